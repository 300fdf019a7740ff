"""FSDP2 in ODC mode (odc_runtime.fsdp): equivalence with a single-process reference and with stock FSDP2.

Runs unchanged on every supported torch (2.9 .. 2.14; .ci/compat.sh runs it on the oldest and the newest besides
the main CI torch): where a torch lacks a capability ODC provides itself (unused-parameter tracking before 2.13) the
same scenarios exercise ODC's replacement, and ``test_private_fsdp_surface_of_this_torch`` checks the FSDP2
internals ODC reads on the torch at hand.

Scenarios live in ``tests/_fsdp_harness.py`` and run on a tiny transformer whose parameter shapes do not divide by
the world size. To keep the file fast on a 2-core machine, the scenarios are batched into two spawned jobs (3 ranks
and 2 ranks: gloo, host transport, one torch thread each), run once per module by fixtures; each test checks the
results of its scenario.

Tolerances. fp32: ODC and the references compute the same sums in a different order (per micro-batch vs. one fp32
accumulator, pushes landing in any order), so parameters differ by a few fp32 ulps per step (|p| < ~2, eps = 1.2e-7);
1e-5 leaves a wide margin while any scaling or layout mistake gives differences of order 1e-2..1. bf16: the
reference reproduces FSDP's bf16 semantics (fp32 master weights cast to bf16 for compute, bf16 gradients summed in
fp32); the remaining fp32 reordering can flip the bf16 rounding of a weight (relative 2^-8 = 3.9e-3 of that weight)
in a later step, so after 3 SGD steps we allow 2e-3 absolute (a wrong scale would be off by 1e-2 or more).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _fsdp_harness as h

FP32_TOL = 1e-5
BF16_TOL = 2e-3
FP16_TOL = 5e-4  # fp16 (eps 9.8e-4): FSDP reduces in fp16 after pre-dividing, ODC sums the fp16 rows in fp32
SUITE_TIMEOUT = 240  # the first test of a suite also pays for its fixture (spawning and running every scenario)

PLAN3 = [
    # rank r runs 1 + r micro-batches per minibatch; SGD momentum, 3 steps, fp32
    ("unequal", "scenario_vs_reference", (3, [1, 2, 3], {})),
    # rank 0 runs no micro-batch at all; clip_grad_norm_ on the DTensor grads
    ("zero_clip", "scenario_vs_reference", (3, [0, 2, 1], {"clip": 0.5})),
    ("state_dict", "scenario_state_dict", ()),
    # frozen parameters (requires_grad=False): the gradient rows are shorter than the parameter rows
    ("frozen", "scenario_vs_reference", (2, [2, 0, 1], {"frozen": ["pos.weight", "blocks.1.up.bias"]})),
    # layers used by some micro-batches only: FSDP leaves their gradients out of the reduce-scatter input
    ("unused", "scenario_vs_reference", (2, [2, 1, 3], {"branch": True})),
    # every rank its own virtual node: every fetch and push of another rank's shard takes the hierarchical path
    ("nodes", "scenario_nodes", (1, 3, [2, 0, 1], {})),
]
PLAN2 = [
    ("bf16_ref", "scenario_vs_reference", (3, [1, 3], {"bf16": True, "reshard_after_forward": False})),
    ("fsdp_fp32", "scenario_vs_fsdp", (3, 2, {})),
    ("fsdp_no_raf", "scenario_vs_fsdp", (3, 2, {"reshard_after_forward": False})),
    ("fsdp_bf16", "scenario_vs_fsdp", (3, 2, {"bf16": True})),
    ("fsdp_fp16", "scenario_vs_fsdp", (2, 2, {"fp16": True})),
    ("disable", "scenario_disable", ()),
    ("eval", "scenario_eval_outside", ()),
    ("misuse", "scenario_misuse", ()),
    # the same with ODC's own unused-parameter tracking forced (what torch < 2.13 always uses)
    ("unused_tracked", "scenario_vs_reference", (2, [3, 1], {"branch": True, "track_unused": True})),
    ("compat", "scenario_compat", ()),
    ("refusals", "scenario_refusals", ()),  # finalizes and re-initialises ODC: keep it last
]


@pytest.fixture(scope="module")
def suite3():
    return h.run(h.run_suite, 3, PLAN3, timeout=SUITE_TIMEOUT - 20)


@pytest.fixture(scope="module")
def suite2():
    return h.run(h.run_suite, 2, PLAN2, timeout=SUITE_TIMEOUT - 20)


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_unequal_microbatches_match_single_process_reference(suite3):
    h.check_vs_reference(h.results(suite3, "unequal"), FP32_TOL)


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_hierarchical_mode_matches_single_process_reference(suite3):
    h.check_vs_reference(h.results(suite3, "nodes"), FP32_TOL)


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_zero_microbatch_rank_and_clip_grad_norm(suite3):
    results = h.results(suite3, "zero_clip")
    h.check_vs_reference(results, FP32_TOL)
    for res in results:
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
        assert all(n > 0.5 for n in res["ref_norm"])  # clipping was active


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_frozen_parameters(suite3):
    h.check_vs_reference(h.results(suite3, "frozen"), FP32_TOL)


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_unused_parameters_keep_the_reduce_scatter_layout(suite3):
    results = h.results(suite3, "unused")
    h.check_vs_reference(results, FP32_TOL)
    assert sum(res["partial"] for res in results) > 0  # some backward really left parameters without a gradient
    for res in results:  # torch's own hook where it exists (>= 2.13), ODC's tracking before
        assert res["tracking"] is not res["has_hook"]


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_unused_parameters_with_odc_tracking(suite2):
    results = h.results(suite2, "unused_tracked")
    h.check_vs_reference(results, FP32_TOL)
    assert sum(res["partial"] for res in results) > 0
    assert all(res["tracking"] for res in results)


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_private_fsdp_surface_of_this_torch(suite2):
    """Fails loudly when a torch release changes an FSDP2 internal that odc_runtime.fsdp._compat reads."""
    for res in h.results(suite2, "compat"):
        assert res["problems"] == [], f"torch {res['torch']}: {res['problems']}"
        for name, (detected, by_table) in res["table"].items():
            assert detected == by_table, (
                f"torch {res['torch']}: capability {name} detected={detected}, table says "
                f"{by_table}; update odc_runtime.fsdp._compat.CAPABILITIES"
            )


# ODC with unequal micro-batch counts against stock FSDP2 running the same minibatches with equal counts
UNEQUAL2 = [1, 3]
GROUPED = {  # torchtitan's llama3 shards its final norm and output head together: fully_shard([norm, output])
    "grouped": {"grouped": True},
    "grouped_tied": {"grouped": True, "tied": True},  # tied weights: fully_shard([tok_embeddings, norm, output])
    # the head run per chunk of the sequence with its gradient sync off but for the last chunk (torchtitan's chunked
    # loss), fp32: torch's reduce-scatter of unused parameters stays in use
    "grouped_chunked": {"grouped": True, "chunks": 3},
}
NO_PARTIAL_GROUPS = "this torch's FSDP2 cannot run the head of a grouped fully_shard alone (the chunked loss)"


def runnable(variants: dict[str, dict]) -> dict[str, dict]:
    """The variants this torch runs: the chunked loss on a grouped head needs FSDP2's partial-group forward."""
    return {key: opts for key, opts in variants.items() if not opts.get("chunks") or h.partial_group_forward()}


