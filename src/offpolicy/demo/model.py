"""A tiny causal transformer language model (pre-LayerNorm, learned positions), in plain torch.

The trainer runs it in fp32. A simulated sampler runs a copy of it in its own numerics (see
:mod:`offpolicy.demo.simulated_fleet`): weights fake-quantised on sync, compute in bf16, an FP8 key/value path, and another
attention kernel. All of that is a property of the copy; the module only offers two hooks:

* ``attn_impl``: ``"sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``) or ``"math"`` (an explicit
  softmax(QK^T)V), the same function computed by different kernels;
* ``kv_quant``: a function applied to the keys and values after projection (e.g. an FP8 fake quantiser). Applying it
  in a full forward is exactly what an FP8 KV cache does to every later query.

With ``ModelConfig.n_experts > 0`` every block's MLP is a mixture of experts (:class:`MoE`): a router picks the
top-``top_k`` of ``n_experts`` small GELU MLPs per token, weighted by the router's softmax renormalised over the
chosen ones. The router's weight is a plain parameter (not an ``nn.Linear``), so a sampler's fake quantiser keeps it
as deployments keep their gates (unquantised); its logits are computed in the copy's compute dtype, the softmax in
fp32. Each forward records the routes it used (:attr:`TinyLM.last_routes`, ``[B, T, L, K]`` int64) and the routes
its own router would pick (:attr:`TinyLM.last_natural_routes`); :attr:`TinyLM.replay` forces recorded routes
(routing replay, R3: the sampler's expert ids, the trainer's router weights over them, computed by
:func:`offpolicy.routing.replayed_weights`, the convention of the transformers replay hook).

Below fp32 every matrix product is computed as a GPU's tensor-core GEMM computes it (:func:`gemm`,
:func:`linear`): inputs in the compute dtype, fp32 accumulation, the output rounded once to the compute dtype.
That is also 8x faster here than torch's own bf16 CPU kernels, which lack hardware support on AVX2 and round
differently (the last bf16 bit of 1.6 % of the logits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from offpolicy.routing import replayed_weights

ATTN_IMPLS = ("sdpa", "math")


def gemm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with fp32 accumulation and one rounding to ``a``'s dtype (exactly ``a @ b`` in fp32)."""
    if a.dtype == torch.float32:
        return a @ b
    return (a.float() @ b.float()).to(a.dtype)


def linear(lin: nn.Linear, x: Tensor) -> Tensor:
    """``lin(x)`` with fp32 accumulation, the bias added in fp32 and one rounding to ``x``'s dtype (exactly
    ``lin(x)`` in fp32)."""
    if x.dtype == torch.float32:
        return lin(x)
    bias = lin.bias.float() if lin.bias is not None else None
    return F.linear(x.float(), lin.weight.float(), bias).to(x.dtype)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny transformer."""

    vocab_size: int = 32
    max_len: int = 16
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    #: 0: a dense GELU MLP of width ``d_ff``; > 0: that many experts of width ``d_ff // n_experts`` each.
    n_experts: int = 0
    #: experts per token (MoE only).
    top_k: int = 2

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_experts < 0:
            raise ValueError(f"ModelConfig.n_experts must be >= 0 (0: dense), got {self.n_experts}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"ModelConfig.top_k must lie in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.n_experts and self.d_ff < self.n_experts:
            raise ValueError(f"ModelConfig.d_ff={self.d_ff} must be >= n_experts={self.n_experts}")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def to_dict(self) -> dict:
        # A dense model's dict (and so its warm-up cache key) is the one it had before experts existed.
        d = asdict(self)
        if not self.is_moe:
            del d["n_experts"], d["top_k"]
        return d


class Expert(nn.Module):
    """One expert: a GELU MLP ``d_model -> d_hidden -> d_model``."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return linear(self.fc2, F.gelu(linear(self.fc1, x)))


