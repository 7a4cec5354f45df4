"""offpolicy.adapters.slime: slime's custom_loss and custom TIS contracts with ``args`` / ``batch`` built as slime
builds them (per-sample lists; packed ``[1, T, V/TP]`` fp32 logits before temperature; CSR top-p supports per
sample), single rank and over gloo (TP 2 and CP 2, megatron-core's parallel_state), against the float64
reference. slime itself is not on PyPI: these are contract tests on its documented signatures."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import offpolicy as op
from offpolicy.adapters import slime
from offpolicy.reference import reference_policy_loss
from support.distributed_harness import run_distributed

V = 24
TEMP = 0.8
TOP_P = 0.9
# fp32 loss against the float64 oracle: fp32 rounding of the logits and log-softmax dominates.
REF32 = dict(rtol=1e-4, atol=1e-5)


def _support(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p support mask of rows of ``z`` (already divided by temperature), as samplers compute it."""
    p = torch.softmax(z, -1)
    srt, order = p.sort(-1, descending=True)
    before = srt.cumsum(-1) - srt
    keep_sorted = before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def make_case(seed: int, lengths=((3, 5), (2, 7), (4, 1), (2, 4)), pad: int = 3, top_p: float = TOP_P,
              record: str = "support"):
    """slime-style args and batch, the packed fp32 logits ``[1, T, V]`` and per-sample float64 pieces."""
    g = torch.Generator().manual_seed(seed)
    t = sum(p + r for p, r in lengths) + pad
    logits = torch.randn(t, V, generator=g, dtype=torch.float64) * 2
    batch = {k: [] for k in ("unconcat_tokens", "total_lengths", "response_lengths", "loss_masks", "advantages",
                             "log_probs", "rollout_log_probs", "rollout_top_p_token_ids",
                             "rollout_top_p_token_offsets", "rollout_top_p_token_logprobs")}
    pieces = []
    start = 0
    for i, (p, r) in enumerate(lengths):
        total = p + r
        rows = logits[start + p - 1: start + total - 1]  # row j predicts token j + 1
        zq = (rows + 0.3 * torch.randn(rows.shape, generator=g, dtype=torch.float64)) / TEMP
        keep = _support(zq, top_p) if record == "support" else torch.ones_like(zq, dtype=torch.bool)
        logq = torch.log_softmax(zq.masked_fill(~keep, float("-inf")), -1)
        resp = torch.multinomial(logq.exp(), 1, generator=g)[:, 0]
        prompt = torch.randint(0, V, (p,), generator=g)
        mask = torch.ones(r, dtype=torch.int)
        if r > 2:
            mask[1] = 0
        adv = torch.full((r,), float(torch.randn(1, generator=g)))
        ids, offs, lps = [], [0], []
        for j in range(r):
            sup = keep[j].nonzero()[:, 0]
            ids.append(sup)
            lps.append(logq[j, sup])
            offs.append(offs[-1] + sup.numel())
        batch["unconcat_tokens"].append(torch.cat([prompt, resp]))
        batch["total_lengths"].append(total)
        batch["response_lengths"].append(r)
        batch["loss_masks"].append(mask)
        batch["advantages"].append(adv.float())
        prox = torch.log_softmax(rows / TEMP + 0.05 * torch.randn(rows.shape, generator=g, dtype=torch.float64), -1)
        batch["log_probs"].append(prox.gather(1, resp[:, None])[:, 0].float())
        batch["rollout_log_probs"].append(logq.gather(1, resp[:, None])[:, 0].float())
        batch["rollout_top_p_token_ids"].append(torch.cat(ids))
        batch["rollout_top_p_token_offsets"].append(torch.tensor(offs))
        batch["rollout_top_p_token_logprobs"].append(torch.cat(lps).float())
        pieces.append({"rows": rows, "tokens": resp, "mask": mask.bool(), "keep": keep, "logq": logq,
                       "prox": batch["log_probs"][-1].double()})
        start += total
    if record != "support":
        for k in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_top_p_token_logprobs"):
            del batch[k]
    args = SimpleNamespace(rollout_temperature=TEMP, rollout_top_p=top_p if record == "support" else 1.0,
                           calculate_per_token_loss=False, eps_clip=0.2, eps_clip_high=0.28,
                           offpolicy_correction=None)
    return args, batch, logits, pieces


