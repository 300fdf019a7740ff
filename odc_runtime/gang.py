"""Gang attention: the K/V exchange between the ranks that run the chunks of one split sample.

A sample split by ``lb_mini_split`` (``odc_runtime.split``) runs as one micro-batch on the ranks of its *gang*:
member ``p`` holds chunk ``p`` (some of the sample's tokens, at their global positions). Causal attention needs
every earlier token's K/V, so at every layer each member gives its K/V to the others and, in the backward pass,
returns to each owner the gradient with respect to that owner's K/V (dK/dV). ``exchange_kv`` is that exchange
as one differentiable operation: forward = gather the gang's K/V, backward = sum each owner's dK/dV contributions.
The attention itself is ordinary differentiable code over the gathered K/V with a mask from global positions, so
the split sample's loss and gradients are the unsplit computation's up to floating-point reassociation.

Mechanism. Everything goes through the transport's signalled put (``Transport.put_signal`` /
``Transport.wait_signal``), the one point-to-point ordering guarantee the transport interface defines: a
receiver that sees the signal word reach a count sees the data of every put counted in it. A one-sided ``get`` of
the owner's own region would need the owner's local write to be visible to a peer without a fence, which the
interface only promises after a (world-wide) barrier. So member ``s`` *puts* its K/V at layer ``l`` into the next
slot of its ring in every other member's ``slots`` buffer, plus a tag (gang, sample, length, layer, pass, the
sender's part and the gang's members in order) into the matching tag slot, each put adding 1 to word ``s`` of the
receiver's signal buffer; the backward pass puts dK/dV into the owners' rings the same way. A receiver has one ring
of ``depth`` slots per gang position relative to it (the member ``i`` places after it uses ring ``i - 1``), so
memory grows with the largest gang, not the world. A receiver that copied a slot out returns a *credit* (a signalled
put into the sender's ``acks``); within a gang micro-batch a sender reuses a slot only after the credit of its
previous use. A ring serves different senders in different gangs, so before its first put of a gang micro-batch a
member tells every peer that it started it (a *join*: everything of its earlier gangs is consumed) and waits for
every peer's join. Only gang members signal one another: no barrier, no collective. Every wait is bounded by the
transport's timeout (``ODC_TIMEOUT``) and raises ``OdcTimeoutError`` (or
``OdcPeerLostError``) naming the gang, the sample, the layer and the rank that did not
deliver; a tag that does not match (ranks running different plans or layers, or members that disagree on the member
order, hence on which chunk each runs) raises ``OdcMismatchError``. Owners sum
contributions in member order, so the result is deterministic.

No host synchronisation per layer. On the GPU ``put_signal``/``wait_signal`` are stream-ordered, so the exchange
must not read device memory on the host inside the layer loop: every put reads its source from a small symmetric
*stage* (so a peer on another node, reached by the network, which reads registered memory only, is served too), the
tags of a step are made on the device once, and received tags are copied aside and compared in one read at the end
of the pass (when the ``with step:`` block ends for the forward pass, after layer 0 for the backward pass, and
before a wait error is raised, so a mismatch is named as such rather than as the timeout it leads to).

Activation checkpointing. A checkpointed layer runs its forward pass again during the backward pass; that
recomputation exchanges K/V again (tagged as a recomputation), in the same order on every member since they run
the same model, so the ordering argument is unchanged. The recomputation runs outside the ``with step:`` block (and
on the GPU on autograd's device thread), so ``active_step`` also returns the step whose forward pass completed
last while autograd is running a backward pass. Run each gang micro-batch's backward pass before the next
micro-batch's forward pass (as a training loop does).

Ordering and why it cannot deadlock (docs/design.md, "Splitting outlier sequences"): a member sends before it
waits for its peers' data, at every layer in both directions; the only waits before a send are for the peers'
joins, which each peer puts as soon as it reaches the gang micro-batch, and for a credit that the peer returns as
soon as it consumed an *earlier* exchange; every rank runs its gang micro-batches first, in increasing gang number.

Memory: ``((max_gang_size - 1) · depth + 1) · 2 · max_chunk_tokens · kv_features`` elements of symmetric memory per
rank (the rings and the stage; ``GangExchange.nbytes``), plus small tag, credit and signal buffers.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

from odc_runtime import state
from odc_runtime.errors import OdcBackendError, OdcError, OdcMismatchError, OdcUsageError
from odc_runtime.split import Chunk
from odc_runtime.telemetry import span
from odc_runtime.transport.base import PutRequest, SymmetricBuffer, Transport, as_failure

__all__ = ["GangExchange", "GangStep", "active_step", "exchange_kv", "gang_attention"]

T = TypeVar("T")

# A tag: gang, sample, length, layer, pass, the sender's part, then the gang's members in order (padded with -1 to
# the exchange's max_gang_size), so members that disagree on the order (on who runs which chunk) see a mismatch.
_TAG_FIXED = 6
# Passes, what an exchange belongs to: the forward pass (K/V), a checkpointed layer's recomputation (K/V again),
# the backward pass (dK/dV).
_FIRST, _RECOMPUTE, _GRAD = 0, 1, 2
_ACTIVE: contextvars.ContextVar[GangStep | None] = contextvars.ContextVar("odc_gang_step", default=None)
# The step whose forward pass completed last: a checkpointed layer recomputes under it during the backward pass,
# which runs outside its `with step:` block (and on the GPU on another thread, so not a context variable).
_PENDING: GangStep | None = None


def _describe(tag: list[int]) -> str:
    """A tag in words, for mismatch messages."""
    gang, sample, length, layer, pass_, part, *members = tag
    kind = ("forward K/V", "recomputed forward K/V", "backward dK/dV")[pass_] if 0 <= pass_ < 3 else f"pass {pass_}"
    ranks = tuple(r for r in members if r >= 0)
    return (f"(gang {gang}, sample {sample} of {length} tokens, layer {layer}, {kind}, chunk {part} of the gang "
            f"of ranks {ranks})")


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (what torch.utils.checkpoint asks too)."""
    return torch._C._current_graph_task_id() != -1


