"""The demo: the task's reward check, its building blocks, and tiny end-to-end runs (seconds) so it cannot rot.
The drift probe and the calibration have their own files (test_demo_probe.py)."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import math

import pytest
import torch

from offpolicy.__main__ import main as cli_main
from offpolicy.demo.arms import ARMS, parse_arms
from offpolicy.demo.cli import build_parser
from offpolicy.demo.simulated_fleet import build_fleet, sampler_copy
from offpolicy.demo.model import ModelConfig, TinyLM
from offpolicy.demo.task import SortTask
from offpolicy.demo.train import EVAL_PROMPT_SEED, RunConfig, pass_at_k, run
from offpolicy.demo.warmup import WarmupConfig, expected_success, warmup

TASK = SortTask(n_items=5, max_value=30, vocab=40)


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
    tail = right.clone()
    tail[:, 0] = TASK.vocab_size - 1  # a tail id (never correct) in place of the right first element
    assert TASK.reward(prompts, tail).tolist() == [0.0, 0.0]
    assert TASK.reward(prompts, right).dtype == torch.float32


def test_scratchpad_is_unscored_and_warmed_up_on_the_tail():
    task = SortTask(n_items=4, max_value=10, vocab=20, scratch=3)
    assert task.answer_len == 7 and task.seq_len == task.prompt_len + 7
    numbers = task.sample_numbers(6, torch.Generator().manual_seed(0))
    prompts, targets = task.prompts(numbers), task.targets(numbers, torch.Generator().manual_seed(1))
    # the warm-up's scratchpad is drawn from the tail ids, the rest is the sorted answer
    assert bool((targets[:, :3] >= task.tail_start).all()) and torch.equal(targets[:, 3:], task.answers(numbers))
    assert task.reward(prompts, targets).tolist() == [1.0] * 6
    # any scratchpad keeps the reward; one wrong scored token loses it
    other = targets.clone()
    other[:, :3] = torch.randint(0, task.vocab, (6, 3), generator=torch.Generator().manual_seed(2))
    assert task.reward(prompts, other).tolist() == [1.0] * 6
    other[:, 3] = (other[:, 3] + 1) % task.max_value
    assert task.reward(prompts, other).tolist() == [0.0] * 6
    with pytest.raises(ValueError, match="tail"):
        SortTask(n_items=4, max_value=10, vocab=12, scratch=1)
    with pytest.raises(ValueError, match="scratch"):
        SortTask(scratch=-1)


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
    assert TASK.vocab_size == 40 and TASK.seq_len == 12
    default = SortTask()
    assert (default.n_items, default.max_value, default.vocab_size, default.seq_len) == (12, 32, 256, 26)
    with pytest.raises(ValueError, match="vocab"):
        SortTask(max_value=30, vocab=31)


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
    assert [a.key for a in parse_arms("all")] == [k for k in ARMS if not ARMS[k].route_replay]
    assert {k for k in ARMS if ARMS[k].route_replay} == {"sc_mis_topp_rr", "rr_tis"}
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
    onpol = build_fleet("onpolicy", 3.0)
    assert [g.group.capacity for g in mixed] == [g.group.capacity for g in homog] == [g.group.capacity for g in onpol]
    assert [g.lag for g in mixed] == [g.lag for g in homog]
    assert all(g.lag == 0.0 for g in onpol)
    cap = sum(g.group.capacity for g in mixed)
    assert sum(g.group.capacity * g.lag for g in mixed) / cap == pytest.approx(3.0)
    assert {g.group.weight_format for g in mixed} == {"nvfp4", "fp8", "bf16"}
    assert {g.group.weight_format for g in homog} == {"bf16"} and all(g.compute == "bf16" for g in homog)
    assert {g.attn_impl for g in homog} == {"sdpa", "math"}
    assert all((g.group.weight_format, g.compute, g.attn_impl) == ("fp32", "fp32", "sdpa") for g in onpol)
    assert {g.group.weight_format for g in build_fleet("mixed", 1.0, weight_format="mxfp4")} == {"mxfp4"}
    with pytest.raises(ValueError, match="fleet"):
        build_fleet("cloud", 1.0)
    with pytest.raises(ValueError, match="staleness"):
        build_fleet("mixed", -1.0)


def test_sampler_copies_have_their_numerics():
    torch.manual_seed(0)
    trainer = TinyLM(ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len))
    mixed = {g.name: g for g in build_fleet("mixed", 1.0)}
    nv = sampler_copy(trainer, mixed["b200-nvfp4"])
    assert nv.head.weight.dtype == torch.bfloat16 and nv.kv_quant is not None
    assert not torch.equal(nv.blocks[0].fc1.weight.float(), trainer.blocks[0].fc1.weight)
    homog = sampler_copy(trainer, build_fleet("homogeneous", 1.0)[1])
    assert homog.head.weight.dtype == torch.bfloat16 and homog.kv_quant is None and homog.attn_impl == "math"
    exact = sampler_copy(trainer, build_fleet("onpolicy", 1.0)[0])
    assert exact.kv_quant is None and torch.equal(exact.blocks[0].fc1.weight, trainer.blocks[0].fc1.weight)
    ids = TASK.prompts(torch.tensor([[1, 2, 3, 4, 5]]))
    p = torch.softmax(trainer(ids).detach(), -1)
    with torch.no_grad():
        gaps = [float((torch.softmax(m(ids).float(), -1) - p).abs().max()) for m in (nv, homog, exact)]
    # NVFP4 weights move q most; bf16 with another kernel a little but not zero; the on-policy copy not at all
    assert gaps[0] > gaps[1] > 1e-6 and gaps[2] < 1e-6


# ------------------------------------------------------------------------------------------ tiny end-to-end runs
TINY_MODEL = ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=16, n_layers=1, n_heads=2,
                         d_ff=32)


def test_run_is_reproducible_and_records_every_metric(tmp_path):
    state, info = warmup(TASK, TINY_MODEL, WarmupConfig(max_steps=5), tmp_path)
    assert not info["cached"]
    again, info2 = warmup(TASK, TINY_MODEL, WarmupConfig(max_steps=5), tmp_path)
    assert info2["cached"] and all(torch.equal(state[k], again[k]) for k in state)
    cfg = RunConfig(arm="sc_mis_topp", fleet="mixed", seed=3, steps=3, prompts=3, samples=2, eval_every=2,
                    eval_prompts=4, eval_samples=4, pass_k=2, probe_prefixes=3)
    a = run(cfg, TASK, TINY_MODEL, state)
    b = run(cfg, TASK, TINY_MODEL, state)
    assert [h["reward"] for h in a["history"]] == [h["reward"] for h in b["history"]]
    assert [h["kl_full"] for h in a["history"]] == [h["kl_full"] for h in b["history"]]
    assert [e["step"] for e in a["evals"]] == [0, 2, 3]
    row = a["history"][-1]
    for key in ("reward", "kl_full", "extreme_full", "tv", "step_kl", "kl_k3_loss", "extreme_loss",
                "grad_norm_preclip", "entropy", "staleness"):
        assert math.isfinite(row[key]), key
    assert row["support_size"] >= 1 and row["step_kl"] >= 0
    # per-group extreme-ratio shares: one per group, nan only for a group that sampled nothing this step
    assert len(row["extreme_by_group"]) == len(a["groups"])
    assert all(0 <= x <= 1 or math.isnan(x) for x in row["extreme_by_group"])
    for key in ("success_exact", "pass@1", "drift_kl_qp", *(f"drift_{k}_{s}" for k in ("along", "masked_mass",
                                                                                       "tail_mass")
                                                          for s in ("pos", "neg"))):
        assert math.isfinite(a["evals"][-1][key]), key
    # the run starts from the warm-up weights: its first exact success is the warm-up's on the same prompts
    numbers = TASK.sample_numbers(4, torch.Generator().manual_seed(EVAL_PROMPT_SEED), heldout=True)
    model = TinyLM(TINY_MODEL)
    model.load_state_dict(state)
    assert a["evals"][0]["success_exact"] == pytest.approx(float(expected_success(model, TASK, numbers).mean()))
    assert sum(g["share_samples"] for g in a["groups"]) == pytest.approx(1.0)


def test_per_group_means_are_over_each_groups_own_tokens():
    from offpolicy.demo.train import _per_group_mean

    out = _per_group_mean(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1, 1]), 3)
    assert out[:2] == pytest.approx([0.5, 2 / 3]) and math.isnan(out[2])


def test_onpolicy_control_has_no_mismatch(tmp_path):
    state, _ = warmup(TASK, TINY_MODEL, WarmupConfig(max_steps=5), tmp_path)
    cfg = RunConfig(arm="grpo", fleet="onpolicy", steps=3, prompts=3, samples=2, eval_every=3, eval_prompts=4,
                    eval_samples=2, pass_k=1, probe_prefixes=3, staleness=2.0)
    res = run(cfg, TASK, TINY_MODEL, state)
    assert all(h["staleness"] == 0 for h in res["history"])
    assert all(abs(h["kl_full"]) < 1e-6 and h["extreme_full"] == 0 for h in res["history"])
    assert all(e["drift_along_pos"] == 0 == e["drift_along_neg"] for e in res["evals"])


def test_runconfig_defaults_match_the_cli():
    args = build_parser().parse_args([])
    assert args.lr == RunConfig.lr and args.staleness == RunConfig.staleness
    assert RunConfig.lr == 1e-4 and RunConfig.staleness == 4.0


TINY_FLAGS = ["--steps", "3", "--prompts", "3", "--samples", "2", "--eval-prompts", "4", "--eval-samples", "4",
              "--pass-k", "2", "--eval-every", "2", "--n-items", "5", "--max-value", "30", "--vocab", "40",
              "--d-model", "16", "--layers", "1", "--heads", "2", "--warmup-max-steps", "5", "--workers", "1"]


def test_tiny_demo_writes_tables_csv_histories_and_figures(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli_main(["demo", "--arms", "grpo,sc_mis_topp", "--fleets", "onpolicy,mixed,homogeneous", "--seeds", "2",
                   "--sweep-arms", "grpo", "--sweep-formats", "nvfp4", *TINY_FLAGS, "--out", str(out),
                   "--cache-dir", str(tmp_path / "cache")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Numerics mismatch" in text and "Paired differences" in text and "grpo@mixed:nvfp4" in text
    for name in ("runs.json.gz", "summary.csv", "configs.csv", "groups.csv", "tables.md"):
        assert (out / name).is_file(), name
    with gzip.open(out / "runs.json.gz", "rt") as f:
        data = json.load(f)
    # per seed: on-policy GRPO, 2 arms x (mixed, homogeneous), the sweep's GRPO on NVFP4 -> 6 runs, 2 seeds
    assert len(data["runs"]) == 12 and all(len(r["history"]) == 3 for r in data["runs"])
    assert data["calibration"]["numerics"] and data["calibration"]["step_kl"]
    assert data["meta"]["command"].startswith("offpolicy demo --arms grpo,sc_mis_topp")
    # what decides bit-reproducibility (docs/demo.md#run-it): the CPU and the instruction set torch dispatches to
    assert data["meta"]["cpu"] and data["meta"]["cpu"] != "unknown"
    assert data["meta"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    with open(out / "configs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and all(r["seeds"] == "2" for r in rows)
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("training.png", "collapse.png", "mismatch.png", "drift.png", "groups.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not (out / "runs.partial.json.gz").exists()
    assert "Pre-registered predictions" in (out / "tables.md").read_text()
    # the committed histories regenerate the same tables
    again = tmp_path / "again"
    assert cli_main(["demo", "--report-only", str(out / "runs.json.gz"), "--out", str(again), "--no-plots"]) == 0
    assert (again / "tables.md").read_text() == (out / "tables.md").read_text()
    assert cli_main(["demo", "--report-only", str(tmp_path / "missing.json.gz")]) == 2
    # a file twice would count its runs twice: refused
    assert cli_main(["demo", "--report-only", str(out / "runs.json.gz"), str(again / "runs.json.gz")]) == 2


def test_calibrate_measures_numerics_and_step_kl(tmp_path, capsys):
    out = tmp_path / "cal"
    rc = cli_main(["demo", "--calibrate", "--calibrate-lrs", "1e-4,1e-3", "--calibrate-steps", "2", *TINY_FLAGS,
                   "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert rc == 0
    data = json.loads((out / "calibration.json").read_text())["calibration"]
    fleets = {r["config"]: r for r in data["numerics"] if r["group"] == "(fleet)"}
    assert abs(fleets["on-policy"]["kl"]) < 1e-9 < fleets["homogeneous"]["kl"] < fleets["mixed (study formats)"]["kl"]
    assert [r["lr"] for r in data["step_kl"]] == [1e-4, 1e-3]
    assert all(r["step_kl_mean"] >= 0 and r["steps"] == 2 for r in data["step_kl"])


def test_cli_errors_and_help(capsys):
    assert cli_main(["demo", "--arms", "nope", "--steps", "1"]) == 2
    assert "unknown arm" in capsys.readouterr().err
    assert cli_main(["demo", "--fleets", "cloud", "--steps", "1", *TINY_FLAGS[2:]]) == 2
    assert "--fleets" in capsys.readouterr().err
    assert cli_main(["bogus"]) == 2
    assert cli_main([]) == 2
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "--help"])
    assert e.value.code == 0


def test_histories_do_not_depend_on_workers_or_run_order(tmp_path):
    """docs/demo.md#run-it: on one machine the histories are bit-identical whatever the worker count and whichever
    configuration a worker process ran before."""
    flags = [*TINY_FLAGS[:-2], "--steps", "2", "--cache-dir", str(tmp_path / "cache"), "--no-plots"]
    runs = {}
    for name, extra in (("both", ["--arms", "grpo,sc_mis_topp", "--workers", "1"]),
                        ("alone", ["--arms", "sc_mis_topp", "--workers", "1"]),
                        ("two_workers", ["--arms", "grpo,sc_mis_topp", "--workers", "2"])):
        assert cli_main(["demo", "--fleets", "mixed", *flags, *extra, "--out", str(tmp_path / name)]) == 0
        with gzip.open(tmp_path / name / "runs.json.gz", "rt") as f:
            runs[name] = {r["run_id"]: (r["history"], r["evals"]) for r in json.load(f)["runs"]}
    key = "sc_mis_topp@mixed/s0"
    assert runs["both"][key] == runs["alone"][key] == runs["two_workers"][key]
    assert runs["both"]["grpo@mixed/s0"] == runs["two_workers"]["grpo@mixed/s0"]


def test_sampler_matrix_products_round_once_like_a_gpu_gemm():
    """``gemm`` / ``linear``: exactly torch's own product in fp32 (the trainer is untouched); in bf16 the float64
    product of the bf16 inputs, rounded once to bf16 (fp32 accumulation of 64-256 products of bf16 values is exact
    to far below one bf16 ulp, so the single rounding decides every output but a rare tie)."""
    from offpolicy.demo.model import gemm, linear

    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(7, 5, 64, generator=g)
    assert torch.equal(linear(lin, x), lin(x))
    a, b = torch.randn(4, 9, 64, generator=g), torch.randn(4, 64, 9, generator=g)
    assert torch.equal(gemm(a, b), a @ b)
    lin16, x16, a16, b16 = lin.to(torch.bfloat16), x.bfloat16(), a.bfloat16(), b.bfloat16()
    want_lin = (x16.double() @ lin16.weight.double().T + lin16.bias.double()).to(torch.bfloat16)
    want_mm = (a16.double() @ b16.double()).to(torch.bfloat16)
    got_lin, got_mm = linear(lin16, x16), gemm(a16, b16)
    assert got_lin.dtype == got_mm.dtype == torch.bfloat16
    assert (got_lin != want_lin).float().mean() < 1e-3 and (got_mm != want_mm).float().mean() < 1e-3
    ulp = 2.0 ** -7
    assert torch.allclose(got_lin.float(), want_lin.float(), rtol=ulp, atol=0)
