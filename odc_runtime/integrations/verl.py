"""veRL recipe: run the actor's FSDP2 updates in ODC mode, with micro-batches planned without equal counts.

Tested with veRL **0.9.1** (the newest release) on torch 2.13.0 (CPU, gloo: ``tests/test_verl_real.py``, run by
``.ci/verl.sh``); ``install`` refuses any veRL other than 0.9.x (``SUPPORTED_VERL``). Names below are
veRL 0.9.1's; this module copies none of its code.

The path a PPO step takes in veRL 0.9 (``verl.workers.engine_workers``): ``ActorRolloutRefWorker.compute_log_prob``
→ ``TrainingWorker.infer_batch`` and ``ActorRolloutRefWorker.update_actor`` → ``TrainingWorker.train_mini_batch`` →
``train_batch`` per PPO mini-batch, both ending in the FSDP engine's ``forward_backward_batch``
(``verl.workers.engine.fsdp``) → ``verl.workers.engine.utils.prepare_micro_batches`` →
``verl.utils.seqlen_balancing.rearrange_micro_batches(batch, max_token_len, dp_group, num_batches_divided_by,
same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance, force_group_size)``. With dynamic batching
(``use_dynamic_bsz``) that planner takes ``ceil(tokens / max_token_len)`` micro-batches and, with
``same_micro_num_in_dp``, all-reduces the *maximum* count over the data-parallel group so that every rank runs the
same number (FSDP's per-layer collectives deadlock otherwise). Ranks with less work run extra, smaller
micro-batches, and every layer of every micro-batch waits for the slowest rank. ``odc_runtime.balance`` models this
planner as the ``"verl_lb_micro"`` policy (the ODC paper's LB-Micro). The engine normalises token-mean losses by the
global token count times the data-parallel size (FSDP averages gradients over ranks) and may defer gradient sync
(``use_no_sync_for_gradient_accumulation``) on all but the last micro-batch.

What ODC changes (see the README's "With veRL" section and ``examples/verl_odc.py``):

1. ``enable_actor`` switches the actor's FSDP2 module to ODC mode (``odc_runtime.fsdp.enable``).
2. ``rearrange_micro_batches`` (same arguments and results as veRL's) plans each rank's micro-batches from its
   own samples only: as few as fit under ``max_token_len`` (best-fit packing by ``odc_runtime.balance``, the
   packing step of ``lb_mini``), with no all-reduce of the count, so counts differ between ranks. veRL's driver
   (``balance_batch``) balances each rank's share of the whole step with equal sample counts; ODC waits once per
   mini-batch, so the per-mini-batch totals are what matter (see the README for what that means with several PPO
   mini-batches).
3. Every ``forward_backward_batch`` (training *and* forward-only log-prob passes: with unequal counts a collective
   all-gather would hang) runs inside ``odc_runtime.fsdp.minibatch(module)``. Deferred gradient sync is turned
   off: under ODC it saves nothing (a push is one-sided, nobody waits for it) and it would keep the whole model's
   unsharded gradients alive across micro-batches (``odc_runtime.fsdp`` also refuses a minibatch that *starts*
   with ``set_requires_gradient_sync(False)``).
4. Loss scaling stays as veRL has it: ``end_minibatch``'s default divide factor is the world size, FSDP2's mean,
   so veRL's ``× dp_size / global tokens`` gives the same gradients as before.
5. Per-micro-batch metrics. ``train_mini_batch`` all-gathers each rank's per-micro-batch ``Metric`` lists and
   reduces them with ``Metric.aggregate_dp``, which raises unless every rank has the same number of values. This
   module *corrects veRL's reduction* (``aggregate_dp``, installed over ``Metric.aggregate_dp``) rather than
   giving veRL equal counts (e.g. one collapsed value per rank), because the correction leaves every case stock veRL
   handles untouched: with equal counts, or with no ODC engine attached in the process, veRL's own function runs
   (bitwise the same values, the same error). Only unequal counts under ODC take the new path, which reduces each
   rank's values with the metric's own aggregation and averages over ranks for ``mean`` / ``sum`` (with equal counts
   that *is* stock's mean over ranks of each micro-batch index, regrouped) and takes ``min`` / ``max`` over all
   values. The ``sum`` metrics (e.g. the loss terms, scaled per micro-batch by the global token count) then give the
   same value however a rank's samples were split; ``mean`` metrics weight each rank equally, as veRL's equal
   per-rank sample counts suggest. Padding the lists to a common length instead would need a collective and would
   change ``mean``/``min``.
6. ODC's figures in veRL's metrics: every training ``forward_backward_batch`` (a PPO mini-batch) adds this rank's
   figures of that minibatch (``odc_runtime.fsdp.stats(module)["last_minibatch"]``) to its ``metrics`` as veRL
   ``Metric`` objects, which veRL gathers over the data-parallel group with the other metrics (no collective of
   ours) and reduces with ``Metric.aggregate_dp``: ``odc/sync_wait_s/max`` and ``odc/sync_wait_s/mean`` (seconds
   the ranks waited in ``odc.sync``: max and mean over ranks), ``odc/micro_batches/min`` and
   ``odc/micro_batches/max`` (over ranks), ``odc/push_bytes`` (bytes a rank pushed, mean over ranks). They reach
   whatever logger the trainer set up, per PPO mini-batch like ``loss`` (``METRICS``).

``attach_engine`` does 1 and 3 on a veRL FSDP engine object (anything with ``.module`` and
``.forward_backward_batch(data, loss_function, forward_only)``), and ``install`` routes veRL's
``rearrange_micro_batches`` to ours *only while an attached engine is inside its minibatch*, so the reference and
critic models (stock FSDP) keep veRL's equal counts, and installs 5.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

import odc_runtime as odc
import odc_runtime.fsdp as odc_fsdp
from odc_runtime import balance
from odc_runtime.errors import OdcUsageError

log = logging.getLogger(__name__)

__all__ = [
    "METRICS",
    "SUPPORTED_VERL",
    "add_metrics",
    "aggregate_dp",
    "attach_engine",
    "cost_model_from_hf_config",
    "enable_actor",
    "install",
    "plan_micro_batches",
    "rearrange_micro_batches",
    "select_rows",
    "seq_lengths",
    "uninstall",
    "verl_version",
]

#: veRL releases (major, minor) whose worker/engine path this module follows; 0.9.1 is the one tested.
SUPPORTED_VERL = ((0, 9),)
#: Where veRL's ``Metric`` class lives (its ``aggregate_dp`` is corrected by ``install``).
VERL_METRIC_SITE = "verl.utils.metric.utils"

#: Where veRL keeps a module-level reference to ``rearrange_micro_batches`` (``from ... import`` copies it).
VERL_PLANNER_SITES = ("verl.utils.seqlen_balancing", "verl.workers.engine.utils")

#: The metrics ``attach_engine`` adds per training pass: name -> (veRL aggregation, last_minibatch key).
METRICS = {
    "odc/sync_wait_s/max": ("max", "sync_wait_s"),
    "odc/sync_wait_s/mean": ("mean", "sync_wait_s"),
    "odc/micro_batches/min": ("min", "micro_batches"),
    "odc/micro_batches/max": ("max", "micro_batches"),
    "odc/push_bytes": ("mean", "push_bytes"),
}

# Inside an attached engine's forward_backward_batch: the cost model to plan with (or True for the default).
_ACTIVE: contextvars.ContextVar[object] = contextvars.ContextVar("odc_verl_active", default=False)
_ORIGINALS: dict[str, Callable] = {}
_ATTACHED = [0]  # engines attached in this process: the ragged metric reduction is used only when > 0


# --------------------------------------------------------------------------------------------------- planning


def cost_model_from_hf_config(config: Any, *, activation_checkpointing: bool = False) -> balance.CostModel:
    """The ``a·s² + b·s`` cost model of a Hugging Face decoder config (``model.config``; multimodal configs give
    their text config). Used to order and pack micro-batches; only the ratio of ``a`` to ``b`` matters."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        return balance.CostModel.from_model_config(
            text.num_hidden_layers,
            text.hidden_size,
            text.num_attention_heads,
            text.vocab_size,
            intermediate_size=getattr(text, "intermediate_size", None),
            num_kv_heads=getattr(text, "num_key_value_heads", None),
            activation_checkpointing=activation_checkpointing,
        )
    except AttributeError as e:
        raise OdcUsageError(f"cost_model_from_hf_config: {type(config).__name__} lacks a decoder field ({e})") from e


