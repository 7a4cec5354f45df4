"""TRL issue #6789's statistics from recorded ``OffPolicyGRPOTrainer`` micro-batches: TRL's pairing of the trainer's
full-vocabulary log-probs with a filtered sampler's (its ``vllm_importance_sampling_correction`` formula,
``exp(sum_t old - sampling)``) against offpolicy's support replay."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def pairing_gaps(seen: Iterable[dict]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(trl_token, trl_sequence, replay_token, replay_sequence)``: the trained tokens' log-ratios and each row's
    sequence ratio, TRL's pairing first, then the replay's. Each record holds ``inputs`` (with
    ``sampling_per_token_logps``), ``trl_logps``, ``log_ratio`` and ``loss_mask`` (``[B, T]``)."""
    trl_tok, trl_seq, replay_tok, replay_seq = [], [], [], []
    for s in seen:
        m = s["loss_mask"]
        diff = (s["trl_logps"] - s["inputs"]["sampling_per_token_logps"]) * m
        trl_tok.append(diff[m])
        trl_seq.append(diff.sum(-1).exp())
        replay_tok.append(s["log_ratio"][m])
        replay_seq.append((s["log_ratio"] * m).sum(-1).exp())
    return torch.cat(trl_tok), torch.cat(trl_seq), torch.cat(replay_tok), torch.cat(replay_seq)
