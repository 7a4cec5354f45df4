"""Compare two demo outputs (``runs.json.gz``): the check that a change of code left a grid's histories unchanged.

    .venv/bin/python tools/demo_same_histories.py A/runs.json.gz B/runs.json.gz

Each run's configuration, per-step history, evaluations, probes and per-group totals must be equal, value for value
(the files hold floats to 6 significant digits); only the wall-clock fields (``seconds``) may differ. Prints one
line per run and a verdict, and exits 1 on any difference.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

#: Fields that measure the machine, not the run.
TIMING = frozenset({"seconds"})


def _load(path: str) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only in one" for k in sorted(set(a) ^ set(b)) if k not in TIMING]
        for k in sorted(set(a) & set(b) - TIMING):
            out += _differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} against {b!r}"]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    missing = [p for p in argv if not Path(p).is_file()]
    if missing:
        print(f"not a file: {', '.join(missing)} (expected a demo output's runs.json.gz)")
        return 2
    a, b = (_load(p) for p in argv)
    if len(a["runs"]) != len(b["runs"]):
        print(f"{len(a['runs'])} runs against {len(b['runs'])}: different grids")
        return 1
    bad = 0
    for ra, rb in zip(a["runs"], b["runs"]):
        cfg = ra["config"]
        diffs = _differences(ra, rb)
        bad += bool(diffs)
        steps = len(ra.get("history", []))
        print(f"{cfg['arm']}@{cfg['fleet']} seed {cfg['seed']}: {steps} steps, "
              + ("identical" if not diffs else f"{len(diffs)} differences, first {diffs[0]}"))
    calibration = _differences(a.get("calibration"), b.get("calibration"))
    print("calibration: " + ("identical" if not calibration else f"{len(calibration)} differences"))
    same = not bad and not calibration
    print(f"{len(a['runs']) - bad} of {len(a['runs'])} runs identical: " + ("same histories" if same else "DIFFERENT"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
