"""The reference sampler: SGLang's filter, the recorded contract, multi-turn masks, numerics hooks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offpolicy.fleet.quant import fake_quantize_module
from offpolicy.fleet.sampler import Rollout, sample, support_mask

V = 24


class ToyLM(nn.Module):
    """A one-layer causal transformer: ids [B, L] -> logits [B, L, V]."""

    def __init__(self, vocab: int = V, d: int = 32, max_len: int = 64, seed: int = 0, hf_style: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab)
        self.hf_style = hf_style

    def forward(self, ids):
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))[None]
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)[:, 0]
        logits = 3.0 * self.head(h + self.mlp(h))
        return SimpleNamespace(logits=logits) if self.hf_style else logits


class FixedLM(nn.Module):
    """Context-free: every position gets the same logits row."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.z = nn.Parameter(logits.clone(), requires_grad=False)

    def forward(self, ids):
        return self.z.expand(ids.shape[0], ids.shape[1], -1)


def sglang_filter_reference(lp: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """SGLang's torch sampler, line for line (sglang 0.5.23 srt/layers/sampler.py,
    top_k_top_p_min_p_sampling_from_probs_torch): sort, cumsum, zero rank >= k, zero mass-before > top_p."""
    probs = lp.exp()
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    top_ks = torch.full((probs.shape[0],), top_k if top_k is not None else 1 << 30)
    probs_sort[torch.arange(probs.shape[-1]).view(1, -1) >= top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_p] = 0.0
    return torch.zeros_like(probs, dtype=torch.bool).scatter(1, probs_idx, probs_sort > 0)


@pytest.mark.parametrize("top_k,top_p", [(None, 0.9), (5, 1.0), (3, 0.7), (1, 1.0), (None, 0.05), (50, 0.99)])
def test_support_mask_matches_sglang_code_and_definition(top_k, top_p):
    lp = torch.log_softmax(torch.randn(64, V, generator=torch.Generator().manual_seed(0)) * 2, dim=-1)
    keep = support_mask(lp, top_k, top_p)
    assert torch.equal(keep, sglang_filter_reference(lp, top_k, top_p))
    # the definition, in float64 with python loops: rank < k and mass-before <= top_p
    for row in range(8):
        p = lp[row].double().exp()
        order = sorted(range(V), key=lambda i: (-float(p[i]), i))
        mass, kept = 0.0, set()
        for rank, i in enumerate(order):
            if (top_k is None or rank < top_k) and mass <= top_p:
                kept.add(i)
            mass += float(p[i])
        assert {i for i in range(V) if keep[row, i]} == kept


def test_support_mask_boundary_and_vllm_semantics():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    # mass before the third token is exactly 0.75: SGLang keeps it (<=), vLLM drops it (<)
    assert support_mask(lp, None, 0.75).tolist() == [[True, True, True, False]]
    assert support_mask(lp, None, 0.75, "vllm").tolist() == [[True, True, False, False]]
    # top-k ties: SGLang keeps rank < k (lower id wins a tie), vLLM keeps every token tied with the k-th
    tied = torch.log_softmax(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), dim=-1)
    assert support_mask(tied, 2).tolist() == [[True, True, False, False]]
    assert support_mask(tied, 2, semantics="vllm").tolist() == [[True, True, True, False]]
    # vLLM applies top-p on the top-k renormalised distribution
    lp2 = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # SGLang: mass before token 1 is 0.4 <= 0.5, kept; vLLM: 0.4 / 0.7 = 0.57 >= 0.5 after top-2, dropped
    assert support_mask(lp2, 2, 0.5).tolist() == [[True, True, False, False]]
    assert support_mask(lp2, 2, 0.5, "vllm").tolist() == [[True, False, False, False]]
    assert support_mask(lp2, 3, 0.6, "vllm").tolist() == [[True, True, False, False]]  # 0.4/0.9 < 0.6
    assert support_mask(lp2, 3, 0.8).tolist() == [[True, True, True, False]]


def test_zero_probability_tokens_never_enter_a_support():
    z = torch.tensor([2.0, float("-inf"), 1.0, float("-inf"), 0.5, -200.0])
    lp = torch.log_softmax(z, -1)[None]
    # exp(-202) underflows fp32: SGLang's support {w > 0} drops it, vLLM's finite-logit mask keeps it
    assert support_mask(lp, 5).tolist() == [[True, False, True, False, True, False]]
    assert support_mask(lp).tolist() == [[True, False, True, False, True, False]]
    assert support_mask(lp, 5, semantics="vllm").tolist() == [[True, False, True, False, True, True]]
    r = sample(FixedLM(z), [[0]] * 50, 3, temperature=0.5, top_k=5, record="support")
    b = r.flatten()
    b.candidates.validate(6, b.tokens.shape[0], b.tokens)
    assert bool(torch.isfinite(b.candidates.logprobs[b.candidates.valid]).all())
    assert set(b.candidates.ids[b.candidates.valid].tolist()) <= {0, 2, 4}