def _runtime_transport() -> Transport:
    if state.current is None:
        raise OdcUsageError("odc gang: call odc_runtime.init() first (or pass transport=)")
    return state.current.transport


class GangExchange:
    """Symmetric buffers for the K/V exchange of gang micro-batches; create once, reuse for every gang.

    Collective: every rank constructs it with the same arguments, in the same order relative to other
    allocations. ``num_layers``: attention layers per forward pass; ``max_chunk_tokens``: the most tokens of a
    chunk (the planner's ``max_tokens``); ``kv_features``: elements of K (and of V) per token on one rank
    (``num_kv_heads · head_dim``); ``dtype``: the dtype of K/V; ``depth``: slots per ring (2: a member may run one
    exchange ahead of a peer; 1: lockstep, half the memory); ``max_gang_size``: the most ranks in a gang (default
    the world; memory grows with it, and a larger gang is refused). ``transport`` defaults to the initialised
    runtime's. Memory per rank: ``((max_gang_size - 1) · depth + 1) · 2 · max_chunk_tokens · kv_features``
    elements of ``dtype`` (``nbytes`` in all).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        max_chunk_tokens: int,
        kv_features: int,
        dtype: torch.dtype = torch.float32,
        depth: int = 2,
        max_gang_size: int | None = None,
        transport: Transport | None = None,
    ) -> None:
        for name, value in (("num_layers", num_layers), ("max_chunk_tokens", max_chunk_tokens),
                            ("kv_features", kv_features), ("depth", depth), ("max_gang_size", max_gang_size or 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OdcUsageError(f"GangExchange: {name} must be a positive int, got {value!r}")
        self.transport = transport if transport is not None else _runtime_transport()
        w = self.transport.world_size
        if max_gang_size is not None and max_gang_size > w:
            raise OdcUsageError(f"GangExchange: max_gang_size={max_gang_size} exceeds the world size {w}")
        self.num_layers, self.max_chunk_tokens, self.kv_features, self.dtype, self.depth = (
            num_layers, max_chunk_tokens, kv_features, dtype, depth)
        self.max_gang_size = max_gang_size or w
        rings = max(self.max_gang_size - 1, 1)  # one ring per gang position of a sender relative to the receiver
        self.slot = 2 * max_chunk_tokens * kv_features
        self.tag_words = _TAG_FIXED + self.max_gang_size
        self.slots = self.transport.alloc(rings * depth * self.slot, dtype, "gang.slots")
        self.tags = self.transport.alloc(rings * depth * self.tag_words, torch.int64, "gang.tags")
        self.acks = self.transport.alloc(2 * w, torch.int64, "gang.acks")  # payloads of credits and joins
        # Sources of every put (data, then a tag and a credit word): symmetric, so network puts can read them;
        # reused in stream order, since a put has read its source before anything later on the stream runs.
        self.stage = self.transport.alloc(self.slot, dtype, "gang.stage")
        self.stage_words = self.transport.alloc(self.tag_words + 1, torch.int64, "gang.stage_words")
        # Words [s]: puts from sender s (data and tag: +2 per exchange); [W + r]: credits from receiver r (+1 per
        # exchange it consumed); [2W + r]: joins from member r (+1 per gang micro-batch it starts with this rank).
        # Words only grow; both sides keep running counts per pair.
        self.signal = self.transport.alloc(3 * w, torch.int64, "gang.signal")
        self._sent = [0] * w  # [peer]: exchanges this rank put to peer
        self._received = [0] * w  # [peer]: exchanges this rank consumed from peer
        self._joined = [0] * w  # [peer]: gang micro-batches this rank started with peer
        self._backward_open: GangStep | None = None  # the step whose backward pass started and has not ended

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def nbytes(self) -> int:
        """Symmetric memory this exchange holds on each rank."""
        return sum(b.numel * b.dtype.itemsize for b in self._buffers())

    def step(self, chunk: Chunk) -> GangStep:
        """The exchange state of this rank's gang micro-batch ``chunk``; use as ``with exchange.step(c):``.

        Raises (and fails the runtime) if the previous step's backward pass started and never ended: an exception
        elsewhere in that backward pass stopped it after this rank had sent some dK/dV (fail-stop, see
        ``GangStep``)."""
        last = self._backward_open
        if last is not None:
            self._backward_open = None
            error = OdcBackendError(
                f"odc gang {last.chunk.gang} (sample {last.chunk.sample}): its backward pass stopped on this rank "
                f"after sending dK/dV down to layer {last._grad_layer} of {self.num_layers} (an exception elsewhere "
                "in the backward pass?); its members wait for the rest, so the runtime is unusable now (call "
                "odc_runtime.finalize() and restart the job)"
            )
            raise self.transport.fail(error)
        return GangStep(self, chunk)

    def free(self) -> None:
        """Collective: release the buffers."""
        for buf in reversed(self._buffers()):
            self.transport.free(buf)

    def _buffers(self) -> list[SymmetricBuffer]:
        return [self.slots, self.tags, self.acks, self.stage, self.stage_words, self.signal]

    def _slot(self, ring: int, n: int) -> int:
        """Offset of the slot of ring ``ring`` used by a pair's ``n``-th exchange."""
        return (ring * self.depth + n % self.depth) * self.slot

    def _tag_offset(self, ring: int, n: int) -> int:
        return (ring * self.depth + n % self.depth) * self.tag_words


