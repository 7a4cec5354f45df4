"""The Megatron adapter's contract in one process, without megatron-core: layouts, padding, counts, the report,
the batch builders and the errors. (The multi-process behaviour against real megatron-core is in
``test_distributed_megatron.py``.)"""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.adapters.megatron import BATCH_KEYS, make_loss_func, packed_batch, split_for_context_parallel
from offpolicy.parallel.packing import pad_cu_seqlens, scatter_to_padded, thd_cp_index, zigzag_index

B, S, V, K = 2, 8, 13, 3


def _batch(seed: int = 0, with_cands: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B, S, V, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V - 2, (B, S), generator=gen)
    lq = torch.log_softmax(z + 0.5 * torch.randn(z.shape, generator=gen, dtype=torch.float64), -1)
    batch = dict(labels=labels, sampler_logprobs=lq.gather(-1, labels[..., None])[..., 0].float(),
                 advantages=torch.randn(B, S, generator=gen), loss_mask=torch.rand(B, S, generator=gen) < 0.8,
                 seq_ids=torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [3, 3, 4, 4, 4, 4, 5, 5]]))
    if with_cands:
        top = torch.topk(lq[..., : V - 2], K, dim=-1)
        batch["candidate_ids"], batch["candidate_logprobs"] = top.indices, top.values.float()
    return batch, z


