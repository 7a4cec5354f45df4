"""Per-row vocabulary statistics, carried in one record (:class:`RowStats`) from the backends through the vocabulary
shards to the op's result, and each optional statistic declared once (:data:`STATISTICS`).

Every backend's vocabulary pass yields, per row and relative to a reference ``m`` (the row max), the base
statistics ``s = sum exp(x - m)`` and ``t = sum exp(x - m) (x - m)`` (:mod:`offpolicy.ops.online_softmax`: ``lse``
and the entropy follow), plus the accumulators of the extras a call asked for, by name (``stats=("sum_p2",)``).
A :class:`Statistic` says, for one extra:

* ``block``: its accumulator over one block of columns, from ``e = exp(x - m)`` and ``x - m`` of that block;
* ``rescale``: the accumulator relative to a new reference ``M`` (``a = exp(m - M)``, ``d = m - M``, given the same
  part's ``s`` and ``t``): the one rule both the online fold of vocabulary tiles (:func:`merge`) and the
  all-reduce of vocabulary shards (:func:`offpolicy.ops.vocab_parallel.combine_shards`) apply;
* ``finish``: the value the caller reads, from the full-vocabulary accumulator, ``s`` and ``t``;
* ``support``: the value over a row's support (mask replay), from the renormalised ``p^S`` and ``log p^S``.

The layers above read the accumulators and values by name; nothing between a kernel and the result names a
statistic. The native kernels (the C loops of :mod:`offpolicy.ops.logits_op.cpu_backend`, the Triton kernels of
``kernels/``) accumulate ``sum_p2`` in their own loops; a backend asked for an extra its kernels lack runs the
PyTorch backend's pass for that call (the backend modules say which they have, ``NATIVE_STATS``).

The extras:

* ``sum_p2``: ``sum_v p(v)^2 = q / s^2`` with ``q = sum exp(2 (x - m))`` (the Optimal Token Baseline's
  statistic, verl PR #4678; collision probability). Moving the reference scales ``q`` by ``a^2``. Since the max
  term contributes 1, ``q >= 1`` on a row with mass: no underflow where it matters.
* ``varentropy``: the variance of the surprisal ``-log p`` under ``p``, ``sum p (log p + H)^2 = u / s - (t / s)^2``
  with ``u = sum exp(x - m) (x - m)^2`` (0 for a one-hot or uniform row). Moving the reference shifts ``x - m`` by
  ``d``: ``u' = a (u + 2 d t + d^2 s)``. It cancels when the spread of ``x - m`` under ``p`` is small against its
  mean: fp32 statistics carry an absolute error of about ``2**-20 (u / s)``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.ops import online_softmax
from offpolicy.ops.online_softmax import INF


@dataclass(frozen=True)
class Statistic:
    """One optional per-row statistic: how a vocabulary pass accumulates it, how two parts fold, what it reports.

    Attributes:
        name: the name a call asks for it by (``stats=(name,)``) and reads it under (``out.stats[name]``).
        block: ``(e [R, C], xm [R, C]) -> [R]``, its accumulator over a block of columns, ``e = exp(x - m)`` and
            ``xm = x - m`` (``-inf`` or a large negative number where ``e = 0``).
        rescale: ``(acc, a, d, s, t) -> acc'`` ``[R]``, the accumulator relative to ``M`` instead of ``m``
            (``a = exp(m - M)``, ``d = m - M``; ``s, t`` of the same part, before rescaling). Parts fold by adding
            their rescaled accumulators.
        finish: ``(acc, s, t) -> [R]``, the value over the full vocabulary (``s > 0``: rows without mass report 0).
        support: ``(p [N, K], logp [N, K]) -> [N]``, the value over a support; ``p`` is 0 and ``logp`` finite at
            padding.
        uses_shift: ``block`` reads ``xm`` (a backend may then have to form it).
    """

    name: str
    block: Callable[[Tensor, Tensor], Tensor]
    rescale: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
    finish: Callable[[Tensor, Tensor, Tensor], Tensor]
    support: Callable[[Tensor, Tensor], Tensor]
    uses_shift: bool = False


def _varentropy_support(p: Tensor, logp: Tensor) -> Tensor:
    h = -(p * logp).sum(dim=1)
    dev = logp + h[:, None]
    return (p * dev * dev).sum(dim=1)


#: Every optional statistic, by name; a call's names are kept in this order.
STATISTICS: dict[str, Statistic] = {st.name: st for st in (
    Statistic(
        "sum_p2",
        block=lambda e, xm: torch.linalg.vecdot(e, e),
        rescale=lambda q, a, d, s, t: a * a * q,
        finish=lambda q, s, t: q / (s * s),
        support=lambda p, logp: (p * p).sum(dim=1),
    ),
    Statistic(
        "varentropy",
        block=lambda e, xm: (e * torch.where(e > 0, xm, torch.zeros_like(xm)).square()).sum(dim=1),
        rescale=lambda u, a, d, s, t: a * (u + d * (2 * t + d * s)),
        finish=lambda u, s, t: (u / s - (t / s).square()).clamp_min(0.0),
        support=_varentropy_support,
        uses_shift=True,
    ),
)}


def names(asked: Iterable[str]) -> tuple[str, ...]:
    """The asked names in :data:`STATISTICS` order (a set asks the same as a tuple); no check (see
    :func:`offpolicy.ops.input_checks.check_stats`)."""
    asked = set(asked)
    return tuple(name for name in STATISTICS if name in asked)


def pack(names: str | Collection[str]) -> str:
    """The names as one comma-separated string: how the custom ops of :mod:`offpolicy.ops.library` carry them."""
    return names if isinstance(names, str) else ",".join(names)


def unpack(packed: str) -> tuple[str, ...]:
    """The inverse of :func:`pack`."""
    return tuple(packed.split(",")) if packed else ()


class RowStats(NamedTuple):
    """A vocabulary pass's per-row statistics (``[N]``, the accumulation dtype), relative to the reference ``m``.

    Attributes:
        m: the reference, the row max (0 on rows without mass).
        s: ``sum exp(x - m)``; 0 on rows without mass (skipped, all ``-inf``).
        t: ``sum exp(x - m) (x - m)``.
        extras: the accumulator of each asked statistic, by name (see :data:`STATISTICS`).
    """

    m: Tensor
    s: Tensor
    t: Tensor
    extras: dict[str, Tensor]

    def map(self, fn: Callable[[Tensor], Tensor]) -> RowStats:
        """``fn`` applied to every tensor of the record (a row selection, a mask)."""
        return RowStats(fn(self.m), fn(self.s), fn(self.t), {k: fn(v) for k, v in self.extras.items()})

    def tensors(self) -> tuple[Tensor, ...]:
        """``(m, s, t, *extras)``, extras in the record's order."""
        return (self.m, self.s, self.t, *self.extras.values())


