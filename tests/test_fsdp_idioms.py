"""Trainer idioms in FSDP2 ODC mode, on 4 CPU ranks (the README's table "trainer idioms in ODC mode").

Each idiom that works runs the same training loop three times: ODC mode and collective FSDP2 with equal micro-batch
counts (they must agree step for step), and ODC mode with counts ``[0, 1, 2, 3]`` (rotated by one rank every
minibatch, so a rank idle in one minibatch works in the next) against a single process that trains on every rank's
micro-batches (zero included). Slips that cannot work are refused at the call with a typed
error that says what to do; the model stays usable where the error says so. Scenarios: ``tests/_fsdp_idioms.py``.

Tolerances as in tests/test_fsdp.py: fp32 sums in a different order differ by a few ulps per step (1e-5 leaves a
wide margin; a scaling or layout mistake is off by 1e-2 or more). Adam divides by sqrt(v): a gradient component
near zero turns its few-ulp difference into up to ~1e-5 in the parameter, hence 1e-4 there (its gradient norm,
compared at 1e-5 relative, still catches any scaling mistake).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _fsdp_harness as h
import _fsdp_idioms as idioms

UNEQUAL = [0, 1, 2, 3]
TOL = 1e-5
ADAM_TOL = 1e-4
GROUPS = {  # idioms sharing one spawned job (each job well under the 120 s test timeout on a loaded 2-core host)
    "prefetching": ["explicit_prefetch", "prefetch_hooks", "no_reshard_after_backward"],
    "resharding": ["raf_false_forward_only", "checkpoint_wrapper"],
    "validation": ["eval_inside", "eval_outside"],
    "steps": ["grad_accumulation", "meta_init_adam_clip"],
}


def test_groups_cover_every_idiom():
    assert sorted(n for names in GROUPS.values() for n in names) == sorted(idioms.IDIOMS)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_idioms_match_collective_and_reference(group):
    names = GROUPS[group]
    results = h.run(idioms.scenario_idioms, 4, names, 2, UNEQUAL, timeout=110)
    for rank, res in enumerate(results):
        for name in names:
            opts = idioms.IDIOMS[name]
            tol = ADAM_TOL if opts.get("adam") else TOL
            for against, d in res[name].items():
                where = f"{name} vs {against}, rank {rank}: {d}"
                assert d["params"] < tol, where
                assert d["loss"] < TOL, where
                assert d["norm"] < TOL, where
                assert d["eval"] < TOL, where
            if opts.get("clip"):
                assert res[name]["vs_reference"]["n_norm"] == 2
            if opts.get("eval_inside"):  # rank r validated r batches inside each of the 2 minibatches
                assert res[name]["vs_reference"]["n_eval"] == 2 * rank
            if opts.get("forward_only"):  # only a rank without micro-batches runs a forward-only pass: counts
                # [0, 1, 2, 3] then [3, 0, 1, 2] (rotated every minibatch), so rank 0 once, then rank 1 once
                assert res[name]["vs_reference"]["n_eval"] == (1 if rank in (0, 1) else 0)


def test_dcp_save_load_between_minibatches(tmp_path):
    results = h.run(idioms.scenario_dcp, 4, str(tmp_path / "ckpt"), UNEQUAL, timeout=110)
    for res in results:
        assert res["moved"] > 1e-3, res  # training changed the parameters
        assert res["again"] < TOL, res  # resumed from the DCP checkpoint: the same two steps again
        assert res["vs_reference"] < TOL, res


@pytest.mark.timeout(300)  # a cold inductor compile of one block, forward and backward: ~1 min on 2 idle cores
def test_torch_compile_per_block():
    # Counts [0, 2], then [2, 0]: each rank compiles inside a minibatch while the other waits in its sync, so the
    # ODC timeout must cover a cold compile (110 s measured at load ~20), not the harness's 60 s.
    env_key = "TORCHINDUCTOR_COMPILE_THREADS"
    old = os.environ.get(env_key)
    os.environ[env_key] = "1"  # the spawned ranks inherit it: no compile worker pool per rank
    try:
        results = h.run(idioms.scenario_compile, 2, 2, [0, 2], 240, timeout=290, init_odc=False)
    finally:
        if old is None:
            os.environ.pop(env_key)
        else:
            os.environ[env_key] = old
    for d in results:
        assert d["params"] < TOL and d["loss"] < TOL, d


def test_slips_are_refused_where_they_happen():
    results = h.run(idioms.scenario_slips, 4, UNEQUAL, timeout=110)
    for rank, res in enumerate(results):
        assert "SGD.step() inside a minibatch" in res["step_inside"], res["step_inside"]
        assert res["step_inside_unchanged"]
        assert "load_state_dict() inside a minibatch" in res["load_inside"], res["load_inside"]
        if rank == 1:  # the rank that edited a parameter is told what changed
            assert "3 of 120 elements of 'head.weight' differ" in res["edit_inside"], res["edit_inside"]
        else:
            assert "another rank changed its parameters" in res["edit_inside"], res["edit_inside"]
        assert res["edit_next_exact"] < TOL
        assert "divide_factor=...) differs between ranks (from 1.0 to 4.0" in res["local_factor"], res["local_factor"]
        assert res["local_factor_no_grads"]
        assert res["local_factor_next_exact"] < TOL
        assert "by divide_factor 1e-45 overflows torch.float32" in res["tiny_factor"], res["tiny_factor"]
        assert res["np_float32_diff"] < 1e-6
        assert "a forward with gradients enabled ran outside a minibatch" in res["forward_outside"], res
        assert "odc_runtime.fsdp.minibatch" in res["forward_outside"]
        assert res["forward_next_exact"] < TOL
        assert "backward() ran outside a minibatch" in res["backward_outside"], res["backward_outside"]
        if "backward_next_exact" in res:  # torch >= 2.13 (reset_iter_state): ODC cleans up by itself
            assert "ODC resets it" in res["backward_outside"]
            assert res["backward_next_exact"] < TOL
        assert res["nan"] == "NO ERROR"  # NaN parameters are not "changed parameters"
        assert res["nan_loss"]


def test_training_forward_outside_a_minibatch_is_refused_at_once_on_every_rank():
    """Unequal counts (rank r runs r micro-batches) without the minibatch: before, ranks 1-3 hung in FSDP's
    all-gather (the harness's timeout); now each is refused at its first forward, naming the fix."""
    results = h.run(idioms.scenario_forward_outside, 4, timeout=120)
    for rank, res in enumerate(results):
        assert len(res["errors"]) == rank, (rank, res)
        for message in res["errors"]:
            assert "a forward with gradients enabled ran outside a minibatch" in message, message
            assert "`with odc_runtime.fsdp.minibatch(model):`" in message and "torch.no_grad()" in message, message
        assert res["finite"] and res["nonzero"], res  # the minibatch after it trains


@pytest.mark.parametrize("backend", ["host", "symm-cpu"])
def test_a_lone_validation_forward_is_refused_at_once_on_both_ranks(backend):
    """Issue 53: rank 0 waited ODC_TIMEOUT (300 s by default) and rank 1 then got gloo's raw RuntimeError. Host: both
    raise OdcRoundMismatchError at once and the runtime stays usable. symm-cpu: rank 0's sync is stream-ordered and
    its mismatch fails the runtime there (OdcCrossedCollectivesError), also at once and naming the forward."""
    if backend == "host":
        results = h.run(idioms.scenario_lone_eval, 2, timeout=100, init_odc=False)
    else:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        from test_symm_cpu import run_on_symm

        results = run_on_symm(idioms.scenario_lone_eval, 2, False, timeout=200)
    starting, evaluating = results
    assert evaluating["error"][0] == "OdcRoundMismatchError", results
    want = "OdcRoundMismatchError" if backend == "host" else "OdcCrossedCollectivesError"
    assert starting["error"][0] == want, results
    assert "rank 1 is in 'fsdp forward outside a minibatch (every rank must run it)'" in starting["error"][1], results
    message = evaluating["error"][1]
    assert "run evaluation forwards outside a minibatch on every rank together" in message, message
    assert "`with odc_runtime.fsdp.minibatch(model):`" in message and "no torch.distributed collective" in message
    for res in results:
        assert res["elapsed"] < 30, res  # at once: not after the 60 s timeout
        assert backend != "host" or res["diff"] < TOL, res  # then every rank evaluates together, exactly


def _max_diff(a: list, b: list) -> float:
    import torch

    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b, strict=True))


