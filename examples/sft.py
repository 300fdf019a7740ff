"""Post-training (SFT) loop with FSDP2, in collective mode or in ODC mode.

A small decoder-only transformer (random init, nothing downloaded) is trained on synthetic sequences whose lengths
follow a long-tailed post-training distribution (``odc_runtime.workloads``). Every step is one minibatch of
``--samples`` sequences, split across ranks and micro-batches by ``odc_runtime.balance.plan``:

- ``--comm collective``: stock FSDP2. Every rank must run the same number of micro-batches (FSDP's all-gather and
  reduce-scatter are collectives), so the default policy is ``lb_micro`` and ranks with fewer micro-batches run
  empty ones (a dummy token with zero loss weight).
- ``--comm odc``: the same FSDP2 model plus ``odc_runtime.fsdp.enable(model)``; each minibatch runs inside
  ``with odc_runtime.fsdp.minibatch(model, divide_factor=global_tokens)``. Ranks run different numbers of
  micro-batches (default policy ``lb_mini``: balance each rank's total work over the minibatch). With
  ``--policy lb_mini_split`` long samples are split into chunks that a gang of ranks runs together, their attention
  exchanging K/V (``odc_runtime.gang``); a sample longer than ``--max-tokens`` is split rather than refused.

Loss normalisation is the same in both modes: the sum of token cross-entropies of the minibatch divided by its
global number of target tokens, so the loss curves agree (up to float summation order).

    python examples/sft.py --comm odc --steps 10            # spawns --nproc ranks itself (default 4 on CPU)
    torchrun --nproc-per-node 4 examples/sft.py --comm collective --steps 10
    torchrun --nproc-per-node 4 examples/sft.py --comm odc --steps 10
    python examples/sft.py --comm odc --mesh 2x2           # HSDP: 2 replicas x 2-rank shard groups
    python examples/sft.py --comm odc --prefetch           # FSDP2's explicit prefetching, any count per rank

``--mesh RxS`` trains with HSDP: a 2-D device mesh ``(replicate, shard)`` of R replicas of S-rank shard groups
(``R * S`` must be the number of ranks; without ``--mesh`` the mesh is 1-D over all ranks). The planning and the
loss normalisation do not change: the plan spans all ``R * S`` ranks (LB-Mini over every rank in ODC mode).

CPU ranks use gloo and ODC's ``host`` backend; with CUDA the same command uses nccl, one GPU per rank, and ODC's
default GPU backend (``nvshmem``). ``--pes-per-gpu K`` lets K consecutive ranks share each GPU (rank r on GPU
r // K; spawned: ``--nproc`` defaults to GPUs x K): NCCL refuses two ranks on one GPU, so torch.distributed then
uses gloo (on the CUDA tensors) and ODC mode the ``nvshmem`` transport (or ``--odc-backend symm``, its heap then
from CUDA IPC), which needs CUDA MPS for several ranks on one GPU (start it first: ``nvidia-cuda-mps-control -d``;
without it ``odc.init`` refuses, saying so):

    python examples/sft.py --comm odc --pes-per-gpu 4       # 4 ranks on one GPU (MPS running)

Logs one line per step (rank 0): loss, tokens/s, the number of non-empty
micro-batches per rank (in collective mode the ranks with fewer also run empty ones, as the log line says), and in
ODC mode what ODC measured on each rank (``odc_runtime.fsdp.stats(model)["last_minibatch"]``): the seconds it
waited in ``odc.sync`` and the MiB it pushed. ``ODC_TRACE_DIR=DIR`` also writes every rank's minibatches there;
``python -m odc_runtime.report DIR`` draws them (docs/seeing-the-imbalance.md).

``--check``: after the run rank 0 replays every step in one process without FSDP (same initial weights, samples and
optimizer, every sample whole and alone in its forward pass, fp32) and compares the run's losses, gradient norms
and final parameters with the replay's (``--loss-tol``, ``--param-tol``); it prints ``replay check <comm> +
<policy>: ... OK`` or exits non-zero on a mismatch. It costs about one more run's compute, on one rank, so it is
off by default:

    python examples/sft.py --policy lb_mini_split --max-len 512 --max-tokens 256 --nproc 2 --steps 2 --check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import odc_runtime as odc
import odc_runtime.fsdp as odc_fsdp
from odc_runtime import balance, cli, config, gang, split, workloads
from odc_runtime import transport as transports
from odc_runtime.errors import OdcError

# --------------------------------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block; attention runs per packed sequence (varlen), the rest on the packed rows."""

    def __init__(self, dim: int, heads: int, ffn: int, index: int = 0) -> None:
        super().__init__()
        self.heads = heads
        self.index = index  # layer number: the gang exchange of a split sample is per layer
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(t, 3, self.heads, d // self.heads).permute(1, 2, 0, 3)
        step = gang.active_step()
        if step is not None:  # a chunk of a split sample (lb_mini_split): attend over the gang's whole sequence
            a = gang.gang_attention(q, k, v, step, self.index).transpose(0, 1).reshape(t, d)
            x = x + self.proj(a)
            return x + self.down(F.gelu(self.up(self.ln2(x))))
        outs, start = [], 0
        for n in seqlens:  # causal attention inside each sequence only (cost quadratic per sequence)
            s = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(q[:, s], k[:, s], v[:, s], is_causal=True))
            start += n
        a = torch.cat(outs, dim=1).transpose(0, 1).reshape(t, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class DecoderLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, ffn: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn, i) for i in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, seqlens: list[int], positions: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens``: 1-D packed sequences of lengths ``seqlens``; returns logits ``[len(tokens), vocab]``.
        ``positions``: the tokens' positions when they are a chunk of a split sample (global positions)."""
        if positions is None:
            positions = torch.cat([torch.arange(n, device=tokens.device) for n in seqlens])
        pos = positions
        x = self.emb(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x, seqlens)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------------------------------- data


