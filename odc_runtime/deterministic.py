"""Deterministic gradient accumulation (``odc.init(deterministic=True)`` / ``ODC_DETERMINISTIC=1``): the same
pushes give the same gradient bits whatever order they reach their owners in.

Pushes land in an ``int64`` fixed-point accumulator beside each tensor's fp32 one; integer addition is associative,
so the sum does not depend on arrival order. Each *unit* (one sharded tensor) has a power-of-two scale for the
current *window* (the pushes between two ``sync`` calls), fixed at the previous ``sync`` from the largest
contribution every rank saw in the window before, with headroom. Per element and window:

* a contribution ``v`` (``src * scale`` in fp32) with ``|v| < 2**E`` becomes ``q = round(v * 2**F)``, ``F =
  P - E``, so ``|q| <= 2**P``; at most ``2**PUSH_BITS`` pushes per unit, rank and window, and ``P = 62 -
  PUSH_BITS - ceil(log2(world))``, so no sum of a window can exceed ``2**62`` in magnitude (no wrap, by bound);
* a contribution the bound does not cover (``|v| >= 2**E`` or not finite) is found at the next ``sync`` from the
  window's range, which each push folds into two device scalars per unit (no host synchronisation per push); one
  push too many is refused before it is issued. The next ``sync`` raises ``OdcOverflowError`` on every rank,
  discards the window's int64 sums on every rank before any of them reaches ``st.grad`` (which keeps what it had;
  an uncovered contribution's integers are meaningless, and are zeroed with the rest) and raises the bound to what
  was seen, so the same minibatch retried succeeds;
* ``sync`` (three world rounds, through the transport contract only): round 1 exchanges each rank's largest
  exponent per unit and its overflow flags; round 2, a ``barrier``, fences the pushes; every rank then adds ``acc
  * 2**-F`` (fp64, then fp32) into ``st.grad`` and zeroes ``acc``; round 3 keeps peers' next pushes out until the
  conversion is done. A window without pushes anywhere skips the conversion and round 3.

With nodes smaller than the world (``odc_runtime.hierarchy``), the hierarchy routes the ``int64`` pushes: its
accumulator for a tensor is the unit's ``int64`` one, its staging rows and inboxes are ``int64``, and its fold is an
exact integer add. Every staged row holds a sub-sum of the window's quantised contributions at the same scale
``2**-F``, so it is bounded by the same ``2**62`` and any grouping gives the same integer as the flat mode: the same
bits. ``sync`` is then round 1 (the exchange), round 2 = the hierarchy's barrier 1 (pushes into staging rows and
same-node accumulators fenced), the flush of the staging rows of every tensor pushed into (agreed in round 1; or,
in a discarded window, their zeroing on every rank, with no puts), the mirror refresh, this rank's conversion
(after its own folds: no barrier needed before it), and round 3 = the hierarchy's barrier 2. ``gradients=False``
does not keep staged pushes staged in this mode: a staged value carries this window's scale, so it is delivered
and converted in this window (a window nobody pushed in moves nothing, which is what the flag is for). Memory per
rank and hierarchical tensor: ``8·S`` (the ``int64`` accumulator) + ``8·(M-1)·S`` staging + ``8·K·S`` inbox, beside
the default mode's fp32 accumulator and parameter-dtype mirror, for ``S`` shard elements, ``M`` nodes and ``K``
inbox slots.

The choice, the measured alternatives, the precision and the cost are in docs/design.md ("Deterministic
accumulation"). The transport sees only ``int64`` pushes with scale 1 (any transport whose push adds exactly into
``int64`` supports it: ``Capabilities.deterministic``).
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from odc_runtime.errors import OdcOverflowError, OdcUsageError
from odc_runtime.transport.base import Piece, SymmetricBuffer, TransferPlan, Transport, Work

if TYPE_CHECKING:
    from odc_runtime.hierarchy import Hierarchy

log = logging.getLogger("odc_runtime.deterministic")

PUSH_BITS = 12  # at most 4096 pushes per unit, rank and window
MARGIN_BITS = 4  # next window's bound: 16x the largest contribution seen in this one
INITIAL_EXPONENT = 4  # bound of a unit's first window: |contribution| < 16
MIN_EXPONENT, MAX_EXPONENT = -100, 100  # keeps 2**F and 2**-F normal in fp32 and fp64
NONE = -32768  # "no contribution seen" in the exchanged exponents
_ENTRY = struct.Struct("<hB")  # per unit: largest exponent seen (int16), overflow flags (uint8)
_PER_ROUND = 1800 // _ENTRY.size  # units per exchange round (a round carries at most about 1.9 KB)
_BOUND, _NONFINITE, _TOO_MANY = 1, 2, 4
_ROUNDER = 1.5 * 2.0**52  # kernels/peer.py's push_kernel uses the same constant and its bits
_ROUNDER_BITS = struct.unpack("<q", struct.pack("<d", _ROUNDER))[0]
_CONVERT_ELEMS = 1 << 20  # elements converted at a time at sync (8 MiB of fp64 temporaries)


def fraction_bits(world_size: int) -> int:
    """``P``: bits of a contribution's magnitude below its bound (62 minus the headroom for every push)."""
    return 62 - PUSH_BITS - max(0, math.ceil(math.log2(world_size)))  # <= 50: the rounding below needs < 2**51


