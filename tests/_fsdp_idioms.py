"""Trainer idioms in FSDP2 ODC mode (tests/test_fsdp_idioms.py): one training loop whose options switch the idioms
real FSDP2 trainers use, run in ODC mode against collective FSDP2 (equal micro-batch counts) and a single-process
reference (unequal counts, zero included), plus the slips ODC refuses. Scenarios run on spawned ranks through
``_fsdp_harness.run``; they return plain values the tests assert on.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import _fsdp_harness as h

# idiom -> options of train(); every row of the README's table "trainer idioms in ODC mode" that works is one key
IDIOMS: dict[str, dict[str, Any]] = {
    # model.unshard() (root, sync) + every block's unshard(async_op=True) at the start of each minibatch
    "explicit_prefetch": {"prefetch": True},
    "prefetch_hooks": {"prefetch_hooks": True},  # set_modules_to_forward_prefetch / _backward_prefetch
    "no_reshard_after_backward": {"reshard_after_backward": False},
    # reshard_after_forward=False, and ranks without micro-batches run a forward-only (validation) pass
    "raf_false_forward_only": {"reshard_after_forward": False, "forward_only": True},
    "checkpoint_wrapper": {"checkpoint": True},  # activation checkpointing (non-reentrant) on every block
    "eval_inside": {"eval_inside": True},  # model.eval() + no_grad forwards inside the minibatch, rank r runs r
    "eval_outside": {"eval_outside": True},  # the same on every rank together, between minibatches
    "grad_accumulation": {"accumulate": 2},  # two minibatches, then one optimizer step
    # meta-device init, to_empty, full state dict loaded with set_model_state_dict, Adam, clip_grad_norm_
    "meta_init_adam_clip": {"meta": True, "adam": True, "clip": 0.05},
}


def _loss(model, mb, world: int, tokens: int):
    # sum of token losses scaled so that FSDP's mean over ranks (ODC's default divide factor) is the global mean
    return h.token_loss_sum(model, mb) * (world / tokens)


def _eval_batch(step: int, i: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + i)
    return torch.randint(0, 37, (1, 6), generator=g)


def _data(minibatches: int, counts: list[int]) -> list:
    """``make_data`` with the per-rank counts rotated by one rank every minibatch: a rank without micro-batches in
    one minibatch runs some in the next (what an explicit prefetch left pending must not leak into it)."""
    data = h.make_data(minibatches, counts, seed=3)
    return [d[-(k % len(counts)) :] + d[: -(k % len(counts))] if k % len(counts) else d for k, d in enumerate(data)]


def _schedule(opts: dict, counts: list[int], steps: int) -> list[list[tuple[list, int]]]:
    """Per optimizer step, its minibatches (one, or ``accumulate``): each the per-rank micro-batches and the
    minibatch's global number of targets."""
    accumulate = opts.get("accumulate", 1)
    data = _data(steps * accumulate, counts)
    return [
        [(mbs, sum(h.n_targets(m) for m in mbs)) for mbs in data[step * accumulate : (step + 1) * accumulate]]
        for step in range(steps)
    ]


