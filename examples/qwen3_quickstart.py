"""Quickstart on a real (tiny) model: sample from a mismatched sampler, then train with MIS + score centering.

A tiny Qwen3 is built from a config with transformers (no download). The "sampler" is the same model with its
weights perturbed (a stand-in for another precision or stale weights); it samples with top-p and records the
realised support. The trainer computes the corrected loss with `op.policy_loss`, backpropagates, and prints the
metrics.

    python examples/qwen3_quickstart.py
"""

from __future__ import annotations

import copy

import torch

import offpolicy as op


def tiny_qwen3(vocab: int = 512) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    return Qwen3ForCausalLM(cfg)


@torch.no_grad()
def sample_with_support(model, prompt, steps, temperature, top_p):
    """Top-p sampling that records, per generated token, the realised support and its renormalised log-probs."""
    seq = prompt.clone()
    tokens, lq, supports, support_lps = [], [], [], []
    for _ in range(steps):
        logits = model(seq).logits[:, -1].float() / temperature
        probs = torch.softmax(logits, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) <= top_p  # keep while the mass before is <= top_p
        kept_p = torch.where(keep, sorted_p, 0.0)
        kept_p = kept_p / kept_p.sum(-1, keepdim=True)
        pick = torch.multinomial(kept_p, 1)
        y = order.gather(-1, pick)
        k = int(keep.sum(-1).max())
        ids = torch.where(keep[:, :k], order[:, :k], -1)
        lps = torch.where(keep[:, :k], torch.log(kept_p[:, :k]), float("-inf"))
        tokens.append(y[:, 0])
        lq.append(torch.log(kept_p.gather(-1, pick))[:, 0])
        supports.append(ids)
        support_lps.append(lps)
        seq = torch.cat([seq, y], 1)
    width = max(s.shape[1] for s in supports)
    pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)  # noqa: E731
    ids = torch.stack([pad(s, -1) for s in supports], 1)
    lps = torch.stack([pad(s, float("-inf")) for s in support_lps], 1)
    return seq, torch.stack(tokens, 1), torch.stack(lq, 1), ids, lps


def main() -> None:
    torch.manual_seed(0)
    trainer = tiny_qwen3()
    sampler = copy.deepcopy(trainer)
    with torch.no_grad():  # the sampler's numerics differ from the trainer's
        for p in sampler.parameters():
            p.add_(0.02 * torch.randn_like(p))
    batch, prompt_len, steps, temperature = 8, 4, 12, 0.9
    prompt = torch.randint(0, 512, (batch, prompt_len))
    seq, tokens, lq, ids, lps = sample_with_support(sampler, prompt, steps, temperature, top_p=0.9)
    rewards = (tokens % 2 == 0).float().mean(1)  # a toy reward: share of even tokens
    adv = op.advantages.grpo(rewards, torch.zeros(batch, dtype=torch.long))

    logits = trainer(seq).logits[:, prompt_len - 1 : -1]  # [B, T, V] predicting the generated tokens
    n = batch * steps
    out = op.policy_loss(
        logits.reshape(n, -1),
        tokens.reshape(n),
        lq.reshape(n),
        adv[:, None].expand(batch, steps).reshape(n),
        candidates=op.Candidates(ids.reshape(n, -1), lps.reshape(n, -1), kind="support"),
        temperature=temperature,
        correction=op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True),
        seq_ids=torch.arange(batch).repeat_interleave(steps),
        groups=torch.arange(batch).repeat_interleave(steps) % 2,
    )
    out.loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.square().sum() for p in trainer.parameters() if p.grad is not None))
    print(f"loss {out.loss.item():+.5f}   grad norm {grad_norm.item():.4f}")
    for key in ("kl_k1", "kl_k3", "extreme_ratio_frac", "weight_mean", "ess", "entropy", "support_size",
                "sc_abs_coef_sum", "group/0/share_samples", "group/1/kl_k3"):
        print(f"  {key:22s} {out.metrics[key].item():.5f}")


if __name__ == "__main__":
    main()
