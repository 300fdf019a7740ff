"""Worker for tests/gpu/test_hierarchy_gpu.py (the transport calls of the hierarchical protocol, issue 14).

    torchrun --nproc-per-node N tests/gpu/_hierarchy_worker.py RESULT.json SCENARIO [NODE_SIZE]

Scenarios (NVSHMEM starts once per process, so each torchrun runs one):

* ``signal``: every PE put_signal's a row of a symmetric fp32 staging buffer into every PE's inbox at an element
  offset (its own row), over several rounds, and wait_signal's for every source's running count; inboxes, signal
  words, gets at an offset and accumulates at an offset are compared with the expected values.
* ``signal_timeout`` (1 PE): a wait for a count nobody delivers is released at the deadline (the stream does not
  stay blocked: torch.cuda.synchronize() returns), the next call raises OdcTimeoutError naming the op and the peers,
  and the CUDA context stays usable.
* ``hierarchy``: the public API with ``odc.init(node_size=NODE_SIZE)``: all ranks push integer-valued gradients
  (fp32 and bf16, unequal micro-batch counts per rank, odd numels) into world-sharded tensors over several rounds;
  each owner's st.grad equals an independent float64 reference after every sync; after the owners update their
  shards and sync, fetch returns every owner's latest values.

Rank 0 writes ``{"result": "ok" | error text, ...}`` to RESULT.json, merged over ranks.
"""

from __future__ import annotations

import sys
import time

import _worker
import torch
import torch.distributed as dist

import odc_runtime as odc
from odc_runtime import testing


def _transport():
    return testing.transport()  # the transport interface itself (the hierarchy's layer)


def scenario_signal() -> dict:
    from odc_runtime.transport.base import FetchRequest, PushRequest, PutRequest

    t = _transport()
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 1003  # odd: rows start at unaligned element offsets
    staging = t.alloc(world * n, torch.float32, "staging")
    inbox = t.alloc(world * n, torch.float32, "inbox")
    signal = t.alloc(world, torch.int64, "signal")
    acc = t.alloc(64, torch.float32, "acc")
    ramp = torch.arange(n, device="cuda", dtype=torch.float32) % 5

    def value(src: int, dst: int, k: int) -> torch.Tensor:
        return ramp + (src * 100 + dst * 10 + k)

    rounds = 4
    for k in range(1, rounds + 1):
        for q in range(world):
            staging.local[q * n : (q + 1) * n].copy_(value(rank, q, k))
        # every PE, itself included (a put through its own pointer), gets row `rank` of its inbox
        reqs = [PutRequest(q, staging.local[q * n : (q + 1) * n], rank * n, rank) for q in range(world)]
        t.put_signal(inbox, reqs[rank:] + reqs[:rank], signal)
        for s in range(world):
            t.wait_signal(signal, s, k, "test signal", [s])
        # stream-ordered after the waits: what the fold would read
        rows = inbox.local.view(world, n).clone()
        seen = signal.local.clone()
        torch.cuda.synchronize()
        for s in range(world):
            got, want = rows[s].cpu(), value(s, rank, k).cpu()
            assert torch.equal(got, want), f"round {k}: inbox row {s} differs (max {(got - want).abs().max()})"
        assert seen.cpu().tolist() == [k] * world, f"round {k}: signal words {seen.cpu().tolist()}"
        t.barrier("puts done")  # every PE's puts of this round are complete in every inbox
        # get at an offset: PE q's inbox row world - 1 (read from q's region) is value(world - 1, q, k)
        q = (rank + 1) % world
        dst = torch.empty(n - 2, device="cuda")
        t.fetch(inbox, [FetchRequest(q, dst, (world - 1) * n + 1)])
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), value(world - 1, q, k)[1 : n - 1].cpu()), f"round {k}: get at an offset"
        t.barrier("round")  # every PE read the inboxes before the next round's puts overwrite them
    # accumulate at an offset into every owner, then check the owner's words [5, 5 + 7)
    ones = torch.ones(7, device="cuda", dtype=torch.bfloat16)
    t.push(acc, [PushRequest(q, ones, 5) for q in range(world)], 0.5)
    t.barrier("acc")
    got = acc.local.cpu()
    assert torch.equal(got[5:12], torch.full((7,), 0.5 * world)), f"accumulate at an offset: {got[5:12]}"
    assert not got[:5].any() and not got[12:].any(), "accumulate at an offset wrote outside its range"
    for b in (acc, signal, inbox, staging):
        t.free(b)
    return {"result": "ok"}


