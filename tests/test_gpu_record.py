"""The GPU record holds: every figure measured on a GPU that the GPU pages quote is a cell of a record table whose
raw file in ``gpu-runs/`` holds it (docs/gpu-report.md, "Record tables", defines the two table formats), and
docs/gpu-report.md quotes no such figure anywhere else. The other pages that speak of GPU runs (docs/gpu.md,
docs/benchmarks.md, the README) link to the report instead of restating it; the overclaims they once made are
checked absent."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "gpu-runs"
REPORT = ROOT / "docs" / "gpu-report.md"
PAGES = [REPORT, ROOT / "docs" / "gpu.md", ROOT / "docs" / "benchmarks.md", ROOT / "README.md"]

BENCH_HEADER = ["raw file (gpu-runs/)", "config", "op", "size", "GPU µs", "host µs", "GB/s", "x local", "host x copy_"]
CHECK_HEADER = ["raw file (gpu-runs/)", "check", "result", "seconds", "numbers"]
SIZES = {"1M": 1 << 20, "64M": 64 << 20, "256M": 256 << 20}
# A figure with a unit of time, bandwidth or ratio; one after a comparison is a target's bound, not a measurement.
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:µs|us|ms|s|GB/s|TB/s|x|×)(?![\w/])")
BOUND = re.compile(r"(?:>=|<=|≥|≤|[<>])\s*$")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """(line, header, rows) of every Markdown table of ``text``."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1]):
            header, rows, j = _cells(lines[i]), [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            out.append((i + 1, header, rows))
            i = j
        else:
            i += 1
    return out


def _matches(shown: str, value: object) -> bool:
    """``shown`` is ``value`` rounded to the digits shown (``-``: no value)."""
    if shown == "-":
        return value is None or (isinstance(value, float) and math.isnan(value))
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    if isinstance(value, str) or not re.fullmatch(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", shown):
        return str(value) == shown
    if "e" in shown:  # .ci/gpu's own 4 significant digits
        return f"{float(value):.4g}" == shown
    digits = len(shown.split(".")[1]) if "." in shown else 0
    return abs(float(value) - float(shown)) <= 0.5 * 10 ** -digits + 1e-9


def _raw(cell: str) -> Path:
    return RUNS / cell.strip("`")


def check_bench_row(row: list[str]) -> list[str]:
    raw, config, op, size, *shown = row
    path = _raw(raw)
    if not path.is_file():
        return [f"{raw}: no such raw file in gpu-runs/"]
    data = json.loads(path.read_text())
    cfg = data.get("config", {})
    world = cfg.get("world_size")
    prefix = f"{cfg.get('backend')}, {world} PE"
    problems = [] if config.startswith(prefix) else [f"{raw}: config {config!r} is not {prefix}..."]
    found = [r for r in data["results"] if r["op"] == op and r["bytes"] == SIZES.get(size)]
    if len(found) != 1:
        return [*problems, f"{raw}: no row {op} at {size}"]
    r = found[0]
    raw_values = [r["time_s"] * 1e6, r["host_us"], None if op.startswith("sync") else r["algbw_GBps"],
                  r.get("vs_local"), r.get("host_vs_copy")]
    for name, cell, value in zip(BENCH_HEADER[4:], shown, raw_values, strict=True):
        if not _matches(cell, value):
            problems.append(f"{raw} {op} {size} {name}: shown {cell}, raw {value}")
    return problems


def check_check_row(row: list[str]) -> list[str]:
    raw, name, status, seconds, numbers = row
    name = name.strip("`")
    path = _raw(raw)
    if not path.is_file():
        return [f"{raw}: no such raw file in gpu-runs/"]
    found = [r for p in json.loads(path.read_text())["phases"].values() for r in p["results"] if r["name"] == name]
    if len(found) != 1:
        return [f"{raw}: no result named {name!r}"]
    r = found[0]
    problems = [] if r["status"] == status else [f"{name}: shown {status}, raw {r['status']}"]
    if not _matches(seconds, r["seconds"]):
        problems.append(f"{name}: shown {seconds} s, raw {r['seconds']}")
    for pair in filter(None, (p.strip() for p in numbers.split(","))):
        key, _, cell = pair.partition("=")
        if key not in r["numbers"] or not _matches(cell, r["numbers"][key]):
            problems.append(f"{name}: shown {pair}, raw {key}={r['numbers'].get(key)}")
    return problems


def check_tables(text: str) -> tuple[int, list[str]]:
    """(cells checked, problems) of every record table of ``text``."""
    cells, problems = 0, []
    for line, header, rows in tables(text):
        check = {tuple(BENCH_HEADER): check_bench_row, tuple(CHECK_HEADER): check_check_row}.get(tuple(header))
        if check is None:
            if header and header[0] == BENCH_HEADER[0]:
                problems.append(f"line {line}: a table naming raw files with another header: {header}")
            continue
        for row in rows:
            if len(row) != len(header):
                problems.append(f"line {line}: row of {len(row)} cells, header of {len(header)}: {row}")
                continue
            cells += len(row) - 2
            problems += [f"line {line}: {p}" for p in check(row)]
    return cells, problems


def stray_figures(text: str) -> list[str]:
    """Figures with a unit outside record tables, code and target bounds."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("|"):
            continue
        prose = re.sub(r"`[^`]*`", "`…`", line)
        for m in FIGURE.finditer(prose):
            if not BOUND.search(prose[: m.start()]):
                out.append(f"line {i}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return out


def test_every_record_table_cell_is_its_raw_file_value() -> None:
    for page in PAGES:
        cells, problems = check_tables(page.read_text())
        assert problems == [], f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)
        if page == REPORT:
            assert cells > 100, f"the report's record tables hold {cells} figures"


def test_the_report_quotes_no_gpu_figure_outside_its_record_tables() -> None:
    found = stray_figures(REPORT.read_text())
    assert found == [], "a figure outside a record table (put it in one, or say 'not recorded'):\n" + "\n".join(found)


def test_the_other_pages_link_to_the_report_and_drop_the_old_overclaims() -> None:
    overclaims = {
        "docs/gpu.md": ["has not yet run on a GPU", "has not run on a GPU yet", "not yet run)",
                        "holds no report from a real GPU", "1430", "470 µs"],
        "docs/benchmarks.md": ["(what a stream-ordered GPU `sync` costs the host)"],
        "README.md": ["every GPU test passed"],
        "docs/gpu-report.md": ["459 → 138", "on the tree of commit", "The symm contract suite passed on the GPU",
                               "**Every check passed**"],
    }
    for rel, phrases in overclaims.items():
        text = (ROOT / rel).read_text()
        for phrase in phrases:
            assert phrase not in text, f"{rel} still says {phrase!r}"
    for rel in ("docs/gpu.md", "README.md"):
        assert "gpu-report.md" in (ROOT / rel).read_text(), f"{rel} does not link to the GPU report"


def test_the_checks_fail_on_a_mutated_figure() -> None:
    text = REPORT.read_text()
    cells, problems = check_tables(text)
    assert problems == [] and cells > 100
    # a GPU µs cell one off (symm's sync at 64 MiB, the full proof: GPU 459, host 452)
    row = "| `2026-11-27-proof/comm-1pe-symm.json` | symm, 1 PE | sync | 64M | 459 | 452 |"
    assert row in text
    for bad in (row.replace("| 459 | 452 |", "| 458 | 452 |"), row.replace("| 459 | 452 |", "| 452 | 459 |"),
                row.replace("symm, 1 PE", "nvshmem, 1 PE"), row.replace("comm-1pe-symm", "comm-1pe-symmx")):
        assert check_tables(text.replace(row, bad, 1))[1], bad
    # a check's duration and one of its numbers
    dead = "max_raise_s=8, max_exit_s=0.62"
    assert dead in text and check_tables(text.replace(dead, "max_raise_s=8, max_exit_s=0.52"))[1]
    # a figure in prose, the way the report once mixed columns; a bound is no figure
    assert stray_figures("symm's `sync` went from 459 to 138 µs.") != []
    assert stray_figures("push 0.85x `add_`, host 36 µs") != []
    assert stray_figures("fetch `x local` >= 0.95x, `sync` <= 60 µs, see `459 µs` in code") == []
