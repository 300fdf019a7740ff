"""veRL's own actor path on 2 CPU ranks, stock or ODC mode (used by ``tests/test_verl_real.py``; needs veRL).

Per rank: ``ActorRolloutRefWorker(config, role="actor").init_model()`` with veRL's hydra ``ppo_trainer`` config and
a tiny random Qwen2 saved to a local directory (no hub download), then for each step ``compute_log_prob`` (old
log-probs) and ``update_actor`` on this rank's share of a synthetic batch, called as veRL's trainer calls them
(padded DataProto → no-padding TensorDict, the same meta keys), then a checkpoint round trip. In ODC mode the
worker is the recipe's subclass from ``examples/verl_odc.py``. :class:`RunSpec` says what to run; a mode is a field
there that maps to config lines (``full_determinism`` is one) or to the workers' environment (``ODC_DETERMINISTIC``,
as a veRL user sets it through Ray's ``runtime_env``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of the actor path. ``odc``: the ODC worker, else veRL's stock one. ``max_tokens``: the actor's and
    the log-prob pass's token budget per micro-batch (``ppo_max_token_len_per_gpu`` /
    ``log_prob_max_token_len_per_gpu``); a budget above a rank's whole share gives one micro-batch per pass, so
    stock and ODC run identical micro-batches."""

    odc: bool
    model_dir: str
    ckpt_dir: str = ""  # non-empty: save, step, load, compare (the checkpoint round trip)
    max_tokens: int = 48
    steps: int = 2
    mini_batches: int = 2
    samples: int = 16  # per step, all ranks together
    full_determinism: bool = False  # veRL's fsdp_config.full_determinism (deterministic kernels, fixed seeds)
    odc_deterministic: bool = False  # ODC_DETERMINISTIC=1 in the worker's environment (odc.init reads it)
    pushes_last: int = -1  # test only: this rank's pushes wait until the other ranks' landed (see _order_pushes)
    order_dir: str = ""  # with pushes_last: a directory shared by the ranks