def _flat(batch):
    kw = dict(tokens=batch["labels"].reshape(-1), sampler_logprobs=batch["sampler_logprobs"].reshape(-1),
              advantages=batch["advantages"].reshape(-1), loss_mask=batch["loss_mask"].reshape(-1),
              seq_ids=batch["seq_ids"].reshape(-1))
    if "candidate_ids" in batch:
        kw["candidates"] = op.Candidates(batch["candidate_ids"].reshape(-1, K),
                                         batch["candidate_logprobs"].reshape(-1, K), "head")
    return kw


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("layout", ["bsv", "sbv", "flat"])
def test_sum_and_count_give_the_mean(agg, layout):
    """``loss / count`` is ``policy_loss``'s mean, in every layout; the gradient is the sum's."""
    batch, z = _batch()
    corr = op.Correction(weights="mis", score_centering=True)
    zf = z.reshape(B * S, V).clone().requires_grad_(True)
    want = op.policy_loss(zf, correction=corr, aggregation=agg, **_flat(batch))
    want.loss.backward()
    x = {"bsv": z, "sbv": z.transpose(0, 1).contiguous(), "flat": z.reshape(B * S, V)}[layout]
    x = x.clone().requires_grad_(True)
    loss, count, report = make_loss_func(batch, correction=corr, aggregation=agg, logits_layout=layout)(x)
    (loss / count).backward()
    assert count.dtype == torch.int
    n_seq = int(torch.unique(batch["seq_ids"][batch["loss_mask"]]).numel())
    assert int(count) == (int(batch["loss_mask"].sum()) if agg == "token_mean" else n_seq)
    torch.testing.assert_close(loss.detach() / count, want.loss.detach(), rtol=1e-12, atol=1e-14)
    grad = x.grad if layout != "sbv" else x.grad.transpose(0, 1)
    torch.testing.assert_close(grad.reshape(B * S, V), zf.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(report["policy loss"], torch.stack([loss.detach(), count.double()]).float())
    for key in ("kl_k1", "weight_mean", "entropy", "sc_rho"):
        torch.testing.assert_close(report[key][0] / report[key][1], want.metrics[key].float())
    for key in ("weight_max", "weight_min", "abs_log_ratio_max", "ess"):
        torch.testing.assert_close(report[key][0], want.metrics[key].float())


def _with_groups(batch: dict, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(batch, groups=torch.randint(0, 3, (B, S), generator=gen),
                versions=torch.randint(4, 8, (B, S), generator=gen))


@pytest.mark.parametrize("max_staleness", [3, 1])
def test_per_group_and_staleness_report(max_staleness):
    """Per-sampler-group and per-staleness metrics equal ``policy_loss``'s (``group/{g}/...``,
    ``staleness/{s}/...``); a staleness cap merges everything older into the last bucket; absent groups report
    zero tokens."""
    batch, z = _batch()
    batch = _with_groups(batch)
    batch["groups"][batch["groups"] == 1] = 0  # group 1 absent: its keys must still be reported, with 0 tokens
    corr = op.Correction(weights="mis", bounds=(0.8, 1.25))
    now = 7
    capped = torch.maximum(batch["versions"], torch.tensor(now - max_staleness))
    want = op.policy_loss(z.reshape(B * S, V), correction=corr, groups=batch["groups"].reshape(-1),
                          versions=capped.reshape(-1), current_version=now, **_flat(batch)).metrics
    loss_func = make_loss_func(batch, correction=corr, num_groups=3, max_staleness=max_staleness,
                               current_version=now)
    report = loss_func(z.clone())[2]
    buckets = [f"group/{g}" for g in range(3)] + [f"staleness/{s}" for s in range(max_staleness + 1)]
    assert {k.rsplit("/", 1)[0] for k in report if "/" in k} == set(buckets)
    for prefix in buckets:
        if f"{prefix}/num_tokens" not in want:
            assert float(report[f"{prefix}/num_tokens"]) == 0 and float(report[f"{prefix}/kl_k1"][0]) == 0
            continue
        torch.testing.assert_close(report[f"{prefix}/num_tokens"][0], want[f"{prefix}/num_tokens"].float())
        share = report[f"{prefix}/share_tokens"]
        torch.testing.assert_close(share[0] / share[1], want[f"{prefix}/share_tokens"].float())
        for key in ("kl_k1", "kl_k3", "abs_log_ratio_mean", "weight_mean", "ratio_above_upper_frac"):
            pair = report[f"{prefix}/{key}"]
            torch.testing.assert_close(pair[0] / pair[1], want[f"{prefix}/{key}"].float())
        for key in ("weight_max", "weight_min", "abs_log_ratio_max", "ess"):
            torch.testing.assert_close(report[f"{prefix}/{key}"][0], want[f"{prefix}/{key}"].float())


def _dp_report_worker(rank: int, world: int) -> dict:
    """Two DP ranks, one row each: the reduced per-group report is the whole batch's."""
    import torch.distributed as dist

    batch, z = _batch()
    batch = _with_groups(batch)
    mine = {k: v[rank:rank + 1] for k, v in batch.items()}
    loss_func = make_loss_func(mine, correction=op.Correction(weights="tis"), num_groups=3, max_staleness=2,
                               current_version=7, dp_group=dist.group.WORLD, use_parallel_state=False)
    return {k: v.tolist() for k, v in loss_func(z[rank:rank + 1].clone())[2].items()}  # plain data across processes


def test_per_group_report_is_reduced_over_data_parallel():
    from support.distributed_harness import run_distributed

    batch, z = _batch()
    batch = _with_groups(batch)
    single = make_loss_func(batch, correction=op.Correction(weights="tis"), num_groups=3, max_staleness=2,
                            current_version=7)(z.clone())[2]
    for report in run_distributed(_dp_report_worker, 2):
        assert report.keys() == single.keys()
        for key, val in single.items():
            if key.endswith("num_tokens"):  # a 1-element total: train_step averages it, the others are exact
                continue
            torch.testing.assert_close(torch.tensor(report[key]), val, msg=key)


@pytest.mark.parametrize("layout", ["bsv", "sbv"])
def test_constant_aggregation_is_dr_grpo(layout):
    """``aggregation="constant"`` divides the token sum by global sequences x ``max_tokens``: after Megatron's
    division by the count, ``policy_loss(aggregation="constant", constant_normalizer=sequences * max_tokens)``."""
    batch, z = _batch()
    corr = op.Correction(weights="tis")
    n_seq = int(torch.unique(batch["seq_ids"][batch["loss_mask"]]).numel())
    zf = z.reshape(B * S, V).clone().requires_grad_(True)
    want = op.policy_loss(zf, correction=corr, aggregation="constant", constant_normalizer=n_seq * 12.0,
                          **_flat(batch))
    want.loss.backward()
    x = (z if layout == "bsv" else z.transpose(0, 1).contiguous()).clone().requires_grad_(True)
    loss, count, report = make_loss_func(batch, correction=corr, aggregation="constant", max_tokens=12,
                                         logits_layout=layout)(x)
    (loss / count).backward()
    assert int(count) == n_seq
    torch.testing.assert_close(loss.detach() / count, want.loss.detach(), rtol=1e-12, atol=1e-14)
    grad = x.grad if layout == "bsv" else x.grad.transpose(0, 1)
    torch.testing.assert_close(grad.reshape(B * S, V), zf.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(report["policy loss"][0] / report["policy loss"][1], want.loss.detach().float())


def test_padded_vocabulary_is_left_out():
    batch, z = _batch()
    padded = torch.cat([z, torch.full((B, S, 3), 5.0, dtype=torch.float64)], -1).requires_grad_(True)
    loss, count, _ = make_loss_func(batch, vocab_size=V)(padded)
    loss.backward()
    zf = z.reshape(B * S, V).clone().requires_grad_(True)
    want = op.policy_loss(zf, **_flat(batch))
    want.loss.backward()
    torch.testing.assert_close(loss.detach() / count, want.loss.detach())
    torch.testing.assert_close(padded.grad[..., :V].reshape(B * S, V) / count, zf.grad)
    assert bool((padded.grad[..., V:] == 0).all())
    # A label in the padding is not a token the sampler can have drawn.
    bad = dict(batch, labels=torch.full((B, S), V + 1))
    with pytest.raises(ValueError, match="out of range for vocabulary size 13"):
        make_loss_func(bad, vocab_size=V)(padded.detach())


def test_packed_batch_from_csr_and_cu_seqlens():
    t = 6
    ids = torch.tensor([4, 1, 7, 2, 2, 9, 3])
    offsets = torch.tensor([0, 2, 3, 3, 5, 6, 7])
    lps = torch.log(torch.tensor([0.5, 0.2, 0.9, 0.3, 0.6, 0.1, 0.4]))
    mb = packed_batch(torch.arange(t), torch.zeros(t), torch.ones(t), torch.ones(t, dtype=torch.bool),
                      cu_seqlens=torch.tensor([0, 2, 5]), candidate_ids=ids, candidate_offsets=offsets,
                      candidate_logprobs=lps, temperature=torch.full((t,), 0.7))
    assert set(mb) <= set(BATCH_KEYS)
    assert mb["labels"].shape == (1, t) and mb["candidate_ids"].shape == (1, t, 2)
    assert mb["seq_ids"].tolist() == [[0, 0, 1, 1, 1, 2]]
    assert mb["candidate_ids"][0, :, 0].tolist() == [4, 7, -1, 2, 9, 3]
    assert mb["candidate_ids"][0, 0].tolist() == [4, 1] and mb["candidate_ids"][0, 2].tolist() == [-1, -1]
    assert mb["candidate_logprobs"][0, 2, 0] == float("-inf")
    with pytest.raises(ValueError, match="T \\+ 1"):
        packed_batch(torch.arange(t), torch.zeros(t), torch.ones(t), torch.ones(t), candidate_ids=ids,
                     candidate_offsets=offsets[:-1], candidate_logprobs=lps)
    with pytest.raises(ValueError, match="go together"):
        packed_batch(torch.arange(t), torch.zeros(t), torch.ones(t), torch.ones(t), candidate_ids=ids)
    with pytest.raises(ValueError, match="advantages"):
        packed_batch(torch.arange(t), torch.zeros(t), torch.ones(t + 1), torch.ones(t))


def test_split_for_context_parallel():
    batch, _ = _batch()
    for r in range(2):
        part = split_for_context_parallel(batch, 2, r)
        idx = zigzag_index(S, 2, r)
        for k, v in batch.items():
            assert torch.equal(part[k], v[:, idx]), k
    cu_p = pad_cu_seqlens(torch.tensor([0, 3, 5, 8]), 4)
    row = {k: scatter_to_padded(v[0], torch.tensor([0, 3, 5, 8]), cu_p, fill=0).unsqueeze(0)
           for k, v in batch.items()}
    part = split_for_context_parallel(row, 2, 1, cu_seqlens_padded=cu_p)
    assert torch.equal(part["labels"], row["labels"][:, thd_cp_index(cu_p, 2, 1)])
    with pytest.raises(ValueError, match="ends at"):
        split_for_context_parallel(row, 2, 0, cu_seqlens_padded=cu_p[:-1])
    assert split_for_context_parallel(batch, 1, 0).keys() == batch.keys()


@pytest.mark.parametrize(
    "change, kwargs, match",
    [
        (lambda b: b.pop("advantages"), {}, "missing"),
        (lambda b: b.update(tokens=b["labels"]), {}, "unknown keys"),
        (lambda b: b.update(advantages=b["advantages"][:, :-1]), {}, "advantages"),
        (lambda b: b.update(candidate_ids=b["candidate_ids"][..., 0]), {}, "candidate_ids"),
        (lambda b: b.pop("candidate_logprobs"), {}, "go together"),
        (lambda b: b.pop("seq_ids"), {"aggregation": "seq_mean_token_sum"}, "seq_ids"),
        (lambda b: None, {"aggregation": "constant"}, "max_tokens goes with aggregation='constant'"),
        (lambda b: None, {"max_tokens": 8}, "max_tokens goes with"),
        (lambda b: None, {"aggregation": "constant", "max_tokens": 0}, "finite number > 0"),
        (lambda b: b.pop("seq_ids"), {"aggregation": "constant", "max_tokens": 8}, "seq_ids"),
        (lambda b: None, {"logits_layout": "vbs"}, "logits_layout"),
        (lambda b: None, {"num_loss_tokens": 10}, "set by the adapter"),
        (lambda b: None, {"num_groups": 2}, r"needs batch\['groups'\]"),
        (lambda b: b.update(groups=torch.zeros(B, S, dtype=torch.int64)), {}, "needs num_groups"),
        (lambda b: None, {"num_groups": 0}, "positive int"),
        (lambda b: b.update(versions=torch.zeros(B, S, dtype=torch.int64)), {"max_staleness": 2},
         "current_version"),
        (lambda b: b.update(versions=torch.zeros(B, S, dtype=torch.int64)), {}, "needs max_staleness"),
    ],
)
def test_errors(change, kwargs, match):
    batch, _ = _batch()
    change(batch)
    with pytest.raises(ValueError, match=match):
        make_loss_func(batch, **kwargs)


def test_group_and_version_range_errors():
    batch, z = _batch()
    bad = dict(batch, groups=torch.full((B, S), 3))
    with pytest.raises(ValueError, match=r"batch\['groups'\] must lie in \[0, 3\)"):
        make_loss_func(bad, num_groups=3)(z)
    newer = dict(batch, versions=torch.full((B, S), 9))
    with pytest.raises(ValueError, match="must be <= current_version=7"):
        make_loss_func(newer, max_staleness=2, current_version=7)(z)


def test_logits_shape_errors():
    batch, z = _batch()
    fn = make_loss_func(batch, logits_layout="sbv")
    with pytest.raises(ValueError, match="layout 'sbv'"):
        fn(z)
    with pytest.raises(ValueError, match="contiguous"):
        fn(z.transpose(0, 1))
    with pytest.raises(ValueError, match="vocab_size must be an int > 0"):  # every column would be padding
        make_loss_func(batch, vocab_size=0)(z)
