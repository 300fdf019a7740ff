"""The core API: ``init``, ``shard``, ``fetch``, ``push``, ``sync``, ``finalize``.

Layout: ``odc_runtime.layout`` (where element ``i`` of a tensor lives; every rank of the world allocates the
same number of parameter and fp32 accumulator elements, so one offset addresses a buffer on every peer). Plans and
their cache: ``odc_runtime.plans``.

Groups. ``shard(t, group=g)`` is still collective over the whole world (every rank calls it, each with the group it
belongs to, e.g. its row of a device mesh); the groups of one call must partition the ranks. ``fetch``/``push``
address the owners of the caller's group only (their group ranks mapped to global ranks for the transport), and
``sync(group=g)`` fences only ``g``'s ranks. Allocation stays world-collective so that offsets stay symmetric
without per-group heaps; see docs/design.md ("Process groups") for why this cannot deadlock.

Every public call validates all of its arguments before it issues any remote operation, so a rejected ``push``
changes no accumulator anywhere. Collective calls (``init``, ``shard``, ``free``, ``finalize``) run their checks
on every rank and agree on the outcome (``odc_runtime.agree``), within ``ODC_TIMEOUT``: they fail on every rank
together. A forked child of a rank (e.g. a DataLoader worker) may not use the runtime at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from odc_runtime import checks, config, debug, layout, state, telemetry
from odc_runtime import transport as registry
from odc_runtime.agree import StoreExchange, gather_checked, op_digest, require_same, shorten
from odc_runtime.deterministic import FixedPointAccumulators, check_supported
from odc_runtime.errors import (
    OdcError,
    OdcTimeoutError,
    OdcUsageError,
)
from odc_runtime.hierarchy import Hierarchy
from odc_runtime.plans import CONTIGUOUS, dense, output_key, tensor_key
from odc_runtime.sharded import Handle, ShardedTensor
from odc_runtime.state import Runtime
from odc_runtime.transport.base import (
    Group,
    SymmetricBuffer,
    TransferPlan,
    as_failure,
)
from odc_runtime.windows import WindowCheck

log = logging.getLogger("odc_runtime")

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACCUM_DTYPES = (torch.float32,)
@contextlib.contextmanager
def _blaming_odc_backend(backend: str | None) -> Iterator[None]:
    """An OdcError raised inside, while the transport came from ``ODC_BACKEND`` (``backend`` is None), says so:
    its advice names ``backend=``, and a user who never passed one would not look for the variable."""
    try:
        yield
    except OdcError as e:
        requested = config.backend_name(backend) if backend is None else None
        if requested is not None and e.args and isinstance(e.args[0], str):
            e.args = (f"{e.args[0]} [the backend {requested!r} came from ODC_BACKEND={requested}: change or unset "
                      "it; init(backend=...) takes precedence over it]", *e.args[1:])
        raise


def _backend_facts(backend: str | None) -> tuple[str | None, tuple[str, ...], str]:
    """This rank's input to ``odc_runtime.transport.choose``: the requested transport (checked against the
    registry) or None, the transports it could choose, its host name."""
    choice = config.backend_name(backend)
    if choice is not None:
        with _blaming_odc_backend(backend):
            return registry.get(choice).name, (), socket.gethostname()
    return None, registry.auto_candidates(), socket.gethostname()


def init(
    backend: str | None = None,
    *,
    timeout: float | None = None,
    heap_size: int | str | None = None,
    node_size: int | None = None,
    node_slots: int | None = None,
    deterministic: bool | None = None,
    trace_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Start the runtime (collective; call after ``torch.distributed.init_process_group``).

    Args:
        backend: a name from the transport registry (``odc_runtime.transport.names()``): ``"host"`` (CPU shared
            memory, ranks on one machine), ``"symm"`` (GPUs of one node, Triton over PyTorch SymmetricMemory, or CUDA
            IPC where ranks share a GPU),
            ``"nvshmem"`` (GPUs, across nodes), ``"symm-cpu"`` (the symm kernels on CPU ranks); or ``None`` to take
            ``ODC_BACKEND``, else the rule of `odc_runtime.transport.choose`: ``nvshmem`` where its extension
            is built and works on every rank, else (one node) ``symm`` on GPUs, else ``host``; across nodes
            ``nvshmem`` only. The choice is logged at INFO and returned by `backend`.
        timeout: seconds any blocking wait may take before raising OdcTimeoutError (default ``ODC_TIMEOUT`` or
            300); it also bounds every collective step of ``init`` itself.
        heap_size: symmetric memory per rank in bytes or as ``"4G"``; host default ``ODC_HEAP_SIZE`` or 1 GiB;
            nvshmem default ``NVSHMEM_SYMMETRIC_SIZE``.
        node_size: ranks per node (blocks of consecutive ranks; must divide the world size): pushes to and
            fetches from owners on other nodes go through the hierarchical protocol (``odc_runtime.hierarchy``).
            Default ``ODC_NODE_SIZE``, else the transport's real node (host: all ranks; nvshmem: the ranks one
            GPU reaches by NVLink). A smaller value declares virtual nodes (to exercise the multi-node path on
            one machine).
        node_slots: inbox slots per tensor for pushes from other nodes (default ``ODC_NODE_SLOTS``, else one per
            other node). Fewer slots bound the memory (``slots × shard × 4`` bytes per tensor instead of
            ``(nodes − 1) × shard × 4``); ``sync`` then delivers in rounds, one network round trip each.
        deterministic: bitwise-deterministic gradient accumulation (default ``ODC_DETERMINISTIC``, else off): pushes
            add into int64 fixed-point accumulators (8 more bytes per shard element), ``sync`` writes ``st.grad``;
            a push beyond its tensor's bound makes the next ``sync`` raise OdcOverflowError on every rank
            (``odc_runtime.deterministic``). Host, symm, symm-cpu and nvshmem transports, with or without
            ``node_size`` (int64 staging rows and inboxes); the same on every rank.
        trace_dir: a directory (created if missing) where this rank appends one JSON line per minibatch to
            ``rank<r>.jsonl`` (``odc_runtime.telemetry``; read it with ``python -m odc_runtime.report DIR``);
            default ``ODC_TRACE_DIR``, else no trace. Checked on every rank together.

    Raises (on every rank together): OdcUsageError for a bad argument or setting on this rank, OdcMismatchError
    when another rank rejected its arguments or ranks chose different backends, OdcTimeoutError /
    OdcPeerLostError when a rank does not arrive within the timeout, OdcBackendError when the transport fails.
    """
    if state.in_forked_child:
        state.require("init")  # raises in a fork (a child of an initialised rank) ...
    if state.current is not None:
        raise OdcUsageError("odc_runtime.init() called twice; call odc_runtime.finalize() first")
    if not (dist.is_available() and dist.is_initialized()):
        raise OdcUsageError("odc_runtime.init() needs torch.distributed.init_process_group() to have been called")
    for variable, nearest in config.unknown_variables().items():  # a misspelt setting would be ignored silently
        log.warning("odc_runtime.init(): %s is set but %s (python -m odc_runtime.doctor checks every ODC_* "
                    "variable)", variable, config.describe_unknown(nearest))
    try:  # the agreement itself must be bounded even when this rank's timeout setting is bad
        exchange_timeout = config.resolve_timeout(timeout)
    except OdcUsageError:
        exchange_timeout = config.DEFAULT_TIMEOUT_S

    traces: list[str | None] = []

    def local_checks() -> tuple[str, float, int | None, int | None, bool, bool, str]:
        if heap_size is not None:
            config.parse_size(heap_size, what="heap_size")
        traces.append(telemetry.check_trace_dir(trace_dir))  # checked here, so a bad one fails every rank together
        nodes = config.node_size(node_size, dist.get_world_size())
        return (_backend_facts(backend), config.resolve_timeout(timeout), nodes, config.node_slots(node_slots),
                config.deterministic(deterministic), config.debug(), telemetry.run_id())

    results = gather_checked("init", local_checks, exchange=StoreExchange(exchange_timeout))
    # The backend (chosen from every rank's facts, the same on all) and the node settings must match here; the
    # transports compare the resolved heap sizes themselves.
    facts = [r[0] for r in results]
    name = registry.choose([f[0] for f in facts], [f[1] for f in facts], [f[2] for f in facts])
    for i, what in ((2, "node size (init(node_size=...) / ODC_NODE_SIZE)"),
                    (3, "inbox slots (init(node_slots=...) / ODC_NODE_SLOTS)"),
                    (4, "accumulation mode (init(deterministic=...) / ODC_DETERMINISTIC)"),
                    (5, "debug setting (ODC_DEBUG)")):
        require_same("init", [r[i] for r in results], rule=f"needs the same {what} on every rank")
    _, resolved_timeout, requested_nodes, slots, exact, checked, _ = results[dist.get_rank()]
    with _blaming_odc_backend(backend):
        _start(name, backend_timeout=resolved_timeout, heap_size=heap_size, requested_nodes=requested_nodes,
               slots=slots, exact=exact, checked=checked, trace=traces[0], run=results[0][6])  # rank 0's run id


