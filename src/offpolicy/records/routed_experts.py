"""The routing record of a mixture-of-experts sampler: which experts each sampled token went through, per MoE layer.

``RoutedExperts`` holds, for each of ``T`` tokens and each of ``L`` MoE layers, the set of expert ids the router
picked (docs/routing.md). Row ``t`` is the routing of the forward position whose logits predicted token ``t`` (the
position :meth:`~offpolicy.records.TokenBatch.gather` reads, ``col - 1``): the same alignment as the token's
log-probability. Two layouts:

* dense, ``ids [T, L, K]``: a fixed top-``K`` router (Qwen3-MoE, DeepSeek-V3, Mixtral);
* CSR, ``ids [nnz]`` with ``offsets [T L + 1]`` over the ``(token, layer)`` rows in row-major order (row ``t L + l``
  owns ``ids[offsets[t L + l]:offsets[t L + l + 1]]``): a router whose top-``k`` varies per token or layer.

Ids are stored in the smallest integer dtype that holds every expert: ``uint8`` up to 256 experts, ``int16`` up to
32768 (:func:`expert_dtype`). A dense record costs ``L K`` bytes per token at ``uint8``: Qwen3.6-35B-A3B (40 MoE
layers, top-8 of 256 experts) is ``40 x 8 = 320`` bytes per token (:attr:`RoutedExperts.nbytes`), plus ``2 L K``
with bf16 router weights. A CSR record costs ``nnz`` id bytes (``2 nnz`` at ``int16``) and ``8 (T L + 1)`` offset
bytes.

Padding is declared, never guessed: ``valid [T]`` bool marks the tokens that carry a route (None: all). A padded
token (``valid`` False) holds the fill ``0`` in every slot of the dense layout (weights ``0``) and empty rows in
the CSR layout; a padded token that carries anything else is refused as a stale route (engines that reuse a
routing buffer return the previous request's routes on padded rows). Every other check runs at construction too
(docs/routing.md#checks), each error naming the field: ids in ``[0, num_experts)``, no expert twice within a
token-layer, no token-layer without a route (a missing layer), offsets that start at 0, end at ``nnz`` and never
decrease, router weights finite and non-negative. The value checks read the values: no cost on CPU, a few host
syncs for a CUDA record; they are skipped where there are no values (meta device, fake tensors, tracing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.records.candidates import has_values

#: the value a padded token holds in every slot of the dense layout
PAD_FILL = 0
#: the most experts a record holds (``int16`` ids)
MAX_EXPERTS = 32768
#: :func:`route_shift`: a neighbour's flip rate must be below the own one by this factor to name a shift ...
SHIFT_RATIO = 3.0
#: ... and the own flip rate (flipped layers over compared layers) above this
SHIFT_MIN_RATE = 0.05


def expert_dtype(num_experts: int) -> torch.dtype:
    """The id dtype of a record over ``num_experts`` experts: ``torch.uint8`` up to 256, ``torch.int16`` up to
    :data:`MAX_EXPERTS`."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"RoutedExperts.num_experts must be an integer >= 1, got {num_experts!r}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"RoutedExperts.num_experts={num_experts} exceeds {MAX_EXPERTS} (int16 expert ids)")
    return torch.uint8 if num_experts <= 256 else torch.int16


