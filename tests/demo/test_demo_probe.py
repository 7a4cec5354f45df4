"""The drift probe against closed forms, and the calibration's step KL on a policy that does learn."""

from __future__ import annotations

import pytest
import torch

from offpolicy.demo.arms import ARMS
from offpolicy.demo.mismatch import step_kl_table
from offpolicy.demo.model import ModelConfig
from offpolicy.demo.probe import drift_readouts, expected_update, make_probe_set
from offpolicy.demo.task import SortTask
from offpolicy.demo.warmup import WarmupConfig, warmup


def _pair(seed: int, n: int = 5, v: int = 40, noise: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z = 2.0 * torch.randn(n, v, generator=gen)
    logq = torch.log_softmax(z + noise * torch.randn(n, v, generator=gen), dim=-1)
    return z, logq


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_expected_update_is_advantage_times_q_minus_p(seed):
    z, logq = _pair(seed, n=3 + seed, v=17 + 5 * seed)
    p, q = torch.softmax(z.double(), -1), logq.double().exp()
    for a in (-1.0, 2.5):
        u = expected_update(z, logq, ARMS["grpo"], top_p=0.95, head_k=4, advantage=a)
        torch.testing.assert_close(u.double(), a * (q - p), atol=2e-6, rtol=1e-4)
    r = drift_readouts(z, logq, expected_update(z, logq, ARMS["grpo"], 0.95, 4), ARMS["grpo"], tail_start=10)
    assert r["along"] == pytest.approx(-float(((q - p) ** 2).sum(-1).mean()), rel=1e-4)
    assert r["kl_qp"] == pytest.approx(float((q * (logq.double() - torch.log(p))).sum(-1).mean()), rel=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_mis_expected_update_is_the_unmasked_on_policy_score(seed):
    # MIS weight p/q on kept tokens: E_q[w (e_y - p)] = sum_{y kept} p_y (e_y - p), independent of q but the mask
    z, logq = _pair(seed)
    p = torch.softmax(z.double(), -1)
    ratio = p / logq.double().exp()
    kept = (ratio >= 0.5) & (ratio <= 5.0)
    expected = -1.0 * ((p * kept) - (p * kept).sum(-1, keepdim=True) * p)
    u = expected_update(z, logq, ARMS["grpo_mis"], top_p=0.95, head_k=8)
    torch.testing.assert_close(u.double(), expected, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("arm", ["sc_mis", "sc_mis_topp"])
def test_score_centering_with_mis_has_no_drift(arm):
    # exact with a full record (every token a candidate; the top-p support is full by construction)
    z, logq = _pair(3)
    u = expected_update(z, logq, ARMS[arm], top_p=0.95, head_k=z.shape[1])
    r = drift_readouts(z, logq, u, ARMS[arm], tail_start=30)
    grpo = drift_readouts(z, logq, expected_update(z, logq, ARMS["grpo"], 0.95, 8), ARMS["grpo"], 30)
    assert abs(r["along"]) < 1e-4 * abs(grpo["along"])
    assert abs(r["masked_mass"]) < 1e-6 and abs(r["tail_mass"]) < 1e-6


def test_score_centering_with_a_head_record_leaves_little_drift():
    # a top-8 head models the tail's sampler mass as rho * p: a small residual, far below GRPO's
    z, logq = _pair(3)
    r = drift_readouts(z, logq, expected_update(z, logq, ARMS["sc_mis"], 0.95, 8), ARMS["sc_mis"], 30)
    grpo = drift_readouts(z, logq, expected_update(z, logq, ARMS["grpo"], 0.95, 8), ARMS["grpo"], 30)
    assert 0 < abs(r["along"]) < 0.05 * abs(grpo["along"])


def test_no_mismatch_means_no_update_for_every_arm_but_top_p_without_replay():
    z, _ = _pair(4)
    logq = torch.log_softmax(z, -1)
    for arm in ARMS.values():
        u = expected_update(z, logq, arm, top_p=0.95, head_k=8)
        # equal numerics, yet top-p without mask replay still moves p: the action spaces differ
        if arm.key == "grpo_topp_noreplay":
            assert float(u.abs().max()) > 1e-3
        else:
            assert float(u.abs().max()) < 1e-5, arm.key


def test_expected_update_rejects_mismatched_shapes():
    z, logq = _pair(0)
    with pytest.raises(ValueError, match="logq"):
        expected_update(z, logq[:, :-1], ARMS["grpo"], 0.95, 8)


def test_probe_set_is_fixed_and_held_out():
    task = SortTask(n_items=4, max_value=20, vocab=30)
    a, b = make_probe_set(task, 6, seed=1), make_probe_set(task, 6, seed=1)
    assert torch.equal(a.seqs, b.seqs) and torch.equal(a.pos, b.pos) and a.seqs.shape[0] == 12
    assert bool(task.is_heldout(a.seqs[:, 1:1 + task.n_items]).all())
    assert bool(((a.pos >= 0) & (a.pos < task.answer_len)).all())
    with pytest.raises(ValueError, match="probe"):
        make_probe_set(task, 0, seed=1)


def test_step_kl_grows_with_the_learning_rate(tmp_path):
    # a task small enough that a tiny model solves it sometimes after a short warm-up, so GRPO has a gradient
    task = SortTask(n_items=2, max_value=6, vocab=12, heldout_mod=4)
    cfg = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    state, info = warmup(task, cfg, WarmupConfig(target_success=0.3, max_steps=400, batch=32, lr=1e-2, probe=64),
                         tmp_path)
    assert 0.05 < info["success"] < 0.95
    rows = step_kl_table(task, cfg, state, [1e-4, 3e-3], steps=3)
    assert 0 < rows[0]["step_kl_mean"] < rows[1]["step_kl_mean"]


def test_grpo_top_p_without_replay_scores_the_full_vocabulary():
    # Without mask replay the trainer's p is the full-vocabulary softmax while the sampler draws from its top-p
    # support q_s: GRPO's expected update is a (q_s - p), mass outside the support included; replay differs.
    from offpolicy.fleet.sampler import support_mask

    z, logq = _pair(3, n=4, v=23, noise=0.3)
    keep = support_mask(logq, top_p=0.8)
    q_s = torch.where(keep, logq.double().exp(), 0.0)
    q_s = q_s / q_s.sum(-1, keepdim=True)
    p = torch.softmax(z.double(), -1)
    u = expected_update(z, logq, ARMS["grpo_topp_noreplay"], top_p=0.8, head_k=4, advantage=1.0)
    torch.testing.assert_close(u.double(), q_s - p, atol=2e-6, rtol=1e-4)
    replay = expected_update(z, logq, ARMS["grpo_topp"], top_p=0.8, head_k=4, advantage=1.0)
    assert float((replay.double() - u.double()).abs().max()) > 1e-3


def test_probe_has_both_advantage_signs_at_the_prefixes_that_have_them():
    task = SortTask(n_items=4, max_value=20, vocab=30, scratch=2)
    probes = make_probe_set(task, 5, seed=2)
    assert probes.advantage.tolist() == [1.0] * 5 + [-1.0] * 5
    prompts, answers = probes.seqs[:, :task.prompt_len], probes.seqs[:, task.prompt_len:]
    # a = +1: the answer after the scratchpad is correct; a = -1: its first scored token is wrong, so no
    # continuation can earn reward, and the probed position lies after it
    assert task.reward(prompts[:5], answers[:5]).tolist() == [1.0] * 5
    assert task.reward(prompts[5:], answers[5:]).tolist() == [0.0] * 5
    assert bool((probes.pos[5:] > task.scratch).all())
    first = task.prompt_len + task.scratch
    assert torch.equal(probes.seqs[5:, first + 1:], task.answers(probes.seqs[5:, 1:1 + task.n_items])[:, 1:])


def test_drift_probe_reads_grpo_toward_q_at_positive_and_away_at_negative_advantage(tmp_path):
    from offpolicy.demo.model import TinyLM
    from offpolicy.demo.simulated_fleet import build_fleet
    from offpolicy.demo.train import RunConfig, probe_drift

    task = SortTask(n_items=3, max_value=10, vocab=20)
    cfg = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    state, _ = warmup(task, cfg, WarmupConfig(max_steps=5), tmp_path)
    trainer = TinyLM(cfg)
    trainer.load_state_dict(state)
    groups = build_fleet("mixed", 0.0)
    probes = make_probe_set(task, 4, seed=0)
    out = probe_drift(trainer, groups, task, RunConfig(arm="grpo", fleet="mixed"), probes)
    assert out["along_pos"] > 0 > out["along_neg"]
    assert out["kl_qp"] > 0
