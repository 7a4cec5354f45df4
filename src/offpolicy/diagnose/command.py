"""``offpolicy diagnose`` command line."""

from __future__ import annotations

import argparse
import sys

from offpolicy.diagnose import diagnose, load_rollouts
from offpolicy.diagnose.scoring import load_trainer_logprobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="offpolicy diagnose",
        description="Compare recorded sampler rollouts with the trainer: KL k1/k3 and extreme-ratio share overall, "
                    "per group and per staleness; check the log-prob semantics; recommend an op.Correction.")
    ap.add_argument("rollouts", help="recorded rollouts: .jsonl (one turn per line) or .safetensors")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trainer-logprobs", help=".safetensors / .pt with 'logprobs' [N] (and 'candidate_logprobs')")
    src.add_argument("--model", help="a local transformers model directory to evaluate on the recorded contexts")
    ap.add_argument("--current-version", type=int, default=None, help="the trainer's weight version")
    ap.add_argument("--semantics", choices=("vllm", "sglang"), default="vllm", help="the engine's filter order")
    ap.add_argument("--out", default="diagnose_out", help="folder for report.md, report.json and the PNG plots")
    ap.add_argument("--strict", action="store_true", help="exit with status 1 when a mistake is found")
    args = ap.parse_args(argv)
    try:
        rollouts = load_rollouts(args.rollouts)
        trainer = load_trainer_logprobs(args.trainer_logprobs, len(rollouts)) if args.trainer_logprobs else None
        report = diagnose(rollouts, trainer_logprobs=trainer, model=args.model,
                          current_version=args.current_version, semantics=args.semantics, out_dir=args.out)
    except (ValueError, OSError) as exc:
        print(f"offpolicy diagnose: {exc}", file=sys.stderr)
        return 2
    report.print()
    print(f"\nreport: {args.out}/report.md")
    return 1 if args.strict and not report.ok else 0
