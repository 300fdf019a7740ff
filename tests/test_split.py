"""Tests of the lb_mini_split planner (odc_runtime.split): chunks, gangs, plans, imbalance, bad input."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odc_runtime.balance import DEFAULT_COST_MODEL, POLICY_REGISTRY, CostModel, imbalance, plan
from odc_runtime.errors import OdcUsageError
from odc_runtime.split import KV_RATIO, Chunk, check_split_plan, chunk_cost, chunk_ranges

PROPERTY = settings(max_examples=60, deadline=None)
COST_MODELS = [CostModel(1.0, 0.0), CostModel(0.0, 1.0), CostModel(1e-3, 1.0), DEFAULT_COST_MODEL]


def chunks_of(result: list) -> list[Chunk]:
    return [e for rank in result for mb in rank for e in mb if isinstance(e, Chunk)]


# ----------------------------------------------------------------------------------------------- chunks


def test_head_and_tail_pairing_by_hand() -> None:
    # 10 tokens, 2 chunks: cuts at 0, 2, 5, 7, 10; chunk 0 = first and last piece, chunk 1 = the middle two.
    assert chunk_ranges(10, 2) == [((0, 2), (7, 10)), ((2, 5), (5, 7))]
    c = Chunk(sample=0, part=1, parts=2, length=10, gang=0, ranks=(3, 5))
    assert c.positions() == [2, 3, 4, 5, 6] and c.tokens == 5


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_chunks_balance_causal_attention_exactly(parts: int) -> None:
    # Pieces of m tokens: chunk p's causal square is m²·((2p+1) + (4k-2p-1)) = 4k·m², the same for every p.
    length, attention = 2 * parts * 7, CostModel(1.0, 0.0)
    costs = [chunk_cost(Chunk(0, p, parts, length, 0, ()), attention, kv_ratio=0.0) for p in range(parts)]
    assert costs == [costs[0]] * parts
    # Together the chunks do exactly the unsplit sample's work, plus the K/V exchange.
    assert math.fsum(costs) == attention.cost(length)
    linear = CostModel(0.0, 1.0)
    full = [chunk_cost(Chunk(0, p, parts, length, 0, ()), linear) for p in range(parts)]
    assert math.fsum(full) == pytest.approx(length + KV_RATIO * length * (parts - 1))


def test_chunk_ranges_refuses_chunks_without_two_pieces() -> None:
    with pytest.raises(OdcUsageError, match="cannot split 5 tokens into 3 chunks"):
        chunk_ranges(5, 3)


# ----------------------------------------------------------------------------------------------- plans


def test_outlier_is_split_and_beats_the_lb_mini_floor() -> None:
    lengths = [1000 + 97 * i for i in range(14)] + [60000]
    base = plan(lengths, 8, max_tokens=65536, policy="lb_mini")
    result = plan(lengths, 8, max_tokens=65536, policy="lb_mini_split")
    check_split_plan(result, lengths, world_size=8, max_tokens=65536)
    chunks = chunks_of(result)
    assert {c.sample for c in chunks} == {14} and len(chunks) == chunks[0].parts > 1
    # lb_mini sits on its floor (the 60K sample alone); the split plan is far below it and near the mean.
    assert imbalance(base, lengths).odc_time == DEFAULT_COST_MODEL.cost(60000)
    split_time = imbalance(result, lengths).odc_time
    assert split_time < 0.5 * imbalance(base, lengths).odc_time
    assert imbalance(result, lengths).max_over_mean < 1.1


def test_nothing_to_split_gives_lb_mini_exactly() -> None:
    lengths = [500, 700, 300, 900, 400, 600]
    assert plan(lengths, 2, max_tokens=4096, policy="lb_mini_split") == plan(
        lengths, 2, max_tokens=4096, policy="lb_mini")


def test_sample_over_the_cap_is_split_not_refused() -> None:
    lengths = [100, 200, 50]
    with pytest.raises(OdcUsageError, match="more than max_tokens"):
        plan(lengths, 2, max_tokens=120, policy="lb_mini")
    result = plan(lengths, 2, max_tokens=120, policy="lb_mini_split")
    check_split_plan(result, lengths, world_size=2, max_tokens=120)
    assert result == [[[Chunk(1, 0, 2, 200, 0, (0, 1))], [0]], [[Chunk(1, 1, 2, 200, 0, (0, 1))], [2]]]


@pytest.mark.parametrize(("lengths", "world"), [([100, 300, 50], 2), ([300], 1)])
def test_chunk_still_over_the_cap_is_a_typed_error(lengths: list[int], world: int) -> None:
    with pytest.raises(OdcUsageError, match=rf"needs a gang of at least 3 ranks.*world_size is {world}"):
        plan(lengths, world, max_tokens=120, policy="lb_mini_split")


def test_max_gang_size_caps_every_gang_and_refuses_what_cannot_fit() -> None:
    # 8 ranks, one outlier worth most of the minibatch: uncapped it is split across many ranks; capped, across at
    # most 2 (the rest of the plan stays valid), and a sample that needs 3 chunks under the token cap is refused.
    lengths = [4000, 300, 200, 100, 100, 100, 100, 100]
    uncapped = plan(lengths, 8, max_tokens=4000, policy="lb_mini_split")
    assert max(c.parts for c in chunks_of(uncapped)) > 2
    capped = plan(lengths, 8, max_tokens=4000, policy="lb_mini_split", max_gang_size=2)
    check_split_plan(capped, lengths, world_size=8, max_tokens=4000)
    assert {c.parts for c in chunks_of(capped)} == {2}
    with pytest.raises(OdcUsageError, match=r"needs a gang of at least 3 ranks.*max_gang_size is 2"):
        plan([5000, 10], 8, max_tokens=2000, policy="lb_mini_split", max_gang_size=2)
    for bad in (0, True, 2.0):
        with pytest.raises(OdcUsageError, match="max_gang_size"):
            plan(lengths, 8, max_tokens=4000, policy="lb_mini_split", max_gang_size=bad)
    assert plan(lengths, 8, max_tokens=4000, policy="lb_mini", max_gang_size=2) == plan(
        lengths, 8, max_tokens=4000, policy="lb_mini")  # a policy that never splits: the cap changes nothing


def test_gangs_sharing_ranks_run_in_one_agreed_order() -> None:
    # Two outliers on 3 ranks: the gangs must share a rank; every member meets them in gang order, first.
    lengths = [3000, 2900, 10, 10]
    result = plan(lengths, 3, max_tokens=2000, policy="lb_mini_split", cost=CostModel(1.0, 0.0))
    check_split_plan(result, lengths, world_size=3, max_tokens=2000)
    chunks = chunks_of(result)
    assert sorted({c.sample for c in chunks}) == [0, 1] and {c.gang for c in chunks} == {0, 1}
    shared = set(chunks[0].ranks) & {r for c in chunks if c.gang != chunks[0].gang for r in c.ranks}
    assert shared
    for r in shared:
        assert [mb[0].gang for mb in result[r][:2]] == [0, 1]
    # The same plan with one rank's gangs swapped is rejected (it could deadlock).
    r = min(shared)
    swapped = [list(rank) for rank in result]
    swapped[r][0], swapped[r][1] = swapped[r][1], swapped[r][0]
    with pytest.raises(OdcUsageError, match="not in increasing order"):
        check_split_plan(swapped, lengths, world_size=3, max_tokens=2000)


def test_check_split_plan_rejects_broken_gangs() -> None:
    lengths = [100, 200, 50]
    result = plan(lengths, 2, max_tokens=120, policy="lb_mini_split")
    lost = [result[0], [mb for mb in result[1] if not isinstance(mb[0], Chunk)]]
    with pytest.raises(OdcUsageError, match="one gang"):
        check_split_plan(lost, lengths, world_size=2, max_tokens=120)
    moved = [[result[0][0], result[1][0], result[0][1]], [result[1][1]]]  # part 1 on rank 0
    with pytest.raises(OdcUsageError, match="wrong rank"):
        check_split_plan(moved, lengths, world_size=2, max_tokens=120)
    late = [[result[0][1], result[0][0]], result[1]]
    with pytest.raises(OdcUsageError, match="before whole samples"):
        check_split_plan(late, lengths, world_size=2, max_tokens=120)


def test_imbalance_prices_chunks_by_hand() -> None:
    # cost(s) = s², no K/V charge visible with b = 0: chunk 0 of 8 tokens = pieces [0,2) and [6,8): 4 + 28 = 32.
    cost = CostModel(1.0, 0.0)
    gang = (0, 1)
    result = [[[Chunk(0, 0, 2, 8, 0, gang)], [1]], [[Chunk(0, 1, 2, 8, 0, gang)]]]
    got = imbalance(result, [8, 3], cost)
    assert got.per_rank_cost == (32.0 + 9.0, 32.0)  # chunk 1: [2,4) and [4,6): 12 + 20
    assert got.collective_time == 32.0 + 9.0
    with pytest.raises(OdcUsageError, match="does not match lengths"):
        imbalance(result, [9, 3], cost)


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[int], int, int, CostModel]:
    """Mostly short samples and a few outliers, ranks 1-12, a cap that every sample fits."""
    max_tokens = draw(st.sampled_from([100, 1000, 4096]))
    short = st.integers(1, max(1, max_tokens // 16))
    lengths = draw(st.lists(st.one_of(short, short, st.integers(1, max_tokens)), max_size=40))
    return lengths, draw(st.integers(1, 12)), max_tokens, draw(st.sampled_from(COST_MODELS))


@PROPERTY
@given(problems())
def test_split_plans_are_valid_deterministic_and_never_worse_than_lb_mini(problem: tuple) -> None:
    lengths, w, max_tokens, cost = problem
    result = plan(lengths, w, max_tokens=max_tokens, policy="lb_mini_split", cost=cost)
    check_split_plan(result, lengths, world_size=w, max_tokens=max_tokens)
    assert result == plan(list(lengths), w, max_tokens=max_tokens, policy="lb_mini_split", cost=cost)
    if lengths:
        base = plan(lengths, w, max_tokens=max_tokens, policy="lb_mini", cost=cost)
        assert imbalance(result, lengths, cost).odc_time <= imbalance(base, lengths, cost).odc_time


def test_registered_as_an_odc_policy_that_splits() -> None:
    entry = POLICY_REGISTRY["lb_mini_split"]
    assert entry.native_comm == "odc" and entry.splits and not entry.equal_counts
    assert not any(p.splits for name, p in POLICY_REGISTRY.items() if name != "lb_mini_split")
    assert dataclasses.replace(Chunk(0, 0, 2, 8, 0, (0, 1)), part=1).ranges == ((2, 4), (4, 6))
