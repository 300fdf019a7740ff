"""Shared plumbing of the benchmarks: process launch, machine description, tables, JSON, progress bars.

Every benchmark runs either under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) or, started as a
plain ``python bench/X.py``, spawns its own processes with :mod:`torch.multiprocessing` on one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


def ensure_importable() -> None:
    """Make ``import odc_runtime`` work from a source checkout that was not installed."""
    try:
        import odc_runtime  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))


ensure_importable()


# --------------------------------------------------------------------------------------------------- launch


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(local_rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(*args)


def launch(fn: Callable, nproc: int, *args) -> None:
    """Run ``fn(*args)`` on every rank: in this process under torchrun, else in ``nproc`` spawned processes.

    ``fn`` must be a module-level function; it reads its rank from the environment (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``) and calls :func:`init_distributed`.
    """
    if under_torchrun():
        fn(*args)
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(fn, nproc, _free_port(), args), nprocs=nproc, join=True)


def init_distributed(device: str):
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


# --------------------------------------------------------------------------------------------------- reporting


def machine_info() -> dict:
    import torch

    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }
    with contextlib.suppress(Exception):
        info["mem_total_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
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


def write_outputs(args, name: str, payload: dict, draw: Callable[[object, str], None]) -> None:
    """Write ``payload`` to ``--json`` if given, then ``draw(plots_module, path)`` unless ``--plot none``.

    The plot is skipped with one line when matplotlib (the ``bench`` extra) is missing.
    """
    if args.json:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    if (args.plot or "").lower() == "none":
        return
    try:
        import plots
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
