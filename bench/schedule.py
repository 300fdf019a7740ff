"""The *schedule* of a load-imbalance benchmark: which rank runs which micro-batch, layer by layer, at which
modelled compute cost. A pure function of the sequence lengths, the balancing policy, the cost model and the
communication mode; the executor (:mod:`executor`) runs it with real processes, the simulator
(:mod:`simulate`) replays it with modelled GPU and network times.

Modes:

``collective`` (FSDP)
    Every rank runs the same number of micro-batches: ranks with fewer are padded with empty micro-batches
    (zero compute, but they still join every all-gather and reduce-scatter), because a collective needs every
    rank. Every layer of micro-batch step ``i`` is a barrier across ranks.
``odc``
    Ranks run only their own non-empty micro-batches (counts differ, zero allowed); the only barrier is the
    ``sync`` once per minibatch.

HSDP (``replicas`` R > 1, ``world_size`` = R × S): ranks ``g·S .. g·S+S-1`` form shard group ``g`` (the rows
of a (replicate, shard) device mesh); parameters are sharded within a shard group, so the per-layer traffic
(and, with collectives, the lockstep) stays inside it, and each minibatch ends with one all-reduce of every
rank's gradient shard across its replicate group (the ranks ``i, S+i, 2S+i, ...``). The planner still balances
over all R × S ranks: the all-reduce is a barrier across the replicas, so LB-Mini/LB-Micro over every rank is
what evens out the minibatch's end.

Per micro-batch, the program of one rank is FSDP's: forward layers ``0..L-1`` (gather the layer's parameters,
compute), then backward layers ``L-1..0`` (gather, compute, scatter the layer's gradient). The micro-batch's
cost (the sum of its sequences' costs, :class:`odc_runtime.balance.CostModel`, seconds on the modelled GPU)
is split evenly over the ``L`` layers, one third forward and two thirds backward. A gang micro-batch (a split
plan's :class:`~odc_runtime.split.Chunk`, ODC only) has the same program on each member, its cost the chunk's
compute (:func:`odc_runtime.split.chunk_cost` without the K/V term: the executor runs the exchange for real, the
simulator models it), and its tasks name the chunk, so that every layer also exchanges K/V within the gang.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from odc_runtime.balance import POLICY_REGISTRY, CostModel, get_policy, plan
from odc_runtime.bench._common import check_plan
from odc_runtime.split import Chunk, chunk_cost

#: The policies bench/imbalance.py runs by default: whole samples only (a split plan, e.g. lb_mini_split, runs
#: when asked for by name, ODC only: its gang micro-batches exchange K/V through odc_runtime.gang).
POLICIES = tuple(name for name, p in POLICY_REGISTRY.items() if not p.splits)
#: Every policy, split plans' gang micro-batches included: what the simulator replays and the executor can run.
SIMULATED_POLICIES = tuple(POLICY_REGISTRY)

COMMS = ("collective", "odc")
FORWARD_FRACTION = 1.0 / 3.0  # backward ≈ 2 × forward (activation and weight gradients)


def valid(comm: str, policy: str) -> bool:
    """Collectives need every rank to run the same number of micro-batches: only ODC can run a policy whose
    counts differ (``equal_counts=False`` in :data:`odc_runtime.balance.POLICY_REGISTRY`, e.g. lb_mini)."""
    return comm == "odc" or get_policy(policy).equal_counts


def grid(comms: Sequence[str] = COMMS, policies: Sequence[str] = POLICIES) -> list[tuple[str, str]]:
    """The valid (comm, policy) pairs, collective first."""
    return [(c, p) for c in comms for p in policies if valid(c, p)]


# --------------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape (Hugging Face config names)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False  # the LM head shares the input embedding's weights

    def cost_model(self, flops_per_second: float) -> CostModel:
        """Seconds per sequence (forward + backward) at ``flops_per_second`` achieved."""
        return CostModel.from_model_config(
            self.num_layers, self.hidden_size, self.num_heads, self.vocab_size,
            intermediate_size=self.intermediate_size, num_kv_heads=self.num_kv_heads,
            flops_per_second=flops_per_second,
        )

    def layer_params(self) -> int:
        """Parameters of one transformer layer (attention + gated MLP; norms ignored)."""
        h = self.hidden_size
        h_kv = self.num_kv_heads * (h // self.num_heads)
        return h * (h + 2 * h_kv) + h * h + 3 * h * self.intermediate_size

    def kv_token_bytes(self) -> int:
        """Bytes of K and V of one token in one layer (bf16): what a gang exchanges per token and layer."""
        return 2 * self.num_kv_heads * (self.hidden_size // self.num_heads) * 2

    def params(self) -> int:
        """All parameters: the layers, the input embedding and (untied) the LM head (norms, biases ignored)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params() + embeddings


