"""GRPO-style RL post-training on a Hugging Face causal LM with FSDP2: ODC + ``lb_mini`` vs collectives + ``lb_micro``.

Each step is what an RL framework's actor update does with one batch of rollouts:

1. **Rollouts** (synthetic, no generation): ``--prompts`` prompts, each with a group of ``--group`` responses.
   Prompt ids are uniform random, prompt lengths uniform in [16, 48] tokens. Response ids are uniform random and
   response *lengths* are drawn from ``odc_runtime.workloads``' ``rl_rollouts`` preset (clipped log-normals
   moment-matched to RL rollouts: mean ≈ 6K tokens, tail to 32K) times ``--scale`` (default 1/48), clipped to
   ``--max-response`` tokens: a few responses are many times longer than the median, as in real RL batches.
2. **Rewards** (synthetic, deterministic): the share of a response's tokens whose id is below ``vocab/2`` (a
   stand-in for a verifier). **Advantages** are group-normalised: ``(r - mean(group)) / (std(group) + 1e-6)``,
   one per response, applied to each of its tokens.
3. **Old log-probs**: a forward-only pass over all rollouts (``compute_log_prob`` in veRL terms).
4. **Policy update**: the rollouts are split into ``--mini-batches`` PPO mini-batches, one optimizer step each.
   Loss: PPO-clip surrogate ``-min(ρ·A, clip(ρ, 1-ε, 1+ε)·A)`` per response token, ``ρ = exp(logp - logp_old)``,
   *summed* over the mini-batch's response tokens on every rank and divided by the **global** response-token count
   of the mini-batch (token-mean over all ranks, not a mean of per-rank means), then gradient clipping and AdamW.

The same steps run twice on two copies of the model (same initial weights):

- ``odc``: ``odc_runtime.fsdp.enable(model)``; every pass is planned by ``--policy`` (any registered
  policy that keeps samples whole; default ``lb_mini``: each rank's *total* work
  balanced, micro-batch counts differ between ranks, zero allowed) and runs inside ``odc_runtime.fsdp.minibatch``
  with ``divide_factor`` = the global token count. The forward-only pass is also inside a minibatch: ranks with
  different micro-batch counts must not all-gather collectively.
- ``collective``: stock FSDP2; every pass is planned by ``--collective-policy`` (any registered
  policy with equal counts; default ``lb_micro``: equal counts, each micro-batch step balanced
  as collectives need), ranks short of a micro-batch run a zero-weight dummy one, and each micro-batch's loss is
  scaled by ``world / global tokens`` (FSDP averages gradients over ranks).

Micro-batches pack their sequences into one row (``position_ids`` restart per sequence; HF masks across them), up
to ``--max-tokens`` tokens. Per step and mode it prints the loss, the mean reward, tokens/s (rollout tokens over
the wall time of the log-prob pass and the update), micro-batches per rank (summed over the step's PPO
mini-batches; ``+N padding``: the empty ones collectives need), the idle share the cost model predicts
for the plans (``odc_runtime.balance.imbalance``: a collective schedule waits at every micro-batch step, ODC once per
minibatch) and, for ODC, the measured share of time spent in its syncs. At the end rank 0 replays every step in
one process without FSDP (one sequence at a time) and checks that both modes' losses and final parameters match.

Read the CPU timings with care: the ranks share few cores, so a rank that waits gives its core to the others and
imbalance costs little here (``bench/imbalance.py`` models GPU compute to measure that); and CPU attention over a
packed row computes the whole masked square, while the planner's cost model counts each sequence's own square (as
FlashAttention's variable-length kernels do on GPUs).

    python examples/grpo.py                        # spawns 4 CPU ranks (gloo + ODC's host transport)
    python examples/grpo.py --quick --nproc 2      # 2 small steps (the test)
    torchrun --nproc-per-node 4 examples/grpo.py   # the same under torchrun

Needs the ``hf`` extra (``pip install -e ".[hf]"``); nothing is downloaded (the model is built from a config).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import odc_runtime as odc
import odc_runtime.fsdp as odc_fsdp
from odc_runtime import balance, cli, transport, workloads
from odc_runtime.launch import gloo_rank, launch

CLIP_EPS = 0.2
PROMPT_LENS = (16, 48)

# --------------------------------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace):
    """A small random-init Qwen2 or Llama causal LM (same weights for the same seed)."""
    import transformers

    kw = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=PROMPT_LENS[1] + args.max_response,
        use_cache=False,
    )
    if args.arch == "qwen2":
        config, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = cls(config)
    model.train()
    if args.ac:  # HF's activation checkpointing (the newer name first; both exist in transformers 5.x)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def cost_model(args: argparse.Namespace) -> balance.CostModel:
    return balance.CostModel.from_model_config(
        args.layers,
        args.hidden,
        args.heads,
        args.vocab,
        intermediate_size=args.ffn,
        num_kv_heads=args.kv_heads,
        activation_checkpointing=args.ac,
    )


def make_optimizer(model, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


# --------------------------------------------------------------------------------------------------- rollouts


@dataclass
class Rollout:
    tokens: torch.Tensor  # prompt followed by response, 1-D int64
    prompt_len: int
    reward: float
    advantage: float

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def make_rollouts(step: int, args: argparse.Namespace) -> list[Rollout]:
    """Synthetic rollouts of one step (see the module docstring); the same on every rank for the same step."""
    n = args.prompts * args.group
    seed = args.seed * 1_000_003 + step
    response_lens = workloads.sample_lengths(
        "rl_rollouts", n, seed=seed, scale=args.scale, max_len=args.max_response
    )
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(args.prompts):
        prompt = torch.randint(0, args.vocab, (rng.randint(*PROMPT_LENS),), generator=g)
        group = []
        for j in range(args.group):
            response = torch.randint(0, args.vocab, (response_lens[p * args.group + j],), generator=g)
            reward = float((response < args.vocab // 2).float().mean())
            group.append((torch.cat([prompt, response]), reward))
        rewards = torch.tensor([r for _, r in group], dtype=torch.float64)
        adv = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        out += [Rollout(t, len(prompt), r, float(a)) for (t, r), a in zip(group, adv, strict=True)]
    return out


def mini_batches(rollouts: list[Rollout], k: int) -> list[list[int]]:
    """PPO mini-batches: consecutive slices of the rollout batch (as ``data.split(mini_batch_size)`` does)."""
    n = len(rollouts)
    return [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)]


# --------------------------------------------------------------------------------------------------- losses


def response_logprobs(model, rollouts: list[Rollout]) -> list[torch.Tensor]:
    """Log-probabilities of each rollout's response tokens; the rollouts are packed into one row."""
    ids = torch.cat([r.tokens for r in rollouts]).unsqueeze(0)
    pos = torch.cat([torch.arange(len(r.tokens)) for r in rollouts]).unsqueeze(0)
    logits = model(input_ids=ids, position_ids=pos).logits[0, :-1].float()
    # token_logp[i] = log p(ids[i + 1] | ids[<= i]); never read across a sequence boundary below
    token_logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
    out, start = [], 0
    for r in rollouts:
        out.append(token_logp[start + r.prompt_len - 1 : start + len(r.tokens) - 1])
        start += len(r.tokens)
    return out


