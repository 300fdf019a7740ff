"""Gang attention: the K/V exchange between the ranks that run the chunks of one split sample.

A sample split by ``lb_mini_split`` (:mod:`odc_runtime.split`) runs as one micro-batch on the ranks of its *gang*:
member ``p`` holds chunk ``p`` (some of the sample's tokens, at their global positions). Causal attention needs
every earlier token's K/V, so at every layer each member gives its K/V to the others and, in the backward pass,
returns to each owner the gradient with respect to that owner's K/V (dK/dV). :func:`exchange_kv` is that exchange
as one differentiable operation: forward = gather the gang's K/V, backward = sum each owner's dK/dV contributions.
The attention itself is ordinary differentiable code over the gathered K/V with a mask from global positions, so
the split sample's loss and gradients are the unsplit computation's up to floating-point reassociation.

Mechanism. Everything goes through the transport's signalled put (:meth:`Transport.put_signal` /
:meth:`Transport.wait_signal`), the one point-to-point ordering guarantee the transport interface defines: a
receiver that sees the signal word reach a count sees the data of every put counted in it. A one-sided ``get`` of
the owner's own region would need the owner's local write to be visible to a peer without a fence, which the
interface only promises after a (world-wide) barrier. So member ``s`` *puts* its K/V at layer ``l`` into its next
slot of every other member's ``kv`` buffer (a ring of ``depth`` slots per sender), plus a tag (gang, sample,
length, layer, direction, pass) into the matching tag slot, each put adding 1 to word ``s`` of the receiver's signal
buffer; the backward puts dK/dV into the owner's ``dkv`` buffer the same way, counted in word ``world_size + s``.
A receiver that copied a slot out returns a *credit* (a signalled put into the sender's ``acks``); a sender
reuses a slot only after the credit of its previous use. Only gang members signal one another: no barrier, no
collective. Every wait is bounded by the transport's timeout (``ODC_TIMEOUT``) and raises
:class:`~odc_runtime.errors.OdcTimeoutError` (or :class:`~odc_runtime.errors.OdcPeerLostError`) naming the gang,
the sample, the layer and the rank that did not deliver; a tag that does not match (ranks running different plans
or layers) raises :class:`~odc_runtime.errors.OdcMismatchError`. Owners sum contributions in member order, so the
result is deterministic.

No host synchronisation per layer. On the GPU ``put_signal``/``wait_signal`` are stream-ordered, so the exchange
must not read device memory on the host inside the layer loop: every put reads its source from a small symmetric
*stage* (so a peer on another node, reached by the network, which reads registered memory only, is served too), the
tags of a step are made on the device once, and received tags are copied aside and compared in one read at the end
of the pass (when the ``with step:`` block ends for the forward pass, after layer 0 for the backward pass, and
before a wait error is raised, so a mismatch is named as such rather than as the timeout it leads to).

Activation checkpointing. A checkpointed layer runs its forward pass again during the backward pass; that
recomputation exchanges K/V again (tagged as a recomputation), in the same order on every member since they run
the same model, so the ordering argument is unchanged. The recomputation runs outside the ``with step:`` block (and
on the GPU on autograd's device thread), so :func:`active_step` also returns the step whose forward pass completed
last while autograd is running a backward pass. Run each gang micro-batch's backward pass before the next
micro-batch's forward pass (as a training loop does).

Ordering and why it cannot deadlock (docs/design.md, "Splitting outlier sequences"): a member sends before it
waits for its peers' data, at every layer in both directions, and the only wait before a send is for a credit
that the peer returns as soon as it consumed an *earlier* exchange; every rank runs its gang micro-batches first,
in increasing gang number; slots are per sender, so gangs sharing a receiver never write the same slot.

Memory: ``(2 · world_size · depth + 1) · 2 · max_chunk_tokens · kv_features`` elements of symmetric memory per rank
(K and V slots, forward and backward, and the stage), plus small tag, credit and signal buffers.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging

import torch

from odc_runtime.errors import OdcError, OdcMismatchError, OdcUsageError
from odc_runtime.split import Chunk
from odc_runtime.transport.base import PutRequest, SymmetricBuffer, Transport

__all__ = ["GangExchange", "GangStep", "active_step", "causal_mask", "exchange_kv", "gang_attention"]

log = logging.getLogger(__name__)

_TAG_WORDS = 6  # gang, sample, length, layer, direction, pass
_FORWARD, _BACKWARD = 0, 1  # directions: K/V to the gang, dK/dV back to their owners
# Passes: what an exchange belongs to, in the tag; the direction follows from it.
_FIRST, _RECOMPUTE, _GRAD = 0, 1, 2
_DIRECTION = (_FORWARD, _FORWARD, _BACKWARD)
_ACTIVE: contextvars.ContextVar[GangStep | None] = contextvars.ContextVar("odc_gang_step", default=None)
# The step whose forward pass completed last: a checkpointed layer recomputes under it during the backward pass,
# which runs outside its `with step:` block (and on the GPU on another thread, so not a context variable).
_PENDING: GangStep | None = None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (what torch.utils.checkpoint asks too)."""
    return torch._C._current_graph_task_id() != -1