#: Qwen2.5 shapes (the model family of the ODC paper's experiments), plus Llama-3-8B.
MODELS: dict[str, ModelSpec] = {
    "0.5b": ModelSpec("Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, tied_embeddings=True),
    "1.5b": ModelSpec("Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, tied_embeddings=True),
    "7b": ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064),
    "8b": ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256),
    "14b": ModelSpec("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064),
    "32b": ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064),
}

#: Dense bf16 peak FLOP/s.
GPU_PEAK_FLOPS: dict[str, float] = {"h100": 989e12, "h200": 989e12, "a100": 312e12}


def cost_model_for(model: str, gpu: str, mfu: float) -> CostModel:
    return MODELS[model].cost_model(GPU_PEAK_FLOPS[gpu] * mfu)


# --------------------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class MicroBatch:
    samples: tuple[int, ...]  # indices into the whole stream of lengths
    tokens: int
    cost_s: float  # modelled seconds of forward + backward over all layers; 0 for a padded empty micro-batch
    chunk: Chunk | None = None  # a gang micro-batch (lb_mini_split): this rank's chunk; cost_s is its compute only

    @property
    def empty(self) -> bool:
        return not self.samples


@dataclass(frozen=True)
class Minibatch:
    ranks: tuple[tuple[MicroBatch, ...], ...]  # ranks[r] = rank r's micro-batches in execution order

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mbs in self.ranks for mb in mbs)


@dataclass(frozen=True)
class Task:
    """One layer of one micro-batch on one rank: gather the layer, compute, maybe scatter its gradient."""

    micro_batch: int  # index in the rank's micro-batch list
    layer: int
    phase: str  # "fwd" | "bwd"
    compute_s: float
    scatter: bool  # backward tasks push / reduce-scatter the layer's gradient
    empty: bool  # padded micro-batch: a zero gradient
    chunk: Chunk | None = None  # a gang micro-batch's layer: it also exchanges K/V (fwd) or dK/dV (bwd)


@dataclass(frozen=True)
class Schedule:
    comm: str
    policy: str
    world_size: int
    num_layers: int
    minibatches: tuple[Minibatch, ...]
    replicas: int = 1  # HSDP: replicate groups; 1 = parameters sharded over every rank
    oversized: int = 0  # samples longer than the token cap, each planned alone (allow_oversized)

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.minibatches)

    @property
    def shard_size(self) -> int:
        """Ranks a layer's parameters are sharded over (the shard group's size)."""
        return self.world_size // self.replicas

    def shard_groups(self) -> list[list[int]]:
        """Global ranks of each shard group (contiguous blocks of :attr:`shard_size`)."""
        s = self.shard_size
        return [list(range(g * s, (g + 1) * s)) for g in range(self.replicas)]

    def program(self, minibatch: int, rank: int) -> list[Task]:
        """The tasks rank ``rank`` runs in minibatch ``minibatch``, in order."""
        return [task for i, mb in enumerate(self.minibatches[minibatch].ranks[rank])
                for task in micro_batch_tasks(i, self.num_layers, mb.cost_s, empty=mb.empty, chunk=mb.chunk)]

    def digest(self) -> str:
        """Hash of the schedule (ranks check they all built the same one)."""
        blob = json.dumps([self.comm, self.policy, self.world_size, self.replicas, self.num_layers,
                           [[[list(m.samples) for m in mbs] for mbs in mb.ranks] for mb in self.minibatches]])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def micro_batch_tasks(index: int, num_layers: int, cost_s: float = 0.0, *, empty: bool = False,
                      chunk: Chunk | None = None) -> list[Task]:
    """FSDP's program of micro-batch ``index``: forward layers ``0..L-1``, then backward ``L-1..0`` (each scatters
    its gradient); ``cost_s`` split evenly over the layers, :data:`FORWARD_FRACTION` of it forward."""
    fwd = cost_s * FORWARD_FRACTION / num_layers
    bwd = cost_s * (1.0 - FORWARD_FRACTION) / num_layers
    return ([Task(index, layer, "fwd", fwd, False, empty, chunk) for layer in range(num_layers)]
            + [Task(index, layer, "bwd", bwd, True, empty, chunk) for layer in reversed(range(num_layers))])


