"""The two-pass kernel (``row_loss_grad``: the row statistics and a closed-form row gradient in one program)
against float64, directly: every rule, odd shapes, hostile rows, skipped and coefficient-free rows, and the bad
inputs.

Without a GPU the kernel runs in Triton's interpreter (``conftest.py``) on fp32 and fp16 logits; with a GPU the
same tests run compiled, bf16 added. Tolerances: :mod:`support.vocab_reference`.
"""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.kernels import logsoftmax as kernels
from offpolicy.ops.logits_op import logits_naive

from support.vocab_reference import (STORE_FLOOR, STORE_RTOL, arg_tol, assert_close_inf, dname, hostile_logits,
                                     temperatures)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
#: (band, exp_clip) of each rule the loss uses: f = 1, TIS, MIS, rejection; and a clip inside the band.
RULES = {
    "one": (None, None),
    "exp_clip": (None, (20.0, -math.inf, math.log(2.0))),
    "band_exp": ((math.log(0.5), math.log(5.0)), (20.0, -math.inf, math.inf)),
    "band": ((math.log(0.5), math.log(5.0)), None),
    "both": ((-0.3, 0.9), (0.5, -0.2, 0.4)),
}


def _f64_rule(lr: torch.Tensor, band, exp_clip) -> torch.Tensor:
    f = torch.ones_like(lr)
    if exp_clip is not None:
        c, a, b = exp_clip
        f = torch.exp(lr.clamp(-c, c).clamp(a, b))
    if band is not None:
        f = torch.where((lr >= band[0]) & (lr <= band[1]), f, torch.zeros_like(f))
    return f


def _reference(z, y, inv_temp, skip, coef, shift, band, exp_clip):
    """float64 ``(lse, entropy, g, dz)``; ``g`` uses the log-ratio the kernel sees (``lr``, passed in) only for the
    band's decision, so an edge case decided in fp32 is decided alike."""
    zz = z.cpu().clone()
    if skip is not None:
        zz[skip.cpu()] = -math.inf
    lse, ent, x = logits_naive.full_stats(zz, inv_temp.cpu())
    n = z.shape[0]
    ok = (y >= 0) & (y < z.shape[1])
    x_y = torch.where(ok.cpu(), x.gather(1, y.cpu().clamp(0, z.shape[1] - 1)[:, None])[:, 0], -math.inf)
    lp = x_y - lse
    f = _f64_rule(lp - shift.cpu().double(), band, exp_clip)
    live = (coef.cpu() != 0) & (lp > -math.inf) & torch.isfinite(lse)
    g = torch.where(live, coef.cpu().double() * f, torch.zeros(n, dtype=torch.float64))
    p = torch.where(torch.isfinite(lse)[:, None], torch.exp(x - torch.where(torch.isfinite(lse), lse, 0.0)[:, None]),
                    torch.zeros_like(x))
    dz = -(g * inv_temp.cpu().double())[:, None] * torch.where(g[:, None] != 0, p, torch.zeros_like(p))
    rows = torch.nonzero(g != 0)[:, 0]
    dz[rows, y.cpu()[rows]] += inv_temp.cpu().double()[rows] * g[rows]
    return lse, ent, g, dz, x


def _case(n, v, dtype, gen):
    z = hostile_logits(n, v, dtype, gen, DEVICE)
    inv_temp = (1.0 / temperatures(n, gen)).float().to(DEVICE)
    y = torch.randint(0, v, (n,), generator=gen)
    lse, _, x = logits_naive.full_stats(z.cpu(), inv_temp.cpu())
    lp = x.gather(1, y[:, None])[:, 0] - lse
    # shift = lp - l with l spread over every region of the rules, kept 0.02 away from each bound (fp32 vs float64
    # decide the same side)
    lr = torch.empty(n, dtype=torch.float64).uniform_(-2.5, 2.5, generator=gen)
    edges = torch.tensor([-0.3, 0.9, -0.2, 0.4, 0.5, -0.5, math.log(0.5), math.log(2.0), math.log(5.0)],
                         dtype=torch.float64)
    near = (lr[:, None] - edges).abs().min(1)
    lr = torch.where(near.values < 0.02, lr + 0.05, lr)
    shift = torch.where(torch.isfinite(lp), lp - lr, torch.randn(n, generator=gen, dtype=torch.float64)).float()
    coef = torch.randn(n, generator=gen).float()
    if n > 8:
        coef[8] = 0.0  # no gradient: the row is read once, its gradient is zeros
    skip = torch.zeros(n, dtype=torch.bool)
    if n > 5:
        skip[5] = True
        z[5] = float("nan")  # a skipped row is never read
    return z, y.to(DEVICE), inv_temp, skip.to(DEVICE), coef.to(DEVICE), shift.to(DEVICE)