def build_model(path: str, seed: int = 0) -> None:
    """A tiny random Qwen2 causal LM (fp32) saved where veRL's config points (``model.path``)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)


def load_config(spec: RunSpec):
    """veRL's hydra ``ppo_trainer`` config with the lines this run changes (dynamic batching, fp32, CPU-sized)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    world = int(os.environ["WORLD_SIZE"])
    overrides = [
        f"actor_rollout_ref.model.path={spec.model_dir}",
        "+actor_rollout_ref.model.load_tokenizer=False",
        "actor_rollout_ref.model.use_remove_padding=False",  # packing needs flash-attn (GPU)
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={spec.max_tokens}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={spec.samples // spec.mini_batches}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.shuffle=False",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        f"actor_rollout_ref.actor.fsdp_config.full_determinism={spec.full_determinism}",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={spec.max_tokens}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"trainer.n_gpus_per_node={world}",
        "trainer.nnodes=1",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def lengths_for(step: int, world: int, samples: int) -> list[list[int]]:
    """(prompt, response) lengths per sample: rank 0's share long, the last rank's short, so planning from each
    rank's own samples gives different micro-batch counts (veRL dispatches sample i to rank i // share)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    share = samples // world
    out = []
    for i in range(samples):
        long = (i // share) == 0
        prompt = int(torch.randint(3, 7, (1,), generator=g))
        resp = int(torch.randint(8, 14, (1,), generator=g)) if long else int(torch.randint(2, 5, (1,), generator=g))
        out.append([prompt, resp])
    return out


def make_batch(step: int, world: int, samples: int):
    """The global rollout batch as veRL's trainer holds it: a padded DataProto (left-padded prompts, right-padded
    responses) with advantages; old log-probs are added after ``compute_log_prob``."""
    import torch
    from verl import DataProto

    lens = lengths_for(step, world, samples)
    P, R = max(p for p, _ in lens), max(r for _, r in lens)
    g = torch.Generator().manual_seed(step)
    prompts = torch.zeros(samples, P, dtype=torch.long)
    responses = torch.zeros(samples, R, dtype=torch.long)
    attn = torch.zeros(samples, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(lens):
        prompts[i, P - p :] = torch.randint(1, 64, (p,), generator=g)
        responses[i, :r] = torch.randint(1, 64, (r,), generator=g)
        attn[i, P - p : P + r] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    response_mask = attn[:, P:].clone()
    advantages = torch.randn(samples, R, generator=g) * response_mask
    return DataProto.from_dict(
        tensors={
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], -1),
            "attention_mask": attn, "position_ids": position_ids, "response_mask": response_mask,
            "advantages": advantages,
        },
    )


def worker_class(odc: bool):
    if not odc:
        from verl.workers.engine_workers import ActorRolloutRefWorker

        return ActorRolloutRefWorker
    if os.path.join(ROOT, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "examples"))
    from verl_odc import OdcActorRolloutRefWorker

    return OdcActorRolloutRefWorker


def _params(engine) -> dict:
    """The actor's full fp32 parameters (numpy: they cross process boundaries)."""
    return {k: v.full_tensor().detach().numpy().copy() for k, v in engine.module.state_dict().items()}


def _step(worker, rank: int, world: int, spec: RunSpec, step: int) -> tuple[Any, dict | None]:
    """compute_log_prob + update_actor on this rank's share, as veRL's trainer calls them; returns the old
    log-probs (padded, numpy) and update_actor's metrics."""
    import verl.utils.tensordict_utils as tu
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    share = spec.samples // world
    local = make_batch(step, world, spec.samples)[rank * share : (rank + 1) * share]
    local.meta_info.update(temperature=1.0, multi_turn=False)  # set by generation in veRL's trainer
    td = left_right_2_no_padding(local.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    out = worker.compute_log_prob(td)
    logp = no_padding_2_padding(tu.get(out, "log_probs"), td).float()
    local = local.union(DataProto.from_dict(tensors={"old_log_probs": logp}))
    td = left_right_2_no_padding(local.to_tensordict())
    mini = spec.samples // spec.mini_batches
    tu.assign_non_tensor(
        td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False, global_batch_size=mini,
        mini_batch_size=mini, epochs=1, seed=0, dataloader_kwargs={"shuffle": False}, compute_loss=True,
    )
    out = worker.update_actor(td)
    return logp.numpy(), (dict(tu.get(out, "metrics")) if out is not None else None)


def _order_pushes(spec: RunSpec, rank: int):
    """Force the arrival order of every PPO mini-batch's pushes: rank ``spec.pushes_last``'s wait until every other
    rank entered the mini-batch's closing ``odc.sync`` (its pushes are synchronous, so they have all landed). Each
    rank counts its ``odc.sync`` calls (collective: the same sequence on every rank); the others mark each entry
    with a file in ``spec.order_dir``. Returns the function that restores ``odc.push`` and ``odc.sync``."""
    import time

    import odc_runtime as odc

    push, sync, synced = odc.push, odc.sync, [0]

    def marking_sync(*args, **kwargs):
        synced[0] += 1
        open(os.path.join(spec.order_dir, f"{rank}.{synced[0]}"), "w").close()
        return sync(*args, **kwargs)

    def counting_sync(*args, **kwargs):
        sync(*args, **kwargs)
        synced[0] += 1

    def waiting_push(*args, **kwargs):
        world = int(os.environ["WORLD_SIZE"])
        marks = [os.path.join(spec.order_dir, f"{r}.{synced[0] + 1}") for r in range(world) if r != rank]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(m) for m in marks):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: the other ranks never reached sync {synced[0] + 1}")
            time.sleep(0.005)
        return push(*args, **kwargs)

    if rank == spec.pushes_last:  # the FSDP hooks call odc.push and odc.sync through the module
        odc.push, odc.sync = waiting_push, counting_sync
    else:
        odc.sync = marking_sync

    def restore():
        odc.push, odc.sync = push, sync

    return restore


def run(rank: int, world: int, specs: list[RunSpec]) -> list[dict]:
    """Every spec in turn on this rank (one process: veRL imports once); per spec the micro-batch counts per pass,
    update_actor's metrics, the final parameters and, if ``spec.ckpt_dir``, the checkpoint round trip's results."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    import numpy as np
    import verl.workers.engine.utils as eu

    import odc_runtime as odc

    results = []
    for spec in specs:
        # Each ODC run initialises its own runtime in its mode (attach_engine's odc.init reads ODC_DETERMINISTIC).
        os.environ["ODC_DETERMINISTIC"] = "1" if spec.odc_deterministic else "0"
        restore = _order_pushes(spec, rank) if spec.pushes_last >= 0 else lambda: None
        worker = worker_class(spec.odc)(config=load_config(spec).actor_rollout_ref, role="actor")
        worker.init_model()
        # Micro-batches per pass, planned at the site veRL's engine calls (ODC's router included when installed).
        counts: list[int] = []
        planner = eu.rearrange_micro_batches

        def counted(*args, planner=planner, counts=counts, **kwargs):
            micro_batches, index_lists = planner(*args, **kwargs)
            counts.append(len(index_lists))
            return micro_batches, index_lists

        eu.rearrange_micro_batches = counted
        try:
            metrics = [_step(worker, rank, world, spec, step)[1] for step in range(spec.steps)]
            result = {"counts": counts, "metrics": metrics, "params": _params(worker.actor.engine)}
            if spec.ckpt_dir:
                # save, train one more step, load: the parameters and the log-probs are back to the saved ones
                worker.save_checkpoint(spec.ckpt_dir, global_step=spec.steps)
                logp_saved, _ = _step(worker, rank, world, spec, spec.steps)
                worker.load_checkpoint(spec.ckpt_dir)
                after = _params(worker.actor.engine)
                result["ckpt_params_equal"] = all(np.array_equal(after[k], v) for k, v in result["params"].items())
                logp_loaded, _ = _step(worker, rank, world, spec, spec.steps)
                result["ckpt_logp_equal"] = bool(np.array_equal(logp_saved, logp_loaded))
        finally:
            eu.rearrange_micro_batches = planner
            restore()
        results.append(result)
        del worker
        odc.finalize()  # collective, a no-op in stock runs; the next ODC run may use another mode
    return results