@dataclass
class _Unit:
    """The fixed-point state of one sharded tensor."""

    name: str
    acc: SymmetricBuffer  # int64, as many elements as the tensor's fp32 accumulator
    grad: SymmetricBuffer  # the fp32 accumulator st.grad views
    exponent: int = INITIAL_EXPONENT  # E: every contribution of this window is below 2**E
    pushes: int = 0  # pushes this rank made into this unit in this window
    flags: int = 0  # pushes of this window refused before they were issued (_TOO_MANY)
    # The window's smallest and largest contribution this rank pushed, per stream (plans are per stream: pushes on
    # two CUDA streams never update one pair unordered), as two 0-dim fp32 tensors on the tensor's device (NaN once
    # one was NaN): read once per sync, never per push (on a GPU, a read is a device synchronisation).
    ranges: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def observe(self, tensor: torch.Tensor, scale: float, stream: object = None) -> None:
        """Fold the range of ``fp32(tensor * scale)`` into ``ranges[stream]``, on the tensor's device.

        Whether the window's bound covers the values is decided at ``sync`` from it: a value it does not cover (or
        NaN/inf) gives meaningless integers, which that ``sync`` discards on every rank with the rest of the window.
        The range is the source's, scaled: fp32 rounding is monotone, so ``fp32(min(src) * scale)`` is the smallest
        ``fp32(src * scale)`` (the largest for a negative scale), without a scaled copy of the tensor."""
        if not tensor.numel():
            return
        lo, hi = torch.aminmax(tensor.detach().reshape(-1))  # one pass; NaN propagates (and through min/max)
        lo, hi = lo.to(torch.float32), hi.to(torch.float32)
        if scale != 1.0:
            lo, hi = (lo * scale, hi * scale) if scale >= 0 else (hi * scale, lo * scale)
        pair = self.ranges.get(stream)
        if pair is None:
            pair = self.ranges[stream] = torch.zeros(2, dtype=torch.float32, device=tensor.device).unbind()
        torch.minimum(pair[0], lo, out=pair[0])
        torch.maximum(pair[1], hi, out=pair[1])


class _Done(Work):
    """The work of a push that was refused (nothing to wait for; the refusal is reported by ``sync``)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class FixedPointPlan(TransferPlan):
    """A push plan that quantises the gradient and pushes ``int64`` into the unit's fixed-point accumulator."""

    __slots__ = ("_accumulators", "_inner", "_unit")

    def __init__(self, accumulators: FixedPointAccumulators, unit: _Unit, inner: TransferPlan) -> None:
        super().__init__(inner.transport, unit.acc, "push", inner.pieces, inner.stream_key)
        self._inner = inner
        self._unit = unit
        self._accumulators = accumulators

    def run(self, tensor: torch.Tensor, scale: float = 1.0, *, async_op: bool = False) -> Work | None:
        fixed, unit = self._accumulators, self._unit
        if not fixed.admit(unit):
            return _Done() if async_op else None
        unit.observe(tensor, scale, self.stream_key)
        if not async_op and self._inner.run_fixed(tensor, scale, fixed.shift(unit)):
            return None  # quantised in the transport's push kernel
        return self._inner.run(fixed.quantize(unit, tensor, scale), 1.0, async_op=async_op)