def _is_int(x: Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


@dataclass(frozen=True)
class RoutedExperts:
    """Expert ids per token, MoE layer and slot (see the module docstring).

    Attributes:
        ids: dense ``[T, L, K]`` or CSR ``[nnz]``, dtype :func:`expert_dtype` of ``num_experts`` (``uint8`` up to
            256 experts, else ``int16``); build from wider integers with :meth:`from_ids` / :meth:`from_csr`,
            which check the range before narrowing.
        num_experts: ``E``, the routed experts per layer; ids lie in ``[0, E)``.
        offsets: CSR only: ``[T L + 1]`` int32/int64 row starts of the ``(token, layer)`` rows; None: dense.
        num_layers: ``L``; required for the CSR layout, checked against ``ids.shape[1]`` when given for the dense
            one (filled from it when not).
        weights: optional router weights, float, the shape of ``ids`` (``0`` on padded tokens).
        valid: optional ``[T]`` bool, False on padded tokens (no route); None: every token carries one.
    """

    ids: Tensor
    num_experts: int
    offsets: Tensor | None = None
    num_layers: int | None = None
    weights: Tensor | None = None
    valid: Tensor | None = None

    def __post_init__(self) -> None:
        dtype = expert_dtype(self.num_experts)
        if not isinstance(self.ids, Tensor):
            raise TypeError(f"RoutedExperts.ids must be a torch.Tensor, got {type(self.ids).__name__}")
        if self.ids.dtype != dtype:
            raise TypeError(
                f"RoutedExperts.ids must be {dtype} for num_experts={self.num_experts} (uint8 up to 256 experts, "
                f"int16 up to {MAX_EXPERTS}), got {self.ids.dtype}: build the record with RoutedExperts.from_ids / "
                "from_csr, which check the range before narrowing"
            )
        dev = self.ids.device
        if self.offsets is None:
            if self.ids.dim() != 3:
                raise ValueError(f"RoutedExperts.ids must be [T, L, K] (dense) or [nnz] with offsets (CSR), got "
                                 f"shape {tuple(self.ids.shape)}")
            layers = self.ids.shape[1]
            if self.num_layers is not None and self._layers_arg() != layers:
                raise ValueError(f"RoutedExperts.ids holds {layers} layers, num_layers={self.num_layers} declared: "
                                 f"{'layers missing' if layers < self.num_layers else 'extra layers'} "
                                 "(a dense layer recorded, or MoE layers dropped?)")
            if self.ids.shape[2] < 1:
                raise ValueError("RoutedExperts.ids must hold K >= 1 slots per token-layer")
            object.__setattr__(self, "num_layers", layers)
        else:
            if not isinstance(self.offsets, Tensor):
                raise TypeError(f"RoutedExperts.offsets must be a torch.Tensor, got {type(self.offsets).__name__}")
            if self.ids.dim() != 1:
                raise ValueError(f"RoutedExperts.ids must be 1-D [nnz] with offsets (CSR), got {tuple(self.ids.shape)}")
            if self.offsets.dim() != 1 or self.offsets.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"RoutedExperts.offsets must be a 1-D int32/int64 tensor [T L + 1], got "
                                f"{self.offsets.dtype} of shape {tuple(self.offsets.shape)}")
            if self.offsets.device != dev:
                raise ValueError(f"RoutedExperts.offsets is on {self.offsets.device}, ids on {dev}")
            if self.num_layers is None:
                raise ValueError("RoutedExperts.num_layers is required with offsets (CSR): the rows are (token, "
                                 "layer) pairs")
            layers = self._layers_arg()
            rows = self.offsets.numel() - 1
            if rows < 0 or rows % layers:
                raise ValueError(f"RoutedExperts.offsets must hold T * num_layers + 1 entries (num_layers={layers}), "
                                 f"got {self.offsets.numel()}: a layer is missing from some token")
        t = self.num_tokens
        if self.valid is not None:
            if not isinstance(self.valid, Tensor) or self.valid.dtype != torch.bool or self.valid.shape != (t,):
                got = (f"{self.valid.dtype} of shape {tuple(self.valid.shape)}" if isinstance(self.valid, Tensor)
                       else type(self.valid).__name__)
                raise ValueError(f"RoutedExperts.valid must be a bool tensor [T] = [{t}], got {got}")
            if self.valid.device != dev:
                raise ValueError(f"RoutedExperts.valid is on {self.valid.device}, ids on {dev}")
        if self.weights is not None:
            if not isinstance(self.weights, Tensor) or not self.weights.is_floating_point():
                got = self.weights.dtype if isinstance(self.weights, Tensor) else type(self.weights).__name__
                raise TypeError(f"RoutedExperts.weights must be a float tensor, got {got}")
            if self.weights.shape != self.ids.shape:
                raise ValueError(f"RoutedExperts.weights must have the shape of ids {tuple(self.ids.shape)}, got "
                                 f"{tuple(self.weights.shape)}")
            if self.weights.device != dev:
                raise ValueError(f"RoutedExperts.weights is on {self.weights.device}, ids on {dev}")
        if has_values(self.ids):
            self.check_values()

    def _layers_arg(self) -> int:
        n = self.num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"RoutedExperts.num_layers must be an integer >= 1, got {n!r}")
        return n

    # ------------------------------------------------------------------------------------------------ shape
    @property
    def is_csr(self) -> bool:
        return self.offsets is not None

    @property
    def num_tokens(self) -> int:
        """``T``, the tokens the record covers (one row per token)."""
        if self.offsets is None:
            return self.ids.shape[0]
        return (self.offsets.numel() - 1) // int(self.num_layers)

    @property
    def top_k(self) -> int | None:
        """``K`` of the dense layout; None for CSR (it varies)."""
        return None if self.offsets is not None else self.ids.shape[2]

    @property
    def token_valid(self) -> Tensor:
        """``[T]`` bool, True on tokens that carry a route."""
        if self.valid is not None:
            return self.valid
        return torch.ones(self.num_tokens, dtype=torch.bool, device=self.ids.device)

    @property
    def lengths(self) -> Tensor:
        """``[T, L]`` int64 experts per token-layer (``0`` on padded tokens)."""
        t, layers = self.num_tokens, int(self.num_layers)
        if self.offsets is None:
            k = self.ids.shape[2]
            return torch.where(self.token_valid[:, None], k, 0).expand(t, layers).to(torch.int64)
        off = self.offsets.to(torch.int64)
        return (off[1:] - off[:-1]).view(t, layers)

    @property
    def nbytes(self) -> int:
        """Bytes held by the record's tensors (ids, offsets, weights, valid)."""
        return sum(x.numel() * x.element_size() for x in (self.ids, self.offsets, self.weights, self.valid)
                   if x is not None)

    @property
    def bytes_per_token(self) -> float:
        """:attr:`nbytes` over ``T`` (``L K`` for a dense ``uint8`` record without weights)."""
        return self.nbytes / max(self.num_tokens, 1)

    # ------------------------------------------------------------------------------------------------ checks
    def check_offsets(self) -> None:
        """CSR: raise ``ValueError`` naming ``RoutedExperts.offsets`` unless they start at 0, end at ``nnz`` and
        never decrease."""
        off = self.offsets
        if off is None:
            return
        nnz = self.ids.numel()
        first, last = int(off[0]), int(off[-1])
        if first != 0 or last != nnz:
            raise ValueError(f"RoutedExperts.offsets must start at 0 and end at nnz = {nnz}, got {first} and {last}")
        down = off[1:] < off[:-1]
        if bool(down.any()):
            r = int(down.nonzero()[0])
            raise ValueError(f"RoutedExperts.offsets must be non-decreasing; offsets[{r + 1}] < offsets[{r}] "
                             f"({int(off[r + 1])} < {int(off[r])})")

    def row_index(self) -> Tensor:
        """CSR: ``[nnz]`` int64 ``(token, layer)`` row of each entry (``t L + l``), clamped to the rows (never an
        index out of bounds, even on offsets changed after construction)."""
        n = self.offsets.numel() - 1
        entries = torch.arange(self.ids.numel(), device=self.ids.device, dtype=self.offsets.dtype)
        return torch.searchsorted(self.offsets[1:], entries, right=True).clamp_(max=max(n - 1, 0)).to(torch.int64)

    def check_values(self) -> None:
        """The value checks of the module docstring; ``ValueError`` naming the field, token and layer."""
        self.check_offsets()
        layers, e = int(self.num_layers), self.num_experts
        ids = self.ids.to(torch.int64)
        valid = self.token_valid
        if ids.numel():
            if bool((ids < 0).any()):
                raise ValueError(f"RoutedExperts.ids: expert id {int(ids.min())} is negative (ids lie in [0, {e}); "
                                 "padding is declared with valid=, never with a negative id)")
            if bool((ids >= e).any()):
                raise ValueError(f"RoutedExperts.ids: expert id {int(ids.max())} is out of range for num_experts={e}")
        if self.weights is not None and self.weights.numel():
            w = self.weights
            if not bool(torch.isfinite(w).all()):
                raise ValueError("RoutedExperts.weights: a non-finite router weight (NaN or inf)")
            if bool((w < 0).any()):
                raise ValueError("RoutedExperts.weights: a negative router weight")
        if self.offsets is None:
            self._check_dense(ids, valid)
        else:
            self._check_csr(ids, valid, layers)

    def _check_dense(self, ids: Tensor, valid: Tensor) -> None:
        t, layers, k = ids.shape
        if t == 0:
            return
        pad = ~valid
        stale = pad[:, None, None] & (ids != PAD_FILL)
        if self.weights is not None:
            stale = stale | (pad[:, None, None] & (self.weights != 0))
        if bool(stale.any()):
            tok, lay = (int(i) for i in stale.nonzero()[0][:2])
            raise ValueError(f"RoutedExperts.ids: padded token {tok} (valid=False) carries a route at layer {lay} "
                             f"({ids[tok, lay].tolist()}): padded tokens hold the fill {PAD_FILL} (weights 0); a "
                             "route there is stale (a reused routing buffer, or a mask that does not match the ids)")
        if k >= 2:
            empty = valid[:, None] & (ids == PAD_FILL).all(dim=2)
            if bool(empty.any()):
                tok, lay = (int(i) for i in empty.nonzero()[0])
                raise ValueError(f"RoutedExperts.ids: token {tok} has no route at layer {lay} (every slot holds the "
                                 f"fill {PAD_FILL}): a missing layer (a dense layer recorded among the MoE layers, or "
                                 "a capture that skipped it); pass only the MoE layers, or mark the token valid=False")
        srt = torch.sort(ids, dim=2).values
        dup = (srt[:, :, 1:] == srt[:, :, :-1]).any(dim=2) & valid[:, None]
        if bool(dup.any()):
            tok, lay = (int(i) for i in dup.nonzero()[0])
            raise ValueError(f"RoutedExperts.ids: duplicate expert within token {tok}, layer {lay} "
                             f"({ids[tok, lay].tolist()}): a top-k set holds each expert once")

    def _check_csr(self, ids: Tensor, valid: Tensor, layers: int) -> None:
        lengths = self.lengths
        t = lengths.shape[0]
        if t == 0:
            return
        stale = ~valid[:, None] & (lengths > 0)
        if bool(stale.any()):
            tok, lay = (int(i) for i in stale.nonzero()[0])
            raise ValueError(f"RoutedExperts.ids: padded token {tok} (valid=False) carries {int(lengths[tok, lay])} "
                             f"experts at layer {lay}: padded tokens hold empty rows; a route there is stale")
        empty = valid[:, None] & (lengths == 0)
        if bool(empty.any()):
            tok, lay = (int(i) for i in empty.nonzero()[0])
            raise ValueError(f"RoutedExperts.offsets: token {tok} has no expert at layer {lay}: a missing layer "
                             "(mark the token valid=False if it carries no route)")
        if ids.numel() < 2:
            return
        key = self.row_index() * self.num_experts + ids
        srt = torch.sort(key).values
        dup = srt[1:] == srt[:-1]
        if bool(dup.any()):
            row = int(srt[1:][dup][0]) // self.num_experts
            raise ValueError(f"RoutedExperts.ids: duplicate expert within token {row // layers}, layer "
                             f"{row % layers}: a top-k set holds each expert once")

    def check_aligned(self, num_tokens: int, what: str = "tokens") -> None:
        """Raise ``ValueError`` unless the record holds one row per token of a ``num_tokens`` token record,
        naming the off-by-one that engines' layouts invite."""
        t = self.num_tokens
        if t == num_tokens:
            return
        hint = ""
        if t == num_tokens + 1:
            hint = (" One row too many: engines return one row per forwarded position (prompt + output - 1); row t "
                    "is the position that predicts token t (col - 1). Was the prompt's last position dropped, or "
                    "a trailing row kept?")
        elif t == num_tokens - 1:
            hint = (" One row short: the routes of the last output token's *own* position do not exist (it is "
                    "never forwarded); the rows of the sampled tokens are positions P - 1 .. P + T - 2. Was the "
                    "slice shifted by one?")
        raise ValueError(f"routed_experts: {t} token rows for {num_tokens} {what}: the record must hold one row per "
                         f"token.{hint}")

    # ------------------------------------------------------------------------------------------------ builders
    @classmethod
    def from_ids(cls, ids: Tensor, num_experts: int, *, weights: Tensor | None = None, valid: Tensor | None = None,
                 num_layers: int | None = None) -> "RoutedExperts":
        """A dense record from integer ``ids [T, L, K]`` of any integer dtype: the range is checked on the wide
        values (a ``-1`` or ``300`` is refused, never wrapped into ``uint8``), then the ids are narrowed to
        :func:`expert_dtype`. Padded tokens (``valid`` False) are filled with :data:`PAD_FILL` only when they
        hold ``-1`` everywhere (an engine's sentinel); anything else there is left for the stale-route check."""
        dtype = expert_dtype(num_experts)
        if not isinstance(ids, Tensor) or not _is_int(ids):
            got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
            raise TypeError(f"RoutedExperts.ids must be an integer tensor, got {got}")
        if ids.dim() != 3:
            raise ValueError(f"RoutedExperts.ids must be [T, L, K], got shape {tuple(ids.shape)}")
        wide = ids.to(torch.int64)
        if valid is not None and isinstance(valid, Tensor) and valid.dtype == torch.bool \
                and valid.shape == (ids.shape[0],):
            sentinel = (~valid.to(ids.device))[:, None, None] & (wide == -1).all(dim=2, keepdim=True).all(
                dim=1, keepdim=True)
            wide = torch.where(sentinel, torch.full_like(wide, PAD_FILL), wide)
        _check_range(wide, num_experts, "RoutedExperts.ids")
        return cls(wide.to(dtype), num_experts, num_layers=num_layers, weights=weights, valid=valid)

    @classmethod
    def from_csr(cls, ids: Tensor, offsets: Tensor, num_experts: int, num_layers: int, *,
                 weights: Tensor | None = None, valid: Tensor | None = None) -> "RoutedExperts":
        """A CSR record from integer ``ids [nnz]`` of any integer dtype (range checked before narrowing) and
        ``offsets [T L + 1]``."""
        dtype = expert_dtype(num_experts)
        if not isinstance(ids, Tensor) or not _is_int(ids) or ids.dim() != 1:
            got = f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
            raise TypeError(f"RoutedExperts.ids must be a 1-D integer tensor [nnz], got {got}")
        wide = ids.to(torch.int64)
        _check_range(wide, num_experts, "RoutedExperts.ids")
        return cls(wide.to(dtype), num_experts, offsets=offsets, num_layers=num_layers, weights=weights, valid=valid)

    # ------------------------------------------------------------------------------------------------ layouts
    def to_csr(self) -> "RoutedExperts":
        """The CSR record (padded tokens as empty rows); a CSR record is returned as is."""
        if self.offsets is not None:
            return self
        t, layers, k = self.ids.shape
        keep = self.token_valid[:, None].expand(t, layers)
        lengths = torch.where(keep, k, 0).reshape(-1).to(torch.int64)
        offsets = torch.zeros(t * layers + 1, dtype=torch.int64, device=self.ids.device)
        offsets[1:] = lengths.cumsum(0)
        sel = keep.reshape(-1)
        ids = self.ids.reshape(t * layers, k)[sel].reshape(-1)
        w = None if self.weights is None else self.weights.reshape(t * layers, k)[sel].reshape(-1)
        return RoutedExperts(ids, self.num_experts, offsets=offsets, num_layers=layers, weights=w, valid=self.valid)

    def to_dense(self) -> "RoutedExperts":
        """The dense record; a CSR record converts when every routed token-layer holds the same ``K`` experts
        (``ValueError`` naming ``offsets`` otherwise: a varying top-k has no dense form)."""
        if self.offsets is None:
            return self
        self.check_offsets()
        lengths = self.lengths
        valid = self.token_valid
        ks = torch.unique(lengths[valid])
        if ks.numel() > 1:
            raise ValueError(f"RoutedExperts.offsets: the top-k varies ({ks.tolist()} experts per token-layer): "
                             "only the CSR layout holds it")
        t, layers = lengths.shape
        k = int(ks[0]) if ks.numel() else 1
        ids = torch.full((t, layers, k), PAD_FILL, dtype=self.ids.dtype, device=self.ids.device)
        ids[valid] = self.ids.view(-1, layers, k) if self.ids.numel() else ids[valid]
        w = None
        if self.weights is not None:
            w = torch.zeros((t, layers, k), dtype=self.weights.dtype, device=self.ids.device)
            if self.weights.numel():
                w[valid] = self.weights.view(-1, layers, k)
        return RoutedExperts(ids, self.num_experts, weights=w, valid=self.valid)

    def take_rows(self, index: Tensor) -> "RoutedExperts":
        """The record whose token ``j`` is this record's token ``index[j]`` (``index [M]`` int in ``[0, T)``; rows
        may repeat or be left out). ``ValueError`` naming ``index`` when out of range; the CSR offsets are
        re-checked first, so the copy never reads out of bounds."""
        if not isinstance(index, Tensor) or index.dim() != 1 or not _is_int(index):
            got = f"{index.dtype} of shape {tuple(index.shape)}" if isinstance(index, Tensor) else type(index).__name__
            raise TypeError(f"take_rows: index must be a 1-D integer tensor [M], got {got}")
        index = index.to(device=self.ids.device, dtype=torch.int64)
        t = self.num_tokens
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= t):
            bad = int(index.min()) if int(index.min()) < 0 else int(index.max())
            raise ValueError(f"take_rows: index {bad} is out of range for a record of {t} tokens")
        valid = None if self.valid is None else self.valid[index]
        if self.offsets is None:
            w = None if self.weights is None else self.weights[index]
            return RoutedExperts(self.ids[index], self.num_experts, weights=w, valid=valid)
        self.check_offsets()
        layers = int(self.num_layers)
        rows = (index[:, None] * layers + torch.arange(layers, device=index.device)).reshape(-1)
        off = self.offsets.to(torch.int64)
        lengths = off[1:][rows] - off[:-1][rows]
        offsets = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=self.ids.device)
        offsets[1:] = lengths.cumsum(0)
        nnz = int(offsets[-1])
        shift = off[:-1][rows] - offsets[:-1]
        pos = torch.repeat_interleave(shift, lengths, output_size=nnz) + torch.arange(nnz, device=self.ids.device)
        w = None if self.weights is None else self.weights[pos]
        return RoutedExperts(self.ids[pos], self.num_experts, offsets=offsets, num_layers=layers, weights=w,
                             valid=valid)

    @classmethod
    def cat(cls, records: "list[RoutedExperts]") -> "RoutedExperts":
        """The records' tokens one after another. All share ``num_experts`` and ``num_layers`` and either all or
        none carry weights; dense records of one ``K`` stay dense, anything else becomes CSR."""
        if not records:
            raise ValueError("RoutedExperts.cat: records must be non-empty")
        for i, r in enumerate(records):
            if not isinstance(r, RoutedExperts):
                raise TypeError(f"RoutedExperts.cat: records[{i}] is a {type(r).__name__}, not a RoutedExperts")
        first = records[0]
        for i, r in enumerate(records):
            if r.num_experts != first.num_experts:
                raise ValueError(f"RoutedExperts.cat: records[{i}].num_experts={r.num_experts}, records[0] has "
                                 f"{first.num_experts}")
            if r.num_layers != first.num_layers:
                raise ValueError(f"RoutedExperts.cat: records[{i}].num_layers={r.num_layers}, records[0] has "
                                 f"{first.num_layers}: a layer is missing from one record")
            if (r.weights is None) != (first.weights is None):
                raise ValueError(f"RoutedExperts.cat: records[{i}] {'lacks' if r.weights is None else 'has'} router "
                                 "weights, records[0] does not: all or none")
        valid = None
        if any(r.valid is not None for r in records):
            valid = torch.cat([r.token_valid for r in records])
        if all(r.offsets is None for r in records) and len({r.top_k for r in records}) == 1:
            w = None if first.weights is None else torch.cat([r.weights for r in records])
            return cls(torch.cat([r.ids for r in records]), first.num_experts, weights=w, valid=valid)
        csr = [r.to_csr() for r in records]
        lengths = torch.cat([(c.offsets[1:] - c.offsets[:-1]).to(torch.int64) for c in csr])
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        offsets[1:] = lengths.cumsum(0)
        w = None if first.weights is None else torch.cat([c.weights for c in csr])
        return cls(torch.cat([c.ids for c in csr]), first.num_experts, offsets=offsets, num_layers=first.num_layers,
                   weights=w, valid=valid)


