"""``offpolicy demo``: the mixed-fleet RL demonstration on CPU, mismatch from numerics (docs/demo.md).

    offpolicy demo                      # --quick: grid C's contrast at staleness 0 (numerics alone), 1 seed,
                                        # 50 steps: the on-policy controls, GRPO / SC+MIS / SC+MIS+top-p at NVFP4,
                                        # GRPO on the homogeneous fleet (an illustration; grid C decides)
    offpolicy demo --arms grpo,sc_mis_topp --fleets onpolicy,mixed
                                        # the former quick run: the dense toy at staleness 4 (its gap is staleness)
    offpolicy demo --full               # the pre-registered grid: control, 7 arms x (mixed, homogeneous), 30 seeds
    offpolicy demo --calibrate          # numerics KL of every fleet and step KL per learning rate, no RL
    offpolicy demo --grid C --seed 0 --seeds 30 --out docs/demo_results/gridC
                                        # grid C (MoE policy, numerics alone), resumable seed by seed
    offpolicy demo --grid C --calibrate --calibrate-seeds 1 --steps 150 --out calib   # its calibration
    offpolicy demo --arms grpo,sc_mis --fleets mixed --formats nvfp4 --seeds 2 --out my_run

``offpolicy demo`` with no run flag (only ``--steps``, ``--eval-every``, ``--seed``, ``--seeds``, ``--workers``,
``--out``, ``--cache-dir``, ``--no-plots``) runs the quick contrast of grid C (:data:`QUICK_C_RUNS`): grid C's
mixture-of-experts task, model, warm-up and settings (``offpolicy.demo.gridc``) at staleness 0, fewer steps. Any
other run flag (``--arms``, ``--fleets``, ``--lr``, ``--staleness``, the size flags ...) runs the dense toy of grids
A and B with those settings instead, the former quick preset filling the rest.

Every configuration of one invocation shares the learning rate, seeds, steps, batch and staleness: only the
correction, the top-p filter and the fleet's numerics differ. ``--fleets onpolicy`` runs the exact on-policy
GRPO control (the trainer's own numerics, no staleness); ``--sweep-arms`` x ``--sweep-formats`` adds the
weight-format dose-response on the mixed fleet.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import platform
import queue
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from offpolicy.demo.arms import ARMS, parse_arms
from offpolicy.demo.simulated_fleet import FLEETS, WEIGHT_FORMATS
from offpolicy.demo.train import RunConfig

#: The quick demo (``offpolicy demo``): grid C's contrast, one seed. Every run at staleness 0 on grid C's task,
#: model and settings (:func:`offpolicy.demo.gridc.base_config`: its MIS band, gradient clip, batch, evaluation),
#: in this order: the on-policy control; GRPO and SC + MIS on the mixed fleet at NVFP4 (C1, C3); GRPO on the
#: homogeneous fleet (S7); the on-policy top-p control and SC + MIS + top-p at NVFP4, scored on ``Y_p`` (C2).
QUICK_C_RUNS = (("grpo", "onpolicy", "seed"), ("grpo", "mixed", "nvfp4"), ("sc_mis", "mixed", "nvfp4"),
                ("grpo", "homogeneous", "seed"), ("grpo_topp", "onpolicy", "seed"), ("sc_mis_topp", "mixed", "nvfp4"))
#: Its defaults (any of these flags overrides): 6 runs in 2 worker processes, three rounds, 50 steps each; 587 s of
#: CPU from an empty cache, warm-up included (22 min wall on 2 cores at load 11; at least about 6 minutes on a quiet
#: 2-core machine, estimated from the CPU time: docs/demo_results/quick/timing.txt).
QUICK_C = {"steps": 50, "eval_every": 10, "seeds": 1, "workers": 2}
#: The flags the quick contrast takes; any other run flag selects the dense toy (``mode`` and ``grid`` are the
#: mode flags, ``argv`` the command line itself).
QUICK_C_FLAGS = frozenset({"mode", "grid", "seed", "seeds", "steps", "eval_every", "workers", "out", "cache_dir",
                           "no_plots", "report_only", "argv"})

#: Presets of the dense toy (grids A and B); any flag given explicitly overrides its preset value. ``quick`` is the
#: former quick run's (the dense toy at staleness 4), used when a run flag selects the dense toy.
PRESETS = {
    "quick": {"arms": "grpo,sc_mis_topp", "fleets": "onpolicy,mixed", "sweep_arms": "", "sweep_formats": "",
              "seeds": 1, "steps": 100, "eval_every": 25, "workers": 2},
    "full": {"arms": "all", "fleets": "onpolicy,mixed,homogeneous", "sweep_arms": "", "sweep_formats": "",
             "seeds": 30, "steps": 100, "eval_every": 25, "workers": 2},
}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="offpolicy demo", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="the default: grid C's contrast at staleness 0 (numerics alone: NVFP4 samplers flip the "
                           "mixture-of-experts routes): the on-policy control, GRPO and SC+MIS at NVFP4, GRPO on "
                           "the homogeneous fleet, the on-policy top-p control and SC+MIS+top-p at NVFP4, 1 seed, "
                           f"{QUICK_C['steps']} steps (an illustration, not evidence: grid C decides; about 6 minutes "
                           "on a quiet 2-core machine). With a run flag (--arms, --fleets, --lr, ...): the dense toy of grids A "
                           "and B, 1 seed, 100 steps")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="the pre-registered grid (docs/demo.md): every arm on the mixed and homogeneous "
                           "fleets and the on-policy control, 30 seeds, 100 steps (hours)")
    mode.add_argument("--calibrate", dest="mode", action="store_const", const="calibrate",
                      help="no RL: numerics KL of every fleet at equal weights, step KL per --calibrate-lrs")
    p.set_defaults(mode="quick")
    p.add_argument("--grid", choices=("C",), default=None,
                   help="grid C (docs/demo_gridC_registration.md): the registered mixture-of-experts grid, its task, "
                        "model and settings fixed in offpolicy.demo.gridc; one file per seed in --out, seeds "
                        "already there are skipped (resume). With --calibrate: its calibration")
    p.add_argument("--arms", help=f"'all' or a comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--fleets", help=f"comma-separated subset of {','.join(FLEETS)} (onpolicy runs GRPO only)")
    p.add_argument("--formats", default="seed",
                   help=f"comma-separated weight formats of the mixed fleet, from {','.join(WEIGHT_FORMATS)}; "
                        "'seed' = the study's NVFP4/FP8/BF16 per group (default)")
    p.add_argument("--sweep-arms", help="arms run on the mixed fleet at every --sweep-formats (dose-response)")
    p.add_argument("--sweep-formats", help="weight formats of the dose-response sweep")
    p.add_argument("--seed", type=int, default=0, help="first RL seed (runs use seed, seed+1, ...); default 0")
    p.add_argument("--seeds", type=int, help="number of seeds per configuration (shared: paired comparisons)")
    p.add_argument("--steps", type=int, help="optimizer steps per run")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    p.add_argument("--samples", type=int, default=8, help="samples (sessions) per prompt (default 8)")
    p.add_argument("--lr", type=float, default=RunConfig.lr,
                   help=f"Adam learning rate, every arm (default {RunConfig.lr:g})")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 = off (default 1)")
    p.add_argument("--staleness", type=float, default=RunConfig.staleness,
                   help=f"mean staleness of the samplers in optimizer steps (geometric, unbounded; default "
                        f"{RunConfig.staleness:g})")
    p.add_argument("--max-staleness", type=int, default=None, help="cap on any group's staleness (default none)")
    p.add_argument("--kv-format", default="fp8", choices=("fp8", "none"),
                   help="the mixed fleet's key/value path (default fp8)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p of the +top-p arms (default 0.95)")
    p.add_argument("--head-k", type=int, default=8, help="head candidates recorded by the other arms (default 8)")
    p.add_argument("--eval-every", type=int, help="held-out evaluation period in steps")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts (default 128)")
    p.add_argument("--eval-samples", type=int, default=4, help="samples per held-out prompt (default 4)")
    p.add_argument("--pass-k", type=int, default=2, help="k of the held-out pass@k (default 2)")
    p.add_argument("--calibrate-lrs", default="3e-5,5e-5,1e-4,3e-4",
                   help="learning rates whose step KL --calibrate measures")
    p.add_argument("--calibrate-steps", type=int, default=30, help="on-policy steps per learning rate")
    p.add_argument("--calibrate-seeds", type=int, default=0,
                   help="--calibrate also runs the quick configurations for this many seeds and --steps steps, "
                        "for the spread between seeds that the power calculation needs (default 0: none)")
    p.add_argument("--workers", type=int, help="worker processes, one thread each (default 2)")
    p.add_argument("--out", default="demo_out", help="output folder (default ./demo_out)")
    p.add_argument("--cache-dir", default=None,
                   help="warm-up cache (default $OFFPOLICY_CACHE_DIR/demo, ~/.cache/offpolicy/demo when unset)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument("--report-only", metavar="RUNS_JSON_GZ", nargs="+",
                   help="run nothing: rewrite the tables, figures and one merged runs.json.gz into --out from one "
                        "or more runs.json.gz (or the runs.partial.json.gz an interrupted run leaves)")
    size = p.add_argument_group("task and model size (for tests and experiments)")
    size.add_argument("--n-items", type=int, default=12, help="numbers to sort (default 12)")
    size.add_argument("--max-value", type=int, default=32, help="numbers lie in [0, max-value) (default 32)")
    size.add_argument("--vocab", type=int, default=256, help="vocabulary; ids past max-value+1 are the tail")
    size.add_argument("--scratch", type=int, default=0,
                      help="unscored scratchpad tokens before the answer (the task variant whose tail is "
                           "unscored; default 0)")
    size.add_argument("--d-model", type=int, default=64)
    size.add_argument("--layers", type=int, default=2)
    size.add_argument("--heads", type=int, default=4)
    size.add_argument("--warmup-target", type=float, default=0.25,
                      help="expected sampled success the supervised warm-up stops at (default 0.25)")
    size.add_argument("--warmup-max-steps", type=int, default=3000)
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    for key, value in PRESETS["quick" if args.mode == "calibrate" else args.mode].items():
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
            _PROGRESS.put((cfg.run_id, step, row["reward"], row["kl_full"]))

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
               f"{sum(r['reward'] for r in h[-10:]) / len(h[-10:]):.3f}  held-out exact success "
               f"{result['evals'][0]['success_exact']:.3f} -> {last['success_exact']:.3f}  "
               f"({result['seconds']:.0f} s)")
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _configs(args: argparse.Namespace, base) -> list:
    """Every run of the invocation: seeds outermost, so a cut-short grid still holds whole paired seeds."""
    arms = parse_arms(args.arms)
    fleets = _split(args.fleets, "--fleets", FLEETS)
    formats = _split(args.formats, "--formats", WEIGHT_FORMATS)
    sweep_arms = parse_arms(args.sweep_arms) if args.sweep_arms.strip() else []
    sweep_formats = _split(args.sweep_formats, "--sweep-formats", WEIGHT_FORMATS) if sweep_arms else []
    per_seed = []
    for fleet in fleets:
        if fleet == "onpolicy":
            per_seed.append(("grpo", fleet, "seed"))
            continue
        for fmt in formats if fleet == "mixed" else ["seed"]:
            for a in arms:
                per_seed.append((a.key, fleet, fmt))
    for a in sweep_arms:
        for fmt in sweep_formats:
            if (a.key, "mixed", fmt) not in per_seed:
                per_seed.append((a.key, "mixed", fmt))
    return [replace(base, arm=arm, fleet=fleet, weight_format=fmt, seed=args.seed + s)
            for s in range(args.seeds) for arm, fleet, fmt in per_seed]


def _cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where that file is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _split(spec: str, flag: str, allowed) -> list[str]:
    items = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{flag}: expected a comma-separated subset of {tuple(allowed)}, got {spec!r}")
    return items


def run_demo(args: argparse.Namespace) -> dict:
    """Run the demo described by parsed ``args``; returns ``{"results": [...], "files": {...}, "meta": {...}}``."""
    import torch

    from offpolicy.demo.mismatch import numerics_table, step_kl_table
    from offpolicy.demo.model import ModelConfig
    from offpolicy.demo.predictions import predictions_text
    from offpolicy.demo.report import markdown_table, reading_note, tables_text, write_outputs
    from offpolicy.demo.task import SortTask
    from offpolicy.demo.warmup import WarmupConfig, default_cache_dir, warmup

    if getattr(args, "grid", None) == "C":
        return _grid_c(args)
    if is_quick_c(args):
        return _quick_c(args)
    args = _resolve(args)
    if args.report_only:
        return _report_only([Path(p) for p in args.report_only], Path(args.out), plots=not args.no_plots)
    if args.seeds < 1 or args.workers < 1:
        raise ValueError(f"--seeds and --workers must be >= 1, got {args.seeds} and {args.workers}")
    t_start = time.perf_counter()
    # The model is tiny: its ops are far too small to gain from intra-op threads, and on a shared machine
    # spinning threads lose badly; parallelism comes from running configurations in worker processes.
    torch.set_num_threads(1)
    task = SortTask(n_items=args.n_items, max_value=args.max_value, vocab=args.vocab, scratch=args.scratch)
    model_cfg = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=args.d_model,
                            n_layers=args.layers, n_heads=args.heads, d_ff=4 * args.d_model)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    wcfg = WarmupConfig(target_success=args.warmup_target, max_steps=args.warmup_max_steps)
    state, winfo = warmup(task, model_cfg, wcfg, cache)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "offpolicy demo " + " ".join(getattr(args, "argv", [])),
        "mode": args.mode, "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "task": asdict(task), "model": model_cfg.to_dict(), "warmup": dict(asdict(wcfg), **winfo),
        "machine": platform.node(), "platform": platform.platform(), "torch": torch.__version__,
        # Histories are bit-identical between runs on one CPU, not across CPUs: the kernels torch and the C
        # backend pick follow the CPU's instruction set, and a different rounding at step 0 changes the draws.
        "cpu": _cpu_model(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    configs = [] if args.mode == "calibrate" else _configs(args, RunConfig(arm="grpo", fleet="onpolicy"))
    used = None if args.mode != "quick" else {(c.fleet, c.weight_format if c.fleet == "mixed" else "seed")
                                               for c in configs}
    numerics = numerics_table(task, model_cfg, state, prompts=args.eval_prompts, only=used)
    calibration = {"numerics": numerics, "step_kl": []}
    cols = [("config", "fleet"), ("group", "group"), ("weights", "weights"), ("kl", "KL(q||p)"), ("tv", "TV"),
            ("extreme_frac", "ratio outside [0.2, 5]")]
    print("Numerics mismatch at equal weights (before RL):")
    print(markdown_table([r for r in numerics if r["group"] == "(fleet)"], cols), flush=True)
    if args.mode == "calibrate":
        lrs = [float(x) for x in args.calibrate_lrs.split(",") if x.strip()]
        calibration["step_kl"] = step_kl_table(task, model_cfg, state, lrs, args.calibrate_steps, args.seed)
        spread = ""
        if args.calibrate_seeds > 0:
            from offpolicy.demo.report import seed_spread_table

            cal_configs = _configs(argparse.Namespace(**dict(vars(args), seeds=args.calibrate_seeds)),
                                   _base_config(args))
            runs = _execute(cal_configs, task, model_cfg, state, args.workers,
                            _Progress(len(cal_configs) * args.steps, len(cal_configs)), lambda done: None)
            calibration["seed_spread"] = [asdict(row) for row in seed_spread_table(runs)]
            # The calibration runs' histories, so that the spread table can be re-derived from the files.
            with gzip.open(out / "calibration_runs.json.gz", "wt") as f:
                json.dump({"meta": meta, "runs": runs}, f)
            spread = ("\n\nSeed-to-seed spread of the primary outcome (mean exact success after the start), "
                      f"{args.calibrate_seeds} seeds of {args.steps} steps, and the seeds a paired test needs:\n"
                      + markdown_table(calibration["seed_spread"], SPREAD_COLS))
        text = ("Numerics mismatch at equal weights, per group:\n" + markdown_table(numerics, cols)
                + "\n\nStep KL of the on-policy GRPO control:\n"
                + markdown_table(calibration["step_kl"], [("lr", "lr"), ("steps", "steps"),
                                                          ("step_kl_mean", "mean step KL"),
                                                          ("step_kl_max", "max step KL"),
                                                          ("success_start", "exact success, start"),
                                                          ("success_end", "end")]) + spread + "\n")
        print(text)
        meta["seconds"] = time.perf_counter() - t_start
        (out / "calibration.json").write_text(json.dumps({"meta": meta, "calibration": calibration}, indent=1))
        (out / "calibration.md").write_text(text)
        return {"results": [], "files": {"calibration.json": out / "calibration.json"}, "meta": meta,
                "calibration": calibration}

    configs = _configs(args, _base_config(args))
    print(f"offpolicy demo ({args.mode}): {len(configs)} runs of {args.steps} steps ({args.seeds} seed(s)), "
          f"{args.workers} worker(s); lr {args.lr:g}, staleness {args.staleness:g}", flush=True)
    bar = _Progress(len(configs) * args.steps, len(configs))
    partial = out / "runs.partial.json.gz"

    def save_partial(done: list[dict]) -> None:
        # Every finished run is saved at once, so an interrupted grid still leaves its histories.
        with gzip.open(partial, "wt") as f:
            json.dump({"meta": meta, "calibration": calibration, "runs": done}, f)

    results = _execute(configs, task, model_cfg, state, args.workers, bar, save_partial)
    bar.close()
    calibration["step_kl"] = [
        {"lr": args.lr, "steps": args.steps, "source": "on-policy control runs",
         "step_kl_mean": statistics.fmean(h["step_kl"] for r in results if r["config"]["fleet"] == "onpolicy"
                                          for h in r["history"])}
    ] if any(r["config"]["fleet"] == "onpolicy" for r in results) else []
    meta["seconds"] = time.perf_counter() - t_start
    files = write_outputs(results, out, meta, calibration, plots=not args.no_plots, predictions=predictions_text)
    partial.unlink(missing_ok=True)
    print()
    print(tables_text(results))
    note = reading_note(results)
    if note:
        print(f"How to read this: {note}")
    print(f"wrote {', '.join(sorted(files))} to {out}/ in {meta['seconds']:.0f} s")
    return {"results": results, "files": files, "meta": meta, "calibration": calibration}


def _explicit_flags(args: argparse.Namespace) -> set[str]:
    """The destinations of the flags given on the command line (``args.argv``); without ``argv`` (a namespace built
    in code) those whose value differs from the parser's default."""
    argv = getattr(args, "argv", None)
    if argv is None:
        defaults = vars(build_parser().parse_args([]))
        return {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}
    p = build_parser()
    p._defaults.clear()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def is_quick_c(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for the quick contrast of grid C: the quick mode (the default) without ``--grid`` or
    ``--report-only`` and with no flag outside :data:`QUICK_C_FLAGS`."""
    if args.mode != "quick" or getattr(args, "grid", None) or args.report_only:
        return False
    return not (_explicit_flags(args) - QUICK_C_FLAGS)


def _quick_c(args: argparse.Namespace) -> dict:
    """The quick demo: grid C's contrast (:data:`QUICK_C_RUNS`) on grid C's task, model, warm-up (the same cache
    entry as the grid's) and settings, at staleness 0, for ``--seeds`` seeds of ``--steps`` steps. Its runs carry
    ``grid = "C"`` and ``quick = True``: the tables judge grid C's registered claims that these runs allow, each
    "undecided" on one seed."""
    import torch

    from offpolicy.demo import gridc
    from offpolicy.demo.mismatch import CONFIGS_C, numerics_table
    from offpolicy.demo.predictions import predictions_text
    from offpolicy.demo.report import markdown_table, reading_note, tables_text, write_outputs

    for key, value in QUICK_C.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.seeds < 1 or args.workers < 1 or args.steps < 1 or args.eval_every < 1:
        raise ValueError(f"--steps, --eval-every, --seeds and --workers must be >= 1, got {args.steps}, "
                         f"{args.eval_every}, {args.seeds} and {args.workers}")
    t_start = time.perf_counter()
    task, model_cfg, wcfg, state, winfo, out = _grid_c_setup(args)
    base = gridc.base_config(steps=args.steps, eval_every=args.eval_every)
    configs = [replace(base, arm=arm, fleet=fleet, weight_format=fmt, seed=args.seed + s)
               for s in range(args.seeds) for arm, fleet, fmt in QUICK_C_RUNS]
    meta = {"command": "offpolicy demo " + " ".join(getattr(args, "argv", [])), "mode": "quick", "grid": "C",
            "quick": True, "args": {k: v for k, v in vars(args).items() if k != "argv"},
            "settings": asdict(base), "task": asdict(task), "model": model_cfg.to_dict(),
            "warmup": dict(asdict(wcfg), **winfo), "machine": platform.node(), "platform": platform.platform(),
            "torch": torch.__version__, "cpu": _cpu_model(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    used = {(fleet, fmt) for _, fleet, fmt in QUICK_C_RUNS}
    numerics = numerics_table(task, model_cfg, state, prompts=base.eval_prompts, only=used, configs=CONFIGS_C,
                              bands=(base.mis_bounds,))
    calibration = {"numerics": numerics, "step_kl": []}
    lo, hi = base.mis_bounds
    print("Numerics mismatch at equal weights (before RL; staleness 0: the samplers' numerics alone):")
    print(markdown_table([r for r in numerics if r["group"] == "(fleet)"],
                         [("config", "fleet"), ("kl", "KL(q||p)"), ("route_flip", "route-flip share"),
                          (f"masked {lo:g}-{hi:g}", f"outside the MIS band [{lo:g}, {hi:g}]")]), flush=True)
    print(f"offpolicy demo (quick): grid C's contrast, {len(configs)} runs of {args.steps} steps ({args.seeds} "
          f"seed(s)), {args.workers} worker(s); staleness 0, lr {base.lr:g}, gradient clip {base.grad_clip:g}, "
          f"MIS band [{lo:g}, {hi:g}]", flush=True)
    partial = out / "runs.partial.json.gz"

    def save_partial(done: list[dict]) -> None:
        with gzip.open(partial, "wt") as f:
            json.dump({"meta": meta, "calibration": calibration, "runs": done}, f)

    bar = _Progress(len(configs) * args.steps, len(configs))
    results = _execute(configs, task, model_cfg, state, args.workers, bar, save_partial)
    bar.close()
    for r in results:
        r["grid"], r["quick"] = "C", True
    calibration["step_kl"] = [
        {"lr": base.lr, "steps": args.steps, "source": "on-policy control runs",
         "step_kl_mean": statistics.fmean(h["step_kl"] for r in results if r["run_id"].startswith("grpo@onpolicy")
                                          for h in r["history"])}]
    meta["seconds"] = time.perf_counter() - t_start
    files = write_outputs(results, out, meta, calibration, plots=not args.no_plots, predictions=predictions_text)
    partial.unlink(missing_ok=True)
    print()
    print(tables_text(results))
    print(predictions_text(results))
    print(f"How to read this: {reading_note(results)}")
    print(f"wrote {', '.join(sorted(files))} to {out}/ in {meta['seconds']:.0f} s")
    return {"results": results, "files": files, "meta": meta, "calibration": calibration}


def _grid_c_setup(args: argparse.Namespace):
    """Grid C's task, model config, warm-up config, warmed-up state and info, and the output folder (created), for
    the grid and its quick demo alike (one thread per process)."""
    import torch

    from offpolicy.demo import gridc
    from offpolicy.demo.warmup import WarmupConfig, default_cache_dir, warmup

    torch.set_num_threads(1)
    task = gridc.task()
    model_cfg = gridc.model_config(task)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    wcfg = WarmupConfig(target_success=args.warmup_target, max_steps=args.warmup_max_steps)
    state, winfo = warmup(task, model_cfg, wcfg, cache)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return task, model_cfg, wcfg, state, winfo, out


def _grid_c(args: argparse.Namespace) -> dict:
    """``--grid C``: the registered grid seed by seed (resumable), or with ``--calibrate`` its calibration: the
    numerics of every grid-C fleet at the warm-up weights and, with ``--calibrate-seeds``, GRPO on the on-policy
    fleet and on the mixed fleet at ``--formats`` for ``--steps`` steps (``--grad-clip``) per seed."""
    import torch

    from offpolicy.demo import gridc
    from offpolicy.demo.mismatch import CONFIGS_C, numerics_table
    from offpolicy.demo.predictions import predictions_text
    from offpolicy.demo.report import write_outputs

    if args.report_only:
        return _report_only([Path(p) for p in args.report_only], Path(args.out), plots=not args.no_plots)
    task, model_cfg, wcfg, state, winfo, out = _grid_c_setup(args)
    workers = args.workers or 1
    meta = {"command": "offpolicy demo " + " ".join(getattr(args, "argv", [])), "grid": "C",
            "task": asdict(task), "model": model_cfg.to_dict(), "warmup": dict(asdict(wcfg), **winfo),
            "machine": platform.node(), "platform": platform.platform(), "torch": torch.__version__,
            "cpu": _cpu_model(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if args.mode == "calibrate":
        numerics = numerics_table(task, model_cfg, state, prompts=args.eval_prompts, configs=CONFIGS_C,
                                  bands=gridc.CANDIDATE_BANDS)
        runs = []
        if args.calibrate_seeds > 0:
            base = gridc.base_config(steps=args.steps or gridc.SETTINGS["steps"],
                                     eval_every=args.eval_every or gridc.SETTINGS["eval_every"],
                                     grad_clip=args.grad_clip)
            formats = _split(args.formats, "--formats", WEIGHT_FORMATS)
            cfgs = [replace(base, arm="grpo", fleet=fl, weight_format=f, seed=args.seed + s)
                    for s in range(args.calibrate_seeds)
                    for fl, f in [("onpolicy", "seed")] + [("mixed", f) for f in formats]]
            runs = _execute(cfgs, task, model_cfg, state, workers,
                            _Progress(len(cfgs) * base.steps, len(cfgs)), lambda done: None)
            with gzip.open(out / "calibration_runs.json.gz", "wt") as f:
                json.dump({"meta": meta, "runs": runs}, f)
        text = gridc.calibration_text(numerics, runs)
        print(text)
        (out / "calibration.json").write_text(json.dumps({"meta": meta, "numerics": numerics}, indent=1))
        (out / "calibration.md").write_text(f"Command: `{meta['command']}`\n\n" + text)
        return {"results": runs, "files": {}, "meta": meta, "calibration": {"numerics": numerics}}
    seeds = args.seeds if args.seeds is not None else 30
    base = gridc.base_config()
    for seed in range(args.seed, args.seed + seeds):
        cfgs = gridc.configs_for_seed(base, seed)
        run_grid_c_seed(seed, cfgs, out, dict(meta, seed=seed),
                        lambda todo, on_done: _execute(todo, task, model_cfg, state, workers,
                                                       _Progress(len(todo) * base.steps, len(todo)), on_done))
    files = sorted(p for p in out.glob("seed*.runs.json.gz") if not p.name.endswith(PARTIAL_SUFFIX))
    if not files:
        print(f"grid C: no complete seed in {out}/ yet: nothing to report")
        return {"results": [], "files": {}, "meta": meta}
    results = []
    for path in files:
        with gzip.open(path, "rt") as f:
            results += json.load(f)["runs"]
    written = write_outputs(results, out, meta, None, plots=not args.no_plots, predictions=predictions_text)
    print(f"grid C: {len(files)} seed file(s) in {out}/; wrote {', '.join(sorted(written))}")
    return {"results": results, "files": written, "meta": meta}


#: Suffix of a grid-C seed's file of finished runs while that seed is incomplete (``seedK.partial.runs.json.gz``).
PARTIAL_SUFFIX = ".partial.runs.json.gz"


def run_grid_c_seed(seed: int, cfgs: list, out: Path, meta: dict, execute) -> Path:
    """Run the grid-C configurations ``cfgs`` of one seed, resumable run by run; return that seed's file.

    Every finished run is written at once to ``seedK.partial.runs.json.gz`` (a seed cut short by the end of a
    session keeps its finished runs); a rerun skips the runs that file holds (by ``run_id``: each run is a pure
    function of its configuration, so a resumed seed equals an uninterrupted one). When every run is there, the
    seed's ``seedK.runs.json.gz`` is written and the partial file removed. ``execute(todo, on_done)`` runs the
    configurations ``todo`` and calls ``on_done(finished_so_far)`` after each.
    """
    path = out / f"seed{seed}.runs.json.gz"
    partial = out / f"seed{seed}{PARTIAL_SUFFIX}"
    if path.exists():
        print(f"grid C: seed {seed} already in {path}, skipped", flush=True)
        return path
    done: list[dict] = []
    if partial.exists():
        with gzip.open(partial, "rt") as f:
            done = json.load(f)["runs"]
    wanted = [c.run_id for c in cfgs]
    stray = sorted({r["run_id"] for r in done} - set(wanted))
    if stray:
        raise ValueError(f"{partial}: holds runs that seed {seed} does not make ({', '.join(stray)}); "
                         "it belongs to another grid: move it away")
    have = {r["run_id"] for r in done}
    todo = [c for c in cfgs if c.run_id not in have]
    print(f"grid C: seed {seed}: {len(todo)} of {len(cfgs)} runs to go"
          + (f" ({len(have)} finished in {partial.name})" if have else ""), flush=True)

    def write(target: Path, runs: list[dict]) -> None:
        tmp = target.with_name(target.name + ".tmp")
        with gzip.open(tmp, "wt") as f:
            json.dump({"meta": meta, "runs": runs}, f)
        tmp.replace(target)

    def on_done(finished: list[dict]) -> None:
        for r in finished:
            r["grid"] = "C"
        write(partial, done + finished)

    finished = execute(todo, on_done) if todo else []
    for r in finished:
        r["grid"] = "C"
    by_id = {r["run_id"]: r for r in done + finished}
    write(path, [by_id[i] for i in wanted])
    partial.unlink(missing_ok=True)
    return path


def _base_config(args: argparse.Namespace) -> RunConfig:
    """The settings every run of the invocation shares (the arm, fleet and seed are set per run)."""
    return RunConfig(arm="grpo", fleet="onpolicy", steps=args.steps, prompts=args.prompts,
                     samples=args.samples, lr=args.lr, grad_clip=args.grad_clip, top_p=args.top_p,
                     head_k=args.head_k, staleness=args.staleness, max_staleness=args.max_staleness,
                     kv_format=args.kv_format, eval_every=args.eval_every,
                     eval_prompts=args.eval_prompts, eval_samples=args.eval_samples, pass_k=args.pass_k)


#: Columns of the calibration's seed-spread table.
SPREAD_COLS = [("a", "configuration"), ("b", "minus"), ("seeds", "seeds"), ("diff", "mean difference"),
               ("sd", "sd of the paired difference"), ("seeds_needed", "seeds: detect ±delta"),
               ("seeds_needed_equiv", "seeds: equivalence ±margin")]


def _report_only(paths: list[Path], out: Path, plots: bool) -> dict:
    """Merge the runs of ``paths`` (a run id may appear once) and write the outputs; the first file's meta and
    calibration are kept, with every file's command listed under ``meta["merged"]``.

    Grid C is read on complete seeds only (its comparisons pair a seed's runs): a seed's file of finished runs
    (``seedK.partial.runs.json.gz``, which a glob such as ``seed*.runs.json.gz`` matches) is skipped with a line
    saying so, and a grid-C seed that lacks any of its runs is refused."""
    from offpolicy.demo.predictions import predictions_text
    from offpolicy.demo.report import tables_text, write_outputs

    partial = [p for p in paths if p.name.endswith(PARTIAL_SUFFIX)]
    for path in partial:
        print(f"--report-only: skipped {str(path)!r}: the finished runs of an incomplete grid-C seed (grid C is "
              "read on complete seeds only)")
    paths = [p for p in paths if p not in partial]
    if not paths:
        raise ValueError(f"--report-only: every file given is an incomplete grid-C seed (*{PARTIAL_SUFFIX}): "
                         "nothing to report")
    runs: list[dict] = []
    meta: dict = {}
    calibration = None
    for path in paths:
        if not path.is_file():
            raise ValueError(f"--report-only: no such file {str(path)!r}")
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        if not data.get("runs"):
            raise ValueError(f"--report-only: {str(path)!r} holds no runs")
        seen = {r["run_id"] for r in runs}
        dup = [r["run_id"] for r in data["runs"] if r["run_id"] in seen]
        if dup:
            raise ValueError(f"--report-only: run(s) {dup} appear in more than one file")
        runs += data["runs"]
        meta = meta or dict(data["meta"])
        calibration = calibration or data.get("calibration")
        meta.setdefault("merged", []).append({"file": path.name, "command": data["meta"].get("command"),
                                              "runs": len(data["runs"])})
    _check_grid_c_seeds(runs)
    files = write_outputs(runs, out, meta, calibration, plots=plots, predictions=predictions_text)
    print(tables_text(runs))
    print(f"wrote {', '.join(sorted(files))} to {out}/ from {len(runs)} runs in {len(paths)} file(s)")
    return {"results": runs, "files": files, "meta": meta, "calibration": calibration}


def _check_grid_c_seeds(runs: list[dict]) -> None:
    """Refuse grid-C runs (``grid`` "C", not the quick demo's) whose seed lacks any run of
    :func:`offpolicy.demo.gridc.configs_for_seed`."""
    from offpolicy.demo import gridc

    by_seed: dict[int, set[str]] = {}
    for r in runs:
        if r.get("grid") == "C" and not r.get("quick"):
            by_seed.setdefault(r["config"]["seed"], set()).add(r["run_id"])
    for seed, have in sorted(by_seed.items()):
        missing = [c.run_id for c in gridc.configs_for_seed(gridc.base_config(), seed) if c.run_id not in have]
        if missing:
            raise ValueError(f"--report-only: grid C seed {seed} lacks {len(missing)} of its runs ({', '.join(missing)}):"
                             " grid C is read on complete seeds only (its comparisons pair a seed's runs)")


def _execute(configs: list, task, model_cfg, state, workers: int, bar: _Progress, on_done) -> list[dict]:
    """Run ``configs`` (in ``workers`` processes of one thread each), in the order given; ``on_done(results)``
    after every finished run."""
    global _PROGRESS
    results = []
    if workers == 1:

        class _Direct:
            def put(self, item):
                bar.step(item[0], item[2], item[3])

        _PROGRESS = _Direct()
        try:
            for cfg in configs:
                res = _run_one(cfg, task, model_cfg, state)
                results.append(res)
                bar.run_done(res)
                on_done(results)
        finally:
            _PROGRESS = None
        return results
    ctx = mp.get_context("spawn")
    q = ctx.Manager().Queue()
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(q,)) as pool:
        pending = {pool.submit(_run_one, cfg, task, model_cfg, state) for cfg in configs}
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
                on_done(results)
    order = {c.run_id: i for i, c in enumerate(configs)}
    results.sort(key=lambda r: order[r["run_id"]])
    return results


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
