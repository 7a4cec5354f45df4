"""The report's statistics (intervals, pairing, collapse flags) and the prediction verdicts, on synthetic runs."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from offpolicy.demo.predictions import predictions_text
from offpolicy.demo.report import mean_ci, t_quantile, paired, seed_spread_table, seeds_needed, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_mean_ci_is_the_student_t_interval():
    xs = [0.1, 0.4, 0.25]
    mean, half = mean_ci(xs)
    assert mean == pytest.approx(0.25)
    assert half == pytest.approx(4.303 * statistics.stdev(xs) / math.sqrt(3), rel=1e-4)
    assert math.isnan(mean_ci([0.3])[1]) and mean_ci([0.3])[0] == 0.3
    assert all(math.isnan(v) for v in mean_ci([]))
    xs30 = [math.sin(i) for i in range(30)]  # the grids' 30 seeds: df = 29, not the normal 1.96
    assert mean_ci(xs30)[1] == pytest.approx(2.045 * statistics.stdev(xs30) / math.sqrt(30), rel=2e-4)


#: Two-sided 95 % quantiles (t_{0.975, df}) as printed in standard statistical tables (3 decimals), written out here
#: independently of the report's own computation.
T975_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
              11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
              20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
              29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 80: 1.990, 100: 1.984, 120: 1.980}


@pytest.mark.parametrize("df", sorted(T975_TABLE))
def test_t_quantile_matches_the_printed_table(df):
    assert t_quantile(0.975, df) == pytest.approx(T975_TABLE[df], abs=6e-4)


def test_t_quantile_other_levels_and_bad_arguments():
    assert t_quantile(0.95, 29) == pytest.approx(1.699, abs=6e-4)
    assert t_quantile(0.995, 29) == pytest.approx(2.756, abs=6e-4)
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-8)
    for p, df in ((1.0, 5), (0.4, 5), (0.975, 0)):
        with pytest.raises(ValueError, match="t_quantile"):
            t_quantile(p, df)


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
    assert s.collapsed and s.success_change == pytest.approx(-0.13)
    assert s.kl_blowup and s.kl_growth == pytest.approx(3.0)
    s = summarize(_run("grpo", "mixed", 0, [0.25, 0.2, 0.13], [0.01] * 20))
    assert not s.collapsed and not s.kl_blowup
    # float noise (the on-policy control's KL) tripling is no blow-up
    s = summarize(_run("grpo", "onpolicy", 0, [0.25, 0.3], [1e-11] * 10 + [3e-11] * 10))
    assert not s.kl_blowup and math.isnan(s.kl_growth)


def test_clipped_share_is_reported_per_run_and_configuration():
    """The share of optimizer steps whose pre-clip norm exceeded the clip (the registration of grid C promises it per
    configuration): from the histories' ``clipped`` record, a column of the gradient-norm table; absent where the
    histories do not record it (the earlier regime)."""
    from offpolicy.demo.report import tables_text

    runs = []
    for seed, n_clipped in enumerate([3, 5]):
        r = _run("grpo", "mixed", seed, [0.25, 0.3], [0.01] * 20)
        for i, h in enumerate(r["history"]):
            h["clipped"] = i < n_clipped
        runs.append(r)
    assert [summarize(r).extra["clipped"] for r in runs] == [pytest.approx(0.15), pytest.approx(0.25)]
    grad_table = tables_text(runs).split("Gradient norm (before clipping) and entropy:", 1)[1].split("\n\n", 1)[0]
    assert "share of steps clipped" in grad_table.splitlines()[1]
    assert "| 0.200 ± 0.635 |" in grad_table  # mean 0.2, t_{0.975,1} 12.706 x sd 0.0707 / sqrt(2)
    plain = [_run("grpo", "mixed", 0, [0.25, 0.3], [0.01] * 20)]
    assert "clipped" not in summarize(plain[0]).extra and "steps clipped" not in tables_text(plain)


def test_paired_differences_use_shared_seeds_only():
    summary = [summarize(_run("sc_mis", "mixed", s, [0.25, v], [0.01] * 10))
               for s, v in enumerate([0.30, 0.32, 0.31])]
    summary += [summarize(_run("grpo", "mixed", s, [0.25, v], [0.01] * 10)) for s, v in enumerate([0.28, 0.31])]
    d = paired(summary, "sc_mis@mixed", "grpo@mixed")
    assert d.seeds == 2 and d.diff == pytest.approx(0.015)
    assert d.ci == pytest.approx(12.706 * statistics.stdev([0.02, 0.01]) / math.sqrt(2), rel=1e-4)
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


def _run_now(arm: str, fleet: str, seed: int, success: list[float], grad: float = 1.0) -> dict:
    """A run in the current record format (pre-clip gradient norm, drift probe at both signs)."""
    r = _run(arm, fleet, seed, success, [0.01] * 10)
    for h in r["history"]:
        h["grad_norm_preclip"] = h.pop("grad_norm") * grad
    for e in r["evals"]:
        along = e.pop("drift_along")
        e.update(drift_along_pos=-along, drift_along_neg=along)
    return r


def test_seeds_needed_is_the_registered_formula():
    # ((1.959964 + 0.841621) * 0.01 / 0.01)^2 + 1.959964^2 / 2 = 9.77 -> 10; equivalence uses z_0.9 -> 12.43 -> 13
    assert seeds_needed(0.01, 0.01) == 10
    assert seeds_needed(0.01, 0.01, equivalence=True) == 13
    assert seeds_needed(0.02, 0.01) == math.ceil(4 * 2.801585 ** 2 + 1.959964 ** 2 / 2)
    assert seeds_needed(0.0, 0.01) == 2
    with pytest.raises(ValueError, match="delta"):
        seeds_needed(0.01, 0.0)


def test_seed_spread_uses_the_primary_outcome_paired():
    runs = [_run_now("grpo", "onpolicy", s, [0.25, 0.30, 0.30 + 0.01 * s]) for s in range(3)]
    runs += [_run_now("grpo", "mixed", s, [0.25, 0.28, 0.28 + 0.02 * s]) for s in range(3)]
    (row,) = seed_spread_table(runs)
    # success_mean averages the evaluations after the start: per seed 0.28 + 0.01 s and 0.30 + 0.005 s
    diffs = [(0.28 + 0.01 * s) - (0.30 + 0.005 * s) for s in range(3)]
    assert (row.a, row.b, row.seeds) == ("grpo@mixed", "grpo@onpolicy", 3)
    assert row.diff == pytest.approx(statistics.fmean(diffs))
    assert row.sd == pytest.approx(statistics.stdev(diffs))
    assert row.seeds_needed == seeds_needed(row.sd, 0.01)


def test_current_predictions_headline_margins_and_void_rule():
    runs = [_run_now("grpo", "onpolicy", s, [0.25, 0.30 + 0.01 * s]) for s in range(3)]
    runs += [_run_now("grpo", "mixed", s, [0.25, 0.20 + 0.005 * s], grad=20.0) for s in range(3)]
    runs += [_run_now("sc_mis_topp", "mixed", s, [0.25, 0.301 + 0.01 * s]) for s in range(3)]
    text = predictions_text(runs)
    assert "not void" in text.splitlines()[0]
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert lines["H1 GRPO on the mixed fleet below the on-policy control"].endswith("| hit |")
    assert lines["H2 SC+MIS+top-p on the mixed fleet holds (equivalent to on-policy)"].endswith("| hit |")
    assert lines["H3 SC+MIS+top-p above GRPO, mixed fleet"].endswith("| hit |")
    assert lines["S7 GRPO on the homogeneous fleet also below on-policy"].endswith("| not run |")
    # a difference of 0.02 is outside the margin: "holds" misses
    worse = runs[:6] + [_run_now("sc_mis_topp", "mixed", s, [0.25, 0.28 + 0.01 * s]) for s in range(3)]
    lines = {line.split(" | ")[0].lstrip("| "): line for line in predictions_text(worse).splitlines()
             if line.startswith("| ")}
    assert lines["H2 SC+MIS+top-p on the mixed fleet holds (equivalent to on-policy)"].endswith("| miss |")
    # a control that does not rise voids every verdict that was run
    flat = [_run_now("grpo", "onpolicy", s, [0.25, 0.24 + 0.001 * s]) for s in range(3)] + runs[3:]
    text = predictions_text(flat)
    assert "VOID" in text.splitlines()[0] and "| hit |" not in text and "| void |" in text


@pytest.mark.parametrize("folder", ["quick", "quick_stale4", "earlier_quick", "earlier_full", "full_gridA", "full_gridB",
                                    "quick_xeon", "gridC"])
def test_report_only_regenerates_the_committed_tables_byte_for_byte(folder, tmp_path, capsys):
    from offpolicy.__main__ import main as cli_main

    committed = ROOT / "docs" / "demo_results" / folder
    # a grid committed seed by seed holds one history file per seed; the report reads them all
    histories = sorted(committed.glob("seed*.runs.json.gz")) or [committed / "runs.json.gz"]
    assert cli_main(["demo", "--report-only", *map(str, histories), "--out", str(tmp_path), "--no-plots"]) == 0
    names = [n for n in ("tables.md", "summary.csv", "configs.csv", "groups.csv") if (committed / n).exists()]
    assert "tables.md" in names
    for name in names:
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), f"{folder}/{name} differs"


def _verdict_rows(text: str) -> list[str]:
    """The body rows of the first verdict table (``| prediction | measured | verdict |``) in ``text``."""
    table = text.split("| prediction | measured | verdict |", 1)[1].split("\n\n", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| ")]


@pytest.mark.parametrize(("grid", "folder", "claims"), [("A", "full_gridA", 17), ("B", "full_gridB", 17),
                                                     ("C", "gridC", 20)])
def test_docs_verdict_table_is_the_committed_report(grid, folder, claims):
    """docs/demo.md's verdict table for a grid is the committed tables.md's prediction rows, each and in order (grid
    C's with its p-value and after-Holm columns)."""
    doc = (ROOT / "docs" / "demo.md").read_text()
    section = doc.split(f"## Grid {grid}: ", 1)[1].split("\n## ", 1)[0]
    tables = (ROOT / "docs" / "demo_results" / folder / "tables.md").read_text()
    want = _verdict_rows(tables)
    got = [line.replace("\\|", "|").replace("**miss**", "miss") for line in _verdict_rows(section)]
    assert len(want) == claims and got == want


def test_registered_claims_name_real_configurations():
    """Every claim of both registrations has its own label and names configurations the demo can run."""
    from dataclasses import fields

    from offpolicy.demo.arms import ARMS
    from offpolicy.demo.predictions import CURRENT, EARLIER
    from offpolicy.demo.simulated_fleet import FLEETS, WEIGHT_FORMATS

    for registration in (CURRENT, EARLIER):
        labels = [c.label for c in registration.claims]
        assert len(set(labels)) == len(labels)
        for claim in registration.claims:
            for f in fields(claim):
                value = getattr(claim, f.name)
                if f.name in ("a", "b", "config", "base"):
                    arm, _, fleet = value.partition("@")
                    fleet, _, fmt = fleet.partition(":")
                    assert arm in ARMS and fleet in FLEETS and (not fmt or fmt in WEIGHT_FORMATS), (claim, value)


def test_reading_note_names_staleness_when_no_homogeneous_fleet_ran():
    """The former quick demo (on-policy control and the mixed fleet at staleness 4) must not read as mixed precision's
    cost: its printed summary and figure say the gap mixes staleness with numerics."""
    from offpolicy.demo.report import reading_note

    def run(fleet, staleness):
        return {"config": {"fleet": fleet, "staleness": staleness}}

    quick = reading_note([run("onpolicy", 4.0), run("mixed", 4.0)])
    assert "staleness plus numerics" in quick and "No homogeneous fleet" in quick and "grid A" in quick
    assert not quick.startswith("Staleness 0")
    both = reading_note([run("onpolicy", 4.0), run("mixed", 4.0), run("homogeneous", 4.0)])
    assert "staleness plus numerics" in both and "No homogeneous fleet" not in both
    fresh = reading_note([run("onpolicy", 0.0), run("mixed", 0.0), run("homogeneous", 0.0)])
    assert fresh.startswith("Staleness 0") and "numerics alone" in fresh and "stale" not in fresh.split(":", 1)[1]
    assert reading_note([run("onpolicy", 0.0)]) == ""


def test_reading_note_of_grid_c_runs_names_route_flips_one_seed_and_the_top_p_control():
    """Grid C's quick demo: numerics alone with the routes the NVFP4 samplers flip, one seed an illustration, top-p
    arms only against the on-policy top-p control; a staleness-4 run beside them is named as such."""
    from offpolicy.demo.report import reading_note

    def run(arm, fleet, fmt="seed", staleness=0.0, flips=(float("nan"),)):
        return {"grid": "C", "config": {"arm": arm, "fleet": fleet, "weight_format": fmt, "staleness": staleness,
                                        "seed": 0}, "history": [{"route_flip": f} for f in flips]}

    runs = [run("grpo", "onpolicy", flips=(0.0,)), run("grpo", "mixed", "nvfp4", flips=(0.03, 0.05)),
            run("grpo_topp", "onpolicy", flips=(0.0,)), run("sc_mis_topp", "mixed", "nvfp4", flips=(0.04,))]
    note = reading_note(runs)
    assert "numerics alone" in note and "NVFP4 4.0 % of routes" in note
    assert "One seed: an illustration, not evidence; grid C (docs/demo_gridC_registration.md" in note
    assert "only with the on-policy top-p control" in note and "stale on average" not in note
    without_control = reading_note(runs[:2] + runs[3:])
    assert "top-p control" not in without_control
    st4 = reading_note(runs + [run("grpo", "mixed", "nvfp4", staleness=4.0)])
    assert "4 optimizer steps stale on average in the runs so marked" in st4 and "numerics alone" in st4