def reference(pieces, batch, correction, per_token=False):
    """float64 oracle: slime's sum_of_sample_mean (or token sum) over the samples, from the full logits."""
    rows = torch.cat([q["rows"] for q in pieces])
    tokens = torch.cat([q["tokens"] for q in pieces])
    mask = torch.cat([q["mask"] for q in pieces])
    lq = torch.cat([x.double() for x in batch["rollout_log_probs"]])
    adv = torch.cat([x.double() for x in batch["advantages"]])
    seq = torch.cat([torch.full((q["tokens"].numel(),), i) for i, q in enumerate(pieces)])
    cands = None
    if "rollout_top_p_token_ids" in batch:
        k = max(int(q["keep"].sum(-1).max()) for q in pieces)
        ids = torch.full((rows.shape[0], k), -1, dtype=torch.long)
        lps = torch.full((rows.shape[0], k), float("-inf"), dtype=torch.float64)
        r = 0
        for q in pieces:
            for j in range(q["tokens"].numel()):
                sup = q["keep"][j].nonzero()[:, 0]
                ids[r, :sup.numel()] = sup
                lps[r, :sup.numel()] = q["logq"][j, sup]
                r += 1
        cands = op.Candidates(ids, lps, kind="support")
    prox = torch.cat([q["prox"] for q in pieces]) if correction.ppo_clip is not None else None
    agg = dict(aggregation="constant", constant_normalizer=1.0) if per_token else \
        dict(aggregation="seq_mean_token_mean", num_sequences=1.0)
    leaf = rows.clone().requires_grad_(True)
    loss, _, _ = reference_policy_loss(leaf, tokens, lq, adv, cands, mask, TEMP, correction, seq,
                                       proximal_logprobs=prox, **agg)
    loss.backward()
    return loss.detach(), leaf.grad


def _grad_rows(grad_full: torch.Tensor, batch) -> torch.Tensor:
    """The response rows of a packed ``[T, V]`` gradient, in sample order."""
    out, start = [], 0
    for total, r in zip(batch["total_lengths"], batch["response_lengths"]):
        out.append(grad_full[start + total - r - 1: start + total - 1])
        start += total
    return torch.cat(out)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("record", ["support", "none"])
def test_single_rank_matches_float64_reference(per_token, record):
    args, batch, logits, pieces = make_case(0, record=record)
    args.calculate_per_token_loss = per_token
    corr = slime.correction_from_args(args)
    assert corr.ppo_clip == (0.2, 0.28)
    leaf = logits.float()[None].requires_grad_(True)
    loss, metrics = slime.policy_loss(args, batch, leaf, sum_of_sample_mean=None)
    loss.backward()
    ref_loss, ref_grad = reference(pieces, batch, corr, per_token)
    assert torch.allclose(loss.double(), ref_loss, **REF32), (float(loss), float(ref_loss))
    grad = leaf.grad[0].double()
    assert torch.allclose(_grad_rows(grad, batch), ref_grad, **REF32)
    # Prompt and padding rows get no gradient.
    assert float(grad.abs().sum()) == pytest.approx(float(_grad_rows(grad, batch).abs().sum()), rel=1e-6)
    if record == "support":
        assert float(metrics["offpolicy/support_size"]) < V


def test_score_centering_with_recorded_support_logprobs_and_without():
    args, batch, logits, pieces = make_case(1)
    args.offpolicy_correction = {"weights": "mis", "bounds": [0.5, 5.0], "score_centering": True}
    corr = slime.correction_from_args(args)
    loss, _ = slime.policy_loss(args, batch, logits.float()[None])
    ref_loss, _ = reference(pieces, batch, corr)
    assert torch.allclose(loss.double(), ref_loss, **REF32)
    # Replay without the support's log q (ids only, as slime records it): exact without score centering.
    del batch["rollout_top_p_token_logprobs"]
    args.offpolicy_correction = op.Correction(weights="mis", bounds=(0.5, 5.0))
    loss, _ = slime.policy_loss(args, batch, logits.float()[None])
    ref_loss, _ = reference(pieces, {**batch, "rollout_top_p_token_ids": True}, args.offpolicy_correction)
    assert torch.allclose(loss.double(), ref_loss, **REF32)