def zeros(n: int, asked: Iterable[str], dtype: torch.dtype, device: torch.device) -> RowStats:
    """A record of zeros: ``n`` rows without mass."""
    m = torch.zeros(n, dtype=dtype, device=device)
    return RowStats(m, torch.zeros_like(m), torch.zeros_like(m), {k: torch.zeros_like(m) for k in asked})


def of_block(m: Tensor, e: Tensor, xm: Tensor, t: Tensor, asked: Iterable[str]) -> RowStats:
    """The record of one block of columns: reference ``m [R]``, ``e = exp(x - m)``, ``xm = x - m`` ``[R, C]`` and
    its ``t [R]`` (each backend forms ``t`` its own way, guarding ``0 * -inf``)."""
    return RowStats(m, e.sum(dim=1), t, {k: STATISTICS[k].block(e, xm) for k in asked})


def rescale(stats: RowStats, a: Tensor, d: Tensor) -> tuple[Tensor, ...]:
    """``(s, t, *extras)`` relative to a new reference ``M``, with ``a = exp(m - M)`` and ``d = m - M``
    (``a = d = 0`` for a part without mass): the terms that two parts, or all shards, add."""
    s, t = stats.s, stats.t
    return (a * s, a * (t + s * d), *(STATISTICS[k].rescale(v, a, d, s, t) for k, v in stats.extras.items()))


def merge(one: RowStats, two: RowStats) -> RowStats:
    """Fold the statistics of more columns (``two``) into ``one`` (the same extras, the same rows).

    With ``M = max(m, m2)`` over the parts with mass, each part is rescaled to ``M`` (:func:`rescale`) and the two
    added. A part without mass (``s = 0``) counts as ``m = -inf``; ``M = 0`` where neither part has mass. NaN in
    either ``s`` propagates.
    """
    m1e = torch.where(one.s > 0, one.m, -INF)
    m2e = torch.where(two.s > 0, two.m, -INF)
    big = torch.maximum(m1e, m2e)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    terms = []
    for part, me in ((one, m1e), (two, m2e)):
        a = torch.exp(me - big)
        d = torch.where(part.s > 0, part.m - big, torch.zeros_like(part.m))
        terms.append(rescale(part, a, d))
    folded = [x + y for x, y in zip(*terms)]
    return RowStats(big, folded[0], folded[1], dict(zip(one.extras, folded[2:])))


def finish(stats: RowStats) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``(lse [N], entropy [N], values)`` from full-vocabulary statistics (:func:`online_softmax.finish`); each
    extra's value is 0 on rows without mass (``s = 0``)."""
    lse, entropy = online_softmax.finish(stats.m, stats.s, stats.t)
    has_mass = stats.s != 0
    safe_s = torch.where(has_mass, stats.s, torch.ones_like(stats.s))
    values = {k: torch.where(has_mass, STATISTICS[k].finish(v, safe_s, stats.t), torch.zeros_like(stats.s))
              for k, v in stats.extras.items()}
    return lse, entropy, values


def support(asked: Iterable[str], xc: Tensor, lse: Tensor) -> dict[str, Tensor]:
    """Each asked statistic over a gathered support ``xc [N, K]`` (padding ``-inf``) of the support-renormalised
    distribution ``p^S = exp(xc - lse)``; 0 where ``lse = +inf`` (empty support, skipped row)."""
    asked = tuple(asked)
    if not asked:
        return {}
    has_mass = lse != INF  # a NaN lse stays NaN
    logp = xc - torch.where(has_mass, lse, torch.zeros_like(lse))[:, None]
    p = torch.exp(logp)
    logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return {k: torch.where(has_mass, STATISTICS[k].support(p, logp), torch.zeros_like(lse)) for k in asked}
