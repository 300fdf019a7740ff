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
def test_custom_trainer_deterministic_matches_single_process() -> None:
    # the example's rerun idiom around each minibatch (its rerun itself is run by docs/core-api.md's block)
    out = _run(["examples/custom_trainer.py", "--nproc", "2", "--steps", "3", "--samples", "12", "--deterministic"])
    _check_custom_trainer(out)


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
        assert ("odc_backend=host " if comm == "odc" else "odc_backend=- ") in out, out  # the banner names it
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
    # ODC's own figures per rank: rank 1 ran nothing, so pushed nothing (and waited in sync for rank 0)
    pushed = [[float(x) for x in m.split()] for m in re.findall(r"push MiB/rank \[([^\]]*)\]", logs["odc"])]
    assert len(pushed) == 2 and all(p[0] > 0 and p[1] == 0.0 for p in pushed), logs["odc"]
    assert len(re.findall(r"sync wait s/rank \[\d+\.\d+ \d+\.\d+\]", logs["odc"])) == 2, logs["odc"]
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
    # ranks (gang attention); the collective run packs them whole under a 512 cap. Same samples, same losses; and
    # --check: the split run's losses, gradient norms and final parameters match the single-process replay.
    common = ["--steps", "2", "--samples", "8", "--max-len", "512"]
    proc = subprocess.run([sys.executable, "examples/sft.py", "--nproc", "2", "--policy", "lb_mini", *common,
                           "--max-tokens", "256"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0 and "more than max_tokens=256" in proc.stderr, proc.stderr[-2000:]
    runs = {
        "split": ["examples/sft.py", "--nproc", "2", "--policy", "lb_mini_split", "--max-tokens", "256", "--check",
                  "--max-gang-size", "2"],
        "collective": ["-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/sft.py", "--comm",
                       "collective", "--max-tokens", "512"],
    }
    losses = {}
    for name, args in runs.items():
        out = _run([*args, *common])
        losses[name] = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
        assert len(losses[name]) == 2, out
        if name == "split":
            assert re.search(r"^replay check odc \+ lb_mini_split: max \|loss - replay\| .*: OK$", out, re.M), out
    assert losses["split"] == pytest.approx(losses["collective"], abs=1e-4)


def _sft_module():
    """examples/sft.py imported as a module (its functions, not a run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sft_example", os.path.join(ROOT, "examples", "sft.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_sft_replay_check_refuses_a_run_that_differs_from_the_replay(capsys) -> None:
    # --check's comparison in one process (tiny model, one step): the replay's own values pass, and a loss, a gradient
    # norm (a wrong scale, which AdamW hides from the parameters) or a parameter off by more than its tolerance fail.
    sft = _sft_module()
    args = sft.parse_args(["--steps", "1", "--samples", "2", "--max-len", "32", "--dim", "16", "--heads", "2",
                           "--ffn", "24", "--layers", "1", "--vocab", "31", "--check"])
    device = sft.torch.device("cpu")
    losses, norms, params = sft.replay(args, device)
    records = [{"loss": a, "grad_norm": b} for a, b in zip(losses, norms, strict=True)]
    sft.replay_check(args, records, params, device)
    assert re.search(r"^replay check odc \+ lb_mini: .*: OK$", capsys.readouterr().out, re.M)
    wrong_param = [p.clone() for p in params]
    wrong_param[0][0, 0] += 2 * args.param_tol
    cases = [([{**records[0], "loss": losses[0] + 2 * args.loss_tol}], params),
             ([{**records[0], "grad_norm": norms[0] * 1.01}], params), (records, wrong_param)]
    for bad_records, bad_params in cases:
        with pytest.raises(SystemExit, match="does not match the single-process replay"):
            sft.replay_check(args, bad_records, bad_params, device)
        assert "MISMATCH" in capsys.readouterr().out


def test_sft_help_shows_defaults_and_every_backend(capsys) -> None:
    from odc_runtime import transport

    with pytest.raises(SystemExit):
        _sft_module().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal width
    assert "--steps STEPS default: 10" in out and "--lr LR default: 0.01" in out, out
    assert "--samples SAMPLES sequences per minibatch (optimizer step) (default: 32)" in out, out
    assert f"--odc-backend {{{','.join(transport.names())}}}" in out, out


def test_sft_placement_one_rank_per_gpu_and_cpu() -> None:
    sft = _sft_module()
    assert sft.placement(cuda_devices=0, local_rank=3, local_world=4) == sft.Placement("cpu", "gloo", None)
    assert sft.placement(cuda_devices=0, local_rank=0, local_world=4, odc_backend="host").odc_backend == "host"
    assert sft.placement(cuda_devices=8, local_rank=5, local_world=8) == sft.Placement("cuda:5", "nccl", None)


def test_sft_placement_ranks_sharing_a_gpu_use_gloo_and_nvshmem() -> None:
    sft = _sft_module()
    got = [sft.placement(cuda_devices=1, local_rank=r, local_world=4, pes_per_gpu=4) for r in range(4)]
    assert got == [sft.Placement("cuda:0", "gloo", "nvshmem")] * 4
    # K consecutive ranks per GPU: 4 ranks at 2 per GPU on 2 GPUs
    devices = [sft.placement(cuda_devices=2, local_rank=r, local_world=4, pes_per_gpu=2).device for r in range(4)]
    assert devices == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    # fewer ranks than the flag allows still fit (2 ranks, up to 4 per GPU)
    assert sft.placement(cuda_devices=1, local_rank=1, local_world=2, pes_per_gpu=4).device == "cuda:0"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cuda_devices": 0, "local_world": 4, "pes_per_gpu": 2}, "no CUDA GPU is visible"),
        ({"cuda_devices": 1, "local_world": 4, "pes_per_gpu": 1}, "pass --pes-per-gpu 4"),
        ({"cuda_devices": 1, "local_world": 4, "pes_per_gpu": 2}, "need 2 GPUs, but 1 are visible"),
        ({"cuda_devices": 1, "local_world": 4, "pes_per_gpu": 4, "odc_backend": "host"}, "--odc-backend nvshmem"),
        ({"cuda_devices": 1, "local_world": 4, "pes_per_gpu": 4, "odc_backend": "nope"}, "nope"),
        ({"cuda_devices": 1, "local_world": 4, "pes_per_gpu": 0}, "at least 1"),
    ],
)
def test_sft_placement_refuses_ranks_that_do_not_fit(kwargs: dict, message: str) -> None:
    sft = _sft_module()
    with pytest.raises(ValueError, match=re.escape(message)):
        sft.placement(local_rank=0, **kwargs)


@pytest.mark.timeout(120)
def test_sft_pes_per_gpu_refused_without_a_gpu() -> None:
    if _sft_module().torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for a machine without one")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "examples/sft.py", "--pes-per-gpu", "2", "--steps", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1 and "no CUDA GPU is visible" in proc.stderr, proc.stderr[-2000:]
    assert "step" not in proc.stdout  # refused before any rank was spawned
    proc = subprocess.run([*cmd[:3], "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and "--pes-per-gpu must be at least 1" in proc.stderr, proc.stderr[-2000:]


def test_sft_collective_mode_checks_no_odc_transport(monkeypatch) -> None:
    import argparse

    sft = _sft_module()
    monkeypatch.setattr(sft.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sft.torch.cuda, "device_count", lambda: 1)
    args = argparse.Namespace(comm="collective", odc_backend="host", pes_per_gpu=4)
    assert sft.rank_placement(args, 3, 4).dist_backend == "gloo"  # --odc-backend unused: not checked
    args.comm = "odc"
    with pytest.raises(ValueError, match="--odc-backend nvshmem"):
        sft.rank_placement(args, 3, 4)