def plan_micro_batches(
    seqlens: Sequence[int] | torch.Tensor,
    max_token_len: int,
    *,
    cost: balance.CostModel | None = None,
    force_group_size: int = 1,
) -> list[list[int]]:
    """This rank's micro-batches (lists of local sample indices), planned from its own samples only.

    As few micro-batches as fit under ``max_token_len`` tokens each (best-fit decreasing), most expensive first,
    indices ascending inside each; every index appears exactly once; an empty shard gives ``[]``. The count depends
    on this rank's samples alone (no collective), which ODC allows and collectives do not. ``force_group_size``
    keeps each run of that many consecutive samples together (veRL's pairwise reward-model batches). A sample (or
    group) longer than ``max_token_len`` raises ``OdcUsageError``, as veRL asserts.
    """
    if isinstance(seqlens, torch.Tensor):
        seqlens = seqlens.reshape(-1).tolist()
    lengths = []
    for i, s in enumerate(seqlens):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise OdcUsageError(f"plan_micro_batches: seqlens[{i}] must be an int >= 0, got {s!r}")
        lengths.append(max(1, int(s)))  # an all-padding row still occupies a slot; plan it as one token
    if isinstance(force_group_size, bool) or not isinstance(force_group_size, int) or force_group_size < 1:
        raise OdcUsageError(f"plan_micro_batches: force_group_size must be a positive int, got {force_group_size!r}")
    g = force_group_size
    if len(lengths) % g:
        raise OdcUsageError(f"plan_micro_batches: {len(lengths)} samples do not divide into groups of {g}")
    if not lengths:
        return []
    group_lengths = [sum(lengths[i : i + g]) for i in range(0, len(lengths), g)]
    try:
        (parts,) = balance.plan(
            group_lengths, 1, max_tokens=max_token_len, policy="lb_mini", cost=cost or balance.DEFAULT_COST_MODEL
        )
    except OdcUsageError as e:
        unit = f" (planned in groups of {g} samples: 'sample' means group)" if g > 1 else ""
        raise OdcUsageError(f"plan_micro_batches: {e}{unit} (in veRL: raise ppo_max_token_len_per_gpu)") from e
    return [[k * g + j for k in mb for j in range(g)] for mb in parts]