def test_zero_grad_and_clipping_inside_a_minibatch_match_fsdp2_or_are_refused():
    # Reference: collective FSDP2 with the same micro-batches. zero_grad() before the minibatch's first backward drops
    # the earlier gradients in both. After a backward FSDP2 drops the micro-batches so far, which ODC cannot (they
    # reach the owners one-sidedly): refused on every rank at end_minibatch, the model stays usable. Reading or
    # changing .grad in place inside the minibatch (clip_grad_norm_, zero_grad(set_to_none=False)) raises at the call;
    # a .grad kept from inside the minibatch and used after it raises saying so.
    kinds = ["zero_grad_first", "zero_grad_between", "zero_grad_keep", "clip_between", "grad_kept"]
    results = h.run(idioms.scenario_grad_slips, 2, kinds, timeout=110)
    for res in results:
        first = res["zero_grad_first"]
        assert first["odc"]["error"] == first["fsdp2"]["error"] == "NO ERROR", first
        assert _max_diff(first["odc"]["grads"], first["fsdp2"]["grads"]) < TOL
        between = res["zero_grad_between"]
        assert "was reset (optimizer.zero_grad() or model.zero_grad()) inside the minibatch after a backward" in (
            between["odc"]["error"]), between["odc"]["error"]
        assert between["fsdp2"]["error"] == "NO ERROR"
        # FSDP2 dropped micro-batch 0: keeping it (what ODC did before) is a different gradient
        assert _max_diff(between["fsdp2"]["grads"], first["fsdp2"]["grads"]) > 1e-3
        assert _max_diff(between["odc"]["next"], between["fsdp2"]["next"]) < TOL
        for kind in ("zero_grad_keep", "clip_between"):
            message = res[kind]["odc"]["error"]
            assert "gradients (.grad) of an ODC-enabled model were used inside a minibatch (" in message, message
        # a placeholder kept from inside the minibatch and used after it: the error says so (not "inside")
        kept = res["grad_kept"]
        assert kept["fsdp2"]["error"] == "NO ERROR", kept
        message = kept["odc"]["error"]
        assert "of 'head.weight' taken from .grad inside a minibatch was used after the minibatch ended" in message, (
            message)
