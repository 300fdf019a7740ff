"""The PTX ordering check (``odc_runtime.kernels.ptx``): kernels compiled for sm_80/90/100 with no GPU, their
ordered memory operations compared with each module's declared table.

The compiling runs in one child process without ``TRITON_INTERPRET`` (other tests of this pytest process may have
defined the kernels under the interpreter, which cannot be compiled). It checks the project's kernel modules (the
transport's ``kernels/peer.py``), the protocol-shaped kernels of ``tests/_ptx_kernels.py``, two of
them written wrong on purpose, and every ``sem=`` / ``scope=`` literal of the right ones changed in turn. The
project's modules are also compiled the way their launchers call them (``odc_runtime.kernels.launch_check``: Triton's
own argument specialization, a fake driver), and ``tests/_launch_kernels.py`` holds a kernel that only fails so.
CI runs this file under every Triton a supported torch pins (``.ci/triton.sh``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from odc_runtime.kernels import ptx

HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[1]
MODULES = ["tests._ptx_kernels", "tests._launch_kernels",
           *(m for m in ptx.DEFAULT_MODULES if importlib.util.find_spec(m) is not None)]


# The CLI (kernels/peer.py declares its own ORDERING / PTX_ARGS / PTX_HELPERS next to its kernels).
_CHILD = """
import sys
from odc_runtime.kernels import ptx
sys.exit(ptx.main(sys.argv[1:]))
"""

@functools.cache
def _report() -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, "--json", "--mutants", *MODULES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    try:
        return proc.returncode, json.loads(proc.stdout), proc.stderr
    except json.JSONDecodeError:
        pytest.fail(f"no ptx report (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (pip install '.[triton]')")


@needs_triton
@pytest.mark.timeout(300)
def test_targets() -> None:
    _, report, _ = _report()
    assert 90 in report["archs"], report  # Hopper is the transport's main target: it must be checked
    assert set(report["archs"]) | set(report["unsupported_archs"]) == set(ptx.ARCHS)


@needs_triton
@pytest.mark.timeout(300)
@pytest.mark.parametrize("module", MODULES)
def test_right_kernels_have_exactly_their_declared_ordering(module: str) -> None:
    _, report, _ = _report()
    entry = report["modules"][module]
    for case, r in entry["cases"].items():
        if "wrong" not in case:
            assert r["problems"] == [], (case, r)
    for launch in entry.get("launches", []):
        if "wrong" not in launch["case"]:
            assert launch["problems"] == [], launch
    assert entry["mutants"]["survivors"] == [], entry["mutants"]
    if module in ptx.DEFAULT_MODULES:  # the project's kernels are also compiled the way they are launched
        assert entry["launches"], module


@needs_triton
@pytest.mark.timeout(300)
def test_launches_compile_the_specializations_callers_cause() -> None:
    _, report, _ = _report()
    archs = report["archs"]

    def specs(module: str, case: str, what: str) -> list[str]:
        [e] = [e for e in report["modules"][module]["launches"] if (e["case"], e["what"]) == (case, what)]
        assert len(e["specializations"]) == len(archs), e
        return e["specializations"]

    # finding 1 of issue 41: one slot must not specialize k into the constant 1 (triton 3.5-3.6 cannot compile it)
    for s in specs("odc_runtime.kernels._triton", "_accumulate_slots_kernel",
                   "one slot (two virtual nodes), 1000 elements"):
        assert " k:i32 " in s, s
    # world 1, first round: the barrier's member count and round number are never specialized (one compiled kernel
    # serves every round: the cached launch path), and its ordering is checked as launched
    for s in specs("odc_runtime.kernels.peer", "barrier_kernel", "world 1: one member, rank 0, epoch 1"):
        assert " nmembers:i32 " in s and " epoch:i32 " in s, s
    # an unaligned row: no alignment attribute on that pointer
    for s in specs("odc_runtime.kernels._triton", "_accumulate_kernel", "fp32, 1001 elements, unaligned rows"):
        assert " dst_ptr:*fp32 " in s, s


@needs_triton
@pytest.mark.timeout(300)
def test_a_launch_that_only_fails_specialized_fails_the_check() -> None:
    rc, report, _ = _report()
    assert rc == 1
    entry = report["modules"]["tests._launch_kernels"]
    assert entry["cases"]["_one_wrong_kernel"]["problems"] == []  # PTX_ARGS (k: i32) compiles: the PTX check passes
    by_what = {e["what"]: e for e in entry["launches"]}
    problems = by_what["k == 1"]["problems"]  # the message's wording differs between Triton versions
    assert len(problems) == len(report["archs"]), problems
    assert all(": CompilationError: " in p and "division or modulo by zero" in p for p in problems), problems
    assert by_what["k == 2"]["problems"] == []
    assert all(" k:i32" in s for s in by_what["k == 2"]["specializations"])


def test_a_case_without_a_launch_example_is_reported() -> None:
    mod = types.ModuleType("fake_kernels")
    mod.ORDERING = {"k": [], "k:other": []}
    mod.launch_examples = lambda: []
    entries = ptx.check_launches(mod, [90])
    assert [e["problems"] for e in entries] == [
        [f"{case}: no launch example compiles this case; add one to fake_kernels.launch_examples()"]
        for case in ("k", "k:other")]


@needs_triton
@pytest.mark.timeout(300)
def test_a_wrong_sem_or_scope_fails_the_check() -> None:
    rc, report, _ = _report()
    assert rc == 1  # the CLI fails on them
    cases = report["modules"]["tests._ptx_kernels"]["cases"]
    archs = report["archs"]
    sem = [p.split(": ")[1] for p in cases["_signal_wrong_sem_kernel"]["problems"]]
    assert sem == ["missing atom.add.release.sys", "unexpected atom.add.relaxed.sys"] * len(archs)
    scope = [p.split(": ")[1] for p in cases["_push_wrong_scope_kernel"]["problems"]]
    assert scope == ["missing atom.add.relaxed.sys", "unexpected atom.add.relaxed.gpu"] * len(archs)
    # Each literal of the three right kernels changed in turn (8 literals), every change caught.
    assert report["modules"]["tests._ptx_kernels"]["mutants"]["tried"] == 8


# -- the PTX reading, on hand-written lines (no triton needed) ----------------------------------------------------
PTX = """
    ld.param.b64 	%rd4, [k_param_0];
    @%p1 red.global.sys.relaxed.add.f32 [ %rd1 + 0 ], %r1;
    @%p2 red.global.sys.relaxed.add.v4.f32 [ %rd1 + 0 ], {%r1, %r2, %r3, %r4};
    @%p3 atom.global.acquire.gpu.cas.b32 %r4, [ %rd3 + 0 ], %r5, %r2;
    @!%p3 atom.global.exch.b32 %r6, [ %rd3 + 0 ], %r5;
    ld.volatile.global.b32 { %r3 }, [ %rd3 + 0 ];
    @%p3 ld.global.sys.acquire.b32 %r10, [ %rd3 + 0 ];
    st.release.sys.global.u32 [%rd5], %r1;
    ld.global.b32 %r1, [%rd2];
    ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}, [%rd2];
    st.shared::cta.b32 [ %r11 + 0 ], %r10;
    atom.shared.add.u32 %r1, [%r2], 1;
    ld.shared.b32 	%r12, [global_smem];
    fence.acq_rel.sys;
    fence.proxy.async.shared::cta;
    membar.gl;