def test_sampled_frequencies_and_recorded_logprobs_follow_the_renormalised_support():
    z = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -8.0])
    model = FixedLM(z)
    T, top_p = 0.7, 0.9
    r = sample(model, [[0]] * 4000, 1, temperature=T, top_p=top_p, record="support",
               generator=torch.Generator().manual_seed(1))
    batch = r.flatten()
    lp = torch.log_softmax(z.double() / T, dim=0)
    keep = support_mask(lp[None].float(), None, top_p)[0]
    q = torch.where(keep, (lp - torch.logsumexp(lp[keep], 0)).exp(), torch.zeros_like(lp))
    # recorded lq is log q_S(y), to fp32 rounding
    assert torch.allclose(batch.sampler_logprobs.double(), q.log()[batch.tokens], atol=1e-6)
    counts = torch.bincount(batch.tokens, minlength=len(z)).double()
    assert bool((counts[~keep] == 0).all())
    expected = q[keep] * 4000
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    # df = |S| - 1 = 4: the 0.001 critical value is 18.47; with a fixed seed this is deterministic
    assert chi2 < 18.47, chi2
    cands = batch.candidates
    assert cands.kind == "support"
    cands.validate(len(z), batch.tokens.shape[0], batch.tokens)
    assert torch.allclose(cands.logprobs[0].double(), q[cands.ids[0]].log(), atol=1e-6)


def test_head_record_is_topk_of_post_temperature_distribution_and_matches_recompute():
    model = ToyLM()
    T = 1.3
    r = sample(model, [[1, 2, 3], [4, 5]], 6, temperature=T, record="head", k=5,
               generator=torch.Generator().manual_seed(0))
    b = r.flatten()
    assert b.tokens.shape == (12,) and b.candidates.ids.shape == (12, 5) and b.candidates.kind == "head"
    # the trainer's recompute on the final sequences equals the sampler's records (KV-less: same model);
    # fp32 matmuls of different batch shapes agree to ~1e-6 here, so 1e-5 is a safe bound
    z = b.gather(model(r.sequences)) / b.temperature[:, None]
    lp = torch.log_softmax(z, dim=-1)
    assert torch.allclose(b.sampler_logprobs, lp.gather(1, b.tokens[:, None]).squeeze(1), atol=1e-5)
    vals, ids = torch.sort(lp, dim=1, descending=True, stable=True)
    assert torch.equal(b.candidates.ids, ids[:, :5])
    assert torch.allclose(b.candidates.logprobs, vals[:, :5], atol=1e-5)
    b.candidates.validate(V, 12, b.tokens)
    assert torch.equal(b.seq_ids, torch.tensor([0] * 6 + [1] * 6))
    assert r.lengths.tolist() == [9, 8] and int(r.sequences[1, 8]) == 0  # right padding


def test_multi_turn_tool_tokens_are_not_sampled_or_trained():
    model = ToyLM(hf_style=True)
    gen = torch.Generator().manual_seed(3)
    r = sample(model, [[1, 2], [3, 4, 5]], 3, top_p=0.8, record="support", version=7, generator=gen)
    r = r.append([[20, 21], []])
    r = sample(model, r, 2, top_p=0.8, record="support", version=8, trained=False, generator=gen)
    assert r.lengths.tolist() == [2 + 3 + 2 + 2, 3 + 3 + 2]
    assert r.sampled[0].tolist()[:9] == [False, False, True, True, True, False, False, True, True]
    assert r.loss_mask[0].tolist()[:9] == [False, False, True, True, True, False, False, False, False]
    assert r.sequences[0, 5:7].tolist() == [20, 21]
    b = r.flatten()
    assert b.tokens.shape == (10,)
    assert b.versions.tolist() == [7, 7, 7, 8, 8, 7, 7, 7, 8, 8]
    b.candidates.validate(V, 10, b.tokens)
    # recompute over the replayed support after the tool tokens matches the sampler
    lp = torch.log_softmax(b.gather(model(r.sequences).logits), dim=-1)
    ids, valid = b.candidates.ids.clamp(min=0), b.candidates.valid
    lps = lp.gather(1, ids).masked_fill(~valid, float("-inf"))
    renorm = lps - torch.logsumexp(lps, 1, keepdim=True)
    assert torch.allclose(renorm.masked_fill(~valid, 0), b.candidates.logprobs.masked_fill(~valid, 0), atol=1e-5)
    with pytest.raises(ValueError, match="same kind of record"):
        sample(model, r, 1, record="head")
    with pytest.raises(ValueError, match="expected 2 rows"):
        r.append([[1]])


