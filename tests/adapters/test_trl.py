"""offpolicy.adapters.trl against the installed trl==1.16.0: real GRPO runs on CPU with a tiny random Qwen3 and a
locally built WordLevel tokenizer (nothing downloaded), checked against the float64 reference.

Missing TRL fails with the install line unless OFFPOLICY_SKIP_TRAINER_TESTS=1 (an explicit opt-out)."""

import math
import os
import warnings

import pytest
import torch

if os.environ.get("OFFPOLICY_SKIP_TRAINER_TESTS") == "1":
    pytest.skip("OFFPOLICY_SKIP_TRAINER_TESTS=1: trainer-adapter tests opted out", allow_module_level=True)
try:
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
except ImportError as exc:
    raise ImportError(f"TRL tests need trl==1.16.0 in this venv: `pip install trl==1.16.0` ({exc}); "
                      "set OFFPOLICY_SKIP_TRAINER_TESTS=1 to opt out") from exc

import offpolicy as op
from offpolicy.adapters.guard import GuardWarning
from offpolicy.adapters import trl as trl_adapter
from offpolicy.adapters.trl import (CANDIDATES_KEY, PROXIMAL_KEY, OffPolicyGRPOTrainer, records_from_scores,
                                    resolve_correction)
from offpolicy.reference import reference_policy_loss

from support.trl_6789 import pairing_gaps

WORDS = ["<pad>", "<eos>"] + [f"w{i}" for i in range(30)]
SCRATCH = {}


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory):
    """TRL's output_dir (nothing is saved: save_strategy="no"), under pytest's managed temporary folder."""
    SCRATCH["out"] = str(tmp_path_factory.mktemp("trl_out"))


def _tokenizer():
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return Qwen3ForCausalLM(cfg)


def _reward(completions, **kwargs):
    return [float(c.count("w3")) - 0.1 * len(c.split()) for c in completions]


