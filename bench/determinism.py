"""Deterministic accumulation (``odc.init(deterministic=True)``): precision of the candidate designs against an fp64
reference on realistic gradients, their memory, and the host cost of the chosen one against the default mode.

* ``precision``: per-micro-batch gradients of a small causal transformer LM (random tokens; ``--ranks`` ranks x
  ``--micro`` micro-batches; the second minibatch is measured, the first one sets the adaptive bounds), summed by
  each candidate and compared with the fp64 sum: fp32 in arrival order (the default mode; several random orders),
  int64 fixed point with a per-tensor bound adapted at the minibatch boundary (the chosen design), the same in a
  tensor's first minibatch (initial bound), one bound for the whole model, and a bound-free binned accumulator.
* ``cost``: each of ``--backends`` (host; symm-cpu: the Triton transport's kernels under the interpreter, for
  correctness only, its figures are the interpreter's) at world 1, ``odc.push`` of 4 KiB and 4 MiB fp32 gradients
  and ``odc.sync``, deterministic vs default, host microseconds per call and push throughput; memory per rank.

    python bench/determinism.py [--ranks 8] [--micro 4] [--runs 5] [--backends host,symm-cpu] [--json PATH]
                                 [--plot none]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if not __package__:  # python bench/determinism.py from a checkout (bench/_checkout.py)
    import _checkout  # noqa: F401

from odc_runtime import cli
from odc_runtime.bench import _common

if TYPE_CHECKING:
    import torch

SIZES = {"4 KiB": 1024, "4 MiB": 1 << 20}


# ----------------------------------------------------------------------------------------------- precision
def _lm_gradients(ranks: int, micro: int, steps: int, seed: int = 0) -> list[list[dict[str, object]]]:
    """``grads[step][k]``: name -> gradient of micro-batch ``k`` (``ranks * micro`` per step) of a small LM."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(seed)
    vocab, dim, seq = 512, 64, 32

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(dim, vocab)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(t.shape[1])
            return self.head(self.body(self.emb(t), mask=mask, is_causal=True))

    model = LM()
    out = []
    for _ in range(steps):
        per = []
        for _ in range(ranks * micro):
            t = torch.randint(0, vocab, (2, seq + 1))
            model.zero_grad()
            logits = model(t[:, :-1])
            # the mean over the minibatch's tokens, as FSDP divides (each micro-batch's share)
            loss = F.cross_entropy(logits.reshape(-1, vocab), t[:, 1:].reshape(-1)) / (ranks * micro)
            loss.backward()
            per.append({n: p.grad.detach().clone().reshape(-1) for n, p in model.named_parameters()})
        out.append(per)
    return out


def _fixed(parts: list, exponent: int, precision: int) -> torch.Tensor:
    import torch

    acc = torch.zeros(parts[0].numel(), dtype=torch.int64)
    for g in parts:
        assert float(g.abs().max()) < math.ldexp(1.0, exponent), "bound exceeded"
        acc += g.mul(math.ldexp(1.0, precision - exponent)).round().to(torch.int64)
    return acc.to(torch.float64).mul(math.ldexp(1.0, exponent - precision)).to(torch.float32)


def precision_table(ranks: int, micro: int, orders: int) -> dict[str, dict[str, float]]:
    import torch

    from odc_runtime import deterministic as det

    steps = _lm_gradients(ranks, micro, 2)
    p = det.fraction_bits(ranks)
    names = list(steps[0][0])

    def seen(step: list, name: str) -> int:
        return max(math.frexp(float(g[name].abs().max()))[1] for g in step)

    previous = {n: seen(steps[0], n) + det.MARGIN_BITS for n in names}
    whole_model = max(previous.values())
    cur = steps[1]
    ref = {n: sum(g[n].double() for g in cur) for n in names}
    gen = torch.Generator().manual_seed(1)
    cands: dict[str, dict[str, torch.Tensor]] = {}
    for o in range(orders):
        perm = torch.randperm(len(cur), generator=gen).tolist()
        fp = {}
        for n in names:
            acc = torch.zeros_like(cur[0][n])
            for k in perm:
                acc += cur[k][n]
            fp[n] = acc
        cands[f"fp32 arrival order #{o + 1}"] = fp
    cands["int64, per-tensor bound (chosen)"] = {n: _fixed([g[n] for g in cur], previous[n], p) for n in names}
    cands["int64, first minibatch (2**4)"] = {n: _fixed([g[n] for g in cur], det.INITIAL_EXPONENT, p) for n in names}
    cands["int64, one bound per model"] = {n: _fixed([g[n] for g in cur], whole_model, p) for n in names}
    cands["binned, bound-free (exact)"] = {n: ref[n].float() for n in names}  # exact sum rounded once to fp32
    memory = {
        "fp32 arrival order #1": 4, "int64, per-tensor bound (chosen)": 12, "int64, first minibatch (2**4)": 12,
        "int64, one bound per model": 12, "binned, bound-free (exact)": 4 + 8 * math.ceil((277 + 23) / 40),
    }
    table = {}
    ref_all = torch.cat([ref[n] for n in names])
    for label, got in cands.items():
        g = torch.cat([got[n].double() for n in names])
        err = (g - ref_all).abs()
        rel = err / ref_all.abs().clamp_min(1e-300)
        big = ref_all.abs() >= 1e-3 * ref_all.abs().max()
        table[label] = {
            "norm_rel_err": float(err.norm() / ref_all.norm()),
            "max_rel_err_large": float(rel[big].max()),
            "median_rel_err": float(rel[ref_all != 0].median()),
            "frac_rel_gt_1e-6": float((rel[ref_all != 0] > 1e-6).double().mean()),
            "bytes_per_elem": float(memory.get(label, 4)),
            "equal_to_order_1": float(torch.equal(g.float(), torch.cat([cands["fp32 arrival order #1"][n]
                                                                         for n in names]))),
        }
    return table