def build_schedule(
    minibatch_lengths: Sequence[Sequence[int]],
    world_size: int,
    *,
    comm: str,
    policy: str,
    cost: CostModel,
    max_tokens: int,
    num_layers: int,
    replicas: int = 1,
    allow_oversized: bool = False,
) -> Schedule:
    """Plan every minibatch with ``policy`` over all ``world_size`` ranks and lay it out for ``comm`` (see the
    module docstring); ``replicas`` > 1 is HSDP with shard groups of ``world_size // replicas`` ranks.

    A sample longer than ``max_tokens`` raises :class:`odc_runtime.errors.OdcUsageError` (a job could not train
    it), or with ``allow_oversized`` gets a micro-batch of its own and is counted in ``Schedule.oversized`` so
    that reports can flag it. The result is checked (:func:`check_schedule`) before it is returned, so no
    benchmark times a wrong schedule.
    """
    if comm not in COMMS:
        raise ValueError(f"unknown comm {comm!r}; choose from {COMMS}")
    if not valid(comm, policy):
        raise ValueError(f"policy {policy!r} gives ranks different micro-batch counts: collectives cannot run it")
    if replicas < 1 or world_size % replicas:
        raise ValueError(f"HSDP needs world_size ({world_size}) = replicas ({replicas}) × shard size")
    minibatches = []
    offset = 0
    for lengths in minibatch_lengths:
        p = plan(list(lengths), world_size, max_tokens=max_tokens, policy=policy, cost=cost,
                 allow_oversized=allow_oversized)
        ranks = []
        for rank_mbs in p:
            mbs = [
                MicroBatch((offset + mb[0].sample,), mb[0].tokens, chunk_cost(mb[0], cost, kv_ratio=0.0), mb[0])
                if mb and isinstance(mb[0], Chunk)
                else MicroBatch(
                    samples=tuple(offset + i for i in mb),
                    tokens=sum(lengths[i] for i in mb),
                    cost_s=cost.cost_of(lengths[i] for i in mb),
                )
                for mb in rank_mbs
            ]
            if comm == "odc":
                mbs = [m for m in mbs if not m.empty]  # nothing to do, nothing to wait for
            ranks.append(mbs)
        if comm == "collective":
            depth = max(len(r) for r in ranks)
            ranks = [r + [MicroBatch((), 0, 0.0)] * (depth - len(r)) for r in ranks]
        minibatches.append(Minibatch(tuple(tuple(r) for r in ranks)))
        offset += len(lengths)
    over = sum(1 for lengths in minibatch_lengths for s in lengths if s > max_tokens)
    schedule = Schedule(comm, policy, world_size, num_layers, tuple(minibatches), replicas, over)
    check_schedule(schedule, minibatch_lengths, max_tokens=max_tokens)
    return schedule


def check_schedule(schedule: Schedule, minibatch_lengths: Sequence[Sequence[int]], *, max_tokens: int) -> None:
    """Raise ``RuntimeError`` unless every minibatch places each of its samples exactly once within the token
    cap (:func:`_common.check_plan`), with equal micro-batch counts under ``collective``, only non-empty
    micro-batches under ``odc``, and token counts and costs that match the samples."""
    if len(schedule.minibatches) != len(minibatch_lengths):
        raise RuntimeError(f"schedule has {len(schedule.minibatches)} minibatches, expected {len(minibatch_lengths)}")
    offset = 0
    for k, (mb, lengths) in enumerate(zip(schedule.minibatches, minibatch_lengths, strict=True)):
        what = f"{schedule.comm}/{schedule.policy} minibatch {k}"
        local = [[[m.chunk] if m.chunk else [i - offset for i in m.samples] for m in mbs] for mbs in mb.ranks]
        check_plan(local, lengths, world_size=schedule.world_size, max_tokens=max_tokens,
                   equal_counts=schedule.comm == "collective", what=what)
        if schedule.comm == "odc" and any(m.empty for mbs in mb.ranks for m in mbs):
            raise RuntimeError(f"{what}: ODC schedule holds an empty micro-batch")
        for m, ids in zip((m for mbs in mb.ranks for m in mbs), (ids for rank in local for ids in rank), strict=True):
            tokens = m.chunk.tokens if m.chunk else sum(lengths[i] for i in ids)
            if m.tokens != tokens or (m.empty and m.cost_s != 0.0):
                raise RuntimeError(f"{what}: a micro-batch's token count or cost does not match its samples")
        offset += len(lengths)
