"""The quick demo (``offpolicy demo`` with no run flag): grid C's contrast at staleness 0 on a tiny stand-in of grid
C's task and model, and which flags select it (any other run flag runs the dense toy, the former quick run)."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest
import torch

from offpolicy.__main__ import main as cli_main
from offpolicy.demo import gridc
from offpolicy.demo import warmup as warmup_module
from offpolicy.demo.cli import QUICK_C_RUNS, build_parser, is_quick_c
from offpolicy.demo.model import ModelConfig, TinyLM
from offpolicy.demo.task import SortTask


def _args(argv: list[str]):
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args


@pytest.mark.parametrize("argv, quick_c", [
    ([], True),
    (["--quick", "--steps", "20", "--eval-every", "5", "--seeds", "2", "--workers", "1", "--out", "x",
      "--cache-dir", "c", "--no-plots"], True),
    (["--arms", "grpo,sc_mis_topp", "--fleets", "onpolicy,mixed"], False),   # the former quick run: dense toy
    (["--staleness", "4"], False),                                            # a default value, given: still a run flag
    (["--lr", "1e-4"], False),
    (["--grid", "C"], False),
    (["--calibrate"], False),
    (["--report-only", "runs.json.gz"], False),
])
def test_which_flags_select_the_quick_grid_c_contrast(argv, quick_c):
    assert is_quick_c(_args(argv)) is quick_c


def test_a_namespace_without_argv_is_judged_by_its_values():
    args = build_parser().parse_args([])
    assert is_quick_c(args)
    args.staleness = 0.0
    assert not is_quick_c(args)


def test_quick_demo_runs_grid_c_contrast_at_staleness_0_and_says_so(tmp_path, monkeypatch, capsys):
    """Tiny stand-ins for grid C's task, model, warm-up and batch sizes (the real ones take minutes); grid C's other
    registered run settings (MIS band, gradient clip, learning rate, top-p) are used as they are."""
    task = SortTask(n_items=4, max_value=20, vocab=32, scratch=2)
    model = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=16, n_layers=1, n_heads=2,
                        d_ff=32, n_experts=4, top_k=2)
    monkeypatch.setattr(gridc, "task", lambda: task)
    monkeypatch.setattr(gridc, "model_config", lambda t=None: model)
    seen = {}

    def no_warmup(t, m, cfg, cache):   # the freshly initialised policy stands in for the warmed-up one
        seen["cfg"] = cfg
        torch.manual_seed(0)
        return TinyLM(m).state_dict(), {"steps": 0, "success": 0.0, "seconds": 0.0, "cached": False}

    monkeypatch.setattr(warmup_module, "warmup", no_warmup)
    real_base = gridc.base_config
    monkeypatch.setattr(gridc, "base_config", lambda **kw: real_base(**dict(
        kw, prompts=3, samples=2, eval_prompts=4, eval_samples=2, pass_k=1, probe_prefixes=3)))
    out = tmp_path / "out"
    assert cli_main(["demo", "--steps", "2", "--eval-every", "2", "--workers", "1", "--out", str(out),
                     "--cache-dir", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    # grid C's own warm-up settings (the same cache entry as the grid's)
    assert seen["cfg"] == warmup_module.WarmupConfig(target_success=0.25, max_steps=3000)
    with gzip.open(out / "runs.json.gz", "rt") as f:
        data = json.load(f)
    runs = data["runs"]
    assert [(r["config"]["arm"], r["config"]["fleet"], r["config"]["weight_format"]) for r in runs] == list(QUICK_C_RUNS)
    for r in runs:
        assert r["grid"] == "C" and r["quick"] is True and len(r["history"]) == 2
        assert r["config"]["staleness"] == 0.0 and all(h["staleness"] == 0 for h in r["history"])
        assert tuple(r["config"]["mis_bounds"]) == gridc.SETTINGS["mis_bounds"]
        assert r["config"]["grad_clip"] == gridc.SETTINGS["grad_clip"]
    assert data["meta"]["grid"] == "C" and data["meta"]["quick"] is True
    tables = (out / "tables.md").read_text()
    assert "nucleus, after start (Y_p)" in tables and "route flips" in tables
    assert "Pre-registered predictions (docs/demo_gridC_registration.md)" in tables
    verdicts = [line for line in tables.splitlines() if line.startswith("| C") or line.startswith("| S")]
    labels = [line.split(" | ")[0] for line in verdicts]
    assert any(x.startswith("| C1 ") for x in labels) and any(x.startswith("| C2 ") for x in labels)
    assert any(x.startswith("| C3 ") for x in labels) and any(x.startswith("| S7 ") for x in labels)
    assert all("undecided (one seed)" in line for line in verdicts) and "not run" not in tables
    assert not any(x.startswith("| S6 ") for x in labels)   # it ranks all seven NVFP4 arms: not three of them
    c2 = next(line for line in verdicts if line.startswith("| C2 "))
    assert "success_topp_mean sc_mis_topp@mixed:nvfp4 - grpo_topp@onpolicy" in c2
    for text in (printed, tables):
        assert "Staleness 0" in text and "numerics alone" in text and "mixture-of-experts routes" in text
        assert "One seed: an illustration, not evidence" in text and "docs/demo_gridC_registration.md" in text
        assert "only with the on-policy top-p control" in text and "stale on average" not in text
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("contrast.png", "training.png", "collapse.png", "mismatch.png", "groups.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    # the committed histories regenerate the same tables
    again = tmp_path / "again"
    assert cli_main(["demo", "--report-only", str(out / "runs.json.gz"), "--out", str(again), "--no-plots"]) == 0
    assert (again / "tables.md").read_text() == tables
