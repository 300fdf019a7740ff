"""The transport contract: symmetric memory plus one-sided fetch / push, quiet and barrier.

The core API (``odc_runtime.api``) is written once against this interface; ``host`` (shared memory between
processes on one machine) and ``nvshmem`` (GPUs) implement it. Keep it this small.

Semantics every transport provides:

* ``alloc`` is collective: every rank calls it in the same order with the same arguments and gets a
  ``SymmetricBuffer`` whose ``local`` tensor is this rank's region. Peers address the same buffer by
  ``(buffer, peer)``. ``free`` is collective too and never lets a later allocation alias a region that a live
  tensor still views (the transport refuses, defers the reuse, or keeps the memory alive).
* ``fetch`` copies a peer's region into a local tensor; ``push`` adds ``src * scale`` (converted to the
  buffer's dtype) into a peer's region. Concurrent pushes from any number of ranks into the same region are
  exact (no lost updates). With ``async_op=False`` they are issued in the caller's order (on GPU: ordered on the
  current CUDA stream, so the host does not wait for them); with ``async_op=True`` they run concurrently with
  the caller and return a ``Work`` whose ``wait()`` orders the caller after them. ``quiet`` completes every
  operation this rank issued, asynchronous ones included.
* ``barrier`` is collective and implies ``quiet`` on every rank: after it (on GPU: after it in stream order),
  every push issued by any rank before its barrier call is visible in the owner's region, and every write
  a rank made to its own regions before the barrier is what any later ``fetch`` returns.
* Every wait that a dead or stuck peer can block gives up after ``timeout`` seconds with
  ``OdcTimeoutError`` naming the operation and the ranks that did not answer (on GPU
  the error may surface at the next call into the transport, because waits are stream-ordered).
* ``Transport.plan`` returns a ``TransferPlan``: the validated, reusable form of one fetch or push
  pattern (which peer receives which slice of a flat tensor), so that the core API's steady-state calls skip
  validation and request building. Transports may subclass it to precompute their own state (peer pointers).
* ``offset`` (in ``FetchRequest``, ``PushRequest``, ``Piece``, ``PutRequest``) is an
  element offset into the peer's region; ``offset + numel`` never exceeds the buffer's ``numel`` (the caller
  checks).
* ``Transport.put_signal`` writes a local tensor into a peer's region and then adds 1 to a word of the peer's
  ``int64`` *signal* buffer; a rank that sees the word reach a count sees the data of every put counted in it.
  ``Transport.wait_signal`` waits for a local signal word to reach a count (on GPU: the current stream waits,
  the host does not; a wait that misses ``timeout`` is released and raised at the next call). Signal words only
  grow, so a waiter compares against a running count and never resets them.
* ``Transport.node_size`` is how many consecutive ranks share a node (a fast, atomics-capable domain: one
  machine for ``host``, one NVLink domain for ``nvshmem``); the core API may declare a smaller *virtual* node.
* ``Transport.group_barrier`` is ``Transport.barrier`` among the ranks of a ``Group`` only (the other
  ranks do not take part). Allocation stays collective over *all* ranks (offsets are symmetric across the whole
  world); only fences are scoped. A transport without group fences raises
  ``OdcUsageError`` (the default).

Declared state and capabilities (read directly by the layers above; never detected by probing for overrides):

* ``Transport.failure`` is ``None`` while the transport is healthy and the first fatal
  ``OdcError`` once it is not (a peer lost, a collective timed out or mismatched, an
  operation interrupted after it changed shared state: see docs/design.md, "Fail-stop"). Once set, every later
  operation raises at once and ``finalize`` releases local resources without waiting for the peers.
* ``Transport.device_type`` is the ``torch.device`` type of the tensors it works on.
* ``Transport.capabilities`` says which optional parts of the contract it implements
  (``Capabilities``: signalled puts, group fences, a node layout below the world).
* ``Transport.exchange`` is a bounded all-gather of small payloads used by the core API's agreement steps
  (default: through the ``torch.distributed`` store, ``odc_runtime.agree.StoreExchange``).

Lifecycle and call order: ``create`` (collective) → any number of collective ``alloc`` / ``free`` / ``barrier`` /
``group_barrier`` / ``exchange`` in the same order on every rank (group fences: in the same order on the ranks
they share), with one-sided ``fetch`` / ``push`` / ``put_signal`` between them → ``finalize`` (idempotent).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from odc_runtime.errors import OdcBackendError, OdcError, OdcUsageError

T = TypeVar("T")


def as_failure(op: str, error: BaseException, what: str) -> OdcError:
    """The failure to record when ``error`` escaped ``op`` after ``what`` (a change of shared state)."""
    if isinstance(error, OdcError):
        return error
    return OdcBackendError(
        f"odc {op}: interrupted by {type(error).__name__} after {what}; the ranks' protocol state is no longer "
        "consistent, so the runtime is unusable (call odc_runtime.finalize() and restart the job)"
    )


def raw_stream(device_index: int) -> int:
    """The current CUDA stream of ``device_index`` as a ``cudaStream_t`` integer (cheap where torch allows): what
    a GPU transport's ``Transport.stream_key`` returns, and the stream its launches go to."""
    return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # what torch's own generated code uses: no Stream object
    raw_stream = torch._C._cuda_getCurrentRawStream  # type: ignore[assignment]


