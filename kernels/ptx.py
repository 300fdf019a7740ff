"""Memory ordering checked in the generated code: compile Triton kernels to PTX for real GPU targets, with no GPU,
and compare each kernel's ordered memory operations with the table its module declares.

Why: the Triton interpreter runs the transport's kernels on CPU ranks in CI, but x86 ordering hides a missing
``sem=`` or a too-narrow ``scope=``. What a GPU does is decided by the PTX qualifiers Triton emits, and those can be
read without a GPU: ``triton.compile`` with an explicit ``GPUTarget`` runs the whole pipeline (ptxas included, as
shipped in the triton wheel) for sm_80, sm_90 and sm_100.

The declaration, in the kernel module (``kernels/peer.py``, ``kernels/_triton.py``, or a test module)::

    ORDERING = {                        # case -> every ordered global memory operation the case's PTX must have
        "push": [("atom.add", "relaxed", "sys")],
        "signal": [("atom.add", "release", "sys")],
        "wait": [("ld", "acquire", "sys")],
    }
    PTX_ARGS = {                        # case -> (signature, constexprs) to compile it with
        "push": ({"dst_ptr": "*fp32", ...}, {"BLOCK": 1024}),
        ...
    }

A case is a ``@triton.jit`` function of the module named by the case, optionally ``name:label`` to compile one
kernel several ways (e.g. ``_accumulate_slots_kernel:sumsq``). Every ``@triton.jit`` function of the module must
have a case, unless the module lists it in ``PTX_HELPERS`` (a device function only called by kernels).

The check is *exact*: the set of distinct ordered operations in the PTX must equal the declared set, so a weaker
operation (``relaxed`` for ``release``, ``gpu`` for ``sys``) and an unexpected one both fail, naming the PTX line.
Two allowances keep tables readable and stable across Triton versions: ``.volatile`` loads and stores (a spin's
reads: relaxed, never a ``sem=``) are checked when declared but need not be; and ``("atom.add", "acquire", s)``
and ``("ld", "acquire", s)`` are one entry, because Triton lowers an acquire add of zero to ``ld.acquire``.

What counts as an ordered operation, and how it is named (PTX ISA, "Memory Consistency Model"):

* ``atom`` and ``red`` on global or generic memory: ``("atom.<op>", sem, scope)``; ``red`` is ``atom`` without a
  result (Triton picks it when the result is unused), so both are ``atom.*``. No ``.sem`` means ``relaxed``; no
  ``.scope`` means ``gpu``.
* ``ld`` / ``st`` with ``.relaxed``/``.acquire``/``.release`` (and their scope), or ``.volatile``, which the model
  treats as relaxed at system scope: ``("ld", "volatile", "sys")``. Plain (weak) loads and stores, shared-memory
  traffic and ``ld.param`` are not ordered and are not listed. Triton turns an atomic that adds 0 with
  ``sem="acquire"`` into ``ld.acquire``.
* ``fence.<sem>.<scope>`` and ``membar.<level>`` (``membar.gl`` = ``fence.sc.gpu``): ``("fence", sem, scope)``.

Unbarriered releases (every kernel, no declaration): a release at system scope (``atom``/``red``/``st`` with
``.release`` or ``.acq_rel``, or a ``fence``) publishes to another GPU or process the writes *its own thread* made
or observed. Triton issues a scalar atomic (a block's count, a signal) from one thread of the CTA, so the other
threads' data stores reach it only through a CTA barrier (``bar.sync``/``barrier.sync``: ``tl.debug_barrier()``)
between them. The check reads the PTX in program order and fails a system-scope release that follows a data write
(a weak ``st`` or a relaxed ``atom``/``red`` to global memory) of other threads with no CTA barrier between the two,
naming both lines: a write is another thread's unless it ran under the release's own predicate (then each writing
thread releases its own writes), so a one-thread release after every thread's stores fails. Triton 3.9 happens to
emit a barrier before such an atomic; 3.5-3.8 do not, so the kernel must ask for it.

Vector widths (optional): ``ORDERING`` names operations without their vector width. A module may also declare
``VECTOR``, per case and architecture, the vector accesses the case's PTX must contain, as ``(op, bytes)``::

    VECTOR = {"push:aligned": {90: [("ld", 16), ("red.add", 16)], 80: [("ld", 16)]}}

``("red.add", 16)`` is a 16-byte vector reduction (``red.global....add.v4.f32``), ``("ld", 16)`` a 16-byte vector
load (``ld.global.v4.b32`` or ``ld.global.v2.b64``). Each declared access must be present (a kernel whose
alignment hints stopped reaching the code generator fails); other vector accesses are allowed.

Mutation check (``mutation_survivors``): every ``sem="..."`` / ``scope="..."`` literal in a kernel's source is
changed, one at a time, the kernel is recompiled from the changed source, and its cases must then fail the check.
A literal whose change no case notices is reported: the table would not catch a mistake there.

Launch check (``check_launches``): ``PTX_ARGS`` types each argument, but Triton compiles a launch for the
argument *values* (an int equal to 1 becomes a constant, multiples of 16 and 16-byte aligned pointers get an
attribute). A module that defines ``launch_examples()`` has each example compiled through Triton's launch path with
a fake driver (``odc_runtime.kernels.launch_check``), and every kernel so compiled must compile and pass the same exact
ordering check against its case; every case needs an example.

Run it: ``python -m odc_runtime.kernels.ptx [module ...]`` (default: the project's kernel modules; ``--json`` for
a machine-readable report). ``tests/test_ptx.py`` runs it in CI.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import linecache
import re
import sys
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from odc_runtime import cli

__all__ = [
    "ARCHS",
    "DEFAULT_MODULES",
    "Access",
    "Case",
    "accesses",
    "cases",
    "check_case",
    "check_launches",
    "compile_ptx",
    "main",
    "mutation_survivors",
    "supported_archs",
    "unbarriered_releases",
    "vector_accesses",
]

ARCHS = (80, 90, 100)  # Ampere, Hopper, Blackwell: where the transport runs
DEFAULT_MODULES = ("odc_runtime.kernels._triton", "odc_runtime.kernels.peer")

_SEMS = {"relaxed", "acquire", "release", "acq_rel", "sc", "volatile", "weak", "mmio"}
_SCOPES = {"cta", "cluster", "gpu", "sys"}
_ATOM_OPS = {"add", "inc", "dec", "min", "max", "and", "or", "xor", "exch", "cas"}
_UNORDERED_SPACES = {"shared", "shared::cta", "shared::cluster", "local", "param", "const", "tex"}
_MEMBAR = {"cta": "cta", "gl": "gpu", "sys": "sys"}
_TYPE_BITS = re.compile(r"^[bfsu](\d+)$")  # a PTX type qualifier (b32, f32, u64, ...) and its bits
# An instruction: optional predicate, then the dotted opcode.
_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:atom|red|ld|st|fence|membar)(?:\.[\w:]+)+)\b")


@dataclass(frozen=True, order=True)
class Access:
    """One kind of ordered memory operation: ``op`` (``atom.add``, ``ld``, ``fence``, ...), ``sem``, ``scope``."""

    op: str
    sem: str
    scope: str

    @classmethod
    def of(cls, entry: Iterable[str]) -> Access:
        """From a table entry ``(op, sem, scope)``; ``red.<op>`` is taken as ``atom.<op>``."""
        op, sem, scope = entry
        if op.startswith("red."):
            op = "atom." + op[4:]
        if sem not in _SEMS or scope not in _SCOPES:
            raise ValueError(
                f"bad ordering entry {tuple(entry)!r}: sem one of {sorted(_SEMS)}, scope one of {sorted(_SCOPES)}"
            )
        return _canonical(cls(op, sem, scope))

    def __str__(self) -> str:
        return f"{self.op}.{self.sem}.{self.scope}"


def _classify(opcode: str) -> Access | None:
    """The ordered operation a PTX opcode (``red.global.sys.release.add.u32``) performs, or None if unordered."""
    base, *quals = opcode.split(".")
    q = set(quals)
    if q & _UNORDERED_SPACES:
        return None
    sem = next((s for s in quals if s in _SEMS), None)
    scope = next((s for s in quals if s in _SCOPES), None)
    if base in ("atom", "red"):
        op = next((o for o in quals if o in _ATOM_OPS), "?")
        return Access(f"atom.{op}", sem or "relaxed", scope or "gpu")
    if base in ("ld", "st"):
        if sem == "volatile":
            return Access(base, "volatile", "sys")
        if sem in (None, "weak") or "nc" in q:
            return None
        return Access(base, sem, scope or "gpu")
    if base == "fence":
        if any(x.startswith("proxy") for x in quals):
            return None
        return Access("fence", sem or "sc", scope or "gpu")
    if base == "membar":
        return Access("fence", "sc", _MEMBAR.get(quals[0] if quals else "", "gpu"))
    return None


def _canonical(acc: Access) -> Access:
    # Triton lowers an acquire atomic add (of zero: the usual "acquire read of a counter") to ld.acquire; for
    # ordering the two are the same, so a table may name either and either lowering satisfies it.
    if acc.op == "atom.add" and acc.sem == "acquire":
        return Access("ld", "acquire", acc.scope)
    return acc


def accesses(ptx: str) -> dict[Access, str]:
    """Every distinct ordered operation in ``ptx`` (canonical names), with the first PTX line that performs it."""
    found: dict[Access, str] = {}
    for line in ptx.splitlines():
        m = _INSTR.match(line)
        if m:
            acc = _classify(m.group(1))
            if acc is not None:
                found.setdefault(_canonical(acc), line.strip())
    return found


Vector = tuple[str, int]  # a vector access: (op as in ORDERING, red.* as atom.*; bytes per access)


def _vector_of(entry: Iterable[Any]) -> Vector:
    """A ``VECTOR`` entry ``(op, bytes)``, ``red.<op>`` taken as ``atom.<op>``."""
    op, nbytes = entry
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"bad vector entry {tuple(entry)!r}: (op, bytes per access)")
    return ("atom." + op[4:] if op.startswith("red.") else op), nbytes


def vector_accesses(ptx: str) -> dict[Vector, str]:
    """Every distinct vector access to global or generic memory in ``ptx`` (``ld``/``st``, ``atom``/``red`` with a
    ``.vN`` qualifier) as ``(op, bytes per access)``, with the first PTX line that performs it."""
    found: dict[Vector, str] = {}
    for line in ptx.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        base, *quals = m.group(1).split(".")
        width = next((int(q[1:]) for q in quals if q[:1] == "v" and q[1:].isdigit()), None)
        bits = next((int(t.group(1)) for q in quals if (t := _TYPE_BITS.match(q))), None)
        if width is None or bits is None or set(quals) & _UNORDERED_SPACES or base not in ("ld", "st", "atom", "red"):
            continue
        op = base if base in ("ld", "st") else "atom." + next((o for o in quals if o in _ATOM_OPS), "?")
        found.setdefault((op, width * bits // 8), line.strip())
    return found


_CTA_BARRIER = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:bar|barrier)(?:\.cta)?\.(?:sync|red)\b")
_PREDICATE = re.compile(r"^\s*(@!?%\w+)\s")
_RELEASES = {"release", "acq_rel", "sc"}


def unbarriered_releases(ptx: str) -> list[str]:
    """System-scope releases that may not cover other threads' data writes (module docstring), each as
    ``"<release line> after <write line>"``; empty when every one is barriered.

    Between two CTA barriers, a release is accepted after writes made under its own predicate (or when it runs
    unpredicated, in every thread): each thread that wrote then releases its own writes. A write under another
    predicate, or unpredicated, before a predicated release (Triton's one-thread scalar atomic) is reported."""
    problems: list[str] = []
    pending: list[tuple[str | None, str]] = []  # (predicate, line) of the data writes since the last CTA barrier
    for line in ptx.splitlines():
        if _CTA_BARRIER.match(line):
            pending.clear()
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        opcode = m.group(1)
        base, *quals = opcode.split(".")
        pred_match = _PREDICATE.match(line)
        pred = pred_match.group(1) if pred_match else None
        acc = _classify(opcode)
        if acc is not None and acc.scope == "sys" and acc.sem in _RELEASES and base in ("atom", "red", "st", "fence"):
            other = next((w for p, w in pending if pred is not None and p != pred), None)
            if other is not None:
                problems.append(f"{line.strip().rstrip(';')} after {other}")
            continue
        if base in ("atom", "red", "st") and not set(quals) & _UNORDERED_SPACES and (
                acc is None or acc.sem in ("relaxed", "volatile")):
            pending.append((pred, line.strip().rstrip(";")))
    return problems


@dataclass(frozen=True)
class Case:
    """One kernel compiled one way, and the ordered operations (and vector accesses) its PTX must have."""

    name: str  # "kernel" or "kernel:label"
    fn: Any  # the triton JITFunction
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any]
    requires: frozenset[Access]
    vectors: Mapping[int, frozenset[Vector]] = field(default_factory=dict)  # arch -> vector accesses it must have


