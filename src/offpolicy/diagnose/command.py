"""``offpolicy diagnose`` command line.

With ``--attribute`` (and ``--model``) it also splits the mismatch into causes (``offpolicy.diagnose.attribution``):
``--version-weights VERSION=DIR`` for every served version other than the current one, ``--group-format
NAME=FORMAT`` for every sampler group, ``--routes FILE`` for a mixture of experts (the sampler's recorded routes,
replayed for the routing cause: :mod:`offpolicy.diagnose.route_file`); it writes ``attribution.md``,
``attribution.json`` and ``attribution.png``.

Exit codes: 0 the report was written (``--strict``: and no mistake was found); 1 ``--strict`` and a mistake was
found; 2 bad input (a malformed rollouts or trainer file, a model that does not load), with one message naming the
file, the line or tensor and the field; 3 an internal error (a bug: please report it). argparse's own usage
errors also exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from offpolicy.diagnose import diagnose, load_rollouts
from offpolicy.diagnose.attribution import PARTS
from offpolicy.diagnose.findings import short_label
from offpolicy.diagnose.scoring import load_model, load_trainer_logprobs
from offpolicy.diagnose.summary import finite_json
from offpolicy.fleet.quant.fake import FAKE_FORMATS


def _pairs(values: list[str], flag: str, key_type: type) -> dict:
    """``KEY=VALUE`` flags as a dict; a malformed or repeated key raises ``ValueError`` naming ``flag``."""
    out: dict = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{flag} {item!r}: expected {flag.removeprefix('--').upper().replace('-', '_')} as "
                             f"KEY=VALUE, e.g. {'3=ckpt/v3' if key_type is int else 'h100-fp8=fp8'}")
        if key_type is int:
            try:
                key = int(key)
            except ValueError:
                raise ValueError(f"{flag} {item!r}: the version {key!r} is not an integer") from None
            if key < 0:
                raise ValueError(f"{flag} {item!r}: the version must be >= 0")
        if key in out:
            raise ValueError(f"{flag}: {key!r} is given twice")
        out[key] = value
    return out


def _attribution_inputs(args) -> tuple[dict[int, str], dict[str, str], list[dict]]:
    """The attribution flags checked before anything is loaded (a bad flag costs no model load)."""
    import json

    if not args.model:
        raise ValueError("--attribute: needs --model DIR (the trainer's weights, which the attribution re-scores "
                         "under each cause); --trainer-logprobs alone cannot be re-scored")
    if args.attribute_tokens < 1:
        raise ValueError(f"--attribute-tokens: must be >= 1, got {args.attribute_tokens}")
    versions = _pairs(args.version_weights, "--version-weights", int)
    formats = _pairs(args.group_format, "--group-format", str)
    bad = {k: v for k, v in formats.items() if v not in FAKE_FORMATS}
    if bad:
        raise ValueError(f"--group-format: unknown weight format(s) {bad}; one of {FAKE_FORMATS}")
    history = []
    for h in args.history:
        try:
            d = json.loads(Path(h).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--history {h}: not a readable attribution.json ({type(exc).__name__}: "
                             f"{str(exc)[:120]})") from None
        if not isinstance(d, dict) or type(d.get("step")) is not int or not isinstance(d.get("slices"), list):
            raise ValueError(f"--history {h}: expected an attribution.json written with --step (a 'step' integer "
                             "and 'slices')")
        history.append(d)
    if history and args.step is None:
        raise ValueError("--history: pass --step for this run too (the plot places each report at its step)")
    return versions, formats, history


def _attribute(rollouts, model, args, versions: dict[int, str], formats: dict[str, str], history: list[dict],
               current: int | None, routes=None):
    from offpolicy.diagnose.attribution import attribute, check_plan

    if current is None:
        raise ValueError("--current-version: the record holds no weight versions; pass the trainer's version")
    check_plan(rollouts, current, versions, formats)  # before any version's weights are loaded
    replay = routes.replay(model) if routes is not None else None  # checks the routes against the model
    weights = {}
    for v, folder in versions.items():
        try:
            weights[v] = load_model(folder)
        except ValueError as exc:
            raise ValueError(f"--version-weights {v}={folder}: {str(exc).removeprefix(f'--model {folder}: ')}") \
                from None
    rep = attribute(rollouts, model=model, current_version=current, weights=weights,
                    formats=formats, replay=replay, max_tokens=args.attribute_tokens, semantics=args.semantics,
                    quantize_skip=tuple(args.quantize_skip), step=args.step)
    rep.save(args.out, history=history)
    _link_from_report(Path(args.out), rep)
    return rep


def _link_from_report(out: Path, rep) -> None:
    """``report.md`` gains an attribution section (the per-group shares and a link to ``attribution.md``) and
    ``report.json`` an ``attribution`` key (the groups' parts and recommendations), so the diagnose report is
    complete on its own."""
    import json

    groups = [s for s in rep.slices if s.kind in ("all", "group")]
    lines = ["", "## Attribution: why is r != 1? (Shapley shares of mean |log r|)", "",
             "| slice | mean abs log r | " + " | ".join(PARTS) + " |", "|---|---:|" + "---:|" * len(PARTS)]
    for s in groups:
        lines.append(f"| {'all tokens' if s.kind == 'all' else short_label(s.label).replace('|', '/')} | "
                     f"{s.total['mean_abs_log_r']:.4f} | "
                     + " | ".join(f"{s.parts[p]['share_mean_abs_log_r']:.0%}" for p in PARTS) + " |")
    lines += ["", "Every slice, the KL and band shares, the recommendations and the cost: "
              "[attribution.md](attribution.md).", ""]
    md = out / "report.md"
    md.write_text(md.read_text() + "\n".join(lines))
    js = out / "report.json"
    data = json.loads(js.read_text())
    data["attribution"] = finite_json({"method": rep.METHOD, "file": "attribution.json",
                                       "groups": [s.as_dict() for s in groups]})
    js.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")


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
    att = ap.add_argument_group("attribution (why is r != 1?)")
    att.add_argument("--attribute", action="store_true",
                     help="split log q - log p into semantics, staleness, weight format, routing and residual "
                          "(Shapley values; needs --model)")
    att.add_argument("--version-weights", action="append", default=[], metavar="VERSION=DIR",
                     help="a served version's weights (a transformers folder); once per recorded version other "
                          "than the current one")
    att.add_argument("--group-format", action="append", default=[], metavar="NAME=FORMAT",
                     help=f"a sampler group's weight format, one of {', '.join(FAKE_FORMATS)}; once per group")
    att.add_argument("--routes", default=None, metavar="FILE",
                     help="a mixture-of-experts sampler's recorded routes (.safetensors, one row per context "
                          "position; docs/diagnose.md#routes-file), replayed for the routing cause")
    att.add_argument("--attribute-tokens", type=int, default=4096, metavar="N",
                     help="tokens sampled for the attribution (default 4096)")
    att.add_argument("--quantize-skip", action="append", default=[], metavar="SUBSTRING",
                     help="module names left unquantised in the format re-score (e.g. lm_head)")
    att.add_argument("--step", type=int, default=None, help="the training step (for --history)")
    att.add_argument("--history", action="append", default=[], metavar="ATTRIBUTION_JSON",
                     help="an earlier run's attribution.json (with a step): plots the parts over training steps")
    args = ap.parse_args(argv)
    try:
        att_inputs = _attribution_inputs(args) if args.attribute else None
        if args.routes is not None and not args.attribute:
            raise ValueError("--routes: only read with --attribute (the routing cause replays them)")
        rollouts = load_rollouts(args.rollouts)
        routes = None
        if args.routes is not None:
            from offpolicy.diagnose.route_file import load_routes

            routes = load_routes(args.routes, rollouts)  # checked against the rollouts before any model loads
        trainer = (load_trainer_logprobs(args.trainer_logprobs, len(rollouts), rollouts.candidates)
                   if args.trainer_logprobs else None)
        model = load_model(args.model) if att_inputs is not None else args.model  # loaded once for both
        if routes is not None:
            routes.check_model(model)  # before the diagnosis runs
        report = diagnose(rollouts, trainer_logprobs=trainer, model=model,
                          current_version=args.current_version, semantics=args.semantics, out_dir=args.out)
        attribution = None
        if att_inputs is not None:
            attribution = _attribute(rollouts, model, args, *att_inputs, report.current_version, routes)
    except (ValueError, OSError) as exc:  # bad input: the message names the file, the line or tensor, the field
        print(f"offpolicy diagnose: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug in diagnose, never bad input: one line, no traceback, and a way to report it
        print(f"offpolicy diagnose: internal error ({type(exc).__name__}: {str(exc)[:300]}); please report it "
              "with the input file", file=sys.stderr)
        return 3
    report.print()
    print(f"\nreport: {args.out}/report.md")
    if attribution is not None:
        print()
        attribution.print()
        print(f"\nattribution: {args.out}/attribution.md")
    return 1 if args.strict and not report.ok else 0