def seq_lengths(batch: Any) -> list[int]:
    """Per-sample token counts of a veRL batch: ``input_ids`` as a nested (jagged) tensor gives its row lengths,
    otherwise ``attention_mask`` (``[batch, seq]``) is summed per row."""
    input_ids = batch["input_ids"]
    if isinstance(input_ids, torch.Tensor) and input_ids.is_nested:
        return input_ids.offsets().diff().tolist()
    try:
        mask = batch["attention_mask"]
    except KeyError as e:
        raise OdcUsageError("seq_lengths: the batch has neither nested input_ids nor an attention_mask") from e
    if mask.dim() < 2:
        raise OdcUsageError(f"seq_lengths: attention_mask must be [batch, seq], got shape {tuple(mask.shape)}")
    return mask.reshape(mask.shape[0], -1).sum(-1).tolist()


def select_rows(batch: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of a batch: veRL's own ``index_select_tensor_dict`` for TensorDicts when veRL is installed,
    otherwise a dict of regular or nested tensors (and per-sample lists) is indexed here."""
    if not isinstance(batch, dict):
        try:
            tu = importlib.import_module("verl.utils.tensordict_utils")
        except ImportError:
            tu = None
        if tu is not None:
            return tu.index_select_tensor_dict(batch, list(indices))
    index = torch.tensor(list(indices), dtype=torch.long)
    n = len(batch["input_ids"])
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows = value.unbind()
            out[key] = torch.nested.as_nested_tensor([rows[i] for i in index.tolist()], layout=torch.jagged)
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[index.to(value.device)]
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = type(value)(value[i] for i in index.tolist())
        else:  # per-batch metadata (scalars, settings): kept as is
            out[key] = value
    if isinstance(batch, dict):
        return out
    return type(batch)(out, batch_size=[len(index)])  # a TensorDict without veRL's helpers


def rearrange_micro_batches(
    batch: Any,
    max_token_len: int,
    dp_group: Any = None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
    force_group_size: int = 1,
    *,
    cost: balance.CostModel | None = None,
) -> tuple[list[Any], list[list[int]]]:
    """ODC's replacement for veRL's function of the same name: same arguments, same results.

    Returns ``(micro_batches, index_lists)``: ``micro_batches[i]`` holds rows ``index_lists[i]`` of ``batch``
    (veRL restores the original order from ``index_lists``, e.g. with ``restore_dynamic_batch``). The count comes
    from this rank's samples only (``plan_micro_batches``): ``dp_group`` and ``same_micro_num_in_dp`` are
    accepted and ignored, because ODC needs no equal counts; ``use_dynamic_bsz_balance`` (veRL's ordering for
    pipeline bubbles) does not apply. ``num_batches_divided_by`` and ``min_num_micro_batch`` serve pipeline
    parallelism (Megatron), whose schedule needs fixed counts: they raise ``OdcUsageError``.
    """
    del dp_group, same_micro_num_in_dp, use_dynamic_bsz_balance
    if num_batches_divided_by is not None or min_num_micro_batch is not None:
        raise OdcUsageError(
            "odc_runtime.integrations.verl.rearrange_micro_batches: num_batches_divided_by / min_num_micro_batch "
            "are for pipeline parallelism (Megatron), which needs equal micro-batch counts; ODC mode is for the FSDP "
            "actor"
        )
    parts = plan_micro_batches(seq_lengths(batch), max_token_len, cost=cost, force_group_size=force_group_size)
    return [select_rows(batch, p) for p in parts], parts


# --------------------------------------------------------------------------------------------------- the actor


def enable_actor(module: nn.Module, *, backend: str | None = None, validate: bool = False) -> nn.Module:
    """Switch the actor's FSDP2 module to ODC mode (collective): ``odc_runtime.init(backend)`` if not done yet,
    then ``odc_runtime.fsdp.enable(module)``. Call it on every actor rank after veRL applied ``fully_shard``."""
    if not odc.is_initialized():
        odc.init(backend)
    return odc_fsdp.enable(module, validate=validate)


@contextlib.contextmanager
def _no_deferred_grad_sync(*, is_last_micro_batch: bool = True, **_: Any) -> Iterator[None]:
    """Replaces the engine's ``_gradient_sync_context``: every micro-batch pushes its sharded gradients at once
    (one-sided, no barrier), instead of holding unsharded gradients until the last micro-batch."""
    yield


def attach_engine(engine: Any, *, backend: str | None = None, cost: balance.CostModel | None = None) -> Any:
    """Put a veRL FSDP engine (the actor's) in ODC mode (collective, on every actor rank).

    - ``enable_actor`` on ``engine.module``;
    - ``engine.forward_backward_batch`` runs inside ``odc_runtime.fsdp.minibatch(engine.module)``, forward-only
      calls (``compute_log_prob``) included, and while it runs ``install``'s hook plans micro-batches with
      ``rearrange_micro_batches`` (``cost`` orders and packs them; default from ``engine.module.config``);
    - ``engine._gradient_sync_context`` (deferred gradient sync, newer veRL) becomes a no-op;
    - a training pass's output ``metrics`` (a dict) gets ODC's figures (``METRICS``, see the module docstring).

    The engine's ``optimizer_step`` runs after ``forward_backward_batch`` returns, i.e. after the minibatch's
    closing sync has written the gradients. Returns ``engine``.
    """
    module = getattr(engine, "module", None)
    if not isinstance(module, nn.Module) or not callable(getattr(engine, "forward_backward_batch", None)):
        raise OdcUsageError(
            f"attach_engine: {type(engine).__name__} has no .module / .forward_backward_batch (a veRL FSDP engine "
            "after initialize() has both)"
        )
    if (getattr(engine, "ulysses_sequence_parallel_size", 1) or 1) > 1:
        raise OdcUsageError(
            "attach_engine: Ulysses sequence parallelism runs all-to-alls inside each sequence-parallel group, whose "
            "ranks must then run the same micro-batches; ODC mode supports pure data parallelism (sp size 1)"
        )
    if getattr(engine, "_odc_attached", False):
        raise OdcUsageError("attach_engine: this engine is already in ODC mode")
    if cost is None and hasattr(module, "config"):
        with contextlib.suppress(OdcUsageError):
            cost = cost_model_from_hf_config(module.config)
    enable_actor(module, backend=backend)
    original = engine.forward_backward_batch

    @functools.wraps(original)
    def forward_backward_batch(data: Any, loss_function: Callable, forward_only: bool = False) -> Any:
        token = _ACTIVE.set(cost or True)
        try:
            with odc_fsdp.minibatch(module):
                output = original(data, loss_function, forward_only=forward_only)
        finally:
            _ACTIVE.reset(token)
        if not forward_only:
            add_metrics(output, odc_fsdp.stats(module)["last_minibatch"])
        return output

    engine.forward_backward_batch = forward_backward_batch
    engine._gradient_sync_context = _no_deferred_grad_sync
    engine._odc_attached = True
    _ATTACHED[0] += 1
    if not _ORIGINALS:
        log.warning("odc verl: attach_engine() without install(): veRL still plans equal micro-batch counts")
    return engine


def add_metrics(output: Any, figures: dict[str, Any] | None) -> None:
    """Add ``METRICS`` from ``figures`` (``odc_runtime.fsdp.stats(module)["last_minibatch"]``) to
    ``output["metrics"]`` as veRL ``Metric`` objects, where the engine's output has a metrics dict (veRL's
    ``forward_backward_batch``)."""
    metrics = output.get("metrics") if isinstance(output, dict) else None
    if figures is None or not isinstance(metrics, dict):
        return
    metric_cls = importlib.import_module(VERL_METRIC_SITE).Metric
    for name, (aggregation, key) in METRICS.items():
        metrics[name] = metric_cls(aggregation=aggregation, value=figures[key])


def _routed(original: Callable) -> Callable:
    @functools.wraps(original)
    def route(batch: Any, max_token_len: int, *args: Any, **kwargs: Any) -> Any:
        active = _ACTIVE.get()
        if not active:  # not inside an ODC engine's minibatch (reference / critic models): veRL's own planner
            return original(batch, max_token_len, *args, **kwargs)
        cost = active if isinstance(active, balance.CostModel) else None
        return rearrange_micro_batches(batch, max_token_len, *args, cost=cost, **kwargs)

    route.__odc_original__ = original
    return route


def verl_version() -> tuple[int, ...]:
    """The installed veRL's version as integers (``(0, 9, 1)``); ``OdcUsageError`` if veRL is not importable."""
    try:
        verl = importlib.import_module("verl")
    except ImportError as e:
        raise OdcUsageError(f"odc_runtime.integrations.verl: veRL is not importable ({e}); is verl installed?") from e
    text = str(getattr(verl, "__version__", "0"))
    parts = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _check_version() -> None:
    version = verl_version()
    if tuple(version[:2]) not in SUPPORTED_VERL:
        found = ".".join(map(str, version)) or "unknown"
        wanted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERL)
        raise OdcUsageError(
            f"odc_runtime.integrations.verl supports veRL {wanted} (tested with 0.9.1), found veRL {found}: its "
            "actor path (TrainingWorker → FSDP engine → prepare_micro_batches) and metric reduction are what this "
            "adapter hooks; install verl==0.9.1"
        )


