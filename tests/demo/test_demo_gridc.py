"""Grid C's definition and registration: the registered claims name runs the grid makes, Holm's correction and the
p-values that match the interval rule, and every registration committed before the first history of its grid."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest

from offpolicy.demo.claims import direction_p, equivalence_p, holm
from offpolicy.demo.report import PairedDifference, config_key, t_quantile

ROOT = Path(__file__).resolve().parents[2]


def test_grid_c_claims_name_runs_of_the_grid():
    from dataclasses import asdict, fields

    from offpolicy.demo import gridc
    from offpolicy.demo.predictions import GRID_C

    cfgs = gridc.configs_for_seed(gridc.base_config(), 3)
    keys = [config_key(asdict(c)) for c in cfgs]
    assert len(set(keys)) == len(keys) == 18 and len({c.run_id for c in cfgs}) == 18
    assert all(c.seed == 3 for c in cfgs)
    assert {c.staleness for c in cfgs if c.tag == "st4"} == {4.0} and {c.staleness for c in cfgs if not c.tag} == {0}
    labels = [c.label for c in GRID_C.claims]
    assert len(set(labels)) == len(labels)
    for claim in GRID_C.claims:
        for f in fields(claim):
            value = getattr(claim, f.name)
            named = [value] if f.name in ("a", "b", "config", "base") else list(value) if f.name == "configs" else []
            for key in named:
                assert key in keys, (claim.label, key)


def _pair(diff, sd, n):
    return PairedDifference("a", "b", "success_mean", n, diff, t_quantile(0.975, n - 1) * sd / math.sqrt(n))


@pytest.mark.parametrize("diff", [-0.03, -0.011, -0.004, 0.0, 0.004, 0.011, 0.03])
def test_p_values_agree_with_the_interval_rule(diff):
    d = _pair(diff, 0.02, 20)
    for want in (-1, 1):
        hit = (d.diff + d.ci < 0) if want < 0 else (d.diff - d.ci > 0)
        assert (direction_p(d, want) < 0.05) == hit
    inside = -0.01 <= d.diff - d.ci and d.diff + d.ci <= 0.01
    assert (equivalence_p(d, 0.01) < 0.05) == inside
    assert direction_p(PairedDifference("a", "b", "success_mean", 1, diff, math.nan), 1) is None


def test_holm_step_down():
    # sorted: 0.005 <= 0.05/4, 0.01 <= 0.05/3, 0.03 > 0.05/2 stops (0.04 is not rejected though <= 0.05/1)
    assert holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert holm([0.2, 0.3]) == [False, False] and holm([0.01, 0.02]) == [True, True] and holm([]) == []


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


#: (grid, how its registration's commits are found, the folder of its histories). Grids A and B: the commit that
#: added the registration's section to docs/demo.md (which later took the results); grid C: every commit of its own
#: registration file, which is never edited once a history exists.
REGISTRATIONS = [
    ("A", ("-S## Pre-registration of the current regime", "docs/demo.md"), "docs/demo_results/full_gridA"),
    ("B", ("-S## Pre-registration of the current regime", "docs/demo.md"), "docs/demo_results/full_gridB"),
    ("C", ("--follow", "docs/demo_gridC_registration.md"), "docs/demo_results/gridC"),
]


@pytest.mark.parametrize("grid, how, data", REGISTRATIONS, ids=[r[0] for r in REGISTRATIONS])
def test_registration_is_committed_before_the_first_history(grid, how, data):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git history of a checkout")
    option, path = how
    reg = _git("log", option, "--reverse", "--format=%H", "--", path).splitlines()
    assert reg, f"grid {grid}: no commit adds its registration ({path})"
    first_data = _git("log", "--diff-filter=A", "--reverse", "--format=%H", "--", f"{data}/*.runs.json.gz",
                      f"{data}/runs.json.gz").splitlines()
    if grid != "C":
        assert first_data, f"grid {grid}: no committed history under {data}"
    if first_data:
        # strictly earlier: each registration commit is an ancestor of, and not, the first history's commit
        for commit in reg if grid == "C" else reg[:1]:
            assert commit != first_data[0], f"grid {grid}: registration and first history in one commit"
            ok = subprocess.run(["git", "merge-base", "--is-ancestor", commit, first_data[0]], cwd=ROOT).returncode
            assert ok == 0, f"grid {grid}: registration commit {commit[:8]} is not before the first history"


def test_a_grid_c_seed_cut_short_resumes_at_its_first_missing_run(tmp_path):
    """A seed interrupted after its second run keeps both in its partial file; the rerun makes only the rest, and
    its seed file holds every run once, in the grid's order, the partial file gone."""
    import gzip
    import json

    from offpolicy.demo import gridc
    from offpolicy.demo.cli import PARTIAL_SUFFIX, run_grid_c_seed

    cfgs = gridc.configs_for_seed(gridc.base_config(), 3)
    made = []

    def execute(todo, on_done, stop_after=None):
        finished = []
        for c in todo:
            if stop_after is not None and len(finished) == stop_after:
                raise KeyboardInterrupt
            made.append(c.run_id)
            finished.append({"run_id": c.run_id, "history": [c.seed]})
            on_done(finished)
        return finished

    with pytest.raises(KeyboardInterrupt):
        run_grid_c_seed(3, cfgs, tmp_path, {"seed": 3}, lambda t, d: execute(t, d, stop_after=2))
    partial = tmp_path / f"seed3{PARTIAL_SUFFIX}"
    with gzip.open(partial, "rt") as f:
        assert [r["run_id"] for r in json.load(f)["runs"]] == [c.run_id for c in cfgs[:2]]
    assert not (tmp_path / "seed3.runs.json.gz").exists()
    made.clear()
    path = run_grid_c_seed(3, cfgs, tmp_path, {"seed": 3}, execute)
    assert made == [c.run_id for c in cfgs[2:]]
    with gzip.open(path, "rt") as f:
        runs = json.load(f)["runs"]
    assert [r["run_id"] for r in runs] == [c.run_id for c in cfgs] and all(r["grid"] == "C" for r in runs)
    assert not partial.exists()
    made.clear()
    assert run_grid_c_seed(3, cfgs, tmp_path, {"seed": 3}, execute) == path and made == []
    # a partial file of another seed's runs is refused, not mixed in
    with gzip.open(tmp_path / f"seed4{PARTIAL_SUFFIX}", "wt") as f:
        json.dump({"runs": runs[:1]}, f)
    with pytest.raises(ValueError, match="belongs to another grid"):
        run_grid_c_seed(4, gridc.configs_for_seed(gridc.base_config(), 4), tmp_path, {}, execute)


