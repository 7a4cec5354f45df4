"""Normalisation nodes: divide the kept weights by a batch mean (and the centering coefficients alike, so drift
stays zero), docs/spec.md#batch-normalization.

``fast(w [N], sel [N] bool, seg) -> (numerator, denominator)``: scalars whose ratio is the mean to divide by; the
pipeline all-reduces both over the context-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

import torch
from torch import Tensor

from offpolicy.corrections.node import Keyword


@dataclass(frozen=True)
class TokenMean:
    """The mean weight over the batch's kept trained tokens (``batch_normalize=True`` or ``"tokens"``)."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`batch_normalize=True` or `"tokens"`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = ''

    name: ClassVar[str] = "tokens"
    needs_sequences: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#batch-normalization"
    source: ClassVar[str] = "the mean weight over the batch's kept trained tokens (self-normalised IS)"

    def fast(self, w: Tensor, sel: Tensor, seg) -> tuple[Tensor, Tensor]:
        return torch.where(sel, w, torch.zeros_like(w)).sum(), sel.sum().to(w.dtype)


@dataclass(frozen=True)
class SequenceMean:
    """The mean over sequences of each sequence's mean kept weight (``batch_normalize="sequences"``; needs
    ``seq_ids``)."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`batch_normalize="sequences"`'
    inputs: ClassVar[tuple[str, ...]] = ('seq_ids',)
    table_traits: ClassVar[str] = '`needs_sequences`'

    name: ClassVar[str] = "sequences"
    needs_sequences: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#batch-normalization"
    source: ClassVar[str] = ("verl's sequence-level batch normalisation (one weight per sequence at the sequence "
                             "levels)")

    def fast(self, w: Tensor, sel: Tensor, seg) -> tuple[Tensor, Tensor]:
        # Under a context-parallel group the per-sequence sums are already global; the pipeline's extra sum over
        # the group scales numerator and denominator alike.
        kept_w = seg.sum(torch.where(sel, w, torch.zeros_like(w)))
        count = seg.sum(sel.to(w.dtype))
        has = count > 0
        means = torch.where(has, kept_w / count.clamp_min(1), torch.zeros_like(kept_w))
        return means.sum(), has.sum().to(w.dtype)


Normalisation = Union[TokenMean, SequenceMean]
NORMALISATION_CLASSES: tuple[type, ...] = (TokenMean, SequenceMean)
