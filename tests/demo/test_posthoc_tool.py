"""``tools/demo_posthoc.py``: the post-hoc pairs docs/demo.md cites agree with the registered report where they meet."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "demo_results"


@pytest.mark.parametrize("grid", ["full_gridA", "full_gridB"])
def test_posthoc_pairs_match_the_reports_headline_and_name_themselves_post_hoc(grid):
    folder = RESULTS / grid
    files = sorted(map(str, folder.glob("seed*.runs.json.gz")))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "demo_posthoc.py"), *files], capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("Post hoc (not registered; no verdict rests on it)")
    assert f"seeds 0 .. {len(files) - 1} ({len(files)})" in text
    # H1's pair, computed by the tool, is the registered report's H1 row to the printed digits
    tables = (folder / "tables.md").read_text()
    h1 = re.search(r"\| H1 .*? success_mean grpo@mixed - grpo@onpolicy: ([+-][\d.]+ ± [\d.]+) \(n = (\d+)\)", tables)
    assert h1, "H1 row missing from the committed tables"
    assert f"| against the control | grpo@mixed - grpo@onpolicy | {h1.group(1)} | {h1.group(2)} |" in text
    # the mixed - homogeneous rows are labelled by the grid's staleness: on top of staleness 4 (A), alone at 0 (B)
    label = {"full_gridA": "numerics on top of staleness", "full_gridB": "numerics alone (staleness 0)"}[grid]
    assert f"| {label} | grpo@mixed - grpo@homogeneous |" in text
    # Holm's table: its "registered verdict" column (p < 0.05) is the registered report's verdict for every interval
    # claim, so the p-values follow the registration's interval rule exactly; a claim kept after Holm was a hit
    verdicts = dict(re.findall(r"^\| ((?:H|S|D)\d\w* [^|]*?) \| [^\n]* \| (hit|miss) \|$", tables, re.M))
    holm = re.findall(r"^\| ((?:H|S|D)\d\w* [^|]*?) \| [^|]* \| [^|]* \| (hit|miss) \| (hit|miss) \|$", text, re.M)
    assert len(holm) == 12
    for label, registered, after in holm:
        assert verdicts[label] == registered, label
        assert after == "miss" or registered == "hit", label
    # the committed post-hoc file is this output
    assert (folder / "posthoc.md").read_text() == text


def test_posthoc_names_a_missing_file(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "demo_posthoc.py"), str(tmp_path / "nope.json.gz")],
                         capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "not a file" in out.stderr and "nope.json.gz" in out.stderr


def test_grid_c_posthoc_pairs_match_the_registered_report():
    """Grid C's post-hoc file is the tool's output on the committed seeds, labels itself post hoc, and its pairs
    agree with the registered report where they meet (C1's pair, S5a's, R3's)."""
    folder = RESULTS / "gridC"
    files = sorted(str(p) for p in folder.glob("seed*.runs.json.gz") if ".partial." not in p.name)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "demo_posthoc.py"), *files], capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("Post hoc (not registered; no verdict rests on it)") and "Grid C" in text
    assert f"seeds 0 .. {len(files) - 1} ({len(files)})" in text
    tables = (folder / "tables.md").read_text()
    for label, a, b, why in (("C1", "grpo@mixed:nvfp4", "grpo@onpolicy", "numerics alone, by format"),
                             ("S5a", "sc_mis@mixed:nvfp4", "grpo@onpolicy", "NVFP4 arm against the control"),
                             ("R3", "rr_tis@mixed:nvfp4", "grpo@mixed:nvfp4",
                              "routing replay + TIS against GRPO, same format")):
        row = re.search(rf"\| {label} .*? success_mean {re.escape(a)} - {re.escape(b)}: ([+-][\d.]+ ± [\d.]+) "
                        rf"\(n = (\d+)\)", tables)
        assert row, f"{label} row missing from the committed tables"
        assert f"| {why} | {a} - {b} | {row.group(1)} | {row.group(2)} |" in text, label
    assert (folder / "posthoc.md").read_text() == text
