"""Find the routers of a transformers mixture-of-experts model and record the routing it chooses.

Layout of routes everywhere in :mod:`offpolicy.routing`: expert ids as an integer tensor ``[B, T, L, K]`` (or
``[T, L, K]`` for one sequence), where ``L`` counts the model's *routed* (sparse MoE) layers in the order they run
(dense layers, e.g. Qwen3-MoE's ``mlp_only_layers``, have no entry; :func:`moe_layers` maps the ``L`` axis to decoder
layer indices) and ``K`` is the router's top-k, slot ``k`` being the router's ``k``-th choice (descending weight).

Supported routers (transformers >= 5, whose router modules return ``(router_logits, weights, ids)``):
``Qwen3MoeTopKRouter`` (Qwen3-MoE, tested), ``Qwen2MoeTopKRouter`` and ``OlmoeTopKRouter`` (the same router code,
tested for exact replay). Everything here runs with ``torch.compile`` off (eager forward hooks); a compiled module
is refused.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from offpolicy.records.routed_experts import RoutedExperts

#: Router classes whose forward is ``softmax(x W^T) -> top-k -> (optional) renormalise``, by class name.
SUPPORTED_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter")


@dataclass(frozen=True)
class MoeLayer:
    """One routed layer: its position ``index`` on the routes' ``L`` axis, the decoder layer it sits in (``-1``
    when the module name carries no ``layers.<n>``), the sparse block (``block``, input ``[B, T, H]``) and its router
    (``router``, attributes ``top_k``, ``num_experts``, ``norm_topk_prob``)."""

    index: int
    decoder_layer: int
    name: str
    block: nn.Module
    router: nn.Module


def _check_model(model: object, who: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be a torch.nn.Module (a transformers MoE model), got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule":
        raise TypeError(f"{who}: model is a torch.compile'd module; the routing hooks run eagerly (torch.compile "
                        f"off): pass the uncompiled model (model._orig_mod)")


def moe_layers(model: nn.Module, who: str = "moe_layers") -> list[MoeLayer]:
    """The routed layers of ``model`` in execution (module) order; raises ``ValueError`` naming ``model`` when it
    has none of the :data:`SUPPORTED_ROUTERS`."""
    _check_model(model, who)
    blocks = dict(model.named_modules())
    found: list[MoeLayer] = []
    unsupported = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls.endswith("TopKRouter") and cls not in SUPPORTED_ROUTERS:
            unsupported.add(cls)
        if cls not in SUPPORTED_ROUTERS:
            continue
        parent_name = name.rpartition(".")[0]
        parent = blocks.get(parent_name)
        if parent is None or getattr(parent, "gate", None) is not module:
            raise ValueError(f"{who}: router {name!r} is not the `gate` of its parent block; unsupported layout")
        parts = name.split(".")
        dec = next((int(parts[i + 1]) for i in range(len(parts) - 1)
                    if parts[i] == "layers" and parts[i + 1].isdigit()), -1)
        found.append(MoeLayer(len(found), dec, parent_name, parent, module))
    if not found:
        extra = f" (found unsupported routers {sorted(unsupported)})" if unsupported else ""
        raise ValueError(f"{who}: model has no supported MoE router ({', '.join(SUPPORTED_ROUTERS)}){extra}")
    return found


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds ids ``0 .. num_experts - 1``: uint8 up to 256 experts, else int16,
    else int32."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


@dataclass
class CapturedRoutes:
    """What :func:`capture_routes` recorded; read it after the ``with`` block.

    Attributes:
        layers: the routed layers (see :func:`moe_layers`).
        routes: expert ids ``[B, T, L, K]`` in :func:`route_dtype` (uint8 up to 256 experts), slot order as the
            router chose (descending weight). Several forwards inside one ``with`` are concatenated along ``T`` (a
            prefill then one-token decode steps with a KV cache give the routes of the whole sequence); they must
            share ``B``. Padded positions carry whatever the model computed there (mask them with your padding mask).
        weights: the router weights the experts used, float32 ``[B, T, L, K]``, aligned with ``routes``.

    :meth:`to_records` gives them as :class:`~offpolicy.records.RoutedExperts` (one per row, padding as ``valid``).
    """

    layers: list[MoeLayer]
    _ids: list[list[Tensor]] = field(default_factory=list, repr=False)
    _w: list[list[Tensor]] = field(default_factory=list, repr=False)
    _shape: list[list[tuple[int, int]]] = field(default_factory=list, repr=False)
    routes: Tensor | None = None
    weights: Tensor | None = None

    def _finish(self) -> None:
        calls = {len(x) for x in self._ids}
        if calls == {0}:
            raise RuntimeError("capture_routes: no forward ran through the model's routed layers inside the `with`")
        if len(calls) != 1:
            raise RuntimeError(f"capture_routes: the routed layers ran unequal numbers of times {sorted(calls)}")
        batches = {b for shapes in self._shape for b, _ in shapes}
        if len(batches) != 1:
            raise RuntimeError(f"capture_routes: forwards with different batch sizes {sorted(batches)} cannot be "
                               f"concatenated along T; use one `with` per batch")
        (b,) = batches
        ids, ws = [], []
        for layer_ids, layer_w, shapes in zip(self._ids, self._w, self._shape):
            ids.append(torch.cat([x.reshape(b, t, -1) for x, (_, t) in zip(layer_ids, shapes)], dim=1))
            ws.append(torch.cat([x.reshape(b, t, -1) for x, (_, t) in zip(layer_w, shapes)], dim=1))
        e = self.layers[0].router.num_experts
        self.routes = torch.stack(ids, dim=2).to(route_dtype(e))
        self.weights = torch.stack(ws, dim=2).float()

    def to_records(self, pad_mask: Tensor | None = None) -> list[RoutedExperts]:
        """The capture as :class:`~offpolicy.records.RoutedExperts`, one per batch row: ``ids [T, L, K]`` (row
        ``t`` = forward position ``t``), the router ``weights`` and ``valid = ~pad_mask[b]``; padded positions hold
        the record's fill (ids and weights 0), never the routes the model computed there.

        Args:
            pad_mask: optional bool ``[B, T]`` (or ``[T]`` for ``B = 1``), True on padded positions (e.g.
                ``~attention_mask.bool()``); None: every position carries a route (``valid`` None).

        Raises ``RuntimeError`` before the ``with`` block has exited, ``ValueError`` naming ``pad_mask`` for a bad
        mask or ``num_experts`` beyond a record's ``int16`` ids."""
        if self.routes is None or self.weights is None:
            raise RuntimeError("CapturedRoutes.to_records: read it after the `with capture_routes(...)` block")
        b, t = self.routes.shape[:2]
        if pad_mask is not None:
            if not isinstance(pad_mask, Tensor) or pad_mask.dtype != torch.bool:
                raise ValueError(f"CapturedRoutes.to_records: pad_mask must be a bool tensor, got "
                                 f"{getattr(pad_mask, 'dtype', type(pad_mask).__name__)}")
            pad_mask = pad_mask.reshape(1, -1) if pad_mask.dim() == 1 else pad_mask
            if tuple(pad_mask.shape) != (b, t):
                raise ValueError(f"CapturedRoutes.to_records: pad_mask must be [B, T] = {(b, t)} like the "
                                 f"captured routes, got {tuple(pad_mask.shape)}")
            pad_mask = pad_mask.cpu()
        e = self.layers[0].router.num_experts
        out = []
        for i in range(b):
            ids, w = self.routes[i].to(torch.int64), self.weights[i]
            valid = None
            if pad_mask is not None:
                valid = ~pad_mask[i]
                ids = torch.where(valid[:, None, None], ids, 0)
                w = torch.where(valid[:, None, None], w, 0.0)
            out.append(RoutedExperts.from_ids(ids, e, weights=w, valid=valid))
        return out