"""


def test_accesses_reads_scope_and_semantics() -> None:
    found = ptx.accesses(PTX)
    assert sorted(map(str, found)) == [
        "atom.add.relaxed.sys",  # red = atom without a result; the vector form is the same operation
        "atom.cas.acquire.gpu",
        "atom.exch.relaxed.gpu",  # no .sem / .scope: PTX's defaults
        "fence.acq_rel.sys",
        "fence.sc.gpu",  # membar.gl
        "ld.acquire.sys",
        "ld.volatile.sys",
        "st.release.sys",
    ]  # weak, non-coherent, shared-memory, param and proxy-fence operations are not ordering
    assert found[ptx.Access("atom.add", "relaxed", "sys")].startswith("@%p1 red.global.sys.relaxed.add.f32")


def test_table_entries() -> None:
    assert ptx.Access.of(("red.add", "release", "sys")) == ptx.Access("atom.add", "release", "sys")
    with pytest.raises(ValueError, match="bad ordering entry"):
        ptx.Access.of(("atom.add", "release", "system"))


@needs_triton
def test_every_kernel_of_a_module_needs_a_case() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: triton.jit makes interpreted functions")
    import triton

    mod = types.ModuleType("fake_kernels")
    mod.k = triton.jit(ptx._probe_kernel().fn)
    mod.ORDERING = {}
    mod.PTX_ARGS = {}
    with pytest.raises(ValueError, match=r"without a declared ordering: \['k'\]"):
        ptx.cases(mod)
    mod.PTX_HELPERS = ("k",)
    assert ptx.cases(mod) == []
    mod.ORDERING = {"k": []}
    with pytest.raises(ValueError, match="only in ORDERING"):
        ptx.cases(mod)


def test_vector_accesses_read_their_width_in_bytes() -> None:
    found = ptx.vector_accesses(PTX + """
    @%p2 ld.global.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd15 + 0 ];
    @%p3 red.global.sys.relaxed.add.v4.f32 [ %rd16 + 0 ], { %r9, %r10, %r11, %r12 };
    ld.global.v2.b64 { %rd1, %rd2 }, [ %rd3 + 0 ];
    st.global.v2.b32 [ %rd4 + 0 ], { %r1, %r2 };
    ld.shared.v4.b32 { %r5, %r6, %r7, %r8 }, [ %r9 + 0 ];