def aggregate_dp(metric_lists: Sequence[Any], *, original: Callable | None = None) -> Any:
    """``Metric.aggregate_dp`` for per-rank lists of unequal length (see the module docstring, item 5).

    Equal lengths, or no ODC engine attached in this process: veRL's own function (``original``) runs. Otherwise
    ``mean`` / ``sum``: each rank's values reduced with the metric's aggregation, then averaged over ranks;
    ``min`` / ``max``: over all values. A rank with no value (no micro-batch) counts as 0 for ``sum`` and is left out
    of ``mean``."""
    lengths = [len(m.values) for m in metric_lists]
    if original is not None and (len(set(lengths)) <= 1 or not _ATTACHED[0]):
        return original(metric_lists)
    import numpy as np

    kind = getattr(metric_lists[0].aggregation, "value", metric_lists[0].aggregation)
    values = [list(m.values) for m in metric_lists]
    if kind == "sum":
        return np.mean([np.sum(v) if v else 0.0 for v in values])
    if kind == "mean":
        return np.mean([np.mean(v) for v in values if v])
    flat = [x for v in values for x in v]
    return np.min(flat) if kind == "min" else np.max(flat)


def _install_metric_reduction() -> None:
    metric_cls = importlib.import_module(VERL_METRIC_SITE).Metric
    if VERL_METRIC_SITE in _ORIGINALS:
        return
    original = metric_cls.__dict__["aggregate_dp"].__func__
    _ORIGINALS[VERL_METRIC_SITE] = original

    def corrected(cls: type, metric_lists: list) -> Any:
        return aggregate_dp(metric_lists, original=functools.partial(original, cls))

    corrected.__odc_original__ = original
    metric_cls.aggregate_dp = classmethod(functools.wraps(original)(corrected))


