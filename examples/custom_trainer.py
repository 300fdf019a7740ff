"""A custom trainer on the core API: fetch / push per micro-batch, one sync per minibatch.

Each rank runs a *different* number of micro-batches per step (planned by the minibatch-level balancer from
sequence lengths; ``--policy``, default ``lb_mini``), so no per-layer collective could be used. Rank 0 replays
every step in a single process on the union of the data and prints both losses: they agree to float rounding.

    python examples/custom_trainer.py                       # spawns 4 CPU ranks (gloo + host transport)
    torchrun --nproc-per-node 4 examples/custom_trainer.py  # same, launched by torchrun
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import odc_runtime as odc
from odc_runtime import cli
from odc_runtime.balance import POLICIES, CostModel, get_policy, plan
from odc_runtime.launch import gloo_rank, launch
from odc_runtime.workloads import sample_lengths

DIM, HIDDEN = 24, 37  # 24*37 = 888 and 37 elements: neither divides evenly over 4 ranks
MAX_TOKENS = 128  # rows per micro-batch (and the longest sample)
COST = CostModel(a=1.0, b=32.0)  # a toy "attention" term: quadratic cost dominates beyond 32 rows


def init_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(DIM, HIDDEN, generator=g) / DIM**0.5,
        "b1": torch.zeros(HIDDEN),
        "w2": torch.randn(HIDDEN, 1, generator=g) / HIDDEN**0.5,
    }


def make_minibatch(step: int, samples: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Samples of varying length (rows), long-tailed like SFT data; the same on every rank."""
    lengths = sample_lengths("longalign_sft", samples, seed=seed + step, scale=1 / 256, max_len=MAX_TOKENS)
    g = torch.Generator().manual_seed(seed * 1000 + step)
    xs = [torch.randn(n, DIM, generator=g) for n in lengths]
    ys = [x.sum(dim=1, keepdim=True).sin() for x in xs]
    return xs, ys, lengths


def loss_sum(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum of squared errors over the rows (normalised by the global row count outside)."""
    pred = torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return ((pred - y) ** 2).sum()


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    odc.init("host", deterministic=args.deterministic)
    shards = {name: odc.shard(p, name=name) for name, p in init_params(args.seed).items()}
    reference = init_params(args.seed) if rank == 0 else None
    for step in range(args.steps):
        xs, ys, lengths = make_minibatch(step, args.samples, args.seed)
        my_micro_batches = plan(lengths, world, max_tokens=MAX_TOKENS, policy=args.policy, cost=COST)[rank]
        total_rows = sum(lengths)
        for _attempt in range(3):  # --deterministic: a push beyond its tensor's bound makes sync raise on every rank
            try:
                my_loss = accumulate(shards, my_micro_batches, xs, ys, total_rows)
                break
            except odc.OdcOverflowError as e:  # nothing landed and the bound was raised: rerun the same minibatch
                if rank == 0:
                    print(f"step {step:2d}  rerun: {e}", flush=True)
                for st in shards.values():
                    st.zero_grad()
        else:
            raise SystemExit(f"step {step}: the minibatch overflowed the deterministic bound three times")
        with torch.no_grad():
            for st in shards.values():
                st.local.add_(st.grad.to(st.local.dtype), alpha=-args.lr)  # SGD on this rank's shard only
                st.zero_grad()
        odc.sync(gradients=False)  # updated shards are visible to the next fetch; nothing was pushed since
        losses = [None] * world
        dist.all_gather_object(losses, (my_loss, sum(1 for mb in my_micro_batches if mb)))
        if rank == 0:
            ref_loss = reference_step(reference, xs, ys, total_rows, args.lr)
            counts = [c for _, c in losses]
            print(f"step {step:2d}  loss odc {sum(v for v, _ in losses):.6f}  single-process {ref_loss:.6f}  "
                  f"micro-batches per rank {counts}", flush=True)
    for n, st in shards.items():  # the trained parameters equal the single-process ones
        full = odc.fetch(st)
        if rank == 0 and not torch.allclose(full, reference[n], rtol=1e-4, atol=1e-5):
            raise SystemExit(f"parameter {n} differs from the single-process reference")
    if rank == 0:
        print("parameters match the single-process reference", flush=True)
    odc.finalize()


def accumulate(shards: dict, my_micro_batches: list, xs, ys, total_rows: int) -> float:
    """This rank's micro-batches of one minibatch, pushed and synced; returns its loss. Raises OdcOverflowError (on
    every rank, with nothing accumulated) in deterministic mode when a push exceeded its tensor's bound."""
    my_loss = 0.0
    for sample_ids in my_micro_batches:  # the count differs between ranks, zero included
        if not sample_ids:  # an equal-count policy's padding micro-batch: one-sided ODC needs none
            continue
        params = {n: odc.fetch(st).requires_grad_(True) for n, st in shards.items()}
        loss = sum(loss_sum(params, xs[i], ys[i]) for i in sample_ids) / total_rows
        loss.backward()
        for n, st in shards.items():
            odc.push(st, params[n].grad)
        my_loss += float(loss.detach())
    # Every push of this minibatch has landed in its owner's st.grad. No st.local changed since the last sync,
    # so across nodes (init(node_size=...) / ODC_NODE_SIZE) only gradients need to move: parameters=False.
    odc.sync(parameters=False)
    return my_loss


def reference_step(params: dict[str, torch.Tensor], xs, ys, total_rows: int, lr: float) -> float:
    p = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    loss = sum(loss_sum(p, x, y) for x, y in zip(xs, ys, strict=True)) / total_rows
    loss.backward()
    with torch.no_grad():
        for n in params:
            params[n] -= lr * p[n].grad
    return float(loss.detach())


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--nproc", type=int, default=4, help="ranks to spawn when not under torchrun")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=24, help="samples per minibatch (all ranks together)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="bitwise-deterministic accumulation; a minibatch that overflows the bound is rerun")
    whole = [name for name in POLICIES if not get_policy(name).splits]  # split samples need gang attention
    parser.add_argument("--policy", choices=whole, default="lb_mini", help="minibatch balancing policy")
    args = parser.parse_args()
    launch(gloo_rank, args.nproc, train, args)  # in this process under torchrun, else spawned ranks


if __name__ == "__main__":
    main()
