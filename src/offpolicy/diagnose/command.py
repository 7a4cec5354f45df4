"""``offpolicy diagnose`` command line.

Exit codes: 0 the report was written (``--strict``: and no mistake was found); 1 ``--strict`` and a mistake was
found; 2 bad input (a malformed rollouts or trainer file, a model that does not load), with one message naming the
file, the line or tensor and the field; 3 an internal error (a bug: please report it). argparse's own usage
errors also exit 2.
"""

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
        trainer = (load_trainer_logprobs(args.trainer_logprobs, len(rollouts), rollouts.candidates)
                   if args.trainer_logprobs else None)
        report = diagnose(rollouts, trainer_logprobs=trainer, model=args.model,
                          current_version=args.current_version, semantics=args.semantics, out_dir=args.out)
    except (ValueError, OSError) as exc:  # bad input: the message names the file, the line or tensor, the field
        print(f"offpolicy diagnose: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug in diagnose, never bad input: one line, no traceback, and a way to report it
        print(f"offpolicy diagnose: internal error ({type(exc).__name__}: {str(exc)[:300]}); please report it "
              "with the input file", file=sys.stderr)
        return 3
    report.print()
    print(f"\nreport: {args.out}/report.md")
    return 1 if args.strict and not report.ok else 0
