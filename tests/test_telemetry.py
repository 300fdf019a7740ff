"""What ODC shows of a run: ``odc.stats()`` counters, profiler ranges, the ``ODC_TRACE_DIR`` trace, the report.

- the counters count each call that returned, exactly (bytes from the tensors' sizes), not the refused ones;
  ``reset``, ``init`` zeroes them, readable after ``finalize``;
- a 2-rank FSDP ODC job with unequal micro-batch counts (modelled compute: a sleep per micro-batch) shows more
  ``sync_wait_s`` on the rank with less work, in ``odc.stats()``, in ``odc_runtime.fsdp.stats(model)`` and in its
  trace files, which ``python -m odc_runtime.report`` reads and draws;
- a ``torch.profiler`` trace of a 2-rank job holds the ``odc.fetch`` / ``odc.push`` / ``odc.sync`` and
  ``odc.gang.*`` ranges;
- the report's figures against hand-computed ones; a bad ``ODC_TRACE_DIR`` fails ``init`` on every rank.
"""

from __future__ import annotations

import inspect
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_ranks

import odc_runtime as odc
from odc_runtime import report, telemetry
from odc_runtime.errors import OdcUsageError


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


# --------------------------------------------------------------------------------------------------- counters


def _counting_rank(rank: int, world: int) -> dict:
    import torch

    before = odc.stats()
    odc.init("host")
    fresh = odc.stats()
    st = odc.shard(torch.randn(10, 7), name="w")  # fp32: 280 bytes
    half = odc.shard(torch.randn(5, 3, dtype=torch.bfloat16), name="h")  # bf16: 30 bytes
    # each call shape twice: the first takes the checked path, the second the cached plan's fast path
    for _ in range(2):
        odc.fetch(st)
        odc.fetch(st, async_op=True).wait()
        odc.fetch(half, out=torch.empty(5, 3, dtype=torch.bfloat16))
        odc.push(st, torch.ones(10, 7))  # 280 bytes
        odc.push(st, torch.ones(10, 7, dtype=torch.bfloat16), async_op=True).wait()  # 140 bytes
        odc.push(half, torch.ones(3, 5).t())  # non-contiguous fp32 gradient: 60 bytes
    refused = []
    for call in (lambda: odc.fetch(st, out=torch.empty(3)), lambda: odc.push(st, torch.ones(3)),
                 lambda: odc.push(st, torch.ones(10, 7), scale=float("nan")), lambda: odc.sync(gradients=1)):
        with pytest.raises(OdcUsageError):
            call()
        refused.append(odc.stats())
    odc.sync()
    odc.sync()
    got = odc.stats(reset=True)
    after_reset = odc.stats()
    odc.fetch(st)
    odc.finalize()
    after_finalize = odc.stats()
    odc.init("host")
    again = odc.stats()
    return {"before": before, "fresh": fresh, "refused": refused, "got": got, "after_reset": after_reset,
            "after_finalize": after_finalize, "again": again}


def _reset_inside_a_minibatch_rank(rank: int, world: int, trace_dir: str) -> dict:
    """Two minibatches of 3 fetches and 2 pushes each; the user calls ``stats(reset=True)`` after the first fetch of
    the second one. Returns the records, the stats the user saw and the trace file's lines."""
    odc.init("host", trace_dir=trace_dir)
    st = odc.shard(torch.zeros(8), name="w")
    records, seen = [], []
    for minibatch in range(2):
        window = telemetry.begin_minibatch()
        for i in range(3):
            odc.fetch(st)
            if minibatch == 1 and i == 0:
                seen.append(odc.stats(reset=True))  # the user's reset, inside a minibatch
        odc.push(st, torch.ones(8))
        odc.push(st, torch.ones(8))
        odc.sync()
        records.append(telemetry.end_minibatch(window, 3))
    seen.append(odc.stats())
    odc.finalize()
    return {"records": records, "seen": seen, "trace": list(telemetry.records(os.path.join(trace_dir,
                                                                                          f"rank{rank}.jsonl")))}


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
@pytest.mark.timeout(180)
def test_the_trace_is_independent_of_the_users_stats_reset(tmp_path, backend):
    """Issue 53: ``stats(reset=True)`` inside a minibatch zeroed that minibatch's trace figures (0 fetches recorded
    where 3 ran). The user's counters restart from the reset; the trace counts what ran."""
    import importlib.util

    if backend == "symm-cpu" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from test_symm_cpu import run_on_symm

    run = run_ranks if backend == "host" else run_on_symm
    results = run(_reset_inside_a_minibatch_rank, 2, str(tmp_path), timeout=150)
    assert len({line["run"] for res in results for line in res["trace"]}) == 1, results  # one run id, every rank
    for res in results:
        for record in res["records"]:
            assert (record["fetches"], record["pushes"], record["syncs"]) == (3, 2, 1), record
            assert (record["fetch_bytes"], record["push_bytes"]) == (3 * 32, 2 * 32), record
        assert [line["fetches"] for line in res["trace"]] == [3, 3], res["trace"]
        at_reset, at_end = res["seen"]
        assert (at_reset["fetches"], at_reset["pushes"], at_reset["syncs"]) == (4, 2, 1), at_reset
        assert (at_end["fetches"], at_end["pushes"], at_end["syncs"], at_end["minibatches"]) == (2, 2, 1, 1), at_end


