"""Run a :class:`schedule.Schedule` with real processes: modelled compute, real communication.

Every rank walks its program (:meth:`schedule.Schedule.program`), one task per layer of a micro-batch:

- *gather* the layer's parameters: ``all_gather_into_tensor`` (collective) or ``odc.fetch`` (odc), issued one task
  ahead (FSDP's prefetch) and waited for before the task computes;
- *compute* for the task's modelled seconds times ``time_scale``, as ``time.sleep`` (default) or a busy-wait
  loop. Sleep models a GPU: the host core is free while the device computes, so on a machine with fewer cores
  than ranks the other ranks (and the communication threads) can use it. A busy-wait occupies a core and, with
  more ranks than cores, stretches every rank's compute by the time-sharing;
- backward tasks then *scatter* the layer's gradient: ``reduce_scatter_tensor`` into the owner's shard plus an
  add into its accumulator (collective), or ``odc.push`` (odc), asynchronously (waited for before the buffer is
  reused and at the end of the minibatch).

Gang micro-batches (split plans, e.g. ``lb_mini_split``; ODC only): every layer task of a chunk also runs the
split's K/V exchange for real through :func:`odc_runtime.gang.exchange_kv` (:class:`GangKV`): forward tasks give
this chunk's K/V to the other gang members and gather theirs, backward tasks return each owner its dK/dV, so the
members of a gang advance layer by layer together, as they would with gang attention. The K/V rows carry values
derived from (owner, layer), and every member checks what it gathered and what it got back (the sum of every
member's dK/dV contribution), exactly, like the gradient check below. The exchange's time counts as *comm*.

End of minibatch: collective: wait for the reduce-scatters, optimizer step on the shard; odc: ``odc.sync()``,
optimizer step on ``st.local``, ``zero_grad``, ``odc.sync()``. Each rank checks that its gradient shard holds
exactly the number of non-empty micro-batches of all ranks (every micro-batch contributes a gradient of ones),
so the data really moved.

HSDP (``replica_group`` given): parameters are sharded within the rank's *shard group* only (gathers, scatters,
``odc.shard(..., group=)`` and ``odc.sync(group=)`` stay inside it), and before the check and the optimizer step
each gradient shard is summed across the *replicate group* (the ranks holding the same shard in the other
replicas) with one real ``all_reduce`` per layer, in both modes; the expected sum is then again the non-empty
micro-batches of all ranks.

Time accounting per rank: *busy* = time in compute; *comm* = time blocked waiting for communication (includes
waiting for slower ranks inside a collective; on CUDA also until the stream has finished the operation, since the
host-modelled compute needs its data); *sync* = end-of-minibatch work and fences. Each minibatch
starts after a ``dist.barrier``; its wall time runs from the first rank's start to the last rank's end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from odc_runtime.bench._common import tensor_collectives
from odc_runtime.bench.schedule import Schedule, Task, micro_batch_tasks
from odc_runtime.split import Chunk

all_gather_tensor, reduce_scatter_tensor = tensor_collectives()

LR = 1e-3


@dataclass
class MinibatchRecord:
    start: float
    end: float
    busy_s: float
    comm_s: float
    sync_s: float
    grad_ok: bool
    events: list[tuple[str, float, float]] = field(default_factory=list)
    kv_calls: int = 0  # gang K/V exchanges this rank ran (one per layer task of a chunk)
    kv_bytes: int = 0  # bytes this rank put to its gang members in them


class Handle(Protocol):
    """An asynchronous operation in flight (a torch.distributed Work, an ODC handle)."""

    def wait(self) -> object: ...


class Comm(Protocol):
    """What :func:`run_minibatch` needs of a communication mode (:class:`CollectiveComm`, :class:`OdcComm`)."""

    name: str
    device: torch.device  # where its tensors live (cuda: a wait also waits for the GPU, see run_minibatch)
    group_rank: int  # this rank's rank in its shard group (the whole world without HSDP)
    group_size: int

    def gather(self, layer: int, slot: int) -> Handle: ...
    def scatter(self, layer: int, empty: bool) -> Handle: ...
    def set_shard(self, layer: int, value: float) -> None: ...
    def publish(self) -> None: ...
    def gathered(self, slot: int) -> torch.Tensor: ...
    def end_minibatch(self, expected: int) -> bool: ...


class _Then:
    """A work handle with a completion step run on wait()."""

    def __init__(self, work: Handle, then: Callable[[], object]) -> None:
        self.work, self.then = work, then

    def wait(self) -> None:
        self.work.wait()
        self.then()


def _replica_all_reduce(grads: list[torch.Tensor], replica_group: dist.ProcessGroup | None) -> None:
    """HSDP: sum each gradient shard across the replicas (no-op without a replicate group)."""
    if replica_group is None:
        return
    for g in grads:
        dist.all_reduce(g, group=replica_group)


class CollectiveComm:
    """FSDP-style: parameters sharded per layer, all-gather / reduce-scatter through torch.distributed (within
    ``group``, the shard group; ``None``: all ranks), gradients all-reduced across ``replica_group`` (HSDP)."""

    name = "collective"

    def __init__(self, num_layers: int, shard_numel: int, world: int, device: torch.device, *,
                 group: dist.ProcessGroup | None = None, replica_group: dist.ProcessGroup | None = None) -> None:
        self.group, self.replica_group, self.device = group, replica_group, device
        self.group_rank, self.group_size = dist.get_rank(group), world
        self.shards = [torch.zeros(shard_numel, device=device) for _ in range(num_layers)]
        self.grad_acc = [torch.zeros(shard_numel, device=device) for _ in range(num_layers)]
        self.grad_out = [torch.empty(shard_numel, device=device) for _ in range(num_layers)]
        self.gathered_bufs = [torch.empty(world * shard_numel, device=device) for _ in range(2)]
        self.ones = torch.ones(world * shard_numel, device=device)
        self.zeros = torch.zeros(world * shard_numel, device=device)

    def gather(self, layer: int, slot: int) -> Handle:
        return all_gather_tensor(self.gathered_bufs[slot], self.shards[layer], group=self.group, async_op=True)

    def scatter(self, layer: int, empty: bool) -> Handle:
        work = reduce_scatter_tensor(self.grad_out[layer], self.zeros if empty else self.ones, group=self.group,
                                     async_op=True)
        return _Then(work, lambda: self.grad_acc[layer].add_(self.grad_out[layer]))

    def set_shard(self, layer: int, value: float) -> None:
        self.shards[layer].fill_(value)

    def publish(self) -> None:
        """Make :meth:`set_shard` writes what later gathers return (local tensors: nothing to do)."""

    def gathered(self, slot: int) -> torch.Tensor:
        return self.gathered_bufs[slot]

    def end_minibatch(self, expected: int) -> bool:
        _replica_all_reduce(self.grad_acc, self.replica_group)
        ok = all(bool((g == expected).all()) for g in self.grad_acc)
        for p, g in zip(self.shards, self.grad_acc, strict=True):
            p.add_(g, alpha=-LR)
            g.zero_()
        return ok


class OdcComm:
    """ODC: parameters in symmetric memory per layer, one-sided fetch / push, one sync per minibatch (all within
    ``group``, the shard group; ``None``: all ranks), gradients all-reduced across ``replica_group`` (HSDP)."""

    name = "odc"

    def __init__(self, num_layers: int, shard_numel: int, world: int, device: torch.device, *,
                 group: dist.ProcessGroup | None = None, replica_group: dist.ProcessGroup | None = None) -> None:
        import odc_runtime as odc

        self.odc = odc
        self.group, self.replica_group, self.device = group, replica_group, device
        numel = world * shard_numel
        self.sts = [odc.shard(torch.zeros(numel, device=device), name=f"layer{i}", group=group)
                    for i in range(num_layers)]
        self.group_rank, self.group_size = self.sts[0].rank, self.sts[0].world_size
        self.out = [torch.empty(numel, device=device) for _ in range(2)]
        self.ones = torch.ones(numel, device=device)
        self.zeros = torch.zeros(numel, device=device)

    def gather(self, layer: int, slot: int) -> Handle:
        return self.odc.fetch(self.sts[layer], out=self.out[slot], async_op=True)

    def scatter(self, layer: int, empty: bool) -> Handle:
        return self.odc.push(self.sts[layer], self.zeros if empty else self.ones, async_op=True)

    def set_shard(self, layer: int, value: float) -> None:
        self.sts[layer].local.fill_(value)

    def publish(self) -> None:
        self.odc.sync(group=self.group)  # writes to st.local before a sync are what later fetches return

    def gathered(self, slot: int) -> torch.Tensor:
        return self.out[slot]

    def end_minibatch(self, expected: int) -> bool:
        self.odc.sync(group=self.group)  # every rank's pushes have landed in the owners' accumulators
        # HSDP: no member of the shard group pushes again before the sync below, so st.grad is stable here.
        _replica_all_reduce([st.grad for st in self.sts], self.replica_group)
        ok = all(bool((st.grad == expected).all()) for st in self.sts)
        for st in self.sts:
            st.local.add_(st.grad, alpha=-LR)
            st.zero_grad()
        self.odc.sync(group=self.group)  # updated parameters visible, accumulators zeroed, before any fetch or push
        return ok

    def free(self) -> None:
        for st in self.sts:
            st.free()


class GangKV:
    """The K/V exchange of gang micro-batches, run for real through :mod:`odc_runtime.gang` (ODC only).

    Collective: every rank constructs it after ``odc.init``, with the same arguments. ``kv_features``: fp32
    elements of K (and of V) per token, the modelled model's K/V scaled like its parameters (the executor runs
    ``layer_mb`` of parameters per layer, not the model's)."""

    def __init__(self, num_layers: int, max_chunk_tokens: int, kv_features: int) -> None:
        from odc_runtime import gang

        self.gang, self.num_layers = gang, num_layers
        self.exchange = gang.GangExchange(num_layers=num_layers, max_chunk_tokens=max_chunk_tokens,
                                          kv_features=kv_features, dtype=torch.float32)
        self._step = None
        self._layers: dict[int, tuple[torch.Tensor, ...]] = {}

    def _values(self, chunk: Chunk, layer: int) -> torch.Tensor:
        """K of every gathered row at ``layer``: the owning member's ``rank · L + layer + 1`` (V: its negative)."""
        step = self._step
        return torch.cat([torch.full((n,), float(r * self.num_layers + layer + 1), device=step.positions.device)
                          for r, n in zip(chunk.ranks, step.counts, strict=True)])

    def run(self, task: Task) -> tuple[bool, int]:
        """The exchange of ``task`` (a layer of a chunk): (exact, bytes this rank put)."""
        chunk, layer, f = task.chunk, task.layer, self.exchange.kv_features
        if task.phase == "fwd":
            if layer == 0:
                self._step = self.exchange.step(chunk).__enter__()
            step, n = self._step, chunk.tokens
            own = float(self.exchange.rank * self.num_layers + layer + 1)
            k = torch.full((n, f), own, device=step.positions.device, requires_grad=True)
            v = torch.full((n, f), -own, device=step.positions.device, requires_grad=True)
            k_all, v_all = self.gang.exchange_kv(step, layer, k, v)
            want = self._values(chunk, layer)[:, None]
            ok = bool((k_all == want).all()) and bool((v_all == -want).all())
            self._layers[layer] = (k, v, k_all, v_all)
            if layer == self.num_layers - 1:
                step.__exit__(None, None, None)
            return ok, (chunk.parts - 1) * 2 * n * f * 4
        k, v, k_all, v_all = self._layers.pop(layer)
        # dK = 1 and dV = 2 from every member: each owner must get back exactly parts · (1, 2).
        torch.autograd.backward([k_all, v_all], [torch.ones_like(k_all), torch.full_like(v_all, 2.0)])
        ok = bool((k.grad == chunk.parts).all()) and bool((v.grad == 2 * chunk.parts).all())
        others = sum(self._step.counts) - chunk.tokens
        return ok, 2 * others * f * 4

    def warm_up(self) -> None:
        """Collective: one gang of every rank exchanges a small chunk through every layer, both directions, and
        checks it (maps the buffers, starts autograd's engine: half a second on the first backward pass, which
        would otherwise land in the first timed minibatch). Raises ``RuntimeError`` if an exchange was wrong."""
        world = self.exchange.transport.world_size
        chunk = Chunk(0, self.exchange.rank, world, 2 * world, 0, tuple(range(world)))
        if not all([self.run(task)[0] for task in micro_batch_tasks(0, self.num_layers, chunk=chunk)]):
            raise RuntimeError("gang K/V warm-up exchange delivered wrong values: the transport lost or mixed data")

    def free(self) -> None:
        self.exchange.free()


