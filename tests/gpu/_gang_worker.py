"""One PE of the gang-attention GPU test (run by tests/gpu/test_gang_gpu.py under torchrun, CUDA MPS for several PEs
on one GPU): the model of tests/test_gang.py, float64 on the GPU, one sample split across the PEs through the
nvshmem transport's signalled puts, checked against the unsplit CPU reference; with activation checkpointing (the
recomputation runs on autograd's device thread); the host synchronisations a gang micro-batch costs; and bf16
attention on SDPA's flash kernel alone."""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _worker
import test_gang as tg

from odc_runtime.gang import GangExchange, gang_attention
from odc_runtime.split import Chunk

LENGTH = 13


def _setup() -> tuple:
    """The exchange, and the model of tests/test_gang.py on this PE's GPU (float64, parameters requiring grad)."""
    device = torch.device("cuda", torch.cuda.current_device())
    ex = GangExchange(num_layers=tg.LAYERS, max_chunk_tokens=LENGTH, kv_features=tg.KV_HEADS * tg.HEAD_DIM,
                      dtype=torch.float64)
    x, layers, readout = tg._weights(LENGTH)
    x = x.to(device).requires_grad_(True)
    layers = [{k: w.to(device).requires_grad_(True) for k, w in layer.items()} for layer in layers]
    return ex, x, layers, readout.to(device)


def scenario_exact(checkpoint: str = "none") -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ex, x, layers, readout = _setup()
    params = [x] + [t for w in layers for t in w.values()]
    chunk = Chunk(0, rank, world, LENGTH, 0, tuple(range(world)))
    for _ in range(2):  # twice: the second gang reuses every slot
        for t in params:
            t.grad = None
        with ex.step(chunk) as step:
            loss = tg._forward(x, layers, readout, step.positions,
                               lambda i, q, k, v: gang_attention(q, k, v, step, i), checkpoint)
        loss.backward()
        flat = torch.cat([loss.detach().view(1)] + [t.grad.reshape(-1) for t in params]).cpu()
        dist.all_reduce(flat)
        ref_loss, ref_grads = tg._reference(LENGTH)
        want = torch.cat([ref_loss.view(1)] + [t.reshape(-1) for t in ref_grads])
        err = float((flat - want).abs().max())
        if err > tg.TOL:
            return {"result": f"rank {rank}: split differs from the unsplit reference by {err}"}
    ex.free()
    return {"result": "ok"}


def scenario_checkpoint() -> dict:
    return scenario_exact("non-reentrant")


def scenario_syncs() -> dict:
    """Host synchronisations inside a gang micro-batch (torch's sync debug mode): one tag check per pass, none per
    layer or peer (every put, wait and copy of the exchange is stream-ordered)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ex, x, layers, readout = _setup()
    step = ex.step(Chunk(0, rank, world, LENGTH, 0, tuple(range(world))))  # its tags: one copy to the device
    counts = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as forward:
            warnings.simplefilter("always")
            with step:
                loss = tg._forward(x, layers, readout, step.positions,
                                   lambda i, q, k, v: gang_attention(q, k, v, step, i))
        with warnings.catch_warnings(record=True) as backward:
            warnings.simplefilter("always")
            loss.backward()
        for name, caught in (("forward", forward), ("backward", backward)):
            counts[name] = [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ex.free()
    if [len(counts["forward"]), len(counts["backward"])] != [1, 1]:
        return {"result": f"rank {rank}: host syncs per pass (want 1 each, the tag check): {counts}"}
    return {"result": "ok"}


def scenario_flash() -> dict:
    """bf16 gang attention (head_dim 64, grouped-query) with SDPA restricted to the flash kernel: it runs (a dense
    mask would find no kernel) and its output and gradients match the unsplit fp32 attention to bf16 accuracy."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    heads, kv_heads, dim, length = 4, 2, 64, 1000
    g = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(h, length, dim, generator=g) for h in (heads, kv_heads, kv_heads, heads))
    ex = GangExchange(num_layers=1, max_chunk_tokens=length, kv_features=kv_heads * dim, dtype=torch.bfloat16)
    chunk = Chunk(0, rank, world, length, 0, tuple(range(world)))
    with ex.step(chunk) as step:
        pos = step.positions
        mine = [t[:, pos.cpu()].to(device, torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = gang_attention(*mine, step, 0)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        (out.float() * w[:, pos.cpu()].to(device)).sum().backward()
    got = []
    for t, full in zip([out, *mine], (w, q, k, v), strict=True):  # each rank's rows, in place, summed over ranks
        rows = torch.zeros_like(full)
        rows[:, pos.cpu()] = (t if t is out else t.grad).detach().float().cpu()
        dist.all_reduce(rows)
        got.append(rows)
    ex.free()
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want_out = torch.nn.functional.scaled_dot_product_attention(
        ref[0], ref[1].repeat_interleave(2, 0), ref[2].repeat_interleave(2, 0), is_causal=True)
    (want_out * w).sum().backward()
    errors = {name: float((a - b).norm() / b.norm())
              for name, a, b in zip(("out", "dq", "dk", "dv"), got, [want_out.detach()] + [t.grad for t in ref],
                                    strict=True)}
    if max(errors.values()) > 2e-2:  # bf16 inputs and flash's bf16 arithmetic: about 4e-3 expected
        return {"result": f"rank {rank}: relative errors against the unsplit fp32 attention {errors}"}
    return {"result": "ok"}


def main() -> None:
    """``argv``: the result file, then scenario names separated by commas, run in order in this one torchrun (each
    frees its exchange); the first failing one is reported."""
    out_path, names = sys.argv[1], sys.argv[2].split(",")

    def scenarios() -> dict:
        for name in names:
            result = globals()[f"scenario_{name}"]()
            if result["result"] != "ok":
                return {**result, "result": f"{name}: {result['result']}"}
        return {"result": "ok"}

    _worker.start(heap_size="256M")
    _worker.run_scenario(out_path, scenarios)


if __name__ == "__main__":
    main()
