"""Engine responses -> the routes file ``offpolicy diagnose --attribute --routes`` reads
(:func:`offpolicy.diagnose.save_engine_routes`): a tiny Qwen3-MoE sampler (its NVFP4 copy) "serves" each turn, its
per-position routes are encoded as vLLM (base64 ``.npy``) and SGLang (base64 raw ``int32``) responses, decoded by the
adapters' ``routed_positions``, laid out per context and written; the CLI accepts the file, and the trainer's
forward under the file's routes (``SequenceRoutes`` as ``--routes`` builds it) routes exactly as the sampler did at
every forwarded position. One context is two turns sharing a prefix (a tool output between them) whose second
response's prefix rows differ (a re-prefill): the file keeps the first turn's rows, the ones its tokens were sampled
with. Misaligned inputs raise naming the argument."""

from __future__ import annotations

import json

import pytest
import torch

from offpolicy.__main__ import main as cli
from offpolicy.adapters import sglang, vllm
from offpolicy.diagnose import load_rollouts, load_routes, save_engine_routes, save_jsonl
from offpolicy.fleet.quant import fake_quantize_module
from offpolicy.fleet.sampler import sample
from offpolicy.routing import capture_routes, replay_routes
from support.route_payloads import sglang_response, vllm_response
from support.tiny_moe import V, tiny_qwen3_moe

pytest.importorskip("transformers")
E, K, L = 8, 2, 2  # tiny_qwen3_moe: 3 decoder layers, layer 1 dense -> 2 routed layers


def _sampled(net, prompt, n, seed):
    ro = sample(net, torch.tensor([prompt]), n, 1.0, 1.0, None, record=None, version=0,
                generator=torch.Generator().manual_seed(seed))
    tb = ro.flatten()
    return tb.tokens.tolist(), tb.sampler_logprobs.tolist()


def _engine_rows(net, seq):
    """What an engine returns for a turn whose prompt + output is ``seq``: the routes of positions
    ``0 .. len(seq) - 2`` (the last sampled token is never forwarded), ``[len(seq) - 1, L, K]``."""
    with torch.no_grad(), capture_routes(net) as cap:
        net(torch.tensor([seq]))
    return cap.to_records()[0].ids.long()[:-1].numpy()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """``trainer/`` saved; rollouts ``r.jsonl`` of 4 single-turn contexts and one two-turn episode (seq_id 4)
    sampled by the NVFP4 copy; per context the turns' (prompt length, prompt + output, engine rows)."""
    tmp = tmp_path_factory.mktemp("engine_routes")
    trainer = tiny_qwen3_moe(seed=5)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(20.0)
    trainer.save_pretrained(tmp / "trainer")
    sampler = fake_quantize_module(trainer, "nvfp4", skip=("lm_head",))
    g = torch.Generator().manual_seed(1)
    lines, turns = [], []
    for b in range(4):
        prompt = torch.randint(0, V, (4 + b,), generator=g).tolist()
        toks, lps = _sampled(sampler, prompt, 6, seed=10 + b)
        lines.append({"group": "q", "version": 0, "seq_id": b, "input_ids": prompt, "tokens": toks,
                      "sampler_logprobs": lps, "temperature": 1.0})
        turns.append([(len(prompt), prompt + toks, _engine_rows(sampler, prompt + toks))])
    prompt = torch.randint(0, V, (5,), generator=g).tolist()
    t1, lp1 = _sampled(sampler, prompt, 4, seed=20)
    ctx2 = prompt + t1 + [7, 9, 11]  # a tool output between the turns: context, never sampled
    t2, lp2 = _sampled(sampler, ctx2, 5, seed=21)
    for inp, toks, lps in ((prompt, t1, lp1), (ctx2, t2, lp2)):
        lines.append({"group": "q", "version": 0, "seq_id": 4, "input_ids": inp, "tokens": toks,
                      "sampler_logprobs": lps, "temperature": 1.0})
    rows1 = _engine_rows(sampler, prompt + t1)
    rows2 = _engine_rows(sampler, ctx2 + t2)
    rows2[: len(rows1)] = (rows2[: len(rows1)] + 1) % E  # a re-prefill that routed the shared prefix otherwise
    turns.append([(len(prompt), prompt + t1, rows1), (len(ctx2), ctx2 + t2, rows2)])
    path = save_jsonl(lines, tmp / "r.jsonl")
    return tmp, path, trainer, sampler, turns