def _compute(seconds: float, mode: str) -> None:
    if seconds <= 0:
        return
    if mode == "sleep":
        time.sleep(seconds)
        return
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def run_minibatch(
    comm: Comm,
    tasks: list[Task],
    *,
    expected_grad: int,
    time_scale: float,
    compute: str = "sleep",
    record: bool = True,
    max_outstanding_scatters: int = 2,
    gang: GangKV | None = None,
) -> MinibatchRecord:
    """Run one rank's program for one minibatch (collective: every rank must call it with the same shape).
    ``gang``: the K/V exchange of the program's gang micro-batches (required when it has any)."""
    now = time.perf_counter
    events: list[tuple[str, float, float]] = []
    busy = wait = 0.0
    dist.barrier()
    start = now()
    gathers = {0: comm.gather(tasks[0].layer, 0)} if tasks else {}
    scatters: deque = deque()
    pending_scatter: dict[int, object] = {}

    on_gpu = comm.device.type == "cuda"
    kv_ok, kv_calls, kv_bytes = True, 0, 0

    def wait_for(handle: Handle) -> None:
        nonlocal wait
        t0 = now()
        handle.wait()
        if on_gpu:  # a wait orders the stream only; the (host-modelled) compute needs the data, so wait for it
            torch.cuda.current_stream().synchronize()
        t1 = now()
        wait += t1 - t0
        if record:
            events.append(("comm", t0, t1))

    for j, task in enumerate(tasks):
        if j + 1 < len(tasks):  # prefetch the next task's layer
            gathers[j + 1] = comm.gather(tasks[j + 1].layer, (j + 1) % 2)
        wait_for(gathers.pop(j))
        if task.chunk is not None:
            if gang is None:
                raise ValueError("a gang micro-batch (split plan) needs run_minibatch(gang=GangKV(...)), ODC only")
            t0 = now()
            ok, sent = gang.run(task)
            t1 = now()
            kv_ok, kv_calls, kv_bytes = kv_ok and ok, kv_calls + 1, kv_bytes + sent
            wait += t1 - t0
            if record:
                events.append(("comm", t0, t1))
        t0 = now()
        _compute(task.compute_s * time_scale, compute)
        t1 = now()
        busy += t1 - t0
        if record and t1 > t0:
            events.append(("compute", t0, t1))
        if task.scatter:
            if task.layer in pending_scatter:  # its output buffer is about to be reused
                wait_for(pending_scatter.pop(task.layer))
            while len(scatters) >= max_outstanding_scatters:
                layer, handle = scatters.popleft()
                if pending_scatter.get(layer) is handle:
                    wait_for(pending_scatter.pop(layer))
            handle = comm.scatter(task.layer, task.empty)
            scatters.append((task.layer, handle))
            pending_scatter[task.layer] = handle
    for handle in list(pending_scatter.values()):
        wait_for(handle)
    t0 = now()
    ok = comm.end_minibatch(expected_grad)
    end = now()
    if record:
        events.append(("sync", t0, end))
    rec = MinibatchRecord(start, end, busy, wait, end - t0, ok and kv_ok, events, kv_calls, kv_bytes)
    if record:  # gap-free, as drawn: host time between the waits (issuing transfers, Python) is not compute either
        rec.events = timeline_events(rec)
    return rec