class RecordingTrainer(OffPolicyGRPOTrainer):
    """Keeps each micro-batch's inputs, its loss and float64 logits computed by a plain dense forward, and a copy of
    the model's parameters at each generation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []
        self.generation_states = []

    def _generate_and_score_completions(self, inputs):
        self.generation_states.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return super()._generate_and_score_completions(inputs)

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            t = inputs["completion_ids"].shape[1]
            logits = model(input_ids=ids, attention_mask=att).logits[:, -t - 1:-1].double()
            trl_logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, att, t)
        self.seen.append({"inputs": {k: v for k, v in inputs.items()}, "loss": loss.detach().clone(),
                          "logits": logits, "trl_logps": trl_logps.detach(),
                          "generation": len(self.generation_states) - 1, **self.offpolicy_last})
        return loss


def _train(correction, record, *, top_p=0.9, loss_type="dapo", steps=2, max_len=6, accum=2, temperature=0.9,
           bf16=False, generation_config=None, **config):
    model = _model()
    for k, v in (generation_config or {}).items():  # as a checkpoint's generation_config.json would set them
        setattr(model.generation_config, k, v)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    ds = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(16)]})
    args = trl.GRPOConfig(
        output_dir=SCRATCH["out"], use_cpu=True, bf16=bf16,
        per_device_train_batch_size=4, gradient_accumulation_steps=accum, num_generations=4,
        max_completion_length=max_len, max_steps=steps, logging_steps=1, report_to=[], learning_rate=1e-2,
        top_p=top_p, temperature=temperature, loss_type=loss_type, save_strategy="no", seed=0, **config,
    )
    trainer = RecordingTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=ds,
                               processing_class=_tokenizer(), correction=correction, record=record)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GuardWarning)
        trainer.train()
    trainer.guard_warnings = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    return trainer, before


def _record_rows(x):
    """A micro-batch's recorded ``(ids, log-probs)`` per token, ``B T`` rows (empty past each completion), read by
    hand from the per-completion CSR records of the generation batch."""
    t = x["completion_ids"].shape[1]
    rows = []
    for r in x[CANDIDATES_KEY]:
        assert isinstance(r, op.CSRCandidates) and r.num_rows <= t
        off = r.offsets.tolist()
        rows += [(r.ids[off[i]:off[i + 1]], r.logprobs[off[i]:off[i + 1]]) for i in range(r.num_rows)]
        rows += [(r.ids[:0], r.logprobs[:0])] * (t - r.num_rows)
    return rows


def _pad_rows(rows, width):
    """``(ids [n, width] -1 padded, log-probs [n, width] float64 -inf padded)`` of per-token rows."""
    ids = torch.full((len(rows), width), -1, dtype=torch.long)
    lps = torch.full((len(rows), width), float("-inf"), dtype=torch.float64)
    for i, (a, v) in enumerate(rows):
        ids[i, :len(a)], lps[i, :len(v)] = a, v.double()
    return ids, lps


def _reference(seen, correction, record, aggregation, temperature=0.9, proximal=None):
    """float64 loss of one accumulation window (the micro-batches concatenated) by offpolicy.reference;
    ``proximal``: one ``[B, T]`` tensor of log pi_prox per micro-batch (decoupled PPO)."""
    logits, tokens, lq, adv, mask, seq, ids = [], [], [], [], [], [], []
    offset = 0
    for s in seen:
        x = s["inputs"]
        b, t = x["completion_ids"].shape
        logits.append(s["logits"].reshape(b * t, -1))
        tokens.append(x["completion_ids"].reshape(-1))
        lq.append(x["sampling_per_token_logps"].reshape(-1))
        adv.append(x["advantages"][:, None].expand(b, t).reshape(-1))
        mask.append(x["completion_mask"].reshape(-1).bool())
        seq.append((offset + torch.arange(b))[:, None].expand(b, t).reshape(-1))
        offset += b
        if record != "logprobs":
            ids += _record_rows(x)
    m = torch.cat(mask)
    cands = op.Candidates(*_pad_rows(ids, max(len(a) for a, _ in ids)), kind=record) if ids else None
    lqs = torch.where(m, torch.cat(lq).double(), torch.zeros_like(m, dtype=torch.float64))
    prox = None
    if proximal is not None:
        prox = torch.where(m, torch.cat([p.reshape(-1) for p in proximal]).double(), torch.zeros_like(lqs))
    loss, _, _ = reference_policy_loss(torch.cat(logits), torch.cat(tokens), lqs, torch.cat(adv), cands, m,
                                       temperature, correction, torch.cat(seq), aggregation, proximal_logprobs=prox)
    return loss


@pytest.fixture(scope="module")
def support_run():
    corr = op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True)
    return corr, *_train(corr, "support")


def test_support_replay_trains_through_offpolicy(support_run):
    corr, trainer, before = support_run
    logs = [h for h in trainer.state.log_history if "offpolicy/num_tokens" in h]
    assert len(logs) == 2, trainer.state.log_history
    assert all(h["offpolicy/support_size"] < len(WORDS) for h in logs)  # top_p=0.9 filtered the support
    # A correct run is silent: no guard warning, no guard metric.
    assert trainer.guard_warnings == [] and not any(k.startswith("offpolicy/guard/") for h in logs for k in h)
    assert trainer.offpolicy_guard.calls == 4 and trainer.offpolicy_guard.suspects == []
    # Replay: trainer and sampler are the same fp32 model, so the support-renormalised ratio is one to rounding.
    assert max(h["offpolicy/abs_log_ratio_max"] for h in logs) < 1e-5
    changed = [k for k, v in trainer.model.named_parameters() if not torch.equal(v.detach(), before[k])]
    assert "lm_head.weight" in changed and len(changed) > 10


def test_support_records_are_csr_in_the_trained_micro_batches(support_run):
    """After TRL's shuffle and split each micro-batch carries its completions' CSR records: one row per completion
    token, non-empty exactly on completion tokens, filtered (fewer ids than the vocabulary), no ``[B, T, K]``."""
    _, trainer, _ = support_run
    for s in trainer.seen:
        x = s["inputs"]
        assert not any(isinstance(v, torch.Tensor) and v.dim() >= 3 for v in x.values())
        recs = x[CANDIDATES_KEY]
        assert len(recs) == x["completion_ids"].shape[0]
        for r, m in zip(recs, x["completion_mask"].bool()):
            assert isinstance(r, op.CSRCandidates) and r.kind == "support" and r.num_rows == int(m.sum())
            assert r.nnz == int(r.lengths.sum()) and bool((r.lengths > 0).all())
            assert int(r.lengths.max()) < len(WORDS)


def test_support_loss_equals_float64_reference_over_accumulation_window(support_run):
    corr, trainer, _ = support_run
    assert len(trainer.seen) == 4  # 2 optimizer steps x 2 micro-batches
    for step in range(2):
        window = trainer.seen[2 * step: 2 * step + 2]
        got = sum(float(s["loss"]) for s in window)
        # dapo: the window's loss is the token mean over the whole generation batch (default token count).
        ref = float(_reference(window, corr, "support", "token_mean"))
        assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-6), (step, got, ref)


@pytest.mark.parametrize("loss_type, aggregation", [("grpo", "seq_mean_token_mean"), ("bnpo", None)])
def test_loss_type_normalisation_matches_trl(loss_type, aggregation):
    corr = op.Correction(weights="tis", bounds=(0.0, 2.0))
    trainer, _ = _train(corr, "logprobs", top_p=1.0, loss_type=loss_type, steps=1)
    window = trainer.seen[:2]
    got = sum(float(s["loss"]) for s in window)
    if aggregation is not None:
        ref = float(_reference(window, corr, "logprobs", aggregation))
    else:  # bnpo: each micro-batch's token mean, averaged over the accumulation steps
        ref = sum(float(_reference([s], corr, "logprobs", "token_mean")) for s in window) / 2
    assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-6), (got, ref)


def test_trl_6789_bias_vs_support_replay():
    """TRL #6789: sampler log-probs renormalised over the top-p support against the trainer's full-vocabulary
    log-probs (TRL's vLLM importance-sampling pairing) give a sequence ratio far below one; offpolicy's replay of
    the recorded support gives ratio one."""
    corr = op.Correction(weights="mis", bounds=(0.5, 5.0))
    trainer, _ = _train(corr, "support", top_p=0.9, steps=1, max_len=8, temperature=1.0)
    # TRL's formula (grpo_trainer.py, vllm_importance_sampling_correction): exp(sum_t old - sampling).
    trl_tok, trl_seq, replay_tok, replay_seq = pairing_gaps(trainer.seen)
    # Per token the gap is log P(S_t) in [log 0.9, 0): the mass the top-p filter kept.
    assert float(trl_tok.max()) < 0 and float(trl_tok.min()) >= math.log(0.9) - 0.05
    assert float(trl_seq.mean()) < 0.75
    assert float(replay_tok.abs().max()) < 1e-5
    assert abs(float(replay_seq.mean()) - 1.0) < 1e-4
    print(f"TRL #6789 at top_p=0.9: TRL-style token log-ratio mean {float(trl_tok.mean()):.4f}, sequence ratio "
          f"mean {float(trl_seq.mean()):.3f}; offpolicy replay token |log-ratio| max "
          f"{float(replay_tok.abs().max()):.2e}, "
          f"sequence ratio mean {float(replay_seq.mean()):.6f}")


def test_records_from_scores_support_and_head():
    torch.manual_seed(1)
    logits = torch.randn(3, 12)
    scores = logits.clone()
    scores[0, 5:] = float("-inf")
    scores[1, :2] = float("-inf")
    tokens = torch.tensor([1, 7, 0])
    lq, c = records_from_scores(scores, tokens, "support", 4)
    assert c.kind == "support" and c.width == 12
    assert torch.equal(c.ids[0, :5], torch.arange(5)) and bool((c.ids[0, 5:] == -1).all())
    assert torch.allclose(c.logprobs[c.valid].exp().reshape(-1).sum(), torch.tensor(3.0), atol=1e-5)
    assert torch.allclose(lq, torch.log_softmax(scores, -1)[torch.arange(3), tokens])
    with pytest.raises(ValueError, match="record='head' needs unfiltered"):
        records_from_scores(scores, tokens, "head", 4)
    _, h = records_from_scores(logits, tokens, "head", 4)
    assert h.kind == "head" and h.width == 4
    assert torch.equal(h.ids, logits.topk(4, -1).indices)


def _support_reference(scores: torch.Tensor, tokens: torch.Tensor):
    """float64: each row's finite-score ids ascending, their renormalised log q, the sampled token's."""
    logq = torch.log_softmax(scores.double(), -1)
    rows = [torch.isfinite(r).nonzero()[:, 0] for r in scores]
    return rows, [logq[i, r] for i, r in enumerate(rows)], logq.gather(1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("path", ["topk", "mask"])
def test_records_from_scores_support_matches_the_float64_reference(path, monkeypatch):
    """The topk extraction and the finite-mask path give the same ids (exactly) and log q (fp32: 1e-6 absolute +
    1e-6 relative, a few ulps) as a float64 recomputation, on supports of varied size per row (top_p, top_k, min_p
    shapes, a row with one id)."""
    if path == "mask":
        monkeypatch.setattr(trl_adapter, "TOPK_SUPPORT_MAX", 0)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 400, generator=g) * 3  # widest support 300 < V: the topk path applies
    scores = logits.clone()
    order = logits.argsort(-1, descending=True)
    for i, k in enumerate([1, 5, 37, 120, 300, 64]):  # top_k-like prefixes of the score order
        scores[i].scatter_(0, order[i, k:], float("-inf"))
    tokens = torch.stack([torch.multinomial(torch.softmax(r, -1), 1, generator=g)[0] for r in scores])
    lq, c = records_from_scores(scores, tokens, "support", 4)
    ids_ref, lq_ref_rows, lq_ref = _support_reference(scores, tokens)
    assert c.width == 300 and c.kind == "support"
    for i in range(6):
        n = len(ids_ref[i])
        assert torch.equal(c.ids[i, :n], ids_ref[i]) and bool((c.ids[i, n:] == -1).all())
        assert torch.allclose(c.logprobs[i, :n].double(), lq_ref_rows[i], atol=1e-6, rtol=1e-6)
        assert bool(torch.isneginf(c.logprobs[i, n:]).all())
    assert torch.allclose(lq.double(), lq_ref, atol=1e-6, rtol=1e-6)


def test_records_from_scores_topk_path_falls_back_when_a_non_finite_score_displaces_the_support():
    """A +inf or nan score outside the support ranks above it in ``topk``; the extraction then sorts instead and the
    record is still the finite ids."""
    scores = torch.full((2, 50), float("-inf"))
    scores[0, [3, 9]] = torch.tensor([1.0, 2.0])
    scores[1, [4, 7, 8]] = torch.tensor([0.5, 0.1, 0.2])
    scores[0, 20], scores[1, 30] = float("inf"), float("nan")
    _, c = records_from_scores(scores, torch.tensor([3, 7]), "support", 4)
    assert c.ids.tolist() == [[3, 9, -1], [4, 7, 8]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_support_record_at_any_width_matches_the_float64_reference(dtype):
    """Generation's CSR support record (:func:`support_record`) on one batch whose rows range from 1 id to the whole
    vocabulary (K = V, K = V - 1, past and below TOPK_SUPPORT_MAX) and on the narrow batch the ``topk`` path takes:
    ids exact and ascending, log q and the sampled tokens' lq within the dtype's tolerance of float64 (the scores
    as given, upcast), a token outside its support -inf, and exactly 12 |S_t| + 8 bytes per token."""
    from offpolicy.adapters.trl import support_record

    v = 1500
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, v, generator=g) * 2).to(dtype)
    scores = logits.clone()
    order = logits.float().argsort(-1, descending=True)
    for i, k in enumerate([v, v - 1, 1, 1100, 3, 1024, 600]):
        scores[i].scatter_(0, order[i, k:], float("-inf"))
    tokens = torch.stack([torch.multinomial(torch.softmax(r.float(), -1), 1, generator=g)[0] for r in scores])
    tokens[6] = order[6, 700]  # outside its support (the sampler would never; the record says -inf)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-5, rtol=1e-5)
    for batch in (slice(None), slice(2, 4)):  # every width (finite-mask path) / narrow rows only (topk path)
        s, t = scores[batch], tokens[batch]
        lq, rec = support_record(s, t)
        ids_ref, lq_ref_rows, lq_ref = _support_reference(s.float(), t)
        assert rec.kind == "support" and rec.ids.dtype == torch.int64 and rec.logprobs.dtype == torch.float32
        for i in range(s.shape[0]):
            a, b = int(rec.offsets[i]), int(rec.offsets[i + 1])
            assert torch.equal(rec.ids[a:b], ids_ref[i])
            assert torch.allclose(rec.logprobs[a:b].double(), lq_ref_rows[i], **tol)
        assert torch.allclose(lq.double(), lq_ref, **tol)  # -inf where the token is outside its support
        nbytes = sum(x.element_size() * x.numel() for x in (rec.ids, rec.offsets, rec.logprobs))
        assert nbytes == 12 * rec.nnz + 8 * (s.shape[0] + 1)
    assert bool(torch.isneginf(support_record(scores, tokens)[0][6]))


def test_support_record_ignores_non_finite_scores_outside_the_support_at_wide_rows():
    """``+inf`` / ``nan`` scores are not support entries and do not reach the normaliser on the finite-mask path
    (wide rows) either."""
    from offpolicy.adapters.trl import support_record

    scores = torch.randn(2, 3000)
    scores[0, 5], scores[1, 9] = float("inf"), float("nan")
    scores[1, 100:200] = float("-inf")
    lq, rec = support_record(scores, torch.tensor([0, 1]))
    ref = torch.where(torch.isfinite(scores), scores, float("-inf")).double().log_softmax(-1)
    assert rec.lengths.tolist() == [2999, 2899] and 5 not in rec.ids[:2999].tolist()
    assert torch.allclose(lq.double(), ref[[0, 1], [0, 1]], atol=1e-6)
    assert torch.allclose(rec.logprobs.double(), ref[torch.isfinite(scores)], atol=1e-6)


def test_rejects_unsupported_options():
    with pytest.raises(ValueError, match="record must be one of"):
        OffPolicyGRPOTrainer(model=None, reward_funcs=_reward, record="topk")
    with pytest.raises(ValueError, match="score centering needs a candidate record"):
        OffPolicyGRPOTrainer(model=None, reward_funcs=_reward, record="logprobs",
                             correction=op.Correction(weights="mis", score_centering=True))


def test_head_record_with_score_centering_matches_reference():
    """Unfiltered sampling (top_p=1, top_k=0): a head record of the sampler's top 20 and score centering."""
    corr = op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True)
    trainer, _ = _train(corr, "head", top_p=1.0, steps=1)
    window = trainer.seen[:2]
    recs = window[0]["inputs"][CANDIDATES_KEY]  # every head row holds the top head_k = 20, stored in CSR
    assert all(isinstance(r, op.CSRCandidates) and bool((r.lengths == 20).all()) for r in recs)
    got = sum(float(s["loss"]) for s in window)
    ref = float(_reference(window, corr, "head", "token_mean"))
    assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-6), (got, ref)


