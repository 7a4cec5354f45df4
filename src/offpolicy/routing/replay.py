"""Routing replay (R3) for plain PyTorch trainers: force a sampler's recorded top-k onto a transformers MoE model.

    from offpolicy.routing import replay_routes
    with replay_routes(model, routes, pad_mask=~attention_mask.bool()):
        logits = model(input_ids, attention_mask=attention_mask).logits   # the sampler's experts, the trainer's weights

Which experts run comes from ``routes``; how much each contributes comes from the trainer's own router: the weights
are recomputed from the trainer's router logits ``z = x W_gate^T`` over the replayed experts,

    w_k = softmax(z)[id_k]                                  (softmax over all E experts, in float32)
    w_k = w_k / sum_j w_k[id_j]   if the router's norm_topk_prob (= softmax over the replayed set's logits alone)

cast to the logits' dtype, exactly as the model computes its own top-k weights. So replaying the model's own routes
reproduces its forward bit for bit, and gradients flow to the router weights through ``w`` (the ids are constants).
The routes are the sampler's *ids only*: a sampler's weights are never replayed (that is the "replayed ids with
recomputed weights" convention of verl / slime / Megatron R3).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from offpolicy.records.routed_experts import RoutedExperts
from offpolicy.routing.capture import MoeLayer, moe_layers

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_routes(layers: list[MoeLayer], routes: Tensor, pad_mask: Tensor | None,
                 who: str = "replay_routes") -> tuple[Tensor, Tensor | None]:
    """Validate ``routes`` (``[B, T, L, K]`` or ``[T, L, K]``, integer) and ``pad_mask`` (bool ``[B, T]`` or ``[T]``,
    True on padded positions) against the model's routed ``layers``; return them as int64 ``[B, T, L, K]`` and bool
    ``[B, T]`` (or None). Ids at padded positions are not checked (they are never used). Raises ``ValueError`` /
    ``TypeError`` naming the argument."""
    if not isinstance(routes, Tensor):
        raise TypeError(f"{who}: routes must be a torch.Tensor of expert ids, got {type(routes).__name__}")
    if routes.dtype not in _INT_DTYPES:
        raise TypeError(f"{who}: routes must hold integer expert ids, got dtype {routes.dtype}")
    if routes.dim() == 3:
        routes = routes.unsqueeze(0)
        if pad_mask is not None and isinstance(pad_mask, Tensor) and pad_mask.dim() == 1:
            pad_mask = pad_mask.unsqueeze(0)
    if routes.dim() != 4:
        raise ValueError(f"{who}: routes must be [B, T, L, K] (or [T, L, K]), got shape {tuple(routes.shape)}")
    b, t, n_layers, k = routes.shape
    if n_layers != len(layers):
        raise ValueError(f"{who}: routes has L={n_layers} routed layers (dim 2), the model has {len(layers)} "
                         f"(decoder layers {[m.decoder_layer for m in layers]})")
    top_k = {m.router.top_k for m in layers}
    if top_k != {k}:
        raise ValueError(f"{who}: routes has K={k} experts per token-layer (dim 3), the model's routers take "
                         f"top_k={sorted(top_k)}")
    if pad_mask is not None:
        if not isinstance(pad_mask, Tensor) or pad_mask.dtype != torch.bool:
            raise TypeError(f"{who}: pad_mask must be a bool tensor (True on padded positions), got "
                            f"{getattr(pad_mask, 'dtype', type(pad_mask).__name__)}")
        if tuple(pad_mask.shape) != (b, t):
            raise ValueError(f"{who}: pad_mask must be [B, T] = {(b, t)} like routes' first two dims, got "
                             f"{tuple(pad_mask.shape)}")
        pad_mask = pad_mask.to(routes.device)
    ids = routes.to(torch.int64)
    live = ~pad_mask if pad_mask is not None else torch.ones(b, t, dtype=torch.bool, device=ids.device)
    for m in layers:
        lay = ids[:, :, m.index][live]                                     # [n_live, K]
        e = m.router.num_experts
        bad = (lay < 0) | (lay >= e)
        if bad.any():
            pos = torch.nonzero(live, as_tuple=False)[bad.any(-1).nonzero()[0, 0]].tolist()
            raise ValueError(f"{who}: routes has expert id {int(lay[bad][0])} out of range [0, {e}) at (batch, "
                             f"token) {tuple(pos)}, layer {m.index}")
        if k > 1:
            srt = lay.sort(dim=-1).values
            dup = (srt[:, 1:] == srt[:, :-1]).any(-1)
            if dup.any():
                row = int(dup.nonzero()[0, 0])
                pos = torch.nonzero(live, as_tuple=False)[row].tolist()
                raise ValueError(f"{who}: routes repeats an expert within one token-layer at (batch, token) "
                                 f"{tuple(pos)}, layer {m.index}: {lay[row].tolist()}")
    return ids, pad_mask


def record_routes(layers: list[MoeLayer], routes: RoutedExperts | Sequence[RoutedExperts], pad_mask: Tensor | None,
                  who: str = "replay_routes") -> tuple[Tensor, Tensor | None]:
    """The hook's tensors from :class:`~offpolicy.records.RoutedExperts`: one record (``T`` rows, ``B = 1``) or a
    list of ``B`` records of equal ``T`` -> ``ids [B, T, L, K]`` (the records' dense ids) and ``pad [B, T]`` bool,
    True where a record's ``valid`` is False, ORed with ``pad_mask`` when given (None when neither pads). A record's
    row ``t`` is forward position ``t`` here. Raises ``ValueError`` naming ``routes`` for an empty list, records of
    unequal length, a CSR record whose top-k varies (no dense form), or ``num_experts`` unlike the model's."""
    recs = [routes] if isinstance(routes, RoutedExperts) else list(routes) if isinstance(routes, (list, tuple)) else []
    if not recs or not all(isinstance(r, RoutedExperts) for r in recs):
        raise TypeError(f"{who}: routes must be a torch.Tensor of expert ids, a RoutedExperts or a non-empty list of "
                        f"them, got {type(routes).__name__}")
    lengths = {r.num_tokens for r in recs}
    if len(lengths) != 1:
        raise ValueError(f"{who}: routes: the {len(recs)} records hold unequal numbers of rows {sorted(lengths)}; "
                         f"replay takes one row per forward position of a [B, T] batch (pad the short ones with "
                         f"valid False)")
    experts = {m.router.num_experts for m in layers}
    dense = []
    for b, r in enumerate(recs):
        if {r.num_experts} != experts:
            raise ValueError(f"{who}: routes[{b}].num_experts={r.num_experts}, the model's routers hold "
                             f"{sorted(experts)} experts")
        try:
            dense.append(r.to_dense() if r.is_csr else r)
        except ValueError as exc:
            raise ValueError(f"{who}: routes[{b}]: {exc}") from None
    ids = torch.stack([r.ids for r in dense])
    pad = torch.stack([~r.token_valid for r in dense]) if any(r.valid is not None for r in dense) else None
    if pad_mask is not None:
        if not isinstance(pad_mask, Tensor) or pad_mask.dtype != torch.bool:
            raise TypeError(f"{who}: pad_mask must be a bool tensor (True on padded positions), got "
                            f"{getattr(pad_mask, 'dtype', type(pad_mask).__name__)}")
        if pad_mask.dim() == 1:
            pad_mask = pad_mask.unsqueeze(0)
        if tuple(pad_mask.shape) != tuple(ids.shape[:2]):
            raise ValueError(f"{who}: pad_mask must be [B, T] = {tuple(ids.shape[:2])} like the records, got "
                             f"{tuple(pad_mask.shape)}")
        pad = pad_mask.to(ids.device) if pad is None else pad | pad_mask.to(ids.device)
    return ids, pad


def replayed_weights(router_logits: Tensor, ids: Tensor, norm_topk_prob: bool) -> Tensor:
    """The router weights of replayed experts: ``softmax(router_logits)`` (float32, over all experts) gathered at
    ``ids`` ``[N, K]``, renormalised over the K when ``norm_topk_prob``, cast to ``router_logits``' dtype.
    ``router_logits`` ``[N, E]``; differentiable in it."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    w = probs.gather(-1, ids)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(router_logits.dtype)


@contextmanager
def replay_routes(model: nn.Module, routes: Tensor | RoutedExperts | Sequence[RoutedExperts],
                  pad_mask: Tensor | None = None):
    """Force ``routes`` onto ``model``'s routers for every forward inside the ``with`` block (teacher-forced scoring).

    Args:
        model: a transformers MoE model (Qwen3-MoE; also Qwen2-MoE, OLMoE: see
            :data:`~offpolicy.routing.capture.SUPPORTED_ROUTERS`), eager (``torch.compile`` off; a compiled module is
            refused with ``TypeError``).
        routes: expert ids, integer ``[B, T, L, K]`` (or ``[T, L, K]`` for ``B = 1``): ``L`` the model's routed
            layers in order (:func:`~offpolicy.routing.capture.moe_layers`), ``K`` its top-k. Any integer dtype
            (uint8 as recorded). Ids must be in ``[0, E)`` and distinct within a token-layer at every unpadded
            position. The order of the K slots does not change the result beyond float rounding of the sum.
            Or a :class:`~offpolicy.records.RoutedExperts` (``T`` rows, one per forward position: ``B = 1``) or a
            list of ``B`` of them with equal ``T`` (dense, or CSR with a fixed top-k); their ``num_experts`` must be
            the model's, and a token whose ``valid`` is False is padding (the model routes it itself), as with
            ``pad_mask``. Here row ``t`` is forward position ``t`` (:meth:`CapturedRoutes.to_records` gives such
            records); a sampled-token record (row = the token's ``col - 1``) covers only the positions that
            predicted sampled tokens, so a full forward needs the prompt's rows too.
        pad_mask: optional bool ``[B, T]`` (or ``[T]``), True on padded positions: there the model keeps its own
            routing and ``routes`` is ignored (stale or garbage ids on padded rows are harmless). Without it every
            position is replayed. With records it is ORed with their padding (``valid`` False).

    Each forward of the model inside the block must score exactly the ``B x T`` token rows of ``routes`` (a full,
    teacher-forced forward of the batch the routes belong to); a router seeing another number of rows raises
    ``ValueError`` naming ``routes``. The weights are recomputed from the trainer's router logits over the replayed
    experts (softmax over all experts gathered at the replayed ids, renormalised over them when the router's
    ``norm_topk_prob``; see the module docstring), so gradients reach the router weights. On exit, normal or by an
    exception, the hooks are removed and the model routes by itself again.
    """
    layers = moe_layers(model, "replay_routes")
    if not isinstance(routes, Tensor):
        routes, pad_mask = record_routes(layers, routes, pad_mask)
    ids, pad = check_routes(layers, routes, pad_mask)
    b, t = ids.shape[:2]
    handles = []
    for m in layers:
        def hook(_mod, _args, out, m=m):
            logits, scores, natural = out
            n = logits.shape[0]
            if n != b * t:
                raise ValueError(f"replay_routes: routes cover B x T = {b} x {t} = {b * t} token rows, but the "
                                 f"router of layer {m.index} ({m.name}) saw {n}: replay needs a full forward of the "
                                 f"batch the routes belong to (no KV-cache decode steps)")
            lay = ids[:, :, m.index].reshape(n, -1).to(logits.device)
            if pad is not None:
                keep = pad.reshape(n, 1).to(logits.device)
                lay = torch.where(keep, natural, lay)
            w = replayed_weights(logits, lay, m.router.norm_topk_prob)
            if pad is not None:
                w = torch.where(keep, scores, w)
            return logits, w, lay

        handles.append(m.router.register_forward_hook(hook))
    try:
        yield layers
    finally:
        for h in handles:
            h.remove()
