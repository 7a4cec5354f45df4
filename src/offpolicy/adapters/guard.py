"""Trainer-adapter guards: the sampler's record checked against the trainer's distribution on every batch, each
silent mistake warned about once, naming its cause and its fix.

A trainer adapter lists what its configuration makes suspect (:class:`Suspect`: a sampler temperature the loss does
not use, a logits processor the trainer does not apply, mismatched compute dtypes ...) and calls
:meth:`Guard.observe` with the trainer's and the sampler's log-probabilities of the sampled tokens. A suspect fires
when the measured mismatch reaches its ``min_abs_log_ratio_max`` (0: the configuration alone makes the result
wrong); with no suspect firing, a mean ``|log p - log q|`` above ``unexplained_abs_mean`` on a batch that no optimizer
step separates from its generation fires ``unexplained_mismatch`` (a stale or mis-synced sampler). Each finding is
issued once per guard through :mod:`warnings` (:class:`GuardWarning`) and the ``offpolicy`` logger, and appears in
the returned metrics as ``guard/<code> = 1`` on every checked batch where it holds.

Cost: the checks here are ``O(N)`` elementwise reductions over the batch's ``[N]`` log-probabilities (never
``[N, V]``) read back with ONE host synchronisation per call, so they run on every batch by default
(``every=1``). ``first_batches`` / ``every`` exist for a check that costs a forward of its own, which should then be
sampled; none of the adapters in this package needs one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Any

import torch
from torch import Tensor

LOGGER = logging.getLogger("offpolicy")


class GuardWarning(UserWarning):
    """A trainer adapter's guard found a silent mistake in the sampler / trainer pairing."""


@dataclasses.dataclass(frozen=True)
class Suspect:
    """One mistake the configuration makes possible.

    Attributes:
        code: the metric and warning name (``guard/<code>``).
        cause: what the configuration does, in the user's option names.
        fix: the change that removes it.
        min_abs_log_ratio_max: the measured ``max |log p - log q|`` from which it fires (0: always; a measured value
            equal to it fires).
    """

    code: str
    cause: str
    fix: str
    min_abs_log_ratio_max: float = 0.0