def cases(module: ModuleType) -> list[Case]:
    """The cases ``module`` declares (``ORDERING`` + ``PTX_ARGS``); ValueError if the two tables disagree."""
    ordering: Mapping[str, Iterable[Iterable[str]]] = getattr(module, "ORDERING", {})
    args: Mapping[str, tuple[Mapping[str, str], Mapping[str, Any]]] = getattr(module, "PTX_ARGS", {})
    if set(ordering) != set(args):
        raise ValueError(
            f"{module.__name__}: ORDERING and PTX_ARGS name different cases: only in ORDERING "
            f"{sorted(set(ordering) - set(args))}, only in PTX_ARGS {sorted(set(args) - set(ordering))}"
        )
    import triton

    kernels = {n for n, v in vars(module).items() if isinstance(v, triton.runtime.JITFunction)}
    unchecked = kernels - {name.split(":")[0] for name in ordering} - set(getattr(module, "PTX_HELPERS", ()))
    if unchecked:
        raise ValueError(
            f"{module.__name__}: kernels without a declared ordering: {sorted(unchecked)}; add them to ORDERING and "
            "PTX_ARGS (a @triton.jit helper that is never launched on its own: to PTX_HELPERS)"
        )
    vectors = _vectors(module)
    out = []
    for name, table in ordering.items():
        fn = getattr(module, name.split(":")[0])
        signature, constexprs = args[name]
        out.append(Case(name, fn, dict(signature), dict(constexprs), frozenset(Access.of(e) for e in table),
                        vectors.get(name, {})))
    return out