def _runtime_transport() -> Transport:
    import odc_runtime.api as api

    if api._runtime is None:
        raise OdcUsageError("odc gang: call odc_runtime.init() first (or pass transport=)")
    return api._runtime.transport


class GangExchange:
    """Symmetric buffers for the K/V exchange of gang micro-batches; create once, reuse for every gang.

    Collective: every rank constructs it with the same arguments, in the same order relative to other
    allocations. ``num_layers``: attention layers per forward pass; ``max_chunk_tokens``: the most tokens of a
    chunk (the planner's ``max_tokens``); ``kv_features``: elements of K (and of V) per token on one rank
    (``num_kv_heads · head_dim``); ``dtype``: the dtype of K/V. ``transport`` defaults to the initialised runtime's.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        max_chunk_tokens: int,
        kv_features: int,
        dtype: torch.dtype = torch.float32,
        depth: int = 2,
        transport: Transport | None = None,
    ) -> None:
        for name, value in (("num_layers", num_layers), ("max_chunk_tokens", max_chunk_tokens),
                            ("kv_features", kv_features), ("depth", depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OdcUsageError(f"GangExchange: {name} must be a positive int, got {value!r}")
        self.transport = transport if transport is not None else _runtime_transport()
        self.num_layers, self.max_chunk_tokens, self.kv_features, self.dtype, self.depth = (
            num_layers, max_chunk_tokens, kv_features, dtype, depth)
        w = self.transport.world_size
        self.slot = 2 * max_chunk_tokens * kv_features
        self.kv = self.transport.alloc(w * depth * self.slot, dtype, "gang.kv")
        self.dkv = self.transport.alloc(w * depth * self.slot, dtype, "gang.dkv")
        self.tags = self.transport.alloc(2 * w * depth * _TAG_WORDS, torch.int64, "gang.tags")
        self.acks = self.transport.alloc(2 * w, torch.int64, "gang.acks")
        # Sources of every put (data, then a tag and a credit word): symmetric, so network puts can read them;
        # reused in stream order, since a put has read its source before anything later on the stream runs.
        self.stage = self.transport.alloc(self.slot, dtype, "gang.stage")
        self.stage_words = self.transport.alloc(_TAG_WORDS + 1, torch.int64, "gang.stage_words")
        # Words [d·W + s]: puts from sender s in direction d (data and tag: +2 per layer); [(2 + d)·W + r]: credits
        # from receiver r (+1 per layer it consumed). Words only grow; both sides keep running counts per pair.
        self.signal = self.transport.alloc(4 * w, torch.int64, "gang.signal")
        self._sent = [[0] * w for _ in range(2)]  # [direction][peer]: layers this rank put to peer
        self._received = [[0] * w for _ in range(2)]  # [direction][peer]: layers this rank consumed from peer

    @property
    def rank(self) -> int:
        return self.transport.rank

    def step(self, chunk: Chunk) -> GangStep:
        """The exchange state of this rank's gang micro-batch ``chunk``; use as ``with exchange.step(c):``."""
        return GangStep(self, chunk)

    def free(self) -> None:
        """Collective: release the buffers."""
        for buf in (self.signal, self.stage_words, self.stage, self.acks, self.tags, self.dkv, self.kv):
            self.transport.free(buf)

    def _slot(self, sender: int, n: int) -> int:
        """Offset of sender's slot for its ``n``-th exchange with this receiver (a ring of ``depth``)."""
        return (sender * self.depth + n % self.depth) * self.slot

    def _tag_offset(self, direction: int, sender: int, n: int) -> int:
        return ((direction * self.transport.world_size + sender) * self.depth + n % self.depth) * _TAG_WORDS


