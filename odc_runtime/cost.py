"""The cost model of the balancers: the time of one sequence, ``a·s² + b·s`` (``CostModel``), and the
checks of the inputs every planner shares (a positive int, a list of token counts).

Torch-free and below ``odc_runtime.packing``, ``odc_runtime.split`` and ``odc_runtime.balance`` (which
re-exports ``CostModel`` and ``DEFAULT_COST_MODEL``, where users import them).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from odc_runtime.errors import OdcUsageError

__all__ = ["DEFAULT_COST_MODEL", "CostModel", "check_lengths", "check_positive_int"]


# --------------------------------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class CostModel:
    """Time (or any additive work unit) of one sequence of ``s`` tokens: ``a·s² + b·s``.

    ``a`` covers attention (quadratic in the sequence length), ``b`` everything linear (projections, MLP,
    LM head). Both must be finite and non-negative, and not both zero. Only the ratio ``b / a`` matters for
    balancing; the absolute scale matters for predicted times.
    """

    a: float
    b: float

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise OdcUsageError(f"CostModel.{name} must be a finite real number, got {value!r}")
            if value < 0:
                raise OdcUsageError(f"CostModel.{name} must be >= 0, got {value!r}")
        if self.a == 0 and self.b == 0:
            raise OdcUsageError("CostModel needs a > 0 or b > 0: with a = b = 0 every sample costs nothing")

    def cost(self, s: int) -> float:
        """Cost of one sequence of ``s`` tokens."""
        return self.a * s * s + self.b * s

    def cost_of(self, micro_batch_lengths: Iterable[int]) -> float:
        """Cost of a micro-batch: the sum of its sequences' costs (correctly rounded)."""
        return math.fsum(self.cost(s) for s in micro_batch_lengths)

    @classmethod
    def fit(cls, lengths_per_microbatch: Sequence[Sequence[int]], seconds: Sequence[float]) -> CostModel:
        """Fit ``a, b >= 0`` to measured micro-batch times by non-negative least squares.

        Measurement ``j`` is a micro-batch with sequence lengths ``lengths_per_microbatch[j]`` that took
        ``seconds[j]``; the model predicts ``a·Σs² + b·Σs``. The two-variable problem is solved exactly, in
        rational arithmetic on the given floats: the unconstrained least-squares solution if both
        coefficients are non-negative, otherwise (the optimum then lies on the boundary ``a = 0`` or
        ``b = 0``) the better of the two one-variable fits. Raises ``OdcUsageError`` on bad input or
        when the times do not grow with the lengths at all.
        """
        rows = _fit_rows(lengths_per_microbatch, seconds)
        xx = sum(q * q for q, _, _ in rows)
        xy = sum(q * s for q, s, _ in rows)
        yy = sum(s * s for _, s, _ in rows)
        xt = sum(q * t for q, _, t in rows)
        yt = sum(s * t for _, s, t in rows)
        det = xx * yy - xy * xy
        if det != 0:
            a, b = (xt * yy - yt * xy) / det, (yt * xx - xt * xy) / det
            if a >= 0 and b >= 0:
                return cls._from_fit(a, b)
        # Sum of squared residuals minus the constant Σt², for a one-variable fit c·column.
        a_only, b_only = max(xt / xx, Fraction(0)), max(yt / yy, Fraction(0))
        sse_a = a_only * a_only * xx - 2 * a_only * xt
        sse_b = b_only * b_only * yy - 2 * b_only * yt
        return cls._from_fit(a_only, 0) if sse_a <= sse_b else cls._from_fit(0, b_only)

    @classmethod
    def _from_fit(cls, a: Fraction | int, b: Fraction | int) -> CostModel:
        if a == 0 and b == 0:
            raise OdcUsageError("CostModel.fit: the measured times do not increase with the sequence lengths")
        return cls(float(a), float(b))

    @classmethod
    def from_model_config(
        cls,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        vocab_size: int,
        *,
        intermediate_size: int | None = None,
        num_kv_heads: int | None = None,
        gated_mlp: bool = True,
        causal: bool = True,
        activation_checkpointing: bool = False,
        flops_per_second: float = 400e12,
    ) -> CostModel:
        """Derive ``a, b`` (seconds) by counting the FLOPs of a decoder-only transformer.

        Forward FLOPs of one sequence of ``s`` tokens (a multiply-add counts 2), hidden size ``h``,
        ``head_dim = h / num_heads``, ``h_kv = num_kv_heads · head_dim`` (GQA/MQA shrink K and V only):

        - per layer, Q/K/V projections ``2·s·h·(h + 2·h_kv)`` and the output projection ``2·s·h²``;
        - per layer, the MLP ``2·s·h·i`` per weight matrix: 3 matrices when gated (SwiGLU: gate, up, down),
          2 otherwise; ``i`` defaults to ``8h/3`` (gated) or ``4h``;
        - per layer, attention scores ``QKᵀ`` and the weighted sum ``PV``, ``2·s²·h`` each, so ``4·s²·h``;
          with a causal mask a kernel that skips fully masked blocks (FlashAttention) does half: ``2·s²·h``
          (``causal=True``, the default; ``causal=False`` counts the full square);
        - once, the LM head ``2·s·h·V``.

        Ignored (small constants times ``s·h``): embedding lookups, norms, activations, rotary embeddings,
        softmax, the loss. Training costs forward + backward ≈ 3× forward (the backward pass computes
        gradients for activations and for weights, each about one forward), 4× with activation
        checkpointing (the forward runs again). ``flops_per_second`` is the *achieved* rate, not the peak:
        the default 400 TFLOP/s is about 40% of an H100's dense bf16 peak. Memory-bound work and
        communication are not modelled; use ``fit`` on measured times when they matter.
        """
        for name, value in (
            ("num_layers", num_layers),
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("vocab_size", vocab_size),
        ):
            check_positive_int(name, value)
        if hidden_size % num_heads:
            raise OdcUsageError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
        kv_heads = num_heads if num_kv_heads is None else check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % kv_heads:
            raise OdcUsageError(f"num_heads={num_heads} is not a multiple of num_kv_heads={kv_heads}")
        if intermediate_size is None:
            intermediate_size = 8 * hidden_size // 3 if gated_mlp else 4 * hidden_size
        check_positive_int("intermediate_size", intermediate_size)
        if not (isinstance(flops_per_second, numbers.Real) and flops_per_second > 0):
            raise OdcUsageError(f"flops_per_second must be > 0, got {flops_per_second!r}")

        h = hidden_size
        h_kv = kv_heads * (h // num_heads)
        mlp_matrices = 3 if gated_mlp else 2
        linear_per_layer = 2 * h * (h + 2 * h_kv) + 2 * h * h + mlp_matrices * 2 * h * intermediate_size
        forward_linear = num_layers * linear_per_layer + 2 * h * vocab_size
        forward_quadratic = num_layers * 4 * h * (0.5 if causal else 1.0)
        passes = 4.0 if activation_checkpointing else 3.0
        return cls(passes * forward_quadratic / flops_per_second, passes * forward_linear / flops_per_second)


def _fit_rows(
    lengths_per_microbatch: Sequence[Sequence[int]], seconds: Sequence[float]
) -> list[tuple[int, int, Fraction]]:
    """Validated (Σs², Σs, time) per measurement; the time as an exact fraction of the given float."""
    if len(lengths_per_microbatch) != len(seconds):
        raise OdcUsageError(f"CostModel.fit: {len(lengths_per_microbatch)} micro-batches but {len(seconds)} times")
    rows = []
    for j, (micro_batch, t) in enumerate(zip(lengths_per_microbatch, seconds, strict=True)):
        lens = check_lengths(micro_batch, what=f"lengths_per_microbatch[{j}]")
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise OdcUsageError(f"CostModel.fit: seconds[{j}] must be a finite number >= 0, got {t!r}")
        rows.append((sum(s * s for s in lens), sum(lens), Fraction(t)))
    if not any(s for _, s, _ in rows):
        raise OdcUsageError("CostModel.fit needs at least one non-empty micro-batch")
    return rows




# --------------------------------------------------------------------------------------------------- validation


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise OdcUsageError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_lengths(lengths: Iterable[int], what: str = "lengths") -> list[int]:
    if isinstance(lengths, (str, bytes)):
        raise OdcUsageError(f"{what} must be a sequence of positive ints, got {type(lengths).__name__}")
    out = []
    for i, s in enumerate(lengths):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise OdcUsageError(f"{what}[{i}] must be a positive int (a token count), got {s!r}")
        out.append(int(s))
    return out


#: Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads / 8 KV heads, SwiGLU 14336, vocab 128256):
#: attention and the linear part cost the same at about 57K tokens.
DEFAULT_COST_MODEL = CostModel.from_model_config(32, 4096, 32, 128256, intermediate_size=14336, num_kv_heads=8)
