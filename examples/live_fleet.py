"""A live heterogeneous fleet: engine groups of different numerics (vLLM on CPU, one Ray actor and one process
each) sample a tiny Qwen3's sessions; the trainer in this process learns from whatever they return, publishes its
weights after every step, and prints the per-group mismatch table as it goes. Needs ``ray``, ``vllm`` and
``matplotlib`` (``bash tools/setup_vllm_env.sh`` installs all three in ``.venv-vllm``):

    bash tools/setup_vllm_env.sh
    PYTHONPATH=src .venv-vllm/bin/python examples/live_fleet.py --steps 30 --groups cpu-bf16:bf16,cpu-nvfp4:nvfp4
    PYTHONPATH=src .venv-vllm/bin/python examples/live_fleet.py --sync-every 3 --max-staleness 1
    RAY_AUTH_MODE=token PYTHONPATH=src .venv-vllm/bin/python examples/live_fleet.py --address auto   # a cluster
    PYTHONPATH=src .venv-vllm/bin/python examples/live_fleet.py --object-store   # weights through Ray, no folder
    PYTHONPATH=src .venv/bin/python examples/live_fleet.py --replot docs/fleet_results/live/history.json

Writes the trainer's state to ``trainer.pt`` every ``--checkpoint-every`` steps; a rerun with the same ``--out``
resumes from it (the engines load the restored weights as a new version). Writes ``history.json`` under ``--out``
after every step (so a stopped run leaves its history so far): per step the
reward, loss, the trainer's version, turns per group, trained tokens per staleness, per-group and per-staleness KL,
extreme-ratio share and ESS, and every session (id, and per turn its group, served version and tokens); then the
final table, each process's memory, the run's time, the fleet's events and ``audit`` (sessions sent / trained /
duplicated / incomplete / lost) and ``checks`` (what :func:`~offpolicy.adapters.fleet_live.toy_run.check_history` finds
wrong: a step repeated or skipped, a session trained twice, a served version that disagrees with the tokens'
stamps; empty when nothing). At the end ``history.png`` (reward, per-group KL, per-staleness KL and step time
per step). ``--attribute-every k``: every ``k``-th step's per-group attribution of the mismatch (staleness /
format / residual shares of mean ``|log r|``) goes into that step's ``attribution`` and is printed with the table.
``--replot`` only redraws ``history.png`` beside an existing ``history.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from offpolicy.adapters.fleet_live import EngineSettings, LiveFleet, ObjectStoreWeightChannel, RayObjectStore
from offpolicy.adapters.fleet_live.group_attribution import attribution_table
from offpolicy.adapters.fleet_live.history_plot import write_history_plot
from offpolicy.adapters.fleet_live.toy_run import (
    RunConfig,
    audit,
    build_tiny_qwen3,
    check_history,
    resumed_history,
    train,
)
from offpolicy.fleet import SamplerGroup

KEPT_METRICS = ("kl_k3", "extreme_ratio_frac", "num_tokens", "ess")


def parse_groups(spec: str) -> list[SamplerGroup]:
    """``name:format[:capacity],...`` into groups (accelerator ``"CPU"``, fp32 KV cache)."""
    groups = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise SystemExit(f"--groups: expected name:format[:capacity], got {item!r}")
        groups.append(SamplerGroup(parts[0], "CPU", parts[1], "fp32", float(parts[2]) if len(parts) == 3 else 1.0))
    return groups


def write_json(path: Path, record: dict) -> None:
    """Replace ``path`` atomically (a reader never sees half a history)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--groups", default="cpu-bf16:bf16,cpu-nvfp4:nvfp4")
    ap.add_argument("--address", default=None, help="Ray cluster address (set RAY_AUTH_MODE=token); default local")
    ap.add_argument("--kv-cache-mib", type=int, default=None, help="KV cache per engine (CPU default 64)")
    ap.add_argument("--sync-every", type=int, default=1, help="a group loads new weights when this many behind")
    ap.add_argument("--max-staleness", type=int, default=None,
                    help="the most versions a trained token may be behind the trainer at its optimizer step")
    ap.add_argument("--max-restarts", type=int, default=2, help="restarts of a dead or hung group before it is dropped")
    ap.add_argument("--out", default=None, help="output directory (default a temporary one); a rerun with the same "
                    "one resumes from its trainer.pt")
    ap.add_argument("--checkpoint-every", type=int, default=1, help="write the trainer's state every this many steps")
    ap.add_argument("--attribute-every", type=int, default=None,
                    help="attribute every this many steps' mismatch per group (staleness / format / residual)")
    ap.add_argument("--object-store", action="store_true",
                    help="publish the weights through Ray's object store (RayObjectStore: no folder shared with the "
                         "engines) instead of a folder under --out")
    ap.add_argument("--replot", default=None, metavar="HISTORY_JSON", help="only redraw history.png beside it")
    args = ap.parse_args()
    if args.replot is not None:
        src = Path(args.replot)
        print(f"plot: {write_history_plot(json.loads(src.read_text()), src.with_name('history.png'))}")
        return
    t0 = time.monotonic()
    out = Path(args.out or tempfile.mkdtemp(prefix="live_fleet_"))
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_qwen3(out / "model")
    groups = parse_groups(args.groups)
    cfg = RunConfig(steps=args.steps)
    channel = None  # the default: a private folder under --out, quantised once per format
    if args.object_store:
        channel = ObjectStoreWeightChannel(RayObjectStore(), formats=sorted({g.weight_format for g in groups}))
    fleet = LiveFleet(groups, out / "model", out, settings=EngineSettings(kv_cache_mib=args.kv_cache_mib),
                      address=args.address, sync_every=args.sync_every, max_staleness=args.max_staleness,
                      max_restarts=args.max_restarts, channel=channel)
    ckpt = out / "trainer.pt"
    done = resumed_history(ckpt)  # a rerun with the same --out resumes after these steps
    record: dict = {"command": " ".join(sys.argv), "groups": [vars(g) for g in groups], "resumed_at": len(done),
                    "steps": [json.loads(json.dumps(dict(vars(h), metrics={k: v for k, v in h.metrics.items()
                                                                              if k.split("/")[-1] in KEPT_METRICS}),
                                                    default=str)) for h in done]}
    try:
        start_s = fleet.start()
        record["start_s"] = start_s
        print(f"{len(groups)} engine groups started in {start_s:.1f} s", flush=True)
        if done:  # train() publishes the checkpoint's weights, past every version the channel holds
            print(f"resuming after step {done[-1].step} from {ckpt}", flush=True)
        else:
            fleet.publish(model.state_dict(), fleet.next_version())  # 0, or past an earlier run's versions
        memory: dict[str, float] = {}

        def on_step(log, batch, metrics):
            print(f"step {log.step:3d}  version {log.version:3d}  reward {log.reward:.3f}  loss {log.loss:+.4f}  "
                  f"turns {log.served}  staleness {dict(sorted(log.staleness.items()))}  {log.seconds:.2f} s",
                  flush=True)
            if log.step == 0 or (log.step + 1) % 10 == 0 or log.step + 1 == cfg.steps:
                print(metrics.table(), flush=True)
                if log.attribution:
                    print(attribution_table(log.attribution), flush=True)
                memory.update({k: max(v, memory.get(k, 0.0)) for k, v in fleet.memory_mib().items()})
            step = dict(vars(log), metrics={k: v for k, v in log.metrics.items()
                                            if k.split("/")[-1] in KEPT_METRICS})
            record["steps"].append(json.loads(json.dumps(step, default=str)))
            record["events"] = [vars(e) for e in fleet.events]
            record["audit"] = audit(record["steps"], fleet.sessions_opened, cfg.turns)
            write_json(out / "history.json", record)  # as it grows

        history, metrics = train(fleet, model, cfg, on_step, checkpoint=ckpt, checkpoint_every=args.checkpoint_every,
                                 attribute_every=args.attribute_every)
        print(fleet.status())
        wall = time.monotonic() - t0
        print(f"resident memory (MiB, the largest seen): {json.dumps({k: round(v) for k, v in memory.items()})}")
        print(f"run time {wall:.1f} s (engine start {start_s:.1f} s)")
        record.update(table=metrics.table().to_dict(), memory_mib=memory, run_s=wall,
                      events=[vars(e) for e in fleet.events],
                      audit=audit(record["steps"], fleet.sessions_opened, cfg.turns),
                      checks=check_history(record["steps"], cfg.turns, record["resumed_at"]))
        write_json(out / "history.json", record)
        if args.object_store:
            print(f"Ray object store: {fleet.channel.store.nbytes()} bytes held, versions {fleet.channel.versions()}")
        print(f"sessions: {json.dumps(record['audit'])}")
        print("history checks: " + ("; ".join(record["checks"]) or "ok"))
        print(f"history: {out / 'history.json'}")
        print(f"plot: {write_history_plot(json.loads(json.dumps(record, default=str)), out / 'history.png')}")
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