def test_default_bf16_autocast_trains_with_a_numerics_gap():
    """GRPOConfig's default bf16=True: the backbone runs under bf16 autocast in training, fp32 in generation; the
    replay ratio then carries that numerics gap (no longer ~1e-7), and training still runs through offpolicy."""
    trainer, before = _train(op.Correction(weights="mis", bounds=(0.5, 5.0)), "support", steps=1, bf16=True)
    logs = [h for h in trainer.state.log_history if "offpolicy/abs_log_ratio_max" in h]
    assert logs and 1e-4 < logs[0]["offpolicy/abs_log_ratio_max"] < 0.5, logs
    assert not torch.equal(trainer.model.lm_head.weight.detach(), before["lm_head.weight"])
    # The guard names the cause and the fix, once, and logs it as a metric.
    assert len(trainer.guard_warnings) == 1, trainer.guard_warnings
    assert "[compute_dtype]" in trainer.guard_warnings[0] and "bf16=False" in trainer.guard_warnings[0]
    assert logs[0]["offpolicy/guard/compute_dtype"] == 1.0
    print(f"bf16 autocast vs fp32 generation: max |log-ratio| {logs[0]['offpolicy/abs_log_ratio_max']:.2e}, "
          f"mean {logs[0]['offpolicy/abs_log_ratio_mean']:.2e}")


