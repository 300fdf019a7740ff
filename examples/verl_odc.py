"""veRL recipe: its PPO/GRPO trainer with the actor's FSDP2 updates in ODC mode (veRL 0.9.x; tested with 0.9.1).

The only code is :class:`OdcActorRolloutRefWorker`: veRL's ``ActorRolloutRefWorker`` whose ``init_model`` ends
with the two lines of ``odc_runtime.integrations.verl`` (``install()`` then ``attach_engine(self.actor.engine)``);
nothing in veRL is edited. Run it as veRL's own entry point, with the same hydra overrides::

    PYTHONPATH=examples python examples/verl_odc.py \\
        actor_rollout_ref.actor.strategy=fsdp2 \\
        actor_rollout_ref.actor.use_dynamic_bsz=True \\
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \\
        actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \\
        actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \\
        actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 \\
        ...   # model, data, rollout, trainer: as for ``python -m verl.trainer.main_ppo``

Config lines that matter: ``strategy=fsdp2`` (ODC mode is for FSDP2 actors), ``use_dynamic_bsz=True`` on the actor
and the log-prob pass (that is where counts may differ; fixed ``ppo_micro_batch_size_per_gpu`` gives every rank the
same count anyway), Ulysses size 1; with ``fsdp_config.full_determinism=True`` also ``ODC_DETERMINISTIC=1`` in
the workers' environment (``+ray_kwargs.ray_init.runtime_env.env_vars.ODC_DETERMINISTIC='1'``), else ODC's
arrival-order sums are not reproducible bitwise. ``PYTHONPATH`` must reach this file on every node: veRL's Ray
workers import the worker class by module name.

What runs where. ``tests/test_verl_real.py`` runs this worker class on the CPU (2 gloo ranks, a tiny random Qwen2):
``init_model`` (actor role), ``compute_log_prob``, ``update_actor`` and a checkpoint round trip, against stock veRL.
The rest of a veRL step needs GPUs and was not run here: the rollout (vLLM / SGLang servers, the
``actor_rollout``/hybrid roles and weight sync to them), the Ray worker groups and resource pools this entry point
starts, and flash-attn sequence packing (``use_remove_padding=True``, veRL's default, the varlen kernels; the CPU
test uses ``use_remove_padding=False`` with SDPA).
"""

from __future__ import annotations

import sys

from odc_runtime import cli

if __name__ == "__main__":  # run as a program without veRL: its help, or one line saying what to install
    try:
        import verl  # noqa: F401
    except ImportError:
        if {"-h", "--help"} & set(sys.argv[1:]):
            print(cli.plain(__doc__ or ""))
            print("This recipe needs veRL 0.9.x, which is not installed: pip install verl==0.9.1")
            sys.exit(0)
        cli.require("verl", "verl==0.9.1", "examples/verl_odc.py")

from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

import odc_runtime.integrations.verl as odc_verl


class OdcActorRolloutRefWorker(ActorRolloutRefWorker):
    """veRL's actor/rollout/ref worker with the actor's engine in ODC mode (collective over the actor ranks)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # as the parent's: Ray's worker group calls it on every rank
    def init_model(self) -> None:
        super().init_model()
        if self.actor is not None:  # the ref-only role keeps stock FSDP
            odc_verl.install()
            odc_verl.attach_engine(self.actor.engine)


def main() -> None:
    """``verl.trainer.main_ppo`` with this worker in place of ``ActorRolloutRefWorker`` (the v1 trainer looks the
    class up in ``verl.trainer.ppo.v1.trainer_base`` when it builds its worker groups)."""
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from verl.trainer.main_ppo import main as verl_main

    trainer_base.ActorRolloutRefWorker = OdcActorRolloutRefWorker
    verl_main()


if __name__ == "__main__":
    main()
