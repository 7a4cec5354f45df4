"""The segment-level ratio rejection (docs/spec.md#kl-rejection): ``rejections=(op.RatioRejection(lo, hi,
"segment"),)`` drops a turn (one ``(seq_ids, segment_ids)`` pair) whose geometric-mean ratio lies outside
``[lo, hi]``. Checked against the float64 reference and against a transcription of ROLL's train-infer correction
filter with ``agg_type="segment"``."""

from __future__ import annotations

import math

import pytest
import torch
from test_migrating import B, _batch, _check, _ours, _ppo, _rejected_some, _theirs

import offpolicy as op
from offpolicy.reference import reference_metrics
from support.agreement import assert_matches_reference


def _roll_compute_segment_masked_mean(tensor, mask):
    """Transcribed from ROLL (alibaba/ROLL at 8eb27cc, roll/pipeline/agentic/utils.py,
    ``compute_segment_masked_mean``): per row, the runs of ones of the mask (found with ``torch.diff``), each run's
    masked mean written on its positions (the ``+ 1e-8`` in the count left out, as for the other peers)."""
    batch_size, seq_len = mask.shape
    result = torch.zeros_like(tensor)
    for b in range(batch_size):
        sample_mask, sample_tensor = mask[b], tensor[b]
        diff = torch.diff(sample_mask, prepend=torch.tensor([0]))
        segment_starts = torch.where(diff == 1)[0]
        segment_ends = torch.where(diff == -1)[0]
        if sample_mask[-1] == 1:
            segment_ends = torch.cat([segment_ends, torch.tensor([seq_len])])
        for start, end in zip(segment_starts, segment_ends):
            idx = torch.arange(start, end)
            segment_mask, segment_tensor = sample_mask[idx], sample_tensor[idx]
            if segment_mask.sum() > 0:
                segment_mean = (segment_tensor * segment_mask).sum() / segment_mask.sum()
                result[b, idx] = segment_mean * segment_mask
    return result


def _roll_segment_filter(old, infer, response_mask, ratio_low, ratio_high):
    """ROLL's ``compute_train_infer_correction`` (roll/utils/train_infer_corrections.py at 8eb27cc) for one
    ``filters`` entry with ``ratio_enabled`` and ``agg_type="segment"``: ``ratio_segment = exp(
    compute_segment_masked_mean(old - infer, response_mask))`` and the filter mask
    ``(ratio >= ratio_low) * (ratio <= ratio_high)``."""
    ratio = _roll_compute_segment_masked_mean(old - infer, response_mask.long()).exp()
    return ((ratio >= ratio_low).float() * (ratio <= ratio_high).float()).bool()


def _turns(mask):
    """Each token's run index in its row (observation tokens, outside the mask, split the runs)."""
    starts = torch.diff(mask.long(), dim=1, prepend=torch.zeros(mask.shape[0], 1, dtype=torch.long)) == 1
    return torch.cumsum(starts.long(), dim=1)


@pytest.mark.parametrize("low, high", [(0.9, 1.1), (0.8, 1.25)])
def test_roll_segment_filter(low, high):
    """A ``filters`` entry with ``ratio_enabled``, ``agg_type="segment"`` on multi-turn rows, PPO with ``pg_clip``,
    ``seq-mean-token-mean``: filtered tokens leave ``final_response_mask`` while ``global_valid_samples`` stays
    the divisor: ``rejections=(RatioRejection(low, high, "segment"),)``, ``rejected_in_normalizer=False``,
    ``segment_ids`` = each token's run index, ``num_sequences=B``."""
    logp, old, roll, mask, adv = _batch(92)
    mask = mask.clone()
    mask[:, 2] = False  # observation tokens: rows longer than 3 hold two or three turns
    mask[:, 4] = False
    keep = _roll_segment_filter(old, roll, mask, low, high)
    _rejected_some(keep, mask)

    def theirs(lp):
        return _ppo(torch.exp(lp - old), adv, 0.2, 0.2), keep

    corr = op.Correction(ppo_clip=(0.2, 0.2), rejections=(op.RatioRejection(low, high, "segment"),),
                         rejected_in_normalizer=False)
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean", num_sequences=float(B),
                 segment_ids=_turns(mask).reshape(-1)),
           _theirs(theirs, logp, ("sample-mean", B), mask))
    # the sequence's geometric band is another rule
    geo = op.Correction(ppo_clip=(0.2, 0.2), rejections=(op.RatioRejection(low, high, "geometric"),),
                        rejected_in_normalizer=False)
    out, _ = _ours(logp, old, roll, mask, adv, geo, aggregation="seq_mean_token_mean", num_sequences=float(B))
    assert abs(out.loss.item() - _theirs(theirs, logp, ("sample-mean", B), mask)[0].item()) > 1e-6