def _responses(turns, engine):
    out = []
    for ctx in turns:
        got = []
        for p, seq, rows in ctx:
            if engine == "vllm":
                got.append(vllm.routed_positions(vllm_response(rows, p)))
            else:
                got.append(sglang.routed_positions(sglang_response(rows, seq[p:]), num_hidden_layers=L, top_k=K))
        out.append(got[0] if len(got) == 1 else got)
    return out


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_responses_make_a_routes_file_diagnose_replays(fleet, engine, capsys):
    tmp, path, trainer, sampler, turns = fleet
    rollouts = load_rollouts(path)
    assert len(rollouts.contexts) == 5
    file = save_engine_routes(rollouts, _responses(turns, engine), tmp / f"{engine}.safetensors", num_experts=E)
    routes = load_routes(file, rollouts)
    # the file's row s of each context is the sampler's route at position s, from the first turn that forwarded it
    for b, ctx in enumerate(turns):
        lo, hi = int(routes.offsets[b]), int(routes.offsets[b + 1])
        want = torch.zeros(hi - lo, L, K, dtype=torch.int64)
        done = 0
        for _, seq, rows in ctx:
            want[done: len(rows)] = torch.as_tensor(rows[done:])
            done = len(rows)
        assert done == hi - lo - 1
        assert torch.equal(routes.record.ids[lo:hi].long(), want)
        assert routes.record.token_valid[lo:hi].tolist() == [True] * (hi - lo - 1) + [False]
    # the trainer's forward under the file's routes routes as the sampler did at every forwarded position
    width = int(rollouts.contexts.lengths.max())
    rows = torch.arange(len(rollouts.contexts))
    ids, pad = routes.batch(rows, width)
    with torch.no_grad(), replay_routes(trainer, ids, pad_mask=pad), capture_routes(trainer) as cap:
        trainer(rollouts.sequences)
    got = cap.routes.long()
    assert torch.equal(got[~pad].sort(-1).values, ids[~pad].sort(-1).values)
    # the sampler's own routes differ from the trainer's somewhere (so the replay changed something)
    with torch.no_grad(), capture_routes(trainer) as own:
        trainer(rollouts.sequences)
    assert not torch.equal(own.routes.long()[~pad].sort(-1).values, ids[~pad].sort(-1).values)
    rc = cli(["diagnose", str(path), "--model", str(tmp / "trainer"), "--out", str(tmp / f"out_{engine}"),
              "--attribute", "--current-version", "0", "--group-format", "q=nvfp4", "--quantize-skip", "lm_head",
              "--routes", str(file)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads((tmp / f"out_{engine}" / "attribution.json").read_text())
    q = {s["label"]: s for s in data["slices"] if s["kind"] == "group"}["q"]
    assert "routing" in data["causes"] and "routing" in q["parts"]


def test_misaligned_engine_routes_name_the_argument(fleet):
    tmp, path, _, _, turns = fleet
    rollouts = load_rollouts(path)
    good = _responses(turns, "vllm")
    out = tmp / "bad.safetensors"

    def bad(positions, match, **kw):
        with pytest.raises(ValueError, match=match):
            save_engine_routes(rollouts, positions, out, **{"num_experts": E, **kw})
        assert not out.exists()

    bad(good[:-1], r"positions holds 4 entries, the rollouts 5 contexts")
    full = torch.cat([good[0], torch.zeros(1, L, K, dtype=torch.int64)])  # a row for the never-forwarded token
    bad([full] + good[1:], r"positions\[0\] holds 10 rows, its context 10 tokens: the last turn's rows must cover 9 "
                           r"positions \(prompt \+ output - 1\): one row more")
    bad([good[0][:-1]] + good[1:], r"positions\[0\] holds 8 rows, its context 10 tokens: the last turn's rows must "
                                   r"cover 9 positions \(prompt \+ output - 1\)$")
    early = [good[4][0][:-4], good[4][1]]  # turn 0 ends inside the prompt: no sampled token at position 4
    bad(good[:4] + [early], r"positions\[4\]\[0\] holds 4 rows: position 4 of context 4 is no recorded sampled "
                            r"token .* sampled positions are 5..8, 12..16")
    bad(good[:4] + [[good[4][1], good[4][1]]], r"positions\[4\]\[1\] holds 16 rows, no more than the turn before")
    bad(good[:4] + [[good[4][0]]], r"positions\[4\]\[0\] holds 8 rows, its context 17 tokens: .* 16 positions "
                                   r".*last turn missing\?")
    bad(good[:4] + [[good[4][0][:, :1], good[4][1]]], r"positions\[4\]\[0\]: \[1 layers, top_k 2\], positions\[0\]'s \[2 layers")
    dup = good[1].clone()
    dup[2, 1, 1] = dup[2, 1, 0]
    bad([good[0], dup] + good[2:], r"positions\[1\]: .*duplicate expert within token 2")
    bad(good, r"positions\[0\]: .*out of range", num_experts=3)
    bad([good[0].float()] + good[1:], r"positions\[0\] must hold integer expert ids")
    bad([good[0][0]] + good[1:], r"positions\[0\] must be \[positions, layers, top_k\]")
    bad(good, r"moe_layers must be distinct layer indices in \[0, 2\)", moe_layers=[0, 2])
    with pytest.raises(TypeError, match="positions must be a list"):
        save_engine_routes(rollouts, "junk", out, num_experts=E)
    # nested lists are read as well as tensors
    lists = [good[0].tolist()] + [g if isinstance(g, list) else g for g in good[1:]]
    save_engine_routes(rollouts, lists, out, num_experts=E)
    assert torch.equal(load_routes(out, rollouts).record.ids[: good[0].shape[0]].long(), good[0])
