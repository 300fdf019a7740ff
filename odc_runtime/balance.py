"""Minibatch-level load balancing: which rank runs which samples, in which micro-batch.

With collectives (FSDP) every rank must run the same number of micro-batches and every layer of micro-batch
``i`` is a barrier across ranks, so the time of a minibatch is the sum over micro-batch *steps* of the slowest
rank's micro-batch. With ODC the only barrier is once per minibatch, so the time is the slowest rank's *total*.
This module plans both kinds of schedule from sequence lengths and a per-sequence cost model, and predicts what
each would waste (:func:`imbalance`). It is pure Python (no torch) so it can run in a data loader.

A plan is ``plan[rank][i] = [sample indices of rank's i-th micro-batch]``. Policies (:data:`POLICY_REGISTRY`;
:data:`POLICIES` lists their names):

``"local_sort"``
    The baseline: samples dealt round robin (``rank r`` gets indices ``r, r + W, r + 2W, ...``, as
    ``torch.utils.data.DistributedSampler`` does without shuffling), each rank sorts and packs its own samples,
    then every rank is padded with empty micro-batches to the same count, as collectives require.
``"verl_lb_micro"``
    veRL's dynamic batching (the paper's LB-Micro, what a veRL user runs today): equal sample counts per rank
    balanced by Karmarkar–Karp, each rank splits its own samples into micro-batches, the count all-reduced to
    the maximum (padding), micro-batches most expensive first.
``"lb_micro"``
    Equal micro-batch counts, each step balanced across ranks (what the best collective schedule can do).
``"lb_mini"``
    Each rank's total over the whole minibatch balanced; counts differ between ranks and may be zero (ODC).
``"lb_mini_split"``
    ``lb_mini``, with outlier samples split into chunks that a gang of ranks runs together; such a micro-batch
    holds one :class:`odc_runtime.split.Chunk` instead of sample indices (:mod:`odc_runtime.split`).

The cost of a micro-batch is the sum of its sequences' costs (packed variable-length attention is quadratic per
sequence, not in the packed length). Fixed per-micro-batch overheads (e.g. fetching the parameters once per
micro-batch) are not modelled; packing minimises the number of micro-batches, which keeps them small.
"""

from __future__ import annotations

import bisect
import heapq
import math
import numbers
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from operator import itemgetter
from types import MappingProxyType

from odc_runtime.errors import OdcUsageError

__all__ = [
    "DEFAULT_COST_MODEL",
    "POLICIES",
    "POLICY_REGISTRY",
    "CostModel",
    "Imbalance",
    "Plan",
    "Policy",
    "get_policy",
    "imbalance",
    "plan",
]

Plan = list[list[list[int]]]