class GangStep:
    """One gang micro-batch on this rank: the chunk, its gang, and which layers exchanged so far.

    ``with step:`` makes it the active step (what :func:`active_step` and the Hugging Face attention function
    use); leaving the block after a forward pass that did not exchange at every layer raises
    :class:`~odc_runtime.errors.OdcUsageError` (the model's attention is not the gang's), and a tag mismatch seen
    in the forward pass raises :class:`~odc_runtime.errors.OdcMismatchError` there.
    """

    def __init__(self, exchange: GangExchange, chunk: Chunk) -> None:
        if not isinstance(chunk, Chunk):
            raise OdcUsageError(f"odc gang: expected a Chunk, got {type(chunk).__name__}")
        rank, world = exchange.rank, exchange.transport.world_size
        if chunk.ranks[chunk.part] != rank or any(not 0 <= r < world for r in chunk.ranks):
            raise OdcUsageError(f"odc gang {chunk.gang}: chunk {chunk.part} of sample {chunk.sample} belongs to "
                                f"rank {chunk.ranks[chunk.part]} of ranks {chunk.ranks}, not to rank {rank}")
        self.exchange = exchange
        self.chunk = chunk
        self.members = chunk.ranks
        parts = [dataclasses.replace(chunk, part=p) for p in range(chunk.parts)]  # every member's chunk
        self.counts = [c.tokens for c in parts]
        if max(self.counts) > exchange.max_chunk_tokens:
            raise OdcUsageError(f"odc gang {chunk.gang}: a chunk of {max(self.counts)} tokens exceeds the "
                                f"exchange's max_chunk_tokens={exchange.max_chunk_tokens}")
        positions = [c.positions() for c in parts]
        device = exchange.transport.device
        #: Global positions of this chunk's tokens (on the transport's device).
        self.positions = torch.tensor(positions[chunk.part], dtype=torch.long, device=device)
        #: Global positions of the gathered K/V rows (members' chunks in member order).
        self.kv_positions = torch.tensor([t for ps in positions for t in ps], dtype=torch.long, device=device)
        # Every tag this step sends, made on the device once: row pass · num_layers + layer.
        self._tags = torch.tensor([self._tag(layer, p) for p in (_FIRST, _RECOMPUTE, _GRAD)
                                   for layer in range(exchange.num_layers)], dtype=torch.int64, device=device)
        self._next_layer = 0  # first pass: the next layer to exchange
        self._recomputed: set[int] = set()  # layers whose forward ran again (activation checkpointing)
        self._received: list[tuple[torch.Tensor, int, int, int]] = []  # (tag copy, pass, layer, peer), unchecked
        self._token = None

    def _tag(self, layer: int, pass_: int) -> list[int]:
        c = self.chunk
        return [c.gang, c.sample, c.length, layer, _DIRECTION[pass_], pass_]

    def __enter__(self) -> GangStep:
        global _PENDING
        _PENDING = None  # a new micro-batch: the previous one's backward pass is over
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        global _PENDING
        _ACTIVE.reset(self._token)
        if exc_type is not None:
            return
        self._verify()
        if self._next_layer != self.exchange.num_layers:
            raise OdcUsageError(
                f"odc gang {self.chunk.gang}: the forward pass exchanged K/V at {self._next_layer} of "
                f"{self.exchange.num_layers} layers; every attention layer must run the gang attention "
                "(Hugging Face: odc_runtime.integrations.hf_gang.enable(model))"
            )
        _PENDING = self

    def _what(self, layer: int, pass_: int, peer: int) -> str:
        kind = ("forward K/V", "recomputed forward K/V", "backward dK/dV")[pass_]
        return f"gang {self.chunk.gang} (sample {self.chunk.sample}) layer {layer}: {kind} from rank {peer}"

    def _verify(self) -> None:
        """Compare every received tag not yet checked with the expected one: one device-to-host read."""
        if not self._received:
            return
        received, self._received = self._received, []
        got = torch.stack([t for t, *_ in received]).tolist()
        for tag, (_, pass_, layer, peer) in zip(got, received, strict=True):
            if tag != self._tag(layer, pass_):
                raise OdcMismatchError(
                    f"odc {self._what(layer, pass_, peer)}: it sent (gang, sample, length, layer, direction, pass) = "
                    f"{tag}, this rank expected {self._tag(layer, pass_)}; the ranks run different plans or models"
                )

    def _send(self, buf: SymmetricBuffer, pass_: int, layer: int, rows: torch.Tensor | dict[int, torch.Tensor]) -> None:
        """Put the rows (one tensor for every peer, or one per peer) into every peer's next slot for this rank, then
        the tag; both counted in one word. Sources go through the stage.

        A slot is reused ``depth`` exchanges later, once the peer's credit says it consumed the previous one."""
        ex, me, w = self.exchange, self.exchange.rank, self.exchange.transport.world_size
        direction = _DIRECTION[pass_]
        word = direction * w + me
        order = [self.members[(self.chunk.part + i) % len(self.members)] for i in range(1, len(self.members))]
        sent = {p: ex._sent[direction][p] for p in order}
        for p in order:
            if sent[p] >= ex.depth:  # the slot's previous use must be consumed: wait for that credit
                what = self._what(layer, pass_, p).replace(" from rank ", ": credit (slot free) from rank ")
                self._wait(ex.signal, (2 + direction) * w + p, sent[p] - ex.depth + 1, what, p)
        stage = ex.stage.local
        if isinstance(rows, torch.Tensor):  # the same rows for everyone: staged once
            src = stage[: rows.numel()]
            src.copy_(rows.reshape(-1))
            ex.transport.put_signal(buf, [PutRequest(p, src, ex._slot(me, sent[p]), word) for p in order], ex.signal)
        else:  # rows per peer: staged and put one peer after the other (a put has read its source before the next)
            for p in order:
                src = stage[: rows[p].numel()]
                src.copy_(rows[p].reshape(-1))
                ex.transport.put_signal(buf, [PutRequest(p, src, ex._slot(me, sent[p]), word)], ex.signal)
        tag = ex.stage_words.local[:_TAG_WORDS]
        tag.copy_(self._tags[pass_ * ex.num_layers + layer])
        ex.transport.put_signal(
            ex.tags, [PutRequest(p, tag, ex._tag_offset(direction, me, sent[p]), word) for p in order], ex.signal)
        for p in order:
            ex._sent[direction][p] += 1

    def _wait(self, signal: SymmetricBuffer, index: int, value: int, what: str, peer: int) -> None:
        """A bounded wait; a tag mismatch seen before it gave up is the error to report (it is the cause)."""
        try:
            self.exchange.transport.wait_signal(signal, index, value, what, [peer])
        except OdcError as e:
            self._verify()
            raise e from None

    def _receive(self, buf: SymmetricBuffer, pass_: int, layer: int, peer: int, numel: int) -> torch.Tensor:
        """Wait for ``peer``'s put of this layer and pass; a copy of its data (its tag is checked later)."""
        ex, w = self.exchange, self.exchange.transport.world_size
        direction = _DIRECTION[pass_]
        n = ex._received[direction][peer]
        self._wait(ex.signal, direction * w + peer, 2 * (n + 1), self._what(layer, pass_, peer), peer)
        t = ex._tag_offset(direction, peer, n)
        self._received.append((ex.tags.local[t : t + _TAG_WORDS].clone(), pass_, layer, peer))
        offset = ex._slot(peer, n)
        data = buf.local[offset : offset + numel].clone()
        ex._received[direction][peer] = n + 1
        # Credit: the slot is free again (the copies above are ordered before the put, on the stream on GPU).
        me = ex.rank
        credit = ex.stage_words.local[_TAG_WORDS:]
        credit.fill_(n + 1)
        ex.transport.put_signal(ex.acks, [PutRequest(peer, credit, direction * w + me, (2 + direction) * w + me)],
                                ex.signal)
        return data

    def _forward(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ex = self.exchange
        first = self._next_layer < ex.num_layers
        if active_step() is not self or (layer != self._next_layer if first else
                                          not 0 <= layer < ex.num_layers or layer in self._recomputed):
            raise OdcUsageError(
                f"odc gang {self.chunk.gang}: K/V exchange for layer {layer}, expected "
                + (f"layer {self._next_layer}" if first else "a layer not yet recomputed")
                + " inside `with step:` or its backward pass (one exchange per layer, in order; a checkpointed layer "
                "may run its forward pass once more in the backward pass)"
            )
        n, f = self.counts[self.chunk.part], ex.kv_features
        for name, t in (("k", k), ("v", v)):
            if t.dtype != ex.dtype or t.shape[0] != n or t[0].numel() != f:
                raise OdcUsageError(
                    f"odc gang {self.chunk.gang} layer {layer}: {name} is {tuple(t.shape)} {t.dtype}, expected "
                    f"({n}, ...) with {f} elements per token, {ex.dtype}"
                )
        pass_ = _FIRST if first else _RECOMPUTE
        self._send(ex.kv, pass_, layer, torch.cat([k.reshape(n, f), v.reshape(n, f)]))
        ks, vs = [], []
        for p, peer in enumerate(self.members):
            if p == self.chunk.part:
                ks.append(k.reshape(n, f))
                vs.append(v.reshape(n, f))
                continue
            data = self._receive(ex.kv, pass_, layer, peer, 2 * self.counts[p] * f).view(2, self.counts[p], f)
            ks.append(data[0])
            vs.append(data[1])
        if first:
            self._next_layer += 1
        else:
            self._recomputed.add(layer)
        shape = (-1, *k.shape[1:])
        return torch.cat(ks).reshape(shape), torch.cat(vs).reshape(shape)

    def _backward(self, layer: int, dk_all: torch.Tensor, dv_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        global _PENDING
        ex, f = self.exchange, self.exchange.kv_features
        dk_rows = dk_all.reshape(-1, f).to(ex.dtype).split(self.counts)
        dv_rows = dv_all.reshape(-1, f).to(ex.dtype).split(self.counts)
        rows = {peer: torch.cat([dk_rows[p], dv_rows[p]])
                for p, peer in enumerate(self.members) if p != self.chunk.part}
        self._send(ex.dkv, _GRAD, layer, rows)
        me, n = self.chunk.part, self.counts[self.chunk.part]
        total = torch.cat([dk_rows[me], dv_rows[me]])
        for p, peer in enumerate(self.members):  # member order: a deterministic sum
            if p != me:
                total = total + self._receive(ex.dkv, _GRAD, layer, peer, 2 * n * f).view(2 * n, f)
        if layer == 0:  # the last layer of the backward pass
            if _PENDING is self:
                _PENDING = None
            self._verify()
        shape = (n, *dk_all.shape[1:])
        return total[:n].reshape(shape), total[n:].reshape(shape)


class _ExchangeKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, step: GangStep, layer: int) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        ctx.step, ctx.layer = step, layer
        return step._forward(layer, k.detach(), v.detach())

    @staticmethod
    def backward(ctx, dk_all: torch.Tensor, dv_all: torch.Tensor) -> tuple:  # noqa: ANN001
        dk, dv = ctx.step._backward(ctx.layer, dk_all, dv_all)
        return dk, dv, None, None


def exchange_kv(step: GangStep, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gang's K/V at ``layer``: ``k``, ``v`` (this chunk's ``(tokens, ...)``) gathered from every member in
    member order (rows at global positions ``step.kv_positions``). Differentiable: the backward pass sends every
    owner its dK/dV and returns this rank's, summed over the gang."""
    return _ExchangeKV.apply(k, v, step, layer)


def active_step() -> GangStep | None:
    """The gang step of the enclosing ``with step:`` block; during a backward pass, the step whose forward pass
    completed last (a checkpointed layer recomputing), unless a forward pass outside any gang step asked since
    (the step ran forward only, e.g. under ``torch.no_grad()``); else ``None``."""
    global _PENDING
    step = _ACTIVE.get()
    if step is not None or _PENDING is None:
        return step
    if _in_backward():
        return _PENDING
    _PENDING = None  # a forward pass outside any gang step: the last step ran forward only, or its backward is over
    return None


def causal_mask(step: GangStep) -> torch.Tensor:
    """``mask[i, j]``: query ``i`` of this chunk may attend to gathered K/V row ``j`` (global causal order)."""
    return step.positions[:, None] >= step.kv_positions[None, :]


def gang_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: GangStep, layer: int, *, scale: float | None = None
) -> torch.Tensor:
    """Exact causal attention of this chunk's queries over the whole split sample.

    ``q``: ``(heads, tokens, head_dim)``; ``k``, ``v``: ``(kv_heads, tokens, head_dim)`` (grouped-query attention
    when ``kv_heads`` divides ``heads``). Returns ``(heads, tokens, head_dim)``.
    """
    hkv = k.shape[0]
    k_all, v_all = exchange_kv(step, layer, k.transpose(0, 1), v.transpose(0, 1))  # (tokens, kv_heads, d)
    k_all, v_all = k_all.transpose(0, 1), v_all.transpose(0, 1)
    groups = q.shape[0] // hkv
    if groups * hkv != q.shape[0]:
        raise OdcUsageError(f"odc gang: {q.shape[0]} query heads are not a multiple of {hkv} K/V heads")
    if groups > 1:
        k_all, v_all = k_all.repeat_interleave(groups, 0), v_all.repeat_interleave(groups, 0)
    return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=causal_mask(step), scale=scale)

