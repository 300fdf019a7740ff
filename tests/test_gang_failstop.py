"""Fail-stop of an interrupted gang step (odc_runtime.gang, docs/design.md "Fail-stop"), on 2 host ranks.

Once a member delivered its first put of a gang micro-batch, its peers count on the rest of the step. An exception
that ends the step early on one member (a hook that raises, a SIGINT in a wait, in the forward or the backward
pass) must mark that member's runtime failed, so that the member's peers raise OdcPeerLostError within the liveness
period (not OdcTimeoutError after ODC_TIMEOUT, 40 s here) and a retry on the interrupted member raises at once.
The interrupted member's exception itself stays what it was (an interrupt stays a KeyboardInterrupt).

Rank 1 interrupts rank 0 (SIGINT to its pid) at a point where rank 0 is known to be inside the step (rank 0's put
of the previous exchange arrived), and only then goes on, so the interrupt cannot land outside the step.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_ranks
from test_gang import HEAD_DIM, KV_HEADS, LAYERS, _layer, _weights

TIMEOUT = 40  # ODC_TIMEOUT: what a peer would wait without fail-stop


def _wait_until(predicate, seconds: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _interrupted_rank(rank: int, world: int, fault: str) -> dict:
    import signal
    import time

    import torch

    import odc_runtime as odc
    from odc_runtime.gang import GangExchange, gang_attention
    from odc_runtime.split import Chunk
    from odc_runtime.transport.host.control import HEALTHY

    signal.signal(signal.SIGINT, signal.default_int_handler)
    odc.init("host")
    transport = odc.state.current.transport
    pids = [None] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    ex = GangExchange(num_layers=LAYERS, max_chunk_tokens=16, kv_features=KV_HEADS * HEAD_DIM, dtype=torch.float64)
    chunk = Chunk(0, rank, 2, 12, 0, (0, 1))
    x, layers, readout = _weights(12)
    params = [x] + [t for w in layers for t in w.values()]
    for t in params:
        t.requires_grad_(True)

    def puts_from_rank0(n: int) -> bool:  # rank 0's n-th exchange (data and tag: 2 signals each) arrived here
        return int(ex.signal.local[0]) >= 2 * n

    def interrupt_rank0() -> None:  # rank 1: SIGINT rank 0, then wait until its runtime says failed (or give up)
        os.kill(pids[0], signal.SIGINT)
        _wait_until(lambda: transport.control.read(0).status != HEALTHY, 10.0)

    def attend(i, q, k, v):
        if i == 1 and rank == 0 and fault == "hook":
            raise RuntimeError("a forward hook failed")
        if i == 1 and rank == 1 and fault == "sigint_forward":
            _wait_until(lambda: puts_from_rank0(1))  # rank 0 exchanged layer 0: it is inside the step
            interrupt_rank0()
        return gang_attention(q, k, v, step, i)

    def run():
        nonlocal step
        with ex.step(chunk) as step:
            h = x[step.positions]
            for i, w in enumerate(layers):
                h = _layer(h, i, attend, *w.values())
                if i == 0 and rank == 0 and fault == "backward_hook":  # runs between the layers' backward passes
                    h.register_hook(lambda _: (_ for _ in ()).throw(RuntimeError("a tensor hook failed")))
            loss = (h * readout[step.positions]).sum()
        if rank == 1 and fault == "sigint_backward":
            _wait_until(lambda: puts_from_rank0(LAYERS + 1))  # rank 0 sent dK/dV of the last layer
            interrupt_rank0()
        loss.backward()

    step = None
    out: dict = {}
    start = time.monotonic()
    try:
        run()
        out["error"] = "no error"
    except BaseException as e:  # KeyboardInterrupt is the point
        out["error"] = type(e).__name__
        out["message"] = str(e)
    out["seconds"] = time.monotonic() - start
    out["failed"] = transport.failure is not None
    if rank == 0:  # a retry of the step: raises at once (the runtime failed), never waits for the peer
        start = time.monotonic()
        try:
            run()
            out["retry"] = "no error"
        except BaseException as e:
            out["retry"] = type(e).__name__
            out["retry_message"] = str(e)
        out["retry_seconds"] = time.monotonic() - start
    torch.distributed.barrier()  # both ranks reach finalize together (their runtimes failed: it waits for no one)
    return out


@pytest.mark.parametrize(("fault", "error"), [
    ("hook", "RuntimeError"),  # a forward hook raises at layer 1, after layer 0 was exchanged
    ("sigint_forward", "KeyboardInterrupt"),  # SIGINT while waiting for the peer's K/V of layer 1
    ("sigint_backward", "KeyboardInterrupt"),  # SIGINT while waiting for the peer's dK/dV of layer 1
])
def test_an_interrupted_step_fails_the_runtime_and_the_peer_at_once(fault: str, error: str) -> None:
    r0, r1 = run_ranks(_interrupted_rank, 2, fault, timeout=100, env={"ODC_TIMEOUT": str(TIMEOUT)})
    assert r0["error"] == error, r0  # the interrupt stays what it was
    assert r0["failed"], r0  # ... and the runtime recorded the failure
    assert r0["retry"] == "OdcBackendError" and "unusable" in r0["retry_message"], r0
    assert r0["retry_seconds"] < TIMEOUT / 4, r0
    assert r1["error"] == "OdcPeerLostError" and "runtime failed" in r1["message"], r1  # not OdcTimeoutError
    assert r1["seconds"] < TIMEOUT / 2, r1


def test_a_backward_pass_stopped_outside_the_exchange_fails_at_the_next_step() -> None:
    # A tensor hook raises between layer 1's and layer 0's backward exchanges: the gang never sees it; rank 0's next
    # step finds the backward pass unfinished, refuses and fails the runtime, which releases rank 1 from its wait
    # for rank 0's dK/dV of layer 0.
    r0, r1 = run_ranks(_interrupted_rank, 2, "backward_hook", timeout=100, env={"ODC_TIMEOUT": str(TIMEOUT)})
    assert r0["error"] == "RuntimeError" and "tensor hook" in r0["message"], r0
    assert r0["retry"] == "OdcBackendError" and "backward pass stopped on this rank" in r0["retry_message"], r0
    assert r0["retry_seconds"] < TIMEOUT / 4, r0
    assert r1["error"] == "OdcPeerLostError" and "runtime failed" in r1["message"], r1
    assert r1["seconds"] < TIMEOUT / 2, r1
