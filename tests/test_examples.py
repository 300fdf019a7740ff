"""The examples the README points to run as documented and train correctly (small sizes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], timeout: float = 150, **extra_env: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra_env)
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.timeout(180)
def test_custom_trainer_matches_single_process() -> None:
    _check_custom_trainer(_run(["examples/custom_trainer.py", "--nproc", "2", "--steps", "3", "--samples", "12"]))


def _check_custom_trainer(out: str) -> None:
    steps = re.findall(r"loss odc (\S+)\s+single-process (\S+)", out)
    assert len(steps) == 3 and all(abs(float(a) - float(b)) < 1e-5 for a, b in steps), out
    assert "parameters match the single-process reference" in out


@pytest.mark.timeout(180)
def test_custom_trainer_on_virtual_nodes_matches_single_process() -> None:
    # every rank its own node: the example's sync(parameters=False) / sync(gradients=False) move exactly what changed
    args = ["examples/custom_trainer.py", "--nproc", "2", "--steps", "3", "--samples", "12"]
    _check_custom_trainer(_run(args, ODC_NODE_SIZE="1"))


@pytest.mark.timeout(180)
def test_custom_trainer_with_another_policy_matches_single_process() -> None:
    # verl_lb_micro: equal counts padded with empty micro-batches, which the trainer skips (nothing to push)
    args = ["examples/custom_trainer.py", "--nproc", "2", "--steps", "3", "--samples", "12",
            "--policy", "verl_lb_micro"]
    _check_custom_trainer(_run(args))


@pytest.mark.timeout(240)
def test_sft_example_same_losses_in_both_modes() -> None:
    _sft_same_losses_in_both_modes(2)


def _sft_same_losses_in_both_modes(nproc: int, *extra: str, expect: str = "") -> None:
    """examples/sft.py in each mode, collective launched by torchrun and odc spawning its own ranks (plain
    ``python examples/sft.py``): two steps each, the same losses; ``expect`` must appear in both outputs."""
    launch = {
        "collective": ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "examples/sft.py"],
        "odc": ["examples/sft.py", "--nproc", str(nproc)],
    }
    losses = {}
    for comm in ("collective", "odc"):
        out = _run([*launch[comm], *extra, "--comm", comm, "--steps", "2", "--samples", "8"])
        assert expect in out, out
        losses[comm] = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
        assert len(losses[comm]) == 2, out
    assert losses["collective"] == pytest.approx(losses["odc"], abs=1e-4)


@pytest.mark.timeout(300)
def test_sft_example_explicit_prefetch_with_a_rank_without_micro_batches() -> None:
    # --prefetch: model.unshard() on every rank at the start of every minibatch. One sample on 2 ranks:
    # rank 1 runs no micro-batch in ODC mode (it unshards, never runs a forward) and must still clip and step.
    small = ["--steps", "2", "--samples", "1", "--layers", "2", "--dim", "64", "--prefetch", "--nproc", "2"]
    logs = {comm: _run(["examples/sft.py", "--comm", comm, *small]) for comm in ("collective", "odc")}
    assert "micro-batches/rank [1, 0]" in logs["odc"], logs["odc"]
    for key in ("loss", "grad_norm"):
        values = {comm: [float(v) for v in re.findall(rf"{key} (\d+\.\d+)", out)] for comm, out in logs.items()}
        assert len(values["odc"]) == 2, logs["odc"]
        assert values["collective"] == pytest.approx(values["odc"], abs=1e-4)


@pytest.mark.timeout(300)
def test_sft_example_hsdp_same_losses_in_both_modes() -> None:
    # --mesh 2x2: 2 replicas x 2-rank shard groups on 4 ranks; the plans give unequal micro-batch counts in ODC mode
    _sft_same_losses_in_both_modes(4, "--mesh", "2x2", expect="mesh=2x2")


@pytest.mark.timeout(300)
def test_grpo_example_matches_single_process_replay() -> None:
    pytest.importorskip("transformers", reason="examples/grpo.py needs the hf extra")
    out = _run(["examples/grpo.py", "--quick", "--nproc", "2"], timeout=280)
    for mode in ("odc + lb_mini", "collective + lb_micro"):
        assert len(re.findall(rf"step\s+\d+\s+{re.escape(mode)}\s+loss", out)) == 2, out
    checks = re.findall(r"^replay check (\w+)\s*: max \|loss - replay\| .*: OK$", out, re.M)
    assert sorted(checks) == ["collective", "odc"], out
    assert "both modes match the single-process replay" in out
    # the same losses in both modes, step by step (same samples, different plans and communication)
    odc_losses = [float(v) for v in re.findall(r"odc \+ lb_mini\s+loss (\S+)", out)]
    coll_losses = [float(v) for v in re.findall(r"collective \+ lb_micro\s+loss (\S+)", out)]
    assert odc_losses == pytest.approx(coll_losses, abs=1e-5), out


@pytest.mark.timeout(300)
def test_grpo_example_with_other_policies_matches_single_process_replay() -> None:
    pytest.importorskip("transformers", reason="examples/grpo.py needs the hf extra")
    policies = ["--policy", "verl_lb_micro", "--collective-policy", "local_sort"]
    out = _run(["examples/grpo.py", "--quick", "--nproc", "2", "--layers", "1", *policies], timeout=280)
    for mode in ("odc + verl_lb_micro", "collective + local_sort"):
        assert len(re.findall(rf"step\s+\d+\s+{re.escape(mode)}\s+loss", out)) == 2, out
    checks = re.findall(r"^replay check (\w+)\s*: max \|loss - replay\| .*: OK$", out, re.M)
    assert sorted(checks) == ["collective", "odc"], out


@pytest.mark.timeout(300)
def test_sft_example_split_samples_same_losses_as_collective() -> None:
    # --max-len 512 over --max-tokens 256: lb_mini refuses the long samples, lb_mini_split splits them across the two
    # ranks (gang attention); the collective run packs them whole under a 512 cap. Same samples, same losses.
    common = ["--steps", "2", "--samples", "8", "--max-len", "512"]
    proc = subprocess.run([sys.executable, "examples/sft.py", "--nproc", "2", "--policy", "lb_mini", *common,
                           "--max-tokens", "256"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0 and "more than max_tokens=256" in proc.stderr, proc.stderr[-2000:]
    runs = {
        "split": ["examples/sft.py", "--nproc", "2", "--policy", "lb_mini_split", "--max-tokens", "256"],
        "collective": ["-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/sft.py", "--comm",
                       "collective", "--max-tokens", "512"],
    }
    losses = {}
    for name, args in runs.items():
        out = _run([*args, *common])
        losses[name] = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
        assert len(losses[name]) == 2, out
    assert losses["split"] == pytest.approx(losses["collective"], abs=1e-4)
