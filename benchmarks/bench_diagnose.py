"""What share of an ``offpolicy diagnose`` run the temperature grid takes, on committed records.

Records: the vLLM 0.32 support responses in ``tests/support/fixtures`` (10 tokens, V = 512) scored by the tiny
Qwen3 they were sampled from (rebuilt from its seed), and reference-sampler support records (288 tokens, V = 48)
from ``tests/support/diagnose_records.py``. Each case is timed with the full grid and with a one-point grid; the
grid's share is ``(t_full - t_one) / t_full * G / (G - 1)``. One intra-op thread.

    python benchmarks/bench_diagnose.py --tag _after
    PYTHONPATH=<tree of an older commit>/src python benchmarks/bench_diagnose.py --tag _before

Writes benchmarks/results/diagnose_grid_<date><tag>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def cases():
    from adapters.test_vllm_live import build_tiny_qwen3
    from offpolicy.adapters import vllm
    from offpolicy.diagnose import from_lines, turn_to_json
    from support.diagnose_records import TinyLM, record
    from support.engine_fixtures import load

    with tempfile.TemporaryDirectory() as d:
        net = build_tiny_qwen3(Path(d) / "model")
    lines = [turn_to_json(parse(load(f"vllm_live_{n}_response.json"), load(f"vllm_live_{n}_request.json")),
                          group="live", version=0)
             for n, parse in (("completions_support", vllm.parse_completion_response),
                              ("generate_support", vllm.parse_generate_response))]
    tiny = TinyLM()
    return {"vllm_fixture_support": (from_lines(lines), net),
            "reference_support": (record(tiny, kind="support", top_p=0.9), tiny)}


def timed(rollouts, model, calls: int) -> float:
    from offpolicy.diagnose import diagnose

    diagnose(rollouts, model=model)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        diagnose(rollouts, model=model)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    import offpolicy.diagnose.scoring as scoring
    import offpolicy.diagnose.semantics as semantics

    full = scoring.TEMPERATURE_GRID
    out = {}
    for name, (rollouts, model) in cases().items():
        t_full = timed(rollouts, model, args.calls)
        for mod in (scoring, semantics):
            mod.TEMPERATURE_GRID = full[:1]
        t_one = timed(rollouts, model, args.calls)
        for mod in (scoring, semantics):
            mod.TEMPERATURE_GRID = full
        share = max(0.0, (t_full - t_one) / t_full * len(full) / (len(full) - 1))
        out[name] = {"tokens": len(rollouts), "grid_points": len(full), "diagnose_s": round(t_full, 5),
                     "one_point_grid_s": round(t_one, 5), "grid_share": round(share, 4)}
        print(f"{name}: {len(rollouts)} tokens, {len(full)} grid points: diagnose {t_full * 1e3:.1f} ms, "
              f"grid {share:.0%} of it")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    meta = {"host": platform.node(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "loadavg": os.getloadavg(), "commit": commit.stdout.strip(), "offpolicy": scoring.__file__,
            "calls": args.calls, "threads": 1}
    path = Path(args.out) / f"diagnose_grid_{meta['date']}{args.tag}.json"
    path.write_text(json.dumps({"meta": meta, "results": out}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
