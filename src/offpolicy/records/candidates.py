"""The sampler's candidate record: which tokens it considered at each position and with what log-probability.

Two kinds (docs/spec.md#records):

* ``"head"``: sampling was unfiltered; ``ids`` are the sampler's top-``K`` tokens. The unrecorded tail of the
  sampler's distribution is modelled by score centering (``q_hat = rho * p`` outside the head).
* ``"support"``: sampling was filtered (top-p < 1 and/or top-k); ``ids`` are the *whole* realised support ``S_t``
  and ``logprobs`` are renormalised over it, so each valid row sums to one. The trainer replays the mask: it
  renormalises its own distribution over the same ``S_t``.

Padding is ``-1`` in ``ids`` and ``-inf`` in ``logprobs``. A row may be empty (all padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Kind = Literal["head", "support"]
KINDS = ("head", "support")

#: A support row's probabilities must sum to one within this tolerance. Samplers renormalise in fp32 over at
#: most a few thousand entries; the sum of K fp32 terms carries a relative error of about K * 2**-24, and the
#: log-probabilities are themselves rounded once more when they are shipped, so 1e-3 admits every honest record
#: and still catches a record that was not renormalised (whose sum is the kept mass, top_p <= 0.999).
SUPPORT_SUM_TOL = 1e-3


def support_sum_tolerance(logprobs: Tensor) -> Tensor:
    """``[N]`` how far an honestly renormalised support row of ``logprobs [N, K]`` may sum from one.

    :data:`SUPPORT_SUM_TOL` plus the rounding of the shipped log-probabilities themselves: a log-probability
    ``l`` stored in a dtype with machine epsilon ``eps`` is off by up to ``|l| eps / 2``, so ``p = e^l`` is off by
    ``p |l| eps / 2`` and the row sum by ``eps / 2 * sum_v p(v) |l(v)|`` (``eps / 2`` times the row's entropy).
    That is below 1e-6 in fp32 but reaches a few 1e-2 in bf16 (``eps = 2^-7``) on a wide support; ``eps`` (not
    ``eps / 2``) leaves room for the sampler's own renormalisation.
    """
    eps = torch.finfo(logprobs.dtype).eps
    lp = logprobs.double()
    spread = torch.where(torch.isfinite(lp), -torch.exp(lp) * lp, torch.zeros_like(lp)).sum(dim=1)
    return SUPPORT_SUM_TOL + eps * spread


def has_values(x: Tensor) -> bool:
    """Whether ``x``'s values can be read to check them: not on the meta device, not a fake tensor
    (``torch._subclasses.FakeTensor``, what ``torch.compile`` and ``FakeTensorMode`` trace with), and not while
    ``torch.compile`` traces (a graph cannot branch on a value; the compiled loss checks records in its graph)."""
    if x.device.type == "meta" or torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(x)


def first_duplicate_row(ids: Tensor) -> int | None:
    """The first row of ``ids [N, K]`` (``-1`` padding) that holds a real id twice, or None (one sort of each row,
    ``O(N K log K)``, and one host sync)."""
    if ids.shape[1] < 2 or ids.shape[0] == 0:
        return None
    srt, _ = torch.sort(ids, dim=1)
    dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(dim=1)
    return int(dup.nonzero()[0]) if bool(dup.any()) else None


@dataclass(frozen=True)
class Candidates:
    """Candidate ids and sampler log-probabilities per position.

    Attributes:
        ids: ``[N, K]`` integer tensor of token ids, ``-1`` for padding.
        logprobs: ``[N, K]`` float tensor of the sampler's log-probabilities of ``ids`` after temperature
            (``-inf`` at padding). For ``kind="support"`` they are renormalised over the support.
        kind: ``"head"`` or ``"support"`` (see the module docstring).
    """

    ids: Tensor
    logprobs: Tensor
    kind: Kind = "head"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Candidates.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.ids, Tensor) or not isinstance(self.logprobs, Tensor):
            raise TypeError("Candidates.ids and Candidates.logprobs must be torch tensors")
        if self.ids.dim() != 2:
            raise ValueError(f"Candidates.ids must be [N, K], got shape {tuple(self.ids.shape)}")
        if self.ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"Candidates.ids must be int32 or int64, got {self.ids.dtype}")
        if self.logprobs.shape != self.ids.shape:
            raise ValueError(
                f"Candidates.logprobs must have the shape of ids {tuple(self.ids.shape)}, "
                f"got {tuple(self.logprobs.shape)}"
            )
        if not self.logprobs.is_floating_point():
            raise TypeError(f"Candidates.logprobs must be a float tensor, got {self.logprobs.dtype}")
        if self.logprobs.device != self.ids.device:
            raise ValueError("Candidates.ids and Candidates.logprobs must be on the same device")

    @property
    def num_rows(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        """``K``, the padded number of candidates per row."""
        return self.ids.shape[1]

    @property
    def valid(self) -> Tensor:
        """``[N, K]`` bool, True on real (non-padding) entries."""
        return self.ids >= 0

    @classmethod
    def from_csr(
        cls, ids: Tensor, offsets: Tensor, logprobs: Tensor, kind: Kind = "head", width: int | None = None
    ) -> "Candidates":
        """Build the padded record from a CSR one.

        Args:
            ids: ``[nnz]`` int token ids, row ``t`` owning ``ids[offsets[t]:offsets[t + 1]]``.
            offsets: ``[N + 1]`` int, non-decreasing, ``offsets[0] == 0`` and ``offsets[-1] == nnz``.
            logprobs: ``[nnz]`` float sampler log-probabilities.
            kind: ``"head"`` or ``"support"``.
            width: pad to this ``K``; default the longest row. A row longer than ``width`` is an error (nothing
                is ever truncated).
        """
        for name, x, want in (("ids", ids, "int"), ("offsets", offsets, "int"), ("logprobs", logprobs, "float")):
            if not isinstance(x, Tensor):
                raise TypeError(f"from_csr: {name} must be a torch.Tensor, got {type(x).__name__}")
            if want == "int" and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
                raise TypeError(f"from_csr: {name} must be an integer tensor, got {x.dtype}")
            if want == "float" and not x.is_floating_point():
                raise TypeError(f"from_csr: {name} must be a floating-point tensor, got {x.dtype}")
        if ids.dim() != 1 or logprobs.dim() != 1 or offsets.dim() != 1:
            raise ValueError("from_csr: ids, offsets and logprobs must be 1-D")
        if ids.shape != logprobs.shape:
            raise ValueError(f"from_csr: ids {tuple(ids.shape)} and logprobs {tuple(logprobs.shape)} differ")
        if offsets.numel() == 0:
            raise ValueError("from_csr: offsets must hold N + 1 >= 1 entries")
        offsets = offsets.to(torch.int64)
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
            raise ValueError(
                f"from_csr: offsets must start at 0 and end at nnz={ids.numel()}, "
                f"got {int(offsets[0])} and {int(offsets[-1])}"
            )
        lengths = offsets[1:] - offsets[:-1]
        if bool((lengths < 0).any()):
            raise ValueError("from_csr: offsets must be non-decreasing")
        n = lengths.numel()
        longest = int(lengths.max()) if n else 0
        k = longest if width is None else width
        if longest > k:
            raise ValueError(f"from_csr: a row holds {longest} candidates, more than width={k}")
        row = torch.repeat_interleave(torch.arange(n, device=ids.device), lengths.to(ids.device))
        col = torch.arange(ids.numel(), device=ids.device) - offsets[:-1].to(ids.device)[row]
        padded_ids = torch.full((n, k), -1, dtype=torch.int64, device=ids.device)
        padded_lp = torch.full((n, k), float("-inf"), dtype=logprobs.dtype, device=ids.device)
        padded_ids[row, col] = ids.to(torch.int64)
        padded_lp[row, col] = logprobs
        return cls(padded_ids, padded_lp, kind)

    def validate(self, vocab_size: int | None, num_rows: int, tokens: Tensor | None = None,
                 loss_mask: Tensor | None = None) -> None:
        """Check the record against the batch; raise ``ValueError`` naming what is wrong.

        Checks on every row (the loss reads every row's entries): row count, ids in ``[-1, vocab_size)``, no
        duplicate id within a row, no NaN or ``+inf`` log-probability, ``-inf`` at padding. Checks on trained rows
        only (``loss_mask [N]`` bool, None: all; untrained rows such as post-EOS padding may hold placeholders):
        a log-probability above 0, for ``kind="support"`` that each non-empty row sums to one within
        :func:`support_sum_tolerance` (scaled by the dtype's rounding) and contains the sampled token, for
        ``kind="head"`` that a row's mass is at most 1 within the same tolerance.
        """
        ids, lp = self.ids, self.logprobs
        if ids.shape[0] != num_rows:
            raise ValueError(f"candidates: expected {num_rows} rows (one per token), got {ids.shape[0]}")
        if ids.numel() == 0:
            return
        valid = ids >= 0
        trained = (torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device) if loss_mask is None
                   else loss_mask.to(device=ids.device, dtype=torch.bool))
        if bool((ids < -1).any()):
            raise ValueError("candidates.ids: padding must be -1; found ids below -1")
        if vocab_size is not None and bool((ids >= vocab_size).any()):
            bad = int(ids.max())
            raise ValueError(f"candidates.ids: id {bad} is out of range for vocabulary size {vocab_size}")
        if bool(torch.isnan(lp).any()):
            raise ValueError("candidates.logprobs: NaN found")
        if bool((lp == float("inf")).any()):
            raise ValueError("candidates.logprobs: +inf found (log-probabilities are <= 0)")
        if bool((lp[valid & trained[:, None]] > 1e-4).any()):
            raise ValueError("candidates.logprobs: a log-probability above 0 found (probabilities are <= 1)")
        if bool(((~valid) & (lp != float("-inf"))).any()):
            raise ValueError("candidates.logprobs: padding entries (ids == -1) must hold -inf")
        row = first_duplicate_row(ids)
        if row is not None:
            raise ValueError(f"candidates.ids: duplicate id within row {row}")
        if self.kind == "support":
            nonempty = valid.any(dim=1) & trained
            sums = torch.exp(lp.double()).sum(dim=1)
            tol = support_sum_tolerance(lp)
            off = nonempty & ((sums - 1.0).abs() > tol)
            if bool(off.any()):
                row = int(off.nonzero()[0])
                raise ValueError(
                    f"candidates: kind='support' rows must sum to 1 (+-{float(tol[row]):.2g} for {lp.dtype}); row "
                    f"{row} sums to {float(sums[row]):.6f}. Were the sampler log-probabilities renormalised over "
                    "the support?"
                )
            if tokens is not None:
                inside = ((ids == tokens.to(ids.dtype)[:, None]) & valid).any(dim=1)
                outside = nonempty & ~inside
                if bool(outside.any()):
                    row = int(outside.nonzero()[0])
                    raise ValueError(
                        f"candidates: the sampled token of row {row} (id {int(tokens[row])}) is outside its "
                        "recorded support"
                    )
        else:
            # The support rows' tolerance: a bf16 head that holds nearly all the mass rounds above 1 honestly.
            mass = torch.exp(lp.double()).sum(dim=1)
            over = (mass > 1.0 + support_sum_tolerance(lp)) & trained
            if bool(over.any()):
                row = int(over.nonzero()[0])
                raise ValueError(
                    f"candidates: kind='head' row {row} has sampler mass {float(mass[row]):.6f} > 1. Head records "
                    "hold full-vocabulary probabilities; a renormalised top-p/top-k record is kind='support'."
                )
