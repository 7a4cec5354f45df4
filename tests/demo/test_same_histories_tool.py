"""``tools/demo_same_histories.py``: the check cited for "the current code gives the frozen grid's histories"."""

import copy
import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "demo_same_histories.py"


def _write(path: Path, doc: dict) -> str:
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return str(path)


def _run(*paths: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *paths], capture_output=True, text=True, timeout=60)


def test_only_wall_clock_may_differ(tmp_path):
    run = {"config": {"arm": "grpo", "fleet": "mixed", "seed": 0}, "seconds": 3.2,
           "history": [{"step": 0, "reward": 0.25, "kl_full": 0.0123}, {"step": 1, "reward": 0.5, "kl_full": 0.02}],
           "evals": [{"step": 0, "success_exact": 0.25}]}
    doc = {"meta": {"date": "x", "seconds": 10.0}, "calibration": {"kl": 0.1}, "runs": [run]}
    other = copy.deepcopy(doc)
    other["runs"][0]["seconds"] = 9.9
    other["meta"]["date"] = "y"
    a, b = _write(tmp_path / "a.json.gz", doc), _write(tmp_path / "b.json.gz", other)
    ok = _run(a, b)
    assert ok.returncode == 0 and "1 of 1 runs identical: same histories" in ok.stdout

    # one value in the last bit printed is a difference, named with where it is
    other["runs"][0]["history"][1]["kl_full"] = 0.020001
    bad = _run(a, _write(tmp_path / "c.json.gz", other))
    assert bad.returncode == 1 and "history[1].kl_full" in bad.stdout and "DIFFERENT" in bad.stdout

    # a history cut short is a difference too
    other = copy.deepcopy(doc)
    other["runs"][0]["history"].pop()
    short = _run(a, _write(tmp_path / "d.json.gz", other))
    assert short.returncode == 1 and "length 2 against 1" in short.stdout
