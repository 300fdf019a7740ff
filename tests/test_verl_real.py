"""veRL's own actor path, stock versus ODC mode, on 2 CPU ranks (needs veRL: ``bash .ci/verl.sh`` runs this file).

``tests/_verl_actor.py`` runs, per rank and per :class:`RunSpec`, ``ActorRolloutRefWorker(role="actor")
.init_model()`` (or the recipe's ``examples/verl_odc.py`` subclass), ``compute_log_prob`` and ``update_actor`` with
veRL's hydra ``ppo_trainer`` config, a tiny random Qwen2 saved locally and 2 PPO mini-batches per step; CPU stand-ins
for veRL's platform and engine registries come in through veRL's own hooks (``tests/_verl_cpu.py``). All runs share
one pair of processes (veRL imports once). Checked:

- stock veRL plans equal counts on both ranks; ODC plans each rank's own (rank 0 holds the long samples): counts
  differ, and ``Metric.aggregate_dp`` reduces them (stock veRL raises ``All Metric instances must have the same
  number of values for dp aggregation`` there);
- fp32 parameters after 2 steps: ODC versus stock within the noise floor measured here (stock versus stock with a
  different token budget, i.e. other micro-batches); per-mini-batch ``grad_norm`` and ``loss`` likewise (Adam hides
  a gradient scale error from the parameters, not from these);
- one micro-batch per pass on both (a budget above each rank's share): bitwise equal parameters and metrics;
- ODC checkpoint round trip: save, train a step, load: parameters and log-probs back bitwise;
- veRL's ``full_determinism`` on and ``ODC_DETERMINISTIC=1`` in the workers' environment: two runs whose pushes are
  forced into opposite arrival orders (each PPO mini-batch: all of rank 1's pushes land before rank 0's, then the
  reverse) give bitwise equal parameters and metrics, within stock's noise floor. This pair does not show teeth:
  the same pair in ODC's default mode also came out bitwise equal here (2 ranks, each owner adds 3 pushes per
  mini-batch); ``tests/test_deterministic.py`` shows the default mode differing under forced orders.

veRL is heavy (ray, transformers, hydra, ...), so it lives in a cached venv (``.ci/verl.sh``); elsewhere this file
skips, unless ``ODC_REQUIRE_VERL=1`` (set by ``.ci/verl.sh``) makes that a failure.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_ranks

from odc_runtime import config

if importlib.util.find_spec("verl") is None or importlib.util.find_spec("hydra") is None:
    reason = "veRL not installed (bash .ci/verl.sh runs this file in its cached venv)"
    if config.require_verl():
        pytest.fail(f"{reason}, and ODC_REQUIRE_VERL=1", pytrace=False)
    pytest.skip(reason, allow_module_level=True)

import numpy as np
from _verl_actor import RunSpec, build_model

# veRL's hooks for the CPU stand-ins (tests/_verl_cpu.py), set in the rank processes before they import veRL.
ENV = {
    "VERL_USE_EXTERNAL_MODULES": "_verl_cpu",
    "VERL_PLATFORM": "odc_cpu",
    "VERL_ENGINE_DEVICE": "cuda",
    "VERL_USE_EXTERNAL_PLUGINS": "none",
}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _series(result: dict, key: str) -> np.ndarray:
    """One value per PPO mini-batch over all steps (update_actor's metrics are reported on rank 0)."""
    return np.array([v for step in result["metrics"] for v in step[key]], dtype=np.float64)


@pytest.mark.timeout(600)
def test_verl_actor_in_odc_mode_matches_stock(tmp_path):
    import _verl_actor

    model = str(tmp_path / "qwen2")
    build_model(model)
    for r in (0, 1):
        (tmp_path / f"order{r}").mkdir()
    runs = {
        "stock": RunSpec(odc=False, model_dir=model),
        "stock_other_micro_batches": RunSpec(odc=False, model_dir=model, max_tokens=32),
        "odc": RunSpec(odc=True, model_dir=model, ckpt_dir=str(tmp_path / "ckpt")),
        "stock_one_micro_batch": RunSpec(odc=False, model_dir=model, max_tokens=1000),
        "odc_one_micro_batch": RunSpec(odc=True, model_dir=model, max_tokens=1000),
        # last: full_determinism turns on torch.use_deterministic_algorithms for the rest of the process
        **{
            f"det_rank{r}_pushes_last": RunSpec(
                odc=True, model_dir=model, full_determinism=True, odc_deterministic=True, pushes_last=r,
                order_dir=str(tmp_path / f"order{r}"),
            )
            for r in (0, 1)
        },
    }
    per_rank = run_ranks(_verl_actor.run, 2, list(runs.values()), timeout=560, env=ENV)
    res = {name: [rank[i] for rank in per_rank] for i, name in enumerate(runs)}  # name -> per-rank results

    # micro-batch counts per pass (compute_log_prob, then one per PPO mini-batch, per step)
    for name in ("stock", "stock_other_micro_batches", "stock_one_micro_batch"):
        assert res[name][0]["counts"] == res[name][1]["counts"], (name, res[name])
    odc_counts = [r["counts"] for r in res["odc"]]
    assert odc_counts[0] != odc_counts[1], odc_counts
    assert all(a >= b for a, b in zip(*odc_counts, strict=True)), odc_counts  # rank 0 has the long samples
    assert res["stock"][0]["counts"] != res["stock_other_micro_batches"][0]["counts"]
    assert all(c == 1 for r in res["odc_one_micro_batch"] for c in r["counts"])

    # every rank ends with the same full parameters
    for runs_ in res.values():
        assert _max_diff(runs_[0]["params"], runs_[1]["params"]) == 0.0

    stock, other, odc = (res[n][0] for n in ("stock", "stock_other_micro_batches", "odc"))
    floor = _max_diff(stock["params"], other["params"])
    assert 0 < floor < 1e-4, floor
    assert _max_diff(stock["params"], odc["params"]) <= 1.5 * floor, (floor, _max_diff(stock["params"], odc["params"]))
    for key in ("grad_norm", "loss", "actor/pg_loss"):
        metric_floor = np.abs(_series(stock, key) - _series(other, key)).max()
        odc_err = np.abs(_series(stock, key) - _series(odc, key)).max()
        assert odc_err <= 2 * metric_floor + 1e-7, (key, odc_err, metric_floor)

    one, odc_one = res["stock_one_micro_batch"][0], res["odc_one_micro_batch"][0]
    assert _max_diff(one["params"], odc_one["params"]) == 0.0
    for key in ("grad_norm", "loss", "actor/pg_loss", "actor/ppo_kl"):
        assert np.array_equal(_series(one, key), _series(odc_one, key)), key

    for r in res["odc"]:
        assert r["ckpt_params_equal"] and r["ckpt_logp_equal"], r

    # ODC's figures reach update_actor's metrics, one value per PPO mini-batch, reduced by veRL over the ranks; the
    # micro-batch counts are those the planner made (per step: the log-prob pass, then one per mini-batch)
    n = len(_series(odc, "loss"))
    for name in ("odc/sync_wait_s/max", "odc/sync_wait_s/mean", "odc/micro_batches/min", "odc/micro_batches/max",
                 "odc/push_bytes"):
        assert len(_series(odc, name)) == n, name
    assert not any(k.startswith("odc/") for step in stock["metrics"] for k in step)
    per_pass = [[c for i, c in enumerate(r["counts"]) if i % 3] for r in res["odc"]]  # drop the log-prob passes
    assert list(_series(odc, "odc/micro_batches/min")) == [min(c) for c in zip(*per_pass, strict=True)][:n]
    assert list(_series(odc, "odc/micro_batches/max")) == [max(c) for c in zip(*per_pass, strict=True)][:n]
    assert (_series(odc, "odc/sync_wait_s/max") >= _series(odc, "odc/sync_wait_s/mean")).all()
    assert (_series(odc, "odc/push_bytes") > 0).all()

    # full_determinism + ODC's deterministic mode: the same bits whatever the arrival order
    det0, det1 = res["det_rank0_pushes_last"][0], res["det_rank1_pushes_last"][0]
    assert det0["counts"] == odc["counts"][: len(det0["counts"])]  # the unequal micro-batches of the ODC run
    assert _max_diff(det0["params"], det1["params"]) == 0.0
    for key in ("grad_norm", "loss", "actor/pg_loss", "actor/ppo_kl"):
        assert np.array_equal(_series(det0, key), _series(det1, key)), key
    # deterministic mode's exact sums rounded once stay within the noise floor of stock's fp32 sums
    det_err = _max_diff(stock["params"], det0["params"])
    assert det_err <= 1.5 * floor, (floor, det_err)