def _build(opts: dict, rank: int):
    """(sharded model, optimizer) of the idiom, and the reference (plain model, optimizer) with the same init."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ref = h.make_model()
    if opts.get("meta"):
        with torch.device("meta"):
            model = h.make_model()
    else:
        model = copy.deepcopy(ref)
    if opts.get("checkpoint"):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if opts.get("compile"):
        for block in model.blocks:
            block.compile(dynamic=True)  # in place: the block stays the module fully_shard wraps
    h.shard_model(model, reshard_after_forward=opts.get("reshard_after_forward", True))
    if opts.get("meta"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device="cpu")
        set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    if opts.get("reshard_after_backward") is False:
        model.set_reshard_after_backward(False)
    if opts.get("prefetch_hooks"):
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - 1) : i][::-1])

    def make_opt(params):
        return torch.optim.Adam(params, lr=1e-2) if opts.get("adam") else h._sgd(params)

    return model, make_opt(model.parameters()), ref, make_opt(ref.parameters())


def train(rank: int, world: int, opts: dict, counts: list[int], steps: int, odc_mode: bool) -> dict:
    """Train ``steps`` optimizer steps with the idiom ``opts``; ODC mode or collective FSDP2 (equal counts only).

    Returns the full parameters after every step, the losses, the clipped norms and the validation losses.
    """
    import torch
    from torch.distributed.fsdp import FSDPModule

    import odc_runtime.fsdp as ofsdp

    model, opt, _, _ = _build(opts, rank)
    if odc_mode:
        ofsdp.enable(model)
    out: dict[str, list] = {"params": [], "loss": [], "norm": [], "eval": []}
    for step, minibatches in enumerate(_schedule(opts, counts, steps)):
        for mbs, tokens in minibatches:
            loss_sum = torch.zeros(())
            with ofsdp.minibatch(model) if odc_mode else contextlib.nullcontext():
                if opts.get("prefetch"):
                    model.unshard()
                    for block in model.blocks:
                        block.unshard(async_op=True)
                if opts.get("eval_inside"):  # collective FSDP2 needs the same count on every rank
                    out["eval"] += _evaluate(model, step, range(rank if len(set(counts)) > 1 else 1))
                for mb in mbs[rank]:
                    loss = _loss(model, mb, world, tokens)
                    loss.backward()
                    loss_sum += loss.detach()
                if opts.get("forward_only") and not mbs[rank]:
                    out["eval"] += _evaluate(model, step, [0], train_mode=True)
                if not odc_mode and opts.get("reshard_after_backward") is False:
                    for m in model.modules():  # collective FSDP2 leaves that to the user; ODC reshards itself
                        if isinstance(m, FSDPModule):
                            m.reshard()
            torch.distributed.all_reduce(loss_sum)
            out["loss"].append(loss_sum.item() / world)
        if opts.get("eval_outside"):
            out["eval"] += _evaluate(model, step, range(2))
        if opts.get("clip") is not None:
            out["norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), opts["clip"]).full_tensor()))
        opt.step()
        opt.zero_grad()
        out["params"].append([p.full_tensor() for p in model.parameters()])
    if odc_mode:
        ofsdp.disable(model)
    return out


def _evaluate(model, step: int, which, train_mode: bool = False) -> list[float]:
    import torch

    losses = []
    if not train_mode:
        model.eval()
    with torch.no_grad():
        for i in which:
            tokens = _eval_batch(step, i)
            losses.append(h.token_loss_sum(model, tokens).item())
    model.train()
    return losses


def reference(rank: int, world: int, opts: dict, counts: list[int], steps: int) -> dict:
    """One process trains on every rank's micro-batches (what ODC mode must reproduce)."""
    import torch

    _, _, ref, opt = _build(opts, rank)
    out: dict[str, list] = {"params": [], "loss": [], "norm": [], "eval": []}
    for step, minibatches in enumerate(_schedule(opts, counts, steps)):
        for mbs, tokens in minibatches:
            if opts.get("eval_inside"):
                out["eval"] += _evaluate(ref, step, range(rank))
            total = 0.0
            for per_rank in mbs:
                for mb in per_rank:
                    loss = _loss(ref, mb, world, tokens) / world
                    loss.backward()
                    total += loss.item()
            if opts.get("forward_only") and not mbs[rank]:
                out["eval"] += _evaluate(ref, step, [0], train_mode=True)
            out["loss"].append(total)
        if opts.get("eval_outside"):
            out["eval"] += _evaluate(ref, step, range(2))
        if opts.get("clip") is not None:
            out["norm"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), opts["clip"])))
        opt.step()
        opt.zero_grad()
        out["params"].append([p.detach().clone() for p in ref.parameters()])
    return out