def _check(z, y, inv_temp, skip, coef, shift, band, exp_clip, dtype, **kw):
    out = torch.full_like(z, float("nan"))  # every element must be written
    m, s, t, lse, g = kernels.row_loss_grad(z, y, inv_temp, skip, coef, shift, out, band=band, exp_clip=exp_clip,
                                            **kw)
    lse_ref, ent_ref, g_ref, dz_ref, x = _reference(z, y, inv_temp, skip, coef, shift, band, exp_clip)
    tol = arg_tol(x)
    assert_close_inf(lse.cpu(), lse_ref, tol, "lse")
    ent = torch.where(s.cpu() != 0, torch.log(s.cpu().double()) - t.cpu().double() / s.cpu().double(), 0.0)
    assert_close_inf(ent, ent_ref, tol, "entropy")
    # g = coef f(l): exp(l) carries l's error relatively
    assert_close_inf(g.cpu(), g_ref, tol * 2 * g_ref.abs() + 1e-30, "g")
    bound = inv_temp.cpu().double() * 2 * g_ref.abs()
    want_tol = STORE_RTOL[dtype] * dz_ref.abs() + (tol * bound * 2)[:, None] + STORE_FLOOR[dtype]
    assert not bool(torch.isnan(out).any()), "an element of the gradient was not written"
    assert_close_inf(out.cpu(), dz_ref, want_tol, "dz")
    return m, s, t, lse, g, out


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("block", [64, None], ids=["block64", "default"])
def test_row_loss_grad_matches_float64(dtype, rule, block):
    gen = torch.Generator().manual_seed(11)
    band, exp_clip = RULES[rule]
    z, y, it, skip, coef, shift = _case(10, 1000, dtype, gen)  # 1000: a partial last block of 64
    m, s, t, lse, g, out = _check(z, y, it, skip, coef, shift, band, exp_clip, dtype, block=block)
    assert s[5] == 0 and lse[5] == math.inf and g[5] == 0 and bool((out[5] == 0).all())  # skipped
    assert s[1] == 0 and lse[1] == math.inf and g[1] == 0 and bool((out[1] == 0).all())  # all -inf
    assert g[8] == 0 and bool((out[8] == 0).all())  # coef = 0


@pytest.mark.parametrize("n,v,block", [(1, 1, 16), (3, 17, 16), (7, 129, 32), (13, 2049, None), (4, 4096, 1024)])
def test_odd_shapes(n, v, block):
    """Shapes from one column up, partial blocks, one block per row."""
    gen = torch.Generator().manual_seed(n * 1000 + v)
    z = (torch.randn(n, v, generator=gen) * 4).to(DEVICE)
    it = (1.0 / temperatures(n, gen)).float().to(DEVICE)
    y = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
    coef = torch.randn(n, generator=gen).to(DEVICE)
    shift = torch.randn(n, generator=gen).to(DEVICE) - 3
    band, exp_clip = RULES["band_exp"]
    _check(z, y, it, None, coef, shift, (-math.inf, math.inf), exp_clip, torch.float32, block=block)
    _check(z, y, it, None, coef, shift, None, None, torch.float32, block=block)


