"""When the loss's gradient of each row is a closed form of that row's own log-probability: the rule the two-pass
kernel applies (:mod:`offpolicy.ops.logits_op.stats_grad_pass`).

With the score-function surrogate, token-level weights and no batch coupling, the loss of
:mod:`offpolicy.loss.logprobs` is

    L = sum_t a_t (-A_t) w_t log p(y_t),     w_t = sg(f(log p(y_t) - lq_t))

where ``a_t = dL / d token_loss_t`` is the aggregation's per-token factor (``1 / T`` for ``token_mean``, ``1 / C``
for ``constant``, ``1 / (|i| S)`` or ``1 / S`` for the sequence means: linear in the token losses, known before
the forward) and zero on untrained tokens (``A_t = 0``, masked). So ``dL / d log p(y_t) = coef_t f(lp_t - lq_t)``
with ``coef_t = -A_t a_t``, and ``f`` of the weight mode is one of the kernel's rules:

    none     f = 1
    tis      f = exp(clamp(clamp(l, -M, M), log c, log C))          (M = max_log_ratio)
    mis      f = 1[log L <= l <= log U] exp(clamp(l, -M, M))
    reject   f = 1[log L <= l <= log U]

(``w = 0`` where ``log p(y_t) = -inf``: the kernel's ``g = 0`` there). The bounds compare in fp32, as torch
compares an fp32 tensor with a Python float, so the kernel's band and the loss's agree at the edges.

Score centering with a padded head record (docs/spec.md#score-centering) adds ``- sum_k sg(c_t(k)) log p(v_k)``
to each row's policy term, so the row's loss is ``coef_t (w_t log p(y_t) - sum_k c_t(k) log p(v_k))`` and
``dL / d log p(v_k) = -coef_t c_t(k)``. Each ``c_t(k) = q(k) f(p(k) / q(k)) - alpha_t p(k)`` is a closed form of
the row's own candidate log-probabilities and its record (``alpha_t = rho_t f(1 / rho_t)``, ``rho_t`` from the
head masses ``P_H``, ``Q_H``, the same ``f``): once the row's normaliser is known the kernel forms them in ``O(K)``
(float64 head masses, as :mod:`offpolicy.loss.centering` does) before it writes the gradient, so centering costs no
pass over the vocabulary (the rule's ``head``). The study's configuration (MIS + score centering, token
aggregation, a head record) thus takes two passes.

Everything else keeps its own path (:func:`row_rule` returns None):

- the three-pass path: sequence, geometric and segment weights (the ratio is a sequence's sum), rejection rules,
  ``weights="reject"`` with ``rejected_in_normalizer=False`` (the aggregation's count then depends on the
  log-probabilities), batch normalisation (a batch mean of the weights), trust regions, KL penalties, surrogates
  other than the score function, a proximal policy, context parallelism, CSR records, score centering without a
  record (an error the loss raises);
- support records (top-p / top-k mask replay, padded or CSR) keep the support pass of
  :mod:`offpolicy.ops.logits_op.logits_function` / :mod:`offpolicy.ops.support_pass`, which is already fewer
  passes than two: a support row's normaliser is the log-sum-exp of its ``|S|`` gathered logits (``O(K)``), and
  its gradient is exactly 0 outside ``S``, so that path reads no vocabulary at all and writes the gradient once
  (``V b`` bytes per token). Computing the support's log-sum-exp in the two-pass kernel's sweep over ``V``
  (membership from the row's ids) would add a read of the whole row, ``2 V b``, for nothing the gather does not
  give.
"""

from __future__ import annotations

import math

import torch

from offpolicy.corrections.correction import Correction
from offpolicy.corrections.node import log_bound
from offpolicy.corrections.surrogates import ScoreFunction
from offpolicy.corrections.weighting import MIS, TIS, NoWeights, Reject, TokenLevel
from offpolicy.loss.aggregation import SEQUENCE_AGGREGATIONS, aggregate
from offpolicy.loss.centering import TAIL_EPS
from offpolicy.loss.inputs import Aggregation, TokenData
from offpolicy.records.candidates import Candidates
from offpolicy.loss.segments import Segments
from offpolicy.ops.logits_op.stats_grad_pass import RowRule


def served(corr: Correction, data: TokenData, cp_group, candidates: object = None) -> bool:
    """Whether the loss's gradient of each row is a closed form of its own log-probabilities (module docstring):
    ``candidates`` is the call's record (None, a padded head record; anything else is not served)."""
    tree = corr.tree
    head = isinstance(candidates, Candidates) and candidates.kind == "head"
    if candidates is not None and not head:
        return False
    mode = tree.weighting.mode
    return (type(tree.weighting.level) is TokenLevel and type(mode) in (NoWeights, TIS, MIS, Reject)
            and not tree.rejections and tree.normalisation is None and (tree.centering is None or head)
            and not (mode.rejects and not tree.rejected_in_normalizer)
            and tree.trust_region is None and tree.kl_penalty is None and type(tree.surrogate) is ScoreFunction
            and data.proximal_logprobs is None and cp_group is None)


def row_rule(corr: Correction, data: TokenData, agg: Aggregation, *, n: int, device: torch.device,
             cp_group, candidates: object = None) -> RowRule | None:
    """The :class:`~offpolicy.ops.logits_op.stats_grad_pass.RowRule` of ``dL / d log p(y_t)``, or None where the
    correction is not :func:`served` (or the batch is empty).

    ``coef [N]`` is ``-A_t`` times the aggregation's factor on trained tokens (0 elsewhere), the factor read by
    differentiating :func:`~offpolicy.loss.aggregation.aggregate` once at zero token losses (it is linear in them);
    ``shift = lq``; with score centering, ``head = (ids, log q)`` of the head record (fp32) and ``TAIL_EPS``.
    """
    if n == 0 or not served(corr, data, cp_group, candidates):
        return None
    tree = corr.tree
    active = (torch.ones(n, dtype=torch.bool, device=device) if data.loss_mask is None
              else data.loss_mask.to(device=device, dtype=torch.bool))
    adv = data.advantages.to(device=device, dtype=torch.float32).detach()
    seg = (Segments.from_ids(data.seq_ids, active) if agg.name in SEQUENCE_AGGREGATIONS else None)
    with torch.enable_grad():
        zero = torch.zeros(n, dtype=torch.float32, device=device, requires_grad=True)
        total = aggregate(zero, active, agg.name, seg, agg.num_loss_tokens, agg.num_sequences,
                          agg.constant_normalizer, None)
        (factor,) = torch.autograd.grad(total, zero)
    coef = torch.where(active & (adv != 0), -adv * factor, torch.zeros_like(adv))
    shift = data.sampler_logprobs.to(device=device, dtype=torch.float32).detach().contiguous()
    head = None
    if tree.centering is not None:
        head = (candidates.ids.to(device=device, dtype=torch.int64).contiguous(),
                candidates.logprobs.to(device=device, dtype=torch.float32).detach().contiguous())
    mode, mlr = tree.weighting.mode, float(tree.max_log_ratio)
    band = exp_clip = None
    if isinstance(mode, TIS):
        exp_clip = (mlr, log_bound(mode.lower), log_bound(mode.upper))
    elif isinstance(mode, MIS):
        band, exp_clip = (log_bound(mode.lower), log_bound(mode.upper)), (mlr, -math.inf, math.inf)
    elif isinstance(mode, Reject):
        band = (log_bound(mode.lower), log_bound(mode.upper))
    return RowRule(coef, shift, band=band, exp_clip=exp_clip, head=head, tail_eps=TAIL_EPS)
