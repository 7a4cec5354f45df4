"""op.policy_loss against the float64 reference: every weight mode x SC x record x temperature x aggregation.

Tolerances: float64 logits run the whole fast path in float64, so loss and gradient agree to 1e-10 (only the
summation order differs). fp32 logits: the primitive's statistics are fp32 (relative error ~ V * 2**-24 in the
normaliser, ~1e-5 at V = 40 after the loss's O(K) sums), so 2e-5 relative. bf16 logits are compared with the
reference on the same bf16 values upcast; the fp32 path then differs only by fp32 rounding, but the gradient is
stored in bf16 (relative 2**-8), hence 1e-2 relative on the gradient.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_policy_loss

from support.batches import make_batch

N, V, K = 12, 40, 6
WEIGHTS = [
    op.Correction(),
    op.Correction(weights="tis"),
    op.Correction(weights="tis", bounds=(0.8, 1.5)),
    op.Correction(weights="mis"),
    op.Correction(weights="mis", bounds=(0.7, 1.3)),
    op.Correction(weights="reject", bounds=(0.6, 2.0)),
]
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"]


def _run(z, y, lq, cands, corr, tau, agg, mask, adv, seq, dtype=torch.float64, **kw):
    # Each side gets its own fresh leaf: z.to(float64) returns z itself when z is float64, and two backward
    # passes into one leaf would make the gradient comparison compare a tensor with itself.
    z1 = z.to(dtype).clone().detach().requires_grad_()
    z2 = z.to(dtype).double().clone().detach().requires_grad_()
    extra = {"constant_normalizer": 7.0} if agg == "constant" else {}
    out = op.policy_loss(z1, y, lq, adv, cands, mask, tau, corr, seq_ids=seq, aggregation=agg, **extra, **kw)
    ref, ref_tl, ref_w = reference_policy_loss(
        z2, y, lq, adv, cands, mask, tau, corr, seq_ids=seq, aggregation=agg, **extra, **kw
    )
    out.loss.backward()
    ref.backward()
    return out, z1.grad, ref, ref_tl, ref_w, z2.grad


def _rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize(
    "kind,corr,sc,per_token_tau,agg",
    list(itertools.product(["head", "support", None], WEIGHTS, [False, True], [False, True], AGGS)),
)
def test_matches_reference_float64(kind, corr, sc, per_token_tau, agg):
    corr = op.Correction(weights=corr.weights, bounds=corr.bounds, score_centering=sc)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, corr, per_token_tau, agg)).encode()))
    tau = torch.rand(N, generator=gen, dtype=torch.float64) + 0.5 if per_token_tau else 0.7
    z, y, lq, cands = make_batch(N, V, K, kind or "head", seed=int(gen.initial_seed()), temperature=tau)
    cands = cands if kind else None
    mask = torch.rand(N, generator=gen) > 0.2
    adv = torch.randn(N, generator=gen)
    seq = torch.arange(N) // 3
    if sc and kind is None:
        # Score centering sums over the sampler's record: without one, both sides refuse.
        with pytest.raises(ValueError, match="needs candidates"):
            _run(z, y, lq, cands, corr, tau, agg, mask, adv, seq)
        return
    out, g, ref, ref_tl, ref_w, ref_g = _run(z, y, lq, cands, corr, tau, agg, mask, adv, seq)
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * max(1.0, abs(ref.item()))
    torch.testing.assert_close(out.token_loss, ref_tl, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.token_weight.double(), ref_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, ref_g, rtol=1e-9, atol=1e-11)


FAMILY = [
    op.Correction(weights="tis", level="sequence", bounds=3.0),
    op.Correction(weights="mis", level="sequence", bounds=(0.2, 4.0)),
    op.Correction(weights="reject", level="geometric", bounds=(0.7, 1.4)),
    op.Correction(weights="tis", level="geometric"),
    op.Correction(weights="mis", veto=0.3),
    op.Correction(weights="tis", kl_rejection=op.KLRejection(0.3, "k3", "token"), score_centering=True),
    op.Correction(weights="mis", kl_rejection=op.KLRejection(0.5, "k2", "seq_mean")),
    op.Correction(kl_rejection=op.KLRejection(1.0, "k1", "seq_sum")),
    op.Correction(kl_rejection=op.KLRejection(1.0, "k3", "seq_max")),
    op.Correction(weights="mis", opsm_delta=0.1, score_centering=True),
    op.Correction(weights="mis", batch_normalize=True, score_centering=True),
    op.Correction(weights="tis", batch_normalize=True),
    # batch_normalize names its normalisation too ("tokens" is True's): the reference resolves the name itself.
    op.Correction(weights="mis", batch_normalize="tokens", score_centering=True),
    # A token-level KL rejection under a sequence-level weight zeros the rejected tokens' own weights.
    op.Correction(weights="tis", level="sequence", bounds=3.0, kl_rejection=op.KLRejection(0.3, "k3", "token")),
    op.Correction(weights="mis", level="geometric", kl_rejection=op.KLRejection(0.2, "k1", "token")),
    # Token-level rules fold into f, so score centering sees them exactly.
    op.Correction(weights="mis", score_centering=True, rejections=(op.RatioRejection(0.7, 1.5),
                                                                   op.KLRejection((-0.3, 0.3), "k1"))),
]


@pytest.mark.parametrize("kind", ["head", "support"])
@pytest.mark.parametrize("corr", FAMILY, ids=lambda c: repr(c)[11:70])
def test_family_matches_reference(corr, kind):
    z, y, lq, cands = make_batch(N, V, K, kind, seed=5, mismatch=0.8)
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(N, generator=gen) > 0.15
    adv = torch.randn(N, generator=gen)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
    out, g, ref, ref_tl, _, ref_g = _run(z, y, lq, cands, corr, 1.0, "seq_mean_token_mean", mask, adv, seq)
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * max(1.0, abs(ref.item()))
    torch.testing.assert_close(out.token_loss, ref_tl, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g, ref_g, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.3)])
@pytest.mark.parametrize("weights", ["none", "tis", "mis"])
def test_decoupled_ppo_matches_reference(eps, weights):
    z, y, lq, cands = make_batch(N, V, K, "head", seed=9, mismatch=0.5)
    gen = torch.Generator().manual_seed(2)
    prox = (torch.log_softmax(z + 0.3 * torch.randn(z.shape, generator=gen, dtype=torch.float64), 1)
            .gather(1, y[:, None])[:, 0].float())
    corr = op.Correction(weights=weights, ppo_clip=eps)
    adv = torch.randn(N, generator=gen)
    out, g, ref, ref_tl, _, ref_g = _run(z, y, lq, None, corr, 1.0, "token_mean", None, adv, None,
                                         proximal_logprobs=prox)
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * max(1.0, abs(ref.item()))
    torch.testing.assert_close(g, ref_g, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype,rtol_loss,rtol_grad", [(torch.float32, 2e-5, 2e-5), (torch.bfloat16, 2e-5, 1e-2),
                                                      (torch.float16, 2e-5, 2e-3)])
@pytest.mark.parametrize("kind", ["head", "support"])
def test_low_precision_logits(dtype, rtol_loss, rtol_grad, kind):
    z, y, lq, cands = make_batch(64, 300, 16, kind, seed=3)
    z = z.to(dtype).double()  # the reference sees exactly the values the fast path reads
    corr = op.Correction(weights="mis", score_centering=True)
    adv = torch.randn(64, generator=torch.Generator().manual_seed(4))
    out, g, ref, _, _, ref_g = _run(z, y, lq, cands, corr, 0.9, "token_mean", None, adv, None, dtype=dtype)
    assert g.dtype == dtype
    assert _rel(out.loss.detach()[None], ref.detach()[None]) <= rtol_loss
    assert _rel(g, ref_g) <= rtol_grad


def test_num_loss_tokens_splits_exactly():
    """Two micro-batches with the global token count sum to the one-batch gradient."""
    z, y, lq, cands = make_batch(N, V, K, "head", seed=11)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(5))
    corr = op.Correction(weights="mis", score_centering=True)
    whole = z.clone().requires_grad_()
    op.policy_loss(whole, y, lq, adv, cands, correction=corr).loss.backward()
    parts = z.clone().requires_grad_()
    for sl in (slice(0, 5), slice(5, N)):
        sub = op.Candidates(cands.ids[sl], cands.logprobs[sl], "head")
        op.policy_loss(parts[sl], y[sl], lq[sl], adv[sl], sub, correction=corr, num_loss_tokens=N).loss.backward()
    torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-12, atol=1e-14)


def test_gradient_check_has_teeth(monkeypatch):
    """The gradient comparison above compares two independent leaves: it passes on the real loss and fails on a
    perturbed gradient and on a loss whose value is right but whose gradient is scaled by 1.001."""
    z, y, lq, cands = make_batch(N, V, K, "head", seed=21)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(6))
    corr = op.Correction(weights="mis", score_centering=True)
    out, g, ref, _, _, ref_g = _run(z, y, lq, cands, corr, 1.0, "token_mean", None, adv, None)
    assert g is not ref_g and g.data_ptr() != ref_g.data_ptr()
    torch.testing.assert_close(g, ref_g, rtol=1e-9, atol=1e-11)
    bad = ref_g.clone()
    bad[3, 5] += 1e-7
    with pytest.raises(AssertionError):
        torch.testing.assert_close(g, bad, rtol=1e-9, atol=1e-11)

    import offpolicy.loss.logprobs as lp_mod

    real = lp_mod.aggregate

    def wrong_gradient(token_loss, *args):
        # Same value, gradient scaled by 1.001: only a check on the gradient itself can see it.
        loss = real(token_loss, *args)
        return loss + 1e-3 * (loss - loss.detach())

    monkeypatch.setattr(lp_mod, "aggregate", wrong_gradient)
    out2, g2, ref2, _, _, ref_g2 = _run(z, y, lq, cands, corr, 1.0, "token_mean", None, adv, None)
    assert abs(out2.loss.item() - ref2.item()) <= 1e-10 * max(1.0, abs(ref2.item()))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(g2, ref_g2, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("corr", [
    op.Correction(weights="mis", batch_normalize=True, veto=0.5),
    op.Correction(weights="tis", batch_normalize=True, kl_rejection=op.KLRejection(0.3, "k2", "seq_mean")),
    op.Correction(weights="reject", batch_normalize=True, opsm_delta=0.0, score_centering=True),
    op.Correction(weights="tis", batch_normalize="sequences", veto=0.5, score_centering=True),
    op.Correction(weights="mis", level="geometric", batch_normalize="sequences", opsm_delta=0.0),
], ids=["veto", "seq_kl", "opsm_sc", "seq_mean_veto_sc", "seq_mean_geometric_opsm"])
def test_batch_normalize_with_live_sequence_rejection(corr):
    """Batch normalisation averages the weights over the kept tokens only: a rejection that drops some but not all
    sequences, against the reference (loss, per-token loss, weights, gradient)."""
    z, y, lq, cands = make_batch(N, V, K, "head", seed=5, mismatch=0.8)
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(N, generator=gen) > 0.15
    adv = torch.randn(N, generator=gen)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
    out, g, ref, ref_tl, ref_w, ref_g = _run(z, y, lq, cands, corr, 1.0, "token_mean", mask, adv, seq)
    assert 0.0 < float(out.metrics["rejected_frac"]) < 1.0  # the rejection is live
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * max(1.0, abs(ref.item()))
    torch.testing.assert_close(out.token_loss, ref_tl, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.token_weight.double(), ref_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, ref_g, rtol=1e-9, atol=1e-11)


SEQ = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])


def _prox(z, y, seed=2, scale=0.4):
    gen = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(z + scale * torch.randn(z.shape, generator=gen, dtype=torch.float64), 1)
    return lp.gather(1, y[:, None])[:, 0]


PEER_CASES = [
    op.Correction(weights="tis", ppo_clip=(0.2, 0.28), ppo_delta=1.5),
    op.Correction(weights="mis", ppo_clip=(0.2, 0.2), dual_clip=3.0),
    op.Correction(ppo_clip=(0.2, 0.3), dual_clip=2.0, ppo_delta=1.4),
    op.Correction(ppo_clip=(3e-4, 4e-4), ppo_ratio="gspo_token"),
    op.Correction(weights="tis", ppo_clip=(0.1, 0.1), ppo_ratio="gspo_token", dual_clip=3.0),
    op.Correction(cispo=(0.0, 1.2)),
    op.Correction(weights="mis", cispo=(0.8, 1.2), veto=0.05),
    op.Correction(weights="tis", batch_normalize="sequences"),
    op.Correction(weights="mis", level="sequence", bounds=(0.1, 10.0), batch_normalize="sequences"),
    op.Correction(weights="mis", opsm_delta=0.0, rejected_in_normalizer=False),
    op.Correction(weights="tis", kl_rejection=op.KLRejection(0.1, "k3", "token"), rejected_in_normalizer=False),
    op.Correction(weights="reject", bounds=(0.7, 1.4), rejected_in_normalizer=False, veto=0.1),
    op.Correction(weights="reject", level="geometric", bounds=(0.9, 1.1), rejected_in_normalizer=False),
    # Importance weights and a rejection band at another level; chained rules with their own thresholds and levels;
    # two-sided k1 bands.
    op.Correction(weights="tis", bounds=2.0, rejections=(op.RatioRejection(0.8, 1.25, "geometric"),),
                  rejected_in_normalizer=False),
    op.Correction(rejections=(op.KLRejection(0.3, "k1", "token"), op.KLRejection(0.05, "k2", "seq_max")),
                  rejected_in_normalizer=False),
    op.Correction(weights="mis", level="sequence", bounds=(0.2, 5.0),
                  rejections=(op.KLRejection((-0.2, 0.3), "k1", "token"), op.RatioRejection(0.5, 2.0, "sequence"))),
    op.Correction(weights="tis", kl_rejection=op.KLRejection((-0.1, 0.1), "k1", "seq_mean"),
                  rejections=(op.RatioRejection(0.6, 1.6),)),
]


@pytest.mark.parametrize("agg", AGGS[:3])
@pytest.mark.parametrize("corr", PEER_CASES, ids=lambda c: repr(c)[11:80])
def test_peer_family_matches_reference(corr, agg):
    z, y, lq, _ = make_batch(N, 30, 5, "head", seed=8, mismatch=0.7)
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(N, generator=gen) > 0.15
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    needs_prox = corr.surrogate.needs_proximal
    prox = _prox(z, y) if needs_prox else None
    z1 = z.clone().requires_grad_()
    z2 = z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, None, mask, 1.0, corr, seq_ids=SEQ, aggregation=agg,
                         proximal_logprobs=prox)
    ref, ref_tl, ref_w = reference_policy_loss(z2, y, lq, adv, None, mask, 1.0, corr, seq_ids=SEQ,
                                               aggregation=agg, proximal_logprobs=prox)
    out.loss.backward()
    ref.backward()
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * max(1.0, abs(ref.item()))
    torch.testing.assert_close(out.token_loss, ref_tl, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.token_weight, ref_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-9, atol=1e-11)