@pytest.mark.timeout(120)
def test_counters_count_every_call_that_returned_exactly():
    zeros = dict.fromkeys(telemetry.FIELDS, 0)
    for res in run_ranks(_counting_rank, 2, timeout=100):
        assert res["fresh"] == res["after_reset"] == res["again"] == zeros
        assert res["before"] == zeros  # a fresh process: nothing counted before init
        got = res["got"]
        want = {"fetches": 6, "pushes": 6, "syncs": 2, "fetch_bytes": 2 * (280 + 280 + 30),
                "push_bytes": 2 * (280 + 140 + 60), "minibatches": 0}
        assert {k: got[k] for k in want} == want, got
        assert got["sync_wait_s"] > 0
        # the refused calls changed nothing (the counts before the two syncs, four times)
        assert all({k: r[k] for k in want} == {**want, "syncs": 0} for r in res["refused"]), res["refused"]
        assert res["after_finalize"]["fetches"] == 1 and res["after_finalize"]["fetch_bytes"] == 280


def test_the_counted_api_functions_keep_their_signatures():
    from odc_runtime import api

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    P, K, E = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty
    assert params(api.fetch) == [("st", P, E), ("out", P, None), ("async_op", K, False)]
    assert params(api.push) == [("st", P, E), ("grad", P, E), ("scale", K, 1.0), ("async_op", K, False)]
    assert odc.fetch is api.fetch and odc.push is api.push and odc.sync is api.sync


def test_stats_rejects_a_non_bool_reset():
    with pytest.raises(OdcUsageError, match="reset must be a bool"):
        odc.stats(reset=1)


# ---------------------------------------------------------------------------------- unequal work, FSDP ODC mode
SLEEP_S = 0.25
COUNTS = (1, 4)  # micro-batches of rank 0 and rank 1
STEPS = 3


def _fsdp_rank(rank: int, world: int) -> dict:
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import odc_runtime.fsdp as odc_fsdp

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(2)))
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    odc.init("host")
    odc_fsdp.enable(model)
    assert odc_fsdp.stats(model)["last_minibatch"] is None
    odc.stats(reset=True)
    lasts = []
    for _ in range(STEPS):
        with odc_fsdp.minibatch(model):
            for _ in range(COUNTS[rank]):
                time.sleep(SLEEP_S)  # the modelled compute of one micro-batch
                model(torch.randn(4, 8)).square().mean().backward()
        lasts.append(odc_fsdp.stats(model)["last_minibatch"])
    figures = odc.stats()
    units = odc_fsdp.stats(model)
    odc_fsdp.disable(model)
    return {"stats": figures, "lasts": lasts, "fsdp": units}


