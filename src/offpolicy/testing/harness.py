"""Feeding a user's loss function and the float64 oracle the same example.

The function is reached through one adapter signature (:data:`LossFn`, see :mod:`offpolicy.testing.invariants`).
A property's failure on one example is a :class:`_Fail` (hypothesis shrinks on it); :func:`_feed` turns a drawn
:class:`~offpolicy.testing.strategies.Problem` into the tensors of one call, :func:`_call` runs the function and
checks what it returned, :func:`_reference` runs :func:`offpolicy.reference.reference_policy_loss` on the same
tensors upcast to float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import Tensor

from offpolicy.records.candidates import Candidates
from offpolicy.reference import reference_policy_loss
from offpolicy.testing.config import LossConfig
from offpolicy.testing.strategies import Problem


LossFn = Callable[[Tensor, Tensor, Tensor, "Candidates | None", Tensor, float], Tensor]


class _Fail(Exception):
    """A property's failure on one example (internal; hypothesis shrinks on it)."""

    def __init__(self, what: str, example: str):
        super().__init__(what)
        self.what = what
        self.example = example


@dataclass
class _Fed:
    """The tensors handed to the user's function (and, upcast, to the reference)."""

    logits: Tensor
    tokens: Tensor
    lq: Tensor
    cands: Candidates | None
    adv: Tensor
    tau: float
    loss_mask: Tensor | None = None
    seq_ids: Tensor | None = None
    scalar: bool = False  # the function returns the aggregated scalar, not per-token losses
    prox: Tensor | None = None  # proximal log-probabilities (decoupled PPO, CISPO)
    versions: Tensor | None = None  # policy versions (staleness rejection), with current_version
    current_version: int | None = None
    route_flips: Tensor | None = None  # MoE route-flip counts (route-flip rejection)

    @property
    def loss_name(self) -> str:
        return "aggregated loss" if self.scalar else "per-token loss"

    def keywords(self) -> dict[str, Tensor | int]:
        """The optional keywords this call passes (only those set)."""
        kw = {"loss_mask": self.loss_mask, "seq_ids": self.seq_ids, "proximal_logprobs": self.prox,
              "versions": self.versions, "current_version": self.current_version, "route_flips": self.route_flips}
        return {k: v for k, v in kw.items() if v is not None}

    def trained(self) -> Tensor:
        """``[N]`` bool: the tokens the loss trains."""
        n = self.tokens.shape[0]
        return torch.ones(n, dtype=torch.bool) if self.loss_mask is None else self.loss_mask


def _sampler_dtype(cfg: LossConfig) -> torch.dtype:
    # Sampler-side tensors are float32 in practice; float64 runs keep everything in float64.
    return torch.float64 if cfg.dtype == torch.float64 else torch.float32


def _feed(prob: Problem, cfg: LossConfig, logits: Tensor | None = None, sampler_grad: bool = False,
          loss_mask: Tensor | None = None) -> _Fed:
    sd = _sampler_dtype(cfg)
    z = (prob.logits if logits is None else logits).to(cfg.dtype).detach().requires_grad_()
    lq = prob.sampler_logprobs.to(sd).detach().requires_grad_(sampler_grad)
    adv = prob.advantages.to(sd).detach().requires_grad_(sampler_grad)
    cands = None
    if cfg.record is not None and prob.candidates is not None:
        clp = prob.candidates.logprobs.to(sd).detach().requires_grad_(sampler_grad)
        cands = Candidates(prob.candidates.ids.clone(), clp, prob.candidates.kind)
    seq_ids = prob.seq_ids.clone() if cfg.needs_sequences and prob.seq_ids is not None else None
    mask = None if loss_mask is None else loss_mask.clone()
    prox = None
    if cfg.needs_proximal:
        if prob.proximal_logprobs is None:
            raise ValueError("the configuration needs proximal log-probabilities: draw problems through "
                             "offpolicy.testing.strategies.with_proximal")
        prox = prob.proximal_logprobs.to(sd).detach().requires_grad_(sampler_grad)
    for needed, value, strategy in ((cfg.needs_versions, prob.versions, "with_versions"),
                                    (cfg.needs_route_flips, prob.route_flips, "with_route_flips")):
        if needed and value is None:
            raise ValueError(f"the configuration needs what offpolicy.testing.strategies.{strategy} adds: draw "
                             "problems through it")
    versions = prob.versions.clone() if cfg.needs_versions else None
    flips = prob.route_flips.clone() if cfg.needs_route_flips else None
    return _Fed(z, prob.tokens.clone(), lq, cands, adv, float(prob.temperature), mask, seq_ids,
                cfg.aggregation is not None, prox, versions, prob.current_version if cfg.needs_versions else None,
                flips)


def _call(fn: LossFn, fed: _Fed, example: str) -> Tensor:
    """Run the user's function; a wrong type or shape, or an exception, is a failure of the example."""
    n = fed.tokens.shape[0]
    want, shape = ("a scalar [] tensor (LossConfig.aggregation is set)", ()) if fed.scalar else (
        f"a [N] = [{n}] tensor", (n,))
    try:
        out = fn(fed.logits, fed.tokens, fed.lq, fed.cands, fed.adv, fed.tau, **fed.keywords())
    except Exception as exc:  # the user's code failed on a valid input: report it with the example
        raise _Fail(f"the loss function raised {type(exc).__name__}: {exc}", example) from exc
    if not isinstance(out, Tensor):
        raise _Fail(f"the loss function returned {type(out).__name__}, expected {want}", example)
    if tuple(out.shape) != shape:
        expected = "a scalar (LossConfig.aggregation is set)" if fed.scalar else f"per-token [N] = [{n}]"
        raise _Fail(f"the loss function returned shape {tuple(out.shape)}, expected {expected}", example)
    return out


def _grads(out: Tensor, wrt: Iterable[Tensor], example: str) -> list[Tensor | None]:
    """Gradients of ``out.sum()`` (None where a tensor is unused or nothing is differentiable)."""
    wrt = list(wrt)
    if not out.requires_grad:
        return [None] * len(wrt)
    try:
        return list(torch.autograd.grad(out.sum(), wrt, allow_unused=True))
    except Exception as exc:  # a custom backward of the user's failed
        raise _Fail(f"the backward of the loss raised {type(exc).__name__}: {exc}", example) from exc


def _logit_grad(out: Tensor, fed: _Fed, example: str) -> Tensor:
    (g,) = _grads(out, [fed.logits], example)
    return torch.zeros_like(fed.logits, dtype=torch.float64) if g is None else g.double()


def _reference(fed: _Fed, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """``(token_loss [N], d sum(token_loss) / d logits [N, V])`` of the float64 oracle, or ``(loss [], d loss /
    d logits)`` for an aggregated configuration."""
    z = fed.logits.detach().double().requires_grad_()
    cands = None if fed.cands is None else Candidates(fed.cands.ids, fed.cands.logprobs.detach().double(),
                                                       fed.cands.kind)
    agg = cfg.aggregation or "constant"
    loss, token_loss, _ = reference_policy_loss(
        z, fed.tokens, fed.lq.detach().double(), fed.adv.detach().double(), cands, fed.loss_mask, fed.tau,
        cfg.correction, fed.seq_ids, aggregation=agg,
        constant_normalizer=cfg.constant_normalizer if cfg.aggregation else (1.0 if agg == "constant" else None),
        proximal_logprobs=None if fed.prox is None else fed.prox.detach().double(),
        versions=fed.versions, current_version=fed.current_version, route_flips=fed.route_flips,
    )
    (g,) = torch.autograd.grad(loss, z)
    return (loss.detach() if fed.scalar else token_loss), g