@pytest.mark.parametrize("option, code, words", [
    ({"generation_kwargs": {"temperature": 0.6}}, "sampler_temperature",
     "generation_kwargs['temperature']=0.6 overrides GRPOConfig.temperature=0.9"),
    ({"repetition_penalty": 1.3}, "logits_processor", "repetition_penalty=1.3"),
])
def test_guard_warns_once_on_a_silent_sampler_mistake(option, code, words):
    """The sampler's temperature overridden through generation_kwargs, or a repetition penalty the trainer does
    not apply: the run trains, and the guard warns once naming the option, the measured mismatch and the fix."""
    trainer, _ = _train(op.Correction(weights="mis", bounds=(0.5, 5.0)), "support", steps=1, **option)
    assert len(trainer.guard_warnings) == 1, trainer.guard_warnings
    message = trainer.guard_warnings[0]
    assert f"[{code}]" in message and words in message and "Fix:" in message, message
    logs = [h for h in trainer.state.log_history if "offpolicy/abs_log_ratio_max" in h]
    assert logs[0][f"offpolicy/guard/{code}"] == 1.0
    assert logs[0]["offpolicy/abs_log_ratio_max"] > 1e-3  # the mismatch the guard reports is real


@pytest.mark.parametrize("option", [{"top_p": 0.9}, {"top_k": 5, "top_p": 1.0},
                                    {"top_p": 1.0, "generation_kwargs": {"no_repeat_ngram_size": 2}}])
def test_filtered_sampler_without_replay_is_an_error(option):
    ds = Dataset.from_dict({"prompt": ["w1 w2"] * 4})
    with pytest.raises(ValueError, match=r"the sampler filters its distribution .*record='logprobs' does not replay"):
        OffPolicyGRPOTrainer(model=_model(), reward_funcs=_reward, args=_config(**option), train_dataset=ds,
                             processing_class=_tokenizer(), record="logprobs")


def test_unfiltered_sampler_records_no_support():
    """record='support' at top_p=1, top_k=0: the support would be the whole vocabulary, the log-prob record is exact;
    nothing but lq is recorded and the loss is the float64 reference's without candidates."""
    corr = op.Correction(weights="mis", bounds=(0.5, 5.0))
    trainer, _ = _train(corr, "support", top_p=1.0, steps=1)
    assert trainer.offpolicy_record == "logprobs"
    window = trainer.seen[:2]
    assert all(CANDIDATES_KEY not in s["inputs"] for s in window)
    assert trainer.guard_warnings == []
    got = sum(float(s["loss"]) for s in window)
    ref = float(_reference(window, corr, "logprobs", "token_mean"))
    assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-6), (got, ref)
    ds = Dataset.from_dict({"prompt": ["w1 w2"] * 4})
    with pytest.raises(ValueError, match="would record the whole vocabulary per token.*record='head'"):
        OffPolicyGRPOTrainer(model=_model(), reward_funcs=_reward, args=_config(top_p=1.0), train_dataset=ds,
                             processing_class=_tokenizer(), record="support",
                             correction=op.Correction(weights="mis", score_centering=True))


def test_support_record_memory_at_a_real_vocabulary():
    """V = 152k (Qwen's vocabulary), a peaked sampler at top_p = 0.9: the record of one step holds K = the largest
    realised support entries per row (12 K bytes per token), not V, and the CSR record the generation batch stores
    holds each token's own support: 12 |S_t| + 8 bytes per token (docs/spec.md#record-memory)."""
    v, b = 151_936, 4
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, v, generator=g) * 0.5
    logits[:, :40] += 14.0 + torch.randn(b, 40, generator=g)  # a peaked model: about 40 likely ids per position
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < 0.9
    scores = torch.full_like(logits, float("-inf")).scatter(1, order, torch.where(keep, sorted_p.log(), -torch.inf))
    tokens = torch.multinomial(torch.softmax(scores, -1), 1, generator=g)[:, 0]
    lq, rec = records_from_scores(scores, tokens, "support", 20)
    sizes = keep.sum(-1)
    assert rec.width == int(sizes.max()) < 100  # tens of ids, not the vocabulary
    nbytes = rec.ids.element_size() * rec.ids.numel() + rec.logprobs.element_size() * rec.logprobs.numel()
    assert nbytes == 12 * rec.width * b
    assert torch.equal((rec.ids >= 0).sum(-1), sizes)
    assert torch.allclose(lq, torch.log_softmax(scores, -1).gather(1, tokens[:, None])[:, 0])
    stored = op.CSRCandidates.from_padded(rec)  # what _generate_single_turn keeps of the step
    assert torch.equal(stored.lengths, sizes)
    nbytes = sum(x.element_size() * x.numel() for x in (stored.ids, stored.offsets, stored.logprobs))
    assert nbytes == 12 * int(sizes.sum()) + 8 * (b + 1) <= 12 * int(sizes.sum()) + 16 * b


