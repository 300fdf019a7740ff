"""Helpers for tests/test_fsdp.py: a spawn runner, a tiny decoder-only transformer and the per-rank scenarios.

Every scenario runs inside ``run(fn, world_size, *args)``: ``world_size`` spawned processes, gloo over a FileStore,
one torch thread each, ``odc_runtime.init("host")``. Scenarios return plain Python values (max differences,
error messages) that the tests assert on in the parent process.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

from _dist import run_ranks


def _with_odc(rank: int, world: int, fn: Callable, *args: Any) -> Any:
    import odc_runtime as odc

    odc.init("host", timeout=60)
    return fn(rank, world, *args)


def run(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, init_odc: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks (after ``odc.init("host")`` unless
    ``init_odc`` is false); return the per-rank results."""
    if init_odc:
        return run_ranks(_with_odc, world_size, fn, *args, timeout=timeout)
    return run_ranks(fn, world_size, *args, timeout=timeout)


# --------------------------------------------------------------------------------------------------- model


def make_model(
    seed: int = 0, vocab: int = 37, dim: int = 12, heads: int = 3, hidden: int = 22, layers: int = 2, branch=False,
    tied=False,
):
    """A tiny decoder-only transformer whose parameter dims are not multiples of 2, 3 or 4 (uneven shards).

    ``tied``: the output head shares the embedding's weight (``head.weight is emb.weight``), as small LLMs do.

    ``branch``: add layers used only by some micro-batches (``extra`` in the root's parameters, between ``pos`` and
    ``ln_f``, when the batch has 2 rows; ``aux`` in each block when the sequence length is odd), so a backward
    leaves some trainable parameters without a gradient, as mixture-of-experts or multi-modal models do.
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.ln2 = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, hidden)
            self.down = nn.Linear(hidden, dim)
            self.aux = nn.Linear(dim, dim) if branch else None

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            if self.aux is not None and t % 2 == 1:
                x = x + self.aux(x)
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(16, dim)
            self.extra = nn.Linear(dim, dim) if branch else None
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens, skip_head=False):
            x = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1]))
            if self.extra is not None and tokens.shape[0] == 2:
                x = x + self.extra(x)
            for block in self.blocks:
                x = block(x)
            x = self.ln_f(x)
            return x if skip_head else self.head(x)  # skip_head: the caller runs the head (chunked loss)

    torch.manual_seed(seed)
    model = TinyLM()
    if tied:
        model.head.weight = model.emb.weight
    with torch.no_grad():  # LayerNorm starts at 1/0: perturb so its gradients are not degenerate
        for name, p in model.named_parameters():
            if "ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def shard_model(model, mp_policy=None, reshard_after_forward=True, grouped=False):
    """``fully_shard`` every block, then the root. ``grouped``: before the root, one FSDP parameter group for
    ``[ln_f, head]`` (``[emb, ln_f, head]`` when the head's weight is the embedding's), as torchtitan's llama3 does
    (``fully_shard([norm, output])``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "reshard_after_forward": reshard_after_forward,
    }
    for block in model.blocks:
        fully_shard(block, **kw)
    if grouped:
        tied = model.head.weight is model.emb.weight
        fully_shard([model.emb, model.ln_f, model.head] if tied else [model.ln_f, model.head], **kw)
    fully_shard(model, **kw)
    return model


