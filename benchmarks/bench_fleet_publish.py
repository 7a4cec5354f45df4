"""Seconds per weight publish on the live fleet's disk channel: each group quantising the version for itself
(before) against the channel quantising it once per weight format (after), engine-free.

    PYTHONPATH=src python benchmarks/bench_fleet_publish.py --out docs/fleet_results/publish_formats/result.json

"Per publish" is the trainer's ``publish`` plus, before, every group's own ``group_checkpoint`` + write (what
``EngineGroup.sync`` did per group); the engine reload, the same in both, is left out. The model is the live toy
run's (``toy_run.build_tiny_qwen3``); the fleet is ``--fleet`` (name:format pairs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from offpolicy.adapters.fleet_live import DiskWeightChannel, weight_sync
from offpolicy.adapters.fleet_live.toy_run import build_tiny_qwen3


def one_run(state, fleet, per_format: bool, versions: int, root: Path) -> dict[str, object]:
    from safetensors.torch import save_file

    formats = sorted({f for _, f in fleet}) if per_format else []
    ch = DiskWeightChannel(root / "weights", formats=formats)
    calls = {"n": 0}
    real = weight_sync.fake_quantize

    def counted(t, fmt):
        calls["n"] += 1
        return real(t, fmt)

    weight_sync.fake_quantize = counted
    group_bytes, times = 0, []
    try:
        for v in range(versions):
            t0 = time.perf_counter()
            ch.publish(state, v)
            if not per_format:  # each group: fetch, quantise, write its own checkpoint
                for name, fmt in fleet:
                    d = root / "groups" / name / f"v{v:06d}"
                    d.mkdir(parents=True)
                    save_file(weight_sync.group_checkpoint(ch.fetch(v), fmt), str(d / "model.safetensors"))
                    group_bytes += (d / "model.safetensors").stat().st_size
            times.append(time.perf_counter() - t0)
    finally:
        weight_sync.fake_quantize = real
    return {"seconds_per_publish_median": statistics.median(times), "seconds_per_publish_min": min(times),
            "seconds_per_publish_max": max(times), "quantiser_calls_per_publish": calls["n"] / versions,
            "bytes_written_per_publish": (ch.bytes_written + group_bytes) / versions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fleet", default="b200:nvfp4,b300:nvfp4,h100:fp8,h200:fp8")
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    fleet = [tuple(p.split(":")) for p in args.fleet.split(",")]
    torch.set_num_threads(1)
    state = {k: v.detach().clone() for k, v in build_tiny_qwen3(None).state_dict().items()}
    result = {"command": "PYTHONPATH=src python benchmarks/bench_fleet_publish.py " + " ".join(
                  f"--{k} {v}" for k, v in [("fleet", args.fleet), ("versions", args.versions), ("out", args.out)]),
              "model": "toy_run.build_tiny_qwen3 (2-layer Qwen3, hidden 128, vocab 128)",
              "parameters": sum(t.numel() for t in state.values()), "fleet": args.fleet,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, LOADED (shared with other jobs and a "
                         "test suite): absolute seconds are noisy, the ratio is the point", "torch_threads": 1}
    for label, per_format in (("before_per_group", False), ("after_per_format", True)):
        with tempfile.TemporaryDirectory() as tmp:
            result[label] = one_run(state, fleet, per_format, args.versions, Path(tmp))
    result["speedup_median"] = (result["before_per_group"]["seconds_per_publish_median"]
                                / result["after_per_format"]["seconds_per_publish_median"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