""")
    # 16-byte loads (v4.b32 and v2.b64 alike), the 16-byte vector reduction, an 8-byte store; shared memory is not
    # the transport's traffic
    assert sorted(found) == [("atom.add", 16), ("ld", 16), ("st", 8)]


def test_a_declared_vector_access_that_is_missing_fails_the_check() -> None:
    required = frozenset({("ld", 16)})
    assert ptx._compare("k", frozenset(), "\tld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];", required) == []
    problems = ptx._compare("k", frozenset(), "\tld.global.b32 %r1, [ %rd1 + 0 ];", required)
    assert problems == ["k: missing the 16-byte vector ld (VECTOR); vector accesses found: none"]
    with pytest.raises(ValueError, match="bad vector entry"):
        ptx._vector_of(("ld", "16"))
    mod = types.ModuleType("fake_kernels")
    mod.ORDERING, mod.VECTOR = {}, {"k:aligned": {90: [("ld", 16)]}}
    with pytest.raises(ValueError, match=r"VECTOR names cases ORDERING does not declare: \['k:aligned'\]"):
        ptx._vectors(mod)


# -- a release after other threads' stores needs a CTA barrier between them --------------------------------------
_STORES = """
    @%p2 st.global.b32 [ %rd26 + 0 ], { %r5 };
    @%p3 st.global.b32 [ %rd27 + 0 ], { %r6 };
"""
_COUNT = "    @%p10 atom.global.sys.acq_rel.add.u64 %rd58, [ %rd59 + 0 ], %rd60;\n"


def test_a_system_release_after_stores_needs_a_cta_barrier() -> None:
    assert ptx.unbarriered_releases(_STORES + _COUNT) == [
        "@%p10 atom.global.sys.acq_rel.add.u64 %rd58, [ %rd59 + 0 ], %rd60 after @%p2 st.global.b32 [ %rd26 + 0 ], "
        "{ %r5 }"]
    for barrier in ("\tbar.sync \t0;\n", "\tbarrier.sync 0;\n", "\tbarrier.cta.sync.aligned.all 0;\n"):
        assert ptx.unbarriered_releases(_STORES + barrier + _COUNT) == []
    # a relaxed red (the push's data) is a data write; a release store and a fence are releases
    assert ptx.unbarriered_releases("\t@%p3 red.global.sys.relaxed.add.f32 [%rd1], %f1;\n"
                                    "\t@%p4 st.release.sys.b32 [%rd2], 1;")
    assert ptx.unbarriered_releases("\t@%p3 st.global.b32 [%rd1], %r1;\n\t@%p4 fence.acq_rel.sys;\n")
    # a thread's own writes: a store under the release's predicate (one thread storing, then signalling), or a
    # release every thread makes after its own stores; an unpredicated store is every thread's
    assert ptx.unbarriered_releases("\t@%p1 st.global.b32 [%rd1], %r1;\n\t@%p1 atom.global.sys.release.add.u32 %r2, "
                                    "[%rd2], %r3;\n") == []
    assert ptx.unbarriered_releases(_STORES + "\tst.release.sys.global.b32 [%rd2], %r1;\n") == []
    assert ptx.unbarriered_releases("\tst.global.b32 [%rd1], %r1;\n" + _COUNT)
    # not publications to a peer: shared-memory stores, a gpu-scope release, a release before any store
    assert ptx.unbarriered_releases("\tst.shared.b64 [%r20], %rd58;\n" + _COUNT) == []
    assert ptx.unbarriered_releases(_STORES + "\tatom.global.gpu.acq_rel.add.f32 %f1, [%rd1], %f2;\n") == []
    assert ptx.unbarriered_releases(_COUNT + "\tbar.sync 0;\n" + _STORES) == []
    # an acq_rel count then the release signal with a barrier between: one thread's own synchronisation, no data
    assert ptx.unbarriered_releases(_STORES + "\tbar.sync 0;\n" + _COUNT + "\tbar.sync 0;\n"
                                    "\t@%p10 red.global.sys.release.add.u64 [ %rd70 + 0 ], %rd62;\n") == []


_PUT_SIGNAL = """
import json, re, sys
from odc_runtime.kernels import peer, ptx
case = next(c for c in ptx.cases(peer) if c.name == "put_signal_kernel")
text = ptx.compile_ptx(case.fn, case.signature, case.constexprs, 90)
count = next(i for i, line in enumerate(text.splitlines()) if ".acq_rel." in line)
# the mutant: every CTA barrier before the block's count deleted from the kernel's own PTX
lines = text.splitlines()
mutant = "\\n".join(line for i, line in enumerate(lines) if i > count or not re.search(r"\\bbar\\.sync", line))
print(json.dumps([ptx.unbarriered_releases(text), ptx.unbarriered_releases(mutant)]))
"""


@needs_triton
@pytest.mark.timeout(120)
def test_put_signal_orders_every_threads_stores_before_its_count() -> None:
    """The signalled put's PTX (this Triton, sm_90) has a CTA barrier between the data stores and the block's
    count; with the barriers before the count deleted, the check fails it (it can fail: Triton 3.9 also emits one
    of its own, 3.5-3.8 do not, and .ci/triton.sh runs this file under each)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _PUT_SIGNAL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real, mutant = json.loads(proc.stdout.strip().splitlines()[-1])
    assert real == []
    assert mutant and ".acq_rel." in mutant[0] and "st.global" in mutant[0]
