"""Triton fused-accumulation kernels against the torch references, on CPU through the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before the kernels are defined, and other tests in the same pytest process
may already have imported triton (or odc_runtime.kernels._triton) without it. So the kernel runs happen in one
child process (``python -c``) started with the variable set; it prints a JSON report, and the parametrised
tests below check one case each. The run takes a few seconds. Skipped when triton is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import odc_runtime.kernels as K

HAS_TRITON = importlib.util.find_spec("triton") is not None
SIZES = (1, 7, 1000, 4099)
DTYPES = ("float32", "bfloat16", "float16")
KS = tuple(range(1, 9))

_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import odc_runtime.kernels as K

    sizes, dtypes, ks = json.loads(sys.argv[1])
    out = {}
    g = torch.Generator().manual_seed(1234)

    def rnd(*shape, dtype):
        return (torch.randn(*shape, generator=g) * 3).to(getattr(torch, dtype))

    def err(a, b):
        return ((a - b).abs() / (1 + b.abs())).max().item()

    for dt in dtypes:
        for n in sizes:
            try:
                dst = rnd(n, dtype="float32"); src = rnd(n, dtype=dt); ref = dst.clone()
                K.accumulate_(dst, src, 0.37); K.accumulate_ref(ref, src, 0.37)
                zero = torch.zeros(n); K.accumulate_(zero, src, 1.0)
                out[f"acc-{dt}-{n}"] = {"err": err(dst, ref), "upcast_exact": bool(torch.equal(zero, src.float()))}
            except Exception as e:
                out[f"acc-{dt}-{n}"] = {"exc": repr(e)}
            for k in ks:
                try:
                    dst = rnd(n, dtype="float32"); slots = rnd(k, n, dtype=dt); ref = dst.clone()
                    ss, ss_ref = torch.full((1,), 2.0), torch.full((1,), 2.0)
                    K.accumulate_slots_(dst, slots, -1.5, sumsq_out=ss)
                    K.accumulate_slots_ref(ref, slots, -1.5, sumsq_out=ss_ref)
                    plain = rnd(n, dtype="float32"); plain_ref = plain.clone()
                    K.accumulate_slots_(plain, slots, 0.25); K.accumulate_slots_ref(plain_ref, slots, 0.25)
                    zero = torch.zeros(n); K.accumulate_slots_(zero, slots[:1], 1.0)
                    out[f"slots-{dt}-{n}-{k}"] = {
                        "err": max(err(dst, ref), err(plain, plain_ref)),
                        "sumsq_rel": abs(ss.item() - ss_ref.item()) / ss_ref.item(),
                        "upcast_exact": bool(torch.equal(zero, slots[0].float())),
                    }
                except Exception as e:
                    out[f"slots-{dt}-{n}-{k}"] = {"exc": repr(e)}
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install 'odc_runtime[triton]')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([SIZES, DTYPES, KS])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"kernel child failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


# fp32 accumulation; the kernel may fuse multiply-add where the reference rounds twice: a few ulps.
TOL = 1e-6


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_matches_reference(interpreted_results, dtype, n):
    r = interpreted_results[f"acc-{dtype}-{n}"]
    assert "exc" not in r, r.get("exc")
    assert r["err"] <= TOL
    assert r["upcast_exact"], "scale=1 into zeros must reproduce the upcast input exactly"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_slots_matches_reference(interpreted_results, dtype, n, k):
    r = interpreted_results[f"slots-{dtype}-{n}-{k}"]
    assert "exc" not in r, r.get("exc")
    assert r["err"] <= TOL * k
    assert r["sumsq_rel"] <= 1e-5  # block-wise partial sums vs torch's order
    assert r["upcast_exact"]


# --- no triton needed below --------------------------------------------------------------------------------


def test_cpu_without_interpreter_uses_reference():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process")
    dst = torch.zeros(5)
    K.accumulate_(dst, torch.ones(5, dtype=torch.bfloat16), 2.0)
    assert torch.equal(dst, torch.full((5,), 2.0))
    ss = torch.zeros(1)
    K.accumulate_slots_(dst, torch.ones(3, 5, dtype=torch.float16), 0.5, sumsq_out=ss)
    assert torch.equal(dst, torch.full((5,), 3.5)) and ss.item() == pytest.approx(5 * 3.5**2)


def test_argument_validation():
    with pytest.raises(TypeError):
        K.accumulate_(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3))
    with pytest.raises(ValueError):
        K.accumulate_(torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError):
        K.accumulate_(torch.zeros(3), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError):
        K.accumulate_slots_(torch.zeros(3), torch.zeros(2, 4))
    with pytest.raises(ValueError):
        K.accumulate_slots_(torch.zeros(3), torch.zeros(0, 3))
    with pytest.raises(ValueError):
        K.accumulate_slots_(torch.zeros(3), torch.zeros(2, 3), sumsq_out=torch.zeros(2))


def test_import_without_triton():
    """``import odc_runtime.kernels`` works when triton is missing; using the kernels then says what to install."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        import odc_runtime.kernels as K
        assert not K.triton_available() or True
        d = torch.zeros(4); K.accumulate_(d, torch.ones(4), 1.0)  # CPU, no interpreter: reference
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            K.accumulate_(d, torch.ones(4), 1.0)
        except ImportError as e:
            assert "triton" in str(e), e
            print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