def install() -> list[str]:
    """Route veRL's ``rearrange_micro_batches`` (at every site in ``VERL_PLANNER_SITES`` that exists) to ours
    while an ``attach_engine``-d engine runs, elsewhere veRL's function runs unchanged; and correct
    ``Metric.aggregate_dp`` for unequal counts (``aggregate_dp``). Idempotent; returns the patched planner sites.
    Raises ``OdcUsageError`` if veRL is not importable, is not a supported version (``SUPPORTED_VERL``), or
    no site was found."""
    _check_version()
    patched = []
    for site in VERL_PLANNER_SITES:
        try:
            mod = importlib.import_module(site)
        except ImportError:
            continue
        current = getattr(mod, "rearrange_micro_batches", None)
        if current is None:
            continue
        if site not in _ORIGINALS:
            _ORIGINALS[site] = getattr(current, "__odc_original__", current)
            mod.rearrange_micro_batches = _routed(_ORIGINALS[site])
        patched.append(site)
    if not patched:
        raise OdcUsageError(
            "odc_runtime.integrations.verl.install(): veRL's rearrange_micro_batches not found in "
            f"{', '.join(VERL_PLANNER_SITES)} (is verl installed? which version?)"
        )
    _install_metric_reduction()
    log.info("odc verl: micro-batch planning routed at %s; Metric.aggregate_dp accepts unequal counts",
             ", ".join(patched))
    return patched


def uninstall() -> None:
    """Undo ``install`` (engines stay attached)."""
    for site, original in list(_ORIGINALS.items()):
        mod = importlib.import_module(site)
        if site == VERL_METRIC_SITE:
            mod.Metric.aggregate_dp = classmethod(original)
        else:
            mod.rearrange_micro_batches = original
        del _ORIGINALS[site]