@pytest.mark.timeout(120)
def test_grouped_fully_shard_matches_stock_fsdp():
    """One FSDP parameter group for several modules (``fully_shard([ln_f, head])``, and ``[emb, ln_f, head]`` with
    the head tied to the embedding), 2 ranks with 1 and 3 micro-batches, ``clip_grad_norm_`` after the minibatch.
    Before, ``enable`` built an ODC unit per module of the group: the group's gradient placeholders were never
    released and the clip raised OdcUsageError ("used inside a minibatch")."""
    variants = runnable(GROUPED)
    plan = [(key, "scenario_unequal_vs_fsdp", (2, UNEQUAL2, opts)) for key, opts in variants.items()]
    suite = h.run(h.run_suite, 2, plan, timeout=100)
    for key in variants:
        h.check_vs_stock(h.results(suite, key), FP32_TOL)


CHUNKED_BF16 = {  # torchtitan's default: bf16 compute, fp32 reduction, the chunked loss
    "bf16_chunked": {"grouped": True, "bf16": True, "chunks": 3},
    "bf16_chunked_tied": {"grouped": True, "tied": True, "bf16": True, "chunks": 3},
}


@pytest.mark.timeout(120)
def test_bf16_chunked_loss_toggling_gradient_sync_matches_stock_fsdp():
    """``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` with the head run per chunk and its gradient
    sync off but for the last chunk, as torchtitan's ``ChunkedLossWrapper`` does; 2 ranks with 1 and 3
    micro-batches, clipping after the minibatch. Before, torch's zeros for the parameters a backward leaves
    unused (``set_reduce_scatter_unused_params``, bf16) met the head's gradient FSDP accumulated in fp32 with sync
    off, and FSDP asserted "expects uniform gradient dtype"."""
    if not h.partial_group_forward():
        pytest.skip(NO_PARTIAL_GROUPS)
    plan = [(key, "scenario_unequal_vs_fsdp", (2, UNEQUAL2, opts)) for key, opts in CHUNKED_BF16.items()]
    suite = h.run(h.run_suite, 2, plan, timeout=100)
    for key in CHUNKED_BF16:
        h.check_vs_stock(h.results(suite, key), BF16_TOL, rel=1e-3)


