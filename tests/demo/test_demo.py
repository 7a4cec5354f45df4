"""The demo: the task's reward check, its building blocks, and a tiny end-to-end run (seconds) so it cannot rot."""

from __future__ import annotations

import csv
import importlib.util
import json
import math

import pytest
import torch

from offpolicy.__main__ import main as cli_main
from offpolicy.demo.arms import ARMS, parse_arms
from offpolicy.demo.simulated_fleet import build_fleet, sampler_copy
from offpolicy.demo.model import ModelConfig, TinyLM
from offpolicy.demo.task import SortTask
from offpolicy.demo.train import RunConfig, pass_at_k, run
from offpolicy.demo.warmup import WarmupConfig, expected_success, warmup

TASK = SortTask(n_items=5, max_value=30)


# ----------------------------------------------------------------------------------------------- the reward check
def test_reward_exact_sorted_answer_only():
    numbers = torch.tensor([[3, 1, 2, 2, 0], [29, 0, 15, 7, 7]])
    prompts = TASK.prompts(numbers)
    right = torch.tensor([[0, 1, 2, 2, 3], [0, 7, 7, 15, 29]])
    assert TASK.reward(prompts, right).tolist() == [1.0, 1.0]
    wrong = right.clone()
    wrong[0, 4] = 4  # one wrong element
    wrong[1] = torch.tensor([29, 15, 7, 7, 0])  # right multiset, wrong order (descending)
    assert TASK.reward(prompts, wrong).tolist() == [0.0, 0.0]
    unsorted = numbers.clone()  # the prompt copied back unsorted
    assert TASK.reward(prompts, unsorted).tolist() == [0.0, 0.0]
    dropped_dup = torch.tensor([[0, 1, 2, 3, 3], [0, 7, 15, 29, 29]])  # a duplicate lost
    assert TASK.reward(prompts, dropped_dup).tolist() == [0.0, 0.0]
    markers = torch.full((2, 5), TASK.sep)  # marker tokens are simply wrong answers
    assert TASK.reward(prompts, markers).tolist() == [0.0, 0.0]
    assert TASK.reward(prompts, right).dtype == torch.float32


def test_reward_matches_python_sort_on_random_lists():
    gen = torch.Generator().manual_seed(0)
    numbers = TASK.sample_numbers(200, gen)
    prompts = TASK.prompts(numbers)
    answers = torch.tensor([sorted(row) for row in numbers.tolist()])
    assert TASK.reward(prompts, answers).sum() == 200
    perturbed = answers.clone()
    perturbed[:, 2] = (perturbed[:, 2] + 1) % TASK.max_value
    assert TASK.reward(prompts, perturbed).sum() == 0


def test_reward_rejects_bad_shapes_and_prompts():
    prompts = TASK.prompts(torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="responses"):
        TASK.reward(prompts, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="prompts"):
        TASK.reward(prompts[:, 1:], torch.zeros(2, 5, dtype=torch.int64))
    bad = prompts.clone()
    bad[0, 0] = 3
    with pytest.raises(ValueError, match="BOS"):
        TASK.reward(bad, torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="numbers"):
        TASK.prompts(torch.full((1, 5), 30))


def test_prompt_layout_and_vocabulary():
    p = TASK.prompts(torch.tensor([[4, 3, 2, 1, 0]]))
    assert p.tolist() == [[TASK.bos, 4, 3, 2, 1, 0, TASK.sep]]
    assert TASK.vocab_size == 32 and TASK.seq_len == 12


def test_heldout_split_is_disjoint_and_stable():
    gen = torch.Generator().manual_seed(1)
    train = TASK.sample_numbers(500, gen)
    held = TASK.sample_numbers(100, gen, heldout=True)
    assert not TASK.is_heldout(train).any()
    assert TASK.is_heldout(held).all()
    assert train.shape == (500, 5) and held.shape == (100, 5)
    # about one list in heldout_mod is held out
    frac = TASK.is_heldout(torch.randint(0, 30, (20000, 5), generator=gen)).float().mean()
    assert abs(float(frac) - 1 / TASK.heldout_mod) < 0.01


# ------------------------------------------------------------------------------------------------ building blocks
def test_pass_at_k_estimator():
    c = torch.tensor([0, 1, 4, 8])
    assert pass_at_k(8, c, 1).tolist() == pytest.approx([0.0, 1 / 8, 0.5, 1.0])
    # 1 - C(n-c, k) / C(n, k)
    expected = [1 - math.comb(8 - x, 4) / math.comb(8, 4) for x in c.tolist()]
    assert pass_at_k(8, c, 4).tolist() == pytest.approx(expected)


def test_expected_success_is_the_probability_of_the_answer():
    torch.manual_seed(0)
    model = TinyLM(ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=16, n_layers=1,
                               n_heads=2, d_ff=32))
    numbers = torch.tensor([[5, 1, 9, 0, 2]])
    seq = torch.cat([TASK.prompts(numbers), TASK.answers(numbers)], 1)
    logp = torch.log_softmax(model(seq[:, :-1]).detach(), -1)
    manual = sum(float(logp[0, TASK.prompt_len - 1 + i, seq[0, TASK.prompt_len + i]]) for i in range(5))
    assert float(expected_success(model, TASK, numbers)) == pytest.approx(math.exp(manual), rel=1e-5)


