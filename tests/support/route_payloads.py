"""Engine routed-experts payloads for tests: random per-position routes and the vLLM / SGLang wire encodings
(vLLM: base64 ``.npy`` in ``choices[i].routed_experts``; SGLang: base64 raw ``int32`` bytes, flat, in
``meta_info.routed_experts``; layouts cited in the adapters' docstrings)."""

from __future__ import annotations

import base64
import io
import random

import numpy as np


def positions(n, seed, layers, k, e):
    """``[n, layers, k]`` int64 random routes, ``k`` distinct experts of ``e`` per position-layer."""
    rng = random.Random(seed)
    return np.array([[rng.sample(range(e), k) for _ in range(layers)] for _ in range(n)], dtype=np.int64)


def npy_b64(arr):
    """vLLM's HTTP encoding: base64 of the ``.npy`` bytes."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def vllm_response(rows, prompt_len):
    """A ``/v1/completions`` response dict carrying ``rows [P + T - 1, L, K]`` as vLLM returns them."""
    return {"choices": [{"index": 0, "text": "", "routed_experts": npy_b64(np.asarray(rows).astype(np.int16))}],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(rows) - prompt_len + 1}}


def sglang_response(rows, output_ids):
    """A ``/generate`` response dict carrying ``rows [P + T - 1, L, K]`` as SGLang returns them (raw int32)."""
    raw = np.asarray(rows).astype(np.int32).tobytes()
    return {"output_ids": list(output_ids), "meta_info": {"id": "r", "routed_experts": base64.b64encode(raw).decode()}}