def test_rejects_options_whose_terms_the_correction_replaces():
    args = trl.GRPOConfig(output_dir=SCRATCH["out"], use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=4, report_to=[],
                          top_entropy_quantile=0.5)
    ds = Dataset.from_dict({"prompt": ["w1 w2"] * 4})
    with pytest.raises(ValueError, match=r"does not support top_entropy_quantile < 1;"):
        OffPolicyGRPOTrainer(model=_model(), reward_funcs=_reward, args=args, train_dataset=ds,
                             processing_class=_tokenizer())


# ---- decoupled PPO: num_iterations > 1 (docs/spec.md#decoupled-ppo) ----

def _generation_logprobs(trainer, s, support, temperature=0.9):
    """float64 ``log pi(y_t)`` ``[B, T]`` of micro-batch ``s`` under a fresh float64 copy of the model as it was at
    that batch's generation, over the recorded support ``S_t`` or the full vocabulary; 0 on untrained tokens."""
    model = _model().double()
    model.load_state_dict(trainer.generation_states[s["generation"]])
    x = s["inputs"]
    t = x["completion_ids"].shape[1]
    with torch.no_grad():
        z = model(input_ids=torch.cat([x["prompt_ids"], x["completion_ids"]], 1),
                  attention_mask=torch.cat([x["prompt_mask"], x["completion_mask"]], 1)).logits[:, -t - 1:-1]
    z = z.double() / temperature
    if support:
        inside = torch.zeros(z.shape[0] * t, z.shape[2], dtype=torch.bool)
        for i, (a, _) in enumerate(_record_rows(x)):
            inside[i, a] = True
        z = z.masked_fill(~inside.view(z.shape), float("-inf"))
    lp = torch.log_softmax(z, -1).gather(2, x["completion_ids"][..., None])[..., 0]
    return torch.where(x["completion_mask"].bool(), lp, torch.zeros_like(lp))


@pytest.fixture(scope="module")
def ppo_run():
    """num_iterations=2, support replay at top_p=0.9: one generation batch (8 rows) trained twice, 2 micro-batches
    per optimizer step; the Correction carries no ppo_clip, so TRL's (epsilon, epsilon_high) is filled in."""
    trainer, _ = _train(op.Correction(weights="mis", bounds=(0.5, 5.0)), "support", num_iterations=2, epsilon=0.1,
                        epsilon_high=0.15)
    return trainer


def test_ppo_second_iteration_loss_equals_float64_reference(ppo_run):
    trainer = ppo_run
    corr = trainer.offpolicy_correction
    assert corr.ppo_clip == (0.1, 0.15) and trainer.offpolicy_proximal_at_generation
    assert len(trainer.generation_states) == 1 and len(trainer.seen) == 4
    window = trainer.seen[2:]  # the second pass over the generation batch, after one optimizer step
    # The clip acts on part of this window: some tokens' p / pi_prox leave [1 - 0.1, 1 + 0.15], some stay inside.
    u = torch.cat([(s["logprobs"] - s["proximal_logprobs"])[s["loss_mask"]] for s in window]).exp()
    outside = ((u < 0.9) | (u > 1.15)).float().mean()
    assert 0.05 < float(outside) < 0.95, float(outside)
    # Reference: float64, from the loss-time logits and the float64 proximal of a fresh copy of the generation-time
    # model (not the adapter's stored values). fp32 trainer vs float64: 1e-4 relative, as the other loss checks.
    prox = [_generation_logprobs(trainer, s, support=True) for s in window]
    got = sum(float(s["loss"]) for s in window)
    ref = float(_reference(window, corr, "support", "token_mean", proximal=prox))
    assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-6), (got, ref)
    # Without the PPO surrogate the same window's loss is another number: the check can tell the two apart.
    plain = float(_reference(window, op.Correction(weights="mis", bounds=(0.5, 5.0)), "support", "token_mean"))
    assert abs(plain - ref) > 100 * 1e-4 * abs(ref), (plain, ref)
    print(f"num_iterations=2, second pass: clipped-ratio fraction {float(outside):.3f}, loss {got:.7f} vs float64 "
          f"{ref:.7f} (without PPO {plain:.7f})")


def test_ppo_stored_proximal_is_support_normalised_at_generation(ppo_run):
    trainer = ppo_run
    # seen[0:2] are the two micro-batches of the generation batch, each row once.
    for s in trainer.seen[:2]:
        m = s["inputs"]["completion_mask"].bool()
        stored = s["inputs"][PROXIMAL_KEY]
        assert stored.shape == s["inputs"]["completion_ids"].shape and stored.dtype == torch.float32
        want = _generation_logprobs(trainer, s, support=True)
        # fp32 forward of a 2-layer width-32 model against float64: rounding ~1e-6 on O(1) log-probs.
        assert float((stored.double() - want)[m].abs().max()) < 1e-5
        assert bool((stored[~m] == 0).all())
        # The full-vocabulary log-probs (TRL's old_per_token_logps) differ by log P(S_t) where top_p cut the support.
        full = _generation_logprobs(trainer, s, support=False)
        assert float((stored.double() - full)[m].abs().max()) > 1e-2
        print(f"stored proximal vs float64 support log-softmax: max |diff| "
              f"{float((stored.double() - want)[m].abs().max()):.2e}; vs full vocabulary "
              f"{float((stored.double() - full)[m].abs().max()):.3f}")
    # record="logprobs": the loss is on the full vocabulary, and so is the stored proximal.
    trainer, _ = _train(op.Correction(), "logprobs", top_p=1.0, steps=1, num_iterations=2)
    assert trainer.offpolicy_correction.ppo_clip == (0.2, 0.2)
    for s in trainer.seen:
        m = s["inputs"]["completion_mask"].bool()
        full = _generation_logprobs(trainer, s, support=False)
        assert float((s["inputs"][PROXIMAL_KEY].double() - full)[m].abs().max()) < 1e-5