def _start(name: str, *, backend_timeout: float, heap_size: int | str | None, requested_nodes: int | None,
           slots: int | None, exact: bool, checked: bool, trace: str | None, run: str) -> None:
    """Create the agreed transport ``name`` and start the runtime on it (the second half of ``init``)."""
    transport = registry.get(name).create(timeout=backend_timeout, heap_size=heap_size)
    try:
        nodes = requested_nodes or transport.node_size()
        if nodes < transport.world_size and not transport.capabilities.signals:
            raise OdcUsageError(
                f"odc_runtime.init(): node size {nodes} < world {transport.world_size} needs put-with-signal, which "
                f"the {name} transport does not have; set ODC_NODE_SIZE={transport.world_size} (one node)"
            )
        if exact:
            check_supported(transport)  # agreed inputs: every rank refuses together
        hierarchy = None
        if nodes < transport.world_size:
            hierarchy = Hierarchy(transport, nodes, slots)
            # A transport may refuse the layout on some ranks only (e.g. a node without peer pointers): agreed.
            gather_checked("init (nodes)", lambda: transport.use_nodes(nodes), exchange=StoreExchange(backend_timeout))
    except BaseException:
        transport.finalize()  # deterministic on every rank (agreed inputs), so every rank gets here together
        raise
    fixed = FixedPointAccumulators(transport, hierarchy) if exact else None
    # The window check runs in debug mode (the setting is agreed), its summaries in the fingerprint's round
    windows = WindowCheck(transport.rank, transport.world_size) if checked else None
    state.start(transport, hierarchy=hierarchy, fixed=fixed, debug=checked, windows=windows)
    telemetry.start(transport.rank, trace, run)
    log.info(
        "odc_runtime initialised: backend=%s rank=%d world=%d node_size=%d deterministic=%s debug=%s", name,
        transport.rank, transport.world_size, nodes, exact, checked,
    )


