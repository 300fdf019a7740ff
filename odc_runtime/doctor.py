"""What odc_runtime finds on this machine, and why a transport cannot run here.

    python -m odc_runtime.doctor [--json PATH|-]

It shows:

* the versions that matter: odc_runtime (and the directory it was imported from: an installed wheel's
  site-packages, or a checkout), Python, torch and its CUDA, Triton, the NVSHMEM wheels;
* the NVSHMEM extension it finds: a source build's ``odc_runtime._C`` or an extension wheel (``odc-runtime-cu13``),
  with the NVSHMEM release it was compiled against; or why none loads;
* the CUDA devices, with CUDA MPS's state (several ranks on one GPU need it);
* the host transport's shared-memory directory and its free space (a container's small ``/dev/shm`` is the usual
  cause of an ``OdcMemoryError`` on CPU ranks);
* every registered transport: whether it can run here and, where it cannot, why (``TransportSpec.
  unavailable_reason``, the fact the automatic choice uses);
* the transport ``odc.init()`` would take for ranks on this host alone;
* every ``ODC_*`` variable set in the environment, parsed by the reader ``init`` uses (``config.SETTINGS``): a
  bad value shows the error ``init`` would raise, and a name odc_runtime does not read is flagged, with the
  setting it is closest to (a typo is otherwise silently ignored).

It needs no GPU and no ``torch.distributed``, and it starts no job: on a GPU machine it queries the devices only.
Exit status 1 when a set variable is invalid or unknown, or no transport fits; else 0.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch

from odc_runtime import __version__, _nvshmem_locate, cli, config
from odc_runtime import transport as registry
from odc_runtime.errors import OdcError
from odc_runtime.transport import gpu_sharing

__all__ = ["collect", "healthy", "main", "render"]

_MPS = {1: "on", 0: "off", -1: "unknown"}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({
            "index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "mps": _MPS[gpu_sharing.mps_state(index)],
        })
    return gpus


def _shared_memory() -> dict[str, Any]:
    """The host transport's segment directory (``ODC_SHM_DIR``) and its free bytes, or why it cannot be used."""
    try:
        directory = config.shm_dir()
        stats = os.statvfs(directory)
    except (OdcError, OSError) as e:
        return {"dir": config.shm_dir_as_set(), "free_bytes": None, "error": str(e)}
    return {"dir": directory, "free_bytes": stats.f_bavail * stats.f_frsize, "error": None}


def _transports() -> list[dict[str, Any]]:
    rows = []
    for name in registry.names():
        spec = registry.get(name)
        reason = spec.unavailable_reason()
        rows.append({
            "name": name, "device_type": spec.device_type, "automatic": spec.auto, "multi_node": spec.multi_node,
            "available": reason is None, "reason": reason,
        })
    return rows