def compare(a: dict, b: dict) -> dict:
    """Largest differences between two runs: parameters after every step, losses, norms, validation losses."""

    def dmax(xs, ys) -> float:
        return max((abs(x - y) for x, y in zip(xs, ys, strict=True)), default=0.0)

    return {
        "params": max(
            (p - q).abs().max().item()
            for pa, pb in zip(a["params"], b["params"], strict=True)
            for p, q in zip(pa, pb, strict=True)
        ),
        "loss": dmax(a["loss"], b["loss"]),
        "norm": dmax(a["norm"], b["norm"]),
        "eval": dmax(a["eval"], b["eval"]),
        "n_eval": len(a["eval"]),
        "n_norm": len(a["norm"]),
    }


def scenario_idioms(rank: int, world: int, names: list[str], steps: int, unequal: list[int]) -> dict:
    """Every idiom in ``names``: ODC vs collective FSDP2 with equal counts, ODC vs the reference with ``unequal``."""
    import torch.distributed as dist

    out = {}
    for name in names:
        opts = IDIOMS[name]
        dist.barrier()
        equal = [2] * world
        odc_eq = train(rank, world, opts, equal, steps, True)
        coll = train(rank, world, opts, equal, steps, False)
        odc_un = train(rank, world, opts, unequal, steps, True)
        ref = reference(rank, world, opts, unequal, steps)
        out[name] = {"vs_collective": compare(odc_eq, coll), "vs_reference": compare(odc_un, ref)}
    return out


def scenario_compile(rank: int, world: int, steps: int, counts: list[int], odc_timeout: float) -> dict:
    """torch.compile (inductor) on every block before fully_shard, as torchtitan does: ODC vs the reference.

    A rank compiles the blocks at its first micro-batch, inside a minibatch, while a rank without micro-batches
    there waits in ``end_minibatch``'s sync: ``odc_timeout`` must cover a cold compile (over 100 s on a loaded
    2-core host; the harness's 60 s made this test fail with an ODC timeout at that sync)."""
    import odc_runtime as odc

    odc.init("host", timeout=odc_timeout)
    opts = {"compile": True}
    odc_run = train(rank, world, opts, counts, steps, True)
    return compare(odc_run, reference(rank, world, opts, counts, steps))