def _logits_batch(seed: int, b: int = 4, t: int = 9, vocab: int = 7):
    g = torch.Generator().manual_seed(seed)
    n = b * t
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + 0.4 * torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    prox = (lq + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.9
    seq = torch.arange(n) // t
    segment = (torch.arange(n) % t) // 3  # three turns of three tokens per sequence
    return z, y, lq, prox, adv, mask, seq, segment


@pytest.mark.parametrize("corr", [
    op.Correction(rejections=(op.RatioRejection(0.85, 1.2, "segment"),)),
    op.Correction(weights="tis", ppo_clip=(0.2, 0.2), rejected_in_normalizer=False,
                  rejections=(op.RatioRejection(0.9, 1.15, "segment"), op.RatioRejection(0.5, 2.0))),
    op.Correction(weights="tis", level="segment", rejections=(op.RatioRejection(0.0, 1.1, "segment"),)),
], ids=["plain", "ppo-chained", "segment-weights"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", [0, 1])
def test_segment_rejection_matches_the_reference(corr, aggregation, seed):
    z, y, lq, prox, adv, mask, seq, segment = _logits_batch(seed)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, segment_ids=segment, aggregation=aggregation,
              proximal_logprobs=prox if corr.tree.surrogate.needs_proximal else None)
    out = assert_matches_reference(z, y, lq, adv, **kw)
    ref = reference_metrics(z, y, lq, adv, **kw)
    assert math.isclose(float(out.metrics["rejected_frac/rule0"]), ref["rejected_frac/rule0"], abs_tol=1e-14)
    assert 0 < ref["rejected_frac/rule0"] < 1  # some turns dropped, not all


@pytest.mark.parametrize("tr", [op.TrustRegion(0.01, 0.02, sign="none", level="segment", on="weights"),
                                op.TrustRegion(0.003, 0.003, "binary_kl", sign="none", level="segment"),
                                op.TrustRegion(0.02, 0.025, sign="none", level="segment", penalty=0.1)],
                         ids=["difference-weights", "binary-kl-update", "difference-update-penalty"])
@pytest.mark.parametrize("seed", [0, 1])
def test_segment_trust_region_matches_the_reference(tr, seed):
    """``TrustRegion(level="segment")``: each turn's mean difference (or divergence) banded, on the weights' ratio or
    on the update (with the proximal policy), against the float64 reference (its own turn-by-turn loop)."""
    z, y, lq, prox, adv, mask, seq, segment = _logits_batch(seed)
    corr = op.Correction(ppo_clip=(0.2, 0.2) if tr.on == "weights" else None, trust_region=tr,
                         rejected_in_normalizer=False)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, segment_ids=segment, aggregation="token_mean",
              proximal_logprobs=prox)
    out = assert_matches_reference(z, y, lq, adv, **kw)
    frac = float(out.metrics["trust_region_masked_frac"])
    assert 0 < frac < 1  # some turns masked, not all
    # without seq_ids the turns are the segment ids alone: turn k of every sequence merges, another mask
    alone = assert_matches_reference(z, y, lq, adv, **dict(kw, seq_ids=None))
    assert float(alone.metrics["trust_region_masked_frac"]) != frac


def test_it_needs_segment_ids():
    z, y, lq, _, adv, mask, seq, _ = _logits_batch(0)
    with pytest.raises(ValueError, match=r"RatioRejection\(level='segment'\) or TrustRegion"):
        op.policy_loss(z, y, lq, adv, loss_mask=mask, seq_ids=seq,
                       correction=op.Correction(rejections=(op.RatioRejection(0.9, 1.1, "segment"),)))
    assert not op.RatioRejection(0.9, 1.1, "segment").per_sequence  # it drops turns, needs no seq_ids
    assert op.Correction(rejections=(op.RatioRejection(0.9, 1.1, "segment"),)).tree.needs_segments
    tr = op.TrustRegion(0.1, 0.1, sign="none", level="segment")
    assert not tr.per_sequence and op.Correction(trust_region=tr).tree.needs_segments
    with pytest.raises(ValueError, match=r"TrustRegion\(level='segment'\) and segment_ids"):
        op.policy_loss(z, y, lq, adv, loss_mask=mask, correction=op.Correction(trust_region=tr))
    with pytest.raises(ValueError, match="needs sign='none'"):
        op.TrustRegion(0.1, 0.1, level="segment")
