"""The report's statistics (intervals, pairing, collapse flags) and the prediction verdicts, on synthetic runs."""

from __future__ import annotations

import math
import statistics

import pytest

from offpolicy.demo.report import mean_ci, paired, predictions_text, summarize


def test_mean_ci_is_the_student_t_interval():
    xs = [0.1, 0.4, 0.25]
    mean, half = mean_ci(xs)
    assert mean == pytest.approx(0.25)
    assert half == pytest.approx(4.303 * statistics.stdev(xs) / math.sqrt(3))
    assert math.isnan(mean_ci([0.3])[1]) and mean_ci([0.3])[0] == 0.3
    assert all(math.isnan(v) for v in mean_ci([]))


def _run(arm: str, fleet: str, seed: int, success: list[float], kl: list[float], fmt: str = "seed") -> dict:
    history = [dict(reward=0.3, kl_full=k, extreme_full=0.0, tv=0.01, step_kl=1e-4, kl_k3_loss=k, extreme_loss=0.0,
                    staleness=0.5, grad_norm=1.0, entropy=0.5) for k in kl]
    evals = [dict(step=i, success_exact=s, **{"pass@1": s, "pass@2": s}, drift_along=-1e-3 if arm == "grpo" else 0.0,
                  drift_masked_mass=0.0, drift_tail_mass=0.0) for i, s in enumerate(success)]
    return {"run_id": f"{arm}@{fleet}/s{seed}", "label": arm,
            "config": dict(arm=arm, fleet=fleet, seed=seed, weight_format=fmt, pass_k=2),
            "history": history, "evals": evals, "groups": []}


def test_collapse_and_kl_blowup_flags():
    s = summarize(_run("grpo", "mixed", 0, [0.25, 0.2, 0.12], [0.01] * 10 + [0.03] * 10))
    assert s["collapsed"] and s["success_change"] == pytest.approx(-0.13)
    assert s["kl_blowup"] and s["kl_growth"] == pytest.approx(3.0)
    s = summarize(_run("grpo", "mixed", 0, [0.25, 0.2, 0.13], [0.01] * 20))
    assert not s["collapsed"] and not s["kl_blowup"]
    # float noise (the on-policy control's KL) tripling is no blow-up
    s = summarize(_run("grpo", "onpolicy", 0, [0.25, 0.3], [1e-11] * 10 + [3e-11] * 10))
    assert not s["kl_blowup"] and math.isnan(s["kl_growth"])


def test_paired_differences_use_shared_seeds_only():
    summary = [summarize(_run("sc_mis", "mixed", s, [0.25, v], [0.01] * 10))
               for s, v in enumerate([0.30, 0.32, 0.31])]
    summary += [summarize(_run("grpo", "mixed", s, [0.25, v], [0.01] * 10)) for s, v in enumerate([0.28, 0.31])]
    d = paired(summary, "sc_mis@mixed", "grpo@mixed")
    assert d["seeds"] == 2 and d["diff"] == pytest.approx(0.015)
    assert d["ci"] == pytest.approx(12.706 * statistics.stdev([0.02, 0.01]) / math.sqrt(2))
    assert paired(summary, "sc_mis@mixed", "grpo@homogeneous") is None


def test_prediction_verdicts():
    runs = [_run("grpo", "onpolicy", s, [0.25, 0.30 + 0.01 * s], [0.0] * 10) for s in range(3)]
    runs += [_run("grpo", "mixed", s, [0.25, 0.20 + 0.005 * s], [0.01] * 10) for s in range(3)]
    text = predictions_text(runs)
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[2:]}
    assert lines["1 on-policy control does not degrade, rises"].endswith("| hit |")
    assert lines["2 no run collapses, no KL blow-up"].endswith("| hit |")
    assert lines["3 GRPO mixed below on-policy"].endswith("| hit |")
    assert lines["4 SC+MIS mixed above GRPO mixed"].endswith("| not run |")
    assert lines["6 dose-response"].endswith("| not run |")
    flipped = [_run("grpo", "onpolicy", s, [0.25, 0.20], [0.0] * 10) for s in range(3)]
    assert "| miss |" in predictions_text(flipped).splitlines()[2]