def scenario_dcp(rank: int, world: int, path: str, counts: list[int]) -> dict:
    """torch.distributed.checkpoint save/load of the sharded model and optimizer state between minibatches: train,
    save, train 2 steps (A), load, train the same 2 steps again (B): A == B, and A matches the reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import odc_runtime.fsdp as ofsdp

    model, opt, ref, ref_opt = _build({}, rank)
    ofsdp.enable(model)
    data = h.make_data(3, counts, seed=4)

    def step(m, o, k, single=False):
        mbs = data[k]
        tokens = sum(h.n_targets(x) for x in mbs)
        if single:
            for per_rank in mbs:
                for mb in per_rank:
                    (_loss(m, mb, world, tokens) / world).backward()
        else:
            with ofsdp.minibatch(m):
                for mb in mbs[rank]:
                    _loss(m, mb, world, tokens).backward()
        o.step()
        o.zero_grad()

    step(model, opt, 0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    for k in (1, 2):
        step(model, opt, k)
    first = [p.full_tensor().clone() for p in model.parameters()]
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for k in (1, 2):
        step(model, opt, k)
    again = [p.full_tensor() for p in model.parameters()]
    for k in range(3):
        step(ref, ref_opt, k, single=True)
    return {
        "again": max((a - b).abs().max().item() for a, b in zip(first, again, strict=True)),
        "moved": max((a - b).abs().max().item() for a, b in zip(first, _plain(h.make_model()), strict=True)),
        "vs_reference": max((a - b).abs().max().item() for a, b in zip(first, _plain(ref), strict=True)),
    }


def _plain(model) -> list:
    return [p.detach() for p in model.parameters()]


def _error(fn) -> str:
    """The OdcUsageError message ``fn`` raises, ``NO ERROR``, or the type and message of another exception."""
    from odc_runtime.errors import OdcUsageError

    try:
        fn()
    except OdcUsageError as e:
        return str(e)
    except Exception as e:
        return f"WRONG {type(e).__name__}: {e}"
    return "NO ERROR"


def _grads(model) -> list:
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def _bits_equal(a: list, b: list) -> bool:  # fp32 tensors
    import torch

    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


def scenario_slips(rank: int, world: int, counts: list[int]) -> dict:
    """The slips of issue 25, each on a fresh ODC model (4 ranks, ``counts`` micro-batches per rank, zero included):
    refused at the call with a typed error, or made harmless; the model stays usable where the error says so."""
    import numpy as np
    import torch

    import odc_runtime.fsdp as ofsdp

    data = h.make_data(3, counts, seed=9)
    tokens = [sum(h.n_targets(m) for m in step) for step in data]
    out: dict[str, Any] = {}

    def fresh(validate=False):
        model, opt, ref, _ = _build({}, rank)
        ofsdp.enable(model, validate=validate)
        return model, opt, ref

    def micro(model, k):
        for mb in data[k][rank]:
            _loss(model, mb, world, tokens[k]).backward()

    def ref_grads(ref, k):
        for per_rank in data[k]:
            for mb in per_rank:
                (_loss(ref, mb, world, tokens[k]) / world).backward()
        g = [p.grad.clone() for p in ref.parameters()]
        ref.zero_grad()
        return g

    # optimizer.step() inside the minibatch: refused at the call, before the parameters change
    model, opt, _ = fresh()
    before = [p.full_tensor() for p in model.parameters()]

    def step_inside():
        with ofsdp.minibatch(model):
            micro(model, 0)
            opt.step()

    out["step_inside"] = _error(step_inside)
    out["step_inside_unchanged"] = _bits_equal(before, [p.full_tensor() for p in model.parameters()])
    ofsdp.disable(model)

    # load_state_dict() inside the minibatch: refused at the call
    model, opt, _ = fresh()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def load_inside():
        with ofsdp.minibatch(model):
            model.load_state_dict(sd)

    out["load_inside"] = _error(load_inside)
    ofsdp.disable(model)

    # an in-place change inside the minibatch on rank 1 only (no validate): end_minibatch fails on every rank, says
    # what changed where it happened, discards the minibatch, and the next minibatch is exact
    model, opt, ref = fresh()

    def edit_inside():
        with ofsdp.minibatch(model):
            micro(model, 0)
            if rank == 1:
                with torch.no_grad():
                    model.head.weight.to_local()[0, :3].add_(1.0)

    out["edit_inside"] = _error(edit_inside)
    with torch.no_grad():  # undo the edit, so that the next minibatch is comparable with the reference
        if rank == 1:
            model.head.weight.to_local()[0, :3].sub_(1.0)
    out["edit_next_exact"] = _after(model, ref, micro, ref_grads, 1)

    # divide_factor that differs between ranks (a local token count): refused on every rank, nothing written
    model, opt, ref = fresh()

    def local_factor():
        with ofsdp.minibatch(model, divide_factor=float(1 + rank)):
            micro(model, 0)

    out["local_factor"] = _error(local_factor)
    out["local_factor_no_grads"] = all(p.grad is None or not p.grad.to_local().any() for p in model.parameters())
    out["local_factor_next_exact"] = _after(model, ref, micro, ref_grads, 1)

    # a divide factor that overflows the gradients: refused on every rank
    def tiny_factor():
        with ofsdp.minibatch(model, divide_factor=1e-45):
            micro(model, 0)

    out["tiny_factor"] = _error(tiny_factor)
    model.zero_grad()

    # np.float32 divide factors are accepted (like odc.push(scale=)) and act as the float
    with ofsdp.minibatch(model, divide_factor=np.float32(2.0)):
        micro(model, 0)
    g_np = _grads(model)
    model.zero_grad()
    with ofsdp.minibatch(model, divide_factor=2.0):
        micro(model, 0)
    # (pushes land in any order: equal up to fp32 rounding; a factor of 1 instead of 2 would differ by 100 %)
    out["np_float32_diff"] = max((a - b).abs().max().item() for a, b in zip(g_np, _grads(model), strict=True))
    model.zero_grad()

    # a training forward outside a minibatch is refused before FSDP's pre-forward: nothing changed, the next
    # minibatch is exact without any cleanup
    micro_all = data[0][rank] or data[0][-1]
    out["forward_outside"] = _error(lambda: _loss(model, micro_all[0], world, tokens[0]))
    out["forward_next_exact"] = _after(model, ref, micro, ref_grads, 1)

    # a backward outside a minibatch (of a forward inside one) is refused; ODC itself cleans FSDP's state, the next
    # minibatch is exact
    def backward_outside():
        with ofsdp.minibatch(model):
            loss = _loss(model, micro_all[0], world, tokens[0])
        loss.backward()

    out["backward_outside"] = _error(backward_outside)
    if ofsdp.has_capability("reset_iter_state"):
        out["backward_next_exact"] = _after(model, ref, micro, ref_grads, 2)
    ofsdp.disable(model)

    # NaN in the parameters (e.g. uninitialised memory), validate=True: no false "parameters changed" error; the
    # loss and the gradients are NaN, as collective FSDP2 gives
    model, opt, _ = fresh(validate=True)
    with torch.no_grad():
        model.blocks[0].qkv.weight.to_local().view(-1)[0] = float("nan")
    loss = torch.zeros(())

    def nan_minibatch():
        nonlocal loss
        with ofsdp.minibatch(model):
            for mb in data[0][rank]:
                one = _loss(model, mb, world, tokens[0])
                one.backward()
                loss = loss + one.detach()

    out["nan"] = _error(nan_minibatch)
    torch.distributed.all_reduce(loss)
    out["nan_loss"] = bool(torch.isnan(loss))
    ofsdp.disable(model)
    return out


def _after(model, ref, micro, ref_grads, k: int) -> float:
    """Run minibatch ``k`` on ``model`` (after a refused slip) and return its largest gradient difference from the
    reference's gradients of the same minibatch (the reference's parameters are the initial ones, like model's)."""
    import odc_runtime.fsdp as ofsdp

    model.zero_grad()
    with ofsdp.minibatch(model):
        micro(model, k)
    diff = max((a - b).abs().max().item() for a, b in zip(_grads(model), ref_grads(ref, k), strict=True))
    model.zero_grad()
    return diff