class FixedPointAccumulators:
    """Every unit of a runtime in deterministic mode: allocation beside ``shard``, push plans, the ``sync``."""

    def __init__(self, transport: Transport, nodes: Hierarchy | None = None) -> None:
        """``nodes``: the runtime's hierarchy (nodes smaller than the world), which routes the ``int64`` pushes of
        the tensors it holds (registered by the caller with ``accumulator`` as their accumulator)."""
        self.transport = transport
        self.nodes = nodes
        self.precision = fraction_bits(transport.world_size)  # P
        self.units: dict[int, _Unit] = {}  # by shard sequence number (the same on every rank)

    # -- allocation (collective, beside shard / free) ---------------------------------------------------
    def add(self, seq: int, name: str, grad: SymmetricBuffer, tag: str) -> None:
        acc = self.transport.alloc(grad.numel, torch.int64, tag=f"{tag}.fixed")
        self.units[seq] = _Unit(name, acc, grad)

    def remove(self, seq: int) -> None:
        unit = self.units.get(seq)
        if unit is not None:
            # Freed before it is forgotten: a mismatched free (OdcMismatchError, nothing freed) keeps the unit, so
            # later pushes still find it and a retried free resumes here (as the hierarchy does, issue 34 item 2).
            self.transport.free(unit.acc)
            del self.units[seq]

    def has(self, seq: int) -> bool:
        return seq in self.units

    def accumulator(self, seq: int) -> SymmetricBuffer:
        """The ``int64`` accumulator of a unit (what the hierarchy folds into and routes same-node pushes to)."""
        return self.units[seq].acc

    def bytes_per_rank(self) -> int:
        """Symmetric memory the mode adds on this rank: the ``int64`` accumulators (with nodes, the hierarchy's
        staging rows and inboxes are ``int64`` too, 4 more bytes per element each, not counted here)."""
        return sum(u.acc.nbytes for u in self.units.values())

    def plan(self, seq: int, pieces: Sequence[Piece]) -> TransferPlan:
        unit = self.units[seq]
        if self.nodes is not None and self.nodes.has(seq):  # same-node owners' acc, proxies' int64 staging rows
            return FixedPointPlan(self, unit, self.nodes.plan(seq, "push", pieces))
        return FixedPointPlan(self, unit, self.transport.plan(unit.acc, "push", pieces))

    # -- push ------------------------------------------------------------------------------------------
    def admit(self, unit: _Unit) -> bool:
        """Count a push into ``unit``; ``False`` (recorded, nothing may be sent) for one push too many."""
        if unit.pushes >= 1 << PUSH_BITS:
            unit.flags |= _TOO_MANY
            log.warning(
                "odc push into %r refused in deterministic mode (%s); nothing was written, the next sync raises "
                "OdcOverflowError on every rank", unit.name, _describe(_TOO_MANY, 0.0, unit.exponent),
            )
            return False
        unit.pushes += 1
        return True

    def shift(self, unit: _Unit) -> int:
        """``F``: a contribution ``v`` of this window is quantised as ``round_half_even(v * 2**F)``."""
        return self.precision - unit.exponent

    def quantize(self, unit: _Unit, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        """``round_half_even(fp32(tensor * scale) * 2**F)`` as ``int64`` (torch ops; the symm transport's push
        kernel computes the same integers in registers). Deterministic: the default mode's fp32 product, an exact
        power-of-two scaling and round-half-even."""
        v = tensor.detach().reshape(-1).to(torch.float32)
        if scale != 1.0:
            v = v * scale
        # v * 2**F is exact in fp64 and below 2**P <= 2**50 in magnitude when the bound covers v, so adding 1.5 *
        # 2**52 rounds it to an integer in the low mantissa bits (one pass instead of round + cast).
        q = v.to(torch.float64).mul_(math.ldexp(1.0, self.shift(unit))).add_(_ROUNDER)
        return q.view(torch.int64).sub_(_ROUNDER_BITS)

    def _window(self, units: list[_Unit]) -> list[tuple[int, int]]:
        """This rank's ``(largest frexp exponent seen, flags)`` per unit for the window: one read of every range (one
        device synchronisation per ``sync``, on the current stream: pushes on other streams must be ordered before
        ``sync``, as for the pushes themselves). The window's state is reset only once ``sync`` succeeded."""
        pairs = [(i, lo, hi) for i, u in enumerate(units) for lo, hi in u.ranges.values()]
        values = torch.stack([x for _, lo, hi in pairs for x in (lo, hi)]).tolist() if pairs else []
        amax = [0.0] * len(units)
        for k, (i, _, _) in enumerate(pairs):
            lo, hi = values[2 * k], values[2 * k + 1]
            amax[i] = math.nan if math.isnan(lo) or math.isnan(hi) or math.isnan(amax[i]) else max(amax[i], -lo, hi)
        out = []
        for unit, m in zip(units, amax, strict=True):
            seen, flags = NONE, unit.flags
            if not math.isfinite(m):
                flags |= _NONFINITE
            else:
                if m >= math.ldexp(1.0, unit.exponent):
                    flags |= _BOUND
                if m > 0.0:
                    seen = math.frexp(m)[1]  # m < 2**seen
            if flags & (_NONFINITE | _BOUND):
                log.warning(
                    "odc push into %r in deterministic mode: %s; the next sync raises OdcOverflowError on every rank "
                    "and discards the window", unit.name, _describe(flags & (_NONFINITE | _BOUND), m, unit.exponent),
                )
            out.append((seen, flags))
        return out

    # -- sync (world-collective) -----------------------------------------------------------------------
    def sync(self, op: str, *, gradients: bool = True, parameters: bool = True) -> None:
        """Agree on the next window's bounds and on overflow, fence every push, convert into ``st.grad``.

        Only the transport contract: ``exchange`` carries host-side state (what each rank quantised), and
        ``barrier`` is the round after which every rank's pushes are visible in their owners' accumulators (on a
        GPU, in stream order: the conversion below is stream-ordered after it). An exchange alone is no such
        fence on a transport whose pushes complete on a device stream (``symm``).

        With nodes, the hierarchy's two barriers are rounds 2 and 3 (see the module docstring); ``parameters``
        is its flag (mirrors refreshed or not), and ``gradients`` only names its barrier (flags compared across
        ranks): every tensor pushed into is delivered and converted at every sync in this mode."""
        transport = self.transport
        transport.quiet()  # a failed asynchronous push is raised here, before any round
        units = [self.units[s] for s in sorted(self.units)]
        payloads = self._exchange(op, self._window(units))
        seen = [NONE] * len(units)
        flagged: dict[int, list[int]] = {}
        for r, entries in enumerate(payloads):
            for i, (e, flags) in enumerate(entries):
                seen[i] = max(seen[i], e)
                if flags:
                    flagged.setdefault(i, []).append(r)
        # Units whose accumulators (and staging rows) may hold something: a value was seen, or a push was flagged (a
        # NaN/inf push has no exponent but wrote meaningless integers, which must be zeroed with the window).
        written = [seen[i] != NONE or i in flagged for i in range(len(units))]
        busy = any(written)

        def convert() -> None:
            for i, unit in enumerate(units):
                if not written[i]:
                    continue  # nobody pushed a nonzero value into this tensor in this window: still zero
                if not flagged:
                    self._convert(unit)
                else:  # the window is discarded on every rank: nothing partial reaches st.grad
                    unit.acc.local.zero_()

        if self.nodes is not None:
            # Round 2 is the hierarchy's barrier 1; the flush of the tensors pushed into (or, discarded, the zeroing
            # of their staging rows), the mirrors, the conversion, then round 3 = its barrier 2 (fail-stop inside).
            pushed = {s for s, w in zip(sorted(self.units), written, strict=True) if w}
            self.nodes.sync(op, gradients=gradients, parameters=parameters, pushed=pushed, discard=bool(flagged),
                            then=convert if busy else None)
        else:
            transport.barrier(f"{op} (deterministic pushes)")  # round 2: the pushes (and parameter writes) are visible

            def finish() -> None:
                convert()
                # Round 3: no peer pushes its next window into an accumulator before its owner converted it.
                transport.barrier(f"{op} (deterministic conversion)")

            if busy:  # the same on every rank (agreed data); a window without pushes anywhere has nothing to convert
                # Peers passed round 2 with us: an error here leaves them waiting in round 3 (fail-stop).
                transport.fail_stop(op, "the deterministic bounds were agreed", finish)
        for i, unit in enumerate(units):
            if seen[i] != NONE:  # a discarded window only raises the bound (its retry must fit)
                wanted = min(MAX_EXPONENT, max(MIN_EXPONENT, seen[i] + MARGIN_BITS))
                unit.exponent = max(unit.exponent, wanted) if flagged else wanted
            unit.pushes, unit.flags = 0, 0
            unit.ranges.clear()
        if flagged:
            what = "; ".join(
                f"{units[i].name!r} (ranks {ranks}; bound now 2**{units[i].exponent})" for i, ranks in flagged.items()
            )
            raise OdcOverflowError(
                f"odc {op}: in deterministic mode a push exceeded its tensor's fixed-point bound (or was not finite, "
                f"or was one push too many: at most {1 << PUSH_BITS} per tensor, rank and sync) for {what}. Nothing "
                "of it reached st.grad: every rank discarded this window's pushes (st.grad is unchanged) and raised "
                "the bounds to what was seen, so the same minibatch can be retried. Not finite gradients must be fixed "
                "at their source."
            )

    def _exchange(self, op: str, window: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """Every rank's ``(largest exponent seen, flags)`` per unit, in rounds of at most ``_PER_ROUND`` units."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.transport.world_size)]
        for start in range(0, max(1, len(window)), _PER_ROUND):
            part = window[start : start + _PER_ROUND]
            payload = b"".join(_ENTRY.pack(max(NONE, min(32767, seen)), flags) for seen, flags in part)
            for r, data in enumerate(self.transport.exchange(f"{op} (deterministic bounds)", payload)):
                if len(data) != len(payload):
                    raise OdcUsageError(f"odc {op}: rank {r} has a different number of tensors in deterministic mode")
                out[r].extend(_ENTRY.iter_unpack(data))
        return out

    def _convert(self, unit: _Unit) -> None:
        acc, grad = unit.acc.local, unit.grad.local
        step = math.ldexp(1.0, unit.exponent - self.precision)
        for lo in range(0, acc.numel(), _CONVERT_ELEMS):  # bounded temporary memory
            part = acc[lo : lo + _CONVERT_ELEMS]
            # int64 -> fp64 rounds above 2**53, the product is exact, fp32 rounds once: the same bits every run.
            grad[lo : lo + _CONVERT_ELEMS].add_(part.to(torch.float64).mul_(step))
            part.zero_()


def _describe(why: int, amax: float, exponent: int) -> str:
    if why == _NONFINITE:
        return f"the gradient is not finite (max |value| {amax})"
    if why == _TOO_MANY:
        return f"more than {1 << PUSH_BITS} pushes into this tensor since the last sync"
    return f"max |value * scale| {amax:.6g} >= this window's bound 2**{exponent}"


def check_supported(transport: Transport) -> None:
    """Refuse what deterministic mode cannot run (the same outcome on every rank: agreed inputs)."""
    if not transport.capabilities.deterministic:
        raise OdcUsageError(
            f"odc_runtime.init(deterministic=True): the {transport.name} transport cannot accumulate "
            "deterministically (it has no exact int64 push); use backend='host', 'symm-cpu', 'symm' or 'nvshmem', or "
            "init without deterministic=True / ODC_DETERMINISTIC"
        )
