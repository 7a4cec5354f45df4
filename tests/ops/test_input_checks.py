"""Both exported primitives check their inputs: every bad argument is a ValueError naming it (issue: the exported
primitive checked nothing), and ``validate=False`` skips exactly the value checks."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.ops import linear_sparse_log_softmax, sparse_log_softmax

from support.vocab_reference import distinct_ids

N, D, V, K = 4, 6, 20, 3


def _inputs():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=gen)
    w = torch.randn(V, D, generator=gen)
    y = torch.randint(0, V, (N,), generator=gen)
    c = distinct_ids(N, V, K, gen)
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
    c_dup = c.clone()
    c_dup[2, 1] = c_dup[2, 0]
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
        # issue 22, finding 7: a repeated id would count twice in the support's normaliser
        ("candidate_ids", dict(y=y, c=c_dup, support=True), "holds an id twice"),
        # issue 22, finding 8: ids PyTorch cannot compare on CPU, a temperature whose inverse overflows fp32
        *[(name, dict(y=y.to(dt), c=c) if name == "targets" else dict(y=y, c=c.to(dt)), "integer")
          for name in ("targets", "candidate_ids") for dt in (torch.uint16, torch.uint32, torch.uint64)],
        ("temperature", dict(y=y, c=c, tau=1e-39), "too small"),
        ("temperature", dict(y=y, c=c, tau=torch.tensor([1.0, 1e-39, 1.0, 1.0])), "too small"),
        ("temperature", dict(y=y, c=c, tau=torch.full((N,), 1 + 0j)), "float"),
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


def test_duplicates_are_fine_without_support():
    """A head record's repeated id is harmless to the primitive (each entry is gathered, the gradients add up):
    only the support's normaliser would count it twice."""
    _, _, y, c = _inputs()
    c[2, 1] = c[2, 0]
    for call in CALLS.values():
        out = call(y, c)
        assert torch.equal(out.candidates[2, 1], out.candidates[2, 0])


def test_meta_logits_are_a_clear_error():
    """Meta tensors have shapes but no values (issue 22, finding 8: they failed inside ``.item()``)."""
    meta = torch.empty(N, V, device="meta")
    y = torch.zeros(N, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="logits: a meta tensor"):
        sparse_log_softmax(meta, y)
    with pytest.raises(ValueError, match="logits: a meta tensor"):
        op.policy_loss(meta, y, torch.full((N,), -1.0, device="meta"), torch.ones(N, device="meta"))


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("shape", [(N,), (1,)])
def test_meta_temperature_is_a_clear_error(validate, shape):
    """Issue 40: a temperature tensor on the meta device (no values to divide by) hung or failed inside a copy;
    it is a ValueError naming ``temperature`` at every boundary, with or without the value checks."""
    h, w, y, c = _inputs()
    tau = torch.ones(shape, device="meta")
    for call in (lambda: sparse_log_softmax(h @ w.T, y, c, tau, validate=validate),
                 lambda: linear_sparse_log_softmax(h, w, y, c, tau, validate=validate),
                 lambda: op.policy_loss(h @ w.T, y, torch.full((N,), -1.0), torch.ones(N), temperature=tau,
                                        validate=validate)):
        with pytest.raises(ValueError, match="temperature: a meta tensor holds no values"):
            call()


def _aliased(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if kind == "expand":
        return torch.randn(1, V, generator=gen).expand(N, V)
    return torch.randn(N * 5 + V, generator=gen).as_strided((N, V), (5, 1))  # row stride 5 < V: rows overlap


@pytest.mark.parametrize("backend", ["torch", None], ids=["torch", "default"])
@pytest.mark.parametrize("kind", ["expand", "overlapping rows"])
def test_inplace_grad_refuses_overlapping_logits(backend, kind):
    """Issue 22, finding 6: the gradient written over logits whose rows share memory was silently wrong (the
    native backend) or a RuntimeError (expanded rows on the torch backend)."""
    _, _, y, c = _inputs()
    with pytest.raises(ValueError, match="inplace_grad=True .* overlap") as err:
        sparse_log_softmax(_aliased(kind), y, c, inplace_grad=True, backend=backend)
    assert "inplace_grad=False" in str(err.value)
    with pytest.raises(ValueError, match="inplace_grad=True .* overlap"):
        op.policy_loss(_aliased(kind), y, torch.full((N,), -1.0), torch.ones(N), inplace_grad=True, backend=backend)
    out = sparse_log_softmax(_aliased(kind), y, c, backend=backend)  # reading overlapping rows is fine
    assert bool(torch.isfinite(out.target).all())


@pytest.mark.parametrize("backend", ["torch", None], ids=["torch", "default"])
def test_inplace_grad_on_rows_with_gaps_is_the_gradient(backend):
    """Rows with gaps between them (row stride above ``V``) do not overlap: the in-place gradient is accepted and
    equals the out-of-place one."""
    _, _, y, c = _inputs()
    grads = []
    for inplace in (False, True):
        leaf = torch.randn(N * (V + 3), generator=torch.Generator().manual_seed(1)).requires_grad_()
        z = leaf.clone().as_strided((N, V), (V + 3, 1))  # the in-place gradient overwrites the clone
        out = sparse_log_softmax(z, y, c, 0.7, inplace_grad=inplace, backend=backend)
        (out.target.sum() + out.candidates.sum()).backward()
        grads.append(leaf.grad)
    assert bool(grads[0].abs().sum() > 0)
    # fp32: a few ulps apart at most (the torch backend's out-of-place backward rescales the forward's cached
    # exponentials, the in-place one recomputes them)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)