def make_sequence(step: int, index: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """A learnable synthetic sample: a fixed random successor rule over the vocabulary (the "language"), with 10%
    of the tokens replaced by noise. Deterministic in (seed, step, index), so every rank can build any sample."""
    successor = list(range(vocab))
    random.Random(seed).shuffle(successor)
    rng = random.Random((seed * 1_000_003 + step) * 1_000_003 + index)
    tokens = [rng.randrange(vocab)]
    for _ in range(length - 1):
        tokens.append(rng.randrange(vocab) if rng.random() < 0.1 else successor[tokens[-1]])
    return torch.tensor(tokens, dtype=torch.long)


def step_lengths(args: argparse.Namespace, step: int) -> list[int]:
    """Sample lengths of minibatch ``step`` (every rank and the replay draw the same)."""
    lengths = workloads.sample_lengths(
        args.preset, args.samples, seed=args.seed * 100003 + step, max_len=args.max_len, scale=args.scale
    )
    return [max(2, n) for n in lengths]  # a sample needs at least one target


def build_model(args: argparse.Namespace, device: torch.device) -> DecoderLM:
    """The model with the run's initial weights (seeded: the same on every rank and in the replay)."""
    torch.manual_seed(args.seed)
    return DecoderLM(args.vocab, args.dim, args.heads, args.ffn, args.layers, args.max_len).to(device)


def chunk_loss(model: nn.Module, sample: torch.Tensor, chunk: split.Chunk, device: torch.device) -> torch.Tensor:
    """Sum of next-token cross-entropies of a split sample's chunk (global positions; the sample's last token has
    no target), run in its gang step."""
    positions = torch.tensor(chunk.positions(), device=device)
    sample = sample.to(device)
    targets = torch.cat([sample[1:], sample.new_full((1,), -100)])[positions]
    logits = model(sample[positions], [len(positions)], positions)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def micro_batch_loss(model: nn.Module, samples: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over the packed samples, and the number of targets."""
    tokens = torch.cat(samples).to(device)
    seqlens = [len(s) for s in samples]
    logits = model(tokens, seqlens)
    keep = torch.ones(len(tokens), dtype=torch.bool, device=device)
    ends = torch.tensor(seqlens, device=device).cumsum(0) - 1
    keep[ends] = False  # the last token of a sequence has no target
    targets = torch.roll(tokens, -1)
    loss = F.cross_entropy(logits[keep].float(), targets[keep], reduction="sum")
    return loss, int(keep.sum())


# --------------------------------------------------------------------------------------------------- main


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its torch device, the torch.distributed backend and the ODC transport."""

    device: str  # "cpu" or "cuda:<index>"
    dist_backend: str  # "gloo" or "nccl"
    odc_backend: str | None  # odc.init's backend (None: its automatic choice)


def placement(*, cuda_devices: int, local_rank: int, local_world: int, pes_per_gpu: int = 1,
              odc_backend: str | None = None) -> Placement:
    """The device and backends of local rank ``local_rank`` of ``local_world`` ranks on a node with
    ``cuda_devices`` visible GPUs (0: CPU), ``pes_per_gpu`` ranks per GPU. A pure function.

    One rank per GPU: nccl. Several (``pes_per_gpu > 1``): rank r on GPU r // pes_per_gpu, gloo (NCCL refuses two
    ranks on one GPU) and a GPU transport for ODC (``nvshmem`` unless another CUDA one is named). Raises
    ``ValueError`` saying what to change when the ranks do not fit the visible devices."""
    if pes_per_gpu < 1:
        raise ValueError(f"--pes-per-gpu must be at least 1, got {pes_per_gpu}")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} outside the {local_world} ranks of this node")
    if cuda_devices == 0:
        if pes_per_gpu > 1:
            raise ValueError(f"--pes-per-gpu {pes_per_gpu} shares GPUs between ranks, but no CUDA GPU is visible "
                             "(drop the flag to train on the CPU)")
        return Placement("cpu", "gloo", odc_backend)
    need = -(-local_world // pes_per_gpu)
    if need > cuda_devices:
        hint = (f"pass --pes-per-gpu {-(-local_world // cuda_devices)} to let ranks share GPUs (CUDA MPS needed "
                "in ODC mode)" if pes_per_gpu == 1 else "raise --pes-per-gpu or start fewer ranks")
        raise ValueError(f"{local_world} ranks on this node at {pes_per_gpu} per GPU need {need} GPUs, but "
                         f"{cuda_devices} are visible: {hint}")
    device = f"cuda:{local_rank // pes_per_gpu}"
    if pes_per_gpu == 1:
        return Placement(device, "nccl", odc_backend)
    name = odc_backend or "nvshmem"
    try:
        kind = transports.get(name).device_type
    except OdcError as e:
        raise ValueError(str(e)) from None
    if kind != "cuda":
        raise ValueError(f"--pes-per-gpu {pes_per_gpu}: ODC's {name!r} transport works on {kind} tensors; ranks "
                         "sharing a GPU need a GPU transport (--odc-backend nvshmem or symm, under CUDA MPS)")
    return Placement(device, "gloo", name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, first_paragraph=True)
    p.add_argument("--comm", choices=("collective", "odc"), default="odc")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", choices=balance.POLICIES, default=None, help="default: lb_mini (odc), lb_micro")
    p.add_argument("--preset", choices=sorted(workloads.PRESETS), default="longalign_sft")
    p.add_argument("--scale", type=float, default=1 / 32, help="multiplies the preset's lengths (CPU-sized)")
    p.add_argument("--max-len", type=int, default=1024, help="clip sample lengths to this many tokens")
    p.add_argument("--samples", type=int, default=32, help="sequences per minibatch (optimizer step)")
    p.add_argument("--max-tokens", type=int, default=1024, help="token cap of one micro-batch")
    p.add_argument("--max-gang-size", type=int, default=None,
                   help="lb_mini_split: the most ranks one sample is split across (default: every rank); the gang "
                        "exchange's memory grows with it")
    p.add_argument("--vocab", type=int, default=509)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=347)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="FSDP2's explicit prefetching: model.unshard() at the start of every minibatch (on every "
        "rank, also one without micro-batches) and set_modules_to_forward/backward_prefetch between the blocks",
    )
    p.add_argument(
        "--mesh",
        default=None,
        metavar="RxS",
        help="HSDP: a 2-D (replicate, shard) mesh of R replicas x S shard ranks, e.g. 2x2 (default: 1-D)",
    )
    p.add_argument("--odc-backend", default=None, choices=transports.names(),
                   help="the ODC transport (default: ODC_BACKEND, else odc.init's automatic choice)")
    p.add_argument(
        "--pes-per-gpu",
        type=int,
        default=1,
        metavar="K",
        help="ranks sharing each GPU (rank r on GPU r // K): gloo instead of nccl, ODC on nvshmem (needs CUDA MPS)",
    )
    p.add_argument("--json", default=None, help="write per-step records to this file (rank 0)")
    p.add_argument("--check", action="store_true",
                   help="rank 0 replays the run in one process (no FSDP, samples whole, fp32) and compares losses,\n"
                   "gradient norms and final parameters; exits non-zero on a mismatch")
    # fp32: the run differs from the replay only in summation order (packing, splitting, FSDP's reductions), so
    # the first step's loss and gradient norm agree to a few ulps; later steps start from parameters that differ by
    # that rounding, so the difference grows with the steps (measured: 2e-7 after 2 steps, 2e-5 after the 10
    # default ones): 1e-4. AdamW divides each gradient element by its own magnitude, so an element whose gradient
    # is near its rounding noise (a few in 10^5, measured) can move by a fraction of lr per step whatever the
    # gradient's scale: the parameters are compared to lr / 10 (measured: at most 1.3e-4 at lr 1e-2, median 4e-9).
    # A lost sample, chunk or dK/dV moves many elements by ~lr and the losses by far more than 1e-4; a wrong gradient
    # scale, which AdamW would hide, shows in the gradient norms.
    p.add_argument("--loss-tol", type=float, default=1e-4,
                   help="--check: max |loss - replay| and |grad_norm / replay - 1| per step")
    p.add_argument("--param-tol", type=float, default=None,
                   help="--check: max |parameter - replay| at the end (default: --lr / 10)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to spawn when not launched by torchrun (default on CPU: R*S with --mesh, else 4; with "
        "CUDA: GPUs x --pes-per-gpu)",
    )
    args = p.parse_args(argv)
    if args.pes_per_gpu < 1:
        p.error(f"--pes-per-gpu must be at least 1, got {args.pes_per_gpu}")
    args.mesh_shape = None
    if args.mesh is not None:
        m = re.fullmatch(r"(\d+)x(\d+)", args.mesh)
        if m is None or int(m[1]) < 1 or int(m[2]) < 2:
            p.error(f"--mesh must be RxS with R >= 1 replicas and S >= 2 shard ranks (e.g. 2x2), got {args.mesh!r}")
        args.mesh_shape = (int(m[1]), int(m[2]))
    if args.policy is None:
        args.policy = "lb_mini" if args.comm == "odc" else "lb_micro"
    if args.param_tol is None:
        args.param_tol = args.lr / 10
    if args.check and args.bf16:
        p.error("--check compares with an fp32 replay: drop --bf16")
    if balance.get_policy(args.policy).splits and args.comm != "odc":
        p.error(f"--policy {args.policy} splits samples across gangs of ranks, which only --comm odc can run")
    return args


