"""odc_runtime.integrations.verl: the veRL recipe's contract, tested with stand-ins and, where installed, veRL.

Most tests run without veRL, against *stand-ins* written from veRL 0.9.1's behaviour, with veRL's data layout:

- batches are dicts shaped like veRL's actor batches (``input_ids`` / ``attention_mask`` / ``position_ids``
  ``[batch, seq]`` right-padded, ``responses`` / ``response_mask`` / ``old_log_probs`` / ``advantages``
  ``[batch, response]``, per-sample non-tensor lists), and the no-padding variant with jagged nested ``input_ids``;
- a fake ``verl`` package (in ``sys.modules``, version 0.9.1) whose ``rearrange_micro_batches`` has veRL's
  signature and its equal-count behaviour (all-reduce of the maximum count over the data-parallel group), imported
  by name into a fake ``verl.workers.engine.utils`` as veRL does, and a ``Metric`` whose ``aggregate_dp`` refuses
  unequal counts as veRL's does;
- a fake FSDP engine with veRL's ``forward_backward_batch(data, loss_function, forward_only)`` structure: global
  token count all-reduced, micro-batches from ``prepare_micro_batches``, token-mean loss × dp_size, deferred gradient
  sync (``set_requires_gradient_sync(False)``) on all but the last micro-batch, optimizer step afterwards.

When veRL is importable (``.ci/verl.sh`` runs this file in its veRL venv), the last tests also run the adapter on
veRL's own TensorDict batches, ``rearrange_micro_batches``, ``restore_dynamic_batch``, ``prepare_micro_batches``
and ``Metric``. veRL's worker and engine with a real model: ``tests/test_verl_real.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_ranks

import odc_runtime.integrations.verl as ov
from odc_runtime.errors import OdcUsageError

VOCAB, SEQ, RESP = 37, 14, 6

# --------------------------------------------------------------------------------------------------- batches


def verl_batch(lengths: list[int], seed: int, nested: bool = False) -> dict:
    """A veRL-shaped actor batch: prompt + response per row, right-padded to SEQ, responses to RESP."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    input_ids = torch.zeros(n, SEQ, dtype=torch.long)
    mask = torch.zeros(n, SEQ, dtype=torch.long)
    responses = torch.zeros(n, RESP, dtype=torch.long)
    response_mask = torch.zeros(n, RESP, dtype=torch.long)
    for i, total in enumerate(lengths):
        resp = min(RESP, max(1, total // 2))
        prompt = total - resp
        ids = torch.randint(1, VOCAB, (total,), generator=g)
        input_ids[i, :total], mask[i, :total] = ids, 1
        responses[i, :resp], response_mask[i, :resp] = ids[prompt:], 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "old_log_probs": torch.randn(n, RESP, generator=g),
        "advantages": torch.randn(n, RESP, generator=g),
        "uid": [f"prompt-{i // 2}" for i in range(n)],
        "temperature": 1.0,
    }
    if nested:
        batch["input_ids"] = torch.nested.as_nested_tensor(
            [input_ids[i, :total] for i, total in enumerate(lengths)], layout=torch.jagged
        )
    return batch


# --------------------------------------------------------------------------------------------------- unit tests


def test_plan_micro_batches_packs_under_the_cap_without_equal_counts():
    lengths = [9, 3, 12, 1, 7, 5, 2, 11, 4]
    parts = ov.plan_micro_batches(lengths, 16)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 16 for p in parts)
    assert len(parts) == -(-sum(lengths) // 16)  # these lengths pack perfectly: the minimum count
    assert ov.plan_micro_batches([], 16) == []  # a rank with nothing to do runs no micro-batch
    assert ov.plan_micro_batches(torch.tensor([3, 4]), 16) == [[0, 1]]
    grouped = ov.plan_micro_batches([5, 6, 1, 2, 7, 8], 16, force_group_size=2)
    assert all(p[k] % 2 == 0 and p[k + 1] == p[k] + 1 for p in grouped for k in range(0, len(p), 2))
    assert ov.plan_micro_batches([0, 4], 16) == [[0, 1]]  # an all-padding row is planned, not dropped


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"seqlens": [17], "max_token_len": 16}, "ppo_max_token_len_per_gpu"),
        ({"seqlens": [-1], "max_token_len": 16}, "must be an int >= 0"),
        ({"seqlens": [1, 2, 3], "max_token_len": 16, "force_group_size": 2}, "groups of 2"),
    ],
)
def test_plan_micro_batches_rejects_bad_input(kwargs, needle):
    with pytest.raises(OdcUsageError, match=needle):
        ov.plan_micro_batches(**kwargs)


