"""The packing and partitioning primitives of the balancers, and the planners of the policies that place whole
samples (``local_sort``, ``verl_lb_micro``, ``lb_micro``, ``lb_mini``; ``odc_runtime.balance`` documents what
each promises and registers them).

Torch-free. ``odc_runtime.split`` builds ``lb_mini_split`` on ``Job``, ``pack``, ``by_cost_desc``
and ``plan_lb_mini``; both sit below ``odc_runtime.balance``, which holds the one policy registry.
A planner takes a validated ``Job`` and returns a ``Plan``: ``plan[rank][i]`` lists the sample indices of
rank's i-th micro-batch.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from odc_runtime.cost import CostModel

Plan = list[list[list[int]]]


# --------------------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Job:
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



def plan_local_sort(job: Job) -> Plan:
    ranks = _pack_ranks(job, _deal_round_robin(len(job.lengths), job.world_size))
    depth = max(len(r) for r in ranks)
    return [r + [[] for _ in range(depth - len(r))] for r in ranks]


def plan_lb_micro(job: Job) -> Plan:
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
    bins = by_cost_desc(job, pack(job, range(len(job.lengths))))
    layouts = [bins]
    steps_needed = -(-len(bins) // w)
    # LPT over S·W parts, kept where it respects the cap. Where it does not, the cap is nearly as tight as
    # packing and the packed layout's steps are as full as they can be (a capped LPT there costs O(n·S·W)).
    spread = _lpt(job, range(len(job.lengths)), steps_needed * w)
    if spread is not None and all(job.fits(p) for p in spread):
        layouts.append(by_cost_desc(job, spread))
    candidates = []
    for layout in layouts:
        steps = [_balance_step(job, layout[i : i + w]) for i in range(0, len(layout), w)]
        steps.sort(key=lambda parts: -job.max_cost(parts))
        candidates.append(steps)
    best = min(candidates, key=lambda steps: math.fsum(job.max_cost(parts) for parts in steps))
    return _steps_to_ranks(job, best)


def plan_verl_lb_micro(job: Job) -> Plan:
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
    return [by_cost_desc(job, rank) + [[] for _ in range(depth - len(rank))] for rank in parts]


def plan_lb_mini(job: Job) -> Plan:
    """Balance rank totals over the whole minibatch, then let each rank pack its own samples.

    Candidates: LPT and Karmarkar–Karp over sample costs, each refined by moves/swaps, and the rank
    assignments local_sort, verl_lb_micro and lb_micro induce; the cheapest (refined once more) wins, so
    lb_mini is never worse than any baseline and keeps LPT's 4/3 bound.
    """
    n, w = len(job.lengths), job.world_size
    # Neither seed dominates: KK wins more often on small inputs, LPT carries the bound.
    candidates = [_refine(job, seed, cap=None) for seed in (_lpt(job, range(n), w), _karmarkar_karp(job, range(n), w))]
    candidates += [_deal_round_robin(n, w)] + [[_flatten(r) for r in baseline(job)]
                                               for baseline in (plan_verl_lb_micro, plan_lb_micro)]
    best = _refine(job, min(candidates, key=job.max_cost), cap=None)  # min keeps the first of equals
    return _pack_ranks(job, best)



def _deal_round_robin(n: int, w: int) -> list[list[int]]:
    return [list(range(r, n, w)) for r in range(w)]


def _flatten(micro_batches: Iterable[Iterable[int]]) -> list[int]:
    return [i for mb in micro_batches for i in mb]


def pack(job: Job, indices: Iterable[int]) -> list[list[int]]:
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


def by_cost_desc(job: Job, micro_batches: Iterable[list[int]]) -> list[list[int]]:
    """Indices ascending inside each micro-batch; micro-batches most expensive first, ties by first index."""
    mbs = [sorted(mb) for mb in micro_batches]
    return sorted(mbs, key=lambda mb: (-job.cost(mb), mb[0] if mb else math.inf))


def _pack_ranks(job: Job, assignment: list[list[int]]) -> Plan:
    return [by_cost_desc(job, pack(job, samples)) for samples in assignment]


def _balance_step(job: Job, bins: list[list[int]]) -> list[list[int]]:
    """Re-partition one step's samples over W micro-batches with balanced costs, respecting the token cap."""
    w = job.world_size
    items = _flatten(bins)
    # Cost-balancing ignores the cap, so each candidate is kept only if it respects it; the packed bins
    # always do. KK balances best when the cap leaves slack, capped LPT when it is tight.
    candidates = [bins + [[] for _ in range(w - len(bins))], _karmarkar_karp(job, items, w)]
    candidates.append(_lpt(job, items, w, cap=job.max_tokens))
    feasible = [c for c in candidates if c is not None and all(job.fits(p) for p in c)]
    return _refine(job, min(feasible, key=job.max_cost), cap=job.max_tokens)


def _steps_to_ranks(job: Job, steps: list[list[list[int]]]) -> Plan:
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


def _lpt(job: Job, items: Iterable[int], k: int, cap: int | None = None) -> list[list[int]] | None:
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


def _karmarkar_karp(job: Job, items: Iterable[int], k: int, *, equal_counts: bool = False) -> list[list[int]]:
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


def _refine(job: Job, parts: list[list[int]], cap: int | None) -> list[list[int]]:
    """Lower the dearest part by the best single move or swap with a cheaper part, until none helps.

    Each accepted exchange moves cost ``d`` with ``0 < d < gap`` from the dearest part to a cheaper one, so
    no part ends above the old maximum and the sum of squared totals strictly falls: it terminates, and
    the result is never worse than the input. It stops early once the dearest part is within
    ``_GOOD_ENOUGH`` of the mean. With ``cap`` every touched part stays within ``cap`` tokens.
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
    """Mutable state of ``_refine``.

    Per part, parallel lists sorted by cost: costs, sample indices, lengths (cost grows with length, so the
    lengths are sorted too); plus the part's total cost and free tokens (``inf`` without a cap).
    """

    def __init__(self, job: Job, parts: list[list[int]], cap: int | None) -> None:
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