def train(args: argparse.Namespace) -> None:
    """One rank of the job (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` in the environment)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    try:
        place = rank_placement(args, int(os.environ.get("LOCAL_RANK", 0)), local_world)
    except ValueError as e:
        raise SystemExit(f"examples/sft.py: {e}") from None
    device = torch.device(place.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if place.dist_backend == "nccl":
        dist.init_process_group("nccl", device_id=device)
    else:  # CPU ranks, or ranks sharing a GPU (gloo on CUDA tensors)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build_model(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.mesh_shape is None:
        mesh = init_device_mesh(device.type, (world,))
    else:  # HSDP: shard inside each replica, replicate across them
        if args.mesh_shape[0] * args.mesh_shape[1] != world:
            raise SystemExit(f"--mesh {args.mesh} needs {args.mesh_shape[0] * args.mesh_shape[1]} ranks, got {world}")
        mesh = init_device_mesh(device.type, args.mesh_shape, mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    if args.prefetch:  # each block gathers the next one's parameters before it runs (backward: the previous one)
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - 1) : i])
    if args.comm == "odc":
        odc.init(place.odc_backend)
        odc_fsdp.enable(model)
    exchange = None
    if balance.get_policy(args.policy).splits:  # K/V exchange of split samples (odc_runtime.gang)
        kv_dtype = torch.bfloat16 if args.bf16 else torch.float32
        exchange = gang.GangExchange(num_layers=args.layers, max_chunk_tokens=args.max_tokens, kv_features=args.dim,
                                     dtype=kv_dtype, max_gang_size=args.max_gang_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    if rank == 0:
        print(
            f"comm={args.comm} policy={args.policy} world={world} mesh={args.mesh or world} device={device.type} "
            f"dist={place.dist_backend} odc_backend={odc.backend() if odc.is_initialized() else '-'} "
            f"pes_per_gpu={args.pes_per_gpu} "
            f"params={n_params} "
            f"preset={args.preset} scale={args.scale:g} samples/step={args.samples} max_tokens={args.max_tokens}",
            flush=True,
        )
    records = []
    for step in range(args.steps):
        lengths = step_lengths(args, step)
        plan = balance.plan(lengths, world, max_tokens=args.max_tokens, policy=args.policy,
                            max_gang_size=args.max_gang_size)
        global_targets = sum(n - 1 for n in lengths)
        mine = plan[rank]
        if args.comm == "collective":  # collectives need the same micro-batch count everywhere
            depth = max(len(r) for r in plan)
            mine = mine + [[] for _ in range(depth - len(mine))]

        # the data loader's job: build this rank's samples before the timed region
        # (a chunk of a split sample comes with its whole sample: (chunk, tokens))
        batches = [
            [(mb[0], make_sequence(step, mb[0].sample, mb[0].length, args.vocab, args.seed))]
            if mb and isinstance(mb[0], split.Chunk)
            else [make_sequence(step, i, lengths[i], args.vocab, args.seed) for i in mb]
            for mb in mine
        ]

        dist.barrier()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        if args.comm == "odc":
            with odc_fsdp.minibatch(model, divide_factor=global_targets):
                if args.prefetch:  # a rank that runs no forward keeps it unsharded: end_minibatch reshards it
                    model.unshard()
                for samples in batches:
                    if not samples:  # a planner's padding micro-batch: ODC has no need to run it
                        continue
                    if isinstance(samples[0], tuple):  # (chunk, whole sample): this rank's part of a gang
                        chunk, sample = samples[0]
                        with exchange.step(chunk):
                            loss = chunk_loss(model, sample, chunk, device)
                    else:
                        loss, _ = micro_batch_loss(model, samples, device)
                    loss.backward()
                    loss_sum += loss.detach()
        else:
            if args.prefetch:
                model.unshard()
            for samples in batches:
                if samples:
                    loss, _ = micro_batch_loss(model, samples, device)
                    weight = world / global_targets  # FSDP (HSDP too) averages over all ranks: undo it, / global tokens
                else:  # padding micro-batch: take part in the collectives, contribute nothing
                    loss, _ = micro_batch_loss(model, [torch.zeros(2, dtype=torch.long)], device)
                    weight = 0.0
                (loss * weight).backward()
                loss_sum += loss.detach() * (weight != 0)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0

        dist.all_reduce(loss_sum)
        odc_line = ""
        if args.comm == "odc":  # what ODC measured on each rank in this minibatch (odc_runtime.telemetry)
            last = odc_fsdp.stats(model)["last_minibatch"]
            mine_figures = torch.tensor([last["sync_wait_s"], last["push_bytes"], last["micro_batches"]],
                                        dtype=torch.float64, device=device)
            figures = [torch.empty_like(mine_figures) for _ in range(world)]
            dist.all_gather(figures, mine_figures)
            waits, pushed, ran = zip(*(f.tolist() for f in figures), strict=True)
            odc_line = (f"  sync wait s/rank [{' '.join(f'{w:.2f}' for w in waits)}]  push MiB/rank "
                        f"[{' '.join(f'{b / 2**20:.1f}' for b in pushed)}]")
        counts = [len([mb for mb in r if mb]) for r in plan]  # non-empty ones (a gang's chunk counts on each member)
        padded = ""
        if args.comm == "collective" and len(set(counts)) > 1:  # the collectives made every rank run as many
            padded = f" (+ empty ones: every rank runs {max(len(r) for r in plan)})"
        rec = {
            "step": step,
            "loss": loss_sum.item() / global_targets,
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "tokens": sum(lengths),
            "seconds": dt,
            "tokens_per_s": sum(lengths) / dt,
            "micro_batches": counts,
        }
        if odc_line:  # ODC's own figures, per rank: seconds waited in sync, bytes pushed, backward passes run
            rec.update(odc_sync_wait_s=list(waits), odc_push_bytes=[int(b) for b in pushed],
                       odc_micro_batches=[int(n) for n in ran])
        records.append(rec)
        if rank == 0:
            print(
                f"step {step:3d}  loss {rec['loss']:.5f}  grad_norm {rec['grad_norm']:.4f}  "
                f"tokens {rec['tokens']:6d}  {dt:6.2f}s  {rec['tokens_per_s']:8.0f} tok/s  "
                f"micro-batches/rank {counts}{padded}{odc_line}",
                flush=True,
            )
    if rank == 0:
        steady = records[1:] or records
        tps = sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady)
        print(f"mean tokens/s (steps 1..{args.steps - 1}): {tps:.0f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "records": records, "tokens_per_s": tps}, f, indent=1)
    final = [p.full_tensor().detach().clone() for p in model.parameters()] if args.check else None  # collective
    if exchange is not None:
        exchange.free()
    if args.comm == "odc":
        odc_fsdp.disable(model)
        odc.finalize()
    dist.destroy_process_group()
    if args.check and rank == 0:
        replay_check(args, records, final, device)


# --------------------------------------------------------------------------------------------------- replay


def replay(args: argparse.Namespace, device: torch.device) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """Every step in one process without FSDP: each sample whole, alone in its forward pass, its loss sum divided
    by the minibatch's target count; the run's clipping and optimizer. Returns the losses, the gradient norms
    (before clipping) and the final parameters."""
    model = build_model(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, norms = [], []
    for step in range(args.steps):
        lengths = step_lengths(args, step)
        global_targets = sum(n - 1 for n in lengths)
        total = 0.0
        for i, n in enumerate(lengths):
            loss, _ = micro_batch_loss(model, [make_sequence(step, i, n, args.vocab, args.seed)], device)
            (loss / global_targets).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / global_targets)
    return losses, norms, [p.detach() for p in model.parameters()]


def replay_check(args: argparse.Namespace, records: list[dict], params: list[torch.Tensor],
                 device: torch.device) -> None:
    """Compare the run's per-step losses and gradient norms (relative: ``--loss-tol``) and its final parameters
    (``--param-tol``) with :func:`replay`'s; ``SystemExit`` on a mismatch."""
    ref_losses, ref_norms, ref_params = replay(args, device)
    loss_diff = max(abs(r["loss"] - b) for r, b in zip(records, ref_losses, strict=True))
    norm_diff = max(abs(r["grad_norm"] / b - 1) for r, b in zip(records, ref_norms, strict=True))
    param_diff = max((a - b).abs().max().item() for a, b in zip(params, ref_params, strict=True))
    good = loss_diff <= args.loss_tol and norm_diff <= args.loss_tol and param_diff <= args.param_tol
    print(
        f"replay check {args.comm} + {args.policy}: max |loss - replay| {loss_diff:.2e}, max |grad_norm / replay "
        f"- 1| {norm_diff:.2e} (tol {args.loss_tol:g}), max |param - replay| {param_diff:.2e} (tol "
        f"{args.param_tol:g}): {'OK' if good else 'MISMATCH'}",
        flush=True,
    )
    if not good:
        raise SystemExit("examples/sft.py: the distributed run does not match the single-process replay")