class GangStep:
    """One gang micro-batch on this rank: the chunk, its gang, and which layers exchanged so far.

    ``with step:`` makes it the active step (what ``active_step`` and the Hugging Face attention function
    use); leaving the block after a forward pass that did not exchange at every layer raises
    ``OdcUsageError`` (the model's attention is not the gang's), and a tag mismatch seen
    in the forward pass raises ``OdcMismatchError`` there.

    Fail-stop. Once the step delivered its first put (its join), its members count on every exchange of the rest
    of the step, so an exception that ends it early (an interrupt, a hook that raises, a usage error) marks the
    runtime failed before it propagates (unchanged): on this rank every later operation raises at once, and the
    members waiting for this rank raise ``OdcPeerLostError`` within the transport's
    liveness period instead of waiting out ``ODC_TIMEOUT``. This covers exceptions escaping the ``with step:``
    block and the exchanges themselves (forward, recomputation, backward); an exception elsewhere in the backward
    pass (a tensor hook, another autograd function) never reaches the gang, so the next ``GangExchange.step``
    finds that backward pass unfinished and fails then. Before the join nothing was delivered: an exception is an
    ordinary error and the step can be run again.
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
        if chunk.parts > exchange.max_gang_size:
            raise OdcUsageError(f"odc gang {chunk.gang}: sample {chunk.sample} is split across {chunk.parts} ranks, "
                                f"more than the exchange's max_gang_size={exchange.max_gang_size}")
        positions = [c.positions() for c in parts]
        device = exchange.transport.device
        #: Global positions of this chunk's tokens (on the transport's device).
        self.positions = torch.tensor(positions[chunk.part], dtype=torch.long, device=device)
        #: Global positions of the gathered K/V rows (members' chunks in member order).
        self.kv_positions = torch.tensor([t for ps in positions for t in ps], dtype=torch.long, device=device)
        #: The gathered rows in global order (the chunks cover the sample: sorted, the positions are 0..length-1).
        self.kv_order = torch.argsort(self.kv_positions)
        # Every tag this step sends, made on the device once: row pass · num_layers + layer.
        self._tags = torch.tensor([self._tag(layer, p, chunk.part) for p in (_FIRST, _RECOMPUTE, _GRAD)
                                   for layer in range(exchange.num_layers)], dtype=torch.int64, device=device)
        self._next_layer = 0  # first pass: the next layer to exchange
        self._recomputed: set[int] = set()  # layers whose forward ran again (activation checkpointing)
        self._received: list[tuple[torch.Tensor, int, int, int]] = []  # (tag copy, pass, layer, peer), unchecked
        # The other members, starting after this one (each member starts with a different peer), and the rings:
        # a receiver's ring for a sender is the sender's gang position after the receiver's, minus one.
        me = chunk.part
        self._peers = [self.members[(me + i) % chunk.parts] for i in range(1, chunk.parts)]
        self._ring_at = {r: (me - p - 1) % chunk.parts for p, r in enumerate(self.members)}  # my puts, at r
        self._ring_from = {r: (p - me - 1) % chunk.parts for p, r in enumerate(self.members)}  # r's puts, here
        self._sent = dict.fromkeys(self.members, 0)  # exchanges put to each member in this step
        self._joined = False
        self._grad_layer: int | None = None  # the last layer whose dK/dV this step sent
        # The lowest layer whose first-pass exchange autograd recorded: where the backward pass ends (layers below
        # it may be frozen). Layer 0 when the first pass recorded none (reentrant checkpointing runs it without
        # grad; the recomputation records it).
        self._backward_end = exchange.num_layers
        self._token = None

    def _tag(self, layer: int, pass_: int, part: int) -> list[int]:
        """The tag of member ``part``'s put at ``layer`` in pass ``pass_`` (the words are listed at ``_TAG_FIXED``)."""
        c = self.chunk
        pad = [-1] * (self.exchange.max_gang_size - len(c.ranks))
        return [c.gang, c.sample, c.length, layer, pass_, part, *c.ranks, *pad]

    def __enter__(self) -> GangStep:
        global _PENDING
        _PENDING = None  # a new micro-batch: the previous one's backward pass is over
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, _tb: object) -> None:
        global _PENDING
        _ACTIVE.reset(self._token)
        if exc is not None:
            self._abandon(exc)
            return
        try:
            self._verify()
            if self._next_layer != self.exchange.num_layers:
                raise OdcUsageError(
                    f"odc gang {self.chunk.gang}: the forward pass exchanged K/V at {self._next_layer} of "
                    f"{self.exchange.num_layers} layers; every attention layer must run the gang attention "
                    "(Hugging Face: odc_runtime.integrations.hf_gang.enable(model))"
                )
        except BaseException as e:
            self._abandon(e)
            raise
        _PENDING = self

    def _abandon(self, error: BaseException) -> None:
        """``error`` ends this step early: once its join was delivered, fail the runtime (see the class
        docstring); before, nothing changed and the error is an ordinary one."""
        if self._joined:
            self.exchange.transport.fail(as_failure(
                f"gang {self.chunk.gang}", error, "its puts were delivered to the gang's members"))

    def _what(self, layer: int, pass_: int, peer: int) -> str:
        kind = ("forward K/V", "recomputed forward K/V", "backward dK/dV")[pass_]
        return f"gang {self.chunk.gang} (sample {self.chunk.sample}) layer {layer}: {kind} from rank {peer}"

    def _verify(self) -> None:
        """Compare every received tag not yet checked with the expected one: one device-to-host read. A mismatch
        marks the runtime failed (fail-stop) and raises ``OdcMismatchError``."""
        if not self._received:
            return
        received, self._received = self._received, []
        got = torch.stack([t for t, *_ in received]).tolist()
        for (*tag, delivered), (_, pass_, layer, peer) in zip(got, received, strict=True):
            # An undelivered tag (its wait was released by the abort) says nothing: the wait's timeout is the error.
            expected = self._tag(layer, pass_, self.members.index(peer))
            if delivered and tag != expected:
                error = OdcMismatchError(
                    f"odc {self._what(layer, pass_, peer)}: it sent {_describe(tag)}, this rank expected "
                    f"{_describe(expected)}; the ranks run different plans or models (every member must build its "
                    "chunk from the same plan entry: the same gang, sample and member order)"
                )
                # Fail-stop: the members exchanged different things, so their running counts may differ and data
                # may have been used; the runtime is marked failed, which also ends the peers' waits at once. The
                # mismatch is raised even when a failure it caused was recorded first (a wait on a failed peer).
                self.exchange.transport.fail(error)
                raise error

    def _join(self, layer: int, pass_: int) -> None:
        """Before the first put of a gang micro-batch: tell every peer that this rank started it (so consumed
        everything of its earlier gangs), then wait until every peer did. Rings are per gang position, not per
        sender, so a peer's ring may have served another sender in an earlier gang: this is what frees it."""
        ex, me, w = self.exchange, self.exchange.rank, self.exchange.transport.world_size
        peers = self._peers
        word = ex.stage_words.local[ex.tag_words :]
        word.fill_(1)
        with span("odc.gang.join"):
            ex.transport.put_signal(ex.acks, [PutRequest(p, word, w + me, 2 * w + me) for p in peers], ex.signal)
            self._joined = True  # delivered: from here on, an exception ending this step is fatal
            for p in peers:
                ex._joined[p] += 1
                what = self._what(layer, pass_, p).replace(" from rank ", ": join (it started the gang) from rank ")
                self._wait(2 * w + p, ex._joined[p], what, p)

    def _send(self, pass_: int, layer: int, rows: torch.Tensor | dict[int, torch.Tensor]) -> None:
        """Put the rows (one tensor for every peer, or one per peer) into every peer's next slot of this rank's
        ring, then the tag; both counted in one word. Sources go through the stage.

        Within a gang micro-batch a slot is reused ``depth`` exchanges later, once the peer's credit says it
        consumed the previous use; its uses in earlier gangs were consumed before the peer joined this one."""
        ex, me, w = self.exchange, self.exchange.rank, self.exchange.transport.world_size
        peers = self._peers
        if not peers:  # a gang of one: nothing to send (nor to call the transport with)
            return
        if not self._joined:
            self._join(layer, pass_)
        for p in peers:
            if self._sent[p] >= ex.depth:  # the slot's previous use must be consumed: wait for that credit
                what = self._what(layer, pass_, p).replace(" from rank ", ": credit (slot free) from rank ")
                self._wait(w + p, ex._sent[p] - ex.depth + 1, what, p)
        at = {p: (self._ring_at[p], ex._sent[p]) for p in peers}  # (ring, exchange count) at each peer
        stage = ex.stage.local
        if isinstance(rows, torch.Tensor):  # the same rows for everyone: staged once
            src = stage[: rows.numel()]
            src.copy_(rows.reshape(-1))
            ex.transport.put_signal(ex.slots, [PutRequest(p, src, ex._slot(*at[p]), me) for p in peers], ex.signal)
        else:  # rows per peer: staged and put one peer after the other (a put has read its source before the next)
            for p in peers:
                src = stage[: rows[p].numel()]
                src.copy_(rows[p].reshape(-1))
                ex.transport.put_signal(ex.slots, [PutRequest(p, src, ex._slot(*at[p]), me)], ex.signal)
        tag = ex.stage_words.local[: ex.tag_words]
        tag.copy_(self._tags[pass_ * ex.num_layers + layer])
        ex.transport.put_signal(ex.tags, [PutRequest(p, tag, ex._tag_offset(*at[p]), me) for p in peers], ex.signal)
        for p in peers:
            ex._sent[p] += 1
            self._sent[p] += 1

    def _wait(self, index: int, value: int, what: str, peer: int) -> None:
        """A bounded wait on this rank's signal word ``index``."""
        with span("odc.gang.wait"):
            self.exchange.transport.wait_signal(self.exchange.signal, index, value, what, [peer])

    def _exchange(self, run: Callable[[], T]) -> T:
        """Run one layer's exchange. When a transport error ends it (a wait that timed out, a peer whose runtime
        failed), a tag mismatch received before is its cause, and is what is raised. Any exception ending it
        after the join (an interrupt in a wait included) fails the runtime (fail-stop, see the class docstring)."""
        try:
            return run()
        except OdcMismatchError:
            raise
        except OdcError as e:
            self._verify()
            self._abandon(e)
            raise e from None
        except BaseException as e:
            self._abandon(e)
            raise

    def _receive(self, pass_: int, layer: int, peer: int, numel: int) -> torch.Tensor:
        """Wait for ``peer``'s put of this layer and pass; a copy of its data (its tag is checked later)."""
        ex, me, w = self.exchange, self.exchange.rank, self.exchange.transport.world_size
        n = ex._received[peer]
        self._wait(peer, 2 * (n + 1), self._what(layer, pass_, peer), peer)
        ring = self._ring_from[peer]
        t = ex._tag_offset(ring, n)
        # On the GPU the wait returns to the host at once; an abort may release it before the count arrives, and
        # the tag copied then is stale. So the copy carries whether the count had arrived (read first, in stream
        # order), and _verify compares delivered tags only.
        delivered = (ex.signal.local[peer : peer + 1] >= 2 * (n + 1)).long()
        self._received.append((torch.cat([ex.tags.local[t : t + ex.tag_words], delivered]), pass_, layer, peer))
        offset = ex._slot(ring, n)
        data = ex.slots.local[offset : offset + numel].clone()
        ex._received[peer] = n + 1
        # Credit: the slot is free again (the copies above are ordered before the put, on the stream on GPU).
        credit = ex.stage_words.local[ex.tag_words :]
        credit.fill_(n + 1)
        ex.transport.put_signal(ex.acks, [PutRequest(peer, credit, me, w + me)], ex.signal)
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
        self._send(pass_, layer, torch.cat([k.reshape(n, f), v.reshape(n, f)]))
        ks, vs = [], []
        for p, peer in enumerate(self.members):
            if p == self.chunk.part:
                ks.append(k.reshape(n, f))
                vs.append(v.reshape(n, f))
                continue
            data = self._receive(pass_, layer, peer, 2 * self.counts[p] * f).view(2, self.counts[p], f)
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
        ex._backward_open = self  # until layer 0's exchange completes (GangExchange.step checks it)
        self._grad_layer = layer
        self._send(_GRAD, layer, rows)
        me, n = self.chunk.part, self.counts[self.chunk.part]
        total = torch.cat([dk_rows[me], dv_rows[me]])
        for p, peer in enumerate(self.members):  # member order: a deterministic sum
            if p != me:
                total = total + self._receive(_GRAD, layer, peer, 2 * n * f).view(2 * n, f)
        if layer == self._backward_end % ex.num_layers:  # the last layer of the backward pass
            if _PENDING is self:
                _PENDING = None
            ex._backward_open = None
            self._verify()
        shape = (n, *dk_all.shape[1:])
        return total[:n].reshape(shape), total[n:].reshape(shape)


