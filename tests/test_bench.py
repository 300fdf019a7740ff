"""Smoke tests of the benchmarks: schedule logic, simulator sanity, tiny end-to-end runs (no timing asserts)."""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from odc_runtime.balance import CostModel
from odc_runtime.bench import _common, simulate
from odc_runtime.bench import netmodel as nm
from odc_runtime.bench import schedule as sch
from odc_runtime.bench.__main__ import TOOLS
from odc_runtime.workloads import sample_lengths

BENCH = Path(_common.__file__).resolve().parent  # bench/ of a checkout, or odc_runtime/bench of an install

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


def test_hsdp_allreduce_term_hand_computed():
    """HSDP's end-of-minibatch all-reduce: latency + 2·(R-1)/R · (L · layer_bytes / S) / bandwidth per minibatch."""
    link = simulate.Link("test", 10.0, 10.0, 1e-3)
    # 4 replicas, 1 GB: 1 ms + 2 · 3/4 · 1e9 B / 10e9 B/s = 0.151 s; one replica or no bytes: nothing to reduce
    assert simulate.allreduce_seconds(link, 1e9, 4) == pytest.approx(0.151, rel=1e-12)
    assert simulate.allreduce_seconds(link, 1e9, 1) == 0.0
    assert simulate.allreduce_seconds(link, 0.0, 4) == 0.0
    # In the simulator: 4 ranks as 2 replicas × 2, 3 layers of 1e8 B, intra-group links free, so the difference to
    # the compute-only run is the all-reduce of a rank's 3·1e8/2 = 1.5e8 B: 1 ms + 2 · 1/2 · 1.5e8 / 1e10 = 16 ms.
    batches = _batches(2)
    s = sch.build_schedule(batches, 4, comm="odc", policy="lb_mini", cost=COST, max_tokens=65536, num_layers=3,
                           replicas=2)
    assert s.shard_size == 2 and s.shard_groups() == [[0, 1], [2, 3]]
    base = simulate.simulate(s, layer_bytes=0, link=simulate.LINKS["none"])
    hsdp = simulate.simulate(s, layer_bytes=1e8, link=simulate.LINKS["none"], replica_link=link)
    assert [h - b for h, b in zip(hsdp.minibatch_s, base.minibatch_s, strict=True)] == pytest.approx([0.016] * 2)


def test_hsdp_collective_lockstep_only_within_shard_groups():
    """Collectives under HSDP wait for the slowest rank of their shard group per layer, not of the world: compute
    alone never takes longer than the 1-D schedule of the same plan, and a bad world size is refused."""
    batches = _batches(3)
    flat = simulate.simulate(_build("collective", "local_sort", batches), layer_bytes=0, link=simulate.LINKS["none"])
    hsdp = simulate.simulate(
        sch.build_schedule(batches, 4, comm="collective", policy="local_sort", cost=COST, max_tokens=65536,
                           num_layers=3, replicas=2), layer_bytes=0, link=simulate.LINKS["none"])
    assert all(h <= f * (1 + 1e-12) for h, f in zip(hsdp.minibatch_s, flat.minibatch_s, strict=True))
    with pytest.raises(ValueError, match="replicas"):
        sch.build_schedule(batches, 4, comm="odc", policy="lb_mini", cost=COST, max_tokens=65536, num_layers=3,
                           replicas=3)



