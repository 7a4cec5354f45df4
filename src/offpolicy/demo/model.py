"""A tiny causal transformer language model (pre-LayerNorm, learned positions), in plain torch.

The trainer runs it in fp32. A simulated sampler runs a copy of it in its own numerics (see
:mod:`offpolicy.demo.simulated_fleet`): weights fake-quantised on sync, compute in bf16, an FP8 key/value path, and another
attention kernel. All of that is a property of the copy; the module only offers two hooks:

* ``attn_impl``: ``"sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``) or ``"math"`` (an explicit
  softmax(QK^T)V), the same function computed by different kernels;
* ``kv_quant``: a function applied to the keys and values after projection (e.g. an FP8 fake quantiser). Applying it
  in a full forward is exactly what an FP8 KV cache does to every later query.

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

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    """One pre-LN transformer block: causal multi-head self-attention and a GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor, attn_impl: str, kv_quant: Callable[[Tensor], Tensor] | None) -> Tensor:
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
        return x + linear(self.fc2, F.gelu(linear(self.fc1, self.ln2(x))))


class TinyLM(nn.Module):
    """Causal LM: ``forward(ids [B, T] int64) -> logits [B, T, V]`` in the module's dtype.

    Attributes:
        attn_impl: attention kernel, one of :data:`ATTN_IMPLS`.
        kv_quant: optional function applied to keys and values (``[B, H, T, D/H]``) after projection.
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
        self.apply(_init)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dim() != 2:
            raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
        t = ids.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.cfg.max_len}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for blk in self.blocks:
            x = blk(x, self.attn_impl, self.kv_quant)
        return linear(self.head, self.ln_f(x))


def _init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
