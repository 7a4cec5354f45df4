"""The eight properties, each ``(fn, config, case) -> None`` raising :class:`~offpolicy.testing.harness._Fail`
on a violation, and the hypothesis strategies of their cases (:mod:`offpolicy.testing.invariants` names them).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from hypothesis import assume
from hypothesis import strategies as st
from torch import Tensor

from offpolicy.reference import support_mask
from offpolicy.testing.config import LossConfig
from offpolicy.testing.strategies import (
    Position,
    Problem,
    loss_masks,
    problems,
    temperatures,
    with_proximal,
    with_route_flips,
    with_sequences,
    with_versions,
)
from offpolicy.testing.harness import LossFn, _Fail, _Fed, _call, _feed, _grads, _logit_grad, _reference
from offpolicy.testing.tolerances import _compare, _near_discontinuity, _rounding_floor, _row_scale


def _generic_temperatures(cfg: LossConfig) -> st.SearchStrategy[float]:
    # Below float64, temperatures under 0.25 multiply the logits' rounding error beyond the float32 tolerance;
    # the extremes stay covered by hostile_finite.
    return temperatures() if cfg.dtype == torch.float64 else temperatures(0.25, 10.0)


def _batches(cfg: LossConfig, record: str | None | bool = False) -> st.SearchStrategy[Problem]:
    """Generic batches for ``cfg`` (``record`` overrides ``cfg.record``), packed into sequences for
    sequence-level configurations."""
    batches = problems(cfg.record if record is False else record, temperature=_generic_temperatures(cfg))
    return _dressed(batches, cfg)


def _dressed(batches: st.SearchStrategy[Problem], cfg: LossConfig) -> st.SearchStrategy[Problem]:
    """``batches`` with what ``cfg`` needs besides: packed sequences, proximal log-probabilities, policy versions,
    route-flip counts."""
    if cfg.needs_sequences:
        batches = with_sequences(batches)
    if cfg.needs_versions:
        batches = with_versions(batches)
    if cfg.needs_route_flips:
        batches = with_route_flips(batches)
    return with_proximal(batches) if cfg.needs_proximal else batches


def _prop_agreement(fn: LossFn, cfg: LossConfig, prob: Problem) -> None:
    fed = _feed(prob, cfg)
    assume(not _near_discontinuity(fed, cfg))
    ex = prob.describe()
    ref_loss, ref_grad = _reference(fed, cfg)
    out = _call(fn, fed, ex)
    floor = _rounding_floor(fed, cfg)
    msg = _compare(fed.loss_name, out, ref_loss, cfg, floor=floor)
    if msg:
        raise _Fail(msg, ex)
    if not out.requires_grad and bool((ref_grad != 0).any()):
        raise _Fail("the returned loss is not differentiable with respect to the logits (requires_grad is False)", ex)
    msg = _compare("d sum(loss) / d logits", _logit_grad(out, fed, ex), ref_grad, cfg, floor=floor)
    if msg:
        raise _Fail(msg, ex)


def _expected_grad(fn: LossFn, cfg: LossConfig, pos: Position, adv: Tensor | float) -> tuple[Tensor, Tensor, _Fed, str]:
    """Exact ``E_{y ~ q}[grad loss(y)]`` over the position's outcomes (one row each): ``(mean [V], scale [V])``
    with ``scale = E_q |grad loss(y)|`` entrywise."""
    prob = pos.expand(adv)
    if cfg.needs_sequences:  # each outcome row is its own sequence
        prob = replace(prob, seq_ids=torch.arange(prob.num_tokens))
    fed = _feed(prob, cfg)
    assume(not _near_discontinuity(fed, cfg))
    ex = pos.describe() + f"\nadvantages per outcome y={prob.tokens.tolist()}: {prob.advantages.tolist()}"
    out = _call(fn, fed, ex)
    # An aggregated loss divides every row's term by the same factor: undo it to get grad loss(y) per row.
    g = _logit_grad(out, fed, ex) * _row_scale(cfg, prob.num_tokens)
    if not bool(torch.isfinite(g).all()):
        raise _Fail("the logit gradient is not finite", ex)
    q = fed.lq.detach().double().exp()[:, None]
    return (q * g).sum(0), (q * g.abs()).sum(0), fed, ex


def _prop_zero_drift(fn: LossFn, cfg: LossConfig, case: tuple[Position, float]) -> None:
    pos, a = case
    drift, scale, fed, ex = _expected_grad(fn, cfg, pos, a)
    msg = _compare("sum_y q(y) d loss(y) / d logits (the drift)", drift, torch.zeros_like(drift), cfg,
                   scale=float(scale.max()), floor=_rounding_floor(fed, cfg), expected="zero")
    if msg:
        raise _Fail(msg + f"; constant advantage {a:g}", ex)


def _prop_plain_is(fn: LossFn, cfg: LossConfig, case: tuple[Position, list[float]]) -> None:
    pos, adv_list = case
    m = pos.outcomes.shape[0]
    adv = torch.tensor(adv_list[:m], dtype=torch.float64)
    mean, scale, fed, ex = _expected_grad(fn, cfg, pos, adv)
    # Target: E_{y~p}[grad of -A(y) log p(y)] = -(1/tau) sum_y p(y) A(y) (e_y - p), p over the support if any.
    z = fed.logits.detach().double()[0]
    x = z / fed.tau
    if pos.kind == "support":
        x = x.masked_fill(~torch.isfinite(pos.sampler_logq), -math.inf)
    p = torch.softmax(x, dim=0)
    ys = fed.tokens
    a = fed.adv.detach().double()
    target = torch.zeros_like(p)
    target.index_add_(0, ys, -(p[ys] * a) / fed.tau)
    target += p * (p[ys] * a).sum() / fed.tau
    msg = _compare("E_q[d loss / d logits]", mean, target, cfg,
                   scale=max(float(scale.max()), float(target.abs().max())), floor=_rounding_floor(fed, cfg),
                   expected="E_p[d(-A log p) / d logits]")
    if msg:
        raise _Fail(msg, ex)


@st.composite
def _replay_cases(draw: st.DrawFn, cfg: LossConfig) -> tuple[Problem, Tensor]:
    prob = draw(_batches(cfg, "support"))
    inside = support_mask(prob.candidates, prob.vocab)
    z2 = prob.logits.clone()
    if draw(st.booleans()):
        z2 = torch.where(inside, z2, z2.max(dim=1, keepdim=True).values + 40.0)
    else:
        k = int((~inside).sum())
        vals = draw(st.lists(st.floats(-60.0, 60.0, allow_nan=False), min_size=k, max_size=k))
        z2[~inside] = torch.tensor(vals, dtype=torch.float64)
    return prob, z2


def _prop_support_replay(fn: LossFn, cfg: LossConfig, case: tuple[Problem, Tensor]) -> None:
    prob, z2 = case
    ex = prob.describe() + f"\nlogits outside the support changed to: {_rows(z2)}"
    fed = _feed(prob, cfg)
    out = _call(fn, fed, ex)
    g = _logit_grad(out, fed, ex)
    inside = support_mask(fed.cands, prob.vocab)
    rtol, atol = cfg.tolerances
    floor = _rounding_floor(fed, cfg)
    tol = atol + floor + rtol * float(g.abs().max()) if g.numel() else atol
    outside = torch.where(inside, torch.zeros_like(g), g.abs().nan_to_num(math.inf))
    if outside.numel() and float(outside.max()) > tol:
        idx = [int(i) for i in (outside == outside.max()).nonzero()[0]]
        raise _Fail(f"gradient outside the replayed support: |d loss / d logits| = {float(outside.max()):.3g} at "
                    f"{idx} (outside S), tolerance {tol:.3g}", ex)
    fed2 = _feed(prob, cfg, logits=z2)
    out2 = _call(fn, fed2, ex)
    floor = max(floor, _rounding_floor(fed2, cfg))
    msg = _compare(f"{fed.loss_name} after changing logits outside the support", out2, out.detach().double(), cfg,
                   floor=floor, expected="unchanged value")
    msg = msg or _compare("d loss / d logits after changing logits outside the support", _logit_grad(out2, fed2, ex),
                          g, cfg, floor=floor, expected="unchanged value")
    if msg:
        raise _Fail(msg, ex)


def _rows(x: Tensor) -> str:
    from offpolicy.testing.strategies import _fmt

    return _fmt(x)


@st.composite
def _shift_cases(draw: st.DrawFn, cfg: LossConfig) -> tuple[Problem, list[float]]:
    prob = draw(_batches(cfg))
    big = 100.0 if cfg.dtype == torch.float64 else 2.0
    shifts = draw(st.lists(st.one_of(st.sampled_from([big, -big]), st.floats(-big, big, allow_nan=False)),
                           min_size=prob.num_tokens, max_size=prob.num_tokens))
    return prob, shifts


def _prop_shift(fn: LossFn, cfg: LossConfig, case: tuple[Problem, list[float]]) -> None:
    prob, shifts = case
    c = torch.tensor(shifts, dtype=torch.float64).reshape(-1, 1)
    ex = prob.describe() + f"\nper-row constant added to the logits: {_rows(c.reshape(-1))}"
    fed = _feed(prob, cfg)
    assume(not _near_discontinuity(fed, cfg))
    out = _call(fn, fed, ex)
    g = _logit_grad(out, fed, ex)
    fed2 = _feed(prob, cfg, logits=prob.logits + c)
    out2 = _call(fn, fed2, ex)
    floor = max(_rounding_floor(fed, cfg), _rounding_floor(fed2, cfg))
    msg = _compare(f"{fed.loss_name} after a constant logit shift", out2, out.detach().double(), cfg, floor=floor,
                   expected="unshifted value")
    msg = msg or _compare("d loss / d logits after a constant logit shift", _logit_grad(out2, fed2, ex), g, cfg,
                          floor=floor, expected="unshifted value")
    if msg:
        raise _Fail(msg, ex)


def _prop_sampler_no_grad(fn: LossFn, cfg: LossConfig, prob: Problem) -> None:
    ex = prob.describe()
    fed = _feed(prob, cfg, sampler_grad=True)
    out = _call(fn, fed, ex)
    named = [("sampler_logprobs", fed.lq), ("advantages", fed.adv)]
    if fed.cands is not None:
        named.append(("candidates.logprobs", fed.cands.logprobs))
    if fed.prox is not None:
        named.append(("proximal_logprobs", fed.prox))
    grads = _grads(out, [t for _, t in named], ex)
    for (name, _), g in zip(named, grads):
        if g is not None and bool((g != 0).any()):
            idx = [int(i) for i in (g != 0).nonzero()[0]]
            raise _Fail(f"gradient flows into {name}: d sum(loss) / d {name} = {_rows(g.detach().double())} "
                        f"(first nonzero at {idx}); sampler-side tensors and advantages must be detached "
                        "(w = sg(f(r)), c = sg(c), pi_prox is data)", ex)


def _prop_hostile(fn: LossFn, cfg: LossConfig, prob: Problem) -> None:
    ex = prob.describe()
    fed = _feed(prob, cfg)
    out = _call(fn, fed, ex)
    if not bool(torch.isfinite(out.detach()).all()):
        if fed.scalar:
            raise _Fail(f"the aggregated loss is {float(out.detach())}", ex)
        bad = [int(i) for i in (~torch.isfinite(out.detach())).nonzero()[:, 0]]
        raise _Fail(f"per-token loss is not finite at tokens {bad}: {_rows(out.detach().double())}", ex)
    g = _logit_grad(out, fed, ex)
    if not bool(torch.isfinite(g).all()):
        idx = [int(i) for i in (~torch.isfinite(g)).nonzero()[0]]
        raise _Fail(f"d loss / d logits is not finite (first at {idx}): {_rows(g)}", ex)


@st.composite
def _masking_cases(draw: st.DrawFn, cfg: LossConfig) -> tuple[Problem, Tensor]:
    prob = draw(_batches(cfg))
    mask = draw(loss_masks(prob.num_tokens))
    if draw(st.booleans()):
        # What padded batches hold at untrained positions: placeholder sampler log-probabilities (0) and
        # advantages; a sequence-level ratio that counts those tokens changes.
        off = ~mask
        prox = None if prob.proximal_logprobs is None else torch.where(off, 0.0, prob.proximal_logprobs)
        prob = replace(prob, sampler_logprobs=torch.where(off, 0.0, prob.sampler_logprobs),
                       advantages=torch.where(off, 1e3, prob.advantages), proximal_logprobs=prox,
                       notes={**prob.notes, "untrained rows": "lq=0, A=1e3" + (", prox=0" if prox is not None
                                                                                  else "")})
    return prob, mask


def _prop_masking(fn: LossFn, cfg: LossConfig, case: tuple[Problem, Tensor]) -> None:
    prob, mask = case
    ex = prob.describe() + f"\nloss_mask        = {_rows(mask)}"
    fed = _feed(prob, cfg, loss_mask=mask)
    assume(not _near_discontinuity(fed, cfg))
    out = _call(fn, fed, ex)
    values = out.detach().double()
    if fed.scalar and not bool(torch.isfinite(values)):
        raise _Fail(f"the aggregated loss is {float(values)}", ex)
    if not fed.scalar and not bool(torch.isfinite(values).all()):
        bad = [int(i) for i in (~torch.isfinite(values)).nonzero()[:, 0]]
        raise _Fail(f"per-token loss is not finite at tokens {bad}: {_rows(values)}", ex)
    g = _logit_grad(out, fed, ex)
    if not bool(torch.isfinite(g).all()):
        idx = [int(i) for i in (~torch.isfinite(g)).nonzero()[0]]
        raise _Fail(f"d loss / d logits is not finite (first at {idx}): {_rows(g)}", ex)
    _, atol = cfg.tolerances
    off = ~mask
    if not fed.scalar and bool(off.any()) and float(values[off].abs().max()) > atol:
        bad = [int(i) for i in (off & (values.abs() > atol)).nonzero()[:, 0]]
        raise _Fail(f"untrained tokens {bad} (loss_mask False) carry loss: {_rows(values)}", ex)
    if bool(off.any()) and float(g[off].abs().max()) > atol:
        bad = [int(i) for i in (off[:, None] & (g.abs() > atol)).any(1).nonzero()[:, 0]]
        raise _Fail(f"gradient reaches the logits of untrained tokens {bad}: {_rows(g)}", ex)
    ref_loss, ref_grad = _reference(fed, cfg)
    floor = _rounding_floor(fed, cfg)
    msg = _compare(f"{fed.loss_name} under the loss mask", out, ref_loss, cfg, floor=floor)
    msg = msg or _compare("d sum(loss) / d logits under the loss mask", g, ref_grad, cfg, floor=floor)
    if msg:
        raise _Fail(msg, ex)