def test_ppo_first_iteration_ratio_is_one(ppo_run):
    """The first pass over a generation batch runs the model the proximal log-probs were taken with: p / pi_prox
    is 1 (the clip inactive), and the weights act on pi_prox / q."""
    for s in ppo_run.seen[:2]:
        m = s["loss_mask"]
        assert float((s["logprobs"] - s["proximal_logprobs"])[m].abs().max()) < 1e-6
    # num_iterations=1 with the user's ppo_clip (agreeing with GRPOConfig): no reuse, so pi_prox is the current
    # policy detached, taken from the loss's own hidden states: the ratio is exactly 1 and the loss is the float64
    # reference's with pi_prox = p.
    corr = op.Correction(weights="tis", bounds=(0.0, 2.0), ppo_clip=(0.2, 0.2))
    trainer, _ = _train(corr, "head", top_p=1.0, steps=1)
    assert not trainer.offpolicy_proximal_at_generation
    window = trainer.seen[:2]
    for s in window:
        assert PROXIMAL_KEY not in s["inputs"]
        assert bool((s["logprobs"] == s["proximal_logprobs"]).all())
    current = [torch.log_softmax(s["logits"] / 0.9, -1).gather(2, s["inputs"]["completion_ids"][..., None])[..., 0]
               for s in window]
    got = sum(float(s["loss"]) for s in window)
    ref = float(_reference(window, corr, "head", "token_mean", proximal=current))
    assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-6), (got, ref)


def _config(**kw):
    return trl.GRPOConfig(output_dir=SCRATCH["out"], use_cpu=True, bf16=False, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=4, report_to=[], **kw)


def test_ppo_clip_disagreeing_with_grpo_config_raises():
    ds = Dataset.from_dict({"prompt": ["w1 w2"] * 4})
    with pytest.raises(ValueError, match=r"Correction.ppo_clip=\(0.2, 0.2\) disagrees with GRPOConfig epsilon=0.2, "
                                         r"epsilon_high=0.28"):
        OffPolicyGRPOTrainer(model=_model(), reward_funcs=_reward, args=_config(num_iterations=2, epsilon_high=0.28),
                             train_dataset=ds, processing_class=_tokenizer(),
                             correction=op.Correction(ppo_clip=(0.2, 0.2)))
    # The same holds with num_iterations=1, and for TRL's other surrogate options.
    cases = [
        (op.Correction(ppo_clip=(0.1, 0.1)), {}, r"ppo_clip=\(0.1, 0.1\) disagrees with GRPOConfig epsilon=0.2"),
        (op.Correction(ppo_clip=(0.2, 0.2)), {"delta": 1.5}, r"ppo_delta=None disagrees with GRPOConfig delta=1.5"),
        (op.Correction(ppo_clip=(0.2, 0.2)), {"importance_sampling_level": "sequence"},
         r"ppo_ratio='token' disagrees with GRPOConfig importance_sampling_level='sequence'"),
        (op.Correction(ppo_clip=(0.2, 0.2)), {"loss_type": "cispo", "epsilon_high": 5.0},
         r"cispo=None disagrees with GRPOConfig loss_type='cispo', epsilon_high=5.0"),
        (op.Correction(weights="mis", score_centering=True), {"num_iterations": 2},
         r"cannot be combined with.*score_centering"),
        (op.Correction(), {"num_iterations": 2, "loss_type": "sapo"}, r"loss_type='sapo'.*no offpolicy equivalent"),
        (op.Correction(), {"num_iterations": 2, "loss_type": "cispo", "importance_sampling_level": "sequence"},
         r"loss_type='cispo', importance_sampling_level='sequence'.*no offpolicy equivalent"),
    ]
    for corr, kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            resolve_correction(corr, _config(**kw))
    # Agreeing or absent: kept, or filled in from GRPOConfig when generations are reused.
    agree = op.Correction(ppo_clip=(0.2, 0.28), ppo_delta=1.5)
    assert resolve_correction(agree, _config(epsilon_high=0.28, delta=1.5)) is agree
    assert resolve_correction(op.Correction(), _config()) == op.Correction()
    assert resolve_correction(op.Correction(), _config(num_iterations=2, loss_type="cispo", epsilon_high=5.0)) == \
        op.Correction(cispo=(0.0, 5.0))
    assert resolve_correction(op.Correction(weights="tis"), _config(num_iterations=2, delta=1.5,
                                                                    importance_sampling_level="sequence")) == \
        op.Correction(weights="tis", ppo_clip=(0.2, 0.2), ppo_delta=1.5, ppo_ratio="gspo_token")


# ---------------------------------------------------------------- record boundaries (issue 29, class 6)
#: Fixed completions of the fake generate (4 rows, 5 steps; EOS ids 1 and 9, padding 0 after a stop):
#: the first EOS ends a row and is part of it, a second EOS id stops it too, a row without EOS runs to the end.
FIXED = torch.tensor([[4, 5, 1, 0, 0],    # EOS (1) at step 2: 3 tokens
                      [4, 9, 6, 1, 0],    # the generation config's other EOS id 9 at step 1: 2 tokens
                      [4, 5, 6, 7, 8],    # no EOS: all 5 (truncated)
                      [1, 0, 0, 0, 0]])   # EOS first: 1 token
LENGTHS = [3, 2, 5, 1]


def _boundary_trainer(record):
    model = _model()
    model.generation_config.eos_token_id = [1, 9]
    ds = Dataset.from_dict({"prompt": ["w0 w1", "w2 w3"]})
    args = trl.GRPOConfig(output_dir=SCRATCH["out"], use_cpu=True, per_device_train_batch_size=4,
                          gradient_accumulation_steps=1, num_generations=4, max_completion_length=5, max_steps=1,
                          report_to=[], top_p=1.0 if record == "head" else 0.9, save_strategy="no", seed=0)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=ds,
                                   processing_class=_tokenizer(), record=record, head_k=3)
    g = torch.Generator().manual_seed(3)
    scores = [torch.randn(4, len(WORDS), generator=g) for _ in range(FIXED.shape[1])]
    if record == "support":  # a filtered sampler: -inf outside a random support that holds the sampled token
        for t, s in enumerate(scores):
            s[torch.rand(s.shape, generator=g) < 0.5] = float("-inf")
            s[torch.arange(4), FIXED[:, t]] = torch.randn(4, generator=g)

    def generate(input_ids, generation_config=None, **kwargs):
        seq = torch.cat([input_ids, FIXED[: input_ids.shape[0]]], 1)
        if generation_config is not None and generation_config.return_dict_in_generate:
            return type("Out", (), {"sequences": seq, "scores": tuple(s[: input_ids.shape[0]] for s in scores)})
        return seq

    model.generate = generate
    return trainer, scores


