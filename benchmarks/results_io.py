"""Saving a benchmark run: one JSON file with everything and one CSV of the result rows, side by side."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` is empty on Linux), or ``""``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def write_results(stem: Path, payload: dict, rows: list[dict], drop: tuple[str, ...] = ()) -> None:
    """Write ``payload`` to ``stem.json`` and ``rows`` to ``stem.csv`` (the union of their keys in first-seen
    order, without ``drop``: per-repetition lists and tracebacks stay in the JSON)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str))
    fields: list[str] = []
    for r in rows:
        fields += [f for f in r if f not in fields and f not in drop]
    with stem.with_suffix(".csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {stem}.json and .csv", flush=True)