def pg_loss_sum(model, rollouts: list[Rollout], old_logps: list[torch.Tensor]) -> torch.Tensor:
    """PPO-clip surrogate summed over the response tokens of ``rollouts`` (normalised by the caller)."""
    new = torch.cat(response_logprobs(model, rollouts))
    old = torch.cat(old_logps)
    adv = torch.cat([torch.full((r.response_len,), r.advantage) for r in rollouts])
    ratio = torch.exp(new - old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv).sum()


# --------------------------------------------------------------------------------------------------- distributed


def dummy_rollout() -> Rollout:
    """What a rank short of micro-batches runs under collectives (its loss is multiplied by 0)."""
    return Rollout(torch.zeros(3, dtype=torch.long), 1, 0.0, 0.0)


def policy_of(mode: str, args: argparse.Namespace) -> str:
    """The balancing policy that plans ``mode``'s passes (``--policy`` / ``--collective-policy``)."""
    return args.policy if mode == "odc" else args.collective_policy


def plan(rollouts: list[Rollout], ids: list[int], mode: str, world: int, args, cost) -> balance.Plan:
    """``result[rank]`` = micro-batches of rollout ids (``[]`` = padding micro-batch under collectives)."""
    p = balance.plan([len(rollouts[i].tokens) for i in ids], world, max_tokens=args.max_tokens,
                     policy=policy_of(mode, args), cost=cost)
    return [[[ids[j] for j in mb] for mb in rank_mbs] for rank_mbs in p]