@dataclass(frozen=True)
class Capabilities:
    """The optional parts of the contract a transport implements.

    Attributes:
        signals: ``Transport.put_signal`` / ``Transport.wait_signal`` (needed by the hierarchical
            protocol, i.e. nodes smaller than the world).
        group_fences: ``Transport.group_barrier`` (``sync(group=...)``).
        nodes: ``Transport.node_size`` may be below the world size (a real multi-node layout).
        deterministic: ``Transport.push`` into an ``int64`` buffer (scale 1) adds exactly, so the core API's
            deterministic mode (``odc_runtime.deterministic``) can run on it.
    """

    signals: bool = False
    group_fences: bool = False
    nodes: bool = False
    deterministic: bool = False


class Work(abc.ABC):
    """Completion handle of an asynchronous operation (returned with ``async_op=True``)."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation completed (GPU: make the current stream wait for it).

        Re-raises any error the operation hit. ``timeout`` bounds the host-side wait in seconds.
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Whether the operation already completed (non-blocking)."""


@dataclass(eq=False)
class SymmetricBuffer:
    """One collective allocation: ``numel`` elements of ``dtype`` on every rank.

    ``local`` is this rank's region (1-D). ``handle`` is transport-private (offset in a heap, a device address).
    """

    numel: int
    dtype: torch.dtype
    local: torch.Tensor
    handle: object
    tag: str = ""
    freed: bool = field(default=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Group:
    """A set of ranks that a fence is scoped to.

    ``index`` is agreed by every rank of the world (the core API numbers groups in the order ``shard`` first saw
    them, from the same exchanged data on every rank), so a transport can use it to address per-group state in
    symmetric memory. ``ranks`` are global ranks in group-rank order.
    """

    index: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class FetchRequest:
    """Fetch: copy ``dst.numel()`` elements from ``peer``'s region of the buffer, starting at element ``offset``, into
    ``dst``."""

    peer: int
    dst: torch.Tensor
    offset: int = 0


@dataclass(frozen=True)
class PushRequest:
    """Push: add ``src * scale`` into ``peer``'s region of the buffer at ``[offset, offset + src.numel())``."""

    peer: int
    src: torch.Tensor
    offset: int = 0


@dataclass(frozen=True)
class PutRequest:
    """Write ``src`` (the buffer's dtype) into ``peer``'s region at ``[offset, offset + src.numel())``, then add 1
    to word ``signal_index`` of ``peer``'s signal buffer once the data is delivered."""

    peer: int
    src: torch.Tensor
    offset: int
    signal_index: int


@dataclass(frozen=True)
class Piece:
    """One peer's part of a planned transfer: elements ``[start, start + numel)`` of the flat local tensor
    go to (push) or come from (fetch) elements ``[offset, offset + numel)`` of ``peer``'s region."""

    peer: int
    start: int
    numel: int
    offset: int = 0


class TransferPlan:
    """A validated fetch or push pattern over a flat local tensor, reusable across calls.

    The generic plan slices the tensor and calls ``Transport.fetch`` / ``Transport.push``;
    transports override ``Transport.plan`` to return a subclass with precomputed state. A plan is only valid
    while its buffer is allocated and for the stream key it was made for (the caller checks both).
    """

    __slots__ = ("buf", "kind", "pieces", "stream_key", "transport")

    def __init__(
        self, transport: Transport, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece], stream_key: object
    ) -> None:
        if kind not in ("fetch", "push"):
            raise ValueError(f"unknown plan kind {kind!r}")
        self.transport = transport
        self.buf = buf
        self.kind = kind
        self.pieces = tuple(pieces)
        self.stream_key = stream_key

    def run(self, tensor: torch.Tensor, scale: float = 1.0, *, async_op: bool = False) -> Work | None:
        """Issue the planned operation on ``tensor``: the caller's validated, contiguous tensor of any shape whose
        flattened elements the pieces index (no view is made on the fast path; this generic plan flattens it)."""
        flat = tensor.detach().reshape(-1)
        if self.kind == "fetch":
            reads = [FetchRequest(p.peer, flat[p.start : p.start + p.numel], p.offset) for p in self.pieces]
            return self.transport.fetch(self.buf, reads, async_op=async_op)
        adds = [PushRequest(p.peer, flat[p.start : p.start + p.numel], p.offset) for p in self.pieces]
        return self.transport.push(self.buf, adds, scale, async_op=async_op)

    def run_fixed(self, tensor: torch.Tensor, scale: float, shift: int) -> bool:
        """Deterministic mode's fused push (``odc_runtime.deterministic``): add ``round_half_even(fp32(tensor *
        scale) * 2**shift)`` into this plan's ``int64`` buffer, quantising on the way, synchronously. Returns
        ``False`` where the transport does not fuse it (the generic plan never does): the caller then quantises
        and runs an ``int64`` push."""
        return False