def make_data(steps: int, counts: list[int], seed: int = 1, vocab: int = 37):
    """``data[step][rank]`` = list of micro-batches ``[B, T]`` (B, T vary); identical on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        per_rank = []
        for c in counts:
            mbs = []
            for _ in range(c):
                b = int(torch.randint(1, 3, (1,), generator=g))
                t = int(torch.randint(3, 10, (1,), generator=g))
                mbs.append(torch.randint(0, vocab, (b, t), generator=g))
            per_rank.append(mbs)
        data.append(per_rank)
    return data


def token_loss_sum(model, tokens):
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum")


def n_targets(mbs) -> int:
    return sum(t.shape[0] * (t.shape[1] - 1) for t in mbs)


def max_param_diff(model, ref) -> float:
    """Max |full FSDP parameter - reference parameter| (collective: gathers the DTensors)."""
    diffs = [
        (p.full_tensor().float() - q.detach().float()).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    ]
    return max(diffs)


def _sgd(params, lr=0.2):
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=0.9)


# --------------------------------------------------------------------------------------------------- scenarios


def scenario_vs_reference(rank: int, world: int, steps: int, counts: list[int], opts: dict) -> dict:
    """ODC with ``counts[r]`` micro-batches on rank r vs one process training on the union (sum loss / tokens).

    opts: ``clip`` (max norm or None), ``bf16`` (MixedPrecisionPolicy(bf16, fp32) vs a bf16-semantics reference),
    ``reshard_after_forward``, ``frozen`` (parameter names), ``branch`` (see :func:`make_model`),
    ``track_unused`` (use ODC's own unused-parameter tracking even where torch has the hook).
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import odc_runtime.fsdp as ofsdp

    bf16 = opts.get("bf16", False)
    clip = opts.get("clip")
    model = make_model(branch=opts.get("branch", False))
    for name in opts.get(
        "frozen", ()
    ):  # frozen parameters: FSDP's reduce-scatter row is shorter than its all-gather row
        model.get_parameter(name).requires_grad_(False)
    ref = copy.deepcopy(model)  # fp32 master weights of the reference
    ref_compute = copy.deepcopy(model).to(torch.bfloat16) if bf16 else ref
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    shard_model(model, mp, opts.get("reshard_after_forward", True))
    ofsdp._FORCE_UNUSED_TRACKING = opts.get("track_unused", False)
    try:
        ofsdp.enable(model)
    finally:
        ofsdp._FORCE_UNUSED_TRACKING = False
    tracking = any(u.track_unused for u in ofsdp._STATES[model].units)
    opt = _sgd([p for p in model.parameters() if p.requires_grad])
    ref_opt = _sgd([p for p in ref.parameters() if p.requires_grad])
    data = make_data(steps, counts)
    out: dict[str, list] = {"diff": [], "norm": [], "ref_norm": [], "loss": [], "ref_loss": []}
    for step in range(steps):
        tokens = sum(n_targets(mbs) for mbs in data[step])
        local_loss = torch.zeros(())
        with ofsdp.minibatch(model, divide_factor=tokens):
            for mb in data[step][rank]:
                loss = token_loss_sum(model, mb)
                loss.backward()
                local_loss += loss.detach()
        torch.distributed.all_reduce(local_loss)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], clip)
            out["norm"].append(float(norm.full_tensor()))
        opt.step()
        opt.zero_grad()
        # reference: one process, every rank's micro-batches
        if bf16:
            with torch.no_grad():
                for p, q in zip(ref_compute.parameters(), ref.parameters(), strict=True):
                    p.copy_(q)  # round to bf16 as FSDP's all-gather input cast does
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        ref_loss = 0.0
        for mbs in data[step]:
            for mb in mbs:
                loss = token_loss_sum(ref_compute, mb)
                ref_loss += loss.item()
                loss.backward()
                for g, p in zip(grads, ref_compute.parameters(), strict=True):
                    if p.grad is not None:
                        g += p.grad.float()  # per micro-batch bf16 grads summed in fp32, as the fp32 accumulator
                        p.grad = None
        for g, q in zip(grads, ref.parameters(), strict=True):
            if q.requires_grad:
                q.grad = g / tokens
        if clip is not None:
            out["ref_norm"].append(float(torch.nn.utils.clip_grad_norm_(ref_opt.param_groups[0]["params"], clip)))
        ref_opt.step()
        ref_opt.zero_grad()
        out["diff"].append(max_param_diff(model, ref))
        out["loss"].append(local_loss.item() / tokens)
        out["ref_loss"].append(ref_loss / tokens)
    out["tracking"] = tracking
    # micro-batches of this rank that leave some trainable parameter without a gradient (with branch=True)
    out["partial"] = sum(mb.shape[0] != 2 or (mb.shape[1] - 1) % 2 == 0 for step in data for mb in step[rank])
    out["has_hook"] = ofsdp.has_capability("reduce_scatter_unused_params")
    ofsdp.disable(model)
    return out


