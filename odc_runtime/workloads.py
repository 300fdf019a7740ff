"""Sequence-length presets for planning, benchmarks and simulation.

Each preset models one kind of post-training data; its docstring (also in ``PRESETS``) says what it
models, where its range and mean come from and which parameters were chosen by hand. No raw dataset is
shipped or downloaded: the long-tailed presets are clipped log-normals *moment-matched* to a target mean
(``TARGET_MEANS``): the spread ``sigma`` is set by hand to give a long right tail, and ``mu`` is solved so
that the mean *after clipping* equals the target. Every preset's range (``MAX_LENGTHS``) fits a 64K-token
micro-batch, the benchmarks' default cap, so every sample it draws can be trained there. Use
``load_lengths`` to plan with real lengths instead.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from odc_runtime.errors import OdcUsageError

__all__ = ["MAX_LENGTHS", "PRESETS", "TARGET_MEANS", "load_lengths", "sample_lengths"]


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@dataclass(frozen=True)
class _ClippedLogNormal:
    """``shift + clip(exp(mu + sigma·Z), lo, hi)`` with ``mu`` solved so that the mean is ``mean``."""

    mean: float
    sigma: float
    lo: float
    hi: float
    shift: float = 0.0  # a floor under the whole distribution (e.g. a dataset's minimum length)
    mu: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mu", self._solve_mu())

    @property
    def max_length(self) -> float:
        return self.shift + self.hi

    def clipped_mean(self, mu: float) -> float:
        """Closed form of E[clip(X, lo, hi)] for X log-normal(mu, sigma)."""
        s = self.sigma
        alpha, beta = (math.log(self.lo) - mu) / s, (math.log(self.hi) - mu) / s
        inside = math.exp(mu + s * s / 2) * (_normal_cdf(beta - s) - _normal_cdf(alpha - s))
        return self.lo * _normal_cdf(alpha) + inside + self.hi * (1.0 - _normal_cdf(beta))

    def _solve_mu(self) -> float:
        # The clipped mean increases with mu from lo to hi: bisection on [log lo - 10s, log hi + 10s].
        lo_mu, hi_mu = math.log(self.lo) - 10 * self.sigma, math.log(self.hi) + 10 * self.sigma
        for _ in range(200):
            mid = (lo_mu + hi_mu) / 2
            lo_mu, hi_mu = (mid, hi_mu) if self.shift + self.clipped_mean(mid) < self.mean else (lo_mu, mid)
        return (lo_mu + hi_mu) / 2

    def draw(self, rng: random.Random) -> float:
        return self.shift + min(max(rng.lognormvariate(self.mu, self.sigma), self.lo), self.hi)


_LONGALIGN = _ClippedLogNormal(mean=16_500, sigma=1.0, lo=1, hi=65_536 - 8_192, shift=8_192)
_SWE = _ClippedLogNormal(mean=35_000, sigma=0.5, lo=2_048, hi=65_536)
_RL_PROMPT = _ClippedLogNormal(mean=1_000, sigma=0.7, lo=64, hi=4_096)
_RL_RESPONSE = _ClippedLogNormal(mean=5_000, sigma=1.0, lo=16, hi=28_672)
_UNIFORM = (256, 8_192)


def _longalign_sft(rng: random.Random) -> float:
    """Long-context SFT (LongAlign-10k): mean ≈ 16.5K tokens, 8K to 64K (8,192 to 65,536).

    The range is LongAlign-10k's: 10,000 long instruction samples of 8K to 64K tokens (Bai et al., "LongAlign:
    A Recipe for Long Context Alignment of Large Language Models", 2024); the mean 16.5K is the figure the
    project's design brief gives for this data. 8K plus a log-normal excess clipped at 56K, sigma = 1.0 chosen
    by hand (median ≈ 13K, about 1% at the 64K top); mu solved for the mean.
    """
    return _LONGALIGN.draw(rng)


def _swe_agentic(rng: random.Random) -> float:
    """Agentic software-engineering traces (multi-turn tool use): mean ≈ 35K tokens, 2K to 64K (65,536).

    The mean 35K is the figure the project's design brief gives for such traces; the 64K top is a training
    context of 64K (longer traces are truncated to it, so about 8% sit at exactly 64K), chosen so that every
    trace fits the benchmarks' 64K micro-batch, not measured. Clipped log-normal, sigma = 0.5 chosen by hand
    (median ≈ 32K); mu solved so the clipped mean is 35K.
    """
    return _SWE.draw(rng)


def _rl_rollouts(rng: random.Random) -> float:
    """RL rollouts: prompt + generated response, mean ≈ 6K tokens, long tail up to 32K (32,768).

    Sum of two independent clipped log-normals, each moment-matched: prompt mean 1K (sigma 0.7, 64 to 4K),
    response mean 5K (sigma 1.0, 16 to 28K, a max_new_tokens limit). Chosen inside the 4–8K mean range the
    design brief gives for RL rollouts; the response, not the prompt, makes the tail.
    """
    return _RL_PROMPT.draw(rng) + _RL_RESPONSE.draw(rng)


def _uniform(rng: random.Random) -> float:
    """Uniform integer lengths from 256 to 8192 tokens (mean 4224), for tests: no tail, nothing fitted."""
    return rng.randint(*_UNIFORM)


_SAMPLERS: dict[str, Callable[[random.Random], float]] = {
    "longalign_sft": _longalign_sft,
    "swe_agentic": _swe_agentic,
    "rl_rollouts": _rl_rollouts,
    "uniform": _uniform,
}

#: Preset name → what it models and how it was fitted (the sampler's docstring).
PRESETS: dict[str, str] = {name: inspect.getdoc(fn) or "" for name, fn in _SAMPLERS.items()}

#: Preset name → the longest sample it can draw (tokens, at ``scale=1``).
MAX_LENGTHS: dict[str, int] = {
    "longalign_sft": int(_LONGALIGN.max_length),
    "swe_agentic": int(_SWE.max_length),
    "rl_rollouts": int(_RL_PROMPT.hi + _RL_RESPONSE.hi),
    "uniform": _UNIFORM[1],
}

#: Preset name → the mean length (tokens, at ``scale=1``) its parameters were matched to.
TARGET_MEANS: dict[str, float] = {
    "longalign_sft": _LONGALIGN.mean,
    "swe_agentic": _SWE.mean,
    "rl_rollouts": _RL_PROMPT.mean + _RL_RESPONSE.mean,
    "uniform": sum(_UNIFORM) / 2,
}


def sample_lengths(preset: str, n: int, *, seed: int, max_len: int | None = None, scale: float = 1.0) -> list[int]:
    """``n`` sequence lengths (positive ints) drawn from ``preset``; the same arguments give the same list.

    ``scale`` multiplies every length (e.g. ``1/16`` for a CPU benchmark) keeping the shape; ``max_len``
    then clips lengths to at most that many tokens. Uses only ``random.Random(seed)``.
    """
    if preset not in _SAMPLERS:
        raise OdcUsageError(f"unknown preset {preset!r}; valid presets: {', '.join(_SAMPLERS)}")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise OdcUsageError(f"n must be an int >= 0, got {n!r}")
    if not (isinstance(scale, numbers.Real) and math.isfinite(scale) and scale > 0):
        raise OdcUsageError(f"scale must be a finite number > 0, got {scale!r}")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len < 1):
        raise OdcUsageError(f"max_len must be a positive int or None, got {max_len!r}")
    rng = random.Random(seed)
    draw = _SAMPLERS[preset]
    cap = math.inf if max_len is None else int(max_len)
    return [int(min(max(1, round(draw(rng) * scale)), cap)) for _ in range(n)]


def load_lengths(path: str | Path) -> list[int]:
    """Read sequence lengths from a JSON list, or from text with one int per line (``#`` starts a comment)."""
    path = Path(path)
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise OdcUsageError(f"{path}: not a valid JSON list of lengths: {exc}") from exc
        entries = [(f"entry {i}", v) for i, v in enumerate(values)]
    else:
        entries = []
        for lineno, line in enumerate(text.splitlines(), 1):
            token = line.split("#", 1)[0].strip()
            if token:
                entries.append((f"line {lineno}", _parse_int(token)))
    for where, v in entries:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise OdcUsageError(f"{path}, {where}: expected a positive int (a token count), got {v!r}")
    return [v for _, v in entries]


def _parse_int(token: str) -> int | str:
    """The int a text line holds, or the raw text (rejected with its line number by the caller)."""
    try:
        return int(token)
    except ValueError:
        return token