def is_initialized() -> bool:
    """Whether ``init`` has been called and ``finalize`` has not."""
    return state.current is not None


def finalize() -> None:
    """Collective: wait for peers, then free all symmetric memory. Idempotent.

    Every ``ShardedTensor`` becomes unusable. If a peer is dead the wait ends as soon as that is seen (at the
    latest after ``ODC_TIMEOUT``), the local resources are still released, and the error is raised. If an earlier
    collective already reported a lost or stuck peer, ``finalize`` does not wait again: it releases the local
    resources and returns. A failure that was recorded but never raised to the caller (a stream-ordered ``sync``
    on a GPU returns before its peers arrived; its watchdog may find a dead or stuck peer after the user's last
    call) is raised here, after the release, with its own type: the work since that ``sync`` is not trustworthy.
    Raises OdcUsageError in a forked child of a rank.
    """
    if state.current is None:
        return
    runtime = state.require("finalize")
    transport = runtime.transport
    state.take()
    telemetry.stop()  # never raises (an unwritable trace is warned of): the transport below is always released
    unseen: OdcError | None = None
    try:
        # A transport that saw a peer die or a collective time out records it (``failure``): waiting for the
        # peers again would only add another ODC_TIMEOUT.
        failure = transport.failure  # every transport declares it (None while healthy)
        if failure is None:
            if runtime.debug:
                debug.check(runtime, "finalize()")
            transport.barrier("finalize")
        elif transport.failure_unseen:
            unseen = failure  # found by a watchdog after the user's last call: nobody has seen it yet
        else:
            log.warning("odc_runtime.finalize(): not waiting for peers after an earlier failure: %s", failure)
    finally:
        transport.finalize()
    if unseen is not None:
        transport.failure_raised()
        raise type(unseen)(
            f"odc finalize: an earlier operation failed after it returned and no call raised it until now "
            f"({unseen}); the results since the last sync that completed (gradients, updated shards) are not "
            "trustworthy: do not save them, restart from the last checkpoint"
        ) from unseen


def backend() -> str:
    """Name of the active transport: ``"host"``, ``"symm"``, ``"nvshmem"`` or ``"symm-cpu"``
    (``odc_runtime.transport.names()``)."""
    return state.require("backend", read_only=True).transport.name