def test_report_only_reads_complete_grid_c_seeds_only(tmp_path, capsys):
    """The documented ``--report-only docs/demo_results/gridC/seed*.runs.json.gz`` also matches a seed's partial
    file: it is skipped with a line saying so, not mixed in; a seed file that lacks runs is refused by name."""
    import gzip
    import json

    from offpolicy.__main__ import main as cli_main

    committed = ROOT / "docs" / "demo_results" / "gridC"
    seed0 = committed / "seed0.runs.json.gz"
    with gzip.open(committed / "seed1.runs.json.gz", "rt") as f:
        data = json.load(f)
    partial = tmp_path / "seed1.partial.runs.json.gz"
    with gzip.open(partial, "wt") as f:
        json.dump({"meta": data["meta"], "runs": data["runs"][:3]}, f)
    out = tmp_path / "report"
    assert cli_main(["demo", "--report-only", str(seed0), str(partial), "--out", str(out), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "skipped" in printed and "seed1.partial.runs.json.gz" in printed
    assert "from 18 runs in 1 file(s)" in printed
    assert cli_main(["demo", "--report-only", str(partial), "--out", str(out), "--no-plots"]) == 2
    assert "every file given is an incomplete grid-C seed" in capsys.readouterr().err
    trimmed = tmp_path / "seed1.runs.json.gz"
    partial.rename(trimmed)
    assert cli_main(["demo", "--report-only", str(seed0), str(trimmed), "--out", str(out), "--no-plots"]) == 2
    assert "grid C seed 1 lacks 15 of its runs (" in capsys.readouterr().err


def test_committed_grid_c_is_complete_and_each_seed_is_one_paired_block():
    """The committed grid C holds its registered 30 seeds (0 .. 29), each with its 18 runs of 200 steps, none with a
    skipped step, and no partial file; within a seed every run starts from one warm-up (one step-0 held-out success):
    the pairing the registration relies on. Seeds ran on two kinds of machine whose warm-ups differ (docs/demo.md),
    so a seed resumed on the other machine would mix two starts; this check is what found seed 11's."""
    import gzip
    import json

    from offpolicy.demo import gridc

    folder = ROOT / "docs" / "demo_results" / "gridC"
    assert not list(folder.glob("*.partial.runs.json.gz"))
    files = {int(p.name.removeprefix("seed").split(".")[0]): p for p in folder.glob("seed*.runs.json.gz")}
    assert sorted(files) == list(range(30))
    for seed, path in sorted(files.items()):
        with gzip.open(path, "rt") as f:
            runs = json.load(f)["runs"]
        want = [c.run_id for c in gridc.configs_for_seed(gridc.base_config(), seed)]
        assert [r["run_id"] for r in runs] == want, seed
        assert all(len(r["history"]) == 200 and not any(h.get("skipped") for h in r["history"]) for r in runs), seed
        starts = {r["evals"][0]["success_exact"] for r in runs}
        assert len(starts) == 1, f"seed {seed}: its runs start from {len(starts)} different warm-ups"