class Transport(abc.ABC):
    """Symmetric memory with one-sided fetch / push, quiet and barrier (see module docstring)."""

    name: str = "abstract"
    device_type: ClassVar[str] = "cpu"
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = timeout
        # None while healthy; the first fatal error once the runtime is unusable (see the module docstring).
        self.failure: OdcError | None = None
        # Whether ``failure`` was found away from the caller (a watchdog thread, for a stream-ordered operation)
        # and no call has raised it to the caller yet: ``finalize`` then raises it instead of only logging it.
        self.failure_unseen = False

    def fail(self, error: OdcError) -> OdcError:
        """Record ``error`` as this transport's failure (the first one wins) and return the recorded failure."""
        if self.failure is None:
            self.failure = error
        return self.failure

    def fail_unseen(self, error: OdcError) -> OdcError:
        """``fail`` for a failure found away from the caller (a watchdog thread; the first recorded failure still
        wins): the transport's failure is unseen until a call raises it (``failure_raised``)."""
        failure = self.fail(error)
        self.failure_unseen = True
        return failure

    def failure_raised(self) -> None:
        """The recorded failure is being raised to the caller (it is no longer unseen)."""
        self.failure_unseen = False

    def fail_stop(self, op: str, what: str, step: Callable[[], T], *, aligned: tuple[type, ...] = ()) -> T:
        """Run ``step``, a protocol step that changes shared state before it can fail (``what`` says which, for
        the message): any exception escaping it, except the ``aligned`` types (errors that leave every rank's
        protocol state consistent), records the failure (``fail``) and is re-raised unchanged, so an
        interrupt stays an interrupt while every later operation raises the recorded failure."""
        try:
            return step()
        except aligned:
            raise
        except BaseException as e:
            self.fail(as_failure(op, e, what))
            raise

    def check_usable(self, op: str) -> None:
        """Raise (a fresh error of the recorded failure's type) if the transport has failed."""
        failure = self.failure
        if failure is not None:
            self.failure_raised()
            raise type(failure)(
                f"odc {op}: the runtime is unusable since an earlier operation failed ({failure}); call "
                "odc_runtime.finalize() and restart the job"
            )

    def exchange(self, op: str, payload: bytes, *, label: str | None = None) -> list[bytes]:
        """Collective: one bounded all-gather of ``payload`` (small: at most about 1.9 KB) from every rank.

        Returns every rank's payload (indexed by rank). Raises OdcMismatchError when ranks are in different
        operations (``op`` is compared), OdcPeerLostError / OdcTimeoutError naming the ranks that did not arrive
        within ``timeout``. ``label`` (default ``op``) is what messages call the round, on every rank: the user's
        operation where ``op`` is an internal round's constant name. The default goes through the
        ``torch.distributed`` store; a transport may offer a faster one."""
        from odc_runtime.agree import StoreExchange  # agree imports torch.distributed; keep base light

        return StoreExchange(self.timeout).exchange(op, payload, label=label)

    # -- memory ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, numel: int, dtype: torch.dtype, tag: str = "") -> SymmetricBuffer:
        """Collective: allocate ``numel`` zero-initialised elements of ``dtype`` on every rank.

        Raises ``OdcMemoryError`` (on every rank, before allocating anything) when the
        symmetric heap cannot hold it.
        """

    @abc.abstractmethod
    def free(self, buf: SymmetricBuffer) -> None:
        """Collective: release a buffer allocated by ``alloc`` (same order on all ranks)."""

    @abc.abstractmethod
    def heap_capacity(self) -> int:
        """Bytes of symmetric memory this rank may allocate in total."""

    @abc.abstractmethod
    def heap_used(self) -> int:
        """Bytes of symmetric memory held by this rank's live buffers (allocated and not yet freed), alignment
        padding included. A ``free`` lowers it at once and a refused ``alloc`` leaves it unchanged, on every
        transport. It is not the complement of what can still be allocated: a transport may keep a freed range
        from reuse for a while (nvshmem quarantines it while a tensor still views it), and the heap-exhausted
        error names such buffers."""

    # -- one-sided operations -------------------------------------------------------------------------
    @abc.abstractmethod
    def fetch(self, buf: SymmetricBuffer, requests: Sequence[FetchRequest], *, async_op: bool = False) -> Work | None:
        """Issue the copies in ``requests`` (from peers' regions of ``buf`` into local tensors).

        Requests are issued in the given order; the caller rotates peers so owners are not all hit at once.
        Returns a ``Work`` with ``async_op=True``, else ``None``.
        """

    @abc.abstractmethod
    def push(
        self, buf: SymmetricBuffer, requests: Sequence[PushRequest], scale: float, *, async_op: bool = False
    ) -> Work | None:
        """Issue ``peer_region[:n] += src.to(buf.dtype) * scale`` for every request.

        Returns a ``Work`` with ``async_op=True``, else ``None``.
        """

    def plan(self, buf: SymmetricBuffer, kind: str, pieces: Sequence[Piece]) -> TransferPlan:
        """A reusable plan of ``kind`` (``"fetch"`` or ``"push"``) for ``pieces`` of ``buf``.

        The caller has validated everything; the plan is valid for ``stream_key`` at this moment.
        """
        return TransferPlan(self, buf, kind, pieces, self.stream_key())

    def stream_key(self) -> object:
        """Identity of the execution context that plans depend on (GPU: the current CUDA stream)."""
        return None

    @abc.abstractmethod
    def quiet(self) -> None:
        """Complete every operation this rank issued (including asynchronous ones)."""

    @abc.abstractmethod
    def barrier(self, op: str = "barrier") -> None:
        """Collective fence (implies quiet everywhere). ``op`` names the caller in timeout errors."""

    # -- signalled puts (the hierarchical push across nodes, odc_runtime.hierarchy) --------------------------
    def put_signal(self, buf: SymmetricBuffer, requests: Sequence[PutRequest], signal: SymmetricBuffer) -> None:
        """For every request: write ``src`` into ``peer``'s region of ``buf`` at ``offset``, then add 1 to
        ``peer``'s ``signal[signal_index]`` (an ``int64`` buffer from ``alloc``) after the data is delivered.

        Issued in order (GPU: on the current stream; ``src`` may be reused after it in stream order). Completion
        at the peer is what the signal says; ``quiet`` / ``barrier`` complete them too. A transport
        without signalled puts (``capabilities.signals`` false) raises ``OdcUsageError``
        (the default).
        """
        raise OdcUsageError(
            f"odc: the {self.name} transport has no put-with-signal, so it cannot run the hierarchical (multi-node) "
            "protocol; set ODC_NODE_SIZE to the world size (one node)"
        )

    def wait_signal(self, signal: SymmetricBuffer, index: int, value: int, op: str, peers: Sequence[int]) -> None:
        """Wait until this rank's ``signal[index] >= value`` (GPU: the current stream waits; the host does not).

        ``peers`` are the ranks whose puts count into the word, named in the OdcTimeoutError / OdcPeerLostError
        raised when the count is not reached within ``timeout`` (on GPU: at the next call into the transport,
        after the stream's wait was released so that nothing stays blocked).
        """
        raise OdcUsageError(f"odc {op}: the {self.name} transport has no signal waits")

    def node_size(self) -> int:
        """How many consecutive ranks share a node (ranks ``r`` and ``q`` share one iff ``r // n == q // n``).

        Same on every rank. The default, one node of every rank, is right for a transport whose ranks all share
        one machine."""
        return self.world_size

    def use_nodes(self, node_size: int) -> None:  # noqa: B027 (optional hook, not abstract: most need nothing)
        """Called once by ``init`` when the hierarchical protocol is on (``node_size`` below the world size): from
        then on the core API pushes into ranks of the caller's node only, except for tensors of a proper
        subgroup. A transport whose push protocol depends on that (nvshmem: intra-node atomics in a
        multi-node job) switches here; the default changes nothing."""

    def group_barrier(self, op: str, group: Group) -> None:
        """Collective over ``group.ranks`` only: ``barrier``'s guarantees among those ranks (implies quiet on
        each of them; pushes a member issued before it are visible in the owners' regions, writes a member
        made to its own regions before it are what later gets return). This rank must be a member."""
        raise OdcUsageError(
            f"odc {op}: the {self.name} transport has no group-scoped fence; call odc_runtime.sync() without a "
            "group (all ranks fence together)"
        )

    @abc.abstractmethod
    def finalize(self) -> None:
        """Release every resource; idempotent; must not hang if peers are gone."""