def node_size() -> int:
    """Ranks per node of the runtime (ranks ``r`` and ``q`` share a node iff ``r // n == q // n``)."""
    runtime = state.require("node_size", read_only=True)
    hierarchy = runtime.hierarchy
    return runtime.transport.world_size if hierarchy is None else hierarchy.node_size


def world_size() -> int:
    """Number of ranks in the runtime."""
    return state.require("world_size", read_only=True).transport.world_size


def rank() -> int:
    """This process's rank in the runtime."""
    return state.require("rank", read_only=True).transport.rank


def shard(
    tensor: torch.Tensor,
    *,
    accum_dtype: torch.dtype = torch.float32,
    name: str | None = None,
    requires_grad: bool = True,
    group: dist.ProcessGroup | None = None,
) -> ShardedTensor:
    """Collective over *all* ranks: shard ``tensor`` over the ranks of ``group`` (same order, shapes and dtypes on
    every rank).

    ``group`` (a ``torch.distributed`` process group this rank belongs to; ``None`` = all ranks) picks the owners:
    ``fetch``/``push`` of the result read from / add into the shards of ``group``'s ranks only, and
    ``sync(group=group)`` fences just them. Every rank of the world still calls ``shard`` (allocation is symmetric
    over the world), each with its own group; the groups of one call must partition the ranks, e.g. the shard groups
    of a 2-D device mesh (HSDP: ``mesh.get_group("shard")``).

    Each rank keeps its slice of ``tensor``'s values as the initial parameter shard (ranks normally pass the same
    values). A tensor on the ``meta`` device gives zero shards without materialising the full tensor anywhere.
    ``requires_grad=False`` allocates no gradient accumulator (frozen weights, e.g. a LoRA base model).
    ``name`` must be unique among this runtime's live tensors (default ``"shard<n>"``).

    Raises (on every rank together): OdcUsageError for a bad argument, a duplicate name or a group this rank is not
    in, OdcMismatchError if ranks disagree on name, shape or dtypes, pass groups that do not partition the ranks,
    or another rank rejected its arguments,
    OdcMemoryError if the symmetric heap (or the filesystem backing it) cannot hold the tensor,
    OdcTimeoutError / OdcPeerLostError if a peer does not arrive within ``ODC_TIMEOUT``.
    An interrupt (``KeyboardInterrupt``, or an exception a signal handler raises) inside ``shard`` is re-raised as
    it is and fails the runtime (its peers raise OdcPeerLostError within a liveness period): the rank left a
    sequence of collective steps its peers are in (docs/design.md, "Fail-stop").
    Not detected: with default names, two ``shard()`` calls of the same shape and dtypes issued in swapped order
    on different ranks (pass ``name=`` to have names compared); values are never compared across ranks.
    """
    runtime = state.require("shard")
    if runtime.debug:  # before anything changes (the sequence number): a mismatch leaves every rank as it was
        debug.check(runtime, f"shard(name={shorten(repr(name), 60)})")
    seq = next(runtime.shards)
    if name is None:
        name = f"shard{seq}"
        while name in runtime.live_names:  # a user took it: deterministic, since every rank has the same names
            name += "_"

    transport = runtime.transport
    world, me = transport.world_size, transport.rank

    def local_checks() -> tuple[str, int, tuple[int, ...], str, str, bool, tuple[int, ...] | None]:
        ranks = checks.group_ranks("shard()", group, world, me)  # None (all ranks) keeps the exchanged payload small
        if not isinstance(name, str) or not name:
            raise OdcUsageError(f"odc_runtime.shard(): name must be a non-empty str, got {name!r}")
        if name in runtime.live_names:
            raise OdcUsageError(
                f"odc_runtime.shard(): name {shorten(name)!r} is already used by a live ShardedTensor of this "
                "runtime; names must be unique (free the other tensor first, or pick another name)"
            )
        checks.plain_tensor("shard()", tensor)  # a DTensor would fail only after allocating
        if tensor.layout != torch.strided or tensor.is_nested:
            raise OdcUsageError(
                f"odc_runtime.shard(): tensor has layout {tensor.layout}; pass a dense (strided) tensor"
            )
        if tensor.dtype not in PARAM_DTYPES:
            raise OdcUsageError(f"odc_runtime.shard(): dtype {tensor.dtype} not supported; use one of {PARAM_DTYPES}")
        if accum_dtype not in ACCUM_DTYPES:
            raise OdcUsageError(f"odc_runtime.shard(): accum_dtype {accum_dtype} not supported; use torch.float32")
        # The name is compared through a digest of all of it; the readable part is for the error message only.
        identity = f"{shorten(name, 120)} [{op_digest(name).hex()[:12]}]"
        return identity, seq, tuple(tensor.shape), str(tensor.dtype), str(accum_dtype), bool(requires_grad), ranks

    op = f"shard({name}#{seq})"
    allocated: list[SymmetricBuffer] = []  # released in reverse order if a later step fails
    try:
        st = _shard_steps(runtime, op, local_checks, tensor, name, seq, accum_dtype, requires_grad, group, allocated)
    except BaseException as e:
        _undo_shard(runtime, op, e, seq, allocated)
        raise
    runtime.live_names.add(name)
    return st


