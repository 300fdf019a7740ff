"""Shared plumbing of the benchmarks: process launch, common arguments, loading sequence lengths, result checks,
tables with legends, JSON, plots, progress bars. Every tool in ``bench/`` goes through these, so each takes
``--json PATH`` and ``--plot PATH`` (:func:`add_output_args`), loads lengths one way (:func:`add_workload_args`,
:func:`load_minibatches`) and prints every table with a legend of its columns (:func:`print_table`).

Distributed benchmarks run either under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) or, started as
a plain ``python bench/X.py``, spawn their own processes with :mod:`torch.multiprocessing` on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from odc_runtime import launch as launch_helper

BENCH_DIR = Path(__file__).resolve().parent
#: Where plots go by default: ``bench/results`` in a checkout (this folder's parent is the repository, not a
#: package); ``odc-bench-results`` in the working directory for an installed package (never site-packages).
RESULTS_DIR = Path("odc-bench-results") if (BENCH_DIR.parent / "__init__.py").is_file() else BENCH_DIR / "results"

# --------------------------------------------------------------------------------------------------- launch


def under_torchrun() -> bool:
    return launch_helper.under_launcher()


def launch(fn: Callable[..., None], nproc: int, *args: object) -> None:
    """Run ``fn(*args)`` on every rank: in this process under torchrun, else in ``nproc`` spawned processes
    (:func:`odc_runtime.launch.launch`).

    ``fn`` must be a module-level function; it reads its rank from the environment (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``) and calls :func:`init_distributed`.
    """
    launch_helper.launch(fn, nproc, *args)


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """``init_process_group`` (gloo on CPU, nccl on CUDA) from the environment; returns (rank, world, device)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
        return rank, world, torch.device("cuda", local)
    # Ranks share few cores: one intra-op thread each, or they oversubscribe the machine.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world, torch.device("cpu")


# --------------------------------------------------------------------------------------------------- collectives


def tensor_collectives() -> tuple[Callable, Callable]:
    """``(all_gather, reduce_scatter)`` of whole tensors from the public ``torch.distributed`` API: torch 2.13+
    names them ``all_gather_single`` / ``reduce_scatter_single`` and warns on every call of the old names,
    which are all that 2.9-2.12 have (same signatures)."""
    import torch.distributed as dist

    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)


# --------------------------------------------------------------------------------------------------- arguments


def add_output_args(parser: argparse.ArgumentParser, name: str) -> None:
    """``--json PATH`` and ``--plot PATH`` (default ``RESULTS_DIR/<name>.png``; ``none`` skips the plot)."""
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help=f"PNG path (default {default_plot_path(name)}); 'none' to skip")


