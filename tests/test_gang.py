"""Gang attention (odc_runtime.gang) on the host transport: a split sample's loss and gradients equal the unsplit
computation's; gangs sharing a rank; a member that leaves or runs another plan is a typed error, not a hang.

The model is two causal self-attention layers (the second attends over the first's output, so dK/dV of layer 1
flow back through layer 0's exchange) with a weighted-sum loss; the reference runs the whole sequence in one
process. float64 (K/V exchanged in float64): the split computes the same sums in a different order (softmax over the
gathered rows, dK/dV summed over members), so the results agree to a few ulps of values up to ~30; 1e-10 is far
below what a lost contribution or a wrong position changes (order 1e-1, see the negative control below)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_ranks

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8, 4, 2, 2, 2
TOL = 1e-10


def _weights(length: int):
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(length, HIDDEN, generator=g, dtype=torch.float64)
    layers = [
        {name: torch.randn(HIDDEN, rows * HEAD_DIM, generator=g, dtype=torch.float64) * 0.5
         for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS), ("o", HEADS))}
        for _ in range(LAYERS)
    ]
    layers = [{**w, "o": w["o"].T.contiguous()} for w in layers]  # o: (heads·head_dim) -> hidden
    readout = torch.randn(length, HIDDEN, generator=g, dtype=torch.float64)
    return x, layers, readout


def _forward(x, layers, readout, positions, attend, checkpoint: str = "none"):
    """The model on the tokens at ``positions``; ``attend(layer, q, k, v)`` is the attention. ``checkpoint``:
    ``"none"``, or torch.utils.checkpoint per layer, ``"reentrant"`` or ``"non-reentrant"``."""
    import torch.utils.checkpoint

    h = x[positions]
    for i, w in enumerate(layers):
        if checkpoint == "none":
            h = _layer(h, i, attend, *w.values())
        else:
            h = torch.utils.checkpoint.checkpoint(_layer, h, i, attend, *w.values(),
                                                  use_reentrant=checkpoint == "reentrant")
    return (h * readout[positions]).sum()


def _layer(h, i, attend, wq, wk, wv, wo):
    n = h.shape[0]
    q = (h @ wq).view(n, HEADS, HEAD_DIM).transpose(0, 1)
    k = (h @ wk).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = (h @ wv).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
    return h + attend(i, q, k, v).transpose(0, 1).reshape(n, HEADS * HEAD_DIM) @ wo


def _reference(length: int):
    import torch

    x, layers, readout = _weights(length)
    params = [x] + [t for w in layers for t in w.values()]
    for t in params:
        t.requires_grad_(True)

    def attend(_i, q, k, v):
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    loss = _forward(x, layers, readout, torch.arange(length), attend)
    loss.backward()
    return loss.detach(), [t.grad for t in params]


def _run_chunk(exchange, chunk, checkpoint: str = "none"):
    from odc_runtime.gang import gang_attention

    x, layers, readout = _weights(chunk.length)
    params = [x] + [t for w in layers for t in w.values()]
    for t in params:
        t.requires_grad_(True)
    with exchange.step(chunk) as step:
        loss = _forward(x, layers, readout, step.positions, lambda i, q, k, v: gang_attention(q, k, v, step, i),
                        checkpoint)
    loss.backward()
    return loss.detach(), [t.grad for t in params]


def _gangs_rank(rank: int, world: int, gangs: list[tuple[int, int, tuple[int, ...]]], depth: int = 2,
                checkpoint: str = "none", max_gang_size: int | None = None):
    """Run every gang (sample length, parts, ranks) this rank belongs to, in gang order; per gang, the loss and
    gradients summed over the members (all_reduce over the world, zeros from non-members)."""
    import torch
    import torch.distributed as dist

    import odc_runtime as odc
    from odc_runtime.gang import GangExchange
    from odc_runtime.split import Chunk

    odc.init("host")
    longest = max(length for length, _, _ in gangs)
    ex = GangExchange(num_layers=LAYERS, max_chunk_tokens=longest, kv_features=KV_HEADS * HEAD_DIM,
                      dtype=torch.float64, depth=depth, max_gang_size=max_gang_size)
    results = []
    for g, (length, parts, ranks) in enumerate(gangs):
        if rank in ranks:
            loss, grads = _run_chunk(ex, Chunk(g, ranks.index(rank), parts, length, g, ranks), checkpoint)
        else:
            x, layers, _ = _weights(length)
            loss = torch.zeros((), dtype=torch.float64)
            grads = [torch.zeros_like(t) for t in [x] + [t for w in layers for t in w.values()]]
        results.append((loss, grads))
    out = []
    for loss, grads in results:  # the sums, after every gang ran (no collective between gangs)
        flat = torch.cat([loss.view(1)] + [t.reshape(-1) for t in grads])
        dist.all_reduce(flat)
        out.append(flat.tolist())  # plain floats: tensors do not survive the result queue
    ex.free()
    return out


def _check_against_reference(results: list, gangs: list) -> None:
    import torch

    for g, (length, _, _) in enumerate(gangs):
        loss, grads = _reference(length)
        want = torch.cat([loss.view(1)] + [t.reshape(-1) for t in grads])
        for per_rank in results:  # every rank holds the same sums
            flat = torch.tensor(per_rank[g], dtype=torch.float64)
            assert torch.allclose(flat, want, atol=TOL, rtol=TOL), (g, (flat - want).abs().max())
        assert want.abs().max() > 1.0  # the tolerance is small against the values


@pytest.mark.parametrize(("world", "gangs", "depth"), [
    (2, [(13, 2, (0, 1))], 2),  # 13 tokens: chunks of 6 and 7, uneven pieces; a slot per layer
    (3, [(17, 3, (0, 1, 2))], 1),  # one slot per peer: reused at every layer, after the peer's credit
])
def test_split_sample_equals_unsplit(world: int, gangs: list, depth: int) -> None:
    _check_against_reference(run_ranks(_gangs_rank, world, gangs, depth, timeout=100), gangs)


def test_gangs_sharing_a_rank_run_in_order_without_deadlock() -> None:
    # Rank 1 is in every gang; rank 2 reaches gang 1 first and waits for rank 1 to finish gang 0; ranks 0 and 1
    # meet again in gang 2, reusing their one slot per peer (depth 1) under credits.
    gangs = [(12, 2, (0, 1)), (10, 2, (1, 2)), (9, 2, (0, 1))]
    _check_against_reference(run_ranks(_gangs_rank, 3, gangs, 1, timeout=100), gangs)


def test_a_ring_serves_the_senders_of_successive_gangs() -> None:
    # max_gang_size 2: every receiver has one ring (depth 1: one slot), used by rank 0 then rank 2 at rank 1, and
    # checkpointing makes the backward passes exchange twice per layer. Rank 2 reaches gang 1 while rank 1 is still
    # in gang 0: only rank 1's join lets it write (without the join wait this fails at the tag check).
    gangs = [(12, 2, (0, 1)), (10, 2, (1, 2)), (9, 2, (0, 1)), (11, 2, (2, 1))]
    _check_against_reference(run_ranks(_gangs_rank, 3, gangs, 1, "non-reentrant", 2, timeout=100), gangs)


def _sizes_rank(rank: int, world: int) -> tuple[int, str]:

    import odc_runtime as odc
    from odc_runtime.errors import OdcUsageError
    from odc_runtime.gang import GangExchange
    from odc_runtime.split import Chunk

    odc.init("host")
    ex = GangExchange(num_layers=2, max_chunk_tokens=16, kv_features=4, depth=1, max_gang_size=2)
    try:
        ex.step(Chunk(0, rank, 3, 12, 0, (0, 1, 2)))
    except OdcUsageError as e:
        return ex.nbytes, str(e)
    finally:
        ex.free()
    return ex.nbytes, "no error"


def test_memory_grows_with_the_largest_gang_and_a_larger_gang_is_refused() -> None:
    for nbytes, message in run_ranks(_sizes_rank, 3, timeout=60):
        slot = 2 * 16 * 4 * 4  # K and V of a chunk, fp32
        tag = 6 + 2  # gang, sample, length, layer, pass, part, and the members (up to max_gang_size)
        words = (tag + 2 * 3 + tag + 1 + 3 * 3) * 8  # tags, acks, stage words, signal
        assert nbytes == (1 * 1 + 1) * slot + words  # one ring of one slot, and the stage
        assert "split across 3 ranks, more than the exchange's max_gang_size=2" in message


@pytest.mark.parametrize("checkpoint", ["non-reentrant", "reentrant"])
def test_activation_checkpointing_recomputes_the_exchange(checkpoint: str) -> None:
    # Every layer checkpointed: the backward pass runs each layer's forward again, outside the `with step:` block,
    # and the recomputation exchanges K/V again (interleaved with the dK/dV exchanges, in the same order on every
    # member). Depth 1 reuses each slot at every exchange; two gangs share rank 1.
    gangs = [(13, 2, (0, 1)), (11, 2, (1, 2))]
    _check_against_reference(run_ranks(_gangs_rank, 3, gangs, 1, checkpoint, timeout=100), gangs)


def _forward_only_step_then_checkpointed_rank(rank: int, world: int) -> float:
    import torch

    import odc_runtime as odc
    from odc_runtime.gang import GangExchange, active_step, gang_attention
    from odc_runtime.split import Chunk

    def attend(i, q, k, v):  # what a model's attention does: the gang's inside a gang step, else local causal
        step = active_step()
        if step is not None:
            return gang_attention(q, k, v, step, i)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    odc.init("host")
    ex = GangExchange(num_layers=LAYERS, max_chunk_tokens=16, kv_features=KV_HEADS * HEAD_DIM, dtype=torch.float64)
    x, layers, readout = _weights(12)
    with torch.no_grad(), ex.step(Chunk(0, 0, 1, 12, 0, (0,))) as step:  # e.g. log-probs: forward only
        _forward(x, layers, readout, step.positions, attend)
    # A checkpointed micro-batch of whole samples next: its recomputation must not be taken for the gang's.
    length = 10
    x, layers, readout = _weights(length)
    params = [x] + [t for w in layers for t in w.values()]
    for t in params:
        t.requires_grad_(True)
    _forward(x, layers, readout, torch.arange(length), attend, "non-reentrant").backward()
    _, want = _reference(length)
    ex.free()
    return max(float((t.grad - g).abs().max()) for t, g in zip(params, want, strict=True))


def test_a_forward_only_gang_step_does_not_capture_a_later_recomputation() -> None:
    (err,) = run_ranks(_forward_only_step_then_checkpointed_rank, 1, timeout=60)
    assert err < TOL


def test_split_is_not_the_unsplit_without_the_exchange() -> None:
    # The reference check can fail: a chunk attending only to its own tokens gives a different loss.
    import torch

    from odc_runtime.split import Chunk

    length = 13
    chunk = Chunk(0, 1, 2, length, 0, (0, 1))
    x, layers, readout = _weights(length)

    def local(_i, q, k, v):
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    other = Chunk(0, 0, 2, length, 0, (0, 1))
    split = sum(_forward(x, layers, readout, torch.tensor(c.positions()), local) for c in (chunk, other))
    assert (split - _reference(length)[0]).abs() > 100 * TOL


def _faulty_rank(rank: int, world: int, fault: str):
    import torch

    import odc_runtime as odc
    from odc_runtime.errors import OdcMismatchError, OdcTimeoutError
    from odc_runtime.gang import GangExchange
    from odc_runtime.split import Chunk

    odc.init("host")
    ex = GangExchange(num_layers=LAYERS, max_chunk_tokens=16, kv_features=KV_HEADS * HEAD_DIM, dtype=torch.float64)
    sample = rank if fault == "mismatch" else 0
    chunk = Chunk(sample, rank, 2, 12, 0, (0, 1))
    checkpoint = "non-reentrant" if fault == "checkpoint" and rank == 0 else "none"
    if fault == "leave" and rank == 1:
        torch.distributed.barrier()  # after rank 0 gave up on it
        os._exit(0)  # gone: rank 0's runtime has failed and does not wait for it in finalize
    try:
        _run_chunk(ex, chunk, checkpoint)
    except (OdcTimeoutError, OdcMismatchError) as e:
        return type(e).__name__, str(e)
    finally:
        torch.distributed.barrier()  # both ranks reach finalize together
    return "no error"


def test_a_member_that_leaves_is_a_timeout_naming_gang_and_layer() -> None:
    results = run_ranks(_faulty_rank, 2, "leave", timeout=60, env={"ODC_TIMEOUT": "3"}, expect_exit={1})
    kind, message = results[0]
    assert kind == "OdcTimeoutError"
    assert "odc gang 0 (sample 0) layer 0: forward K/V: join (it started the gang) from rank 1" in message


def test_members_running_different_plans_is_a_mismatch() -> None:
    results = run_ranks(_faulty_rank, 2, "mismatch", timeout=60, env={"ODC_TIMEOUT": "5"})
    for rank, (kind, message) in enumerate(results):
        assert kind == "OdcMismatchError"
        assert f"layer 0: forward K/V from rank {1 - rank}" in message and "different plans" in message


def test_members_checkpointing_differently_is_a_mismatch_on_both() -> None:
    # Rank 0 checkpoints its layers, rank 1 does not: in the backward pass rank 0 recomputes layer 1 while rank 1
    # sends dK/dV of layer 1. Each takes the other's put for its own (one ring per pair); the tags tell. Rank 1 finds
    # it at the end of its backward pass and fails its runtime, which ends rank 0's next wait at once (well inside
    # the 30 s ODC_TIMEOUT; the harness's 60 s would fail a run that waited for it).
    results = run_ranks(_faulty_rank, 2, "checkpoint", timeout=60, env={"ODC_TIMEOUT": "30"})
    assert results[0][0] == "OdcMismatchError" and "layer 1: recomputed forward K/V from rank 1" in results[0][1]
    assert results[1][0] == "OdcMismatchError" and "layer 1: backward dK/dV from rank 0" in results[1][1]


def _member_order_rank(rank: int, world: int, orders: list[tuple[int, ...]]):
    """Run one gang whose members each build their chunk from their own member order ``orders[rank]``."""
    import torch

    import odc_runtime as odc
    from odc_runtime.errors import OdcMismatchError
    from odc_runtime.gang import GangExchange
    from odc_runtime.split import Chunk

    odc.init("host")
    ex = GangExchange(num_layers=LAYERS, max_chunk_tokens=16, kv_features=KV_HEADS * HEAD_DIM, dtype=torch.float64)
    ranks = orders[rank]
    try:
        _run_chunk(ex, Chunk(0, ranks.index(rank), len(ranks), 12, 0, ranks))
    except OdcMismatchError as e:
        return "OdcMismatchError", str(e), odc.state.current.transport.failure is not None
    finally:
        torch.distributed.barrier()  # both ranks reach finalize together
    ex.free()
    return "no error", "", False


@pytest.mark.parametrize("orders", [
    [(1, 0), (0, 1)],  # each rank takes itself for chunk 1: both compute the same chunk
    [(0, 1, 2), (0, 1, 2), (0, 2, 1)],  # rank 2 takes itself for chunk 1, ranks 0 and 1 give it chunk 2
])
def test_members_disagreeing_on_the_member_order_is_a_mismatch(orders: list) -> None:
    # The README's promise: members that run different plans raise OdcMismatchError, never a wrong sum. Before the
    # tag carried the sender's part and the members, this ran to completion with a loss off by 86 %.
    results = run_ranks(_member_order_rank, len(orders), orders, timeout=60, env={"ODC_TIMEOUT": "20"})
    for rank, (kind, message, failed) in enumerate(results):
        assert kind == "OdcMismatchError", (rank, kind)
        assert "different plans" in message and "member order" in message, message
        assert f"of the gang of ranks {orders[rank]}" in message, message  # what this rank expected
        assert failed  # fail-stop: the members exchanged different chunks