class _ExchangeKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, step: GangStep, layer: int,  # noqa: ANN001
                recorded: bool) -> tuple[torch.Tensor, ...]:
        ctx.step, ctx.layer = step, layer
        first = step._next_layer < step.exchange.num_layers
        with span("odc.gang.forward"):  # the layer's K/V exchange (recomputations included)
            out = step._exchange(lambda: step._forward(layer, k.detach(), v.detach()))
        if first and recorded:  # autograd records this first-pass exchange: the backward pass reaches it
            step._backward_end = min(step._backward_end, layer)
        return out

    @staticmethod
    def backward(ctx, dk_all: torch.Tensor, dv_all: torch.Tensor) -> tuple:  # noqa: ANN001
        with span("odc.gang.backward"):  # the layer's dK/dV exchange
            dk, dv = ctx.step._exchange(lambda: ctx.step._backward(ctx.layer, dk_all, dv_all))
        return dk, dv, None, None, None


def exchange_kv(step: GangStep, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gang's K/V at ``layer``: ``k``, ``v`` (this chunk's ``(tokens, ...)``) gathered from every member in
    member order (rows at global positions ``step.kv_positions``). Differentiable: the backward pass sends every
    owner its dK/dV and returns this rank's, summed over the gang."""
    recorded = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)  # its backward pass will come
    return _ExchangeKV.apply(k, v, step, layer, recorded)


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