# ----------------------------------------------------------------------------------------------- cost
def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1e3


def cost_table(runs: int, backend: str = "host") -> dict[str, dict[str, float]]:
    import torch

    import odc_runtime as odc

    slow = 100 if backend == "symm-cpu" else 1  # an interpreted launch costs milliseconds: fewer calls
    out: dict[str, dict[str, float]] = {}
    for mode in (False, True):
        odc.init(backend, deterministic=mode)
        try:
            sts = {k: odc.shard(torch.zeros(n), name=k) for k, n in SIZES.items()}
            grads = {k: torch.randn(n) * 1e-3 for k, n in SIZES.items()}
            for k, st in sts.items():  # verify, and let deterministic mode fit its bound to the data
                odc.push(st, grads[k])
                odc.sync()
                if not torch.allclose(st.grad, grads[k], rtol=1e-6, atol=1e-12):
                    raise RuntimeError("push accumulated wrong values")
                st.zero_grad()
            row: dict[str, float] = {}
            for k, st in sts.items():
                calls = max(2, (2000 if SIZES[k] <= 1024 else 20) // slow)
                samples = []
                for _ in range(runs):
                    samples.append(_per_call_us(lambda st=st, g=grads[k]: odc.push(st, g), calls))
                    odc.sync()
                    st.zero_grad()
                us = statistics.median(samples)
                row[f"push {k} us"] = us
                row[f"push {k} GB/s"] = SIZES[k] * 4 / us / 1e3
            for k, st in sts.items():
                odc.push(st, grads[k])
            small, g = sts["4 KiB"], grads["4 KiB"]
            row["sync us"] = statistics.median(
                _per_call_us(lambda small=small, g=g: (odc.push(small, g), odc.sync()), max(5, 50 // slow))
                for _ in range(runs)
            )
            fixed = odc.state.current.fixed
            row["extra bytes/elem"] = 0.0 if fixed is None else fixed.bytes_per_rank() / sum(
                st._grad.numel for st in sts.values())
            out[f"{backend} {'deterministic' if mode else 'default'}"] = row
        finally:
            odc.finalize()
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser(__doc__, first_paragraph=True)
    parser.add_argument("--ranks", type=int, default=8, help="simulated ranks (precision)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per rank (precision)")
    parser.add_argument("--orders", type=int, default=2, help="random arrival orders of the fp32 sum")
    parser.add_argument("--runs", type=int, default=5, help="runs per cost figure (median)")
    parser.add_argument("--backends", type=lambda v: [b for b in v.split(",") if b], default=["host"],
                        help="comma-separated transports of the cost table (host, symm-cpu)")
    _common.add_output_args(parser, "determinism")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    prec = precision_table(args.ranks, args.micro, args.orders)
    cols = ["norm_rel_err", "max_rel_err_large", "median_rel_err", "frac_rel_gt_1e-6", "bytes_per_elem",
            "equal_to_order_1"]
    _common.print_table(
        ["design", *cols], [[k, *(f"{v[c]:.3g}" for c in cols)] for k, v in prec.items()],
        {
            "design": "how the owner sums the pushes of one minibatch",
            "norm_rel_err": "||sum - fp64 sum|| / ||fp64 sum|| over the model",
            "max_rel_err_large": "max relative error over elements >= 1e-3 x the model's largest",
            "median_rel_err": "median relative error over nonzero elements",
            "frac_rel_gt_1e-6": "fraction of nonzero elements with relative error > 1e-6",
            "bytes_per_elem": "accumulator bytes per shard element and rank (fp32 result included)",
            "equal_to_order_1": "1 if bitwise equal to fp32 arrival order #1",
        },
        title=f"precision against fp64 ({args.ranks} ranks x {args.micro} micro-batches, small LM)",
    )
    store = tempfile.mktemp(prefix="odc-determinism-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        cost = {k: v for b in args.backends for k, v in cost_table(args.runs, b).items()}
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)
    ccols = list(next(iter(cost.values())))
    _common.print_table(
        ["mode", *ccols], [[k, *(v[c] for c in ccols)] for k, v in cost.items()],
        {
            "mode": "transport and accumulation mode (world 1; symm-cpu: interpreted kernels, correctness only)",
            **{c: "host microseconds per odc.push of a gradient of that size (median)" for c in ccols if "us" in c
               and "push" in c},
            **{c: "push throughput: gradient bytes per second" for c in ccols if "GB/s" in c},
            "sync us": "host microseconds per push(4 KiB) + sync() (deterministic: three rounds and the conversion)",
            "extra bytes/elem": "symmetric memory the mode adds per shard element (the int64 accumulator)",
        },
        title=f"host cost per call ({args.runs} runs, medians)",
    )
    _common.write_outputs(args, "determinism", {
        "precision": prec, "cost": cost, "machine": _common.machine_info(), "ranks": args.ranks,
        "micro": args.micro, "runs": args.runs,
    }, lambda plots, path: None)


if __name__ == "__main__":
    main()