@contextmanager
def capture_routes(model: nn.Module):
    """Record the routing ``model`` chooses during the forwards run inside the ``with`` block.

        with capture_routes(model) as cap:
            model(input_ids, attention_mask=mask)
        cap.routes    # [B, T, L, K] uint8 expert ids; cap.weights: [B, T, L, K] float32

    Args:
        model: a transformers MoE model with :data:`SUPPORTED_ROUTERS` (eager; not ``torch.compile``'d).

    Yields:
        a :class:`CapturedRoutes`, filled when the block exits normally. The hooks are removed on exit, also on an
        exception. The model's outputs are untouched (the hooks only read).
    """
    layers = moe_layers(model, "capture_routes")
    cap = CapturedRoutes(layers, [[] for _ in layers], [[] for _ in layers], [[] for _ in layers])
    handles = []
    for layer in layers:
        def pre(_mod, args, kwargs, i=layer.index):
            x = args[0] if args else kwargs["hidden_states"]
            cap._shape[i].append((int(x.shape[0]), int(x.shape[1])) if x.dim() == 3 else (1, int(x.shape[0])))

        def post(_mod, _args, out, i=layer.index):
            cap._ids[i].append(out[2].detach().to("cpu", torch.int64))
            cap._w[i].append(out[1].detach().to("cpu", torch.float32))

        handles.append(layer.block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.router.register_forward_hook(post))
    try:
        yield cap
    finally:
        for h in handles:
            h.remove()
    cap._finish()