def rank_placement(args: argparse.Namespace, local_rank: int, local_world: int) -> Placement:
    """:func:`placement` for this machine's visible GPUs and the parsed arguments (``ODC_BACKEND`` when no
    ``--odc-backend``; collective mode runs no ODC transport, so none is checked)."""
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = config.backend_name(args.odc_backend) if args.comm == "odc" else None
    return placement(cuda_devices=cuda_devices, local_rank=local_rank, local_world=local_world,
                     pes_per_gpu=args.pes_per_gpu, odc_backend=backend)


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    train(args)
    _finish()


def _finish() -> None:
    """End this rank's process after a clean shutdown, skipping C++ static destructors at interpreter exit: with
    torch 2.14.1's CUDA wheels, about one FSDP2 + gloo run in ten aborts there ("terminate called without an active
    exception"; reproduced with plain FSDP2 and no odc_runtime), which would turn a finished run into a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:  # launched by torchrun (or another launcher that sets the rank environment)
        train(args)
        _finish()
    default = args.mesh_shape[0] * args.mesh_shape[1] if args.mesh_shape else 4
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = args.nproc or (gpus * args.pes_per_gpu if gpus else default)
    if nproc < 1:
        raise SystemExit(f"--nproc must be at least 1, got {nproc}")
    try:  # the ranks must fit the visible devices: say so once, before spawning them
        rank_placement(args, 0, nproc)
    except ValueError as e:
        raise SystemExit(f"examples/sft.py: {e}") from None
    if args.mesh_shape and nproc != args.mesh_shape[0] * args.mesh_shape[1]:
        need = args.mesh_shape[0] * args.mesh_shape[1]
        raise SystemExit(f"--mesh {args.mesh} needs {need} ranks, got --nproc {nproc}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(nproc, port, args), nprocs=nproc)


if __name__ == "__main__":
    main()