@pytest.mark.timeout(150)
def test_the_rank_with_less_work_waits_more_in_stats_trace_and_report(tmp_path):
    trace = tmp_path / "trace"
    results = run_ranks(_fsdp_rank, 2, timeout=130, env={"ODC_TRACE_DIR": str(trace)})
    light, heavy = results
    gap = (COUNTS[1] - COUNTS[0]) * SLEEP_S * STEPS  # what the light rank waits for, at least
    assert light["stats"]["sync_wait_s"] > heavy["stats"]["sync_wait_s"] + gap / 2, (light["stats"], heavy["stats"])
    for res, count in zip(results, COUNTS, strict=True):
        assert res["stats"]["minibatches"] == STEPS and res["stats"]["syncs"] == 2 * STEPS
        assert [m["micro_batches"] for m in res["lasts"]] == [count] * STEPS
        assert res["stats"]["pushes"] == res["fsdp"]["reduce_scatters"] == sum(m["pushes"] for m in res["lasts"])
        assert res["stats"]["fetches"] == sum(m["fetches"] for m in res["lasts"])
    for a, b in zip(light["lasts"], heavy["lasts"], strict=True):  # every minibatch: the light rank waits longer
        assert a["sync_wait_s"] > b["sync_wait_s"] + (COUNTS[1] - COUNTS[0]) * SLEEP_S / 2, (a, b)

    # the trace: one line per minibatch and rank, the same records last_minibatch returned
    for rank, res in enumerate(results):
        lines = list(telemetry.records(str(trace / f"rank{rank}.jsonl")))
        assert [x["minibatch"] for x in lines] == list(range(STEPS))
        assert lines == res["lasts"]
        assert all(x["rank"] == rank and x["world"] == 2 and x["label"] is None for x in lines)
        assert sum(x["sync_wait_s"] for x in lines) == pytest.approx(res["stats"]["sync_wait_s"], rel=1e-9)
        assert sum(x["push_bytes"] for x in lines) == res["stats"]["push_bytes"] > 0

    # the report reads it: the light rank idles more, and the picture is drawn
    out = tmp_path / "report.png"
    (summary,) = report.main([str(trace), "--out", str(out) if _has_matplotlib() else "none"])
    assert summary["micro_batches"] == [c * STEPS for c in COUNTS]
    assert summary["idle_share"][0] > summary["idle_share"][1]
    assert summary["sync_wait_s"] == [pytest.approx(r["stats"]["sync_wait_s"], rel=1e-9) for r in results]
    if _has_matplotlib():
        assert out.stat().st_size > 10_000


# --------------------------------------------------------------------------------------------- profiler ranges


def _profiled_rank(rank: int, world: int, path: str) -> dict[str, int]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from odc_runtime.gang import GangExchange, exchange_kv
    from odc_runtime.split import Chunk

    odc.init("host")
    st = odc.shard(torch.randn(6, 4), name="w")
    ex = GangExchange(num_layers=1, max_chunk_tokens=4, kv_features=3, dtype=torch.float32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):  # the checked path, then the cached plan's fast path
            full = odc.fetch(st)
            odc.push(st, torch.ones_like(full))
        odc.sync()
        # one gang micro-batch of one layer: a 6-token sample in chunks of 3 on both ranks
        k = torch.randn(3, 3, requires_grad=True)
        v = torch.randn(3, 3, requires_grad=True)
        with ex.step(Chunk(0, rank, 2, 6, 0, (0, 1))) as step:
            k_all, v_all = exchange_kv(step, 0, k, v)
        (k_all.sum() + v_all.sum()).backward()
    out = os.path.join(path, f"trace{rank}.json")
    prof.export_chrome_trace(out)
    ex.free()
    with open(out) as f:
        names = [e["name"] for e in json.load(f)["traceEvents"] if str(e.get("name", "")).startswith("odc.")]
    return {name: names.count(name) for name in names}


@pytest.mark.timeout(120)
def test_a_profiler_trace_holds_the_odc_ranges(tmp_path):
    for names in run_ranks(_profiled_rank, 2, str(tmp_path), timeout=100):
        assert {"odc.fetch", "odc.push", "odc.sync", "odc.gang.forward", "odc.gang.backward", "odc.gang.join",
                "odc.gang.wait"} <= set(names), names
        assert names["odc.fetch"] == names["odc.push"] == 2, names  # one range per call, on both paths


# ----------------------------------------------------------------------------------------------- the report


def _line(rank: int, k: int, start: float, end: float, waits: list, **extra) -> dict:
    return telemetry.make_record(rank=rank, world=2, minibatch=k, start=start, end=end, micro_batches=extra.pop(
        "micro_batches", 1), waits=waits, run=extra.pop("run", "r"), label=extra.pop("label", None), **extra)