@pytest.mark.parametrize("record", ["support", "head"])
def test_completion_and_records_end_where_trls_completion_ends(record):
    """The adapter's completions, the sampler log-probs and the candidate records end exactly where TRL 1.16's own
    ``_generate_single_turn`` ends the same generated ids: after the first token of any of the generation config's
    EOS ids, that token included; a row without EOS keeps every step. Each ``lq_t`` is
    ``log_softmax(scores_t)[y_t]`` of the post-warper scores of its own step."""
    trainer, scores = _boundary_trainer(record)
    prompts = [[2, 3], [2, 3], [4, 5], [4, 5]]
    ours, lqs = trainer._generate_single_turn(prompts, None, {}, 4)
    records = trainer._offpolicy_pending
    theirs, _ = trl.GRPOTrainer._generate_single_turn(trainer, prompts, None, {}, 4)
    assert ours == theirs == [FIXED[b, :n].tolist() for b, n in enumerate(LENGTHS)]
    for b, n in enumerate(LENGTHS):
        assert len(lqs[b]) == n and isinstance(records[b], op.CSRCandidates) and records[b].num_rows == n
        off = records[b].offsets.tolist()
        for t in range(n):
            want = torch.log_softmax(scores[t][b].double(), -1)[FIXED[b, t]]
            assert lqs[b][t] == pytest.approx(float(want), abs=1e-5)
            ids = records[b].ids[off[t]:off[t + 1]]
            assert int(FIXED[b, t]) in ids.tolist() or record == "head"
            if record == "support":
                assert sorted(ids.tolist()) == torch.isfinite(scores[t][b]).nonzero().flatten().tolist()


def test_generation_batch_records_cover_the_completion_mask_exactly():
    """Through TRL's ``_generate_and_score_completions``: the per-completion CSR records hold a non-empty row exactly
    where TRL's ``completion_mask`` is 1 (EOS included), ``sampling_per_token_logps`` carries the step's ``lq``, and
    no dense support tensor exists: the batch holds no ``[B, T, K]`` tensor and the records' ``nnz`` is the sum of
    the realised supports (the finite post-warper scores of each completion's steps)."""
    trainer, scores = _boundary_trainer("support")
    trainer.model.train()
    out = trainer._generate_and_score_completions([{"prompt": "w0 w1"}] * 4)
    mask = out["completion_mask"].bool()
    assert mask.sum(1).tolist() == LENGTHS
    has = torch.tensor([[len(a) > 0 for a, _ in _record_rows(out)[b * mask.shape[1]:(b + 1) * mask.shape[1]]]
                        for b in range(mask.shape[0])])
    assert torch.equal(has, mask)
    recs = out[CANDIDATES_KEY]
    assert isinstance(recs, list) and all(isinstance(r, op.CSRCandidates) for r in recs)
    assert not any(isinstance(v, torch.Tensor) and v.dim() >= 3 for v in out.values())
    realised = [sum(int(torch.isfinite(scores[t][b]).sum()) for t in range(n)) for b, n in enumerate(LENGTHS)]
    assert [r.nnz for r in recs] == realised
    assert [r.ids.untyped_storage().nbytes() for r in recs] == [8 * k for k in realised]  # not views of a padded one
    for b, n in enumerate(LENGTHS):
        want = [float(torch.log_softmax(scores[t][b], -1)[FIXED[b, t]]) for t in range(n)]
        assert out["sampling_per_token_logps"][b, :n].tolist() == pytest.approx(want, abs=1e-5)


# ---- greedy sampling and the checkpoint's generation_config ----

def _build(record="support", generation_config=None, **options):
    model = _model()
    for k, v in (generation_config or {}).items():
        setattr(model.generation_config, k, v)
    return OffPolicyGRPOTrainer(model=model, reward_funcs=_reward, args=_config(**options),
                                train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * 4}),
                                processing_class=_tokenizer(), record=record)


@pytest.mark.parametrize("options, words", [
    ({"generation_kwargs": {"do_sample": False}}, r"generation_kwargs=\{'do_sample': False\} \(greedy decoding\)"),
    ({"generation_config": {"num_beams": 4}}, r"model.generation_config.num_beams=4 .*\(beam search\)"),
])
def test_a_sampler_that_does_not_sample_is_refused(options, words):
    """Greedy decoding or beam search has no sampling distribution: refused at construction, named, with the fix
    (it used to train and warn only the generic unexplained_mismatch)."""
    with pytest.raises(ValueError, match=rf"the sampler does not sample: {words}.*Fix: drop 'do_sample'"):
        _build(**options)


@pytest.mark.parametrize("gen", [{"suppress_tokens": [5, 6]}, {"bad_words_ids": [[7]]}, {"min_p": 0.05}])
def test_generation_config_filters_count_in_the_construction_check(gen):
    """A filter shipped in the checkpoint's generation_config.json (transformers applies it where TRL's options leave
    it unset) with record='logprobs': refused, naming model.generation_config."""
    key = next(iter(gen))
    with pytest.raises(ValueError, match=rf"filters its distribution \(model.generation_config.{key}=.*"
                                         r"generation_config.json.*record='logprobs' does not replay"):
        _build("logprobs", generation_config=gen, top_p=1.0)


def test_generation_config_suppress_tokens_are_replayed_by_the_support_record():
    """top_p=1 but the checkpoint suppresses tokens 5 and 6: the sampler filters, so record='support' is kept (not
    downgraded to the log-prob record), the support never holds 5 or 6, the loss is the float64 reference's and
    the guard stays silent (before: a log-prob record, off by -log P(S), and only unexplained_mismatch)."""
    corr = op.Correction(weights="mis", bounds=(0.5, 5.0))
    trainer, _ = _train(corr, "support", top_p=1.0, steps=1, generation_config={"suppress_tokens": [5, 6]})
    assert trainer.offpolicy_record == "support" and trainer.guard_warnings == []
    window = trainer.seen[:2]
    for s in window:
        for rec in s["inputs"][CANDIDATES_KEY]:
            assert rec.nnz and not bool(torch.isin(rec.ids, torch.tensor([5, 6])).any())
    got = sum(float(s["loss"]) for s in window)
    ref = float(_reference(window, corr, "support", "token_mean", temperature=0.9))
    assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-6), (got, ref)