def _vectors(module: ModuleType) -> dict[str, dict[int, frozenset[Vector]]]:
    """The module's ``VECTOR`` table, normalised; ValueError for a case ``ORDERING`` does not declare."""
    table: Mapping[str, Mapping[int, Iterable[Iterable[Any]]]] = getattr(module, "VECTOR", {})
    unknown = set(table) - set(getattr(module, "ORDERING", {}))
    if unknown:
        raise ValueError(f"{module.__name__}: VECTOR names cases ORDERING does not declare: {sorted(unknown)}")
    return {name: {arch: frozenset(map(_vector_of, entries)) for arch, entries in per_arch.items()}
            for name, per_arch in table.items()}


def compile_ptx(fn: Any, signature: Mapping[str, str], constexprs: Mapping[str, Any], arch: int) -> str:
    """PTX of ``fn`` compiled for ``sm_<arch>`` (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(fn, triton.runtime.JITFunction):
        raise TypeError(
            f"{fn!r} is not a compilable triton.jit function (TRITON_INTERPRET=1 was set when it was defined?)"
        )
    src = ASTSource(fn=fn, signature=dict(signature), constexprs=dict(constexprs))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32)).asm["ptx"]


def supported_archs(archs: Iterable[int] = ARCHS) -> tuple[int, ...]:
    """The architectures of ``archs`` this triton can compile for (a trivial kernel is compiled for each)."""
    ok = []
    for arch in archs:
        try:
            compile_ptx(_probe_kernel(), {"p": "*i32"}, {}, arch)
        except Exception:
            continue
        ok.append(arch)
    return tuple(ok)


def check_case(case: Case, arch: int, fn: Any = None) -> list[str]:
    """Problems of ``case`` on ``sm_<arch>`` (empty: its PTX has exactly the declared ordered operations).

    ``fn`` replaces the case's kernel (a mutant) when given.
    """
    ptx = compile_ptx(fn if fn is not None else case.fn, case.signature, case.constexprs, arch)
    return _compare(f"{case.name} sm_{arch}", case.requires, ptx, case.vectors.get(arch, frozenset()))


def _compare(what: str, requires: frozenset[Access], ptx: str, vectors: frozenset[Vector] = frozenset()) -> list[str]:
    found = accesses(ptx)
    problems = [f"{what}: missing {a}" for a in sorted(requires - found.keys())]
    problems += [f"{what}: unbarriered release: {p}; other threads' stores are not covered by it: put a CTA barrier "
                 "(tl.debug_barrier()) between the stores and the release" for p in unbarriered_releases(ptx)]
    extra = sorted(a for a in found.keys() - requires if a.sem != "volatile")
    problems += [f"{what}: unexpected {a}: {found[a]}" for a in extra]
    if vectors:
        have = vector_accesses(ptx)
        problems += [f"{what}: missing the {n}-byte vector {op} (VECTOR); vector accesses found: "
                     f"{sorted(have) or 'none'}" for op, n in sorted(vectors - have.keys())]
    return problems


def check_launches(module: ModuleType, archs: Iterable[int]) -> list[dict[str, Any]]:
    """Every example of the module's ``launch_examples()`` (``odc_runtime.kernels.launch_check``) compiled through
    Triton's launch path for each of ``archs``, each compiled kernel's PTX compared with its case's ``ORDERING``.

    One entry per example: ``case``, ``what``, ``specializations`` (``sm_XY: kernel args``) and ``problems`` (a
    compiler error, a kernel other than the case's, or the ordering check's). A case no example compiles is an
    entry with that problem: every kernel the module declares must be compiled the way it is launched."""
    from . import launch_check as launch

    ordering: Mapping[str, Iterable[Iterable[str]]] = getattr(module, "ORDERING", {})
    requires = {name: frozenset(Access.of(e) for e in table) for name, table in ordering.items()}
    vectors = _vectors(module)
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for arch in archs:
        for run in launch.compiled_launches(module, arch):
            e = entries.setdefault((run.case, run.what),
                                   {"case": run.case, "what": run.what, "specializations": [], "problems": []})
            where = f"{run.case} [{run.what}] sm_{arch}"
            if run.error is not None:
                e["problems"].append(f"{where}: {run.error}")
                continue
            e["specializations"].append(f"sm_{arch}: {run.kernel} {run.specialization}")
            if run.case not in requires or run.kernel != run.case.split(":")[0]:
                e["problems"].append(f"{where}: launched {run.kernel}, not a kernel of the ORDERING case {run.case}")
                continue
            e["problems"] += _compare(where, requires[run.case], run.ptx or "",
                                      vectors.get(run.case, {}).get(arch, frozenset()))
    for name in sorted(set(requires) - {case for case, _ in entries}):
        entries[(name, "")] = {"case": name, "what": "", "specializations": [],
                               "problems": [f"{name}: no launch example compiles this case; add one to "
                                            f"{module.__name__}.launch_examples()"]}
    return list(entries.values())


_LITERAL = re.compile(r"""\b(sem|scope)\s*=\s*(["'])(\w+)\2""")
_CHANGE = {
    "sem": {"release": "relaxed", "acquire": "relaxed", "acq_rel": "relaxed", "relaxed": "acq_rel"},
    "scope": {"sys": "gpu", "gpu": "cta", "cta": "gpu"},
}


def _mutants(fn: Any) -> Iterator[tuple[str, Any]]:
    """``(description, kernel)`` for each ``sem=`` / ``scope=`` literal of ``fn``'s source changed in turn."""
    import triton

    py = fn.fn
    src = textwrap.dedent(inspect.getsource(py))
    src = src[re.search(r"^def\s", src, re.MULTILINE).start():]  # the decorator is re-applied below  # type: ignore[union-attr]
    for i, m in enumerate(_LITERAL.finditer(src)):
        key, quote, value = m.group(1), m.group(2), m.group(3)
        new = _CHANGE[key].get(value)
        if new is None:
            continue
        changed = src[: m.start()] + f"{key}={quote}{new}{quote}" + src[m.end():]
        filename = f"<odc-ptx mutant {py.__name__} {i}>"
        # triton.jit reads the source through inspect, which finds code compiled from a string in linecache.
        linecache.cache[filename] = (len(changed), None, changed.splitlines(True), filename)
        namespace = dict(py.__globals__)
        exec(compile(changed, filename, "exec"), namespace)
        line = src.count("\n", 0, m.start()) + 1
        yield f"{py.__name__} line {line}: {key}={value!r} -> {new!r}", triton.jit(namespace[py.__name__])


def mutation_survivors(module_cases: list[Case], arch: int = 90) -> tuple[list[str], int]:
    """Changed ``sem=`` / ``scope=`` literals that no case of their kernel notices, and how many were tried."""
    by_kernel: dict[str, list[Case]] = {}
    for c in module_cases:
        by_kernel.setdefault(c.name.split(":")[0], []).append(c)
    survivors, tried = [], 0
    for kernel_cases in by_kernel.values():
        for what, mutant in _mutants(kernel_cases[0].fn):
            tried += 1
            if not any(check_case(c, arch, fn=mutant) for c in kernel_cases):
                survivors.append(what)
    return survivors, tried


@functools.cache
def _probe_kernel() -> Any:
    """A trivial kernel, built on first use (importing this module needs no triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(p):
        tl.store(p, 1)

    return _probe


def _load(names: Iterable[str], explicit: bool) -> list[ModuleType]:
    mods = []
    for name in names:
        if not explicit and importlib.util.find_spec(name) is None:
            continue  # a default module not written yet
        mods.append(importlib.import_module(name))
    return mods


def main(argv: list[str] | None = None) -> int:
    """CLI: check every case of the given kernel modules on every supported architecture; exit 1 on a problem."""
    ap = cli.parser(__doc__, prog="python -m odc_runtime.kernels.ptx", first_paragraph=True)
    ap.add_argument("modules", nargs="*", help=f"kernel modules (default: {', '.join(DEFAULT_MODULES)})")
    ap.add_argument("--arch", type=int, action="append", help="sm_XY as XY (repeatable; default 80, 90, 100)")
    ap.add_argument("--mutants", action="store_true", help="also change each sem=/scope= literal (on sm_90)")
    ap.add_argument("--no-launches", dest="launches", action="store_false",
                    help="skip the launch check: compiling each module's launch_examples() as its launchers do")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    requested = tuple(args.arch or ARCHS)
    archs = supported_archs(requested)
    report: dict[str, Any] = {"archs": list(archs), "unsupported_archs": sorted(set(requested) - set(archs)),
                              "modules": {}}
    failed = not archs
    for mod in _load(args.modules or DEFAULT_MODULES, explicit=bool(args.modules)):
        entry: dict[str, Any] = {"cases": {}}
        mod_cases = cases(mod)
        for case in mod_cases:
            problems = [p for arch in archs for p in check_case(case, arch)]
            entry["cases"][case.name] = {"requires": sorted(map(str, case.requires)), "problems": problems,
                                         "vectors": {a: sorted(v) for a, v in case.vectors.items() if a in archs}}
            failed |= bool(problems)
        if args.launches and hasattr(mod, "launch_examples"):
            entry["launches"] = check_launches(mod, archs)
            failed |= any(e["problems"] for e in entry["launches"])
        if args.mutants and 90 in archs:  # on the kernels that pass: a failing one needs no mutant to fail
            failing = {c.split(":")[0] for c, r in entry["cases"].items() if r["problems"]}
            survivors, tried = mutation_survivors([c for c in mod_cases if c.name.split(":")[0] not in failing])
            entry["mutants"] = {"tried": tried, "survivors": survivors}
            failed |= bool(survivors)
        report["modules"][mod.__name__] = entry
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        missing = report["unsupported_archs"]
        print(f"PTX ordering check on sm_{', sm_'.join(map(str, archs))}"
              + (f" (this triton cannot target {missing})" if missing else ""))
        for name, entry in report["modules"].items():
            for case, r in entry["cases"].items():
                vec = "; ".join(f"sm_{a}: " + ", ".join(f"{op} x{n}B" for op, n in v) for a, v in r["vectors"].items())
                print(f"  {name}.{case}: {'ok' if not r['problems'] else 'FAIL'} [{', '.join(r['requires']) or '-'}]"
                      + (f" vectors [{vec}]" if vec else ""))
                for p in r["problems"]:
                    print(f"    {p}")
            for e in entry.get("launches", []):
                print(f"  {name}.{e['case']} launched [{e['what'] or '-'}]: {'ok' if not e['problems'] else 'FAIL'}")
                for p in e["problems"]:
                    print(f"    {p}")
            if "mutants" in entry:
                m = entry["mutants"]
                print(f"  {name}: {m['tried'] - len(m['survivors'])}/{m['tried']} changed sem/scope literals caught")
                for s in m["survivors"]:
                    print(f"    not caught: {s}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