def timeline_events(rec: MinibatchRecord) -> list[tuple[str, float, float]]:
    """A recorded minibatch's events covering all of ``[start, end]``: its compute, and ``trace_waits`` for
    the rest, in time order (the plot's busy and waiting time are then the table's)."""
    compute = [e for e in rec.events if e[0] == "compute"]
    return sorted([*compute, *((kind, a, b) for a, b, kind in trace_waits(rec))], key=lambda e: e[1])


def trace_waits(rec: MinibatchRecord) -> list[tuple[float, float, str]]:
    """A recorded minibatch's waiting time as trace intervals: all of ``[start, end]`` outside compute, as
    ``"comm"`` before the end-of-minibatch work and ``"sync"`` in it, so a trace's busy time is the record's
    ``busy_s`` and its idle time the table's ("idle s/rank")."""
    sync_at = next((t0 for kind, t0, _ in rec.events if kind == "sync"), rec.end)
    out, t = [], rec.start
    for t0, t1 in [*sorted((a, b) for kind, a, b in rec.events if kind == "compute"), (rec.end, rec.end)]:
        for a, b, kind in ((t, min(t0, sync_at), "comm"), (max(t, sync_at), t0, "sync")):
            if b > a:
                out.append((a, b, kind))
        t = max(t, t1)
    return out