def mismatch_stats(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """``k1 = mean(log q - log p)``, ``abs_log_ratio_mean`` / ``_max`` of ``log p - log q`` over ``mask``, in float64,
    read back with one host synchronisation.

    Args:
        trainer_logprobs: ``[N]`` float ``log p(y_t)``.
        sampler_logprobs: ``[N]`` float ``log q(y_t)``.
        mask: ``[N]`` bool, the tokens to compare.
    """
    m = mask.reshape(-1).bool()
    if m.numel() == 0:
        return {"tokens": 0.0, "k1": 0.0, "abs_log_ratio_mean": 0.0, "abs_log_ratio_max": 0.0}
    diff = trainer_logprobs.reshape(-1).detach().double() - sampler_logprobs.reshape(-1).detach().double()
    d = torch.where(m, diff, torch.zeros_like(diff))
    n, total, abs_total, abs_max = torch.stack([m.sum().double(), d.sum(), d.abs().sum(), d.abs().max()]).tolist()
    if not n:
        return {"tokens": 0.0, "k1": 0.0, "abs_log_ratio_mean": 0.0, "abs_log_ratio_max": 0.0}
    return {"tokens": n, "k1": -total / n, "abs_log_ratio_mean": abs_total / n, "abs_log_ratio_max": abs_max}


class Guard:
    """Warn-once checks of a trainer adapter (see the module docstring).

    Args:
        suspects: what the configuration makes suspect.
        first_batches: batches checked from the start.
        every: afterwards, one batch in ``every`` (default 1: every batch; the checks are ``O(N)`` with one host
            sync, see the module docstring).
        unexplained_abs_mean: the mean ``|log p - log q|`` above which a synced batch with no suspect firing is
            ``unexplained_mismatch``.
    """

    UNEXPLAINED = Suspect(
        "unexplained_mismatch",
        "the sampler's log-probs disagree with the trainer's on a batch no optimizer step separates from its "
        "generation, beyond numerics: a stale or partial weight sync (e.g. tied embeddings the engine does not "
        "update), a logits processor, or a different model or temperature in the sampler",
        "run `offpolicy diagnose` on the recorded batch and compare the sampler's configuration with the trainer's")

    def __init__(self, suspects: list[Suspect], *, first_batches: int = 2, every: int = 1,
                 unexplained_abs_mean: float = 1e-2) -> None:
        if first_batches < 0 or every < 1:
            raise ValueError(f"first_batches must be >= 0 and every >= 1, got {first_batches}, {every}")
        self.suspects = list(suspects)
        self.first_batches, self.every = first_batches, every
        self.unexplained_abs_mean = unexplained_abs_mean
        self.calls = 0
        #: codes already warned about
        self.issued: set[str] = set()
        #: trained tokens in a row (across calls) whose sampler log-prob is exactly 0 (:func:`check_sampler_logprobs`)
        self.zero_run = 0
        #: what an adapter keeps from batch to batch for its own checks (e.g. verl's truncated weights)
        self.memory: dict[str, Any] = {}

    def due(self) -> bool:
        """Whether the next :meth:`observe` call checks its batch."""
        n = self.calls + 1
        return n <= self.first_batches or (n - self.first_batches) % self.every == 0

    def observe(self, trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *,
                synced: bool = True) -> dict[str, float]:
        """Check one batch when :meth:`due`; returns ``{"guard/<code>": 1.0}`` for each finding that holds.

        Args:
            trainer_logprobs, sampler_logprobs, mask: ``[N]`` as in :func:`mismatch_stats`.
            synced: no optimizer step separates the trainer's log-probs from the generation (else drift is
                expected and only the configuration's suspects are checked).
        """
        if not self.tick():
            return {}
        stats = mismatch_stats(trainer_logprobs, sampler_logprobs, mask)
        if not stats["tokens"]:
            return {}
        found = [s for s in self.suspects if stats["abs_log_ratio_max"] >= s.min_abs_log_ratio_max]
        if not found and synced and stats["abs_log_ratio_mean"] > self.unexplained_abs_mean:
            found = [self.UNEXPLAINED]
        measured = (f"{int(stats['tokens'])} tokens: mean |log p - log q| {stats['abs_log_ratio_mean']:.2e}, max "
                    f"{stats['abs_log_ratio_max']:.2e}, k1 {stats['k1']:.2e}")
        metrics: dict[str, float] = {}
        for s in found:
            metrics.update(self.flag(s, measured))
        return metrics

    def tick(self) -> bool:
        """Count one batch; whether it is checked (:meth:`due` before counting)."""
        due = self.due()
        self.calls += 1
        return due

    def flag(self, suspect: Suspect, measured: str) -> dict[str, float]:
        """Record that ``suspect`` holds on the current batch (``measured``: what was seen); warn the first time.
        Returns ``{"guard/<code>": 1.0}``."""
        if suspect.code not in self.issued:
            self.issued.add(suspect.code)
            message = (f"offpolicy guard [{suspect.code}]: {suspect.cause}. Measured on batch {self.calls} "
                       f"({measured}). Fix: {suspect.fix}")
            LOGGER.warning(message)
            warnings.warn(message, GuardWarning, stacklevel=3)
        return {f"guard/{suspect.code}": 1.0}


#: The largest trained ``lq`` taken for rounding of a log-probability at 0; above it the record is not log-probs.
LOGPROB_POSITIVE_TOL = 1e-4
#: ``sampler_logprobs_zero`` fires once this many trained tokens in a row (across calls) have ``lq`` exactly 0: a
#: confident sampler gives an honest 0 now and then (``p`` within fp32 rounding of 1), never on every token of a run
#: this long; a placeholder does on all of them.
ZERO_MIN_TOKENS = 32
ZERO_SAMPLER_LOGPROBS = Suspect(
    "sampler_logprobs_zero",
    "every trained token's sampler log-prob is exactly 0 (q = 1): the sampler returned no log-probs and a "
    "placeholder was passed, or it sampled greedily; the importance weights are then pi itself",
    "enable log-prob return in the rollout engine (and pass the sampler's values); a greedy sampler has no "
    "importance weights to correct")


#: ``narrower_sampler`` fires when at least this share of the trained tokens has ``lq > log p`` ...
NARROWER_SHARE = 0.98
#: ... and their mean ``lq - log p`` is at least this (``-log 0.99``: a support holding under 99% of the mass).
NARROWER_MEAN = 1e-2
#: ... over at least this many trained tokens (fewer could all take one sign by chance).
NARROWER_MIN_TOKENS = 32
NARROWER_SAMPLER = Suspect(
    "narrower_sampler",
    "the sampler's log-prob exceeds the trainer's on almost every trained token: the sampler's distribution is "
    "narrower than the one the loss uses, a top_p / top_k / min_p filter whose support this adapter cannot replay "
    "(every ratio is then off by -log P(S_t)) or a sampler temperature below the trainer's",
    "sample with top_p=1 and no top_k / min_p (this trainer passes no support record to the loss), and the same "
    "temperature in the sampler and the trainer")


def check_sampler_logprobs(guard: Guard, sampler_logprobs: Tensor, mask: Tensor, *, name: str,
                           trainer_logprobs: Tensor | None = None) -> dict[str, float]:
    """The record checks of a trainer adapter that sees no sampler configuration and no support record, on a batch
    :meth:`Guard.due` (counted by this call; every batch by default), ``O(N)`` with one host sync: a trained ``lq``
    above :data:`LOGPROB_POSITIVE_TOL` or NaN is an error (not a log-probability); :data:`ZERO_MIN_TOKENS` or more
    trained tokens in a row with ``lq`` exactly 0 (counted across calls, a batch with any other value resets the
    count) warn :data:`ZERO_SAMPLER_LOGPROBS`; with ``trainer_logprobs``, ``lq > log p`` on at least
    :data:`NARROWER_SHARE` of at least :data:`NARROWER_MIN_TOKENS` tokens, with mean ``lq - log p >=``
    :data:`NARROWER_MEAN`, warns :data:`NARROWER_SAMPLER` (a stale sampler's differences take both signs).

    Args:
        sampler_logprobs: ``[N]`` float ``lq``; mask: ``[N]`` bool trained tokens; name: the argument's name in the
            trainer's terms (for the error); trainer_logprobs: ``[N]`` float ``log p`` of the same tokens.

    Returns:
        ``{"guard/<code>": 1.0}`` for each finding.
    """
    if not guard.tick():
        return {}
    m = mask.reshape(-1).bool()
    lq = sampler_logprobs.reshape(-1).detach()
    if m.numel() == 0:
        return {}
    parts = [m.sum().double(), torch.where(m, lq, torch.full_like(lq, -math.inf)).max().double(),
             (m & (lq == 0)).sum().double(), (m & torch.isnan(lq)).sum().double()]
    if trainer_logprobs is not None:
        diff = lq.double() - trainer_logprobs.reshape(-1).detach().double()
        d = torch.where(m, diff, torch.zeros_like(diff))
        parts += [(m & (d > 0)).sum().double(), d.sum()]
    stats = torch.stack(parts).tolist()
    n, top, zeros, nans = stats[:4]
    if not n:
        return {}
    if nans or top > LOGPROB_POSITIVE_TOL:
        shown = "NaN" if nans else f"{top:.4g}"
        raise ValueError(f"{name} must be the sampler's log-probabilities (<= 0); a trained token has {shown}: "
                         "probabilities, logits or another quantity were passed")
    if zeros == n:
        guard.zero_run += int(n)
        if guard.zero_run >= ZERO_MIN_TOKENS:
            return guard.flag(ZERO_SAMPLER_LOGPROBS, f"{guard.zero_run} trained tokens in a row, all lq = 0")
        return {}
    guard.zero_run = 0
    if trainer_logprobs is None or n < NARROWER_MIN_TOKENS:
        return {}
    share, mean = stats[4] / n, stats[5] / n
    if share >= NARROWER_SHARE and mean >= NARROWER_MEAN:
        return guard.flag(NARROWER_SAMPLER, f"{int(n)} trained tokens: lq > log p on {share:.1%}, mean "
                                            f"lq - log p {mean:.3e} (-log P(S) of a support at {math.exp(-mean):.3f})")
    return {}


__all__ = ["Guard", "GuardWarning", "LOGPROB_POSITIVE_TOL", "NARROWER_MEAN", "NARROWER_MIN_TOKENS", "NARROWER_SAMPLER",
           "NARROWER_SHARE", "Suspect", "ZERO_MIN_TOKENS", "ZERO_SAMPLER_LOGPROBS",
           "check_sampler_logprobs", "mismatch_stats"]