def scenario_signal_timeout() -> dict:
    t = _transport()
    signal = t.alloc(2, torch.int64, "signal")
    torch.cuda.synchronize()
    start = time.monotonic()
    t.wait_signal(signal, 1, 1, "test wait", [0])  # nobody puts: the count never comes
    # A second wait queued behind it, released by the same abort right after: it must not overwrite the first
    # wait's record (issue 22: the first record wins; the message reports word 1, not word 0's count of 7).
    t.wait_signal(signal, 0, 7, "test wait", [0])
    host_return = time.monotonic() - start  # the host does not block on the wait
    done = torch.cuda.Event()
    done.record()
    end = time.monotonic() + 60
    while not done.query() and time.monotonic() < end:  # completes once the watchdog released the wait
        time.sleep(0.01)
    released = time.monotonic() - start if done.query() else None
    error = None
    end = time.monotonic() + 30
    while error is None and time.monotonic() < end:
        try:
            t.quiet()
            time.sleep(0.01)
        except odc.OdcTimeoutError as e:
            error = str(e)
    raised = time.monotonic() - start
    context_ok = float((torch.ones(4, device="cuda") * 2).sum().item()) == 8.0
    return {
        "result": "ok", "error": error, "host_return_s": host_return, "released_s": released, "raised_s": raised,
        "context_ok": context_ok, "timeout_s": t.timeout,
    }


def _grad(n: int, r: int, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Integer values in [-5, 5]: exact in bf16, and every sum here is exact in fp32."""
    return (((torch.arange(n, dtype=torch.float64) + 3 * r + 7 * m + 11 * k) % 11) - 5).to(dtype)


def scenario_hierarchy() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    rounds = 3
    for n, dtype in ((4099, torch.float32), (3 * 65536 + 5, torch.bfloat16), (7, torch.float32)):
        init = ((torch.arange(n, dtype=torch.float64) % 13) - 6).float()
        st = odc.shard(init.cuda(), name=f"h-{n}")
        lo, hi = st.shard_range
        reference = torch.zeros(n, dtype=torch.float64)
        params = init.double().clone()
        for k in range(rounds):
            if k == 2:  # zero_grad between minibatches resets every owner's accumulator
                st.zero_grad()
                odc.sync()
                reference.zero_()
            for m in range(rank + 1):  # unequal micro-batch counts: rank r pushes r + 1 per round
                odc.push(st, _grad(n, rank, m, k, dtype).cuda(), scale=0.5)
            odc.sync()
            for r in range(world):
                for m in range(r + 1):
                    reference += _grad(n, r, m, k, torch.float64) * 0.5
            got = st.grad.double().cpu()
            err = (got - reference[lo:hi]).abs().max().item() if got.numel() else 0.0
            assert torch.equal(got, reference[lo:hi]), f"n={n} {dtype} round {k}: st.grad differs (max {err})"
            # "optimizer step" on every owner, then fetch sees every owner's latest values
            st.local.add_(float(k + 1 + rank))
            odc.sync()
            s = -(-n // world)
            for r in range(world):
                a, b = min(r * s, n), min((r + 1) * s, n)
                params[a:b] += k + 1 + r
            fetched = odc.fetch(st)
            torch.cuda.synchronize()
            assert torch.equal(fetched.reshape(-1).double().cpu(), params), f"n={n} round {k}: fetch after sync"
        st.free()
    return {"result": "ok"}


def main() -> None:
    out_path, scenario = sys.argv[1], sys.argv[2]
    node_size = int(sys.argv[3]) if len(sys.argv) > 3 else None
    _worker.start(heap_size="1G", **({"node_size": node_size} if node_size is not None else {}))
    _worker.run_scenario(out_path, globals()[f"scenario_{scenario}"], finalize=scenario != "signal_timeout")


if __name__ == "__main__":
    main()