@pytest.mark.parametrize("nested", [False, True])
def test_rearrange_micro_batches_has_verls_contract(nested):
    lengths = [14, 3, 8, 5, 11, 2, 6, 9]
    batch = verl_batch(lengths, seed=0, nested=nested)
    mbs, index_lists = ov.rearrange_micro_batches(batch, 20, dp_group=object(), same_micro_num_in_dp=True)
    assert len(mbs) == len(index_lists) == -(-sum(lengths) // 20)
    order = [i for idx in index_lists for i in idx]
    assert sorted(order) == list(range(len(lengths)))
    for mb, idx in zip(mbs, index_lists, strict=True):
        assert sum(lengths[i] for i in idx) <= 20
        assert ov.seq_lengths(mb) == [lengths[i] for i in idx]
        assert torch.equal(mb["advantages"], batch["advantages"][idx])
        assert torch.equal(mb["attention_mask"], batch["attention_mask"][idx])
        assert mb["uid"] == [batch["uid"][i] for i in idx]
        assert mb["temperature"] == 1.0
        if nested:
            assert [t.tolist() for t in mb["input_ids"].unbind()] == [
                batch["input_ids"].unbind()[i].tolist() for i in idx
            ]
    # veRL restores per-sample outputs with the inverse of the concatenated index lists
    outputs = torch.cat([mb["old_log_probs"] for mb in mbs])
    restored = torch.empty_like(outputs)
    restored[torch.tensor(order)] = outputs
    assert torch.equal(restored, batch["old_log_probs"])
    with pytest.raises(OdcUsageError, match="pipeline parallelism"):
        ov.rearrange_micro_batches(batch, 20, num_batches_divided_by=2)


def test_cost_model_from_hf_config_reads_decoder_fields():
    class Cfg:
        num_hidden_layers, hidden_size, num_attention_heads, vocab_size = 28, 3584, 28, 152064
        intermediate_size, num_key_value_heads = 18944, 4

    cost = ov.cost_model_from_hf_config(Cfg())
    assert cost.a > 0 and cost.b > 0
    with pytest.raises(OdcUsageError, match="lacks a decoder field"):
        ov.cost_model_from_hf_config(object())


def test_install_without_verl_says_so(monkeypatch):
    for name in ov.VERL_PLANNER_SITES:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    with pytest.raises(OdcUsageError, match="is verl installed"):
        ov.install()


def _metrics(kind: str, *per_rank: list[float]) -> list:
    return [FakeMetric(kind, v) for v in per_rank]


def test_aggregate_dp_is_verls_own_for_equal_counts_and_reduces_unequal_ones_per_rank(monkeypatch):
    import numpy as np

    stock = FakeMetric.aggregate_dp
    monkeypatch.setattr(ov, "_ATTACHED", [1])  # an ODC engine is attached in this process
    equal = _metrics("mean", [1.0, 2.0], [3.0, 4.0])
    assert ov.aggregate_dp(equal, original=stock) == stock(equal)  # veRL's function itself, same values
    # unequal counts (rank 0: 4 micro-batches, rank 1: 1): each rank reduced with the metric's aggregation, then
    # averaged over ranks (mean / sum); min / max over every value
    a, b = [0.5, -1.0, 2.0, 0.25], [3.0]
    assert ov.aggregate_dp(_metrics("sum", a, b), original=stock) == pytest.approx((1.75 + 3.0) / 2, abs=0)
    assert ov.aggregate_dp(_metrics("mean", a, b), original=stock) == pytest.approx((0.4375 + 3.0) / 2, abs=0)
    assert ov.aggregate_dp(_metrics("min", a, b), original=stock) == -1.0
    assert ov.aggregate_dp(_metrics("max", a, b), original=stock) == 3.0
    # with equal counts the per-rank rule is stock's rule regrouped: same numbers (veRL: mean over ranks per index)
    x, y = [0.5, -1.0, 2.0], [3.0, 0.125, -0.75]
    for kind, per_index in (("sum", np.sum), ("mean", np.mean)):
        ragged = ov.aggregate_dp(_metrics(kind, x, y))  # no original: the ragged rule even for equal counts
        assert ragged == pytest.approx(per_index(np.mean([x, y], axis=0)), rel=1e-15)
    # a rank without micro-batches: nothing to its sum, left out of the mean
    assert ov.aggregate_dp(_metrics("sum", [2.0, 4.0], []), original=stock) == 3.0
    assert ov.aggregate_dp(_metrics("mean", [2.0, 4.0], []), original=stock) == 3.0
    # no ODC engine attached: veRL's own behaviour, its error included
    monkeypatch.setattr(ov, "_ATTACHED", [0])
    with pytest.raises(ValueError, match="same number of values"):
        ov.aggregate_dp(_metrics("sum", a, b), original=stock)


@pytest.mark.parametrize("version", ["0.8.2", "0.10.0", "1.0.0", "unknown"])
def test_install_refuses_an_unsupported_verl(monkeypatch, version):
    import types

    fake = types.ModuleType("verl")
    fake.__version__ = version
    monkeypatch.setitem(sys.modules, "verl", fake)
    with pytest.raises(OdcUsageError, match=r"supports veRL 0\.9\.x \(tested with 0\.9\.1\), found veRL"):
        ov.install()
    assert not ov._ORIGINALS  # nothing patched


# --------------------------------------------------------------------------------------------------- multi-rank


class FakeMetric:
    """veRL's ``Metric`` reduced to what :func:`aggregate_dp` reads: ``values``, ``aggregation`` (an enum whose
    ``.value`` is the name) and a classmethod ``aggregate_dp`` that refuses unequal counts, as veRL 0.9.1's does."""

    def __init__(self, aggregation: str, value=None) -> None:  # veRL's signature
        import enum

        self.aggregation = enum.Enum("AggregationType", {aggregation.upper(): aggregation})[aggregation.upper()]
        self.values = [] if value is None else list(value) if isinstance(value, list) else [value]

    @classmethod
    def aggregate_dp(cls, metric_lists):
        lengths = [len(m.values) for m in metric_lists]
        if len(set(lengths)) > 1:
            raise ValueError(f"All Metric instances must have the same number of values for dp aggregation: {lengths}")
        return ("stock", tuple(tuple(m.values) for m in metric_lists))


def _fake_verl():
    """A stand-in ``verl`` package with veRL's planner behaviour (equal counts via an all-reduce of the max)."""
    import types

    import torch.distributed as dist

    calls = []

    def rearrange_micro_batches(
        batch,
        max_token_len,
        dp_group=None,
        num_batches_divided_by=None,
        same_micro_num_in_dp=True,
        min_num_micro_batch=None,
        use_dynamic_bsz_balance=True,
        force_group_size=1,
    ):
        lengths = ov.seq_lengths(batch)
        count = torch.tensor([max(1, -(-sum(lengths) // max_token_len))])
        if same_micro_num_in_dp and dist.is_initialized():
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        k = int(count)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        parts = [order[j::k] for j in range(k)]  # equal count on every rank; may be empty
        calls.append(("verl", k))
        return [ov.select_rows(batch, p) for p in parts], parts

    def prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=True):
        # the engine's helper looks the planner up in its own module globals, as veRL's does
        return engine_utils.rearrange_micro_batches(
            data, data["max_token_len_per_gpu"], dp_group=dp_group, same_micro_num_in_dp=same_micro_num_in_dp
        )

    verl = types.ModuleType("verl")
    verl.__version__ = "0.9.1"
    utils = types.ModuleType("verl.utils")
    metric = types.ModuleType("verl.utils.metric")
    metric_utils = types.ModuleType("verl.utils.metric.utils")
    metric_utils.Metric = FakeMetric
    seqlen_balancing = types.ModuleType("verl.utils.seqlen_balancing")
    seqlen_balancing.rearrange_micro_batches = rearrange_micro_batches
    workers = types.ModuleType("verl.workers")
    engine = types.ModuleType("verl.workers.engine")
    engine_utils = types.ModuleType("verl.workers.engine.utils")
    engine_utils.rearrange_micro_batches = rearrange_micro_batches  # `from ... import` copies the name
    engine_utils.prepare_micro_batches = prepare_micro_batches
    for name, mod in [
        ("verl", verl),
        ("verl.utils", utils),
        ("verl.utils.seqlen_balancing", seqlen_balancing),
        ("verl.utils.metric", metric),
        ("verl.utils.metric.utils", metric_utils),
        ("verl.workers", workers),
        ("verl.workers.engine", engine),
        ("verl.workers.engine.utils", engine_utils),
    ]:
        sys.modules[name] = mod
    return engine_utils, calls


class FakeEngine:
    """veRL's FSDP engine, reduced to the structure the adapter relies on."""

    def __init__(self, module, optimizer, dp_size: int) -> None:
        self.module, self.optimizer, self.dp_size = module, optimizer, dp_size
        self.micro_batch_counts: list[int] = []
        self.deferred_syncs = 0

    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            if is_last_micro_batch:
                yield
                return
            self.deferred_syncs += 1
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)

        return ctx()

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """Returns veRL's output structure: ``{"model_output", "loss", "metrics"}`` (per-sample log-probs)."""
        import contextlib

        import torch.distributed as dist

        engine_utils = sys.modules["verl.workers.engine.utils"]
        tokens = data["response_mask"].sum().clone()
        dist.all_reduce(tokens)
        micro_batches, indices = engine_utils.prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=True)
        self.micro_batch_counts.append(sum(1 for p in indices if p))
        outputs = []
        for k, (mb, idx) in enumerate(zip(micro_batches, indices, strict=True)):
            last = k == len(micro_batches) - 1
            sync = contextlib.nullcontext() if forward_only else self._gradient_sync_context(is_last_micro_batch=last)
            with torch.no_grad() if forward_only else contextlib.nullcontext(), sync:
                if not idx:  # an empty part (equal counts): run a zero-weight dummy row
                    mb = ov.select_rows(data, [0])
                loss, logp = loss_function(self.module, mb, float(tokens), self.dp_size)
                if not idx:
                    loss, logp = loss * 0.0, logp[:0]
                if not forward_only:
                    loss.backward()
            outputs.append(logp.detach())
        order = torch.tensor([i for p in indices for i in p])
        out = torch.empty(len(order), RESP)
        out[order] = torch.cat(outputs)
        return {"model_output": {"log_probs": out}, "loss": [], "metrics": {}}

    def train_batch(self, data, loss_function):
        self.optimizer.zero_grad()
        out = self.forward_backward_batch(data, loss_function)
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        return out


def response_logp(model, mb):
    """Log-probs of each row's response tokens ``[rows, RESP]`` (zeros past the response)."""
    ids = mb["input_ids"]
    logits = model(ids[:, :-1]).float().log_softmax(-1)
    token_logp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [rows, SEQ-1]
    lengths = mb["attention_mask"].sum(-1)
    resp = mb["response_mask"].sum(-1)
    out = torch.zeros(ids.shape[0], RESP)
    for r in range(ids.shape[0]):
        total, n = int(lengths[r]), int(resp[r])
        out[r, :n] = token_logp[r, total - n - 1 : total - 1]
    return out


def pg_loss(model, mb, global_tokens: float, dp_size: int):
    """veRL-style token-mean policy-gradient loss: masked sum / global tokens × dp_size (FSDP averages)."""
    logp = response_logp(model, mb)
    ratio = torch.exp(logp - mb["old_log_probs"])
    per_token = -torch.minimum(ratio * mb["advantages"], ratio.clamp(0.8, 1.2) * mb["advantages"])
    return (per_token * mb["response_mask"]).sum() / global_tokens * dp_size, logp


def rank_lengths(rank: int, step: int) -> list[int]:
    """Rank r's 6 local samples: rank 0 long ones, the last rank short ones (unequal micro-batch needs)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    hi = SEQ - 4 * rank
    return [int(torch.randint(max(3, hi - 4), hi + 1, (1,), generator=g)) for _ in range(6)]


def make_model(seed: int = 0) -> torch.nn.Module:
    """A tiny causal LM (embeddings, two pre-norm blocks, head) whose dims do not divide by 2, 3 or 4."""
    import torch.nn as nn
    import torch.nn.functional as F

    dim, heads = 12, 3

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 23), nn.GELU(), nn.Linear(23, dim))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(x)

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(dim, VOCAB, bias=False)

        def forward(self, tokens):
            x = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(seed)
    return TinyLM()


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def scenario(rank: int, world: int) -> dict:
    import copy

    import torch.distributed as dist

    engine_utils, calls = _fake_verl()
    assert ov.install() == list(ov.VERL_PLANNER_SITES)
    assert ov.install() == list(ov.VERL_PLANNER_SITES)  # idempotent
    ref = make_model()
    actor = FakeEngine(shard_model(copy.deepcopy(ref)), None, world)
    actor.optimizer = torch.optim.SGD(actor.module.parameters(), lr=0.5)
    critic_like = FakeEngine(shard_model(copy.deepcopy(ref)), None, world)  # not attached: stock FSDP
    ov.attach_engine(actor)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    data = [[verl_batch(rank_lengths(r, s), seed=10 * s + r) for r in range(world)] for s in range(3)]
    for d in (x for row in data for x in row):
        d["max_token_len_per_gpu"] = 24
    import odc_runtime.fsdp as odc_fsdp

    out = {"logp_diff": [], "param_diff": [], "critic_counts": [], "odc_metrics": [], "last": []}
    for step in range(3):
        mine = data[step][rank]
        # compute_log_prob: forward only, unequal counts, inside an ODC minibatch
        inferred = actor.forward_backward_batch(mine, pg_loss, forward_only=True)
        logp = inferred["model_output"]["log_probs"]
        assert inferred["metrics"] == {}  # ODC's figures go to training passes only
        with torch.no_grad():
            ref_logp = response_logp(ref, mine)
        out["logp_diff"].append((logp - ref_logp).abs().max().item())
        # the stock-FSDP engine still gets veRL's equal counts (the hook routes only inside ODC minibatches)
        n_calls = len(calls)
        critic_like.forward_backward_batch(mine, pg_loss, forward_only=True)
        out["critic_counts"].append(calls[n_calls:])
        metrics = actor.train_batch(mine, pg_loss)["metrics"]
        # ODC's figures, as veRL gathers them over the data-parallel group (its allgather_dict_into_dict)
        gathered = [None] * world
        dist.all_gather_object(gathered, {k: (m.aggregation.value, m.values) for k, m in metrics.items()})
        out["odc_metrics"].append(gathered)
        out["last"].append(odc_fsdp.stats(actor.module)["last_minibatch"])
        # reference: one process, every rank's samples, the same token-mean loss
        everyone = data[step]
        tokens = float(sum(d["response_mask"].sum() for d in everyone))
        ref_opt.zero_grad()
        for d in everyone:
            loss, _ = pg_loss(ref, d, tokens, 1)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        out["param_diff"].append(
            max(
                (p.full_tensor() - q.detach()).abs().max().item()
                for p, q in zip(actor.module.parameters(), ref.parameters(), strict=True)
            )
        )
    out["actor_counts"] = actor.micro_batch_counts
    out["deferred_syncs"] = actor.deferred_syncs
    gathered = [None] * world
    dist.all_gather_object(gathered, actor.micro_batch_counts)
    out["all_actor_counts"] = gathered
    ov.uninstall()
    out["restored"] = engine_utils.rearrange_micro_batches.__name__ == "rearrange_micro_batches" and not hasattr(
        engine_utils.rearrange_micro_batches, "__odc_original__"
    )
    odc_fsdp.disable(actor.module)
    return out


@pytest.mark.timeout(180)
def test_attached_engine_runs_unequal_counts_and_matches_reference():
    results = run_ranks(scenario, 3, timeout=150)
    counts = results[0]["all_actor_counts"]  # per rank: micro-batches per forward_backward_batch call
    assert any(len({c[k] for c in counts}) > 1 for k in range(len(counts[0]))), f"counts never differed: {counts}"
    for res in results:
        assert max(res["logp_diff"]) < 1e-5, res["logp_diff"]
        assert max(res["param_diff"]) < 1e-5, res["param_diff"]
        assert res["restored"]
        assert res["deferred_syncs"] == 0  # the engine's deferred gradient sync is off under ODC
        for calls in res["critic_counts"]:  # veRL's own planner, equal counts, for the stock-FSDP engine
            assert [c[0] for c in calls] == ["verl"], calls
    for k in range(len(results[0]["critic_counts"])):
        assert len({res["critic_counts"][k][0][1] for res in results}) == 1
    # ODC's figures in each training pass's metrics, one value per rank with the documented aggregation; the
    # micro-batch counts are the engine's own (the train pass is the second forward_backward_batch of a step)
    for step in range(3):
        gathered = results[0]["odc_metrics"][step]
        for name, (aggregation, key) in ov.METRICS.items():
            per_rank = [g[name] for g in gathered]
            assert [a for a, _ in per_rank] == [aggregation] * 3, name
            assert [v for _, v in per_rank] == [[res["last"][step][key]] for res in results], name
        assert [g["odc/micro_batches/max"][1][0] for g in gathered] == [c[2 * step + 1] for c in counts]
        assert all(g["odc/push_bytes"][1][0] > 0 and g["odc/sync_wait_s/max"][1][0] > 0 for g in gathered)


def test_attach_engine_rejects_non_engines_and_sequence_parallelism():
    with pytest.raises(OdcUsageError, match=r"no \.module"):
        ov.attach_engine(object())
    engine = FakeEngine(torch.nn.Linear(2, 2), None, 1)
    engine.ulysses_sequence_parallel_size = 2
    with pytest.raises(OdcUsageError, match="Ulysses"):
        ov.attach_engine(engine)


# --------------------------------------------------------------------------------------------------- real veRL


def _real_verl():
    """veRL's own modules when importable (not in CI: see the module docstring), else skip."""
    pytest.importorskip("tensordict")
    try:
        import verl.utils.seqlen_balancing as sb
        import verl.utils.tensordict_utils as tu
        import verl.workers.engine.utils as eu
    except Exception as e:  # any import failure means "veRL not usable here"
        pytest.skip(f"veRL not importable: {type(e).__name__}: {e}")
    if "__odc_original__" in vars(sb.rearrange_micro_batches):  # a stand-in or a leftover install
        pytest.skip("veRL's planner is already patched")
    return sb, tu, eu


@pytest.mark.parametrize("nested", [False, True])
def test_against_real_verl_planner_and_tensordicts(nested):
    import inspect

    sb, tu, eu = _real_verl()
    ours = list(inspect.signature(ov.rearrange_micro_batches).parameters)
    theirs = list(inspect.signature(sb.rearrange_micro_batches).parameters)
    assert ours[: len(theirs)] == theirs, (ours, theirs)

    lengths = [14, 3, 8, 5, 11, 2, 6, 9]
    plain = verl_batch(lengths, seed=3, nested=nested)
    td = tu.get_tensordict({k: v for k, v in plain.items() if k not in ("uid", "temperature")})
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=20)
    # veRL's own planner (no process group: no all-reduce) vs ours, on veRL's TensorDict
    their_mbs, their_idx = sb.rearrange_micro_batches(td, 20)
    our_mbs, our_idx = ov.rearrange_micro_batches(td, 20)
    assert sorted(i for p in our_idx for i in p) == sorted(i for p in their_idx for i in p) == list(range(8))
    assert all(sum(lengths[i] for i in p) <= 20 for p in our_idx)
    assert len(our_idx) <= len(their_idx) + 1
    for mb, idx in zip(our_mbs, our_idx, strict=True):
        assert type(mb) is type(their_mbs[0]) and set(mb.keys()) == set(their_mbs[0].keys())
        assert torch.equal(mb["advantages"], plain["advantages"][idx])
    # veRL restores per-sample outputs from our index lists
    outputs = torch.cat([mb["old_log_probs"] for mb in our_mbs])
    assert torch.equal(sb.restore_dynamic_batch(outputs, our_idx), plain["old_log_probs"])

    # install(): veRL's engine helper plans with ours only inside an ODC engine's minibatch
    sites = ov.install()
    try:
        assert set(sites) == set(ov.VERL_PLANNER_SITES)
        _, outside = eu.prepare_micro_batches(td)
        assert outside == their_idx  # veRL's own planner, untouched
        token = ov._ACTIVE.set(True)  # what attach_engine's wrapper sets around forward_backward_batch
        try:
            _, inside = eu.prepare_micro_batches(td, dp_group=object(), same_micro_num_in_dp=True)
        finally:
            ov._ACTIVE.reset(token)
        assert inside == our_idx
    finally:
        ov.uninstall()
    assert "__odc_original__" not in vars(eu.rearrange_micro_batches)


def test_real_verl_metric_reduction_with_install(monkeypatch):
    """veRL's own ``Metric``: after install(), equal counts give bitwise veRL's values, unequal counts reduce (with
    an engine attached); uninstall() restores veRL's function."""
    _real_verl()
    from verl.utils.metric.utils import Metric

    def metric(kind, values):
        m = Metric(kind)
        m.extend(values)
        return m

    stock = Metric.aggregate_dp
    rows = [[0.25, -1.5, 3.0], [2.0, 0.125, -0.5]]
    want = {k: stock([metric(k, v) for v in rows]) for k in ("mean", "sum", "min", "max")}
    ov.install()
    try:
        monkeypatch.setattr(ov, "_ATTACHED", [1])
        for kind, value in want.items():
            assert Metric.aggregate_dp([metric(kind, v) for v in rows]) == value
        assert Metric.aggregate_dp([metric("sum", [1.0, 2.0]), metric("sum", [5.0])]) == 4.0
        monkeypatch.setattr(ov, "_ATTACHED", [0])
        with pytest.raises(ValueError, match="same number of values"):
            Metric.aggregate_dp([metric("sum", [1.0, 2.0]), metric("sum", [5.0])])
    finally:
        ov.uninstall()
    assert "__odc_original__" not in vars(Metric.aggregate_dp.__func__)
    with pytest.raises(ValueError, match="same number of values"):
        Metric.aggregate_dp([metric("sum", [1.0, 2.0]), metric("sum", [5.0])])
