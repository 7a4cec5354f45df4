"""Sampling answers with the reference sampler (:mod:`offpolicy.fleet.sampler`) and reshaping its record for the demo.

The demo's answers have a fixed length (the task's ``answer_len``), so every session yields exactly that many
tokens; the record is reshaped to ``[B, L]`` / ``[B, L, K]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.fleet.sampler import sample


class Rollout(NamedTuple):
    """One group's sampled answers.

    Attributes:
        tokens: ``[B, L]`` int64 sampled ids.
        logprobs: ``[B, L]`` fp32 sampler log-probabilities of ``tokens`` (renormalised over the support when
            top-p filtered).
        cand_ids: ``[B, L, K]`` int64 candidate ids (the top-K head, or the whole support), ``-1`` padding.
        cand_logprobs: ``[B, L, K]`` fp32 candidate log-probabilities, ``-inf`` padding.
        last_logits: ``[B, P + L - 1, V]`` logits (the model's dtype) of the sampler's last forward, over the prompt
            and every answer token but the last: the same input, hence bit for bit the same output (and, for the
            MoE, the same ``last_routes``) as a teacher-forced re-scoring of the sampled sequence; None if that
            forward did not cover every row.
    """

    tokens: Tensor
    logprobs: Tensor
    cand_ids: Tensor
    cand_logprobs: Tensor
    last_logits: Tensor | None = None


def rollout(model: torch.nn.Module, prompts: Tensor, answer_len: int, *, temperature: float, top_p: float,
            head_k: int, generator: torch.Generator) -> Rollout:
    """Sample ``answer_len`` tokens after each of ``prompts [B, P]`` from ``model``.

    With ``top_p < 1`` the sampler filters and records the realised support (kind ``"support"``); otherwise it
    samples the full vocabulary and records its top-``head_k`` tokens (kind ``"head"``).
    """
    p = prompts.shape[1]
    filtered = top_p < 1.0
    last: list[Tensor] = []
    # The sampler re-runs the whole sequence at every decoding step; its last forward is kept (see last_logits).
    hook = model.register_forward_hook(lambda _m, _inp, out: last.__setitem__(slice(None), [out]))
    try:
        with torch.no_grad():
            r = sample(model, prompts, max_new_tokens=answer_len, temperature=temperature, top_p=top_p,
                       record="support" if filtered else "head", k=head_k, generator=generator)
    finally:
        hook.remove()
    if not bool(r.sampled[:, p:].all()) or r.sequences.shape[1] != p + answer_len:
        raise RuntimeError("reference sampler returned a ragged rollout; the demo's answers have a fixed length")
    full = last[0] if last and isinstance(last[0], Tensor) else None
    if full is None or full.shape[:2] != (prompts.shape[0], p + answer_len - 1):
        full = None
    return Rollout(r.sequences[:, p:], r.sampler_logprobs[:, p:].float(), r.cand_ids[:, p:],
                   r.cand_logprobs[:, p:].float(), full)