def scenario_forward_outside(rank: int, world: int) -> dict:
    """The README's FSDP loop without its ``with odc_runtime.fsdp.minibatch(model):``, rank r running r micro-batches
    (issue 43: ranks 1.. waited in FSDP's all-gather for rank 0 until a timeout that never said "minibatch"). Every
    rank that runs a forward is refused at once; then every rank runs the same loop inside a minibatch: the refusal
    changed nothing."""
    import torch

    import odc_runtime.fsdp as ofsdp

    model = h.shard_model(h.make_model())
    ofsdp.enable(model)
    data = h.make_data(1, list(range(world)), seed=5)[0]
    out: dict = {"errors": []}
    for mb in data[rank]:  # a hang here (the bug) fails the test at the harness's timeout
        out["errors"].append(_error(lambda mb=mb: h.token_loss_sum(model, mb).backward()))
    with ofsdp.minibatch(model):
        for mb in data[rank]:
            h.token_loss_sum(model, mb).backward()
    out["finite"] = all(bool(torch.isfinite(p.grad.full_tensor()).all()) for p in model.parameters())
    out["nonzero"] = any(bool(p.grad.full_tensor().any()) for p in model.parameters())
    ofsdp.disable(model)
    return out


def scenario_lone_eval(rank: int, world: int, together: bool = True) -> dict:
    """Rank 1 runs a validation forward outside a minibatch while rank 0 starts one (issue 53: rank 0 waited
    ODC_TIMEOUT, rank 1 then got gloo's raw "Connection closed by peer"). Both are refused at once, typed, before
    any torch.distributed collective. ``together``: the runtime stayed usable (host: an aligned round), so every
    rank then evaluates together, exactly; else (symm's stream-ordered sync fails the runtime) release locally."""
    import time

    import torch

    import odc_runtime as odc
    import odc_runtime.fsdp as ofsdp
    from odc_runtime import testing

    odc.init("host", timeout=60)
    model = h.shard_model(h.make_model())
    ref = h.make_model()
    ofsdp.enable(model)
    tokens = _eval_batch(0, 0)
    t0 = time.monotonic()
    try:
        if rank == 0:
            ofsdp.begin_minibatch(model)
        else:
            with torch.no_grad():
                model(tokens)
        error = ("NO ERROR", "")
    except odc.OdcError as e:
        error = (type(e).__name__, str(e))
    elapsed = time.monotonic() - t0
    if not together:
        testing.abandon()
        return {"error": error, "elapsed": elapsed, "diff": None}
    with torch.no_grad():  # every rank together: allowed, and exact
        diff = (model(tokens) - ref(tokens)).abs().max().item()
    odc.finalize()
    return {"error": error, "elapsed": elapsed, "diff": diff}