def test_eos_stops_rows_and_active_mask():
    z = torch.full((6,), -10.0)
    z[5] = 10.0  # the EOS token is almost sure
    r = sample(FixedLM(z), [[0], [1]], 4, eos_token_id=5, record=None)
    assert r.finished.tolist() == [True, True] and r.lengths.tolist() == [2, 2]
    assert r.flatten().candidates is None
    r2 = sample(FixedLM(z), [[0], [1]], 3, active=torch.tensor([True, False]), record=None)
    assert r2.lengths.tolist() == [4, 1]


def test_numerics_hook_changes_sampler_probabilities_only():
    model = ToyLM(seed=1)
    prompts = [[1, 2, 3, 4]] * 4
    r_q = sample(model, prompts, 5, numerics="nvfp4", record="head", generator=torch.Generator().manual_seed(0))
    b = r_q.flatten()
    with torch.no_grad():
        trainer = torch.log_softmax(b.gather(model(r_q.sequences)), -1).gather(1, b.tokens[:, None]).squeeze(1)
        sampler_q = torch.log_softmax(b.gather(fake_quantize_module(model, "nvfp4")(r_q.sequences)), -1)
    # the record is the quantised model's, and it differs from the full-precision trainer
    assert torch.allclose(b.sampler_logprobs, sampler_q.gather(1, b.tokens[:, None]).squeeze(1), atol=1e-5)
    assert float((b.sampler_logprobs - trainer).abs().max()) > 1e-3
    # a callable hook, and the model itself is left untouched and in its mode
    model.train()
    r_c = sample(model, prompts, 2, numerics=lambda m: fake_quantize_module(m, "fp8"), record=None)
    assert r_c.flatten().tokens.shape == (8,) and model.training
    r_h = sample(model, prompts, 2, logits_hook=lambda z: z.bfloat16().float(), record=None)
    assert r_h.flatten().tokens.shape == (8,)


def test_sampler_rejects_bad_arguments():
    model = ToyLM()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sample(model, [[1]], 2, temperature=0.0)
    with pytest.raises(ValueError, match="record='head' needs unfiltered"):
        sample(model, [[1]], 2, top_p=0.9, record="head")
    with pytest.raises(ValueError, match="top_p must be in"):
        sample(model, [[1]], 2, top_p=0.0, record="support")
    with pytest.raises(ValueError, match="top_k must be"):
        sample(model, [[1]], 2, top_k=0, record="support")
    with pytest.raises(ValueError, match="every prompt must hold"):
        sample(model, [[1], []], 2)
    with pytest.raises(ValueError, match="max_support"):
        sample(model, [[1]], 2, top_p=0.999, record="support", max_support=2)
    class TwoD(nn.Module):
        def forward(self, ids):
            return ids.float()

    with pytest.raises(TypeError, match="logits"):
        sample(TwoD(), [[1]], 1)
    with pytest.raises(ValueError, match="record must be"):
        sample(model, [[1]], 1, record="full")


def test_rollout_is_a_frozen_dataclass():
    r = sample(ToyLM(), [[1]], 1, record=None)
    assert isinstance(r, Rollout) and r.batch_size == 1
    with pytest.raises(AttributeError):
        r.kind = "head"
    assert math.isfinite(float(r.flatten().sampler_logprobs[0]))


def test_docs_examples_run():
    # every python block of docs/samplers.md runs as written (they assert their own claims)
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "samplers.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/samplers.md#{i}", "exec"), {})


@pytest.mark.parametrize("semantics", ["sglang", "vllm"])
def test_top_k_off_conventions(semantics):
    """``top_k = -1`` is ``None`` (off) in both engines' semantics, and so is a ``top_k`` of the whole
    vocabulary; ``top_p = 1`` keeps every token of positive probability; 0 is refused (it is "off" only in vLLM's
    request fields, which its adapter maps to ``None``)."""
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    for top_p in (1.0, 0.75, 0.5):
        off = support_mask(lp, None, top_p, semantics)
        assert torch.equal(support_mask(lp, -1, top_p, semantics), off)
        assert torch.equal(support_mask(lp, 4, top_p, semantics), off)
    assert support_mask(lp, -1, 1.0, semantics).tolist() == [[True] * 4]
    with pytest.raises(ValueError, match="top_k must be None, -1"):
        support_mask(lp, 0, 1.0, semantics)
    r = sample(ToyLM(), [[1]], 2, top_k=-1, record="head", k=3, filter_semantics=semantics)
    assert r.flatten().candidates.kind == "head"