def gang_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: GangStep, layer: int, *, scale: float | None = None
) -> torch.Tensor:
    """Exact causal attention of this chunk's queries over the whole split sample.

    ``q``: ``(heads, tokens, head_dim)``; ``k``, ``v``: ``(kv_heads, tokens, head_dim)`` (grouped-query attention
    when ``kv_heads`` divides ``heads``). Returns ``(heads, tokens, head_dim)``.

    The gathered K/V are put in global order; a chunk's queries are pieces of consecutive positions ``[lo, hi)``,
    and each piece sees exactly the prefix ``[0, hi)`` with its diagonal at the end: one causal attention per piece,
    aligned to the lower right (``torch.nn.attention.bias.causal_lower_right``), so no dense mask is built and
    SDPA may use its flash and memory-efficient kernels.
    """
    # Imported here: torch.nn.attention.bias imports torch._dynamo (~5 CPU seconds), which the K/V exchange alone
    # (GangExchange, exchange_kv) never needs.
    from torch.nn.attention.bias import causal_lower_right

    hkv = k.shape[0]
    groups = q.shape[0] // hkv
    if groups * hkv != q.shape[0]:
        raise OdcUsageError(f"odc gang: {q.shape[0]} query heads are not a multiple of {hkv} K/V heads")
    k_all, v_all = exchange_kv(step, layer, k.transpose(0, 1), v.transpose(0, 1))  # (tokens, kv_heads, d)
    k_all = k_all.index_select(0, step.kv_order).transpose(0, 1)  # (kv_heads, sample length, d): global order
    v_all = v_all.index_select(0, step.kv_order).transpose(0, 1)
    if groups > 1:
        k_all, v_all = k_all.repeat_interleave(groups, 0), v_all.repeat_interleave(groups, 0)
    out, start = [], 0
    for lo, hi in step.chunk.ranges:  # 4-D (a batch of one): SDPA's fused kernels take nothing else
        n = hi - lo
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[None, :, start : start + n], k_all[None, :, :hi], v_all[None, :, :hi],
            attn_mask=causal_lower_right(n, hi), scale=scale)[0])
        start += n
    return torch.cat(out, dim=1)
