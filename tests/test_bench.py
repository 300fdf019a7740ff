"""Smoke tests of the benchmarks: schedule logic, simulator sanity, tiny end-to-end runs (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import schedule as sch  # noqa: E402
import simulate  # noqa: E402

from odc_runtime.balance import CostModel  # noqa: E402
from odc_runtime.workloads import sample_lengths  # noqa: E402

COST = sch.cost_model_for("7b", "h100", 0.4)


def _batches(n_batches=3, size=24, seed=1):
    return _common.split_minibatches(sample_lengths("longalign_sft", n_batches * size, seed=seed), size)


def _build(comm, policy, batches, world=4, layers=3):
    return sch.build_schedule(batches, world, comm=comm, policy=policy, cost=COST, max_tokens=65536,
                              num_layers=layers)


@pytest.mark.parametrize(("comm", "policy"), sch.grid())
def test_schedule_deterministic_and_complete(comm, policy):
    batches = _batches()
    a, b = _build(comm, policy, batches), _build(comm, policy, batches)
    assert a == b and a.digest() == b.digest()
    seen = sorted(i for m in a.minibatches for mbs in m.ranks for mb in mbs for i in mb.samples)
    assert seen == list(range(sum(len(x) for x in batches)))  # every sample exactly once
    flat = [x for batch in batches for x in batch]
    for m in a.minibatches:
        assert len(m.ranks) == 4
        for mbs in m.ranks:
            for mb in mbs:
                assert mb.tokens == sum(flat[i] for i in mb.samples)
                assert mb.cost_s == pytest.approx(COST.cost_of(flat[i] for i in mb.samples))
        counts = {len(mbs) for mbs in m.ranks}
        if comm == "collective":
            assert len(counts) == 1  # padded to equal counts, as collectives force
        else:
            assert all(not mb.empty for mbs in m.ranks for mb in mbs)  # ODC runs only real micro-batches
    assert a.tokens == sum(flat)


def test_program_shape():
    s = _build("collective", "local_sort", _batches(1), layers=3)
    progs = [s.program(0, r) for r in range(4)]
    assert len({len(p) for p in progs}) == 1
    p = progs[0]
    assert [t.layer for t in p[:6]] == [0, 1, 2, 2, 1, 0]
    assert [t.scatter for t in p[:6]] == [False] * 3 + [True] * 3
    for r in range(4):
        total = sum(t.compute_s for t in progs[r])
        assert total == pytest.approx(sum(mb.cost_s for mb in s.minibatches[0].ranks[r]))


def test_lb_mini_needs_odc():
    with pytest.raises(ValueError):
        _build("collective", "lb_mini", _batches(1))
    assert ("collective", "lb_mini") not in sch.grid()


@pytest.mark.parametrize("link", ["none", "nvlink", "ib"])
@pytest.mark.parametrize("policy", ["local_sort", "lb_micro"])
@pytest.mark.parametrize("overlap", [True, False])
def test_simulator_odc_never_slower_on_same_plan(link, policy, overlap):
    batches = _batches(4)
    spec = sch.MODELS["7b"]
    kw = {"layer_bytes": 2 * spec.layer_params(), "link": simulate.LINKS[link], "overlap": overlap,
          "sync_s": 1e-3}
    coll = simulate.simulate(_build("collective", policy, batches), **kw)
    odc = simulate.simulate(_build("odc", policy, batches), **kw)
    assert odc.time_s <= coll.time_s * (1 + 1e-12)
    assert all(o <= c * (1 + 1e-12) for o, c in zip(odc.minibatch_s, coll.minibatch_s, strict=True))
    assert 0 < odc.utilization <= 1 and 0 < coll.utilization <= 1
    assert odc.tokens == coll.tokens


@pytest.mark.parametrize("link", ["none", "nvlink"])
def test_simulator_equal_when_perfectly_balanced(link):
    batches = [[4096] * 8, [2048] * 8]  # every rank: two equal micro-batches (max_tokens = one sample)
    cost = CostModel(1e-9, 1e-6)
    scheds = [sch.build_schedule(batches, 4, comm=c, policy="lb_micro", cost=cost, max_tokens=4096, num_layers=2)
              for c in ("collective", "odc")]
    kw = {"layer_bytes": 1e8, "link": simulate.LINKS[link], "sync_s": 1e-3}
    coll, odc = (simulate.simulate(s, **kw) for s in scheds)
    assert odc.time_s == pytest.approx(coll.time_s, rel=1e-12)
    if link == "none":
        busy = 2 * cost.cost(4096) + 2 * cost.cost(2048)  # per rank, both minibatches
        assert coll.utilization == pytest.approx(busy / (busy + 2e-3), rel=1e-9)


def _run(args, tmp_path, timeout=90):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH.parent), env.get("PYTHONPATH")]))
    env.setdefault("ODC_TIMEOUT", "60")
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_imbalance_end_to_end_two_ranks(tmp_path):
    out = tmp_path / "imb.json"
    plot = tmp_path / "imb.png"
    plot_arg = str(plot) if _has_matplotlib() else "none"
    _run([str(BENCH / "imbalance.py"), "--nproc", "2", "--minibatches", "2", "--minibatch-size", "8",
          "--time-scale", "0.002", "--layers", "2", "--layer-mb", "0.0625", "--json", str(out),
          "--plot", plot_arg], tmp_path)
    data = json.loads(out.read_text())
    got = {(r["comm"], r["policy"]) for r in data["runs"]}
    assert got == set(sch.grid())
    for r in data["runs"]:
        assert r["tokens_per_s"] > 0
        assert len(r["idle_s_per_rank"]) == 2
        assert 0 < r["utilization"] <= 1
        assert r["grad_check_ok"]
    assert data["config"]["world_size"] == 2 and "machine" in data
    if plot_arg != "none":
        assert plot.stat().st_size > 0


def test_comm_end_to_end_two_ranks(tmp_path):
    out = tmp_path / "comm.json"
    _run([str(BENCH / "comm.py"), "--nproc", "2", "--sizes", "64K", "--repeats", "2", "--warmup", "1",
          "--json", str(out), "--plot", "none"], tmp_path)
    data = json.loads(out.read_text())
    ops = {r["op"] for r in data["results"]}
    assert {"copy", "fetch", "push", "all_gather", "red_scatter"} <= ops
    assert all(r["time_s"] > 0 for r in data["results"])


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