def expected_grad(schedule: Schedule, k: int) -> int:
    """Non-empty micro-batches of all ranks in minibatch ``k`` (each pushes a gradient of ones)."""
    return sum(1 for mbs in schedule.minibatches[k].ranks for mb in mbs if not mb.empty)


def check_gather(comm: Comm, num_layers: int, world: int | None = None) -> None:
    """Every layer's gather returns every owner's shard: owner r's (rank in the shard group) shard of layer l is
    set to ``r·L + l + 1``, gathered, compared, and reset to zero. Raises ``RuntimeError`` naming the layer
    otherwise. ``world``: the owners per layer (default and normally ``comm.group_size``, the shard group's)."""
    rank, world = comm.group_rank, comm.group_size if world is None else world
    for layer in range(num_layers):
        comm.set_shard(layer, rank * num_layers + layer + 1)
    comm.publish()
    for layer in range(num_layers):
        comm.gather(layer, 0).wait()
        got = comm.gathered(0).view(world, -1)
        want = torch.arange(world, dtype=got.dtype, device=got.device) * num_layers + layer + 1
        if not bool((got == want[:, None]).all()):
            raise RuntimeError(f"{comm.name}: layer {layer}'s gathered parameters are not the owners' shards")
    # ODC's fetch reads the owner's memory directly: no owner may zero its shard while a slower rank still
    # fetches it, hence the barrier before the reset (publish() then makes the zeros what later fetches see).
    dist.barrier()
    for layer in range(num_layers):
        comm.set_shard(layer, 0.0)
    comm.publish()


def warm_up(comm: Comm, num_layers: int, world: int) -> None:
    """Check that gathers return the owners' parameters (:func:`check_gather`), then run one zero-compute
    micro-batch through every layer (maps pages, starts threads) and check its gradients, then reset: no
    configuration is timed unless its communication moved the right data."""
    check_gather(comm, num_layers)
    rec = run_minibatch(comm, micro_batch_tasks(0, num_layers), expected_grad=world, time_scale=0.0, record=False)
    if not rec.grad_ok:
        raise RuntimeError(f"{comm.name}: warm-up gradients are wrong: the transport lost or duplicated data")
