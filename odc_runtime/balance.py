"""Minibatch-level load balancing: which rank runs which samples, in which micro-batch.

With collectives (FSDP) every rank must run the same number of micro-batches and every layer of micro-batch
``i`` is a barrier across ranks, so the time of a minibatch is the sum over micro-batch *steps* of the slowest
rank's micro-batch. With ODC the only barrier is once per minibatch, so the time is the slowest rank's *total*.
This module plans both kinds of schedule from sequence lengths and a per-sequence cost model, and predicts what
each would waste (``imbalance``). It is pure Python (no torch) so it can run in a data loader.

A plan is ``plan[rank][i] = [sample indices of rank's i-th micro-batch]``. Policies (``POLICY_REGISTRY``;
``POLICIES`` lists their names):

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
    holds one ``odc_runtime.split.Chunk`` instead of sample indices (``odc_runtime.split``).

The cost of a micro-batch is the sum of its sequences' costs (packed variable-length attention is quadratic per
sequence, not in the packed length). Fixed per-micro-batch overheads (e.g. fetching the parameters once per
micro-batch) are not modelled; packing minimises the number of micro-batches, which keeps them small.
"""


from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from odc_runtime.cost import DEFAULT_COST_MODEL, CostModel, check_lengths, check_positive_int
from odc_runtime.errors import OdcUsageError
from odc_runtime.packing import Job, Plan, plan_lb_micro, plan_lb_mini, plan_local_sort, plan_verl_lb_micro
from odc_runtime.split import Chunk, chunk_cost, plan_lb_mini_split

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


# --------------------------------------------------------------------------------------------------- planning


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
    longer than ``max_tokens`` raises ``OdcUsageError``, or with ``allow_oversized=True`` gets a
    micro-batch of its own. Within a micro-batch indices are ascending; a rank's micro-batches come most
    expensive first (for ``"lb_micro"`` the i-th micro-batches of all ranks form step i, and steps come
    most expensive first). The result is deterministic: no randomness, ties broken by index.

    ``"lb_mini"`` guarantees a per-rank maximum total cost no larger than that of ``"local_sort"``,
    ``"verl_lb_micro"`` and ``"lb_micro"`` on the same input (it evaluates their rank assignments as
    candidates), and within ``4/3 - 1/(3·world_size)`` of the optimum (it includes the LPT assignment,
    Graham's bound).

    ``max_gang_size``: for policies that split samples (``lb_mini_split``), the most ranks one sample may be split
    across (default the world size); pass the same value to ``odc_runtime.gang.GangExchange``, whose memory
    grows with it. Other policies never split, so the cap holds for them as it is.
    """
    entry = get_policy(policy)
    planner = entry.planner
    world_size = check_positive_int("world_size", world_size)
    max_tokens = check_positive_int("max_tokens", max_tokens)
    if not isinstance(cost, CostModel):
        raise OdcUsageError(f"cost must be a CostModel, got {type(cost).__name__}")
    lens = check_lengths(lengths)
    _check_oversized(lens, max_tokens, allow_oversized or entry.splits)
    if max_gang_size is not None:
        max_gang_size = check_positive_int("max_gang_size", max_gang_size)
    job = Job(lens, [cost.cost(s) for s in lens], world_size, max_tokens, cost, max_gang_size)
    return planner(job)



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



@dataclass(frozen=True)
class Policy:
    """One balancing policy: its name, its planner and what its plans promise.

    ``planner`` receives the validated problem (lengths, per-sample costs, ranks, token cap) and returns a
    ``Plan`` with the guarantees ``plan`` documents. ``equal_counts``: every rank gets the same number
    of micro-batches (padded with empty ones where needed), so collectives (FSDP) can run the plan; when
    ``False`` counts differ between ranks and only ODC can run it. ``summary`` is one line for tables and help.
    ``splits``: the plan may hold ``odc_runtime.split.Chunk`` entries (a sample over ``max_tokens`` is split,
    not refused), which only a runtime with gang attention (``odc_runtime.gang``) can run.
    """

    name: str
    planner: Callable[[Job], Plan]
    equal_counts: bool
    summary: str
    splits: bool = False

    @property
    def native_comm(self) -> str:
        """The communication the policy is designed for: ``"collective"`` (equal counts) or ``"odc"``."""
        return "collective" if self.equal_counts else "odc"


#: Every balancing policy by name, in a fixed order (the baseline first). Adding a policy is one entry here:
#: ``plan``, ``POLICIES``, the benchmarks and the examples all derive from this mapping.
POLICY_REGISTRY: Mapping[str, Policy] = MappingProxyType({
    p.name: p
    for p in (
        Policy("local_sort", plan_local_sort, equal_counts=True,
               summary="deal round robin, each rank sorts and packs its own samples; counts padded equal"),
        Policy("verl_lb_micro", plan_verl_lb_micro, equal_counts=True,
               summary="veRL's dynamic batching: equal sample counts per rank (Karmarkar-Karp), each rank packs "
                       "its own, count all-reduced to the max (what a veRL user runs today)"),
        Policy("lb_micro", plan_lb_micro, equal_counts=True,
               summary="equal counts, each micro-batch step balanced across ranks (the best for collectives)"),
        Policy("lb_mini", plan_lb_mini, equal_counts=False,
               summary="each rank's total balanced over the minibatch; counts differ, zero allowed (ODC)"),
        Policy("lb_mini_split", lambda job: plan_lb_mini_split(job, job.model), equal_counts=False,
               summary="lb_mini, outlier samples split into chunks run by a gang of ranks (ODC, gang attention)",
               splits=True),
    )
})

#: The policy names, in registry order.
POLICIES: tuple[str, ...] = tuple(POLICY_REGISTRY)


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``; ``OdcUsageError`` naming the valid ones otherwise."""
    policy = POLICY_REGISTRY.get(name) if isinstance(name, str) else None
    if policy is None:
        raise OdcUsageError(f"unknown policy {name!r}; valid policies: {', '.join(POLICY_REGISTRY)}")
    return policy


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
    """Predicted per-rank totals, waste and times of ``plan`` (from ``plan``) for these lengths.

    - ``collective_waste = Σ_i (max_r c[r][i] − mean_r c[r][i])`` and ``collective_time = Σ_i max_r c[r][i]``
      over micro-batch steps i;
    - ``odc_waste = max_r T[r] − mean_r T[r]`` and ``odc_time = max_r T[r]`` for rank totals T.
    """
    lens = check_lengths(lengths)
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
    """Cost of one plan entry: a sample index, or a chunk of a split sample (``odc_runtime.split``)."""
    if isinstance(i, Chunk):
        if not 0 <= i.sample < len(lens) or i.length != lens[i.sample]:
            raise OdcUsageError(f"plan[{r}] holds {i!r}, which does not match lengths[{i.sample}]")
        return chunk_cost(i, cost)
    if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(lens):
        raise OdcUsageError(f"plan[{r}] holds {i!r}, not a sample index in [0, {len(lens)})")
    return costs[i]

