"""The support-width benchmark (benchmarks/bench_support_width.py) runs end to end at tiny shapes (--quick) and
writes its result files with the fields the docs read (timings are not checked: this is a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_support_width.py"


def test_bench_support_width_quick(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--widths", "0.01,1.0", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    files = sorted(tmp_path.glob("support_width_*_quick_*.json"))
    assert files and files[0].with_suffix(".csv").exists()
    data = json.loads(files[0].read_text())
    assert {"platform", "cpu", "torch", "threads"} <= set(data["machine"]) and data["machine"]["threads"] == 1
    assert len(data["load_average_before"]) == 3 and len(data["load_average_after"]) == 3
    rows = data["results"]
    paths = {"cpu", "torch", "linear"} - set(data["skipped_paths"])
    assert {(r["path"], r["k"]) for r in rows} == {(p, k) for p in paths for k in (3, 256)}
    for r in rows:
        for case in ("support", "norec", "dense", "support+validate"):
            assert len(r["raw_seconds"][case]) == 2 and r["seconds"][case]["min"] > 0
        assert r["support_over_dense"]["min"] <= r["support_over_dense"]["median"] <= r["support_over_dense"]["max"]