def _shard_steps(
    runtime: Runtime, op: str, local_checks: Callable[[], tuple], tensor: torch.Tensor, name: str, seq: int,
    accum_dtype: torch.dtype, requires_grad: bool, group: dist.ProcessGroup | None, allocated: list[SymmetricBuffer],
) -> ShardedTensor:
    """The collective steps of ``shard`` (agreement, allocations, initial values, mirrors); every buffer is
    appended to ``allocated`` as soon as it exists."""
    transport = runtime.transport
    world, me = transport.world_size, transport.rank
    results = gather_checked(op, local_checks, exchange=transport)  # bounded by the transport's timeout
    require_same("shard", [r[:-1] for r in results])
    own = tuple(range(world))
    size = -(-tensor.numel() // world)
    if any(r[-1] is not None for r in results):
        groups = [own if r[-1] is None else tuple(r[-1]) for r in results]
        checks.check_partition(groups)
        for g in groups:  # the same list on every rank, so every rank numbers the groups alike
            if len(g) < world and g not in runtime.groups:
                runtime.groups[g] = len(runtime.groups)
        own = groups[me]
        # The largest shard over the groups: every rank allocates the same bytes, so offsets stay symmetric.
        size = max(-(-tensor.numel() // len(g)) for g in groups)
    tag = f"{name}#{seq}"
    param = transport.alloc(size, tensor.dtype, tag=f"{tag}.param")
    allocated.append(param)
    grad = None
    if requires_grad:
        grad = transport.alloc(size, accum_dtype, tag=f"{tag}.grad")
        allocated.append(grad)
        if runtime.fixed is not None:
            runtime.fixed.add(seq, name, grad, tag)  # the int64 accumulator; _undo_shard releases it first
    st = ShardedTensor(
        name, tensor.shape, tensor.dtype, accum_dtype, param, grad, runtime, seq,
        group=None if len(own) == world else group, group_ranks=own,
    )
    if not tensor.is_meta:  # the symmetric buffers start zeroed
        start, stop = st.shard_range
        st.local.copy_(tensor.detach().reshape(-1)[start:stop])
    transport.barrier(op)  # initial values are in place before anyone fetches them
    if runtime.hierarchy is not None and len(own) == world:
        acc = grad if grad is None or runtime.fixed is None else runtime.fixed.accumulator(seq)  # int64 if exact
        runtime.hierarchy.add(seq, size, param, acc, tag, allocated)  # fills the mirrors from the initial values
        transport.barrier(op)  # mirrors filled before any node-mate reads them
    if runtime.windows is not None:  # last: nothing left to fail, so nothing to undo
        runtime.windows.add(st, None if len(own) == world else groups)
    return st


def _undo_shard(runtime: Runtime, op: str, error: BaseException, seq: int, allocated: list[SymmetricBuffer]) -> None:
    """Release what a failed ``shard`` allocated, under the fail-stop rule (docs/design.md, "Fail-stop").

    An error every rank raised at the same step (an agreed rejection, a mismatched round, a full heap: any
    ``OdcError`` but a timeout) leaves every rank with the same allocations, so they are freed collectively
    and the runtime stays usable. Anything else (an interrupt, an exception a signal handler raised, a timed-out
    local wait) struck this rank alone between collective steps its peers wait in: the runtime is failed here
    (peers learn it within a liveness period), the memory is released locally, and the error is re-raised as it
    is, never replaced by a mismatch from a rollback that its peers cannot match."""
    transport = runtime.transport
    if transport.failure is None and (not isinstance(error, OdcError) or isinstance(error, OdcTimeoutError)):
        transport.fail(as_failure(shorten(op), error, "this rank left shard() between its collective steps"))
    if runtime.fixed is not None:
        runtime.fixed.remove(seq)  # collective unless failed; skipped when it was never allocated
    if runtime.hierarchy is not None:
        runtime.hierarchy.remove(seq)  # collective unless failed; skipped when the tensor never got registered
    for buf in reversed(allocated):
        transport.free(buf)  # collective unless the transport failed (then local, without waiting); skips freed


def _check_st(st: object, what: str) -> Runtime:
    """``st`` is a live ShardedTensor of the current runtime, used from the process that owns it."""
    if not isinstance(st, ShardedTensor):
        raise OdcUsageError(
            f"odc_runtime.{what}: expected a ShardedTensor (from odc_runtime.shard()), got {type(st).__name__}"
        )
    return st._check_alive(what)


# -- per-call fast path (odc_runtime.plans) ---------------------------------------------------------------
def _make_plan(runtime: Runtime, st: ShardedTensor, kind: str) -> TransferPlan:
    """The transfer plan of ``st`` for ``kind``: routed through the node hierarchy for its tensors."""
    pieces = layout.transfer_pieces(st.numel, st.group_ranks, st.rank)
    if kind == "push" and runtime.fixed is not None:
        return runtime.fixed.plan(st.seq, pieces)
    hierarchy = runtime.hierarchy
    if hierarchy is not None and hierarchy.has(st.seq):
        return hierarchy.plan(st.seq, kind, pieces)
    buf = st._param if kind == "fetch" else st._grad
    assert buf is not None
    return runtime.transport.plan(buf, kind, pieces)


def _issue(
    plan: TransferPlan, tensor: torch.Tensor, scale: float, async_op: bool, result: torch.Tensor | None
) -> torch.Tensor | Handle | None:
    work = plan.run(tensor, scale, async_op=async_op)
    if async_op:
        assert work is not None
        return Handle(work, result)
    return result


# The fast paths below are written out inline (no helper calls): they run once per tensor per micro-batch, and each
# Python call costs about a tenth of a 4 KiB copy. A plan is taken only from a ShardedTensor of the live runtime
# (its generation) in the process that owns it, under a key that an earlier call passed every check with
# (odc_runtime.plans); the PlanCache refuses plans of freed buffers. Anything else takes the checked path.
# Telemetry (odc_runtime.telemetry) is inline too: the profiler range over the whole call while a profiler records,
# and the counters updated once the call returned, on each path (a wrapper function cost more than the counting).
_COUNTS = telemetry.counts
_PROFILER = telemetry.profiling()
_TINY, _MAX = checks.FP32_TINY, checks.FP32_MAX


def fetch(st: ShardedTensor, out: torch.Tensor | None = None, *, async_op: bool = False) -> torch.Tensor | Handle:
    """Gather the full tensor (original shape) by reading every owner's shard; the owners do nothing.

    ``out`` (optional) must have ``st``'s shape and dtype, live on the transport's device and be contiguous.
    Returns the tensor, or a ``Handle`` whose ``wait()`` returns it when ``async_op=True``.
    """
    ranged = _PROFILER._is_profiler_enabled and telemetry.open_range("odc.fetch")
    try:
        runtime = state.current
        if (
            runtime is not None and type(st) is ShardedTensor and not state.in_forked_child
            and st._generation == runtime.generation
        ):
            transport = runtime.transport
            if out is None:
                plan = st._plans.get(output_key("fetch", transport.stream_key()))
                if plan is not None:
                    out = torch.empty(st.shape, dtype=st.dtype, device=transport.device)
            elif isinstance(out, torch.Tensor):
                # a cached key says out is contiguous (only such keys are cached)
                plan = st._plans.get(tensor_key("fetch", out, transport.stream_key()))
            else:
                plan = None
            if plan is not None:
                if async_op:
                    result = Handle(plan.run(out, 1.0, async_op=True), out)  # type: ignore[arg-type]
                else:
                    plan.run(out, 1.0)  # type: ignore[arg-type]
                    result = out
                st._fetched = True  # the window check's mark (odc_runtime.windows)
                _COUNTS.fetches += 1
                _COUNTS.fetch_bytes += st.nbytes
                return result  # type: ignore[return-value]
        runtime = _check_st(st, "fetch")
        transport = runtime.transport
        device = transport.device
        if out is None:
            key = output_key("fetch", transport.stream_key())
            out = torch.empty(st.shape, dtype=st.dtype, device=device)
        else:
            checks.check_tensor("fetch(out=...)", out, st, device, (st.dtype,))
            if not out.is_contiguous():
                raise OdcUsageError("odc_runtime.fetch(out=...): out must be contiguous")
            if out.is_neg():  # a transport writing its memory would store the values un-negated
                raise OdcUsageError("odc_runtime.fetch(out=...): out has torch's negative bit (a torch._neg_view); "
                                    "pass a plain tensor (out.resolve_neg() copies it into one)")
            if out.requires_grad:
                raise OdcUsageError("odc_runtime.fetch(out=...): out must not require grad (pass a detached tensor)")
            key = tensor_key("fetch", out, transport.stream_key())
        plan = _make_plan(runtime, st, "fetch")
        st._plans.put(key, plan)
        result = _issue(plan, out, 1.0, async_op, out)
        st._fetched = True
        _COUNTS.fetches += 1
        _COUNTS.fetch_bytes += st.nbytes
        return result  # type: ignore[return-value]
    finally:
        if ranged:
            telemetry.close_range(ranged)


def push(st: ShardedTensor, grad: torch.Tensor, *, scale: float = 1.0, async_op: bool = False) -> Handle | None:
    """Add ``grad.flatten()[range_r] * scale`` into every owner r's accumulator; the owners do nothing.

    ``grad`` has ``st``'s full shape, a float dtype (fp32/bf16/fp16) and lives on the transport's device; any
    strided layout is taken element by element (a non-contiguous one is copied to a contiguous one first). The sum
    is visible in the owners' ``st.grad`` after the next ``sync``. With ``async_op=True`` do not modify
    ``grad`` until the returned handle's ``wait()`` returned.
    """
    ranged = _PROFILER._is_profiler_enabled and telemetry.open_range("odc.push")
    try:
        runtime = state.current
        if (
            runtime is not None and type(st) is ShardedTensor and not state.in_forked_child
            and st._generation == runtime.generation and isinstance(grad, torch.Tensor)
        ):  # fast path, see fetch
            key = tensor_key("push", grad, runtime.transport.stream_key())
            plan = st._plans.get(key)
            if plan is not None:  # plans take contiguous tensors of any shape (see below)
                src = grad if key[CONTIGUOUS] else dense(grad)  # type: ignore[index]
                # the scale can change from call to call: checked every time, before any remote effect (inline:
                # checks.scale_value's common case, a float that fp32 represents as non-zero)
                if type(scale) is float and (_TINY <= scale <= _MAX or -_MAX <= scale <= -_TINY):
                    value = scale
                else:
                    value = checks.check_scale("push", scale)
                if async_op:
                    result = Handle(plan.run(src, value, async_op=True), None)  # type: ignore[arg-type]
                else:
                    plan.run(src, value)
                    result = None
                st._pushed = True  # the window check's mark (odc_runtime.windows)
                _COUNTS.pushes += 1
                _COUNTS.push_bytes += grad.nbytes
                return result
        runtime = _check_st(st, "push")
        if st._grad is None:
            raise OdcUsageError(
                f"odc_runtime.push: {st.name!r} was sharded with requires_grad=False and has no gradient accumulator"
            )
        transport = runtime.transport
        checks.check_tensor("push(grad)", grad, st, transport.device, PARAM_DTYPES)
        value = checks.scale_value(scale)
        key = tensor_key("push", grad, transport.stream_key())
        plan = _make_plan(runtime, st, "push")
        st._plans.put(key, plan)
        # Not reshape(-1): it returns a *view* of a tensor whose strides collapse to one (big[::2], an expand, a 2-D
        # view of a strided 1-D one), and a pointer-based plan (symm, nvshmem) reads numel consecutive elements
        # from its address, as they are in memory (a negative bit unapplied). dense() copies exactly the tensors
        # the plan key's contiguity rejects.
        src = grad if key[CONTIGUOUS] else dense(grad)  # type: ignore[index]
        result = _issue(plan, src, value, async_op, None)
        st._pushed = True
        _COUNTS.pushes += 1
        _COUNTS.push_bytes += grad.nbytes
        return result  # type: ignore[return-value]
    finally:
        if ranged:
            telemetry.close_range(ranged)


@telemetry.counted_sync
def sync(group: dist.ProcessGroup | None = None, *, gradients: bool = True, parameters: bool = True) -> None:
    """Collective fence, at minibatch boundaries: a core-API loop calls it twice per minibatch, after the pushes and
    after the optimizer step and ``zero_grad`` (docs/core-api.md, "Why two syncs per minibatch").

    After it returns on any rank, every push issued by any rank before its ``sync()`` is in the owners'
    ``st.grad``, and every write to ``st.local`` made before it is what any later ``fetch`` returns.

    With ``group`` (a process group passed to ``shard`` before; this rank must be a member) only that group's
    ranks take part, and the guarantee holds for the tensors sharded over it: their pushes and writes are fenced.
    Calls with and without a group must come in the same order on the ranks they share (a rank in a group sync
    that a member meets in a world-wide collective raises OdcMismatchError on both, where the transport can tell).
    Raises OdcUsageError for a group this rank is not in or that no tensor was sharded over, or a transport without
    group fences (nvshmem for now: call ``sync()`` without a group). On GPU this
    holds in stream order (work queued after ``sync()`` on the current stream sees it) and the host does not wait
    for the barrier itself, only for the previous one. Raises OdcTimeoutError naming the missing ranks if a peer
    does not arrive within ``ODC_TIMEOUT`` seconds (on GPU: at the next ``sync()``, ``finalize()`` or any later
    call, at most ``ODC_TIMEOUT`` after the barrier that missed it).

    With nodes smaller than the world (``init(node_size=...)``), tensors sharded over all ranks go through the
    hierarchical protocol, and a world ``sync`` does two more things for them: it delivers the pushes staged for
    owners on other nodes (``gradients``) and refreshes the node-local copies of other nodes' shards that
    ``fetch`` reads (``parameters``). Each flag may be ``False`` when the caller knows there is nothing to move,
    to save the bytes: ``gradients=False`` leaves staged pushes where they are (nothing is lost; they arrive at
    the next ``sync`` with ``gradients=True``), ``parameters=False`` promises that no ``st.local`` of such a
    tensor was written since the last ``sync`` with ``parameters=True`` (else fetches from other nodes keep
    returning the older values). Both flags must be the same on every rank; without nodes they change nothing.
    In deterministic mode ``gradients=False`` delivers staged pushes all the same (their fixed-point scale is this
    sync's; a sync after which nobody pushed moves nothing anyway).
    """
    runtime = state.require("sync")
    transport = runtime.transport
    if not isinstance(gradients, bool) or not isinstance(parameters, bool):
        raise OdcUsageError(
            f"odc_runtime.sync(): gradients and parameters must be bools, got {gradients!r} and {parameters!r}"
        )
    ranks = checks.group_ranks("sync(group=...)", group, transport.world_size, transport.rank)
    if ranks is None:
        _world_sync(runtime, gradients, parameters)
        return
    if runtime.fixed is not None:
        raise OdcUsageError(
            "odc_runtime.sync(group=...) in deterministic mode: the fixed-point bounds are agreed in a world round; "
            "call odc_runtime.sync() without a group (all ranks fence together, as HSDP does per minibatch)"
        )
    index = runtime.groups.get(ranks)
    if index is None:
        raise OdcUsageError(
            f"odc_runtime.sync(group=...): no tensor was sharded over the group of ranks {list(ranks)}; pass a group "
            "given to odc_runtime.shard(group=...) (the group your tensors' pushes went to), or None for all ranks"
        )
    op = f"sync(group={list(ranks)})"
    # The group fence compares its members' operations (a drifted one raises OdcRoundMismatchError on every member);
    # in debug mode the operation carries the call site, at no extra round (odc_runtime.debug)
    transport.group_barrier(f"{op} at {debug.call_site()}" if runtime.debug else op, Group(index, ranks))
    if runtime.windows is not None:
        runtime.windows.close_group(ranks)


def _world_sync(runtime: Runtime, gradients: bool, parameters: bool) -> None:
    """The world ``sync``: the fence of the transport, the hierarchy or the deterministic accumulators; in debug
    mode after the fingerprint round, which also carries the window check's summaries, whose verdict is raised once
    the fence completed (on every rank alike: every rank has the same summaries; odc_runtime.windows)."""
    windows = runtime.windows
    summaries = None
    if runtime.debug:
        summaries = debug.check(runtime, "sync()" if gradients and parameters else
                                f"sync(gradients={gradients}, parameters={parameters})",
                                b"" if windows is None else windows.summary())
    if runtime.fixed is not None:
        runtime.fixed.sync("sync", gradients=gradients, parameters=parameters)
        if windows is not None:
            windows.resample()  # the sync wrote st.grad itself
    elif runtime.hierarchy is None:
        runtime.transport.barrier("sync")
    else:
        runtime.hierarchy.sync("sync", gradients=gradients, parameters=parameters)
    if windows is not None and summaries is not None:
        error = windows.verdict(summaries)
        if error is not None:
            log.error("%s", error)
            raise error