def _grad_slip(rank: int, world: int, kind: str, odc_mode: bool) -> dict:
    """Two minibatches of 2 micro-batches per rank; minibatch 1 runs the gradient idiom ``kind`` (ODC mode or
    collective FSDP2, the reference). Returns the error raised (``NO ERROR``) and the gradients after minibatch 1,
    then after minibatch 2 (run plainly, after ``zero_grad``)."""
    import torch

    import odc_runtime.fsdp as ofsdp

    model, opt, _, _ = _build({}, rank)
    if odc_mode:
        ofsdp.enable(model)
    data = h.make_data(3, [2] * world, seed=11)
    tokens = [sum(h.n_targets(m) for m in step) for step in data]

    def window(k):
        return ofsdp.minibatch(model) if odc_mode else contextlib.nullcontext()

    def backward(k, i):
        _loss(model, data[k][rank][i], world, tokens[k]).backward()

    with window(0):  # leaves gradients in .grad (no zero_grad after it)
        backward(0, 0)
        backward(0, 1)

    kept = []

    def idiom():
        with window(1):
            if kind == "zero_grad_first":  # before any backward of the minibatch: drops minibatch 0 (both modes)
                opt.zero_grad()
            backward(1, 0)
            if kind == "zero_grad_between":  # FSDP2 drops micro-batch 0 (and minibatch 0)
                opt.zero_grad()
            if kind == "zero_grad_keep":  # set_to_none=False
                opt.zero_grad(set_to_none=False)
            if kind == "clip_between":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            if kind == "grad_kept":  # a reference to .grad taken inside the minibatch ...
                kept.append(model.head.weight.grad)
            backward(1, 1)
        if kept:  # ... used after it (local: no collective)
            kept[0].to_local().sum()

    out = {"error": _error(idiom)}
    out["grads"] = [g.tolist() for g in _grads(model)] if all(p.grad is not None for p in model.parameters()) else None
    if kind == "zero_grad_between" and odc_mode:  # refused at end_minibatch on every rank: the model stays usable
        opt.zero_grad()
        with window(2):
            backward(2, 0)
            backward(2, 1)
        out["next"] = [g.tolist() for g in _grads(model)]
    if odc_mode:
        ofsdp.disable(model)
    elif kind == "zero_grad_between":
        opt.zero_grad()
        backward(2, 0)
        backward(2, 1)
        out["next"] = [g.tolist() for g in _grads(model)]
    return out


def scenario_grad_slips(rank: int, world: int, kinds: list[str]) -> dict:
    """Each gradient idiom inside a minibatch in ODC mode and in collective FSDP2 (equal micro-batch counts)."""
    import torch.distributed as dist

    out = {}
    for kind in kinds:
        dist.barrier()
        out[kind] = {"odc": _grad_slip(rank, world, kind, True)}
        if kind != "clip_between":  # collective FSDP2 clips a partial sum; ODC refuses at the call
            out[kind]["fsdp2"] = _grad_slip(rank, world, kind, False)
    return out