# --------------------------------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class CostModel:
    """Time (or any additive work unit) of one sequence of ``s`` tokens: ``a·s² + b·s``.

    ``a`` covers attention (quadratic in the sequence length), ``b`` everything linear (projections, MLP,
    LM head). Both must be finite and non-negative, and not both zero. Only the ratio ``b / a`` matters for
    balancing; the absolute scale matters for predicted times.
    """

    a: float
    b: float

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise OdcUsageError(f"CostModel.{name} must be a finite real number, got {value!r}")
            if value < 0:
                raise OdcUsageError(f"CostModel.{name} must be >= 0, got {value!r}")
        if self.a == 0 and self.b == 0:
            raise OdcUsageError("CostModel needs a > 0 or b > 0: with a = b = 0 every sample costs nothing")

    def cost(self, s: int) -> float:
        """Cost of one sequence of ``s`` tokens."""
        return self.a * s * s + self.b * s

    def cost_of(self, micro_batch_lengths: Iterable[int]) -> float:
        """Cost of a micro-batch: the sum of its sequences' costs (correctly rounded)."""
        return math.fsum(self.cost(s) for s in micro_batch_lengths)

    @classmethod
    def fit(cls, lengths_per_microbatch: Sequence[Sequence[int]], seconds: Sequence[float]) -> CostModel:
        """Fit ``a, b >= 0`` to measured micro-batch times by non-negative least squares.

        Measurement ``j`` is a micro-batch with sequence lengths ``lengths_per_microbatch[j]`` that took
        ``seconds[j]``; the model predicts ``a·Σs² + b·Σs``. The two-variable problem is solved exactly, in
        rational arithmetic on the given floats: the unconstrained least-squares solution if both
        coefficients are non-negative, otherwise (the optimum then lies on the boundary ``a = 0`` or
        ``b = 0``) the better of the two one-variable fits. Raises :class:`OdcUsageError` on bad input or
        when the times do not grow with the lengths at all.
        """
        rows = _fit_rows(lengths_per_microbatch, seconds)
        xx = sum(q * q for q, _, _ in rows)
        xy = sum(q * s for q, s, _ in rows)
        yy = sum(s * s for _, s, _ in rows)
        xt = sum(q * t for q, _, t in rows)
        yt = sum(s * t for _, s, t in rows)
        det = xx * yy - xy * xy
        if det != 0:
            a, b = (xt * yy - yt * xy) / det, (yt * xx - xt * xy) / det
            if a >= 0 and b >= 0:
                return cls._from_fit(a, b)
        # Sum of squared residuals minus the constant Σt², for a one-variable fit c·column.
        a_only, b_only = max(xt / xx, Fraction(0)), max(yt / yy, Fraction(0))
        sse_a = a_only * a_only * xx - 2 * a_only * xt
        sse_b = b_only * b_only * yy - 2 * b_only * yt
        return cls._from_fit(a_only, 0) if sse_a <= sse_b else cls._from_fit(0, b_only)

    @classmethod
    def _from_fit(cls, a: Fraction | int, b: Fraction | int) -> CostModel:
        if a == 0 and b == 0:
            raise OdcUsageError("CostModel.fit: the measured times do not increase with the sequence lengths")
        return cls(float(a), float(b))

    @classmethod
    def from_model_config(
        cls,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        vocab_size: int,
        *,
        intermediate_size: int | None = None,
        num_kv_heads: int | None = None,
        gated_mlp: bool = True,
        causal: bool = True,
        activation_checkpointing: bool = False,
        flops_per_second: float = 400e12,
    ) -> CostModel:
        """Derive ``a, b`` (seconds) by counting the FLOPs of a decoder-only transformer.

        Forward FLOPs of one sequence of ``s`` tokens (a multiply-add counts 2), hidden size ``h``,
        ``head_dim = h / num_heads``, ``h_kv = num_kv_heads · head_dim`` (GQA/MQA shrink K and V only):

        - per layer, Q/K/V projections ``2·s·h·(h + 2·h_kv)`` and the output projection ``2·s·h²``;
        - per layer, the MLP ``2·s·h·i`` per weight matrix: 3 matrices when gated (SwiGLU: gate, up, down),
          2 otherwise; ``i`` defaults to ``8h/3`` (gated) or ``4h``;
        - per layer, attention scores ``QKᵀ`` and the weighted sum ``PV``, ``2·s²·h`` each, so ``4·s²·h``;
          with a causal mask a kernel that skips fully masked blocks (FlashAttention) does half: ``2·s²·h``
          (``causal=True``, the default; ``causal=False`` counts the full square);
        - once, the LM head ``2·s·h·V``.

        Ignored (small constants times ``s·h``): embedding lookups, norms, activations, rotary embeddings,
        softmax, the loss. Training costs forward + backward ≈ 3× forward (the backward pass computes
        gradients for activations and for weights, each about one forward), 4× with activation
        checkpointing (the forward runs again). ``flops_per_second`` is the *achieved* rate, not the peak:
        the default 400 TFLOP/s is about 40% of an H100's dense bf16 peak. Memory-bound work and
        communication are not modelled; use :meth:`fit` on measured times when they matter.
        """
        for name, value in (
            ("num_layers", num_layers),
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("vocab_size", vocab_size),
        ):
            _check_positive_int(name, value)
        if hidden_size % num_heads:
            raise OdcUsageError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
        kv_heads = num_heads if num_kv_heads is None else _check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % kv_heads:
            raise OdcUsageError(f"num_heads={num_heads} is not a multiple of num_kv_heads={kv_heads}")
        if intermediate_size is None:
            intermediate_size = 8 * hidden_size // 3 if gated_mlp else 4 * hidden_size
        _check_positive_int("intermediate_size", intermediate_size)
        if not (isinstance(flops_per_second, numbers.Real) and flops_per_second > 0):
            raise OdcUsageError(f"flops_per_second must be > 0, got {flops_per_second!r}")

        h = hidden_size
        h_kv = kv_heads * (h // num_heads)
        mlp_matrices = 3 if gated_mlp else 2
        linear_per_layer = 2 * h * (h + 2 * h_kv) + 2 * h * h + mlp_matrices * 2 * h * intermediate_size
        forward_linear = num_layers * linear_per_layer + 2 * h * vocab_size
        forward_quadratic = num_layers * 4 * h * (0.5 if causal else 1.0)
        passes = 4.0 if activation_checkpointing else 3.0
        return cls(passes * forward_quadratic / flops_per_second, passes * forward_linear / flops_per_second)


def _fit_rows(
    lengths_per_microbatch: Sequence[Sequence[int]], seconds: Sequence[float]
) -> list[tuple[int, int, Fraction]]:
    """Validated (Σs², Σs, time) per measurement; the time as an exact fraction of the given float."""
    if len(lengths_per_microbatch) != len(seconds):
        raise OdcUsageError(f"CostModel.fit: {len(lengths_per_microbatch)} micro-batches but {len(seconds)} times")
    rows = []
    for j, (micro_batch, t) in enumerate(zip(lengths_per_microbatch, seconds, strict=True)):
        lens = _check_lengths(micro_batch, what=f"lengths_per_microbatch[{j}]")
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise OdcUsageError(f"CostModel.fit: seconds[{j}] must be a finite number >= 0, got {t!r}")
        rows.append((sum(s * s for s in lens), sum(lens), Fraction(t)))
    if not any(s for _, s, _ in rows):
        raise OdcUsageError("CostModel.fit needs at least one non-empty micro-batch")
    return rows


# --------------------------------------------------------------------------------------------------- validation


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise OdcUsageError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_lengths(lengths: Iterable[int], what: str = "lengths") -> list[int]:
    if isinstance(lengths, (str, bytes)):
        raise OdcUsageError(f"{what} must be a sequence of positive ints, got {type(lengths).__name__}")
    out = []
    for i, s in enumerate(lengths):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise OdcUsageError(f"{what}[{i}] must be a positive int (a token count), got {s!r}")
        out.append(int(s))
    return out


def _check_oversized(lengths: list[int], max_tokens: int, allow_oversized: bool) -> None:
    if allow_oversized:
        return
    over = [i for i, s in enumerate(lengths) if s > max_tokens]
    if over:
        i = over[0]
        more = f" (and {len(over) - 1} more)" if len(over) > 1 else ""
        raise OdcUsageError(
            f"sample {i} has {lengths[i]} tokens, more than max_tokens={max_tokens}{more}: raise max_tokens to "
            f"at least {max(lengths[j] for j in over)}, truncate or split long samples, or pass "
            "allow_oversized=True to give each such sample a micro-batch of its own"
        )


#: Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads / 8 KV heads, SwiGLU 14336, vocab 128256):
#: attention and the linear part cost the same at about 57K tokens.
DEFAULT_COST_MODEL = CostModel.from_model_config(32, 4096, 32, 128256, intermediate_size=14336, num_kv_heads=8)


# --------------------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Job:
    """One planning problem, validated: per-sample lengths and costs, ranks, token cap."""

    lengths: list[int]
    costs: list[float]
    world_size: int
    max_tokens: int
    model: CostModel = field(default=None)  # type: ignore[assignment]  # always set by plan()
    max_gang_size: int | None = None  # splitting policies: the most ranks one sample may be split across

    def cost(self, part: Iterable[int]) -> float:
        return math.fsum(self.costs[i] for i in part)

    def max_cost(self, parts: Sequence[Sequence[int]]) -> float:
        return max((self.cost(p) for p in parts), default=0.0)

    def fits(self, part: Sequence[int]) -> bool:
        """Within the token cap, or a lone (oversized) sample."""
        return len(part) <= 1 or sum(self.lengths[i] for i in part) <= self.max_tokens


def plan(
    lengths: Sequence[int],
    world_size: int,
    *,
    max_tokens: int,
    policy: str,
    cost: CostModel = DEFAULT_COST_MODEL,
    allow_oversized: bool = False,
    max_gang_size: int | None = None,
) -> Plan:
    """Assign samples to ranks and micro-batches; ``result[rank][i]`` lists rank's i-th micro-batch.

    Every sample index appears exactly once; no micro-batch holds more than ``max_tokens`` tokens. A sample
    longer than ``max_tokens`` raises :class:`OdcUsageError`, or with ``allow_oversized=True`` gets a
    micro-batch of its own. Within a micro-batch indices are ascending; a rank's micro-batches come most
    expensive first (for ``"lb_micro"`` the i-th micro-batches of all ranks form step i, and steps come
    most expensive first). The result is deterministic: no randomness, ties broken by index.

    ``"lb_mini"`` guarantees a per-rank maximum total cost no larger than that of ``"local_sort"``,
    ``"verl_lb_micro"`` and ``"lb_micro"`` on the same input (it evaluates their rank assignments as
    candidates), and within ``4/3 - 1/(3·world_size)`` of the optimum (it includes the LPT assignment,
    Graham's bound).

    ``max_gang_size``: for policies that split samples (``lb_mini_split``), the most ranks one sample may be split
    across (default the world size); pass the same value to :class:`odc_runtime.gang.GangExchange`, whose memory
    grows with it. Other policies never split, so the cap holds for them as it is.
    """
    entry = get_policy(policy)
    planner = entry.planner
    world_size = _check_positive_int("world_size", world_size)
    max_tokens = _check_positive_int("max_tokens", max_tokens)
    if not isinstance(cost, CostModel):
        raise OdcUsageError(f"cost must be a CostModel, got {type(cost).__name__}")
    lens = _check_lengths(lengths)
    _check_oversized(lens, max_tokens, allow_oversized or entry.splits)
    if max_gang_size is not None:
        max_gang_size = _check_positive_int("max_gang_size", max_gang_size)
    job = _Job(lens, [cost.cost(s) for s in lens], world_size, max_tokens, cost, max_gang_size)
    return planner(job)


def _plan_local_sort(job: _Job) -> Plan:
    ranks = _pack_ranks(job, _deal_round_robin(len(job.lengths), job.world_size))
    depth = max(len(r) for r in ranks)
    return [r + [[] for _ in range(depth - len(r))] for r in ranks]


def _plan_lb_micro(job: _Job) -> Plan:
    """Equal micro-batch counts, each step balanced across ranks; the cheaper of two layouts over the same
    number of steps ``S`` (the packed micro-batch count rounded up to a multiple of W, divided by W):

    - *packed*: few micro-batches (best-fit decreasing) grouped into steps of similar cost;
    - *spread*: the samples balanced over ``S·W`` micro-batches by LPT (where that respects the cap), ``W`` of
      similar cost per step. With many small samples packing fills step 0 to the cap while the last step is
      half empty, and no re-partition of a full step can balance it.

    Each step's samples are then re-partitioned over the W ranks (Karmarkar–Karp or capped LPT where they
    respect the cap) and refined by moves/swaps under the cap. The result's collective time is never above
    that of either layout."""
    w = job.world_size
    bins = _by_cost_desc(job, _pack(job, range(len(job.lengths))))
    layouts = [bins]
    steps_needed = -(-len(bins) // w)
    # LPT over S·W parts, kept where it respects the cap. Where it does not, the cap is nearly as tight as
    # packing and the packed layout's steps are as full as they can be (a capped LPT there costs O(n·S·W)).
    spread = _lpt(job, range(len(job.lengths)), steps_needed * w)
    if spread is not None and all(job.fits(p) for p in spread):
        layouts.append(_by_cost_desc(job, spread))
    candidates = []
    for layout in layouts:
        steps = [_balance_step(job, layout[i : i + w]) for i in range(0, len(layout), w)]
        steps.sort(key=lambda parts: -job.max_cost(parts))
        candidates.append(steps)
    best = min(candidates, key=lambda steps: math.fsum(job.max_cost(parts) for parts in steps))
    return _steps_to_ranks(job, best)


def _plan_verl_lb_micro(job: _Job) -> Plan:
    """veRL's dynamic batching, the LB-Micro of the ODC paper (``verl/utils/seqlen_balancing.py`` and
    ``RayPPOTrainer._balance_batch``, volcengine/verl, January 2026):

    1. the driver deals samples to ranks with *equal sample counts*, balancing the ranks' total cost
       (Karmarkar–Karp in its equal-size form: the samples sorted by cost, taken W at a time);
    2. each rank splits its own samples into ``k = min(samples, ceil(tokens / max_tokens))`` micro-batches
       (Karmarkar–Karp over cost into k parts), ``k`` all-reduced to the maximum over ranks so that every rank
       runs the same count (ranks with fewer samples than ``k`` run empty, padded micro-batches);
    3. each rank runs its micro-batches most expensive first (veRL then moves the cheaper ones to both ends,
       for pipeline bubbles; every rank applies the same permutation, so the steps pair up the same micro-batches
       and the collective time is that of this order).

    Two deviations, both in the baseline's favour: costs come from the planner's cost model rather than veRL's
    fixed ``24576·s + s²``, and where a rank's part would exceed ``max_tokens`` (veRL does not check) ``k`` is
    raised for every rank until all parts fit, as a trainable plan must.
    """
    w, n = job.world_size, len(job.lengths)
    ranks = [sorted(r) for r in _karmarkar_karp(job, range(n), w, equal_counts=True)]
    depth = max(min(len(r), -(-sum(job.lengths[i] for i in r) // job.max_tokens)) for r in ranks)
    while True:
        parts = [_karmarkar_karp(job, r, min(depth, len(r))) if r else [] for r in ranks]
        if all(job.fits(p) for rank in parts for p in rank):
            break
        depth += 1  # terminates: at depth = max samples per rank every part is one sample
    return [_by_cost_desc(job, rank) + [[] for _ in range(depth - len(rank))] for rank in parts]


def _plan_lb_mini(job: _Job) -> Plan:
    """Balance rank totals over the whole minibatch, then let each rank pack its own samples.

    Candidates: LPT and Karmarkar–Karp over sample costs, each refined by moves/swaps, and the rank
    assignments local_sort, verl_lb_micro and lb_micro induce; the cheapest (refined once more) wins, so
    lb_mini is never worse than any baseline and keeps LPT's 4/3 bound.
    """
    n, w = len(job.lengths), job.world_size
    # Neither seed dominates: KK wins more often on small inputs, LPT carries the bound.
    candidates = [_refine(job, seed, cap=None) for seed in (_lpt(job, range(n), w), _karmarkar_karp(job, range(n), w))]
    candidates += [_deal_round_robin(n, w)] + [[_flatten(r) for r in baseline(job)]
                                               for baseline in (_plan_verl_lb_micro, _plan_lb_micro)]
    best = _refine(job, min(candidates, key=job.max_cost), cap=None)  # min keeps the first of equals
    return _pack_ranks(job, best)


@dataclass(frozen=True)
class Policy:
    """One balancing policy: its name, its planner and what its plans promise.

    ``planner`` receives the validated problem (lengths, per-sample costs, ranks, token cap) and returns a
    :data:`Plan` with the guarantees :func:`plan` documents. ``equal_counts``: every rank gets the same number
    of micro-batches (padded with empty ones where needed), so collectives (FSDP) can run the plan; when
    ``False`` counts differ between ranks and only ODC can run it. ``summary`` is one line for tables and help.
    ``splits``: the plan may hold :class:`odc_runtime.split.Chunk` entries (a sample over ``max_tokens`` is split,
    not refused), which only a runtime with gang attention (:mod:`odc_runtime.gang`) can run.
    """

    name: str
    planner: Callable[[_Job], Plan]
    equal_counts: bool
    summary: str
    splits: bool = False

    @property
    def native_comm(self) -> str:
        """The communication the policy is designed for: ``"collective"`` (equal counts) or ``"odc"``."""
        return "collective" if self.equal_counts else "odc"


#: Every balancing policy by name, in a fixed order (the baseline first). Adding a policy is one entry here:
#: :func:`plan`, :data:`POLICIES`, the benchmarks and the examples all derive from this mapping.
POLICY_REGISTRY: Mapping[str, Policy] = MappingProxyType({
    p.name: p
    for p in (
        Policy("local_sort", _plan_local_sort, equal_counts=True,
               summary="deal round robin, each rank sorts and packs its own samples; counts padded equal"),
        Policy("verl_lb_micro", _plan_verl_lb_micro, equal_counts=True,
               summary="veRL's dynamic batching: equal sample counts per rank (Karmarkar-Karp), each rank packs "
                       "its own, count all-reduced to the max (what a veRL user runs today)"),
        Policy("lb_micro", _plan_lb_micro, equal_counts=True,
               summary="equal counts, each micro-batch step balanced across ranks (the best for collectives)"),
        Policy("lb_mini", _plan_lb_mini, equal_counts=False,
               summary="each rank's total balanced over the minibatch; counts differ, zero allowed (ODC)"),
        Policy("lb_mini_split", lambda job: _split()._plan_lb_mini_split(job, job.model), equal_counts=False,
               summary="lb_mini, outlier samples split into chunks run by a gang of ranks (ODC, gang attention)",
               splits=True),
    )
})

#: The policy names, in registry order.
POLICIES: tuple[str, ...] = tuple(POLICY_REGISTRY)


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``; :class:`OdcUsageError` naming the valid ones otherwise."""
    policy = POLICY_REGISTRY.get(name) if isinstance(name, str) else None
    if policy is None:
        raise OdcUsageError(f"unknown policy {name!r}; valid policies: {', '.join(POLICY_REGISTRY)}")
    return policy


def _split() -> types.ModuleType:  # odc_runtime.split builds on this module, so it is imported when first needed
    import odc_runtime.split

    return odc_runtime.split


def _deal_round_robin(n: int, w: int) -> list[list[int]]:
    return [list(range(r, n, w)) for r in range(w)]


def _flatten(micro_batches: Iterable[Iterable[int]]) -> list[int]:
    return [i for mb in micro_batches for i in mb]


def _pack(job: _Job, indices: Iterable[int]) -> list[list[int]]:
    """Best-fit decreasing by tokens: longest first, each into the fullest micro-batch it still fits.

    Few micro-batches, O(n log n) (a sorted list of free capacities); an oversized sample is left alone.
    """
    lengths, cap = job.lengths, job.max_tokens
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, bin id), ascending
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        s = lengths[i]
        pos = bisect.bisect_left(free, (s, -1))
        if pos < len(free):
            room, b = free.pop(pos)
        else:
            room, b = cap, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - s > 0:
            bisect.insort(free, (room - s, b))
    return bins


def _by_cost_desc(job: _Job, micro_batches: Iterable[list[int]]) -> list[list[int]]:
    """Indices ascending inside each micro-batch; micro-batches most expensive first, ties by first index."""
    mbs = [sorted(mb) for mb in micro_batches]
    return sorted(mbs, key=lambda mb: (-job.cost(mb), mb[0] if mb else math.inf))


def _pack_ranks(job: _Job, assignment: list[list[int]]) -> Plan:
    return [_by_cost_desc(job, _pack(job, samples)) for samples in assignment]


def _balance_step(job: _Job, bins: list[list[int]]) -> list[list[int]]:
    """Re-partition one step's samples over W micro-batches with balanced costs, respecting the token cap."""
    w = job.world_size
    items = _flatten(bins)
    # Cost-balancing ignores the cap, so each candidate is kept only if it respects it; the packed bins
    # always do. KK balances best when the cap leaves slack, capped LPT when it is tight.
    candidates = [bins + [[] for _ in range(w - len(bins))], _karmarkar_karp(job, items, w)]
    candidates.append(_lpt(job, items, w, cap=job.max_tokens))
    feasible = [c for c in candidates if c is not None and all(job.fits(p) for p in c)]
    return _refine(job, min(feasible, key=job.max_cost), cap=job.max_tokens)


def _steps_to_ranks(job: _Job, steps: list[list[list[int]]]) -> Plan:
    """Step i's micro-batches become every rank's i-th; the dearest goes to the rank with the least so far,
    which keeps per-rank totals even without changing any step's cost."""
    w = job.world_size
    totals = [0.0] * w
    ranks: Plan = [[] for _ in range(w)]
    for parts in steps:
        part_costs = [job.cost(p) for p in parts]
        part_order = sorted(range(w), key=lambda j: (-part_costs[j], j))
        rank_order = sorted(range(w), key=lambda r: (totals[r], r))
        for j, r in zip(part_order, rank_order, strict=True):
            ranks[r].append(sorted(parts[j]))
            totals[r] += part_costs[j]
    return ranks


# --------------------------------------------------------------------------------------------------- partitioners


def _lpt(job: _Job, items: Iterable[int], k: int, cap: int | None = None) -> list[list[int]] | None:
    """Longest processing time first: dearest sample to the cheapest part. Max ≤ (4/3 − 1/(3k))·optimum.

    With ``cap``, to the cheapest part with room for it (an oversized sample only to an empty part, which
    it then closes); ``None`` when some sample fits nowhere.
    """
    costs, lengths = job.costs, job.lengths
    heap = [(0.0, r) for r in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    room = [math.inf if cap is None else cap] * k
    for i in sorted(items, key=lambda i: (-costs[i], i)):
        skipped = []
        while heap and not (lengths[i] <= room[heap[0][1]] or not parts[heap[0][1]]):
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        total, r = heapq.heappop(heap)
        parts[r].append(i)
        room[r] -= lengths[i]
        heapq.heappush(heap, (total + costs[i], r))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return parts


def _karmarkar_karp(job: _Job, items: Iterable[int], k: int, *, equal_counts: bool = False) -> list[list[int]]:
    """k-way largest differencing: repeatedly merge the two partial partitions with the largest spread,
    pairing the dearest part of one with the cheapest of the other.

    A partial partition is a list of non-empty parts ``[cost, indices]``, dearest first; missing parts are
    empty, so early merges of single samples cost O(1) rather than O(k). With ``equal_counts`` the starting
    partitions are the samples sorted by cost taken k at a time (one per part), so every merge adds one
    sample to each part and the parts' sample counts differ by at most one.
    """
    if equal_counts:
        order = sorted(items, key=lambda i: (job.costs[i], i))
        groups = [order[j : j + k] for j in range(0, len(order), k)]
    else:
        groups = [[i] for i in sorted(items, key=lambda i: (-job.costs[i], i))]
    heap = []
    for seq, group in enumerate(groups):
        parts = [[job.costs[i], [i]] for i in reversed(group)]
        heap.append((-(parts[0][0] - (parts[-1][0] if len(parts) == k else 0.0)), seq, parts))
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        merged = _kk_merge(heapq.heappop(heap)[2], heapq.heappop(heap)[2], k)
        spread = merged[0][0] - (merged[-1][0] if len(merged) == k else 0.0)
        heapq.heappush(heap, (-spread, seq, merged))
        seq += 1
    parts = [sorted(indices) for _, indices in heap[0][2]] if heap else []
    return parts + [[] for _ in range(k - len(parts))]


def _kk_merge(a: list[list], b: list[list], k: int) -> list[list]:
    """Merge two partial partitions (dearest first, implicitly padded with empty parts to k)."""
    start = k - len(b)  # b's parts, cheapest first, occupy positions start .. k-1
    merged = a[: min(len(a), start)]
    for pos in range(start, k):
        part = b[k - 1 - pos]
        if pos < len(a):
            big, small = (a[pos], part) if len(a[pos][1]) >= len(part[1]) else (part, a[pos])
            big[0] += small[0]
            big[1].extend(small[1])  # small-to-large keeps concatenation O(n log n) overall
            part = big
        merged.append(part)
    merged.sort(key=itemgetter(0), reverse=True)
    return merged


def _refine(job: _Job, parts: list[list[int]], cap: int | None) -> list[list[int]]:
    """Lower the dearest part by the best single move or swap with a cheaper part, until none helps.

    Each accepted exchange moves cost ``d`` with ``0 < d < gap`` from the dearest part to a cheaper one, so
    no part ends above the old maximum and the sum of squared totals strictly falls: it terminates, and
    the result is never worse than the input. It stops early once the dearest part is within
    :data:`_GOOD_ENOUGH` of the mean. With ``cap`` every touched part stays within ``cap`` tokens.
    """
    state = _RefineState(job, parts, cap)
    target = (1 + _GOOD_ENOUGH) * math.fsum(state.totals) / len(parts)
    for _ in range(4 * len(job.lengths) + 16):
        if max(state.totals) <= target or not state.improve_dearest():
            break
    result = [sorted(ids) for ids in state.ids]
    return result if job.max_cost(result) <= job.max_cost(parts) else parts


#: Relative excess of the dearest part over the mean below which refining stops: far below the accuracy of
#: any cost model, and it saves most of the refinement rounds on large inputs.
_GOOD_ENOUGH = 1e-4


class _RefineState:
    """Mutable state of :func:`_refine`.

    Per part, parallel lists sorted by cost: costs, sample indices, lengths (cost grows with length, so the
    lengths are sorted too); plus the part's total cost and free tokens (``inf`` without a cap).
    """

    def __init__(self, job: _Job, parts: list[list[int]], cap: int | None) -> None:
        self.job = job
        self.ids = [sorted(p, key=lambda i: (job.costs[i], i)) for p in parts]
        self.costs = [[job.costs[i] for i in ids] for ids in self.ids]
        self.lens = [[job.lengths[i] for i in ids] for ids in self.ids]
        self.totals = [math.fsum(c) for c in self.costs]
        self.room = [math.inf if cap is None else cap - sum(lens) for lens in self.lens]

    def improve_dearest(self) -> bool:
        order = sorted(range(len(self.totals)), key=lambda r: (self.totals[r], r))
        h = order[-1]
        tol = 1e-12 * self.totals[h]
        for p in order[:-1]:
            gap = self.totals[h] - self.totals[p]
            if gap <= tol:
                return False
            exchange = self._best_exchange(h, p, gap, tol)
            if exchange is not None:
                self._apply(h, p, *exchange)
                return True
        return False

    def _best_exchange(self, h: int, p: int, gap: float, tol: float) -> tuple[int, int | None] | None:
        """Best (position in h to give, position in p to take or None): cost moved closest to gap / 2.

        Lengths are sorted like costs, so feasible moves are a prefix of h and, for a given x, feasible
        swap partners a suffix of p; the best lies next to the target inside that range.
        """
        hc, hl, pc, pl = self.costs[h], self.lens[h], self.costs[p], self.lens[p]
        room_h, room_p, half = self.room[h], self.room[p], gap / 2
        best, best_gain = None, tol
        movable = bisect.bisect_right(hl, room_p)
        pos = bisect.bisect_left(hc, half, 0, movable)
        for x in (pos - 1, pos):
            if 0 <= x < movable and min(hc[x], gap - hc[x]) > best_gain:
                best, best_gain = (x, None), min(hc[x], gap - hc[x])
        if not pc:
            return best
        capped = room_p != math.inf
        # Only x with pc[0] < x < pc[-1] + gap can have a partner moving 0 < d < gap.
        for x in range(bisect.bisect_right(hc, pc[0]), bisect.bisect_left(hc, pc[-1] + gap)):
            cx = hc[x]
            lo = bisect.bisect_left(pl, hl[x] - room_p) if capped else 0
            pos = bisect.bisect_left(pc, cx - half, lo)
            for y in (pos - 1, pos):
                if lo <= y < len(pc) and pl[y] - hl[x] <= room_h:
                    gain = min(cx - pc[y], gap - cx + pc[y])  # the pair's maximum falls by this much
                    if gain > best_gain:
                        best, best_gain = (x, y), gain
        return best

    def _apply(self, h: int, p: int, x: int, y: int | None) -> None:
        # Take both out before inserting either, so that the positions stay valid.
        moves = [(h, p, self._take(h, x))]
        if y is not None:
            moves.append((p, h, self._take(p, y)))
        for src, dst, (c, i, s) in moves:
            pos = bisect.bisect_right(self.costs[dst], c)
            self.costs[dst].insert(pos, c)
            self.ids[dst].insert(pos, i)
            self.lens[dst].insert(pos, s)
            self.totals[src] -= c
            self.totals[dst] += c
            self.room[src] += s
            self.room[dst] -= s

    def _take(self, r: int, pos: int) -> tuple[float, int, int]:
        return self.costs[r].pop(pos), self.ids[r].pop(pos), self.lens[r].pop(pos)


# --------------------------------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class Imbalance:
    """What a plan wastes under each kind of schedule, in the cost model's units.

    ``collective_*``: every micro-batch step is a barrier (FSDP); a rank without an i-th micro-batch counts
    as 0 in step i. ``odc_*``: one barrier per minibatch (ODC). ``speedup = collective_time / odc_time``.
    """

    per_rank_cost: tuple[float, ...]
    mean_cost: float
    max_over_mean: float
    collective_waste: float
    odc_waste: float
    collective_time: float
    odc_time: float
    speedup: float


def imbalance(plan: Plan, lengths: Sequence[int], cost: CostModel = DEFAULT_COST_MODEL) -> Imbalance:
    """Predicted per-rank totals, waste and times of ``plan`` (from :func:`plan`) for these lengths.

    - ``collective_waste = Σ_i (max_r c[r][i] − mean_r c[r][i])`` and ``collective_time = Σ_i max_r c[r][i]``
      over micro-batch steps i;
    - ``odc_waste = max_r T[r] − mean_r T[r]`` and ``odc_time = max_r T[r]`` for rank totals T.
    """
    lens = _check_lengths(lengths)
    if not plan:
        raise OdcUsageError("plan must have at least one rank")
    costs = [cost.cost(s) for s in lens]
    entry_costs = []  # entry_costs[r][i]: costs of the entries of rank r's i-th micro-batch
    for r, micro_batches in enumerate(plan):
        row = []
        for mb in micro_batches:
            row.append([_entry_cost(r, i, lens, costs, cost) for i in mb])
        entry_costs.append(row)
    step_costs = [[math.fsum(mb) for mb in row] for row in entry_costs]
    w = len(plan)
    totals = tuple(math.fsum(c for mb in row for c in mb) for row in entry_costs)
    # From the samples, not the rounded totals, so that equal multisets give bit-equal means.
    mean = math.fsum(c for row in entry_costs for mb in row for c in mb) / w
    depth = max(len(row) for row in step_costs)
    steps = [[row[i] if i < len(row) else 0.0 for row in step_costs] for i in range(depth)]
    collective_time = math.fsum(max(step) for step in steps)
    collective_waste = math.fsum(max(step) - math.fsum(step) / w for step in steps)
    odc_time = max(totals)
    return Imbalance(
        per_rank_cost=totals,
        mean_cost=mean,
        max_over_mean=odc_time / mean if mean > 0 else 1.0,
        collective_waste=collective_waste,
        odc_waste=odc_time - mean,
        collective_time=collective_time,
        odc_time=odc_time,
        speedup=collective_time / odc_time if odc_time > 0 else 1.0,
    )


def _entry_cost(r: int, i: object, lens: list[int], costs: list[float], cost: CostModel) -> float:
    """Cost of one plan entry: a sample index, or a chunk of a split sample (:mod:`odc_runtime.split`)."""
    split = _split()
    if isinstance(i, split.Chunk):
        if not 0 <= i.sample < len(lens) or i.length != lens[i.sample]:
            raise OdcUsageError(f"plan[{r}] holds {i!r}, which does not match lengths[{i.sample}]")
        return split.chunk_cost(i, cost)
    if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(lens):
        raise OdcUsageError(f"plan[{r}] holds {i!r}, not a sample index in [0, {len(lens)})")
    return costs[i]