def test_simulator_gang_hand_computed():
    """A split sample: both chunks run in per-layer lockstep plus the K/V exchange, then the whole sample."""
    from odc_runtime.split import Chunk

    # 200 tokens over 2 ranks (cap 120): chunks of 100 tokens with equal causal work a·20000 = 0.02 s each; the
    # 10-token sample (1e-4 s) goes to one rank. K/V: 1000 B per token and layer; each member receives 100 tokens
    # and sends 100: 1 ms + 1e5 B / 1 GB/s = 1.1 ms per layer and direction, 2 layers × 2 directions, not overlapped.
    cost = CostModel(1e-6, 0.0)
    s = sch.build_schedule([[200, 10]], 2, comm="odc", policy="lb_mini_split", cost=cost, max_tokens=120,
                           num_layers=2)
    chunks = [m.chunk for mbs in s.minibatches[0].ranks for m in mbs if m.chunk is not None]
    assert sorted(c.part for c in chunks) == [0, 1] and all(c.tokens == 100 for c in chunks)
    link = simulate.Link("test", 1.0, 1.0, 1e-3)
    res = simulate.simulate(s, layer_bytes=0, link=link, overlap=False, kv_token_bytes=1000)
    assert res.minibatch_s == pytest.approx([0.02 + 4 * 1.1e-3 + 1e-4], rel=1e-9)
    assert res.busy_s == pytest.approx([0.02 + 1e-4, 0.02] if s.minibatches[0].ranks[0][-1].chunk is None
                                       else [0.02, 0.02 + 1e-4], rel=1e-9)
    assert isinstance(chunks[0], Chunk)


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
    env = dict(os.environ)  # a checkout that is not installed: bench/_checkout.py finds odc_runtime
    env.setdefault("ODC_TIMEOUT", "60")
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_imbalance_end_to_end_two_ranks(tmp_path):
    out = tmp_path / "imb.json"
    plot = tmp_path / "imb.png"
    plot_arg = str(plot) if _has_matplotlib() else "none"
    proc = _run([str(BENCH / "imbalance.py"), "--nproc", "2", "--minibatches", "2", "--minibatch-size", "8",
                 "--time-scale", "0.002", "--layers", "2", "--layer-mb", "0.0625", "--outliers", "--json", str(out),
                 "--plot", plot_arg, "--trace-dir", str(tmp_path / "trace")], tmp_path)
    data = json.loads(out.read_text())
    got = {(r["comm"], r["policy"]) for r in data["runs"]}
    assert got == set(sch.grid())
    # --trace-dir: the runtime's trace format, one label per configuration; the report's idle seconds per rank are
    # the table's (wall − compute), its busy seconds the modelled compute
    from odc_runtime import report

    traced = {run.label: report.summarize(run) for run in report.load(str(tmp_path / "trace"))}
    assert set(traced) == {f"{c} + {p}" for c, p in got}
    for r in data["runs"]:
        s = traced[f"{r['comm']} + {r['policy']}"]
        assert s["minibatches"] == 2 and s["wall_s"] == pytest.approx(r["wall_s"], abs=1e-3)
        assert s["idle_s"] == pytest.approx(r["idle_s_per_rank"], abs=1e-3)
        assert s["busy_s"] == pytest.approx(r["busy_s_per_rank"], abs=1e-3)
        assert sum(s["micro_batches"]) >= 2 and (sum(s["push_bytes"]) > 0) == (r["comm"] == "odc")
    for r in data["runs"]:
        assert r["tokens_per_s"] > 0
        assert all(r[f"speedup_vs_collective_{p}"] > 0 for p in ("local_sort", "verl_lb_micro", "lb_micro"))
        assert len(r["idle_s_per_rank"]) == 2
        assert 0 < r["utilization"] <= 1
        assert r["grad_check_ok"]
    assert data["config"]["world_size"] == 2 and "machine" in data
    if plot_arg != "none":
        assert plot.stat().st_size > 0
    # --outliers: odc + lb_mini beside odc + lb_mini_split on 2 samples per rank, where a sample is split and its
    # gang's K/V really moves; every gradient and exchanged row exact.
    outliers = {r["policy"]: r for r in data["outliers"]["runs"]}
    assert set(outliers) == {"lb_mini", "lb_mini_split"} and all(r["comm"] == "odc" for r in outliers.values())
    assert data["outliers"]["minibatch_size"] == 2 * 2
    assert all(r["grad_check_ok"] for r in outliers.values())
    assert outliers["lb_mini"]["kv_exchange_calls"] == 0 < outliers["lb_mini_split"]["kv_exchange_calls"]
    assert outliers["lb_mini_split"]["speedup_vs_odc_lb_mini"] > 0
    assert "Outliers: 6 minibatches × 4 samples (2 per rank)" in proc.stdout
    assert "K/V exchange through odc_runtime.gang" in proc.stdout
    # each table's "executed in" line under that table; the outlier table warns about its spread
    main, _, outlier = proc.stdout.partition("Outliers: ")
    assert main.count("  executed in ") == 1 and "load average" in main.split("  executed in ")[1]
    assert outlier.count("  executed in ") == 1 and "NOTE: one run of this phase varies" in outlier
    assert "columns as in the table above" in outlier and "collective = gloo" not in outlier


def test_recorded_timeline_covers_the_whole_minibatch():
    """The plot's events leave no gap: what is not compute is communication (before the end-of-minibatch work)
    or sync (in it), as in the trace, so every colour of the plot is in its key."""
    from odc_runtime.bench.executor import MinibatchRecord, timeline_events

    rec = MinibatchRecord(0.0, 6.0, 2.0, 3.0, 1.0, True,
                          [("comm", 0.5, 1.0), ("compute", 1.0, 2.0), ("compute", 3.0, 4.0), ("sync", 5.0, 6.0)])
    assert timeline_events(rec) == [("comm", 0.0, 1.0), ("compute", 1.0, 2.0), ("comm", 2.0, 3.0),
                                    ("compute", 3.0, 4.0), ("comm", 4.0, 5.0), ("sync", 5.0, 6.0)]


def test_imbalance_hsdp_2x2_four_ranks(tmp_path):
    """--hsdp 2x2: shard groups of 2, the cross-replica all-reduce, exact gradients in every configuration."""
    out = tmp_path / "imb.json"
    proc = _run([str(BENCH / "imbalance.py"), "--nproc", "4", "--hsdp", "2x2", "--minibatches", "2",
                 "--minibatch-size", "8", "--time-scale", "0.002", "--layers", "2", "--layer-mb", "0.0625",
                 "--json", str(out), "--plot", "none"], tmp_path, timeout=180)
    assert "HSDP 2×2" in proc.stdout
    data = json.loads(out.read_text())
    assert {(r["comm"], r["policy"]) for r in data["runs"]} == set(sch.grid())
    assert all(r["grad_check_ok"] and len(r["idle_s_per_rank"]) == 4 for r in data["runs"])
    assert data["config"]["hsdp"] == [2, 2] and data["config"]["world_size"] == 4


