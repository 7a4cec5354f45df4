"""Tiny transformers mixture-of-experts models built from a config (no download), for the routing tests."""

from __future__ import annotations

import torch

V = 128


def tiny_qwen3_moe(seed: int = 0, *, layers: int = 3, experts: int = 8, top_k: int = 2, norm: bool = True,
                   mlp_only_layers: tuple[int, ...] = (1,), router_scale: float = 1.0, vocab: int = V,
                   dtype: torch.dtype = torch.float32, experts_implementation: str | None = None):
    """A random Qwen3-MoE: ``layers`` decoder layers (hidden 32, 4 heads of 8, 2 KV heads), ``experts`` experts of
    width 32 with top-``top_k`` routing, the decoder layers in ``mlp_only_layers`` dense. ``router_scale`` multiplies
    the router weights (larger: more peaked routers). Eval mode."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm,
                         mlp_only_layers=list(mlp_only_layers), max_position_embeddings=128, tie_word_embeddings=False)
    if experts_implementation is not None:
        cfg._experts_implementation = experts_implementation
    model = Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    if router_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.mul_(router_scale)
    return model


def tiny_other_moe(kind: str, seed: int = 0):
    """A random 2-layer Qwen2-MoE (``kind="qwen2_moe"``, with its shared expert) or OLMoE (``"olmoe"``), 8 experts,
    top-2, hidden 32."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128)
    if kind == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32, **common)
        return Qwen2MoeForCausalLM(cfg).eval()
    if kind == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        return OlmoeForCausalLM(OlmoeConfig(**common)).eval()
    raise ValueError(f"tiny_other_moe: kind must be 'qwen2_moe' or 'olmoe', got {kind!r}")


def save_tiny_qwen3_moe(path, seed: int = 0, vocab: int = 512):
    """A random 2-layer Qwen3-MoE (hidden 128, 2 heads of 64: vLLM's CPU attention refuses head_dim 16; 8 experts of
    width 64, top-2, both layers routed; output layer x12 and routers x10 so both are peaked) with a WordLevel tokenizer ``t0 .. t{vocab-1}``, saved to ``path`` for an
    engine to load (as tests/adapters/test_vllm_live.py saves its dense Qwen3); returns the transformers model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # peaked next-token distributions and routers (random init is near uniform in both)
        model.lm_head.weight.mul_(12.0)
        for m in model.modules():
            if type(m).__name__ == "Qwen3MoeTopKRouter":
                m.weight.mul_(10.0)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(path)
    return model
