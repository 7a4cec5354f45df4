"""``offpolicy demo``: the mixed-fleet asynchronous RL demonstration on CPU.

    offpolicy demo                      # --quick: GRPO and SC+MIS+top-p on both fleets, 1 seed (< 5 min, 2 cores)
    offpolicy demo --full               # all six arms on both fleets, 3 seeds
    offpolicy demo --arms grpo,sc_mis --fleets mixed --staleness 6 --seed 3 --out my_run

Every arm of one invocation shares the learning rate, seeds, steps, batch and fleet: only the correction and
the top-p filter differ. The mismatch knobs (``--staleness``, ``--max-staleness``, ``--weight-format``,
``--kv-format``, ``--lr``) apply to every arm alike; raise them to find where uncorrected GRPO breaks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from offpolicy.demo.arms import ARMS, parse_arms
from offpolicy.demo.simulated_fleet import FLEETS, WEIGHT_FORMATS

#: Presets; any flag given explicitly overrides its preset value.
PRESETS = {
    "quick": {"arms": "grpo,sc_mis_topp", "fleets": "mixed,homogeneous", "seeds": 1, "steps": 120,
              "eval_every": 40, "workers": 2},
    "full": {"arms": "all", "fleets": "mixed,homogeneous", "seeds": 3, "steps": 150, "eval_every": 25,
             "workers": 2},
}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="offpolicy demo", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="the default: 2 arms x 2 fleets, 1 seed, 120 steps (under 5 minutes on 2 cores)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="the real experiment: 6 arms x 2 fleets, 3 seeds, 150 steps")
    p.set_defaults(mode="quick")
    p.add_argument("--arms", help=f"'all' or a comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--fleets", help=f"comma-separated subset of {','.join(FLEETS)}")
    p.add_argument("--seed", type=int, default=0, help="first RL seed (runs use seed, seed+1, ...); default 0")
    p.add_argument("--seeds", type=int, help="number of seeds per arm and fleet")
    p.add_argument("--steps", type=int, help="optimizer steps per run")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    p.add_argument("--samples", type=int, default=8, help="samples (sessions) per prompt (default 8)")
    p.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate, every arm (default 3e-4)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 = off (default 1)")
    p.add_argument("--staleness", type=float, default=2.0,
                   help="mismatch knob: mean staleness of the samplers in optimizer steps (geometric, unbounded; "
                        "default 2)")
    p.add_argument("--max-staleness", type=int, default=None, help="cap on any group's staleness (default none)")
    p.add_argument("--weight-format", default="seed", choices=WEIGHT_FORMATS,
                   help="mismatch knob: the mixed fleet's weight format; 'seed' = NVFP4/FP8/BF16 per group")
    p.add_argument("--kv-format", default="fp8", choices=("fp8", "none"),
                   help="the mixed fleet's key/value path (default fp8)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p of the +top-p arms (default 0.95)")
    p.add_argument("--head-k", type=int, default=8, help="head candidates recorded by the other arms (default 8)")
    p.add_argument("--eval-every", type=int, help="held-out evaluation period in steps")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts (default 128)")
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt (default 8)")
    p.add_argument("--pass-k", type=int, default=4, help="k of the held-out pass@k (default 4)")
    p.add_argument("--workers", type=int, help="worker processes, one thread each (default 2)")
    p.add_argument("--out", default="demo_out", help="output folder (default ./demo_out)")
    p.add_argument("--cache-dir", default=None,
                   help="warm-up cache (default $OFFPOLICY_CACHE or ~/.cache/offpolicy/demo)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    size = p.add_argument_group("task and model size (for tests and experiments)")
    size.add_argument("--n-items", type=int, default=5, help="numbers to sort (default 5)")
    size.add_argument("--max-value", type=int, default=30, help="numbers lie in [0, max-value) (default 30)")
    size.add_argument("--d-model", type=int, default=64)
    size.add_argument("--layers", type=int, default=2)
    size.add_argument("--heads", type=int, default=4)
    size.add_argument("--warmup-target", type=float, default=0.3,
                      help="expected sampled success the supervised warm-up stops at (default 0.3)")
    size.add_argument("--warmup-max-steps", type=int, default=3000)
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in PRESETS[args.mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def _worker_init(progress_queue) -> None:
    import torch

    torch.set_num_threads(1)
    global _PROGRESS
    _PROGRESS = progress_queue


_PROGRESS = None


def _run_one(cfg, task, model_cfg, state):
    from offpolicy.demo.train import run

    def progress(step, row):
        if _PROGRESS is not None:
            _PROGRESS.put((cfg.run_id, step, row["reward"], row["kl_k3"]))

    return run(cfg, task, model_cfg, state, progress)


class _Progress:
    """One overall progress bar (tqdm if installed, else a line every 10 %)."""

    def __init__(self, total: int, runs: int) -> None:
        self.total, self.done, self.runs, self.finished = total, 0, runs, 0
        self.last_print = -1
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self.bar = None

    def step(self, run_id: str, reward: float, kl: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{run_id} reward={reward:.2f} kl={kl:.3f}", refresh=False)
        else:
            tenth = 10 * self.done // self.total
            if tenth != self.last_print:
                self.last_print = tenth
                print(f"  [{100 * self.done // self.total:3d}%] {run_id} reward={reward:.2f} kl={kl:.3f}",
                      flush=True)

    def run_done(self, result: dict) -> None:
        self.finished += 1
        h = result["history"]
        last = result["evals"][-1]
        msg = (f"done {self.finished}/{self.runs}: {result['run_id']:<28} final reward "
               f"{sum(r['reward'] for r in h[-10:]) / len(h[-10:]):.3f}  held-out pass@1 {last['pass@1']:.3f}  "
               f"({result['seconds']:.0f} s)")
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_demo(args: argparse.Namespace) -> dict:
    """Run the demo described by parsed ``args``; returns ``{"results": [...], "files": {...}}``."""
    import torch

    from offpolicy.demo.model import ModelConfig
    from offpolicy.demo.report import tables_text, write_outputs
    from offpolicy.demo.task import SortTask
    from offpolicy.demo.train import RunConfig
    from offpolicy.demo.warmup import WarmupConfig, warmup

    args = _resolve(args)
    arms = parse_arms(args.arms)
    fleets = [f.strip() for f in args.fleets.split(",") if f.strip()]
    bad = [f for f in fleets if f not in FLEETS]
    if bad or not fleets:
        raise ValueError(f"--fleets: expected a comma-separated subset of {FLEETS}, got {args.fleets!r}")
    if args.seeds < 1 or args.workers < 1:
        raise ValueError(f"--seeds and --workers must be >= 1, got {args.seeds} and {args.workers}")
    t_start = time.perf_counter()
    # The model is tiny: its ops are far too small to gain from intra-op threads, and on a shared machine
    # spinning threads lose badly; parallelism comes from running arms in worker processes.
    torch.set_num_threads(1)
    task = SortTask(n_items=args.n_items, max_value=args.max_value)
    model_cfg = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=args.d_model,
                            n_layers=args.layers, n_heads=args.heads, d_ff=4 * args.d_model)
    cache = Path(args.cache_dir or os.environ.get("OFFPOLICY_CACHE") or Path.home() / ".cache/offpolicy/demo")
    wcfg = WarmupConfig(target_success=args.warmup_target, max_steps=args.warmup_max_steps)
    state, winfo = warmup(task, model_cfg, wcfg, cache)

    base = RunConfig(arm=arms[0].key, fleet=fleets[0], steps=args.steps, prompts=args.prompts,
                     samples=args.samples, lr=args.lr, grad_clip=args.grad_clip, top_p=args.top_p,
                     head_k=args.head_k, staleness=args.staleness, max_staleness=args.max_staleness,
                     weight_format=args.weight_format, kv_format=args.kv_format, eval_every=args.eval_every,
                     eval_prompts=args.eval_prompts, eval_samples=args.eval_samples, pass_k=args.pass_k)
    configs = [replace(base, arm=a.key, fleet=f, seed=args.seed + s)
               for s in range(args.seeds) for f in fleets for a in arms]
    print(f"offpolicy demo ({args.mode}): {len(arms)} arm(s) x {len(fleets)} fleet(s) x {args.seeds} seed(s) = "
          f"{len(configs)} runs of {args.steps} steps, {args.workers} worker(s); staleness {args.staleness}, "
          f"lr {args.lr}, weights {args.weight_format}, KV {args.kv_format}", flush=True)
    bar = _Progress(len(configs) * args.steps, len(configs))
    results = []
    if args.workers == 1:
        global _PROGRESS

        class _Direct:
            def put(self, item):
                bar.step(item[0], item[2], item[3])

        _PROGRESS = _Direct()
        try:
            for cfg in configs:
                res = _run_one(cfg, task, model_cfg, state)
                results.append(res)
                bar.run_done(res)
        finally:
            _PROGRESS = None
    else:
        ctx = mp.get_context("spawn")
        q = ctx.Manager().Queue()
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx, initializer=_worker_init,
                                 initargs=(q,)) as pool:
            futures = {pool.submit(_run_one, cfg, task, model_cfg, state): cfg for cfg in configs}
            pending = set(futures)
            while pending:
                try:
                    while True:
                        run_id, _, reward, kl = q.get(timeout=0.2)
                        bar.step(run_id, reward, kl)
                except queue.Empty:
                    pass
                for fut in [f for f in pending if f.done()]:
                    pending.discard(fut)
                    res = fut.result()
                    results.append(res)
                    bar.run_done(res)
        order = {c.run_id: i for i, c in enumerate(configs)}
        results.sort(key=lambda r: order[r["run_id"]])
    bar.close()

    meta = {
        "command": "offpolicy demo " + " ".join(getattr(args, "argv", [])),
        "mode": args.mode, "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "task": asdict(task), "model": model_cfg.to_dict(), "warmup": dict(asdict(wcfg), **winfo),
        "machine": platform.node(), "platform": platform.platform(), "torch": torch.__version__,
        "seconds": time.perf_counter() - t_start, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    out = Path(args.out)
    files = write_outputs(results, out, meta, plots=not args.no_plots)
    meta["seconds"] = time.perf_counter() - t_start
    with open(out / "meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    files["meta.json"] = out / "meta.json"
    print()
    print(tables_text(results, args.pass_k))
    for res in results:
        if res["config"]["fleet"] == "mixed" and res["config"]["arm"] == "sc_mis_topp":
            print(f"fleet table ({res['run_id']}):\n{res['fleet_table']}\n")
            break
    print(f"wrote {', '.join(sorted(files))} to {out}/ in {meta['seconds']:.0f} s")
    return {"results": results, "files": files, "meta": meta}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        run_demo(args)
    except ValueError as e:
        print(f"offpolicy demo: error: {e}", file=sys.stderr)
        return 2
    return 0
