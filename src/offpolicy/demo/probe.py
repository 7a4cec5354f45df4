"""Drift, measured directly: each arm's exact expected update at a fixed probe set of prefixes.

At one position let ``p`` be the trainer's distribution (logits ``z``), ``q`` a sampler's. Under a constant
advantage ``a`` an arm's expected logit update (one unit of learning rate, the loss minimised) is

    u = -E_{y ~ q}[grad_z loss(y; a)]                                                     [V]

which this module computes *exactly*: every token ``y`` the sampler can draw is one row of a call to
:func:`offpolicy.policy_loss` with the arm's correction and candidate record, with advantage ``a * q(y) * R``
(``R`` rows, token-mean aggregation: the rows' mean is the expectation). Uncorrected GRPO gives
``u = a (q - p)`` (``E_q[e_y - p] = q - p``); score centering gives ``u = 0`` with a full record.

Two read-outs, both first-order in the step:

* ``along``: ``<u, q - p>``, the rate at which ``KL(q || p)`` *falls* (``d KL(q||p) = -<q - p, dz>``):
  positive moves ``p`` toward the sampler, negative away from it;
* ``masked_mass``: the rate at which ``p`` gains mass on the tokens MIS masks (ratio ``p / q`` outside the arm's
  MIS band, or the mixed-fleet study's band [0.2, 5] for arms without MIS): ``sum_{y in M} p_y (u_y - <p, u>)``
  (``dp = p * (dz - <p, dz>)``); ``tail_mass``: the same on the task's never-correct ids.

The probe has prefixes of both advantage signs, each update taken at the sign its prefixes really have:
*correct* prefixes (the prompt and a correct start of the answer) with ``a = +1`` (what follows a correct start
succeeds more often than the group mean), and *wrong* prefixes (the first scored answer token already wrong, so the
reward is 0 whatever follows) with ``a = -1``. Read-outs are suffixed ``_pos`` / ``_neg``. Drift moves ``p``
toward ``q`` under ``a > 0`` and away from it under ``a < 0`` (the study's "Drift"), so uncorrected GRPO has
``along_pos > 0 > along_neg``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

import offpolicy as op
from offpolicy.demo.arms import Arm
from offpolicy.demo.model import TinyLM
from offpolicy.demo.task import SortTask
from offpolicy.fleet.sampler import support_mask

#: The mixed-fleet study's band for "extreme" ratios, used for arms without MIS.
EXTREME_BAND = (0.2, 5.0)


class ProbeSet(NamedTuple):
    """Fixed prefixes: ``seqs [P, S]`` answers to held-out prompts, ``pos [P]`` the answer position probed (the
    prefix is the prompt and the first ``pos`` answer tokens), ``advantage [P]`` the prefix's sign: +1 where the
    prefix is correct, -1 where its first scored token is wrong."""

    seqs: Tensor
    pos: Tensor
    advantage: Tensor


def make_probe_set(task: SortTask, n: int, seed: int) -> ProbeSet:
    """``n`` correct prefixes (``a = +1``, position uniform over the answer) and ``n`` wrong ones (``a = -1``: the
    first scored token replaced by another number, position uniform after it) on held-out prompts, scratchpads
    drawn as in the warm-up."""
    if n < 1:
        raise ValueError(f"probe set size must be >= 1, got {n}")
    if task.n_items < 2:
        raise ValueError(f"the drift probe's wrong prefixes need n_items >= 2, got {task.n_items}")
    gen = torch.Generator().manual_seed(seed)
    numbers = task.sample_numbers(2 * n, gen, heldout=True)
    seqs = torch.cat([task.prompts(numbers), task.targets(numbers, gen)], dim=1)
    first = task.prompt_len + task.scratch
    seqs[n:, first] = (seqs[n:, first] + 1) % task.max_value
    pos = torch.cat([torch.randint(0, task.answer_len, (n,), generator=gen),
                     torch.randint(task.scratch + 1, task.answer_len, (n,), generator=gen)])
    advantage = torch.cat([torch.ones(n), -torch.ones(n)])
    return ProbeSet(seqs, pos, advantage)


def probe_logits(model: TinyLM, task: SortTask, probes: ProbeSet) -> Tensor:
    """``[P, V]`` fp32 logits of ``model`` at each probe prefix (teacher forcing)."""
    rows = torch.arange(probes.seqs.shape[0])
    return model(probes.seqs[:, :-1])[rows, task.prompt_len - 1 + probes.pos].float()


def expected_update(z: Tensor, logq: Tensor, arm: Arm, top_p: float, head_k: int, advantage: float = -1.0
                    ) -> Tensor:
    """``[P, V]`` exact expected logit update ``u`` of ``arm`` at trainer logits ``z [P, V]`` (fp32) when the
    sampler's full log-probabilities are ``logq [P, V]`` (fp32) and every sample has advantage ``advantage``.

    A top-p arm samples from ``q`` filtered to its top-``top_p`` support and records that support (replayed as a
    mask, or given as a head without replay); the others sample the full ``q`` and record its top-``head_k`` head.
    """
    if z.shape != logq.shape or z.dim() != 2:
        raise ValueError(f"z and logq must both be [P, V], got {tuple(z.shape)} and {tuple(logq.shape)}")
    n_pos, v = z.shape
    if arm.top_p:
        keep = support_mask(logq, top_p=top_p)
        lq_s = torch.where(keep, logq, -torch.inf)
        lq_s = lq_s - torch.logsumexp(lq_s, dim=-1, keepdim=True)
        width = int(keep.sum(-1).max())
        order = torch.argsort(lq_s, dim=-1, descending=True)[:, :width]
        cand_ids = torch.where(torch.gather(keep, 1, order), order, -1)
        cand_lp = torch.gather(lq_s, 1, order).masked_fill(cand_ids < 0, -torch.inf)
        draw_lp = lq_s
        kind = arm.record_kind
    else:
        cand_lp, cand_ids = torch.topk(logq, min(head_k, v), dim=-1)
        draw_lp = logq
        kind = "head"
    qd = draw_lp.exp()
    row_pos, row_tok = (qd > 0).nonzero(as_tuple=True)
    n_rows = row_pos.numel()
    zz = z.detach().clone().requires_grad_(True)
    adv = advantage * qd[row_pos, row_tok] * (n_rows / n_pos)
    res = op.policy_loss(
        zz[row_pos], row_tok, draw_lp[row_pos, row_tok], adv,
        candidates=op.Candidates(cand_ids[row_pos], cand_lp[row_pos], kind=kind),
        correction=arm.correction, seq_ids=torch.arange(n_rows),
    )
    (grad,) = torch.autograd.grad(res.loss, zz)
    # Token-mean over n_rows rows with advantages scaled by n_rows / n_pos: grad at a position is
    # E_q[grad loss] / n_pos, so -grad * n_pos is the expected update there.
    return -grad * n_pos


def drift_readouts(z: Tensor, logq: Tensor, u: Tensor, arm: Arm, tail_start: int) -> dict[str, float]:
    """Mean over probe positions of ``along``, ``masked_mass`` and ``tail_mass`` (see the module docstring) for the
    update ``u [P, V]`` at trainer logits ``z`` and sampler log-probabilities ``logq``."""
    logp = torch.log_softmax(z.detach().float(), dim=-1)
    p, q = logp.exp(), logq.exp()
    lo, hi = arm.correction.bounds if arm.correction.weights == "mis" else EXTREME_BAND
    log_ratio = logp - logq
    masked = (log_ratio < torch.log(torch.tensor(lo))) | (log_ratio > torch.log(torch.tensor(hi)))
    dp = p * (u - (p * u).sum(-1, keepdim=True))
    return {
        "along": float((u * (q - p)).sum(-1).mean()),
        "masked_mass": float((dp * masked).sum(-1).mean()),
        "tail_mass": float(dp[:, tail_start:].sum(-1).mean()),
        "kl_qp": float((q * (logq - logp)).sum(-1).mean()),
    }
