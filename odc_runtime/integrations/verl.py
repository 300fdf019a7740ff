"""veRL recipe: run the actor's FSDP2 updates in ODC mode, with micro-batches planned without equal counts.

What veRL does today (function names from its source, 2025–2026; this module copies none of its code):

- Dynamic batching (``use_dynamic_bsz``) splits each rank's share of a mini-batch into micro-batches with
  ``verl.utils.seqlen_balancing.rearrange_micro_batches(batch, max_token_len, dp_group=None,
  num_batches_divided_by=None, same_micro_num_in_dp=True, min_num_micro_batch=None, use_dynamic_bsz_balance=True
  [, force_group_size=1]) -> (micro_batches, index_lists)``. It takes ``ceil(tokens / max_token_len)`` micro-batches,
  then, with ``same_micro_num_in_dp``, all-reduces the *maximum* count over the data-parallel group so that every
  rank runs the same number (FSDP's per-layer collectives deadlock otherwise), and splits the rank's samples into
  that many parts. Ranks with less work therefore run extra, smaller micro-batches, and every layer of every
  micro-batch still waits for the slowest rank. ``prepare_dynamic_batch`` (``DataParallelPPOActor``) and
  ``verl.workers.engine.utils.prepare_micro_batches`` (the FSDP engine's ``forward_backward_batch``) call it.
  Together with the driver's ``_balance_batch`` (equal sample counts per rank, Karmarkar–Karp) this is the
  planner this adapter replaces; ``odc_runtime.balance`` models it as the ``"verl_lb_micro"`` policy (the ODC
  paper's LB-Micro), so ``plan(..., policy="verl_lb_micro")`` and the benchmarks show what a veRL user runs
  today next to ODC's ``"lb_mini"``.
- The FSDP engine normalises token-mean losses by the global token count times the data-parallel size (FSDP
  averages gradients over ranks) and may defer gradient sync with ``set_requires_gradient_sync(False)`` on all but
  the last micro-batch.

What ODC changes (see the README's "With veRL" section for the edits):

1. :func:`enable_actor` switches the actor's FSDP2 module to ODC mode (``odc_runtime.fsdp.enable``).
2. :func:`rearrange_micro_batches` (same arguments and results as veRL's) plans each rank's micro-batches from its
   own samples only: as few as fit under ``max_token_len`` (best-fit packing by ``odc_runtime.balance``, the
   packing step of ``lb_mini``), with no all-reduce of the count, so counts differ between ranks. Each rank's
   total is balanced by veRL's own driver-side balancing (``balance_batch``), which assigns samples to ranks with
   equal sample counts because veRL dispatches equal chunks; ODC needs the totals balanced per mini-batch only.
3. Every ``forward_backward_batch`` (training *and* forward-only log-prob passes: with unequal counts a collective
   all-gather would hang) runs inside ``odc_runtime.fsdp.minibatch(module)``. Deferred gradient sync is turned
   off: under ODC it saves nothing (a push is one-sided, nobody waits for it) and it would keep the whole model's
   unsharded gradients alive across micro-batches (``odc_runtime.fsdp`` also refuses a minibatch that *starts*
   with ``set_requires_gradient_sync(False)``).
4. Loss scaling stays as veRL has it: ``end_minibatch``'s default divide factor is the world size, FSDP2's mean,
   so veRL's ``× dp_size / global tokens`` gives the same gradients as before.

:func:`attach_engine` does 1 and 3 on a veRL FSDP engine object (anything with ``.module`` and
``.forward_backward_batch(data, loss_function, forward_only)``), and :func:`install` routes veRL's
``rearrange_micro_batches`` to ours *only while an attached engine is inside its minibatch*, so the reference and
critic models (stock FSDP) keep veRL's equal counts.
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
    "attach_engine",
    "cost_model_from_hf_config",
    "enable_actor",
    "install",
    "plan_micro_batches",
    "rearrange_micro_batches",
    "select_rows",
    "seq_lengths",
    "uninstall",
]

#: Where veRL keeps a module-level reference to ``rearrange_micro_batches`` (``from ... import`` copies it).
VERL_PLANNER_SITES = ("verl.utils.seqlen_balancing", "verl.workers.engine.utils")

# Inside an attached engine's forward_backward_batch: the cost model to plan with (or True for the default).
_ACTIVE: contextvars.ContextVar[object] = contextvars.ContextVar("odc_verl_active", default=False)
_ORIGINALS: dict[str, Callable] = {}


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
    group) longer than ``max_token_len`` raises :class:`OdcUsageError`, as veRL asserts.
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
    from this rank's samples only (:func:`plan_micro_batches`): ``dp_group`` and ``same_micro_num_in_dp`` are
    accepted and ignored, because ODC needs no equal counts; ``use_dynamic_bsz_balance`` (veRL's ordering for
    pipeline bubbles) does not apply. ``num_batches_divided_by`` and ``min_num_micro_batch`` serve pipeline
    parallelism (Megatron), whose schedule needs fixed counts: they raise :class:`OdcUsageError`.
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

    - :func:`enable_actor` on ``engine.module``;
    - ``engine.forward_backward_batch`` runs inside ``odc_runtime.fsdp.minibatch(engine.module)``, forward-only
      calls (``compute_log_prob``) included, and while it runs :func:`install`'s hook plans micro-batches with
      :func:`rearrange_micro_batches` (``cost`` orders and packs them; default from ``engine.module.config``);
    - ``engine._gradient_sync_context`` (deferred gradient sync, newer veRL) becomes a no-op.

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
                return original(data, loss_function, forward_only=forward_only)
        finally:
            _ACTIVE.reset(token)

    engine.forward_backward_batch = forward_backward_batch
    engine._gradient_sync_context = _no_deferred_grad_sync
    engine._odc_attached = True
    if not _ORIGINALS:
        log.warning("odc verl: attach_engine() without install(): veRL still plans equal micro-batch counts")
    return engine


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


def install() -> list[str]:
    """Route veRL's ``rearrange_micro_batches`` (at every site in :data:`VERL_PLANNER_SITES` that exists) to ours
    while an :func:`attach_engine`-d engine runs; elsewhere veRL's function runs unchanged. Idempotent; returns
    the patched sites. Raises :class:`OdcUsageError` if veRL is not importable or no site was found."""
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
    log.info("odc verl: micro-batch planning routed at %s", ", ".join(patched))
    return patched


def uninstall() -> None:
    """Undo :func:`install` (engines stay attached)."""
    for site, original in list(_ORIGINALS.items()):
        mod = importlib.import_module(site)
        mod.rearrange_micro_batches = original
        del _ORIGINALS[site]
