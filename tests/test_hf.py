"""Hugging Face ``transformers`` causal LMs under FSDP2 in ODC mode (needs the ``hf`` extra; skipped without it).

Models are built from small Qwen2 and Llama configs (random init, nothing downloaded; ``HF_HUB_OFFLINE=1``),
``fully_shard`` is applied per decoder layer and to the root, as users do it, and activation checkpointing is
HF's own (``gradient_checkpointing_enable``, non-reentrant). Every scenario trains three copies of the same model on
the same global minibatches, in one process group of 3 ranks (gloo, host transport, one torch thread each):

- **ODC**: ``odc_runtime.fsdp.enable``; ranks run *different* numbers of micro-batches, one rank none at all (the
  count pattern changes every step); loss = sum of token losses, ``divide_factor`` = global target tokens.
- **collective**: stock FSDP2 on the same samples planned by ``lb_micro`` (equal counts; a rank short of a
  micro-batch runs a zero-weight dummy one, as collectives require); loss scaled by ``world / global tokens``.
- **reference**: one process, no FSDP, the whole minibatch.

Samples of a micro-batch are packed into one row with ``position_ids`` restarting at 0 (HF builds a
block-diagonal causal mask from them), so no padding is computed.

Tolerances. fp32: the three compute the same sums in different orders, so parameters differ by a few fp32 ulps per
step (|p| < 1, eps = 1.2e-7): 1e-5 absolute leaves a wide margin, while a wrong scale or a lost micro-batch moves
them by more than 1e-3 (each test checks that training moved the parameters by far more than the tolerance).
bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): ODC is compared with a reference that has
FSDP's bf16 semantics (fp32 master weights cast to bf16 for compute, buffers kept fp32, per-micro-batch bf16
gradients summed in fp32) and the *same micro-batch grouping*, so the first step agrees to fp32 rounding and later
steps only differ where an fp32 reordering flips the bf16 rounding of a weight (relative 2^-8): 2e-3 absolute, as
in tests/test_fsdp.py. ODC against collective mode in bf16 groups the samples differently, so every micro-batch
gradient is rounded to bf16 differently (relative 2^-8 = 3.9e-3 of each gradient element, not of the total):
we bound the parameter difference by 5% of the distance the parameters moved (measured: 1-1.5% after 3 SGD steps)
and the losses by 2e-3 relative (measured: up to 3.5e-4). A mistake in scaling or a lost micro-batch changes
the update by a whole micro-batch's share (>10%).
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORLD = 3
STEPS = 3
SAMPLES = 8
VOCAB = 101
FP32_TOL = 1e-5
BF16_REF_TOL = 2e-3
BF16_REL_MOVED = 0.05
# ODC micro-batch counts per step (5 micro-batches per minibatch): unequal, one rank with none in every step.
ODC_COUNTS = [[3, 2, 0], [0, 1, 4], [1, 0, 4]]
SUITE_TIMEOUT = 420


# --------------------------------------------------------------------------------------------------- model, data


def build_model(arch: str, *, seed: int = 0, tie: bool = False, ac: bool = False):
    """A tiny random-init causal LM; dimensions that do not divide by 2, 3 or 4 give uneven FSDP shards."""
    import torch
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=24,
        intermediate_size=43,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    if arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        raise ValueError(arch)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # RMSNorm weights start at 1: perturb so that their gradients are not degenerate
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.train()
    if ac:
        enable_checkpointing(model)
    return model


def enable_checkpointing(model) -> None:
    """HF's activation checkpointing, non-reentrant (newer transformers renamed the call; both exist in 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def shard(model, mp_policy=None):
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, LM head)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def make_steps(seed: int = 1):
    """``steps[s]`` = list of SAMPLES token tensors of lengths 3..40 (long tail); identical on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        lengths = [int(3 + torch.randint(0, 8, (1,), generator=g)) for _ in range(SAMPLES)]
        lengths[int(torch.randint(0, SAMPLES, (1,), generator=g))] = 40  # one long sample per minibatch
        steps.append([torch.randint(0, VOCAB, (n,), generator=g) for n in lengths])
    return steps


# A step's 8 samples grouped into 5 micro-batches (sample indices): the grouping ODC and the reference use.
ODC_GROUPS = [[0, 1], [2, 3], [4, 5], [6], [7]]


def n_targets(samples) -> int:
    return sum(len(s) - 1 for s in samples)


def loss_sum(model, samples):
    """Sum of next-token cross-entropies of ``samples`` packed into one row (position_ids restart per sample)."""
    import torch
    import torch.nn.functional as F

    ids = torch.cat(samples).unsqueeze(0)
    pos = torch.cat([torch.arange(len(s)) for s in samples]).unsqueeze(0)
    logits = model(input_ids=ids, position_ids=pos).logits[0].float()
    keep = torch.ones(ids.shape[1], dtype=torch.bool)
    keep[torch.tensor([len(s) for s in samples]).cumsum(0) - 1] = False  # a sample's last token has no target
    return F.cross_entropy(logits[keep], ids[0].roll(-1)[keep], reduction="sum")


def reference_grads(compute, target, micro_batches, divide) -> float:
    """Run each micro-batch (a list of samples) through ``compute``, sum the gradients in fp32 and set ``target``'s
    (the fp32 master model's) ``.grad`` to that sum over ``divide``; returns the summed loss."""
    import torch

    grads = [torch.zeros_like(q) for q in target.parameters()]
    total = 0.0
    for mb in micro_batches:
        loss = loss_sum(compute, mb)
        loss.backward()
        total += loss.item()
        for g, p in zip(grads, compute.parameters(), strict=True):
            g += p.grad.float()
            p.grad = None
    for g, q in zip(grads, target.parameters(), strict=True):
        q.grad = g / divide
    return total


# --------------------------------------------------------------------------------------------------- scenario


def _full(model):
    return [p.full_tensor().detach().float().clone() for p in model.parameters()]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def scenario(rank: int, world: int, arch: str, bf16: bool, ac: bool, tie: bool) -> dict:
    """ODC (unequal and zero counts) vs collective FSDP2 (equal counts, lb_micro) vs one-process reference."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import odc_runtime as odc
    import odc_runtime.fsdp as odc_fsdp
    from odc_runtime.balance import CostModel, plan

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    odc_model = shard(build_model(arch, tie=tie, ac=ac), mp)
    coll_model = shard(build_model(arch, tie=tie, ac=ac), mp)
    ref = build_model(arch, tie=tie, ac=False)  # fp32 master weights of the reference
    ref_compute = build_model(arch, tie=tie, ac=False)
    if bf16:  # parameters in bf16, buffers (rotary inv_freq) stay fp32, as under FSDP's MixedPrecisionPolicy
        for p in ref_compute.parameters():
            p.data = p.data.to(torch.bfloat16)
    init = [p.detach().clone() for p in ref.parameters()]
    odc_fsdp.enable(odc_model)
    # Count the MLP forwards of the first decoder layer: 2 per micro-batch when checkpointing recomputes it (a
    # pre-hook: the recomputation stops early, once the last saved tensor is rebuilt, before the MLP returns).
    mlp_calls = [0]
    odc_model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.__setitem__(0, mlp_calls[0] + 1))

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    opts = [sgd(odc_model.parameters()), sgd(coll_model.parameters()), sgd(ref.parameters())]
    out: dict[str, list] = {"odc_loss": [], "coll_loss": [], "ref_loss": [], "odc_ref": [], "coll_ref": []}
    out["odc_coll"], out["counts"], out["coll_counts"], out["odc_mb_run"] = [], [], [], 0
    for step, samples in enumerate(make_steps()):
        tokens = n_targets(samples)
        groups = ODC_GROUPS
        counts = ODC_COUNTS[step]
        start = sum(counts[:rank])
        mine = groups[start : start + counts[rank]]
        out["counts"].append(counts)

        # ODC: this rank's micro-batches (any count, zero included); one sync at each end of the minibatch.
        local = torch.zeros(())
        with odc_fsdp.minibatch(odc_model, divide_factor=tokens):
            for mb in mine:
                loss = loss_sum(odc_model, [samples[i] for i in mb])
                loss.backward()
                local += loss.detach()
                out["odc_mb_run"] += 1
        dist.all_reduce(local)
        out["odc_loss"].append(local.item() / tokens)

        # Collective FSDP2: the same samples planned with equal counts; padding micro-batches run a dummy sample.
        lengths = [len(s) for s in samples]
        lb_micro = plan(
            lengths, world, max_tokens=16, policy="lb_micro", cost=CostModel(1.0, 24.0), allow_oversized=True
        )
        out["coll_counts"].append([len(r) for r in lb_micro])
        local = torch.zeros(())
        for mb in lb_micro[rank]:
            if mb:
                loss = loss_sum(coll_model, [samples[i] for i in mb])
                (loss * (world / tokens)).backward()  # FSDP averages over ranks: undo it, divide by global tokens
                local += loss.detach()
            else:
                (loss_sum(coll_model, [torch.zeros(2, dtype=torch.long)]) * 0.0).backward()
        dist.all_reduce(local)
        out["coll_loss"].append(local.item() / tokens)

        # Reference: one process, every micro-batch of the ODC grouping, per-micro-batch grads summed in fp32.
        if bf16:
            with torch.no_grad():
                for p, q in zip(ref_compute.parameters(), ref.parameters(), strict=True):
                    p.copy_(q)  # the bf16 cast FSDP's all-gather input gets
        total = reference_grads(ref_compute if bf16 else ref, ref, [[samples[i] for i in mb] for mb in groups], tokens)
        out["ref_loss"].append(total / tokens)

        for opt in opts:
            opt.step()
            opt.zero_grad()
        a, b = _full(odc_model), _full(coll_model)
        r = [q.detach().float() for q in ref.parameters()]
        out["odc_ref"].append(_max_diff(a, r))
        out["coll_ref"].append(_max_diff(b, r))
        out["odc_coll"].append(_max_diff(a, b))
    out["moved"] = _max_diff([q.detach() for q in ref.parameters()], init)
    out["mlp_calls"] = mlp_calls[0]
    odc_fsdp.disable(odc_model)
    out["odc_alive"] = odc.is_initialized()
    return out


CASES = {
    # key: (arch, bf16, activation checkpointing, tied embeddings)
    "qwen2_fp32": ("qwen2", False, True, False),
    "qwen2_bf16": ("qwen2", True, True, False),
    "llama_fp32": ("llama", False, True, True),
    "llama_bf16": ("llama", True, True, True),
    "llama_fp32_no_ac": ("llama", False, False, False),
}


def suite(rank: int, world: int) -> dict:
    import traceback

    import torch.distributed as dist

    import odc_runtime as odc

    odc.init("host", timeout=120)
    results = {}
    for key, args in CASES.items():
        dist.barrier()
        try:
            results[key] = scenario(rank, world, *args)
        except Exception:
            results[key] = {"__error__": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(suite, WORLD, timeout=SUITE_TIMEOUT - 30, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def _case(results, key) -> list[dict]:
    for rank, res in enumerate(results):
        if "__error__" in res[key]:
            pytest.fail(f"rank {rank} failed in {key}:\n{res[key]['__error__']}")
    return [res[key] for res in results]


# --------------------------------------------------------------------------------------------------- tests


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("key", [k for k, v in CASES.items() if not v[1]])
def test_fp32_odc_unequal_counts_match_collective_and_reference(results, key):
    per_rank = _case(results, key)
    res = per_rank[0]
    assert all(0 in c for c in res["counts"]), "every step must have a rank without micro-batches"
    assert all(len(set(c)) == 1 for c in res["coll_counts"]), "collective mode must run equal counts"
    assert res["moved"] > 100 * FP32_TOL, f"training barely moved the parameters ({res['moved']})"
    for r in per_rank:
        assert max(r["odc_ref"]) < FP32_TOL, r["odc_ref"]
        assert max(r["coll_ref"]) < FP32_TOL, r["coll_ref"]
        assert max(r["odc_coll"]) < FP32_TOL, r["odc_coll"]
        assert r["odc_loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["coll_loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["odc_alive"]
    _check_counts_and_checkpointing(per_rank, ac=CASES[key][2])


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("key", [k for k, v in CASES.items() if v[1]])
def test_bf16_mixed_precision_odc_matches_reference_and_collective(results, key):
    per_rank = _case(results, key)
    res = per_rank[0]
    assert res["moved"] > 10 * BF16_REF_TOL, f"training barely moved the parameters ({res['moved']})"
    for r in per_rank:
        # same grouping as the bf16-semantics reference: first step to fp32 rounding, then bf16 rounding flips
        assert r["odc_loss"][0] == pytest.approx(r["ref_loss"][0], rel=1e-5)
        assert r["odc_ref"][0] < 1e-5, r["odc_ref"]
        assert max(r["odc_ref"]) < BF16_REF_TOL, r["odc_ref"]
        assert r["odc_loss"] == pytest.approx(r["ref_loss"], rel=1e-3)
        # collective mode groups samples differently: each micro-batch gradient rounds to bf16 differently
        assert max(r["odc_coll"]) < BF16_REL_MOVED * res["moved"], (r["odc_coll"], res["moved"])
        assert r["coll_loss"] == pytest.approx(r["odc_loss"], rel=2e-3)
    _check_counts_and_checkpointing(per_rank, ac=CASES[key][2])


def _check_counts_and_checkpointing(per_rank: list[dict], ac: bool) -> None:
    counts = per_rank[0]["counts"]
    for rank, r in enumerate(per_rank):
        ran = sum(c[rank] for c in counts)
        assert r["odc_mb_run"] == ran
        # non-reentrant checkpointing runs each layer's forward again in backward: 2 MLP calls per micro-batch
        assert r["mlp_calls"] == (2 if ac else 1) * ran, (rank, r["mlp_calls"], ran)