def test_response_rows_cover_each_response_once_across_cp_ranks():
    for total, resp in [(9, 4), (5, 4), (12, 1), (7, 6), (3, 2)]:
        for cp in (1, 2, 4):
            seen = []
            for rank in range(cp):
                rows, idx, block = slime.response_rows(total, resp, cp, rank)
                c = block // 2
                # Local row -> global position, under the zigzag split.
                chunks = (rank, 2 * cp - 1 - rank)
                glob = torch.where(rows < c, rows + chunks[0] * c, rows - c + chunks[1] * c) if cp > 1 else rows
                assert torch.equal(glob, idx + total - resp - 1)
                seen.append(idx)
            assert torch.equal(torch.cat(seen).sort().values, torch.arange(resp))


def test_tis_hook_weights_equal_offpolicy_weights(fresh_guard):
    args, batch, _, pieces = make_case(2, record="none")
    args.offpolicy_correction = {"weights": "mis", "bounds": [0.8, 1.25]}
    pg = torch.randn(sum(batch["response_lengths"]))
    out, masks, metrics = slime.tis_function(
        args, pg_loss=pg, train_log_probs=batch["log_probs"], rollout_log_probs=batch["rollout_log_probs"],
        loss_masks=batch["loss_masks"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"])
    r = torch.cat([(a.double() - b.double()) for a, b in zip(batch["log_probs"], batch["rollout_log_probs"])]).exp()
    mask = torch.cat([m.bool() for m in batch["loss_masks"]])
    w = torch.where(mask & (r >= 0.8) & (r <= 1.25), r, torch.zeros_like(r))
    assert torch.allclose(out.double(), pg.double() * w, rtol=1e-5, atol=1e-7)
    assert bool(((w == 0) & mask).any()) and bool((w > 0).any())  # both sides of the band are exercised
    assert masks is not batch["loss_masks"] and all(torch.equal(a, b) for a, b in zip(masks, batch["loss_masks"]))
    assert "offpolicy/rejected_frac" in metrics and not any(k.startswith("offpolicy/guard/") for k in metrics)
    args.offpolicy_correction = None
    with pytest.raises(ValueError, match="weights only"):
        slime.tis_function(args, pg, batch["log_probs"], batch["rollout_log_probs"], batch["loss_masks"],
                           batch["total_lengths"], batch["response_lengths"])


def test_bad_batches_are_named():
    args, batch, logits, _ = make_case(3)
    with pytest.raises(ValueError, match=r"\[1, T, V/TP\]"):
        slime.policy_loss(args, batch, logits.float())
    bad = dict(batch)
    del bad["rollout_top_p_token_offsets"]
    with pytest.raises(ValueError, match="rollout_top_p=0.9 < 1 needs"):
        slime.policy_loss(args, bad, logits.float()[None])
    bad = dict(batch, rollout_log_probs=[x[:-1] for x in batch["rollout_log_probs"]])
    with pytest.raises(ValueError, match="rollout_log_probs.*expected the response length"):
        slime.policy_loss(args, bad, logits.float()[None])
    with pytest.raises(ValueError, match="local logits rows"):
        slime.policy_loss(args, batch, logits.float()[None, :10])


# ---- guards (offpolicy.adapters.guard) ----

@pytest.fixture
def fresh_guard(monkeypatch):
    from offpolicy.adapters.guard import Guard
    monkeypatch.setattr(slime, "GUARD", Guard([]))


def test_a_filter_with_no_support_to_replay_is_an_error(fresh_guard):
    """--rollout-top-k > 0 with no support record (policy_loss), and any filter under the TIS hook (slime's loss is
    full-vocabulary): errors naming the option and the fix."""
    args, batch, logits, _ = make_case(4, record="none")
    args.rollout_top_k = 20
    with pytest.raises(ValueError, match=r"args.rollout_top_k=20 filters the sampler .* --rollout-top-k -1"):
        slime.policy_loss(args, batch, logits.float()[None])
    args, batch, _, _ = make_case(4)
    args.offpolicy_correction = {"weights": "mis", "bounds": [0.5, 2.0]}
    pg = torch.randn(sum(batch["response_lengths"]))
    with pytest.raises(ValueError, match=r"cannot replay the sampler's filter \(rollout_top_p=0.9.*custom_loss"):
        slime.tis_function(args, pg, batch["log_probs"], batch["rollout_log_probs"], batch["loss_masks"],
                           batch["total_lengths"], batch["response_lengths"])


def test_guard_warns_once_on_a_narrower_sampler_and_stays_silent_on_a_correct_one(fresh_guard, monkeypatch):
    """The TIS hook fed rollouts drawn at top_p = 0.9 while args say 1 (the engine's own default filter): lq > log p
    on every token, warned once as narrower_sampler; the full loss on a correct support replay stays silent."""
    import warnings
    from offpolicy.adapters.guard import GuardWarning
    g = torch.Generator().manual_seed(5)
    z = 2.0 * torch.randn(2, 40, V, generator=g, dtype=torch.float64)
    keep = _support(z, 0.9)
    lq_all = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    tok = torch.multinomial(lq_all.exp().reshape(-1, V), 1, generator=g).reshape(2, 40, 1)
    train = list(torch.log_softmax(z, -1).gather(-1, tok)[..., 0].float())
    rollout = list(lq_all.gather(-1, tok)[..., 0].float())
    args = SimpleNamespace(rollout_top_p=1.0, offpolicy_correction={"weights": "mis", "bounds": [0.5, 2.0]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = [slime.tis_function(args, torch.randn(80), train, rollout, [torch.ones(40)] * 2, [41, 41],
                                      [40, 40])[2] for _ in range(3)]
    messages = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    assert len(messages) == 1 and "[narrower_sampler]" in messages[0]
    # Checked on every batch (the checks are O(N)), flagged on each, warned once.
    assert [float(m.get("offpolicy/guard/narrower_sampler", 0)) for m in metrics] == [1.0, 1.0, 1.0]
    monkeypatch.setattr(slime, "GUARD", slime.GUARD.__class__([]))
    args, batch, logits, _ = make_case(6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, metrics = slime.policy_loss(args, batch, logits.float()[None])
    assert not [w for w in caught if issubclass(w.category, GuardWarning)]
    assert not any(k.startswith("offpolicy/guard/") for k in metrics)


def test_guard_on_rollout_log_probs_that_are_not_log_probs(fresh_guard, monkeypatch):
    import warnings
    from offpolicy.adapters.guard import ZERO_MIN_TOKENS, Guard, GuardWarning
    args, batch, logits, _ = make_case(7, record="none")
    zeros = dict(batch, rollout_log_probs=[torch.zeros_like(x) for x in batch["rollout_log_probs"]])
    trained = int(sum(float(m.sum()) for m in batch["loss_masks"]))
    calls = -(-ZERO_MIN_TOKENS // trained)  # the zero run is counted across calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [slime.policy_loss(args, zeros, logits.float()[None])[1] for _ in range(calls)]
    assert [str(w.message) for w in caught if issubclass(w.category, GuardWarning)][0].startswith(
        "offpolicy guard [sampler_logprobs_zero]")
    assert float(runs[-1]["offpolicy/guard/sampler_logprobs_zero"]) == 1.0
    assert all("offpolicy/guard/sampler_logprobs_zero" not in m for m in runs[:-1])
    monkeypatch.setattr(slime, "GUARD", Guard([]))
    probs = dict(batch, rollout_log_probs=[x.exp() for x in batch["rollout_log_probs"]])
    with pytest.raises(ValueError, match=r"batch\['rollout_log_probs'\] must be the sampler's log-probabilities"):
        slime.policy_loss(args, probs, logits.float()[None])


# ---- gloo: TP 2 (vocabulary split) and CP 2 (zigzag split), megatron-core's parallel_state ----

def _cp_local(batch, logits, cp, rank):
    """This CP rank's packed logits and per-sample lists, as slime lays them out (log-probs CP-local)."""
    rows_out, local = [], {k: list(v) for k, v in batch.items()}
    start = 0
    for name in ("advantages", "log_probs", "rollout_log_probs"):
        local[name] = []
    for i, (total, r) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
        c = -(-total // (2 * cp))
        seq = torch.nn.functional.pad(logits[start:start + total], (0, 0, 0, 2 * cp * c - total))
        rows_out += [seq[rank * c:(rank + 1) * c], seq[(2 * cp - 1 - rank) * c:(2 * cp - rank) * c]]
        _, idx, _ = slime.response_rows(total, r, cp, rank)
        for name in ("advantages", "log_probs", "rollout_log_probs"):
            local[name].append(batch[name][i][idx])
        start += total
    return local, torch.cat(rows_out)


def _gloo_worker(rank, world):
    """Both layouts in one spawn (process start-up and imports dominate the cost)."""
    return {mode: _gloo_case(rank, mode) for mode in ("tp", "cp")}


def _gloo_case(rank, mode):
    from megatron.core import parallel_state as ps

    tp, cp = (2, 1) if mode == "tp" else (1, 2)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        args, batch, logits, _ = make_case(5)
        if mode == "tp":
            shard = logits.float()[:, rank * (V // 2):(rank + 1) * (V // 2)]
            leaf = shard[None].clone().requires_grad_(True)
            loss, _ = slime.policy_loss(args, batch, leaf)
        else:
            local, shard = _cp_local(batch, logits.float(), cp, rank)
            leaf = shard[None].clone().requires_grad_(True)
            loss, _ = slime.policy_loss(args, local, leaf)
            batch = local
        loss.backward()
        tis, _, _ = slime.tis_function(
            SimpleNamespace(offpolicy_correction={"weights": "mis", "bounds": [0.8, 1.25], "level": "sequence"}),
            torch.ones(sum(x.numel() for x in batch["log_probs"])), batch["log_probs"], batch["rollout_log_probs"],
            batch["loss_masks"], batch["total_lengths"], batch["response_lengths"])
        return float(loss), leaf.grad[0].double(), tis
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def gloo_results():
    return run_distributed(_gloo_worker, 2)


def test_tensor_parallel_2_over_gloo_matches_reference(gloo_results):
    args, batch, logits, pieces = make_case(5)
    ref_loss, ref_grad = reference(pieces, batch, slime.correction_from_args(args))
    results = [r["tp"] for r in gloo_results]
    for loss, _, _ in results:  # every TP rank holds the whole loss
        assert math.isclose(loss, float(ref_loss), rel_tol=1e-4, abs_tol=1e-5)
    grad = torch.cat([g for _, g, _ in results], dim=1)
    assert torch.allclose(_grad_rows(grad, batch), ref_grad, **REF32)


def test_context_parallel_2_over_gloo_matches_reference(gloo_results):
    args, batch, logits, pieces = make_case(5)
    ref_loss, ref_grad = reference(pieces, batch, slime.correction_from_args(args))
    results = [r["cp"] for r in gloo_results]
    # CP ranks hold shares of the loss that sum to the whole (slime then multiplies by the DP x CP size).
    assert math.isclose(sum(loss for loss, _, _ in results), float(ref_loss), rel_tol=1e-4, abs_tol=1e-5)
    got = torch.zeros_like(ref_grad)
    offsets = torch.tensor([0] + list(batch["response_lengths"])).cumsum(0)
    for rank, (_, grad, _) in enumerate(results):
        start = 0
        for i, (total, r) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
            rows, idx, block = slime.response_rows(total, r, 2, rank)
            got[offsets[i] + idx] += grad[start + rows]
            start += block
    assert torch.allclose(got, ref_grad, **REF32)
    # Sequence-level TIS weights over CP shares: the same per-sequence weight on both ranks' tokens.
    seq_w = []
    for i, (total, r) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
        m = batch["loss_masks"][i].bool()
        log_rho = ((batch["log_probs"][i].double() - batch["rollout_log_probs"][i].double()) * m).sum()
        rho = float(log_rho.exp())
        seq_w.append(rho if 0.8 <= rho <= 1.25 else 0.0)
    for rank, (_, _, tis) in enumerate(results):
        pos = 0
        for i, (total, r) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
            _, idx, _ = slime.response_rows(total, r, 2, rank)
            m = batch["loss_masks"][i].bool()[idx]
            got_w = tis[pos:pos + idx.numel()]
            assert torch.allclose(got_w[m].double(), torch.full((int(m.sum()),), seq_w[i], dtype=torch.float64),
                                  rtol=1e-5, atol=1e-7)
            pos += idx.numel()
