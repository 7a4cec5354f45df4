"""Both exported primitives check their inputs: every bad argument is a ValueError naming it (issue: the exported
primitive checked nothing), and ``validate=False`` skips exactly the value checks."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.ops import linear_sparse_log_softmax, sparse_log_softmax

N, D, V, K = 4, 6, 20, 3


def _inputs():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=gen)
    w = torch.randn(V, D, generator=gen)
    y = torch.randint(0, V, (N,), generator=gen)
    c = torch.randint(0, V, (N, K), generator=gen)
    return h, w, y, c


def _logits_call(y, c, tau=1.0, **kw):
    h, w, _, _ = _inputs()
    return sparse_log_softmax(h @ w.T, y, c, tau, **kw)


def _linear_call(y, c, tau=1.0, **kw):
    h, w, _, _ = _inputs()
    return linear_sparse_log_softmax(h, w, y, c, tau, **kw)


CALLS = {"logits": _logits_call, "linear": _linear_call}


def _bad_cases():
    _, _, y, c = _inputs()
    c_high = c.clone()
    c_high[1, 2] = V
    c_low = c.clone()
    c_low[0, 0] = -2
    y_high = y.clone()
    y_high[3] = V + 5
    y_neg = y.clone()
    y_neg[2] = -1
    return [
        ("targets", dict(y=y_high, c=c), "out of range"),
        ("targets", dict(y=y_neg, c=c), "negative"),
        ("targets", dict(y=y.float(), c=c), "integer"),
        ("candidate_ids", dict(y=y, c=c_high), "out of range"),
        ("candidate_ids", dict(y=y, c=c_low), "below -1"),
        ("candidate_ids", dict(y=y, c=c.float()), "integer"),
        ("temperature", dict(y=y, c=c, tau=0.0), "> 0"),
        ("temperature", dict(y=y, c=c, tau=0), "> 0"),
        ("temperature", dict(y=y, c=c, tau=-1.0), "> 0"),
        ("temperature", dict(y=y, c=c, tau=float("inf")), "> 0"),
        ("temperature", dict(y=y, c=c, tau=True), "number"),
        ("temperature", dict(y=y, c=c, tau=torch.tensor([1.0, 0.0, 1.0, 1.0])), "> 0"),
        ("temperature", dict(y=y, c=c, tau=torch.tensor([1.0, float("nan"), 1.0, 1.0])), "> 0"),
        ("support", dict(y=y, c=None, support=True), "candidate_ids is required"),
        ("support", dict(y=y, c=c, support=1), "bool"),
        ("skip", dict(y=y, c=c, skip=torch.zeros(N, dtype=torch.int64)), "bool"),
        ("skip", dict(y=y, c=c, skip=torch.zeros(N + 1, dtype=torch.bool)), "bool"),
        ("shard", dict(y=y, c=c, shard=(None, 0)), "VocabShard"),
    ]


@pytest.mark.parametrize("which", sorted(CALLS))
@pytest.mark.parametrize("name,kwargs,message", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_a_clear_error(which, name, kwargs, message):
    kwargs = dict(kwargs)
    y, c = kwargs.pop("y"), kwargs.pop("c")
    with pytest.raises(ValueError, match=name) as err:
        CALLS[which](y, c, **kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("which", sorted(CALLS))
def test_validate_false_skips_only_the_value_checks(which):
    """With ``validate=False`` a negative temperature is not read (the caller vouches for it); static checks stay."""
    _, _, y, c = _inputs()
    out = CALLS[which](y, c, torch.full((N,), 2.0), validate=False)
    assert bool(torch.isfinite(out.target).all())
    with pytest.raises(ValueError, match="skip"):
        CALLS[which](y, c, validate=False, skip=torch.zeros(N, dtype=torch.int64))


def test_logits_shape_and_stride_checks():
    _, _, y, c = _inputs()
    with pytest.raises(ValueError, match="logits"):
        sparse_log_softmax(torch.randn(N, V, 2), y, c)
    with pytest.raises(ValueError, match="logits"):
        sparse_log_softmax(torch.randint(0, 3, (N, V)), y, c)
    with pytest.raises(ValueError, match="unit stride"):
        sparse_log_softmax(torch.randn(V, N).T, y, c)
    one = torch.randn(1, N).T  # V = 1 with stride N along V: contiguous in effect, accepted
    out = sparse_log_softmax(one, torch.zeros(N, dtype=torch.int64))
    torch.testing.assert_close(out.target, torch.zeros(N))


@pytest.mark.parametrize("where", ["weight", "bias"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_weight_row_or_bias_entry_is_nan_like_nan_logits(where, backend):
    """A NaN weight row or bias entry reaches every row's normaliser: the fused-linear op returns NaN ``lse`` and
    log-probabilities exactly where the logits op does for the same NaN logits, and ``policy_loss`` raises."""
    h, w, y, c = _inputs()
    b = torch.zeros(V)
    if where == "weight":
        w[7] = float("nan")
    else:
        b[7] = float("nan")
    lin = linear_sparse_log_softmax(h, w, y, c, bias=b, backend=backend)
    ref = sparse_log_softmax(h @ w.T + b, y, c, backend=backend)
    assert bool(torch.isnan(lin.lse).all()) and bool(torch.isnan(lin.target).all())
    assert torch.equal(torch.isnan(lin.lse), torch.isnan(ref.lse))
    sup = linear_sparse_log_softmax(h, w, y, c, bias=b, support=True, backend=backend)
    sup_ref = sparse_log_softmax(h @ w.T + b, y, c, support=True, backend=backend)
    assert torch.equal(torch.isnan(sup.lse), torch.isnan(sup_ref.lse))  # only supports holding id 7
    lq = torch.full((N,), -2.0)
    with pytest.raises(ValueError, match="NaN"):
        op.policy_loss(hidden=h, weight=w, bias=b, tokens=y, sampler_logprobs=lq, advantages=torch.ones(N),
                       backend=backend)