def scenario_nodes(rank: int, world: int, node_size: int, steps: int, counts: list[int], opts: dict) -> dict:
    """``scenario_vs_reference`` with ODC re-initialised on virtual nodes of ``node_size`` ranks (the hierarchical
    push and fetch of odc_runtime.hierarchy under FSDP2), then back to one node."""
    import odc_runtime as odc

    odc.finalize()
    odc.init("host", timeout=60, node_size=node_size)
    try:
        assert odc.node_size() == node_size
        return scenario_vs_reference(rank, world, steps, counts, opts)
    finally:
        odc.finalize()
        odc.init("host", timeout=60)


def scenario_compat(rank: int, world: int) -> dict:
    """The private FSDP2 surface ODC reads (odc_runtime.fsdp._compat) on this torch, and the capability table."""
    import torch

    from odc_runtime.fsdp import _compat

    model = shard_model(make_model())
    token_loss_sum(model, make_data(1, [1])[0][0][0]).backward()  # creates the unsharded parameters
    problems = []
    for m in (model.blocks[0], model):
        problems += _compat.check_private_surface(m)
    version = _compat.torch_version()
    table = {name: [_compat.has_capability(name), version >= cap.oldest] for name, cap in _compat.CAPABILITIES.items()}
    return {"problems": problems, "table": table, "torch": torch.__version__}


