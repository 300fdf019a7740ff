"""Hugging Face ``transformers``: gang attention (``odc_runtime.gang``) as a registered attention implementation.

``enable`` registers ``ATTN_IMPLEMENTATION`` through ``transformers.AttentionInterface`` and switches a model
to it. Inside ``with exchange.step(chunk):`` the model runs one chunk of a split sample: pass the chunk's tokens and
their *global* positions (``chunk_inputs``, so rotary embeddings see the unsplit sequence) and every attention
layer exchanges K/V with the gang. Outside a gang step the same function is plain causal attention over the
micro-batch (several samples packed in one row are separated where ``position_ids`` restart), so one model runs
gang and whole-sample micro-batches alike. Loss: ``chunk_loss``, the sum of the chunk's token losses over the
*global* target count, so the members' losses add up to the unsplit sample's mean.

Supported: decoder-only models whose attention modules call the attention interface with ``(module, query, key,
value, attention_mask, scaling=..., dropout=...)`` and carry ``layer_idx`` (Llama, Qwen2 and most of their kin);
batch size 1 (packed rows); no attention dropout. Activation checkpointing (``gradient_checkpointing_enable()``)
works: a recomputed layer exchanges its K/V again (``odc_runtime.gang``).
"""

from __future__ import annotations

from typing import Any

import torch

from odc_runtime.errors import OdcUsageError
from odc_runtime.gang import GangExchange, active_step, gang_attention
from odc_runtime.split import Chunk

__all__ = ["ATTN_IMPLEMENTATION", "chunk_inputs", "chunk_loss", "enable", "exchange_for", "gang_attention_forward"]

#: The attention implementation's name in transformers' registry.
ATTN_IMPLEMENTATION = "odc_gang"


def _packed_causal_mask(position_ids: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """Block-diagonal causal mask of one packed row: a new sample starts where the position does not grow by 1."""
    if position_ids is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    pos = position_ids.reshape(-1)
    starts = torch.ones(n, dtype=torch.long, device=device)
    starts[1:] = (pos[1:] != pos[:-1] + 1).long()
    segment = starts.cumsum(0)
    idx = torch.arange(n, device=device)
    return (segment[:, None] == segment[None, :]) & (idx[:, None] >= idx[None, :])


def gang_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention interface's function: ``query`` ``(1, heads, n, d)``, ``key``/``value`` ``(1, kv_heads, n, d)``;
    returns ``(1, n, heads, d)``. In a gang step: the gang's exact causal attention; else causal attention over the
    packed row."""
    if query.shape[0] != 1:
        raise OdcUsageError(f"odc_gang attention: batch size must be 1 (pack samples in one row), got {query.shape[0]}")
    if dropout and module.training:
        raise OdcUsageError("odc_gang attention: attention dropout is not supported (set attention_dropout=0)")
    position_ids = kwargs.get("position_ids")
    step = active_step()
    if step is None:
        n, groups = query.shape[2], query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        mask = _packed_causal_mask(position_ids, n, query.device)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if position_ids is not None and not torch.equal(position_ids.reshape(-1).to(step.positions.device), step.positions):
        raise OdcUsageError(
            f"odc gang {step.chunk.gang}: position_ids are not the chunk's global positions; "
            "build the inputs with odc_runtime.integrations.hf_gang.chunk_inputs"
        )
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise OdcUsageError(f"odc_gang attention: {type(module).__name__} has no integer layer_idx; the gang exchange "
                            "is per layer, so the model's attention modules must carry their layer number")
    out = gang_attention(query[0], key[0], value[0], step, layer, scale=scaling)
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def register() -> None:
    """Register ``ATTN_IMPLEMENTATION`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, gang_attention_forward)


def enable(model: Any) -> Any:
    """Register the gang attention and switch ``model`` (a ``PreTrainedModel``) to it; returns ``model``."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def exchange_for(model: Any, max_chunk_tokens: int, dtype: torch.dtype | None = None, *, depth: int = 2,
                 max_gang_size: int | None = None) -> GangExchange:
    """Collective: a ``GangExchange`` sized for ``model``'s layers and K/V heads (``dtype``: the dtype the
    attention runs in, default the model's; ``depth``, ``max_gang_size``: as for ``GangExchange``)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return GangExchange(
        num_layers=config.num_hidden_layers, max_chunk_tokens=max_chunk_tokens, kv_features=kv_heads * head_dim,
        dtype=dtype or next(model.parameters()).dtype, depth=depth, max_gang_size=max_gang_size,
    )


def chunk_inputs(input_ids: torch.Tensor, chunk: Chunk, ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """Model inputs of ``chunk`` from the whole sample's ``input_ids`` (1-D, ``chunk.length`` tokens):
    ``input_ids`` and ``position_ids`` (global) of shape ``(1, tokens)``, and ``labels``, each token's *next*
    token in the unsplit sample (``ignore_index`` after the last one). Pass ``labels`` to ``chunk_loss``, not to
    the model (which would shift them again)."""
    if input_ids.dim() != 1 or input_ids.numel() != chunk.length:
        raise OdcUsageError(f"chunk_inputs: expected the sample's {chunk.length} token ids (1-D), got "
                            f"{tuple(input_ids.shape)}")
    positions = torch.tensor(chunk.positions(), dtype=torch.long, device=input_ids.device)
    targets = torch.cat([input_ids[1:], input_ids.new_full((1,), ignore_index)])
    return {
        "input_ids": input_ids[positions][None], "position_ids": positions[None], "labels": targets[positions][None]
    }


def chunk_loss(logits: torch.Tensor, labels: torch.Tensor, num_targets: int, ignore_index: int = -100) -> torch.Tensor:
    """Sum of the chunk's token losses divided by ``num_targets``, the target count of the whole (unsplit)
    minibatch, so that losses and gradients add up across ranks and gang members to the global mean."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    ) / num_targets