def _check_range(wide: Tensor, num_experts: int, what: str) -> None:
    if wide.numel() == 0 or not has_values(wide):
        return
    lo, hi = int(wide.min()), int(wide.max())
    if lo < 0:
        raise ValueError(f"{what}: expert id {lo} is negative (ids lie in [0, {num_experts}); padding is declared "
                         "with valid=, never with a negative id)")
    if hi >= num_experts:
        raise ValueError(f"{what}: expert id {hi} is out of range for num_experts={num_experts}")


# ---------------------------------------------------------------------------------------------------- agreement
def _entries(r: RoutedExperts) -> tuple[Tensor, Tensor]:
    """``(row [n] int64, id [n] int64)`` of every routed entry (row ``t L + l``); padded tokens hold none."""
    if r.offsets is None:
        t, layers, k = r.ids.shape
        keep = r.token_valid[:, None, None].expand(t, layers, k).reshape(-1)
        row = torch.arange(t * layers, device=r.ids.device).repeat_interleave(k)
        return row[keep], r.ids.reshape(-1).to(torch.int64)[keep]
    r.check_offsets()
    return r.row_index(), r.ids.to(torch.int64)


def layer_flips(sampler: RoutedExperts, trainer: RoutedExperts) -> Tensor:
    """``[T, L]`` bool: the layers where the sampler's expert *set* differs from the trainer's (slot order is
    ignored); False wherever either record marks the token padded. Both records cover the same ``T`` tokens,
    ``L`` layers and ``num_experts`` (``ValueError`` naming the one that differs). ``O(n log n)`` in the routed
    entries ``n``, any mix of dense and CSR layouts."""
    for name, r in (("sampler", sampler), ("trainer", trainer)):
        if not isinstance(r, RoutedExperts):
            raise TypeError(f"{name} must be an offpolicy.RoutedExperts, got {type(r).__name__}")
    if sampler.num_layers != trainer.num_layers:
        raise ValueError(f"trainer routes hold {trainer.num_layers} layers, sampler routes {sampler.num_layers}")
    if sampler.num_experts != trainer.num_experts:
        raise ValueError(f"trainer routes have num_experts={trainer.num_experts}, sampler {sampler.num_experts}")
    trainer.check_aligned(sampler.num_tokens, "sampler tokens")
    t, layers = sampler.num_tokens, int(sampler.num_layers)
    dev = sampler.ids.device
    ra, ia = _entries(sampler)
    rb, ib = _entries(trainer)
    rb, ib = rb.to(dev), ib.to(dev)
    e = sampler.num_experts
    ka, kb = ra * e + ia, rb * e + ib
    common = torch.isin(ka, kb)
    rows = t * layers
    na = torch.bincount(ra, minlength=rows)
    nb = torch.bincount(rb, minlength=rows)
    nc = torch.bincount(ra[common], minlength=rows)
    differ = ((na != nc) | (nb != nc)).view(t, layers)
    both = sampler.token_valid & trainer.token_valid.to(dev)
    return differ & both[:, None]


