"""The weight function's bounds, in the fast path and the reference."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op


@pytest.mark.parametrize("weights", ["mis", "reject"])
@pytest.mark.parametrize("bounds", [(1.0, 2.0), (0.5, 1.0)])
def test_ratio_bounds_are_inclusive(weights, bounds):
    """``log r = 0`` exactly at a bound ``L = 1`` or ``U = 1`` is kept (weight 1), in the fast path and the
    reference alike; just outside the bound it is masked."""
    from offpolicy.reference import f as reference_f

    lq = torch.tensor([-1.25, -0.5, -2.0], dtype=torch.float64)
    corr = op.Correction(weights=weights, bounds=bounds)
    outside = -1e-12 if bounds[0] == 1.0 else 1e-12
    logp = lq + torch.tensor([0.0, 0.0, outside], dtype=torch.float64)
    out = op.policy_loss_from_logprobs(logp, lq, torch.ones(3, dtype=torch.float64), correction=corr)
    assert out.token_weight.tolist() == [1.0, 1.0, 0.0]
    assert reference_f(torch.exp(logp - lq), corr).tolist() == [1.0, 1.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------
# Band ends of every rule, from first principles (docs/spec.md#weights, #kl-rejection, #veto, #opsm,
# #sequence-level). Each case feeds log-ratios exactly: lq = 0 and log p = x for x <= 0, log p = 0 and lq = -x
# for x > 0, so log p - lq == x bit for bit in float64; "just past" a bound is the next float64 beyond it.
# ---------------------------------------------------------------------------------------------------------------

LOG_HALF, LOG_FIVE = math.log(0.5), math.log(5.0)


def _below(x: float) -> float:
    return math.nextafter(x, -math.inf)


def _above(x: float) -> float:
    return math.nextafter(x, math.inf)


def _run(log_r, corr, seq=None, adv=None, mask=None):
    """``policy_loss_from_logprobs`` on tokens whose ``log p - lq`` is exactly ``log_r`` (float64)."""
    x = torch.tensor(log_r, dtype=torch.float64)
    logp = torch.where(x <= 0, x, torch.zeros_like(x))
    lq = torch.where(x <= 0, torch.zeros_like(x), -x)
    assert torch.equal(logp - lq, x)
    adv = torch.ones_like(x) if adv is None else torch.tensor(adv, dtype=torch.float64)
    return op.policy_loss_from_logprobs(
        logp, lq, adv, correction=corr, seq_ids=None if seq is None else torch.tensor(seq),
        loss_mask=None if mask is None else torch.tensor(mask))


def _kept(log_r, corr, **kw) -> list[bool]:
    return (_run(log_r, corr, **kw).token_weight != 0).tolist()


@pytest.mark.parametrize("weights", ["mis", "reject"])
def test_weight_band_default_ends_closed(weights):
    """``[0.5, 5]`` (the default band) is closed at both ends: ``r = L`` and ``r = U`` are kept, the next float
    beyond either is masked; a kept MIS token weighs ``r``, a kept rejection token 1."""
    xs = [_below(LOG_HALF), LOG_HALF, _above(LOG_HALF), 0.0, _below(LOG_FIVE), LOG_FIVE, _above(LOG_FIVE)]
    out = _run(xs, op.Correction(weights=weights))
    assert (out.token_weight != 0).tolist() == [False, True, True, True, True, True, False]
    if weights == "mis":
        assert out.token_weight[[1, 3, 5]].tolist() == pytest.approx([0.5, 1.0, 5.0], rel=1e-15)
    else:
        assert out.token_weight[1:6].tolist() == [1.0] * 5


def test_weight_band_open_lower_end():
    """``bounds=(0, U)``: no lower end (``log 0 = -inf``): a ratio of ``e^-19`` keeps its weight."""
    assert _run([-19.0], op.Correction(weights="mis", bounds=(0.0, 5.0))).token_weight.tolist() == \
        pytest.approx([math.exp(-19.0)], rel=1e-15)


def test_tis_clamps_at_both_ends_and_scalar_bound_is_upper_only():
    """``clamp(r, c, C)``: below ``c`` the weight is ``c``, above ``C`` it is ``C``, inside it is ``r``; a scalar
    ``bounds=C`` clamps only from above (``(0, C)``: the smallest weight is ``exp(-max_log_ratio)``)."""
    two = op.Correction(weights="tis", bounds=(0.5, 2.0))
    w = _run([-3.0, LOG_HALF, 0.25, math.log(2.0), 3.0], two).token_weight
    assert w.tolist() == pytest.approx([0.5, 0.5, math.exp(0.25), 2.0, 2.0], rel=1e-15)
    one = op.Correction(weights="tis", bounds=2.0, max_log_ratio=20.0)
    w = _run([-25.0, -3.0, 3.0], one).token_weight
    assert w.tolist() == pytest.approx([math.exp(-20.0), math.exp(-3.0), 2.0], rel=1e-15)


# (estimator, threshold, log-ratios, kept?). k1 = -x, k2 = x^2 / 2, k3 = e^x - 1 - x; each row: at the bound, just
# past it, and the side a one-sided threshold leaves unbounded.
TOKEN_KL_CASES = [
    ("k1", 0.5, [-0.5, _below(-0.5), -0.25, 3.0, 19.0], [True, False, True, True, True]),
    ("k1", (-0.5, 0.25), [0.5, _above(0.5), -0.25, _below(-0.25), 0.0], [True, False, True, False, True]),
    ("k1", -0.5, [0.5, _below(0.5), 3.0, 0.0], [True, False, True, False]),  # a signed threshold below 0
    ("k2", 0.5, [1.0, -1.0, _above(1.0), _below(-1.0), 0.0], [True, True, False, False, True]),
    ("k3", 0.0, [0.0, 1e-3, -1e-3], [True, False, False]),
    ("k3", 0.5, [0.0, 0.5, -0.5, 3.0, -3.0], [True, True, True, False, False]),  # k3(+-0.5) = 0.149, 0.107
]


@pytest.mark.parametrize("estimator,threshold,xs,kept", TOKEN_KL_CASES)
def test_token_kl_rejection_band_ends(estimator, threshold, xs, kept):
    """A token is kept iff ``k <= threshold`` (or ``lo <= k <= hi``): the ends are kept, the next float past them
    is rejected, and a one-sided threshold bounds ``k`` from above only."""
    corr = op.Correction(kl_rejection=op.KLRejection(threshold, estimator))
    assert _kept(xs, corr) == kept
    chained = op.Correction(rejections=(op.KLRejection(threshold, estimator),))
    assert _kept(xs, chained) == kept


def test_token_kl_rejection_reads_the_clamped_log_ratio():
    """``max_log_ratio = 1``: ``log r = -5`` is clamped to -1 before ``k2 = 1/2 <= 1/2`` (kept); unclamped it would
    be 12.5 (rejected)."""
    corr = op.Correction(kl_rejection=op.KLRejection(0.5, "k2"), max_log_ratio=1.0)
    assert _kept([-5.0, 5.0, 0.0], corr) == [True, True, True]


# (level, threshold, per-sequence log-ratios, sequence kept?): the k1 statistic exactly at the threshold is kept,
# the next float past it drops the sequence. The third sequence's large k1 sits on an untrained token only.
SEQ_KL_CASES = [
    ("seq_sum", 0.5, [[-0.5, 0.0], [_below(-0.5), 0.0], [0.25, 0.0]]),
    ("seq_mean", 0.5, [[-1.0, 0.0], [_below(-1.0), 0.0], [0.25, 0.0]]),
    ("seq_max", 0.5, [[-0.5, 1.0], [_below(-0.5), 0.0], [0.25, 0.0]]),
]


@pytest.mark.parametrize("level,threshold,seqs", SEQ_KL_CASES)
def test_sequence_kl_rejection_band_ends(level, threshold, seqs):
    xs = [x for s in seqs for x in s] + [-9.0]
    seq = [i for i, s in enumerate(seqs) for _ in s] + [2]
    mask = [True] * (len(xs) - 1) + [False]
    corr = op.Correction(kl_rejection=op.KLRejection(threshold, "k1", level))
    kept = _kept(xs, corr, seq=seq, mask=mask)
    assert kept == [True, True, False, False, True, True, False]


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_ratio_rejection_band_ends(level):
    """``RatioRejection(0.5, 5)``, inclusive at every level. The sequence ratio of ``(x/2, x/2)`` and the
    geometric ratio of ``(2x, 0)`` are exactly ``x`` (halving, doubling and adding 0 are exact)."""
    ends = [LOG_HALF, _below(LOG_HALF), LOG_FIVE, _above(LOG_FIVE)]
    if level == "token":
        xs, seq = ends, None
    else:
        spread = (lambda x: [x / 2, x / 2]) if level == "sequence" else (lambda x: [2 * x, 0.0])
        xs, seq = [v for x in ends for v in spread(x)], [i for i in range(4) for _ in range(2)]
    corr = op.Correction(rejections=(op.RatioRejection(0.5, 5.0, level),))
    kept = _kept(xs, corr, seq=seq)
    assert kept == [k for k in (True, False, True, False) for _ in range(1 if seq is None else 2)]
    if level != "token":  # the weight mode's own band at the same level: weights="reject" keeps the same sequences
        assert _kept(xs, op.Correction(weights="reject", level=level), seq=seq) == kept


def test_chained_rules_reject_a_token_any_rule_rejects():
    """Two token rules, each rejecting a different token: both are rejected (the chain is an AND of keeps)."""
    corr = op.Correction(rejections=(op.RatioRejection(0.5, 5.0), op.KLRejection(0.5, "k2")))
    assert _kept([_below(LOG_HALF), 1.25, 0.0], corr) == [False, False, True]


def test_veto_band_end_is_kept_and_reads_the_unclamped_ratio():
    """``veto = 0.5`` drops a sequence iff some ``r_t < 0.5``: ``r = 0.5`` is kept; with ``max_log_ratio = 1`` a
    token at ``log r = -5 < log 0.01`` still vetoes its sequence (clamped it would be -1). Untrained tokens do
    not veto."""
    corr = op.Correction(veto=0.5)
    xs, seq = [LOG_HALF, 0.0, _below(LOG_HALF), 0.0, -9.0, 0.0], [0, 0, 1, 1, 2, 2]
    assert _kept(xs, corr, seq=seq, mask=[True] * 4 + [False, True]) == [True, True, False, False, False, True]
    clamped = op.Correction(veto=0.01, max_log_ratio=1.0)
    assert _kept([-5.0, 0.0, -0.5, 0.0], clamped, seq=[0, 0, 1, 1]) == [False, False, True, True]


def test_opsm_band_ends():
    """OPSM drops iff ``mean A < 0`` and ``mean(lq - log p) > delta`` (both strict): a sequence exactly at
    ``delta = 0.5`` is kept, the next float past it dropped, a zero mean advantage is never dropped however far the
    sequence drifted, and an untrained token's advantage does not count."""
    corr = op.Correction(opsm_delta=0.5)
    xs = [-1.0, 0.0, _below(-1.0), 0.0, -9.0, -9.0, -9.0, -9.0, -9.0]
    adv = [-1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -50.0]
    seq = [0, 0, 1, 1, 2, 2, 3, 3, 3]
    mask = [True] * 8 + [False]
    assert _kept(xs, corr, seq=seq, adv=adv, mask=mask) == [True, True, False, False, True, True, True, True, False]


@pytest.mark.parametrize("weights,normaliser", [("reject", 2), ("mis", 3)])
def test_rejecting_trait_moves_the_band_end_out_of_the_normaliser(weights, normaliser):
    """``rejected_in_normalizer=False``: a ``reject`` ratio just past ``L`` is a rejection (the ``rejects`` trait)
    and leaves the token mean's normaliser, the one exactly at ``L`` stays; MIS only masks (weight 0, still
    counted). Token losses ``-w log p``: ``(log 2, 0, 0)`` for reject, ``(log 2 / 2, 0, 0)`` for MIS."""
    corr = op.Correction(weights=weights, rejected_in_normalizer=False)
    out = _run([LOG_HALF, _below(LOG_HALF), 0.0], corr)
    w0 = 1.0 if weights == "reject" else 0.5
    assert float(out.loss) == pytest.approx(w0 * math.log(2.0) / normaliser, rel=1e-15)