def scenario_vs_fsdp(rank: int, world: int, steps: int, micro: int, opts: dict) -> dict:
    """ODC and stock FSDP2 side by side on the same data, equal micro-batch counts, default (mean) scaling."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import odc_runtime.fsdp as ofsdp

    bf16 = opts.get("bf16", False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    if opts.get("fp16"):  # fp16 compute and reduction: FSDP pre-divides the reduce-scatter input (overflow guard)
        mp = MixedPrecisionPolicy(param_dtype=torch.float16)
    raf = opts.get("reshard_after_forward", True)
    odc_model = shard_model(make_model(), mp, raf)
    fsdp_model = shard_model(make_model(), mp, raf)
    ofsdp.enable(odc_model)
    opt_a, opt_b = _sgd(odc_model.parameters()), _sgd(fsdp_model.parameters())
    data = make_data(steps, [micro] * world)
    diffs, grad_diffs = [], []
    for step in range(steps):
        with ofsdp.minibatch(odc_model):
            for mb in data[step][rank]:
                (token_loss_sum(odc_model, mb) / n_targets([mb])).backward()
        for mb in data[step][rank]:
            (token_loss_sum(fsdp_model, mb) / n_targets([mb])).backward()
        grad_diffs.append(
            max(
                (a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
                for a, b in zip(odc_model.parameters(), fsdp_model.parameters(), strict=True)
            )
        )
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
        diffs.append(
            max(
                (a.full_tensor() - b.full_tensor()).abs().max().item()
                for a, b in zip(odc_model.parameters(), fsdp_model.parameters(), strict=True)
            )
        )
    return {"diff": diffs, "grad_diff": grad_diffs}


def partial_group_forward() -> bool:
    """Whether this torch's FSDP2 runs a grouped ``fully_shard([norm, head])`` when a forward calls only some of its
    modules (the head alone, per chunk, as torchtitan's chunked loss does): FSDPParamGroup.post_backward has a
    partial-group path (torch 2.13 has it). Older releases finish a group only when all of its modules ran, so the
    chunked loss does not run on a grouped head there, with or without ODC."""
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    post_backward = inspect.unwrap(FSDPParamGroup.post_backward)  # under torch._dynamo.disable
    return "is_partial_group_backward" in post_backward.__code__.co_varnames


def _chunked_backward(model, tokens, scale: float, chunks: int):
    """The loss the way torchtitan's chunked loss runs it (``ChunkedLossWrapper``): the trunk's forward up to the
    final norm, then the head per chunk of the sequence, each chunk's loss backward on its own with the head's
    gradient sync off (``set_requires_gradient_sync(False)``) except for the last chunk, the head kept unsharded
    across the chunks; then one backward of the trunk from the chunks' gradients. Returns the loss (detached)."""
    import torch
    import torch.nn.functional as F

    head = model.head
    h = model(tokens[:, :-1], skip_head=True)
    targets = tokens[:, 1:]
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    total = torch.zeros(())
    grads = []
    pieces = list(zip(h.detach().chunk(chunks, dim=1), targets.chunk(chunks, dim=1), strict=True))
    for i, (piece, target) in enumerate(pieces):
        if i == len(pieces) - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        leaf = piece.requires_grad_()
        logits = head(leaf)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
        (loss * scale).backward()
        grads.append(leaf.grad)
        total += loss.detach()
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.reshard()
    h.backward(torch.cat(grads, dim=1))
    return total


def scenario_unequal_vs_fsdp(rank: int, world: int, steps: int, counts: list[int], opts: dict) -> dict:
    """ODC with ``counts[r]`` micro-batches on rank r against stock FSDP2 running the same global minibatches with
    equal counts (each minibatch's micro-batches dealt out in turn), ``clip_grad_norm_`` after every minibatch.
    Both scale each micro-batch's token-loss sum by ``world / tokens`` (FSDP2's mean over ranks then gives the
    minibatch's mean token loss), so their gradients differ only by the order of the sums.

    opts: ``grouped`` and ``tied`` (``shard_model`` / ``make_model``), ``bf16`` (``MixedPrecisionPolicy(bf16,
    fp32)``), ``chunks`` (the loss through ``_chunked_backward`` with that many chunks), ``clip`` (max norm, 0.5).
    Returns per step the largest gradient and parameter differences, both norms and both losses."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import odc_runtime.fsdp as ofsdp

    assert sum(counts) % world == 0, "stock FSDP2 needs the same count on every rank"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if opts.get("bf16") else None
    odc_model, fsdp_model = (
        shard_model(make_model(tied=opts.get("tied", False)), mp, grouped=opts.get("grouped", False))
        for _ in range(2)
    )
    ofsdp.enable(odc_model)
    opts_ = [_sgd(m.parameters()) for m in (odc_model, fsdp_model)]
    data = make_data(steps, counts)
    chunks, clip = opts.get("chunks"), opts.get("clip", 0.5)

    def backward(model, mbs, tokens):
        total = torch.zeros(())
        for mb in mbs:
            scale = world / tokens
            if chunks:
                total += _chunked_backward(model, mb, scale, chunks) * scale
            else:
                loss = token_loss_sum(model, mb) * scale
                loss.backward()
                total += loss.detach()
        torch.distributed.all_reduce(total)
        return total.item() / world

    out: dict[str, Any] = {"grad_diff": [], "diff": [], "norm": [], "fsdp_norm": [], "loss": [], "fsdp_loss": []}
    out["clip"] = clip
    for step in range(steps):
        everything = [mb for per_rank in data[step] for mb in per_rank]
        tokens = n_targets(everything)
        with ofsdp.minibatch(odc_model):
            out["loss"].append(backward(odc_model, data[step][rank], tokens))
        out["fsdp_loss"].append(backward(fsdp_model, everything[rank::world], tokens))
        out["grad_diff"].append(
            max(
                (a.grad.full_tensor().float() - b.grad.full_tensor().float()).abs().max().item()
                for a, b in zip(odc_model.parameters(), fsdp_model.parameters(), strict=True)
            )
        )
        for key, model in (("norm", odc_model), ("fsdp_norm", fsdp_model)):
            out[key].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor()))
        for opt in opts_:
            opt.step()
            opt.zero_grad()
        out["diff"].append(
            max(
                (a.full_tensor().float() - b.full_tensor().float()).abs().max().item()
                for a, b in zip(odc_model.parameters(), fsdp_model.parameters(), strict=True)
            )
        )
    ofsdp.disable(odc_model)
    return out


def scenario_sync_left_off(rank: int, world: int, kind: str, opts: dict) -> dict:
    """The head's gradient sync turned off for a whole minibatch (``set_requires_gradient_sync(False)`` on the
    grouped ``[ln_f, head]``): ``kind`` "still_off" leaves it off at ``end_minibatch``, "on_after" turns it back on
    after the last backward (too late: FSDP holds the gradients). ``end_minibatch`` must refuse on every rank; with
    sync on again, the next minibatch matches stock FSDP2 (nothing held back leaks into it). ``opts``: ``bf16``
    (FSDP then accumulates in the reduce dtype, apart from the parameter's ``.grad``)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import odc_runtime.fsdp as ofsdp
    from odc_runtime.errors import OdcUsageError

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if opts.get("bf16") else None
    odc_model, fsdp_model = (shard_model(make_model(), mp, grouped=True) for _ in range(2))
    ofsdp.enable(odc_model)
    data = make_data(2, [2] * world, seed=13)

    def backward(model, mbs):
        for mb in mbs:
            (token_loss_sum(model, mb) / n_targets(mbs)).backward()

    out: dict[str, Any] = {"error": "NO ERROR"}
    try:
        with ofsdp.minibatch(odc_model):
            odc_model.head.set_requires_gradient_sync(False, recurse=False)
            backward(odc_model, data[0][rank])
            if kind == "on_after":
                odc_model.head.set_requires_gradient_sync(True, recurse=False)
    except OdcUsageError as e:
        out["error"] = str(e)
    odc_model.head.set_requires_gradient_sync(True, recurse=False)
    odc_model.zero_grad()
    with ofsdp.minibatch(odc_model):
        backward(odc_model, data[1][rank])
    backward(fsdp_model, data[1][rank])
    out["next_diff"] = max(
        (a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
        for a, b in zip(odc_model.parameters(), fsdp_model.parameters(), strict=True)
    )
    ofsdp.disable(odc_model)
    return out


def _train(model, opt, data, rank, steps_range):
    import torch

    import odc_runtime.fsdp as ofsdp

    for step in steps_range:
        tokens = sum(n_targets(mbs) for mbs in data[step])
        with ofsdp.minibatch(model, divide_factor=tokens):
            for mb in data[step][rank]:
                token_loss_sum(model, mb).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def _full(model) -> list:
    return [p.full_tensor().clone() for p in model.parameters()]


def scenario_state_dict(rank: int, world: int) -> dict:
    """Save, train, load, train again == train from the loaded state; also loading into a fresh model."""
    import odc_runtime.fsdp as ofsdp

    counts = [(r % 3) for r in range(world)]  # includes a rank with zero micro-batches
    data = make_data(6, counts, seed=5)
    model = shard_model(make_model())
    ofsdp.enable(model)
    opt = _sgd(model.parameters(), lr=0.1)  # momentum buffers: the optimizer state is part of the checkpoint
    _train(model, opt, data, rank, range(2))
    saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(model, opt, data, rank, range(2, 4))
    first = _full(model)
    model.load_state_dict(saved_model)
    opt.load_state_dict(copy.deepcopy(saved_opt))  # load_state_dict keeps references to the given tensors
    after_load = max(
        (a - b).abs().max().item()
        for a, b in zip(_full(model), [v.full_tensor() for v in saved_model.values()], strict=True)
    )
    _train(model, opt, data, rank, range(2, 4))
    again = _full(model)
    # a brand-new model (different init) loaded from the checkpoint continues the same way
    fresh = shard_model(make_model(seed=123))
    ofsdp.enable(fresh)
    fresh_opt = _sgd(fresh.parameters(), lr=0.1)
    fresh.load_state_dict(saved_model)
    fresh_opt.load_state_dict(copy.deepcopy(saved_opt))
    _train(fresh, fresh_opt, data, rank, range(2, 4))
    fresh_full = _full(fresh)
    moved = max(
        (a - b).abs().max().item() for a, b in zip(first, [v.full_tensor() for v in saved_model.values()], strict=True)
    )
    return {
        "after_load": after_load,
        "moved": moved,
        "again": max((a - b).abs().max().item() for a, b in zip(first, again, strict=True)),
        "fresh": max((a - b).abs().max().item() for a, b in zip(first, fresh_full, strict=True)),
    }


def scenario_disable(rank: int, world: int) -> dict:
    """ODC steps, then disable(): the model behaves as stock FSDP2 again (compared with a stock twin)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    import odc_runtime as odc
    import odc_runtime.fsdp as ofsdp
    from odc_runtime.fsdp import _compat

    data = make_data(4, [1] * world, seed=7)
    a, b = shard_model(make_model()), shard_model(make_model())
    ofsdp.enable(a)
    opt_a, opt_b = _sgd(a.parameters()), _sgd(b.parameters())
    for step in range(2):
        with ofsdp.minibatch(a):
            for mb in data[step][rank]:
                (token_loss_sum(a, mb) / n_targets([mb])).backward()
        for mb in data[step][rank]:
            (token_loss_sum(b, mb) / n_targets([mb])).backward()
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    ofsdp.disable(a)
    groups = [g for m in a.modules() if isinstance(m, FSDPModule) for g in _compat.param_groups(m)]
    restored = bool(groups) and all(
        type(_compat.comms(g)[0]) is DefaultAllGather
        and type(_compat.comms(g)[1]) is DefaultReduceScatter
        and not _compat.reduce_scatter_unused_params(g)
        for g in groups
    )
    # no ODC hook is left on the unsharded parameters (the unused-parameter tracking of older torch)
    restored = restored and all(
        not getattr(_compat.unsharded_param(fp), "_post_accumulate_grad_hooks", None)
        for g in groups
        for fp in _compat.group_layout(g).fsdp_params
    )
    for step in range(2, 4):  # plain FSDP2 on both: backward outside any minibatch is fine again
        for model, opt in ((a, opt_a), (b, opt_b)):
            for mb in data[step][rank]:
                (token_loss_sum(model, mb) / n_targets([mb])).backward()
            opt.step()
            opt.zero_grad()
    diff = max(
        (p.full_tensor() - q.full_tensor()).abs().max().item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    # enable again after disable works, and the heap usage returns to its level before
    ofsdp.enable(a)
    ofsdp.disable(a)
    return {"restored": restored, "diff": diff, "enabled": ofsdp.is_enabled(a), "odc_alive": odc.is_initialized()}


def scenario_misuse(rank: int, world: int) -> dict:
    """Each misuse raises OdcUsageError with a clear message; returns the messages."""
    import torch

    import odc_runtime.fsdp as ofsdp
    from odc_runtime.errors import OdcUsageError

    msgs: dict[str, str] = {}

    def expect(key, fn):
        try:
            fn()
        except OdcUsageError as e:
            msgs[key] = str(e)
        else:
            msgs[key] = "NO ERROR"

    model = shard_model(make_model())
    mb = make_data(1, [1] * world)[0][rank][0]

    def minibatch_without_enable():
        with ofsdp.minibatch(model):
            pass

    expect("without_enable", minibatch_without_enable)
    expect("not_fsdp", lambda: ofsdp.enable(make_model()))
    ofsdp.enable(model)
    expect("enable_twice", lambda: ofsdp.enable(model))
    expect("enable_block", lambda: ofsdp.enable(model.blocks[0]))

    def nested():
        with ofsdp.minibatch(model):
            try:
                with ofsdp.minibatch(model):
                    pass
            finally:
                pass

    # nested: the inner call raises; the outer minibatch is then abandoned (state broken) -> use a fresh model
    expect("nested", nested)
    expect("after_failure", lambda: ofsdp.begin_minibatch(model))
    ofsdp.disable(model)

    model = shard_model(make_model())
    ofsdp.enable(model)
    expect("end_without_begin", lambda: ofsdp.end_minibatch(model))
    with ofsdp.minibatch(model):
        token_loss_sum(model, mb).backward()

    def forward_outside():
        token_loss_sum(model, mb)  # a training forward: refused before FSDP's pre-forward (no all-gather entered)

    expect("forward_outside", forward_outside)

    def backward_outside():
        with ofsdp.minibatch(model):
            loss = token_loss_sum(model, mb)
        loss.backward()  # the forward ran inside, its backward after: the reduce-scatter refuses

    expect("backward_outside", backward_outside)
    if ofsdp.has_capability("reset_iter_state"):
        model.reset_iter_state()
        for p in model.parameters():
            p.grad = None
    else:  # torch < 2.13 cannot recover FSDP after an exception mid-backward: go on with a fresh model
        ofsdp.disable(model)
        model = shard_model(make_model())
        ofsdp.enable(model)
    expect("bad_divide_factor", lambda: (ofsdp.begin_minibatch(model), ofsdp.end_minibatch(model, divide_factor=0)))
    ofsdp.end_minibatch(model)
    # still usable after the misuse: a normal minibatch works
    with ofsdp.minibatch(model):
        token_loss_sum(model, mb).backward()
    ok = all(p.grad is not None and bool(torch.isfinite(p.grad.full_tensor()).all()) for p in model.parameters())
    ofsdp.disable(model)
    expect("disable_twice", lambda: ofsdp.disable(model))

    # validate=True: parameters changed inside a minibatch are caught at the next all-gather
    model = shard_model(make_model())
    ofsdp.enable(model, validate=True)

    def modified_inside():
        with ofsdp.minibatch(model):
            with torch.no_grad():
                model.head.weight.add_(1.0)  # e.g. an optimizer step inside the minibatch
            token_loss_sum(model, mb)

    expect("modified_inside", modified_inside)
    if ofsdp.has_capability("reset_iter_state"):
        model.reset_iter_state()
    msgs["usable_after"] = str(ok)
    return msgs


def scenario_eval_outside(rank: int, world: int) -> dict:
    """A no-grad forward outside a minibatch (all ranks together) matches the reference model's output."""
    import torch

    import odc_runtime.fsdp as ofsdp

    model = shard_model(make_model(), reshard_after_forward=False)
    ref = make_model()
    ofsdp.enable(model)
    tokens = make_data(1, [1])[0][0][0]
    with torch.no_grad():
        out = model(tokens)
    with ofsdp.minibatch(model):  # no micro-batch at all on any rank: gradients are all zero
        pass
    zero = all(float(p.grad.full_tensor().abs().max()) == 0.0 for p in model.parameters())
    return {"eval": (out - ref(tokens)).abs().max().item(), "zero_grads": zero}


def scenario_refusals(rank: int, world: int) -> dict[str, str]:
    """enable() refuses clearly: before odc.init, HSDP with one-rank shard groups, CPU offload, params outside FSDP,
    no_sync."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import odc_runtime as odc
    import odc_runtime.fsdp as ofsdp
    from odc_runtime.errors import OdcUsageError

    out: dict[str, str] = {}
    odc.finalize()  # the suite runner initialised it

    def expect(key, needle, fn):
        try:
            fn()
        except OdcUsageError as e:
            out[key] = "OK" if needle in str(e) else f"wrong message: {e}"
        except Exception as e:
            out[key] = f"wrong error type {type(e).__name__}: {e}"
        else:
            out[key] = "NO ERROR"

    expect("before_init", "needs odc_runtime.init()", lambda: ofsdp.enable(shard_model(make_model())))
    odc.init("host", timeout=60)
    mesh2d = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    hsdp = make_model()
    fully_shard(hsdp, mesh=mesh2d)
    expect("hsdp", "shard group of one rank", lambda: ofsdp.enable(hsdp))  # HSDP itself: tests/test_hsdp.py
    offload = make_model()
    fully_shard(offload, offload_policy=CPUOffloadPolicy(pin_memory=False))
    expect("cpu_offload", "CPU offload", lambda: ofsdp.enable(offload))
    partial = make_model()
    for block in partial.blocks:
        fully_shard(block)
    expect("outside_fsdp", "not managed by FSDP", lambda: ofsdp.enable(partial))
    no_sync = shard_model(make_model())
    no_sync.set_requires_gradient_sync(False)
    expect("no_sync", "set_requires_gradient_sync(False)", lambda: ofsdp.enable(no_sync))
    late = shard_model(make_model())
    ofsdp.enable(late)
    late.set_requires_gradient_sync(False)
    expect("no_sync_late", "set_requires_gradient_sync(False)", lambda: ofsdp.begin_minibatch(late))
    late.set_requires_gradient_sync(True)
    ofsdp.begin_minibatch(late)
    ofsdp.end_minibatch(late)
    ofsdp.disable(late)
    return out


def scenario_single_rank(rank: int, world: int) -> str:
    """enable() on a world of one refuses (FSDP2 would bypass the reduce-scatter hook there)."""
    import odc_runtime.fsdp as ofsdp
    from odc_runtime.errors import OdcUsageError

    try:
        ofsdp.enable(shard_model(make_model()))
    except OdcUsageError as e:
        return str(e)
    return "NO ERROR"


def run_suite(rank: int, world: int, plan: list[tuple[str, str, tuple]]) -> dict[str, Any]:
    """Run several scenarios in one process group: ``plan`` = [(key, scenario function name, args)].

    A scenario that raises on this rank records ``{"__error__": traceback}`` under its key; the next scenarios
    still run (ranks re-align on a barrier first).
    """
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for key, name, args in plan:
        dist.barrier()
        try:
            results[key] = globals()[name](rank, world, *args)
        except Exception:
            results[key] = {"__error__": traceback.format_exc()}
    return results


# -- assertions shared by test_fsdp.py and test_hsdp.py (they run in the pytest process) --------------------------
def results(suite: list[dict], key: str) -> list[Any]:
    """Every rank's result of scenario ``key``; fails the test with the rank's traceback if it raised."""
    import pytest

    out = []
    for rank, res in enumerate(suite):
        if isinstance(res[key], dict) and "__error__" in res[key]:
            pytest.fail(f"rank {rank} failed in scenario {key!r}:\n{res[key]['__error__']}")
        out.append(res[key])
    return out


def check_vs_stock(results: list[dict], tol: float, rel: float = 1e-5) -> None:
    """``scenario_unequal_vs_fsdp``'s results: gradients and parameters within ``tol`` of stock FSDP2 after every
    step, losses and clipped norms within ``rel`` (relative), and the clipping active."""
    import pytest

    for r, res in enumerate(results):
        assert max(res["grad_diff"]) < tol, f"rank {r}: gradient diffs per step {res['grad_diff']}"
        assert max(res["diff"]) < tol, f"rank {r}: parameter diffs per step {res['diff']}"
        assert res["norm"] == pytest.approx(res["fsdp_norm"], rel=rel), f"rank {r}"
        assert res["loss"] == pytest.approx(res["fsdp_loss"], rel=rel), f"rank {r}"
        assert all(n > res["clip"] for n in res["fsdp_norm"]), f"rank {r}: clipping inactive {res['fsdp_norm']}"


def check_vs_reference(results: list[dict], tol: float) -> None:
    """Parameters within ``tol`` of the single-process reference after every step, and the same losses."""
    import pytest

    for r, res in enumerate(results):
        assert max(res["diff"]) < tol, f"rank {r}: param diffs per step {res['diff']}"
        for a, b in zip(res["loss"], res["ref_loss"], strict=True):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