def route_flips(sampler: RoutedExperts, trainer: RoutedExperts) -> Tensor:
    """``[T]`` int64: per token, the number of MoE layers whose expert sets differ between the sampler's record and
    the trainer's (0 on tokens either marks padded). The input the route-flip rejection reads."""
    return layer_flips(sampler, trainer).sum(dim=1)


def route_shift(sampler: RoutedExperts, trainer: RoutedExperts, seq_ids: Tensor | None = None) -> int:
    """Whether the sampler's routes are shifted by one position against the trainer's: ``0`` (aligned), ``+1``
    (the sampler's row ``t`` matches the trainer's row ``t + 1``: a row of the next position was taken) or ``-1``.

    The test ``offpolicy diagnose`` applies to log-probs (:mod:`offpolicy.diagnose.semantics`), on layers instead:
    over tokens whose neighbour lies in the same sequence (``seq_ids [T]``, None: one sequence), the flip rate of
    each row against its own trainer row and against the neighbour's; a shift is named when the own rate exceeds
    :data:`SHIFT_MIN_RATE` and a neighbour's is below it by the factor :data:`SHIFT_RATIO`. Needs a few tokens
    (at least 3 neighbour pairs; fewer give 0)."""
    trainer.check_aligned(sampler.num_tokens, "sampler tokens")
    t = sampler.num_tokens
    dev = sampler.ids.device
    if t < 4:
        return 0
    seq = torch.zeros(t, dtype=torch.int64, device=dev) if seq_ids is None else seq_ids.to(dev, torch.int64)
    if seq.shape != (t,):
        raise ValueError(f"seq_ids must be [T] = [{t}], got {tuple(seq.shape)}")
    both = sampler.token_valid & trainer.token_valid.to(dev)
    pair = (seq[1:] == seq[:-1]) & both[1:] & both[:-1]
    if int(pair.sum()) < 3:
        return 0
    idx = torch.arange(t - 1, device=dev)[pair]
    layers = int(sampler.num_layers)

    def rate(a: Tensor, b: Tensor) -> float:
        return float(route_flips(sampler.take_rows(a), trainer.take_rows(b)).double().sum()) / (a.numel() * layers)

    own = rate(idx, idx)
    nxt = rate(idx, idx + 1)      # sampler row t holds the trainer's row t + 1
    prv = rate(idx + 1, idx)      # sampler row t + 1 holds the trainer's row t
    if own > SHIFT_MIN_RATE and min(nxt, prv) * SHIFT_RATIO < own:
        return 1 if nxt <= prv else -1
    return 0


def check_route_alignment(sampler: RoutedExperts, trainer: RoutedExperts, seq_ids: Tensor | None = None) -> None:
    """Raise ``ValueError`` naming ``routed_experts`` when :func:`route_shift` finds the sampler's routes shifted
    by one position against the trainer's (and when their token counts differ)."""
    s = route_shift(sampler, trainer, seq_ids)
    if s:
        side = "next" if s > 0 else "previous"
        raise ValueError(f"routed_experts: the sampler's routes match the trainer's routes of the {side} position far "
                         "better than their own: the record is shifted by one position against the tokens (row t "
                         "must be the position that predicts token t, col - 1)")