def test_hostile_rows():
    """A NaN logit (s and lse NaN: no gradient, as the three-pass backward gives a row with a NaN normaliser), a +inf
    logit, a target at -inf (lp = -inf: g = 0), logits spanning [-1e4, 1e4], a target id outside [0, V)."""
    gen = torch.Generator().manual_seed(3)
    n, v = 6, 300
    z = torch.randn(n, v, generator=gen) * 3
    z[0, 7] = float("nan")
    z[1, 9] = float("inf")
    z[2, 4] = -float("inf")
    z[3] = torch.linspace(-1e4, 1e4, v)
    y = torch.tensor([1, 2, 4, v - 1, 5, v + 3])
    it = torch.full((n,), 1.1)
    coef = torch.ones(n)
    shift = torch.zeros(n)
    out = torch.empty(n, v)
    m, s, t, lse, g = kernels.row_loss_grad(z.to(DEVICE), y.to(DEVICE), it.to(DEVICE), None, coef.to(DEVICE),
                                            shift.to(DEVICE), out := out.to(DEVICE))
    g, lse, out = g.cpu(), lse.cpu(), out.cpu()
    assert bool(torch.isnan(lse[0])) and g[0] == 0 and bool((out[0] == 0).all())
    assert bool(torch.isnan(lse[1])) and g[1] == 0 and bool((out[1] == 0).all())
    assert g[2] == 0 and bool((out[2] == 0).all())
    assert g[5] == 0 and bool((out[5] == 0).all())
    lse_ref, _, x = logits_naive.full_stats(z[3:5], it[3:5])
    assert_close_inf(lse[3:5], lse_ref, arg_tol(x), "lse")
    assert g[3] == 1 and g[4] == 1
    # row 3: p(y) = 1 to fp32: dz at y = it (1 - p) ~ 0, everywhere else ~ 0
    assert float(out[3].abs().max()) < 1e-6


def test_all_rows_without_gradient_and_empty_shapes():
    z = torch.randn(4, 50, device=DEVICE)
    one = torch.ones(4, device=DEVICE)
    out = torch.full_like(z, 7.0)
    *_, g = kernels.row_loss_grad(z, torch.zeros(4, dtype=torch.int64, device=DEVICE), one, None, 0 * one, one, out)
    assert bool((g == 0).all()) and bool((out == 0).all())
    skip = torch.ones(4, dtype=torch.bool, device=DEVICE)
    out.fill_(7.0)
    m, s, t, lse, g = kernels.row_loss_grad(z, torch.zeros(4, dtype=torch.int64, device=DEVICE), one, skip, one, one,
                                            out)
    assert bool((s == 0).all()) and bool((lse == math.inf).all()) and bool((out == 0).all())
    e = torch.empty(0, 5, device=DEVICE)
    none = torch.empty(0, device=DEVICE)
    res = kernels.row_loss_grad(e, torch.empty(0, dtype=torch.int64, device=DEVICE), none, None, none, none, e)
    assert all(r.shape == (0,) for r in res)
    e = torch.empty(3, 0, device=DEVICE)
    one3 = torch.ones(3, device=DEVICE)
    m, s, t, lse, g = kernels.row_loss_grad(e, torch.zeros(3, dtype=torch.int64, device=DEVICE), one3, None, one3,
                                            one3, e)
    assert bool((lse == math.inf).all()) and bool((g == 0).all())


def test_bad_inputs_raise():
    z = torch.randn(4, 10, device=DEVICE)
    one = torch.ones(4, device=DEVICE)
    y = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    out = torch.empty_like(z)
    with pytest.raises(ValueError, match="target"):
        kernels.row_loss_grad(z, y.int(), one, None, one, one, out)
    with pytest.raises(ValueError, match="coef"):
        kernels.row_loss_grad(z, y, one, None, one.double(), one, out)
    with pytest.raises(ValueError, match="shift"):
        kernels.row_loss_grad(z, y, one, None, one, one[:3], out)
    with pytest.raises(ValueError, match="out"):
        kernels.row_loss_grad(z, y, one, None, one, one, out.half())
    with pytest.raises(ValueError, match="band"):
        kernels.row_loss_grad(z, y, one, None, one, one, out, band=(1.0, 0.0))
    with pytest.raises(ValueError, match="exp_clip"):
        kernels.row_loss_grad(z, y, one, None, one, one, out, exp_clip=(-1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="block"):
        kernels.row_loss_grad(z, y, one, None, one, one, out, block=48)
    ids = torch.zeros(4, 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="head ids"):
        kernels.row_loss_grad(z, y, one, None, one, one, out, head=(ids.int(), ids.float()))
    with pytest.raises(ValueError, match="head lq"):
        kernels.row_loss_grad(z, y, one, None, one, one, out, head=(ids, ids[:, :2].float()))
    with pytest.raises(ValueError, match="tail_eps"):
        kernels.row_loss_grad(z, y, one, None, one, one, out, head=(ids, ids.float()), tail_eps=0.0)