def plan_idle(p: balance.Plan, rollouts: list[Rollout], mode: str, cost) -> tuple[float, float]:
    """(busy, elapsed) in cost units as the plan predicts: collectives wait per micro-batch step, ODC once."""
    lengths = [len(r.tokens) for r in rollouts]
    imb = balance.imbalance(p, lengths, cost)
    world = len(p)
    return imb.mean_cost * world, (imb.odc_time if mode == "odc" else imb.collective_time) * world


class Trainer:
    """One mode (``odc`` or ``collective``) on this rank: its FSDP2 model, optimizer and per-step records."""

    def __init__(self, mode: str, rank: int, world: int, args: argparse.Namespace) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.mode, self.rank, self.world, self.args = mode, rank, world, args
        self.cost = cost_model(args)
        model = build_model(args)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:  # one FSDP unit per decoder layer, then the root (embeddings, head)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if mode == "odc":
            odc_fsdp.enable(model)
        self.model = model
        self.optimizer = make_optimizer(model, args)
        self.records: list[dict] = []

    def _run(self, my_mbs: list[list[int]], fn) -> None:
        """``fn(mb)`` for this rank's micro-batches; ``mb == []`` is a padding one (run under collectives only)."""
        for mb in my_mbs:
            if mb or self.mode != "odc":  # ODC needs no padding micro-batch
                fn(mb)

    def step(self, step: int, rollouts: list[Rollout]) -> None:
        args, model, odc_mode = self.args, self.model, self.mode == "odc"
        ids = list(range(len(rollouts)))
        plans = [plan(rollouts, ids, self.mode, self.world, args, self.cost)]
        batches = mini_batches(rollouts, args.mini_batches)
        plans += [plan(rollouts, b, self.mode, self.world, args, self.cost) for b in batches]
        dist.barrier()
        t0 = time.perf_counter()
        wait = 0.0

        # 1. old log-probs, forward only; ODC: inside a minibatch, so that unequal counts fetch one-sidedly
        old: dict[int, torch.Tensor] = {}

        def logprob_pass(mb: list[int]) -> None:
            rs = [rollouts[i] for i in mb] if mb else [dummy_rollout()]
            lps = response_logprobs(model, rs)
            if mb:
                old.update(zip(mb, lps, strict=True))

        with torch.no_grad():
            if odc_mode:
                t = time.perf_counter()
                odc_fsdp.begin_minibatch(model)
                wait += time.perf_counter() - t
            self._run(plans[0][self.rank], logprob_pass)
            if odc_mode:
                t = time.perf_counter()
                odc_fsdp.end_minibatch(model)
                wait += time.perf_counter() - t
        self.optimizer.zero_grad(set_to_none=True)  # the forward-only minibatch left zero gradients
        gathered: list[dict] = [None] * self.world  # every rank needs the old log-probs of its update samples
        dist.all_gather_object(gathered, old)
        for part in gathered:
            old.update(part)

        # 2. one optimizer step per PPO mini-batch; token-mean over the *global* response tokens of the mini-batch
        loss_sums = torch.zeros(len(batches), dtype=torch.float64)
        for k, (batch, p) in enumerate(zip(batches, plans[1:], strict=True)):
            tokens = sum(rollouts[i].response_len for i in batch)

            def update(mb: list[int], k=k, tokens=tokens) -> None:
                if mb:
                    loss = pg_loss_sum(model, [rollouts[i] for i in mb], [old[i] for i in mb])
                    loss_sums[k] += float(loss.detach())
                    (loss if odc_mode else loss * (self.world / tokens)).backward()
                else:  # padding micro-batch: takes part in every collective, contributes nothing
                    (pg_loss_sum(model, [dummy_rollout()], [torch.zeros(2)]) * 0.0).backward()

            if odc_mode:
                t = time.perf_counter()
                odc_fsdp.begin_minibatch(model)
                wait += time.perf_counter() - t
            self._run(p[self.rank], update)
            if odc_mode:
                t = time.perf_counter()
                odc_fsdp.end_minibatch(model, divide_factor=tokens)
                wait += time.perf_counter() - t
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss_sums[k] /= tokens
        elapsed = time.perf_counter() - t0

        dist.all_reduce(loss_sums)
        waits = [None] * self.world
        dist.all_gather_object(waits, (wait, elapsed))
        busy_model = elapsed_model = 0.0
        for i, p in enumerate(plans):
            b, e = plan_idle(p, rollouts, self.mode, self.cost)
            weight = 1 / 3 if i == 0 else 1.0  # the log-prob pass is forward only: about a third of fwd + bwd
            busy_model, elapsed_model = busy_model + weight * b, elapsed_model + weight * e
        self.records.append(
            {
                "step": step,
                "loss": float(loss_sums.mean()),
                "reward": sum(r.reward for r in rollouts) / len(rollouts),
                "tokens": sum(len(r.tokens) for r in rollouts),
                "seconds": max(e for _, e in waits),
                "micro_batches": [sum(len([m for m in rank_mbs if m]) for rank_mbs in (q[r] for q in plans[1:]))
                                  for r in range(self.world)],
                "padding": sum(1 for q in plans for rank_mbs in q for m in rank_mbs if not m),
                "idle_model": 1.0 - busy_model / elapsed_model,
                "sync_wait": sum(w for w, _ in waits) / sum(e for _, e in waits) if odc_mode else None,
            }
        )

    def full_parameters(self) -> list[torch.Tensor]:
        return [p.full_tensor().detach().clone() for p in self.model.parameters()]