def _init_choice(transports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What ``odc.init()`` would take on this host alone: ``{"backend", "how"}``, or ``{"error"}``."""
    try:
        requested = config.backend_name(None)
        name = registry.choose([requested], [registry.auto_candidates()], [socket.gethostname()])
    except OdcError as e:
        return {"error": str(e)}
    if requested is None:
        return {"backend": name, "how": "the automatic rule of odc_runtime.transport.choose, for ranks on this host"}
    reason = next(t["reason"] for t in transports if t["name"] == name)
    if reason is not None:
        return {"error": f"ODC_BACKEND={requested}, which cannot run here: {reason}"}
    return {"backend": name, "how": f"ODC_BACKEND={requested}"}


def _settings(init: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ``ODC_*`` variable set here, with what its reader says (``ODC_BACKEND``: with what ``init``, the
    choice ``_init_choice`` made from it, says: a name init refuses, or a transport that cannot run here)."""
    rows = []
    unknown = config.unknown_variables()
    for name, value in config.odc_variables().items():
        row: dict[str, Any] = {"name": name, "value": value, "ok": True, "note": ""}
        if name in config.TOOLING:
            row["note"] = "read by odc_runtime's tests and CI scripts, not by the package"
        elif name in unknown:
            row["ok"] = False
            row["note"] = config.describe_unknown(unknown[name])
        elif name == "ODC_BACKEND" and "error" in init:
            row["ok"], row["note"] = False, init["error"]
        elif config.SETTINGS[name] is None:
            row["note"] = "read with its context (init's world size, or the build): not checked here"
        else:
            try:
                config.SETTINGS[name]()  # type: ignore[misc]
            except OdcError as e:
                row["ok"], row["note"] = False, str(e)
        rows.append(row)
    return rows


def _nvshmem_wheels() -> list[tuple[str, str]]:
    try:
        return _nvshmem_locate.installed_wheels()
    except OSError:
        return []


def _extension() -> dict[str, Any]:
    """The NVSHMEM extension ``load_extension`` takes (``{"module", "file", "distribution", "nvshmem"}``; the
    distribution is None for a source build), or ``{"error"}``: why none loads. Loads it (no NVSHMEM init)."""
    from odc_runtime.transport.nvshmem import extension

    try:
        C = extension.load_extension()
        nvshmem = ".".join(str(x) for x in C.nvshmem_version_compiled())
    except (OdcError, AttributeError) as e:
        return {"error": str(e)}
    package = C.__name__.rsplit(".", 1)[0]
    dists = [] if package == "odc_runtime" else importlib.metadata.packages_distributions().get(package, [])
    distribution = f"{dists[0]} {_version(dists[0])}" if dists else None
    return {"module": C.__name__, "file": C.__file__, "distribution": distribution, "nvshmem": nvshmem}


def collect() -> dict[str, Any]:
    """Everything the doctor reports, as a JSON-serialisable dict (see the module docstring)."""
    transports = _transports()
    init = _init_choice(transports)
    return {
        "odc_runtime": __version__,
        "odc_runtime_dir": os.path.dirname(os.path.abspath(__file__)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "nvshmem_wheels": [f"nvidia-nvshmem-{f}=={v}" for f, v in _nvshmem_wheels()],
        "extension": _extension(),
        "gpus": _gpus(),
        "shared_memory": _shared_memory(),
        "transports": transports,
        "init": init,
        "settings": _settings(init),
    }


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


def _render_extension(ext: dict[str, Any]) -> str:
    if "error" in ext:
        return f"NVSHMEM extension: none ({ext['error']})"
    source = f"the extension wheel {ext['distribution']}" if ext["distribution"] else "a source build"
    return f"NVSHMEM extension: {ext['module']} ({source}, compiled against NVSHMEM {ext['nvshmem']}) at {ext['file']}"


def render(report: dict[str, Any]) -> str:
    """``collect()``'s report as text."""
    lines = [
        f"odc_runtime {report['odc_runtime']} · Python {report['python']} · torch {report['torch']} (CUDA "
        f"{report['torch_cuda'] or 'none'}) · triton {report['triton'] or 'not installed'} · NVSHMEM wheels: "
        f"{', '.join(report['nvshmem_wheels']) or 'none'}",
        f"platform: {report['platform']} · odc_runtime imported from {report['odc_runtime_dir']}",
        _render_extension(report["extension"]),
        "",
    ]
    if report["gpus"]:
        lines += _table(["GPU", "name", "capability", "memory", "CUDA MPS"], [
            [str(g["index"]), g["name"], g["capability"], f"{g['memory_gib']} GiB", g["mps"]] for g in report["gpus"]
        ])
    else:
        lines.append("GPUs: none (torch.cuda.is_available() is false)")
    shm = report["shared_memory"]
    lines.append(f"host transport's shared memory: {shm['dir']}: " + (
        f"{shm['free_bytes'] / 2**30:.1f} GiB free (each rank's shards are reserved there as they are allocated, up "
        "to ODC_HEAP_SIZE per rank; in a container: docker run --shm-size=...)" if shm["error"] is None
        else f"unusable: {shm['error']}"))
    lines.append("")
    lines += _table(["transport", "device", "automatic", "available", "why not"], [
        [t["name"], t["device_type"], "yes" if t["automatic"] else "no", "yes" if t["available"] else "no",
         t["reason"] or ""] for t in report["transports"]
    ])
    choice = report["init"]
    lines += ["", f"odc.init() here: {choice['backend']} ({choice['how']})" if "backend" in choice
              else f"odc.init() here: fails: {choice['error']}", ""]
    if report["settings"]:
        lines += _table(["setting", "value", "check"], [
            [s["name"], s["value"], ("ok" if s["ok"] else "ERROR") + (f": {s['note']}" if s["note"] else "")]
            for s in report["settings"]
        ])
    else:
        lines.append("settings: no ODC_* variable is set (every default applies; docs/configuration.md)")
    return "\n".join(lines)


def healthy(report: dict[str, Any]) -> bool:
    """No invalid or unknown setting, and ``odc.init()`` finds a transport."""
    return "backend" in report["init"] and all(s["ok"] for s in report["settings"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser(__doc__, prog="python -m odc_runtime.doctor", first_paragraph=True)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-': stdout only)")
    args = parser.parse_args(argv)
    report = collect()
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=2)
            except OSError as e:
                print(f"python -m odc_runtime.doctor: cannot write the JSON report to {args.json}: {e.strerror or e}",
                      file=sys.stderr)
                return 2
    return 0 if healthy(report) else 1


if __name__ == "__main__":
    sys.exit(main())