def _vllm_records_per_token(completion, logprobs, token_ids, record, head_k):
    """The per-token parsing the colocate path used before (a dict per token), kept as the reference."""
    lq_row, cand_ids, cand_lq = [], [], []
    for tok, lp, tid in zip(completion, logprobs, token_ids):
        entries = {int(i): (float("-inf") if v is None else float(v)) for i, v in zip(tid, lp)}
        lq_row.append(entries[tok])
        finite = {i: v for i, v in entries.items() if v > float("-inf")}
        keep = sorted(finite) if record == "support" else sorted(entries, key=lambda i: -entries[i])[:head_k]
        cand_ids.append(keep)
        cand_lq.append([entries[i] for i in keep])
    return lq_row, cand_ids, cand_lq


def _trl_vllm_output(g, v, t, n, filtered):
    """One completion as TRL's ``VLLMGeneration.generate`` returns it with ``logprobs=n``: per token the top ``n``
    entries by rank plus the sampled token when it is outside them, masked tokens ``-inf`` when ``filtered``."""
    completion, lps, tids = [], [], []
    for _ in range(t):
        logits = torch.randn(v, generator=g) * 2
        logq = torch.log_softmax(logits, -1)
        if filtered:
            cut = int(torch.randint(1, v, (1,), generator=g))
            order = logits.argsort(descending=True)
            logq = torch.full_like(logq, float("-inf")).scatter(0, order[:cut], torch.log_softmax(logits[order[:cut]], -1))
        tok = int(torch.multinomial(logq.exp(), 1, generator=g))
        top = logq.argsort(descending=True, stable=True)[:n].tolist()
        if tok not in top:
            top.append(tok)
        completion.append(tok)
        tids.append(top)
        lps.append([float(logq[i]) for i in top])
    return completion, lps, tids


@pytest.mark.parametrize("record", ["support", "head", "logprobs"])
def test_vllm_row_records_match_the_per_token_parsing(record):
    """The vectorised parsing of vLLM's returned log-probs (colocate) gives the per-token dict parsing's records
    exactly: the sampled tokens' lq, and per token the support's ids ascending or the head's top ``head_k``."""
    from offpolicy.adapters.trl import vllm_row_records

    g = torch.Generator().manual_seed(11)
    v = 40
    filtered = record == "support"
    completion, lps, tids = _trl_vllm_output(g, v, 9, v if filtered else 6, filtered)
    lps[3][1] = None if record != "support" else lps[3][1]  # vLLM's NaN, read as -inf
    if record == "head":
        lps[3][1] = lps[3][0]  # a tie: the order vLLM returned wins
    lq, rec = vllm_row_records(completion, lps, tids, record, 4, v)
    ref_lq, ref_ids, ref_lq_rows = _vllm_records_per_token(completion, lps, tids, record, 4)
    assert lq.tolist() == [torch.tensor(x, dtype=torch.float32).item() for x in ref_lq]
    if record == "logprobs":
        assert rec is None
        return
    assert rec.kind == record and rec.lengths.tolist() == [len(r) for r in ref_ids]
    assert rec.ids.tolist() == [i for r in ref_ids for i in r]
    assert rec.logprobs.tolist() == [torch.tensor(x, dtype=torch.float32).item() for r in ref_lq_rows for x in r]


def test_vllm_row_records_refuse_what_the_per_token_parsing_refused():
    from offpolicy.adapters.trl import vllm_row_records

    ids, lps = [[3, 1], [2, 0]], [[-0.1, -2.5], [-0.3, -1.4]]
    with pytest.raises(RuntimeError, match=r"did not return the sampled token's log-prob \(row 2, step 1\)"):
        vllm_row_records([3, 1], lps, ids, "support", 4, 10, row=2)
    with pytest.raises(ValueError, match=r"all inside the support \(row 0, step 0\)"):
        vllm_row_records([3, 2], lps, ids, "support", 4, 10)
    vllm_row_records([3, 2], lps, ids, "support", 4, 2)  # every id returned: the support is the vocabulary
    with pytest.raises(ValueError, match="record='head' needs unfiltered sampling"):
        vllm_row_records([3, 2], [[-0.1, float("-inf")], [-0.3, -1.4]], ids, "head", 4, 10)
    with pytest.raises(RuntimeError, match="1 log-prob lists and 2 id lists"):
        vllm_row_records([3, 2], lps[:1], ids, "support", 4, 10)


def _calls(fn) -> int:
    """How many Python and C function calls ``fn()`` makes (``sys.setprofile``: a loop over rows or tokens, in
    Python or through torch, shows as a count that grows with them)."""
    import gc
    import sys

    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    fn()  # first-call work (lazy imports, caches) is not the loop we look for
    gc.disable()  # nor a collection's finalizers
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return n


def test_the_records_take_no_python_loop_over_rows_or_tokens():
    """The cost shape without timing: the support record of a generation step makes as many calls for 4 rows as for
    64 (on both paths), and the vLLM parsing of a completion as many for 3 tokens as for 40, while the per-token
    parsing it replaced makes more for more tokens (the count sees a loop)."""
    from offpolicy.adapters.trl import support_record, vllm_row_records

    g = torch.Generator().manual_seed(2)
    for keep in (20, 2000):  # the topk path / the finite-mask path
        calls = []
        for b in (4, 64):
            scores = torch.randn(b, 3000, generator=g)
            scores[:, keep:] = float("-inf")
            calls.append(_calls(lambda: support_record(scores, torch.zeros(b, dtype=torch.long))))
        assert calls[0] == calls[1], (keep, calls)
    calls, before = [], []
    for t in (3, 40):
        completion, lps, tids = _trl_vllm_output(g, 30, t, 30, True)
        calls.append(_calls(lambda: vllm_row_records(completion, lps, tids, "support", 4, 30)))
        before.append(_calls(lambda: _vllm_records_per_token(completion, lps, tids, "support", 4)))
    assert calls[0] == calls[1] and before[1] > before[0], (calls, before)