# --------------------------------------------------------------------------------------------------- replay


def replay(args: argparse.Namespace) -> tuple[list[float], list[torch.Tensor]]:
    """Every step in one process, without FSDP, one sequence at a time: losses and final parameters."""
    model = build_model(args)
    optimizer = make_optimizer(model, args)
    losses = []
    for step in range(args.steps):
        rollouts = make_rollouts(step, args)
        with torch.no_grad():
            old = [response_logprobs(model, [r])[0] for r in rollouts]
        step_losses = []
        for batch in mini_batches(rollouts, args.mini_batches):
            tokens = sum(rollouts[i].response_len for i in batch)
            total = 0.0
            for i in batch:
                loss = pg_loss_sum(model, [rollouts[i]], [old[i]]) / tokens
                loss.backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_losses.append(total)
        losses.append(sum(step_losses) / len(step_losses))
    return losses, [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------------------- main


def _label(mode: str, args: argparse.Namespace) -> str:
    return f"{mode} + {policy_of(mode, args)}"


def _print_step(rec: dict, mode: str, args: argparse.Namespace) -> None:
    label = _label(mode, args)
    extra = f"  sync wait {rec['sync_wait']:5.1%} (measured)" if rec["sync_wait"] is not None else ""
    pad = f" (+{rec['padding']} padding)" if rec["padding"] else ""
    print(
        f"step {rec['step']:2d}  {label:21s} loss {rec['loss']:+.6f}  reward {rec['reward']:.3f}  "
        f"{rec['tokens']:6d} tok {rec['seconds']:6.2f} s {rec['tokens'] / rec['seconds']:7.0f} tok/s  "
        f"micro-batches/rank {rec['micro_batches']}{pad}  idle {rec['idle_model']:5.1%} (cost model){extra}",
        flush=True,
    )


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    odc.init(args.odc_backend)
    trainers = {mode: Trainer(mode, rank, world, args) for mode in ("odc", "collective")}
    if rank == 0:
        n_params = sum(p.numel() for p in trainers["odc"].model.parameters())
        print(
            f"{args.arch} causal LM, {n_params} parameters, {world} ranks; {args.steps} steps of {args.prompts} "
            f"prompts x {args.group} rollouts, {args.mini_batches} PPO mini-batches per step, "
            f"micro-batch cap {args.max_tokens} tokens; ODC on the {odc.backend()} transport",
            flush=True,
        )
    for step in range(args.steps):
        rollouts = make_rollouts(step, args)
        for mode, trainer in trainers.items():
            trainer.step(step, rollouts)
            if rank == 0:
                _print_step(trainer.records[-1], mode, args)
    params = {mode: t.full_parameters() for mode, t in trainers.items()}
    odc_fsdp.disable(trainers["odc"].model)
    odc.finalize()
    if rank != 0:
        return
    summary = {}
    for mode, t in trainers.items():
        steady = t.records[1:] or t.records  # step 0 includes warm-up
        summary[mode] = sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady)
    print(
        f"tokens/s (steps 1..{args.steps - 1}): {_label('odc', args)} {summary['odc']:.0f}, "
        f"{_label('collective', args)} {summary['collective']:.0f} ({summary['odc'] / summary['collective']:.2f}x)",
        flush=True,
    )
    ref_losses, ref_params = replay(args)
    ok = True
    for mode, t in trainers.items():
        losses = [r["loss"] for r in t.records]
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        param_diff = max((a - b).abs().max().item() for a, b in zip(params[mode], ref_params, strict=True))
        good = loss_diff <= args.loss_tol and param_diff <= args.param_tol
        ok &= good
        print(
            f"replay check {mode:10s}: max |loss - replay| {loss_diff:.2e} (tol {args.loss_tol:g}), "
            f"max |param - replay| {param_diff:.2e} (tol {args.param_tol:g}): {'OK' if good else 'MISMATCH'}",
            flush=True,
        )
    if not ok:
        raise SystemExit("the distributed runs do not match the single-process replay")
    print("both modes match the single-process replay", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, first_paragraph=True)
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn when not under torchrun")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="rollouts per prompt (GRPO group size)")
    p.add_argument("--mini-batches", type=int, default=2, help="PPO mini-batches (optimizer steps) per step")
    whole = [name for name in balance.POLICIES if not balance.get_policy(name).splits]  # no gang attention here
    p.add_argument("--policy", choices=whole, default="lb_mini", help="balancing policy of the ODC run")
    p.add_argument("--collective-policy", choices=[n for n in whole if balance.get_policy(n).equal_counts],
                   default="lb_micro", help="balancing policy of the collective run (equal micro-batch counts)")
    p.add_argument("--quick", action="store_true", help="2 steps of 4 prompts (for tests)")
    p.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=172)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ac", action="store_true", help="HF activation checkpointing")
    p.add_argument("--scale", type=float, default=1 / 48, help="multiplies the rl_rollouts preset's lengths")
    p.add_argument("--max-response", type=int, default=448, help="clip response lengths (max_new_tokens)")
    p.add_argument("--max-tokens", type=int, default=512, help="token cap of one micro-batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--odc-backend", default=None, choices=transport.names(),
                   help="the ODC transport (default: ODC_BACKEND, else odc.init's automatic choice)")
    # fp32 throughout; the runs differ from the replay only in summation order. AdamW divides by sqrt(v) + eps,
    # so a gradient element near 0 can turn a rounding difference d into an update difference up to lr·d/eps.
    p.add_argument("--loss-tol", type=float, default=1e-5)
    p.add_argument("--param-tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.prompts = 2, 4
    if args.max_tokens < PROMPT_LENS[1] + args.max_response:
        p.error("--max-tokens must hold the longest rollout (48 + --max-response)")
    return args


def main() -> None:
    args = parse_args()
    cli.require("transformers", "hf", "examples/grpo.py")  # here, not in the ranks: one line, before any launch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: never reach the Hub (ranks too)
    # In this process under torchrun, else spawned ranks; each ends with odc_runtime.launch.exit_process().
    launch(gloo_rank, args.nproc, train, args, exit_after=True)


if __name__ == "__main__":
    main()
