"""The ``lb_mini_split`` policy: outlier samples split into chunks that a *gang* of ranks runs together.

``lb_mini`` cannot beat its floor, the costliest single sample, and refuses a sample longer than the token cap.
``lb_mini_split`` splits every sample whose cost exceeds a rank's fair share (``total / world_size``) or whose
length exceeds ``max_tokens`` into ``k`` chunks, run as one micro-batch by ``k`` ranks at once (context
parallelism for the few samples that need it; their attention exchanges K/V, ``odc_runtime.gang``); every other
sample is placed whole, by LPT over the ranks' loads, and packed as ``lb_mini`` packs.

Plan entries. A micro-batch holds sample indices, or exactly one ``Chunk`` (a gang micro-batch). A rank's
gang micro-batches come first, in increasing ``Chunk.gang``: every member meets its gangs in the same agreed
order, so gangs sharing ranks cannot wait on each other in a cycle (docs/design.md, "Splitting outlier sequences").

Causal balance. Causal attention makes late tokens dearer than early ones, so a sample is cut into ``2k`` equal
pieces and chunk ``p`` takes pieces ``p`` and ``2k - 1 - p`` (head-and-tail pairing): every chunk gets the same
tokens and, within rounding, the same attention work.

Cost of a chunk (``chunk_cost``), in the units of the ``CostModel`` ``a·s² + b·s``:
attention ``a·Σ(hi² − lo²)`` over its ranges (the causal square, attributed to the query rows), the linear part
``b·tokens``, and the K/V exchange ``kv_ratio·b·(length − tokens)``: every member receives the other members'
K/V in the forward pass and returns their dK/dV in the backward pass. ``KV_RATIO`` prices that per token as a
fraction of the linear cost of a token.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from odc_runtime.cost import CostModel
from odc_runtime.errors import OdcUsageError
from odc_runtime.packing import Job, by_cost_desc, pack, plan_lb_mini

__all__ = ["KV_RATIO", "Chunk", "SplitPlanEntry", "check_split_plan", "chunk_cost", "chunk_ranges"]

#: K/V traffic of one token, relative to its linear compute ``b``. Llama-3-8B (32 layers, 8 KV heads of 128, bf16):
#: 128 KiB of K/V per token, sent forward and its dK/dV back: 256 KiB, ~2.6 µs at 100 GB/s, against
#: ``b`` ≈ 120 µs of compute per token (48 GFLOP at 400 TFLOP/s): about 2%.
KV_RATIO = 0.02


@dataclass(frozen=True)
class Chunk:
    """Part ``part`` of ``parts`` of sample ``sample`` (``length`` tokens), run by ``ranks[part]``.

    ``gang`` is the agreed gang number: each member runs its gang micro-batches in increasing ``gang``.
    ``ranks`` are the gang's members; ``ranks[p]`` runs chunk ``p``. Hashable, torch-free.
    """

    sample: int
    part: int
    parts: int
    length: int
    gang: int
    ranks: tuple[int, ...]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """This chunk's token ranges ``[lo, hi)`` of the sample, ascending."""
        return chunk_ranges(self.length, self.parts)[self.part]

    @property
    def tokens(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges)

    def positions(self) -> list[int]:
        """Global positions of this chunk's tokens, in the order the chunk holds them."""
        return [t for lo, hi in self.ranges for t in range(lo, hi)]


#: One entry of a plan's micro-batch: a whole sample's index, or a chunk of a split sample.
SplitPlanEntry = int | Chunk