@pytest.mark.parametrize("world, lengths", [(2, [30000, 1000, 1000, 1000]), (3, [40000, 1000, 1000, 1000, 2000, 500])])
def test_imbalance_runs_split_plans_with_a_real_kv_exchange(tmp_path, world, lengths):
    """lb_mini_split (named in --policies, ODC only): the outlier is split over every rank, its gang's K/V and
    dK/dV really move at every layer (calls and bytes counted by the executor), and every gradient and every
    exchanged K/V row is exact."""
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(lengths))
    out, plot = tmp_path / "imb.json", tmp_path / "imb.png"
    plot_arg = str(plot) if _has_matplotlib() else "none"  # odc only: no collective baseline to compare with
    layers = 2
    proc = _run([str(BENCH / "imbalance.py"), "--nproc", str(world), "--lengths-file", str(path), "--minibatches",
                 "1", "--minibatch-size", str(len(lengths)), "--time-scale", "0.002", "--layers", str(layers),
                 "--layer-mb", "0.0625", "--comms", "odc", "--policies", "lb_mini,lb_mini_split", "--json", str(out),
                 "--plot", plot_arg], tmp_path, timeout=110)
    if plot_arg != "none":
        assert plot.stat().st_size > 0
    runs = {r["policy"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"lb_mini", "lb_mini_split"} and all(r["comm"] == "odc" for r in runs.values())
    assert all(r["grad_check_ok"] for r in runs.values())
    split = runs["lb_mini_split"]
    assert runs["lb_mini"]["kv_exchange_calls"] == 0
    assert split["kv_exchange_calls"] == world * layers * 2  # every member: every layer, forward and backward
    # One fp32 element of K and of V per token (7b's K/V scaled like 0.0625 MiB layers rounds up to 1): per layer,
    # every member sends its chunk to the other world-1 members and gets the others' dK/dV back.
    parts, length = world, lengths[0]
    assert split["kv_exchange_bytes"] == layers * 2 * (parts - 1) * 2 * length * 4
    assert "K/V exchange through odc_runtime.gang" in proc.stdout
    # the memory the exchange held: ((world - 1) rings of depth 2 + the stage) slots of a chunk's K and V, fp32,
    # plus its small int64 buffers (tags, acks, stage words, signal words); a tag is 6 words plus the members, padded
    # to the largest gang (the world here)
    config = json.loads(out.read_text())["config"]
    slot = 2 * config["max_tokens"] * 1 * 4
    tag = 6 + world
    words = 8 * ((world - 1) * 2 * tag + 2 * world + tag + 1 + 3 * world)
    assert config["gang_symmetric_bytes"] == ((world - 1) * 2 + 1) * slot + words
    assert f"{config['gang_symmetric_bytes'] / 2**20:.2f} MiB of symmetric memory per rank" in proc.stdout


def _gang_kv_rank(rank: int, world: int) -> dict[str, list[bool]]:
    import types

    import torch

    import odc_runtime as odc
    from odc_runtime import gang
    from odc_runtime.bench.executor import GangKV
    from odc_runtime.bench.schedule import micro_batch_tasks
    from odc_runtime.split import Chunk

    odc.init("host")
    kv = GangKV(2, 64, 3)
    corruptions = {
        "none": lambda k: k,
        "forward": lambda k: k + 1.0,  # a wrong value delivered
        "backward": lambda k: k + (k - k.detach()),  # right values, every dK contribution doubled
    }
    oks = {}
    for name, corrupt in corruptions.items():
        def exchange(step, layer, k, v, corrupt=corrupt):
            k_all, v_all = gang.exchange_kv(step, layer, k, v)
            return corrupt(k_all), v_all

        kv.gang = types.SimpleNamespace(exchange_kv=exchange)
        chunk = Chunk(0, rank, world, 50, 0, tuple(range(world)))
        oks[name] = [kv.run(t)[0] for t in micro_batch_tasks(0, 2, chunk=chunk)]
    torch.distributed.barrier()
    kv.free()
    return oks


def test_gang_kv_check_catches_wrong_exchanges():
    """The executor's exact check of a gang exchange passes on the real exchange and fails when a K row arrives
    wrong (forward) or an owner gets a wrong dK sum back (backward)."""
    from _dist import run_ranks

    for oks in run_ranks(_gang_kv_rank, 2, timeout=60):
        assert oks["none"] == [True] * 4
        assert oks["forward"] == [False, False, True, True]
        assert oks["backward"] == [True, True, False, False]


def test_imbalance_runs_split_policies_only_when_named_and_only_with_odc():
    from odc_runtime.bench import imbalance

    default = imbalance.resolve(imbalance.build_parser().parse_args([]))
    assert "lb_mini_split" not in default.policies  # --quick's rows stay the whole-sample policies
    args = imbalance.resolve(imbalance.build_parser().parse_args(["--policies", "lb_mini,lb_mini_split"]))
    assert sch.grid(args.comms, args.policies) == [("odc", "lb_mini"), ("odc", "lb_mini_split")]


def test_imbalance_quick_runs_the_outlier_phase_unless_it_cannot():
    from odc_runtime.bench import imbalance

    def outliers(*argv: str) -> bool:
        return imbalance.resolve(imbalance.build_parser().parse_args(list(argv))).outliers

    assert outliers("--quick") and outliers("--outliers")
    assert not outliers() and not outliers("--quick", "--no-outliers")
    assert not outliers("--quick", "--hsdp", "2x2") and not outliers("--quick", "--comms", "collective")
    assert not outliers("--quick", "--backend", "nvshmem") and outliers("--quick", "--backend", "nvshmem", "--outliers")


def test_hsdp_argument_parsing():
    from odc_runtime.bench import imbalance

    assert imbalance.parse_hsdp("2x4") == (2, 4)
    for bad in ("2", "0x4", "axb"):
        with pytest.raises(argparse.ArgumentTypeError, match="hsdp"):
            imbalance.parse_hsdp(bad)


def test_comm_end_to_end_two_ranks(tmp_path):
    out = tmp_path / "comm.json"
    proc = _run([str(BENCH / "comm.py"), "--nproc", "2", "--sizes", "64K", "--repeats", "2", "--warmup", "1",
          "--json", str(out), "--plot", "none"], tmp_path)
    data = json.loads(out.read_text())
    ops = {r["op"] for r in data["results"]}
    assert {"copy", "fetch", "push", "all_gather", "red_scatter", "sync", "sync_flush"} <= ops
    assert all(r["time_s"] > 0 for r in data["results"])
    assert data["config"]["backend"] == "host" and data["config"]["sizes"] == [64 << 10]
    assert data["config"]["node_size_arg"] is None
    lines = proc.stdout.splitlines()
    legend = importlib.import_module("odc_runtime.bench.comm").LEGEND
    for column, meaning in legend.items():  # every column is explained under the table
        assert any(line.startswith(f"  {column} ") and line.endswith(meaning) for line in lines), column


def test_comm_hierarchical_four_ranks_two_virtual_nodes(tmp_path):
    """--node-size 2 on 4 ranks: 2 virtual nodes, so every cross-node path (staging on the node-mate, the flush
    at sync, the owners' fold, the mirror) runs; comm.py verifies fetch and push exactly before timing."""
    out = tmp_path / "comm.json"
    proc = _run([str(BENCH / "comm.py"), "--nproc", "4", "--node-size", "2", "--sizes", "64K", "--repeats", "2",
                 "--warmup", "1", "--ops", "copy,add,fetch,push,sync,sync_flush", "--json", str(out),
                 "--plot", "none"], tmp_path, timeout=180)
    assert "hierarchical ODC, nodes of 2 ranks (2 nodes)" in proc.stdout
    data = json.loads(out.read_text())
    assert data["config"]["node_size_arg"] == 2 and data["config"]["node_size"] == 2
    assert data["config"]["world_size"] == 4
    got = {r["op"]: r for r in data["results"]}
    assert set(got) == {"copy", "add", "fetch", "push", "sync", "sync_flush"}
    assert all(r["time_s"] > 0 for r in got.values())
    assert got["fetch"]["algbw_GBps"] > 0 and got["push"]["algbw_GBps"] > 0


def test_comm_verification_catches_wrong_results():
    """comm.py's pre-timing checks pass on the real transport and stop the run on a wrong push sum or a stale
    fetch (one rank, host transport)."""
    import torch
    import torch.distributed as dist

    import odc_runtime as odc
    from odc_runtime.bench import comm

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    odc.init("host")
    real_push, real_fetch = odc.push, odc.fetch
    try:
        full = torch.randn(1001)
        out = torch.empty(1001)
        st = odc.shard(full, name="verify")
        comm.verify_fetch(st, full, out, 4004)
        comm.verify_push(st, 4004, 1, torch.device("cpu"))
        one_off = torch.zeros(1001)
        one_off[7] = 1.0
        odc.push = lambda st, grad, **kw: real_push(st, grad + one_off, **kw)
        with pytest.raises(SystemExit, match=r"push \+ sync left wrong sums .* the first at 7"):
            comm.verify_push(st, 4004, 1, torch.device("cpu"))
        odc.push = real_push
        st.zero_grad()
        stale = full.clone()  # a fetch that never sees the owners' writes (a mirror not refreshed at sync)
        odc.fetch = lambda st, out=None, **kw: out.copy_(stale)
        with pytest.raises(SystemExit, match=r"fetch returned wrong values .*after the owners' write 1"):
            comm.verify_fetch(st, full, out, 4004)
    finally:
        odc.push, odc.fetch = real_push, real_fetch
        odc.finalize()
        dist.destroy_process_group()


def test_comm_arguments():
    """comm.py's options go through the shared parsers and the transport registry."""
    from odc_runtime import transport
    from odc_runtime.bench import comm

    p = comm.build_parser()
    assert p.parse_args(["--sizes", "64K,1M", "--ops", "copy,fetch"]).sizes == [64 << 10, 1 << 20]
    assert p.parse_args(["--ops", "copy, fetch"]).ops == ["copy", "fetch"]
    assert set(p._option_string_actions["--backend"].choices) == set(transport.names())
    for bad in (["--sizes", "1X"], ["--sizes", ""], ["--ops", "copy,bogus"], ["--backend", "bogus"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    with pytest.raises(SystemExit):  # several ranks per GPU only for a GPU transport
        comm.main(["--backend", "host", "--pes-per-gpu", "2"])
    assert p.parse_args(["--node-size", "2"]).node_size == 2 and p.parse_args([]).node_size is None
    for bad in (["--node-size", "3"], ["--node-size", "0"]):  # must divide the 4 ranks: refused before spawning
        with pytest.raises(SystemExit):
            comm.main(["--backend", "host", "--nproc", "4", *bad])


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------------------- shared plumbing


@pytest.mark.parametrize("tool", TOOLS)
def test_every_benchmark_takes_json_and_plot(tool):
    """The README promises --json PATH and --plot PATH for every benchmark."""
    module = importlib.import_module(f"odc_runtime.bench.{tool}")
    args = module.build_parser().parse_args(["--json", "out.json", "--plot", "none"])
    assert args.json == "out.json" and args.plot == "none"


def test_print_table_needs_a_legend_for_every_column(capsys):
    text = _common.print_table(["a", "b"], [[1, 2.5]], {"a": "first", "b": "second"}, title="T")
    assert capsys.readouterr().out.strip() == text.strip()
    assert text.splitlines()[0] == "T" and "  a  first" in text and "  b  second" in text
    with pytest.raises(ValueError, match=r"without a legend entry: \['b'\]"):
        _common.print_table(["a", "b"], [[1, 2]], {"a": "first"})


def test_check_plan_rejects_wrong_plans():
    lengths = [5, 5, 5]
    ok = [[[0, 1]], [[2]]]
    _common.check_plan(ok, lengths, world_size=2, max_tokens=10, equal_counts=True)
    bad = {
        "ranks": [[[0, 1, 2]]],
        "exactly once": [[[0, 1]], [[1, 2]]],
        "exceeds max_tokens": [[[0, 1, 2]], []],
        "counts differ": [[[0], [1]], [[2]]],
    }
    for message, plan in bad.items():
        with pytest.raises(RuntimeError, match=message):
            _common.check_plan(plan, lengths, world_size=2, max_tokens=10, equal_counts=True)
    _common.check_plan([[[0], [1]], [[2]]], lengths, world_size=2, max_tokens=10, equal_counts=False)


def test_schedule_check_catches_a_lost_sample():
    batches = _batches(1)
    s = _build("odc", "lb_mini", batches)
    ranks = list(s.minibatches[0].ranks)
    ranks[0] = ranks[0][1:]  # drop rank 0's first micro-batch
    broken = sch.Schedule(s.comm, s.policy, s.world_size, s.num_layers, (sch.Minibatch(tuple(ranks)),))
    with pytest.raises(RuntimeError, match="exactly once"):
        sch.check_schedule(broken, batches, max_tokens=65536)


def test_schedule_grid_follows_the_policy_registry():
    from odc_runtime.balance import POLICY_REGISTRY

    assert tuple(name for name, p in POLICY_REGISTRY.items() if not p.splits) == sch.POLICIES
    for name, policy in POLICY_REGISTRY.items():
        if policy.splits:  # gang micro-batches: only when named (imbalance.py --policies), not in the grid
            assert ("odc", name) not in sch.grid()
            continue
        assert ("odc", name) in sch.grid()
        assert (("collective", name) in sch.grid()) == policy.equal_counts


def test_schedule_refuses_oversized_samples_unless_allowed():
    from odc_runtime.errors import OdcUsageError

    batches = [[100, 70_000, 200, 300], [400, 500, 600, 700]]
    with pytest.raises(OdcUsageError, match="sample 1 has 70000 tokens"):
        sch.build_schedule(batches, 2, comm="collective", policy="lb_micro", cost=COST, max_tokens=65536,
                           num_layers=2)
    s = sch.build_schedule(batches, 2, comm="collective", policy="lb_micro", cost=COST, max_tokens=65536,
                           num_layers=2, allow_oversized=True)
    assert s.oversized == 1
    assert [1] in [list(mb.samples) for mbs in s.minibatches[0].ranks for mb in mbs]  # alone
    assert _build("odc", "lb_mini", _batches()).oversized == 0


def test_benchmarks_refuse_oversized_samples_and_flag_them_when_allowed(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(["100", "5000", "300", "400"]))
    argv = ["--world", "2", "--lengths-file", str(path), "--minibatches", "1", "--minibatch-size", "4",
            "--max-tokens", "4096", "--link", "nvlink", "--plot", "none"]
    with pytest.raises(SystemExit, match=r"1 of 4 samples are longer than --max-tokens 4096.*--allow-oversized"):
        simulate.main(argv)
    simulate.main([*argv, "--allow-oversized"])
    assert "NOTE: 1 of 4 samples (25.0%) are longer than the 4096-token cap and ran alone" in capsys.readouterr().out
    from odc_runtime.bench import imbalance

    with pytest.raises(SystemExit, match="--allow-oversized"):  # refused before any rank is spawned
        imbalance.main(["--lengths-file", str(path), "--minibatches", "1", "--minibatch-size", "4",
                        "--max-tokens", "4096"])


def test_load_minibatches_from_file_and_preset(tmp_path):
    import argparse

    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(n) for n in range(1, 12)))
    args = argparse.Namespace(lengths_file=str(path), preset="longalign_sft", seed=0)
    batches, source = _common.load_minibatches(args, 5, 4)
    assert batches == [[1, 2, 3, 4], [5, 6, 7, 8]] and source == str(path)  # short tail dropped
    with pytest.raises(SystemExit, match="need at least 20 lengths"):
        _common.load_minibatches(args, 1, 20)
    args.lengths_file = None
    batches, source = _common.load_minibatches(args, 2, 3)
    assert batches == _common.split_minibatches(sample_lengths("longalign_sft", 6, seed=0), 3)
    assert source == "preset longalign_sft (seed 0)"


def test_balance_cli(tmp_path):
    from odc_runtime.bench import balance as bench_balance

    out = tmp_path / "balance.json"
    plot = tmp_path / "balance.png"
    bench_balance.main(["--ranks", "2", "4", "--samples-per-rank", "8", "--big-samples", "0", "--repeats", "1",
                        "--json", str(out), "--plot", str(plot) if _has_matplotlib() else "none"])
    data = json.loads(out.read_text())
    from odc_runtime.balance import POLICY_REGISTRY

    assert [(r["world_size"], r["policy"]) for r in data["results"]] == [
        (w, p) for w in (2, 4) for p in POLICY_REGISTRY]
    for r in data["results"]:
        assert r["native_schedule"] == POLICY_REGISTRY[r["policy"]].native_comm
        # Every step waits for its slowest rank, so the collective time is at least every rank's total.
        assert r["step_over_mean"] >= r["max_over_mean"] >= 1.0
        assert r["oversized_samples"] == 0
    if _has_matplotlib():
        assert plot.stat().st_size > 0


# ----------------------------------------------------------------------------------------------- α–β model

# Round numbers, so that every expected value below is computed by hand: G = 2 GPUs per node, NVLink 4 GB/s
# (1 ms), atomics at half of it, network 1 GB/s per GPU (10 ms), HBM 8 GB/s, 1 GB locked cells and fetch chunks.
HAND = nm.Cluster(gpus_per_node=2, nvlink_GBps=4.0, nvlink_latency_s=1e-3, atomic_efficiency=0.5, nic_GBps=1.0,
                  nics_per_gpu=1.0, ib_latency_s=1e-2, hbm_GBps=8.0, locked_cell_bytes=10**9, locked_inflight=2,
                  locked_latencies=7.0, fetch_chunk_bytes=10**9)
S = 8e9  # bytes of one layer; on 2 nodes W = 4 and a shard is 2e9


def test_netmodel_per_layer_formulas_by_hand():
    approx = lambda x: pytest.approx(x, rel=1e-12)
    # ring: 3 steps × 10 ms + max(3/4·8e9 / (2 NICs × 1 GB/s), 3/4·8e9·1/2 / 4 GB/s) = 0.03 + max(3, 0.75)
    assert nm.ring_s(HAND, 2, S) == approx(3.03)
    assert nm.ring_s(HAND, 1, S) == approx(0.001 + 1.0)  # one node: 1 NVLink step + 1/2·8e9 / 4e9
    # tree: across nodes 1 step + 1/2·(8e9/2) / 1e9; inside 1 step + 1/2·8e9 / 4e9
    assert nm.tree_phases(HAND, 2, S) == (approx(2.01), approx(1.001))
    # direct: 2 remote shards over the NIC (4 s) vs 1 local shard over NVLink (0.5 s), in flight together
    assert nm.direct_s(HAND, 2, S) == approx(0.01 + 4.0)
    # locked push: 3 owners × 2 cells = 6 cells, 2 in flight: 3 rounds × 7 × 10 ms; wire max(2·2·2e9/1e9, ...)
    assert nm.locked_push_s(HAND, 2, S) == approx(0.21 + 8.0)
    # locked fetch: local 1 ms + 2e9/4e9; then 2 remote owners serially, each 2 gets (20 ms) + 2 s + copy 0.25 s
    assert nm.locked_fetch_s(HAND, 2, S) == approx(0.501 + 2 * 2.27)
    assert nm.pipelined(2.0, 1.0, 3) == 7.0
    # one barrier over 4 GPUs: 2 rounds of one round trip (2 × 10 ms)
    assert nm.barrier_s(HAND, 2) == approx(0.04)


def test_netmodel_built_hierarchical_terms_by_hand():
    """odc_hier's terms on 2 nodes of 2 GPUs (W = 4); a layer of 8e9 bytes is 4 shards of 2e9."""
    approx = lambda x: pytest.approx(x, rel=1e-12)
    # fetch: the node-mate's shard and the node-mate's mirror over NVLink (2 × 2e9 at 4 GB/s, + 1 ms); the own
    # shard and own mirror copied locally meanwhile (read + write of 2 × 2e9 at 8 GB/s: 1 s, hidden)
    assert nm.hier_fetch_s(HAND, 2, S) == approx(0.001 + 1.0)
    # push: 2 shards by NVLink atomics at 0.5 × 4 GB/s (2 s + 1 ms); local adds (3 × 4e9 at 8 GB/s: 1.5 s, hidden)
    assert nm.hier_push_s(HAND, 2, S) == approx(0.001 + 2.0)
    slow_hbm = nm.Cluster(**{**nm.asdict(HAND), "hbm_GBps": 1.0})  # the local copies / adds now dominate
    assert nm.hier_fetch_s(slow_hbm, 2, S) == approx(8.0)  # 2 × (2 × 2e9) / 1e9
    assert nm.hier_push_s(slow_hbm, 2, S) == approx(12.0)  # 3 × (2 × 2e9) / 1e9
    # the whole model 16e9 bytes, shards of 4e9: mirror = one get of the other node's shard (10 ms + 4 s)
    assert nm.hier_mirror_s(HAND, 2, 2 * S) == approx(0.01 + 4.0)
    # flush = one put (10 ms + 4 s), then on HBM the fold (read 1 slot, read + write the accumulator: 3 × 4e9)
    # and zeroing the staging row (4e9): 16e9 at 8 GB/s = 2 s
    assert nm.hier_flush_s(HAND, 2, 2 * S) == approx(0.01 + 4.0 + 2.0)
    # 4 nodes of 2 (W = 8), the model 16e9 bytes: shards of 2e9, 3 other nodes. Default 3 slots, one round: one put
    # of 3 shards (10 ms + 6 s); HBM: read 3 slots, read + write the accumulator once, zero 3 staging rows = 8
    # shards = 16e9 at 8 GB/s = 2 s. One slot: 3 rounds, 5 latencies (a free signal before rounds 2 and 3), the
    # accumulator read + written 3 times: 3 + 6 + 3 = 12 shards = 24e9 at 8 GB/s = 3 s.
    assert nm.hier_flush_s(HAND, 4, 2 * S) == approx(0.01 + 6.0 + 2.0)
    one_slot = nm.Cluster(**{**nm.asdict(HAND), "node_slots": 1})
    assert nm.hier_flush_s(one_slot, 4, 2 * S) == approx(0.05 + 6.0 + 3.0)
    assert nm.hier_mirror_s(HAND, 1, 2 * S) == 0.0 and nm.hier_flush_s(HAND, 1, 2 * S) == 0.0  # one node
    # the not-built streaming variant, per layer: (NVLink phase, network phase [+ fold of 1 slot: 3 × 2e9 / 8e9])
    assert nm.streaming_phases(HAND, 2, S, gradient=False) == (approx(1.001), approx(2.01))
    assert nm.streaming_phases(HAND, 2, S, gradient=True) == (approx(2.001), approx(2.01 + 0.75))


def test_netmodel_minibatch_by_hand():
    approx = lambda x: pytest.approx(x, rel=1e-12)
    barriers4 = 4 * 0.04  # odc_hier: 2 syncs of 2 barriers; the other ODC designs: 2 syncs of 1 barrier
    one = nm.Workload(params=4 * 10**9, layers=1, micro_batches=1, gathers=1, param_bytes=2, grad_bytes=2)
    t = nm.minibatch_s(HAND, one, 2)
    assert t["nccl_ring"] == approx(2 * 3.03)
    assert t["nccl_tree"] == approx(2 * (2.01 + 1.001))
    # model = 8e9 bytes, shards 2e9: mirror 10 ms + 2 s; flush 10 ms + 2 s + HBM (3 + 1) × 2e9 / 8e9 = 1 s
    assert t["odc_hier"] == approx(1.001 + 2.001 + 2.01 + 3.01 + barriers4)
    assert t["odc_hier_streaming"] == approx((2.01 + 1.001) + (2.76 + 2.001) + 0.08)
    # 2 layers of 8e9 bytes, 2 micro-batches × 2 gathers
    two = nm.Workload(params=8 * 10**9, layers=2, micro_batches=2, gathers=2, param_bytes=2, grad_bytes=2)
    t = nm.minibatch_s(HAND, two, 2)
    assert t["nccl_ring"] == approx(2 * 2 * (2 * 3.03 + 3.03))
    # 8 layer-gathers of 1.001 s, 4 layer-pushes of 2.001 s, mirror and flush once (model 16e9: 4.01 s, 6.01 s)
    assert t["odc_hier"] == approx(8 * 1.001 + 4 * 2.001 + 4.01 + 6.01 + barriers4)
    parts = nm.hier_parts(HAND, two, 2)
    assert parts == {"fetch_nvlink": approx(8.008), "push_nvlink": approx(8.004), "mirror_refresh": approx(4.01),
                     "flush_and_fold": approx(6.01), "barriers": approx(barriers4)}
    assert sum(parts.values()) == approx(t["odc_hier"])
    # streaming: 4 passes of 2 pipelined layers (2 × max + min), 2 pushes likewise
    assert t["odc_hier_streaming"] == approx(4 * (2 * 2.01 + 1.001) + 2 * (2 * 2.76 + 2.001) + 0.08)
    assert t["odc_direct"] == approx(2 * (4 * 4.01 + 2 * 4.01) + 0.08)
    assert t["odc_locked"] == approx(2 * (4 * 5.041 + 2 * 8.21) + 0.08)
    # memory: 1 remote node × 2e9 params per rank × (staging 2 + inbox 2 + mirror 2 bytes)
    assert nm.hier_memory_bytes(HAND, two, 2) == approx(12e9)
    real_dtypes = nm.Workload(params=8 * 10**9, layers=2)  # bf16 parameters, fp32 gradients: 4 + 4 + 2 bytes
    assert nm.hier_memory_bytes(HAND, real_dtypes, 2) == approx(20e9)
    assert nm.hier_memory_bytes(HAND, real_dtypes, 1) == 0.0
    # across nodes: 4 proxies, each gets one shard of 2e9 params × 2 B and puts one of 2e9 gradients × 2 B
    assert nm.cross_node_bytes(HAND, two, 2) == approx(4 * (4e9 + 4e9))
    assert nm.cut_bound_s(HAND, two, 2) == approx(4.0)  # 1/2 · 16e9 bytes through 2 NICs of 1 GB/s
    nm.check(HAND, two, 2, t)
    with pytest.raises(RuntimeError, match="beats the network cut bound"):
        nm.check(HAND, two, 2, {"too_fast": 3.9})


def test_netmodel_more_nodes_more_cross_node_traffic():
    """Sanity on the real defaults: odc_hier's cross-node bytes, memory and once-per-minibatch network terms
    grow with the node count; with one node nothing crosses; every design stays above the cut bound."""
    c = nm.Cluster()
    spec = sch.MODELS["7b"]
    wl = nm.Workload(spec.params(), spec.num_layers)
    nodes = [1, 2, 4, 8, 16, 32, 64]
    xbytes = [nm.cross_node_bytes(c, wl, n) for n in nodes]
    memory = [nm.hier_memory_bytes(c, wl, n) for n in nodes]
    network = [nm.hier_parts(c, wl, n)["mirror_refresh"] + nm.hier_parts(c, wl, n)["flush_and_fold"] for n in nodes]
    assert xbytes[0] == 0 and memory[0] == 0 and network[0] == 0
    for seq in (xbytes, memory, network):
        assert all(a < b for a, b in itertools.pairwise(seq)), seq
    for n in nodes[1:]:
        nm.check(c, wl, n, nm.minibatch_s(c, wl, n))
        assert nm.minibatch_s(c, wl, n)["odc_hier"] < nm.minibatch_s(c, wl, n)["odc_direct"]


def test_netmodel_efficiency_for_target_is_the_threshold():
    e = nm.efficiency_for_target(nm.Cluster(), "7b", 4, 2, "ring")
    assert e is not None and 0 < e <= 1

    def ratio(eff):
        return nm.run(nm.Cluster(atomic_efficiency=eff), ["7b"], [4], 4, 2)[0]["ratio_to_ring"]["odc_hier"]

    assert ratio(e) <= nm.TARGET < ratio(e - 2e-3)


def test_netmodel_cluster_validates():
    with pytest.raises(ValueError, match="nic_GBps"):
        nm.Cluster(nic_GBps=0.0)
    with pytest.raises(ValueError, match="atomic_efficiency"):
        nm.Cluster(atomic_efficiency=1.5)


def test_netmodel_cli(tmp_path, capsys):
    out = tmp_path / "net.json"
    plot = tmp_path / "net.png"
    nm.main(["--models", "7b", "--nodes", "1,4", "--json", str(out),
             "--plot", str(plot) if _has_matplotlib() else "none"])
    text = capsys.readouterr().out
    assert "hier/best" in text and "hier/ring" in text and "at 4 nodes" in text and "e needed" in text
    data = json.loads(out.read_text())
    assert [r["nodes"] for r in data["rows"]] == [1, 4]
    assert data["config"]["built"] == "odc_hier"
    row = data["rows"][1]
    assert set(row["seconds"]) == set(nm.DESIGNS)
    assert sum(row["hier_parts_s"].values()) == pytest.approx(row["seconds"]["odc_hier"])
    at4 = row["ratio_to_nccl"]["odc_hier"]
    assert at4 == pytest.approx(row["seconds"]["odc_hier"] / min(row["seconds"]["nccl_ring"],
                                                                  row["seconds"]["nccl_tree"]))
    assert data["summary"]["Qwen2.5-7B"]["0.5"]["to_best"] == pytest.approx(at4)
    assert data["summary"]["Qwen2.5-7B"]["0.5"]["to_ring"] == pytest.approx(row["ratio_to_ring"]["odc_hier"])
    assert data["target_met"] == {"best": at4 <= 1.3, "ring": row["ratio_to_ring"]["odc_hier"] <= 1.3}
    if _has_matplotlib():
        assert plot.stat().st_size > 0


def test_check_gather_catches_wrong_parameters():
    """The pre-timing gather check passes on a correct transport and names the layer on a wrong one (one rank)."""
    import torch
    import torch.distributed as dist

    from odc_runtime.bench.executor import CollectiveComm, check_gather

    class Corrupting(CollectiveComm):
        def gathered(self, slot):
            out = super().gathered(slot)
            out[-1] += 1.0  # one wrong element
            return out

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        check_gather(CollectiveComm(3, 4, 1, torch.device("cpu")), 3, 1)
        with pytest.raises(RuntimeError, match="layer 0's gathered parameters are not the owners' shards"):
            check_gather(Corrupting(3, 4, 1, torch.device("cpu")), 3, 1)
    finally:
        dist.destroy_process_group()


def test_benchmarks_use_public_odc_runtime_api_only():
    """No bench module imports a private odc_runtime module or name (issue 23): what a benchmark measures, a user
    can call. The benchmarks' own modules (``odc_runtime.bench``, e.g. its ``_common``) are not the runtime's."""
    import ast

    private = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("odc_runtime"):
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("odc_runtime")]
            else:
                continue
            private += [f"{path.name}: {n}" for n in names
                        if not n.startswith("odc_runtime.bench") and any(p.startswith("_") for p in n.split("."))]
    assert not private