class MoE(nn.Module):
    """Top-k mixture of experts over ``[N, d_model]`` rows.

    The router's logits ``z = x W^T`` ``[N, E]`` are computed in ``x``'s dtype (fp32 accumulation, one rounding);
    the natural routes are the ``top_k`` largest ``z`` (ties to the lower id); the weights are
    ``softmax(z)`` in fp32 gathered at the routes and renormalised over them, cast to ``x``'s dtype. With
    ``routes`` given, those expert ids are used instead and the weights come from this router's own logits over them.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router_weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        self.experts = nn.ModuleList(Expert(cfg.d_model, cfg.d_ff // cfg.n_experts) for _ in range(cfg.n_experts))

    def forward(self, x: Tensor, routes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``x [N, D]`` -> (``y [N, D]`` in ``x``'s dtype, used ids ``[N, K]`` int64, natural ids ``[N, K]`` int64)."""
        z = gemm(x, self.router_weight.to(x.dtype).t())
        natural = torch.topk(z.float(), self.top_k, dim=-1, sorted=True).indices
        ids = natural if routes is None else routes
        w = replayed_weights(z, ids, norm_topk_prob=True)
        # Dispatch by one stable sort of the (token, slot) pairs by expert: each expert's rows are a contiguous
        # segment in token order, and one index_add adds every token's contributions in increasing expert id.
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // ids.shape[1]
        xs, ws = x[rows], w.reshape(-1)[order].unsqueeze(1)
        outs, start = [], 0
        for n, expert in zip(counts, self.experts):
            if n:
                outs.append(ws[start:start + n] * expert(xs[start:start + n]))
            start += n
        y = torch.zeros_like(x)
        return (y.index_add(0, rows, torch.cat(outs)) if outs else y), ids, natural


class Block(nn.Module):
    """One pre-LN transformer block: causal multi-head self-attention and a GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.is_moe:
            self.moe = MoE(cfg)
        else:
            self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
            self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor, attn_impl: str, kv_quant: Callable[[Tensor], Tensor] | None,
                routes: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``x [B, T, D]`` -> (``x`` after the block, used and natural routes ``[B, T, K]`` or None when dense).
        ``routes [B, T, K]`` int64 forces the MoE's expert ids."""
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = linear(self.qkv, self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        if kv_quant is not None:
            k, v = kv_quant(k), kv_quant(v)
        if attn_impl == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = gemm(q, k.transpose(-1, -2)) / math.sqrt(d // h)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            a = gemm(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
        x = x + linear(self.proj, a.transpose(1, 2).reshape(b, t, d))
        if not hasattr(self, "moe"):
            return x + linear(self.fc2, F.gelu(linear(self.fc1, self.ln2(x)))), None, None
        y, used, natural = self.moe(self.ln2(x).reshape(b * t, d), None if routes is None else routes.reshape(b * t, -1))
        k = used.shape[-1]
        return x + y.view(b, t, d), used.view(b, t, k), natural.view(b, t, k)


class TinyLM(nn.Module):
    """Causal LM: ``forward(ids [B, T] int64) -> logits [B, T, V]`` in the module's dtype.

    Attributes:
        attn_impl: attention kernel, one of :data:`ATTN_IMPLS`.
        kv_quant: optional function applied to keys and values (``[B, H, T, D/H]``) after projection.
        replay: MoE only: None (route by the model's own routers) or ``[B, T, L, K]`` integer expert ids forced
            on every forward (routing replay); the forward's ``ids`` must then be ``[B, T]``.
        last_routes, last_natural_routes: MoE only: the ``[B, T, L, K]`` int64 expert ids the last forward used,
            and those its own routers picked (equal without replay); None for a dense model.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.attn_impl = "sdpa"
        self.kv_quant: Callable[[Tensor], Tensor] | None = None
        self.replay: Tensor | None = None
        self.last_routes: Tensor | None = None
        self.last_natural_routes: Tensor | None = None
        self.apply(_init)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dim() != 2:
            raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
        t = ids.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.cfg.max_len}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        replay = self.replay
        if replay is not None:
            if not self.cfg.is_moe:
                raise ValueError("replay: a dense model has no routes to replay")
            want = (ids.shape[0], t, self.cfg.n_layers, self.cfg.top_k)
            if tuple(replay.shape) != want:
                raise ValueError(f"replay must be [B, T, L, K] = {want}, got {tuple(replay.shape)}")
            if replay.dtype.is_floating_point or bool((replay < 0).any()) or \
                    bool((replay >= self.cfg.n_experts).any()):
                raise ValueError(f"replay must hold integer expert ids in [0, {self.cfg.n_experts})")
            replay = replay.to(torch.int64)
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        used, natural = [], []
        for i, blk in enumerate(self.blocks):
            x, u, n = blk(x, self.attn_impl, self.kv_quant, None if replay is None else replay[:, :, i])
            used.append(u)
            natural.append(n)
        if self.cfg.is_moe:
            self.last_routes, self.last_natural_routes = torch.stack(used, 2), torch.stack(natural, 2)
        return linear(self.head, self.ln_f(x))


def route_flips(a: Tensor, b: Tensor) -> Tensor:
    """``[...]`` bool: whether two routings ``[..., K]`` (expert ids) choose different *sets* of experts."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


def _init(m: nn.Module) -> None:
    if isinstance(m, MoE):
        nn.init.normal_(m.router_weight, std=0.02)
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