def _write(directory, lines_by_rank: list[list[dict]]) -> None:
    directory.mkdir(exist_ok=True)
    for rank, lines in enumerate(lines_by_rank):
        with open(directory / f"rank{rank}.jsonl", "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


def test_report_figures_against_hand_computed_ones(tmp_path):
    # minibatch 0: rank 0 in [0, 10] waits 6 s in sync; rank 1 in [1, 10] waits 1 s; wall 10 s.
    # minibatch 1: rank 0 in [20, 24] waits 1; rank 1 in [20, 25] waits 0; wall 5 s (an unmatched k=2 is dropped).
    ranks = [
        [_line(0, 0, 0.0, 10.0, [(4.0, 10.0, "sync")], micro_batches=1, push_bytes=100),
         _line(0, 1, 20.0, 24.0, [(23.0, 24.0, "sync")], micro_batches=2, push_bytes=50),
         _line(0, 2, 30.0, 31.0, [], micro_batches=9)],
        [_line(1, 0, 1.0, 10.0, [(9.0, 10.0, "sync")], micro_batches=3, push_bytes=300),
         _line(1, 1, 20.0, 25.0, [(21.0, 22.0, "comm")], micro_batches=4, push_bytes=60)],
    ]
    _write(tmp_path / "t", ranks)
    (run,) = report.load(str(tmp_path / "t"))
    s = report.summarize(run)
    busy = [4.0 + 3.0, 8.0 + 4.0]
    assert s["minibatches"] == 2 and s["wall_s"] == 15.0
    assert s["busy_s"] == busy and s["idle_s"] == [15.0 - b for b in busy]
    assert s["idle_share"] == [(15.0 - b) / 15.0 for b in busy]
    assert s["utilization"] == sum(busy) / 30.0
    assert s["micro_batches"] == [3, 7] and s["push_bytes"] == [150, 360]
    assert s["sync_wait_s"] == [7.0, 1.0]  # the collective's wait is not a sync wait
    assert report.timeline(run)[1] == [("compute", 1.0, 9.0), ("sync", 9.0, 10.0), ("compute", 20.0, 21.0),
                                       ("comm", 21.0, 22.0), ("compute", 22.0, 25.0)]
    # a second run appended to the files: --run picks it (default: the last); labels make panels
    _write(tmp_path / "t", [[_line(0, 0, 0.0, 2.0, [], run="q", label="a"), _line(0, 0, 0.0, 1.0, [], run="q",
                                                                                    label="b")],
                            [_line(1, 0, 0.0, 2.0, [], run="q", label="a"), _line(1, 0, 0.0, 3.0, [], run="q",
                                                                                    label="b")]])
    assert [r.label for r in report.load(str(tmp_path / "t"))] == ["a", "b"]
    assert [r.label for r in report.load(str(tmp_path / "t"), run=0)] == ["odc"]
    b = report.summarize(report.load(str(tmp_path / "t"))[1])
    assert b["wall_s"] == 3.0 and b["idle_s"] == [2.0, 0.0]
    if _has_matplotlib():
        out = tmp_path / "p.png"
        report.main([str(tmp_path / "t"), "--out", str(out), "--run", "0"])
        assert out.stat().st_size > 10_000


def _unwritable_trace_rank(rank: int, world: int, trace_dir: str) -> dict:
    """Two minibatches with the trace on, rank 1's file unusable (set up by the test); returns the warnings, the
    gradients and whether finalize released the runtime (a second init works)."""
    import logging

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("odc_runtime").addHandler(Collect())
    odc.init("host", trace_dir=trace_dir)
    st = odc.shard(torch.zeros(4), name="w")
    grads = []
    for _ in range(2):
        window = telemetry.begin_minibatch()
        odc.push(st, torch.ones(4))
        odc.sync()
        telemetry.end_minibatch(window, 1)
        grads.append(st.grad.tolist())
        st.zero_grad()
        odc.sync()
    odc.finalize()  # must not raise: the trace is an observer
    odc.init("host")  # the transport was released
    odc.finalize()
    return {"warnings": warnings, "grads": grads}


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
@pytest.mark.parametrize("how", ["full disk", "a directory"])
@pytest.mark.timeout(180)
def test_an_unwritable_trace_file_warns_and_never_breaks_the_job(tmp_path, backend, how):
    """Issue 53: a full disk under the trace directory raised an untyped OSError on one rank, then again in
    finalize before the transport was released; a trace file that cannot be opened failed init on that rank only,
    after its runtime was live. Rank 1's file is /dev/full (every write: ENOSPC), or a directory."""
    import importlib.util

    if backend == "symm-cpu" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from test_symm_cpu import run_on_symm

    if how == "full disk":
        os.symlink("/dev/full", tmp_path / "rank1.jsonl")
    else:
        (tmp_path / "rank1.jsonl").mkdir()
    run = run_ranks if backend == "host" else run_on_symm
    results = run(_unwritable_trace_rank, 2, str(tmp_path), timeout=150)
    for rank, res in enumerate(results):
        assert res["grads"] == [[2.0, 2.0]] * 2, res
        if rank == 0:
            assert res["warnings"] == [], res
    assert [line["minibatch"] for line in telemetry.records(str(tmp_path / "rank0.jsonl"))] == [0, 1]
    (warning,) = results[1]["warnings"]
    if how == "full disk":
        assert "cannot be written" in warning and "No space left on device" in warning, warning
    else:
        assert "not tracing on this rank" in warning and "rank1.jsonl" in warning, warning


def test_report_pairs_runs_by_their_id_and_names_a_rank_missing_from_one(tmp_path):
    """Issue 53: after a crash and a restart into the same directory, runs were paired by position in each file, so
    one job's run was drawn with another's. Run "a" (both ranks), run "b" (rank 1 crashed before its first minibatch
    ended: rank 0's lines only), run "c" (both ranks, restarted)."""
    def lines(run: str, rank: int, t: float) -> list[dict]:
        return [_line(rank, 0, t, t + 2.0, [], run=run, micro_batches=10 * rank + ord(run))]

    _write(tmp_path / "t", [lines("a", 0, 0.0) + lines("b", 0, 10.0) + lines("c", 0, 20.0),
                            lines("a", 1, 0.5) + lines("c", 1, 20.5)])
    for which, run_name in ((0, "a"), (-1, "c"), (2, "c")):
        (run,) = report.load(str(tmp_path / "t"), which)
        assert [lines[0]["run"] for lines in run.ranks] == [run_name, run_name], (which, run.ranks)
        assert report.summarize(run)["micro_batches"] == [ord(run_name), 10 + ord(run_name)]
    for which in (1, -2):
        with pytest.raises(OdcUsageError, match=r"run -?\d \(id 'b'\) has no trace line of rank\(s\) \[1\]"):
            report.load(str(tmp_path / "t"), which)
    with pytest.raises(OdcUsageError, match="holds 3 run"):
        report.load(str(tmp_path / "t"), 3)


def test_report_refuses_what_is_not_a_trace(tmp_path):
    with pytest.raises(OdcUsageError, match=r"no rank<r>\.jsonl"):
        report.load(str(tmp_path))
    _write(tmp_path / "gap", [[], [_line(1, 0, 0.0, 1.0, [])]])
    (tmp_path / "gap" / "rank0.jsonl").unlink()
    with pytest.raises(OdcUsageError, match=r"no trace of rank\(s\) \[0\]"):
        report.load(str(tmp_path / "gap"))
    _write(tmp_path / "one", [[_line(0, 0, 0.0, 1.0, [])]])
    with pytest.raises(OdcUsageError, match="holds 1 run"):
        report.load(str(tmp_path / "one"), run=1)
    # a torn last line (a crash while writing) is skipped; a bad line elsewhere is an error
    with open(tmp_path / "one" / "rank0.jsonl", "a") as f:
        f.write('{"v": 1, "run"')
    assert len(report.load(str(tmp_path / "one"))[0].ranks[0]) == 1
    with open(tmp_path / "one" / "rank0.jsonl", "a") as f:
        f.write('\n{"v": 1}\n')
    with pytest.raises(OdcUsageError, match="not a trace line"):
        report.load(str(tmp_path / "one"))


def test_a_torn_line_before_a_restarts_lines_is_skipped(tmp_path):
    """Issue 53: a crash that cut rank 0's last line, then a restart appending to the same files, made the report
    refuse the whole directory (the torn line and the restart's first line glued into one). Old files are read
    past the torn part; a writer now ends a torn line before appending."""
    torn = json.dumps(_line(0, 1, 2.0, 3.0, [], run="a"), separators=(",", ":"))[:40]
    for healed in (False, True):
        directory = tmp_path / f"healed={healed}"
        _write(directory, [[_line(0, 0, 0.0, 1.0, [], run="a")], [_line(1, 0, 0.0, 1.0, [], run="a"),
                                                                  _line(1, 1, 2.0, 3.0, [], run="a")]])
        with open(directory / "rank0.jsonl", "a") as f:
            f.write(torn)  # rank 0 crashed while writing minibatch 1
        restarted = [_line(r, 0, 10.0, 11.0, [], run="b") for r in range(2)]
        if healed:  # the runtime's writer
            for r, line in enumerate(restarted):
                writer = telemetry.TraceWriter(str(directory), r)
                writer.write(line)
                writer.close()
        else:  # a writer that appends as it is
            _write(directory, [[line] for line in restarted])
        assert [x["run"] for x in telemetry.records(str(directory / "rank0.jsonl"))] == ["a", "b"], healed
        (run,) = report.load(str(directory))
        assert [[x["run"] for x in lines] for lines in run.ranks] == [["b"], ["b"]], healed
        (first,) = report.load(str(directory), 0)
        assert [len(lines) for lines in first.ranks] == [1, 2], healed


# ------------------------------------------------------------------------------------------ settings and misuse


def _bad_trace_dir_rank(rank: int, world: int, a_file: str) -> str:
    if rank == 1:
        os.environ["ODC_TRACE_DIR"] = a_file
    try:
        odc.init("host")
    except odc.OdcError as e:
        return type(e).__name__ + ": " + str(e)
    return "initialised"


def test_a_bad_trace_dir_fails_init_on_every_rank(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    first, second = run_ranks(_bad_trace_dir_rank, 2, str(a_file), timeout=60)
    assert second.startswith("OdcUsageError") and "ODC_TRACE_DIR" in second, second
    assert first.startswith("OdcMismatchError") and "ODC_TRACE_DIR" in first, first


def _trace_arg_rank(rank: int, world: int, arg: str, env_dir: str) -> list[dict]:
    os.environ["ODC_TRACE_DIR"] = env_dir  # the argument wins over the variable
    odc.init("host", trace_dir=arg)
    st = odc.shard(torch.zeros(4), name="traced")
    window = telemetry.begin_minibatch("step")
    odc.push(st, torch.ones(4))
    odc.sync()
    telemetry.end_minibatch(window, rank + 1)
    odc.finalize()
    with open(os.path.join(arg, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_init_trace_dir_argument_writes_the_trace_there(tmp_path):
    target, ignored = tmp_path / "arg" / "traces", tmp_path / "env"
    lines = run_ranks(_trace_arg_rank, 2, str(target), str(ignored), timeout=60)
    assert [[line["micro_batches"] for line in rank] for rank in lines] == [[1], [2]]
    assert all(line["push_bytes"] == 16 for rank in lines for line in rank)
    assert not ignored.exists()


def _bad_trace_arg_rank(rank: int, world: int) -> str:
    try:
        odc.init("host", trace_dir=3 if rank == 1 else None)  # type: ignore[arg-type]
    except odc.OdcError as e:
        return type(e).__name__ + ": " + str(e)
    return "initialised"


def test_a_bad_trace_dir_argument_fails_init_on_every_rank():
    first, second = run_ranks(_bad_trace_arg_rank, 2, timeout=60)
    assert second.startswith("OdcUsageError") and "trace_dir" in second and "expected a path" in second, second
    assert first.startswith("OdcMismatchError") and "rank 1" in first, first


def _minibatch_misuse_rank(rank: int, world: int) -> list[str]:
    odc.init("host")
    errors = []
    window = telemetry.begin_minibatch("x")
    for call in (lambda: telemetry.end_minibatch(window, -1), lambda: telemetry.end_minibatch(window, True)):
        with pytest.raises(OdcUsageError, match="micro_batches must be an int"):
            call()
    record = telemetry.end_minibatch(window, 2)
    with pytest.raises(OdcUsageError, match="not open"):
        telemetry.end_minibatch(window, 2)
    errors.append(record["label"])
    assert odc.stats()["minibatches"] == 1
    odc.finalize()
    with pytest.raises(odc.OdcNotInitializedError):
        telemetry.begin_minibatch()
    return errors


def test_minibatch_markers_check_their_use():
    assert run_ranks(_minibatch_misuse_rank, 2, timeout=60) == [["x"], ["x"]]


def test_trace_dir_setting(monkeypatch, tmp_path):
    from odc_runtime import config

    monkeypatch.delenv("ODC_TRACE_DIR", raising=False)
    assert config.trace_dir() is None
    monkeypatch.setenv("ODC_TRACE_DIR", str(tmp_path / "new" / "dir"))
    assert config.trace_dir() == str(tmp_path / "new" / "dir")
    assert telemetry.check_trace_dir() == str(tmp_path / "new" / "dir") and (tmp_path / "new" / "dir").is_dir()
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("ODC_TRACE_DIR", str(tmp_path / "f"))
    with pytest.raises(OdcUsageError, match="not a directory"):
        config.trace_dir()