def comma_list(choices: Iterable[str] | None = None, *, cast: Callable[[str], object] = str,
               minimum: int | None = None) -> Callable[[str], list]:
    """An argparse ``type``: a comma-separated list, each item ``cast`` and checked against ``choices`` (or
    ``>= minimum``); an empty list or a bad item is a usage error that names the valid values."""
    allowed = None if choices is None else tuple(choices)

    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        try:
            values = [cast(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {cast.__name__} values, got {text!r}") from None
        bad = [v for v in values if (allowed is not None and v not in allowed) or (minimum is not None and v < minimum)]
        if bad or not values:
            valid = f"choose from {', '.join(allowed)}" if allowed is not None else f"each at least {minimum}"
            raise argparse.ArgumentTypeError(f"{text!r}: {'bad ' + repr(bad) if bad else 'empty'}; {valid}")
        return values

    parse.__name__ = "comma-separated list"  # argparse names the type in its error messages
    return parse


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Where the sequence lengths come from: ``--preset`` (synthetic, seeded) or ``--lengths-file`` (real)."""
    from odc_runtime.workloads import PRESETS

    parser.add_argument("--preset", default="longalign_sft", choices=sorted(PRESETS),
                        help="sequence-length preset (odc_runtime.workloads.PRESETS says what each models)")
    parser.add_argument("--lengths-file", default=None, metavar="PATH",
                        help="real sequence lengths instead of a preset (JSON list, or one int per line)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the preset's sampler")
    parser.add_argument("--allow-oversized", action="store_true",
                        help="plan samples longer than --max-tokens, each alone in a micro-batch of its own (a job "
                             "could not train them there; the tables flag them). Default: refuse them")


def oversized(lengths: Iterable[int], max_tokens: int) -> int:
    """How many samples are longer than ``max_tokens`` (each then needs ``--allow-oversized``)."""
    return sum(1 for s in lengths if s > max_tokens)


def oversized_note(count: int, total: int, max_tokens: int) -> str:
    """What a table and legend say about samples planned over the cap; empty when there are none."""
    if not count:
        return ""
    return (f"{count} of {total} samples ({count / total:.1%}) are longer than the {max_tokens}-token cap and ran "
            "alone (--allow-oversized): a job could not train them")


def check_cap(args: argparse.Namespace, lengths: Iterable[int]) -> None:
    """``SystemExit`` naming the fix when samples exceed ``args.max_tokens`` and ``--allow-oversized`` is off."""
    lengths = list(lengths)
    count = oversized(lengths, args.max_tokens)
    if count and not args.allow_oversized:
        raise SystemExit(
            f"{count} of {len(lengths)} samples are longer than --max-tokens {args.max_tokens} (the longest: "
            f"{max(lengths)}): raise --max-tokens, clip the lengths, or pass --allow-oversized to plan each alone "
            "(flagged in the tables)")


def load_lengths(args: argparse.Namespace, n: int) -> tuple[list[int], str]:
    """``n`` sequence lengths as :func:`add_workload_args` asked for, and a description of their source.

    From ``--lengths-file`` the first ``n`` (fewer when the file is shorter; callers check what they need).
    """
    from odc_runtime.workloads import load_lengths as read_lengths
    from odc_runtime.workloads import sample_lengths

    if args.lengths_file:
        return read_lengths(args.lengths_file)[:n], str(args.lengths_file)
    return sample_lengths(args.preset, n, seed=args.seed), f"preset {args.preset} (seed {args.seed})"


def split_minibatches(lengths: Sequence[int], minibatch_size: int) -> list[list[int]]:
    """Consecutive minibatches of ``minibatch_size`` samples (a short tail is dropped, as drop_last does)."""
    n = len(lengths) // minibatch_size
    return [list(lengths[k * minibatch_size : (k + 1) * minibatch_size]) for k in range(n)]


def load_minibatches(args: argparse.Namespace, count: int, size: int) -> tuple[list[list[int]], str]:
    """Up to ``count`` minibatches of ``size`` lengths (:func:`load_lengths`), and their source.

    Raises ``SystemExit`` with what is missing when not even one full minibatch can be formed.
    """
    lengths, source = load_lengths(args, count * size)
    batches = split_minibatches(lengths, size)
    if not batches:
        raise SystemExit(f"need at least {size} lengths for one minibatch, got {len(lengths)} from {source}")
    return batches, source


# --------------------------------------------------------------------------------------------------- checks


def check_plan(plan: Sequence[Sequence[Sequence[int]]], lengths: Sequence[int], *, world_size: int, max_tokens: int,
               equal_counts: bool, what: str = "plan") -> None:
    """Raise ``RuntimeError`` unless ``plan`` places every sample exactly once on ``world_size`` ranks, keeps
    every micro-batch of several samples within ``max_tokens``, and (``equal_counts``) gives every rank the same
    number of micro-batches. Benchmarks call it before they time anything, so that a wrong plan never gets a
    number."""
    if len(plan) != world_size:
        raise RuntimeError(f"{what}: {len(plan)} ranks, expected {world_size}")
    from odc_runtime.split import Chunk, check_split_plan

    if any(isinstance(i, Chunk) for rank in plan for mb in rank for i in mb):  # a split plan (lb_mini_split)
        try:
            check_split_plan(plan, lengths, world_size=world_size, max_tokens=max_tokens)
        except ValueError as e:
            raise RuntimeError(f"{what}: {e}") from e
        return
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    if seen != list(range(len(lengths))):
        raise RuntimeError(f"{what}: samples are not each placed exactly once")
    over = [mb for rank in plan for mb in rank if len(mb) > 1 and sum(lengths[i] for i in mb) > max_tokens]
    if over:
        raise RuntimeError(f"{what}: a micro-batch of {len(over[0])} samples exceeds max_tokens={max_tokens}")
    if equal_counts and len({len(rank) for rank in plan}) > 1:
        raise RuntimeError(f"{what}: micro-batch counts differ between ranks: {[len(r) for r in plan]}")


# --------------------------------------------------------------------------------------------------- reporting


def machine_info() -> dict:
    """Where a result was measured (torch and GPUs only when torch is installed)."""
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }
    with contextlib.suppress(Exception):
        info["mem_total_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain-text table with right-aligned columns (the first left-aligned)."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]], legend: Mapping[str, str], *,
                title: str | None = None) -> str:
    """Print (and return) ``title``, the table and one legend line per column: what it holds, in which unit.

    Every column needs a legend entry (``ValueError`` otherwise), so that no benchmark prints a column
    without saying what it is.
    """
    missing = [h for h in headers if h not in legend]
    if missing:
        raise ValueError(f"table columns without a legend entry: {missing}")
    width = max(len(h) for h in headers)
    text = ([title] if title else []) + [format_table(headers, rows)]
    text += [f"  {h:<{width}}  {legend[h]}" for h in headers]
    out = "\n".join(text)
    print(out, flush=True)
    return out


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v != v:  # nan
            return "-"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    return "-" if v is None else str(v)


def write_json(path: str | os.PathLike, obj: object) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def default_plot_path(name: str) -> Path:
    return RESULTS_DIR / f"{name}.png"


def write_outputs(args: argparse.Namespace, name: str, payload: dict, draw: Callable[[object, str], None]) -> None:
    """Write ``payload`` to ``--json`` if given, then ``draw(plots_module, path)`` unless ``--plot none``.

    The plot is skipped with one line when matplotlib (the ``bench`` extra) is missing.
    """
    if args.json:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    if (args.plot or "").lower() == "none":
        return
    try:
        from odc_runtime.bench import plots
    except ImportError as e:
        print(f"no plot ({e}); pip install matplotlib (the 'bench' extra)")
        return
    path = args.plot or str(default_plot_path(name))
    draw(plots, path)
    print(f"wrote {path}")


def progress(iterable: Iterable, *, enabled: bool, total: int | None = None, desc: str = "") -> Iterable:
    """tqdm on the reporting rank when tqdm is installed (the ``bench`` extra); the plain iterable otherwise."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)