def chunk_ranges(length: int, parts: int) -> list[tuple[tuple[int, int], ...]]:
    """Head-and-tail pairing: ``2·parts`` near-equal pieces; chunk ``p`` = pieces ``p`` and ``2·parts - 1 - p``."""
    if parts < 1 or length < 2 * parts:
        raise OdcUsageError(f"cannot split {length} tokens into {parts} chunks of two non-empty pieces each")
    cut = [length * j // (2 * parts) for j in range(2 * parts + 1)]
    return [((cut[p], cut[p + 1]), (cut[2 * parts - 1 - p], cut[2 * parts - p])) for p in range(parts)]


def chunk_cost(chunk: Chunk, cost: CostModel, kv_ratio: float = KV_RATIO) -> float:
    """Cost of running ``chunk`` in its gang (module docstring); the parts of a sample sum to its cost plus the
    K/V exchange."""
    attention = math.fsum(hi * hi - lo * lo for lo, hi in chunk.ranges)
    tokens = chunk.tokens
    return cost.a * attention + cost.b * (tokens + kv_ratio * (chunk.length - tokens))


def _parts_needed(i: int, length: int, sample_cost: float, job: Job, share: float, cost: CostModel) -> int:
    """Fewest chunks that bring sample ``i`` within the token cap and (where the world and ``max_gang_size``
    allow) the fair share."""
    w = job.world_size
    most = min(w, job.max_gang_size or w)
    over_cap = length > job.max_tokens
    if not over_cap and (most == 1 or sample_cost <= share or length < 4):
        return 1
    fitting = None
    for k in range(2, min(most, length // 2) + 1):
        chunks = [Chunk(i, p, k, length, 0, ()) for p in range(k)]
        if max(c.tokens for c in chunks) > job.max_tokens:
            continue
        fitting = k
        if max(chunk_cost(c, cost) for c in chunks) <= share:
            break
    if fitting is None:
        if not over_cap:
            return 1
        parts = -(-length // job.max_tokens)
        raise OdcUsageError(
            f"sample {i} has {length} tokens, more than max_tokens={job.max_tokens}: it needs a gang of at least "
            f"{parts} ranks (chunks within the cap), but "
            + (f"world_size is {w}; raise max_tokens, run more ranks, or truncate the sample" if most == w else
               f"max_gang_size is {most}; raise max_gang_size or max_tokens, or truncate the sample")
        )
    return fitting


def plan_lb_mini_split(job: Job, cost: CostModel) -> list[list[list[SplitPlanEntry]]]:
    """Split the outliers (module docstring), place gangs and whole samples by LPT over rank loads, pack.

    With nothing to split the plan is exactly ``lb_mini``'s."""
    w, lengths = job.world_size, job.lengths
    share = math.fsum(job.costs) / w
    parts = {i: _parts_needed(i, s, job.costs[i], job, share, cost) for i, s in enumerate(lengths)}
    split = sorted(i for i, k in parts.items() if k > 1)
    if not split:
        return plan_lb_mini(job)
    gang_of = {i: g for g, i in enumerate(split)}
    # Items dearest first: a gang is priced by its dearest chunk, a whole sample by its cost.
    items = []
    for i, s in enumerate(lengths):
        if i in gang_of:
            chunk_costs = [chunk_cost(Chunk(i, p, parts[i], s, gang_of[i], ()), cost) for p in range(parts[i])]
            items.append((-max(chunk_costs), i, chunk_costs))
        else:
            items.append((-job.costs[i], i, None))
    items.sort(key=lambda t: (t[0], t[1]))
    loads = [(0.0, r) for r in range(w)]  # heap of (load, rank)
    gangs: list[list[Chunk]] = [[] for _ in range(w)]
    whole: list[list[int]] = [[] for _ in range(w)]
    for _, i, chunk_costs in items:
        if chunk_costs is None:
            load, r = heapq.heappop(loads)
            whole[r].append(i)
            heapq.heappush(loads, (load + job.costs[i], r))
            continue
        k = len(chunk_costs)
        least = [heapq.heappop(loads) for _ in range(k)]  # the k least loaded ranks, distinct
        members = tuple(sorted(r for _, r in least))
        for load, r in least:
            p = members.index(r)
            gangs[r].append(Chunk(i, p, k, lengths[i], gang_of[i], members))
            heapq.heappush(loads, (load + chunk_costs[p], r))
    result = [
        [[c] for c in sorted(gangs[r], key=lambda c: c.gang)] + by_cost_desc(job, pack(job, whole[r]))
        for r in range(w)
    ]
    if max(lengths) > job.max_tokens:
        return result
    # lb_mini can run this minibatch too: never plan worse than it.
    fallback = plan_lb_mini(job)
    return result if _max_load(result, job, cost) < _max_load(fallback, job, cost) else fallback


def _max_load(plan: list[list[list[SplitPlanEntry]]], job: Job, cost: CostModel) -> float:
    return max(
        math.fsum(chunk_cost(e, cost) if isinstance(e, Chunk) else job.costs[e] for mb in rank for e in mb)
        for rank in plan
    )


def check_split_plan(plan: Sequence[Sequence[Sequence[SplitPlanEntry]]], lengths: Sequence[int], *,
                     world_size: int, max_tokens: int) -> None:
    """Raise ``OdcUsageError`` unless ``plan`` covers every sample exactly once (whole, or as all chunks of
    one gang, each on the rank its gang names, alone in its micro-batch, within ``max_tokens``), keeps micro-batches
    of several samples within ``max_tokens``, and puts each rank's gang micro-batches first in increasing gang."""
    if len(plan) != world_size:
        raise OdcUsageError(f"plan has {len(plan)} ranks, expected {world_size}")
    whole: list[int] = []
    chunks: dict[int, list[Chunk]] = {}
    for r, rank in enumerate(plan):
        gang_order = []
        for j, mb in enumerate(rank):
            found = [e for e in mb if isinstance(e, Chunk)]
            if found:
                c = found[0]
                if len(mb) != 1:
                    raise OdcUsageError(f"plan[{r}][{j}]: a chunk must be alone in its micro-batch")
                if len(gang_order) != j:
                    raise OdcUsageError(f"plan[{r}][{j}]: gang micro-batches must come before whole samples")
                if not (0 <= c.sample < len(lengths)) or c.length != lengths[c.sample]:
                    raise OdcUsageError(f"plan[{r}][{j}]: {c} does not match sample lengths")
                if c.ranks[c.part] != r or c.tokens > max_tokens:
                    raise OdcUsageError(f"plan[{r}][{j}]: {c} is on the wrong rank or over max_tokens={max_tokens}")
                gang_order.append(c.gang)
                chunks.setdefault(c.sample, []).append(c)
                continue
            for i in mb:
                if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(lengths):
                    raise OdcUsageError(f"plan[{r}][{j}] holds {i!r}, not a sample index or a Chunk")
            if len(mb) > 1 and sum(lengths[i] for i in mb) > max_tokens:
                raise OdcUsageError(f"plan[{r}][{j}]: {len(mb)} samples exceed max_tokens={max_tokens}")
            whole.extend(mb)
        if gang_order != sorted(set(gang_order)):
            raise OdcUsageError(f"plan[{r}]: gangs {gang_order} are not in increasing order")
    for i, cs in chunks.items():
        first = cs[0]
        same = all((c.gang, c.parts, c.ranks) == (first.gang, first.parts, first.ranks) for c in cs)
        if not same or sorted(c.part for c in cs) != list(range(first.parts)) or len(set(first.ranks)) != first.parts:
            raise OdcUsageError(f"sample {i}: its chunks do not form one gang of distinct ranks: {cs}")
    if sorted(whole + list(chunks)) != list(range(len(lengths))):
        raise OdcUsageError("plan does not place every sample exactly once")