@pytest.mark.parametrize("tool", ["imbalance", "simulate", "balance"])
def test_benchmark_defaults_hold_only_trainable_samples(tool):
    """Every preset a benchmark offers fits its default micro-batch cap, so no default run plans a sample that a
    job could not train (over-cap samples need --allow-oversized, and are flagged)."""
    from odc_runtime.workloads import MAX_LENGTHS, PRESETS

    defaults = importlib.import_module(f"odc_runtime.bench.{tool}").build_parser().parse_args([])
    assert not defaults.allow_oversized
    assert set(MAX_LENGTHS) == set(PRESETS)
    assert max(MAX_LENGTHS.values()) <= defaults.max_tokens


# --------------------------------------------------------------------------------------------------- imbalance GPU


def test_imbalance_gpu_placement():
    from odc_runtime.bench import imbalance

    assert [imbalance.gpu_placement(r, 4, 4, 1) for r in range(4)] == [(0, "gloo")] * 4
    assert [imbalance.gpu_placement(r, 4, 2, 2) for r in range(4)] == [(0, "gloo"), (0, "gloo"), (1, "gloo"),
                                                                        (1, "gloo")]
    assert imbalance.gpu_placement(3, 4, 1, 8) == (3, "nccl")
    with pytest.raises(ValueError, match=r"4 ranks at 1 per GPU need 4 GPUs, 1 visible: pass --pes-per-gpu 4"):
        imbalance.gpu_placement(0, 4, 1, 1)
    with pytest.raises(ValueError, match="raise --pes-per-gpu"):
        imbalance.gpu_placement(0, 4, 2, 1)
    with pytest.raises(ValueError, match="at least 1"):
        imbalance.gpu_placement(0, 4, 0, 1)