def test_parse_arms():
    assert [a.key for a in parse_arms("all")] == list(ARMS)
    assert [a.key for a in parse_arms("sc_mis_topp, grpo")] == ["sc_mis_topp", "grpo"]
    with pytest.raises(ValueError, match="unknown"):
        parse_arms("grpo,ppo")
    with pytest.raises(ValueError, match="duplicate"):
        parse_arms("grpo,grpo")
    assert ARMS["sc_mis_topp"].top_p and ARMS["sc_mis_topp"].correction.score_centering
    assert ARMS["grpo"].correction.weights == "none" and not ARMS["grpo"].top_p


def test_fleets_share_slots_and_staleness():
    mixed = build_fleet("mixed", 3.0)
    homog = build_fleet("homogeneous", 3.0)
    assert [g.group.capacity for g in mixed] == [g.group.capacity for g in homog]
    assert [g.lag for g in mixed] == [g.lag for g in homog]
    cap = sum(g.group.capacity for g in mixed)
    assert sum(g.group.capacity * g.lag for g in mixed) / cap == pytest.approx(3.0)
    assert {g.group.weight_format for g in mixed} == {"nvfp4", "fp8", "bf16"}
    assert {g.group.weight_format for g in homog} == {"fp32"} and all(g.compute == "fp32" for g in homog)
    assert {g.group.weight_format for g in build_fleet("mixed", 1.0, weight_format="mxfp4")} == {"mxfp4"}
    with pytest.raises(ValueError, match="fleet"):
        build_fleet("cloud", 1.0)
    with pytest.raises(ValueError, match="staleness"):
        build_fleet("mixed", -1.0)


def test_sampler_copies_have_their_numerics():
    torch.manual_seed(0)
    trainer = TinyLM(ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len))
    mixed = {g.name: g for g in build_fleet("mixed", 1.0)}
    homog = build_fleet("homogeneous", 1.0)[0]
    nv = sampler_copy(trainer, mixed["b200-nvfp4"])
    assert nv.head.weight.dtype == torch.bfloat16 and nv.kv_quant is not None
    assert not torch.equal(nv.blocks[0].fc1.weight.float(), trainer.blocks[0].fc1.weight)
    same = sampler_copy(trainer, homog)
    assert same.kv_quant is None and torch.equal(same.blocks[0].fc1.weight, trainer.blocks[0].fc1.weight)
    ids = TASK.prompts(torch.tensor([[1, 2, 3, 4, 5]]))
    with torch.no_grad():
        drift = (torch.softmax(nv(ids).float(), -1) - torch.softmax(trainer(ids), -1)).abs().max()
        kernel = (torch.softmax(same(ids), -1) - torch.softmax(trainer(ids), -1)).abs().max()
    assert float(drift) > 1e-4 > float(kernel)  # quantised numerics move q; another kernel barely does


# ------------------------------------------------------------------------------------------ tiny end-to-end runs
TINY_MODEL = ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=16, n_layers=1, n_heads=2,
                         d_ff=32)


def test_run_is_reproducible_and_records_every_metric(tmp_path):
    state, info = warmup(TASK, TINY_MODEL, WarmupConfig(max_steps=5), tmp_path)
    assert not info["cached"]
    again, info2 = warmup(TASK, TINY_MODEL, WarmupConfig(max_steps=5), tmp_path)
    assert info2["cached"] and all(torch.equal(state[k], again[k]) for k in state)
    cfg = RunConfig(arm="sc_mis_topp", fleet="mixed", seed=3, steps=3, prompts=3, samples=2, eval_every=2,
                    eval_prompts=4, eval_samples=4, pass_k=2)
    a = run(cfg, TASK, TINY_MODEL, state)
    b = run(cfg, TASK, TINY_MODEL, state)
    assert [h["reward"] for h in a["history"]] == [h["reward"] for h in b["history"]]
    assert [h["kl_k3"] for h in a["history"]] == [h["kl_k3"] for h in b["history"]]
    assert [e["step"] for e in a["evals"]] == [0, 2, 3]
    row = a["history"][-1]
    for key in ("reward", "kl_k3", "kl_exact", "tv", "extreme_ratio_frac", "grad_norm", "entropy", "staleness"):
        assert math.isfinite(row[key]), key
    assert row["support_size"] >= 1
    assert sum(g["share_samples"] for g in a["groups"]) == pytest.approx(1.0)


def test_tiny_demo_writes_tables_csv_json_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli_main(["demo", "--arms", "grpo,sc_mis_topp", "--fleets", "mixed,homogeneous", "--steps", "3",
                   "--prompts", "3", "--samples", "2", "--eval-prompts", "4", "--eval-samples", "4",
                   "--pass-k", "2", "--eval-every", "2", "--d-model", "16", "--layers", "1", "--heads", "2",
                   "--warmup-max-steps", "5", "--workers", "1", "--out", str(out),
                   "--cache-dir", str(tmp_path / "cache")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "## Arms" in text and "SC+MIS+top-p" in text and "Per sampler group" in text
    for name in ("results.json", "summary.csv", "arms.csv", "groups.csv", "history.csv", "evals.csv",
                 "tables.md", "meta.json"):
        assert (out / name).is_file(), name
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 4 and len(data["summary"]) == 4
    with open(out / "history.csv") as f:
        assert len(list(csv.DictReader(f))) == 4 * 3
    with open(out / "groups.csv") as f:
        assert len(list(csv.DictReader(f))) == 4 * 6
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("curves.png", "pass_at_k.png", "groups.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_cli_errors_and_help(capsys):
    assert cli_main(["demo", "--arms", "nope", "--steps", "1"]) == 2
    assert "unknown arm" in capsys.readouterr().err
    assert cli_main(["bogus"]) == 2
    assert cli_main([]) == 2
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "--help"])
    assert e.value.code == 0