@pytest.mark.timeout(120)
def test_gradient_sync_left_off_at_end_of_minibatch_is_refused_on_every_rank():
    """Gradients FSDP accumulated with sync off and never reduce-scattered would be lost to ODC: refused at
    ``end_minibatch`` on every rank (sync still off, or back on only after the last backward; bf16 and fp32 hold
    them in different places), and the next minibatch, with sync on, matches stock FSDP2. Before, the minibatch
    ended without them, silently."""
    plan = [
        ("still_off", "scenario_sync_left_off", ("still_off", {"bf16": True})),
        ("on_after", "scenario_sync_left_off", ("on_after", {})),
    ]
    suite = h.run(h.run_suite, 2, plan, timeout=100)
    for key, _, _ in plan:
        for res in h.results(suite, key):
            assert "the gradients of '[ln_f, head]' were left in FSDP, not reduce-scattered" in res["error"], res
            assert ("and is still off" in res["error"]) == (key == "still_off"), res["error"]
            assert res["next_diff"] < FP32_TOL, res


@pytest.mark.timeout(120)
def test_single_rank_is_refused():
    [msg] = h.run(h.scenario_single_rank, 1, timeout=100)
    assert "on a single rank" in msg, msg


def test_torch_without_custom_comm_hooks_is_refused_by_name(monkeypatch):
    """A torch lacking FSDP2's custom comm hooks (e.g. 2.8) gets an error naming the version, the capability and
    the oldest torch that has it; simulated by removing the method from this torch's FSDPModule."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    import odc_runtime.fsdp as ofsdp
    from odc_runtime.errors import OdcUsageError
    from odc_runtime.fsdp import _compat

    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    _compat._detect.cache_clear()
    try:
        with pytest.raises(OdcUsageError) as info:
            ofsdp.enable(torch.nn.Linear(2, 2))
        assert not ofsdp.has_capability("custom_comm_hooks")
    finally:
        monkeypatch.undo()
        _compat._detect.cache_clear()
    msg = str(info.value)
    assert f"torch {torch.__version__} lacks" in msg and "set_custom_reduce_scatter is missing" in msg, msg
    assert "available from torch 2.9" in msg, msg
    assert ofsdp.has_capability("custom_comm_hooks")


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_state_dict_round_trip(suite3):
    for res in h.results(suite3, "state_dict"):
        assert res["moved"] > 1e-3  # training changed the parameters
        assert res["after_load"] == 0.0  # load_state_dict restored them
        assert res["again"] < FP32_TOL  # ... and the next minibatch used the loaded (republished) parameters
        assert res["fresh"] < FP32_TOL  # a differently initialised model loaded from the checkpoint agrees too


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_bf16_mixed_precision_matches_bf16_reference(suite2):
    h.check_vs_reference(h.results(suite2, "bf16_ref"), BF16_TOL)


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("key", ["fsdp_fp32", "fsdp_no_raf", "fsdp_bf16", "fsdp_fp16"])
def test_equal_counts_match_stock_fsdp_step_by_step(suite2, key):
    tol = {"fsdp_bf16": BF16_TOL, "fsdp_fp16": FP16_TOL}.get(key, FP32_TOL)
    for res in h.results(suite2, key):
        assert max(res["grad_diff"]) < tol, res
        assert max(res["diff"]) < tol, res


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_disable_returns_to_plain_fsdp(suite2):
    for res in h.results(suite2, "disable"):
        assert res["restored"]
        assert res["diff"] < FP32_TOL
        assert not res["enabled"]
        assert res["odc_alive"]


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_eval_forward_outside_minibatch_and_empty_minibatch(suite2):
    for res in h.results(suite2, "eval"):
        assert res["eval"] < 1e-5
        assert res["zero_grads"]


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_misuse_raises_clear_errors(suite2):
    for msgs in h.results(suite2, "misuse"):
        assert "call odc_runtime.fsdp.enable(model)" in msgs["without_enable"]
        assert "no FSDP module found" in msgs["not_fsdp"]
        assert "called twice" in msgs["enable_twice"]
        assert "already belongs to an ODC-enabled model" in msgs["enable_block"]
        assert "minibatch already open" in msgs["nested"]
        assert "previous minibatch failed" in msgs["after_failure"]
        assert "without begin_minibatch" in msgs["end_without_begin"]
        assert "a forward with gradients enabled ran outside a minibatch" in msgs["forward_outside"]
        assert "odc_runtime.fsdp.minibatch" in msgs["forward_outside"]
        assert "backward() ran outside a minibatch" in msgs["backward_outside"]
        assert "divide_factor must be a positive" in msgs["bad_divide_factor"]
        assert "without ODC" in msgs["disable_twice"]
        assert "must not change inside a minibatch" in msgs["modified_inside"]
        assert msgs["usable_after"] == "True"


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_enable_refuses_without_odc_init_and_unsupported_configs(suite2):
    for msgs in h.results(suite2, "refusals"):
        for key, msg in msgs.items():
            assert msg.startswith("OK"), f"{key}: {msg}"