def test_imbalance_backend_parsing():
    from odc_runtime.bench import imbalance

    parser = imbalance.build_parser()
    assert parser.parse_args(["--quick"]).backend == "host"  # --quick on the CPU unchanged
    assert parser.parse_args(["--backend", "nvshmem", "--pes-per-gpu", "4"]).pes_per_gpu == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "mpi"])


def test_imbalance_gpu_backend_refused_without_cuda(capsys, monkeypatch):
    import torch

    from odc_runtime.bench import imbalance

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:  # refused in the parent, before any rank is spawned
        imbalance.main(["--quick", "--backend", "nvshmem"])
    assert exc.value.code == 2
    assert "--backend nvshmem runs the job on CUDA GPUs, and none is visible here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        imbalance.main(["--quick", "--pes-per-gpu", "2"])  # host: the CPU has no GPUs to share
    assert "--pes-per-gpu needs a GPU backend" in capsys.readouterr().err


def test_imbalance_gpu_backend_refused_without_extension_or_enough_gpus(capsys, monkeypatch):
    import torch

    from odc_runtime.bench import imbalance
    from odc_runtime.transport import TransportSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(TransportSpec, "is_available", lambda self: self.device_type == "cpu")
    with pytest.raises(SystemExit):
        imbalance.main(["--quick", "--backend", "nvshmem", "--pes-per-gpu", "4"])
    assert "the odc_runtime._C extension does not load here" in capsys.readouterr().err
    monkeypatch.setattr(TransportSpec, "is_available", lambda self: True)
    with pytest.raises(SystemExit):  # 4 ranks, one GPU, one rank per GPU
        imbalance.main(["--quick", "--backend", "nvshmem"])
    assert "need 4 GPUs, 1 visible: pass --pes-per-gpu 4" in capsys.readouterr().err


def test_executor_waits_for_the_gpu_on_a_cuda_comm(monkeypatch):
    """On a CUDA comm a gather or scatter counts as done only once the stream has finished it (the host-modelled
    compute needs the data): run_minibatch synchronises the current stream after every wait."""
    import torch
    import torch.distributed as dist

    from odc_runtime.bench.executor import run_minibatch
    from odc_runtime.bench.schedule import Task

    events = []

    class Stream:
        def synchronize(self):
            events.append("sync")

    class Work:
        def __init__(self, what):
            self.what = what

        def wait(self):
            events.append(self.what)

    class FakeCudaComm:
        name, device, group_rank, group_size = "fake", torch.device("cuda"), 0, 1

        def gather(self, layer, slot):
            return Work(f"gather{layer}")

        def scatter(self, layer, empty):
            return Work(f"scatter{layer}")

        def end_minibatch(self, expected):
            return True

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    tasks = [Task(0, 0, "fwd", 0.0, False, False), Task(0, 0, "bwd", 0.0, True, False)]
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        run_minibatch(FakeCudaComm(), tasks, expected_grad=1, time_scale=0.0, record=False)
    finally:
        dist.destroy_process_group()
    assert events == ["gather0", "sync", "gather0", "sync", "scatter0", "sync"]
