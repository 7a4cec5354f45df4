"""``offpolicy diagnose ROLLOUTS --model DIR --attribute --routes FILE`` end to end on a tiny Qwen3-MoE saved with
``save_pretrained``: an NVFP4 sampler whose routes were captured gets a positive routing share; the trainer's own
routes replayed get none; every malformed or misaligned routes file exits 2 with one message naming the file and
the tensor, never a traceback."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from offpolicy.__main__ import main as cli
from offpolicy.diagnose import load_rollouts, save_jsonl
from offpolicy.diagnose.route_file import load_routes, save_routes
from offpolicy.fleet.quant import fake_quantize_module
from offpolicy.fleet.sampler import sample
from offpolicy.routing import capture_routes
from support.tiny_moe import V, tiny_qwen3_moe

pytest.importorskip("transformers")


def _routes_of(net, rollouts, path):
    """The routes ``net`` takes on each recorded context (a teacher-forced forward, one sequence at a time), the
    last position marked unrouted (``valid`` False: an engine never forwards it)."""
    recs = []
    ctx = rollouts.contexts
    for b in range(len(ctx)):
        seq = ctx.ids[int(ctx.offsets[b]): int(ctx.offsets[b + 1])]
        with torch.no_grad(), capture_routes(net) as cap:
            net(seq[None])
        pad = torch.zeros(1, seq.numel(), dtype=torch.bool)
        pad[0, -1] = True
        recs += cap.to_records(pad_mask=pad)
    return save_routes(recs, path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``trainer/`` (a tiny Qwen3-MoE: 2 routed layers of 8 experts, top-2), rollouts of one group ``q`` sampled by
    its NVFP4 copy (``r.jsonl``; its output layer kept, as serving stacks do), and two routes files: the sampler's (``sampler.safetensors``) and the trainer's
    own (``own.safetensors``)."""
    tmp = tmp_path_factory.mktemp("attr_routes")
    trainer = tiny_qwen3_moe(seed=5)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(20.0)  # peaked next-token distributions
    trainer.save_pretrained(tmp / "trainer")
    sampler = fake_quantize_module(trainer, "nvfp4", skip=("lm_head",))  # as serving stacks keep the output layer
    prompts = torch.randint(0, V, (12, 4), generator=torch.Generator().manual_seed(1))
    ro = sample(sampler, prompts, 8, 1.0, 1.0, None, record=None, version=0,
                generator=torch.Generator().manual_seed(2))
    tb = ro.flatten()
    lines = []
    for b in range(ro.sequences.shape[0]):
        sel = tb.rows == b
        start = int(tb.cols[sel].min())
        lines.append({"group": "q", "version": 0, "input_ids": ro.sequences[b, :start].tolist(),
                      "tokens": tb.tokens[sel].tolist(), "sampler_logprobs": tb.sampler_logprobs[sel].tolist(),
                      "temperature": 1.0})
    path = save_jsonl(lines, tmp / "r.jsonl")
    rollouts = load_rollouts(path)
    _routes_of(sampler, rollouts, tmp / "sampler.safetensors")
    _routes_of(trainer, rollouts, tmp / "own.safetensors")
    return tmp, path


def _run(saved, out, *extra):
    tmp, path = saved
    return cli(["diagnose", str(path), "--model", str(tmp / "trainer"), "--out", str(tmp / out), "--attribute",
                "--current-version", "0", *extra])


def _group(tmp, out):
    data = json.loads((tmp / out / "attribution.json").read_text())
    return data, {s["label"]: s for s in data["slices"] if s["kind"] == "group"}["q"]


def test_the_samplers_routes_give_routing_a_positive_share(saved, capsys):
    tmp, _ = saved
    rc = _run(saved, "sampler", "--group-format", "q=nvfp4", "--quantize-skip", "lm_head", "--routes",
              str(tmp / "sampler.safetensors"))
    out = capsys.readouterr()
    assert rc == 0, out.err
    data, q = _group(tmp, "sampler")
    parts = q["parts"]
    assert "routing" in data["causes"] and data["mistakes"] == []
    # the sampler is the trainer in NVFP4 with its own routes: format and routing explain (nearly) all of it
    assert parts["routing"]["share_mean_abs_log_r"] > 0.01  # 3% measured: NVFP4 attention dominates
    assert parts["format"]["share_mean_abs_log_r"] > 0.05
    assert abs(parts["residual"]["share_mean_abs_log_r"]) < 0.05
    assert sum(p["mean_abs_log_r"] for p in parts.values()) == pytest.approx(q["total"]["mean_abs_log_r"])
    assert "## Attribution" in (tmp / "sampler" / "report.md").read_text()


def test_the_trainers_own_routes_give_routing_no_share(saved, capsys):
    """Replaying the routes the trainer takes itself changes no logit: routing's part is ~0. The group is declared
    fp32 here so that routing is the only cause (with the format cause on, the Shapley routing part would be half
    the NVFP4 copy's change under the trainer's routes, an interaction, not 0)."""
    tmp, _ = saved
    rc = _run(saved, "own", "--group-format", "q=fp32", "--routes", str(tmp / "own.safetensors"))
    out = capsys.readouterr()
    assert rc == 0, out.err
    data, q = _group(tmp, "own")
    assert "routing" in data["causes"] and q["total"]["mean_abs_log_r"] > 1e-3
    assert abs(q["parts"]["routing"]["share_mean_abs_log_r"]) < 1e-3
    # the same declaration with the sampler's routes: routing takes a share
    rc = _run(saved, "own2", "--group-format", "q=fp32", "--routes", str(tmp / "sampler.safetensors"))
    assert rc == 0, capsys.readouterr().err
    _, q2 = _group(tmp, "own2")
    assert q2["parts"]["routing"]["share_mean_abs_log_r"] > 0.05


def _break(tensors: dict, meta: dict, case: str) -> tuple[dict, dict]:
    ids, off = tensors["expert_ids"].clone(), tensors["route_offsets"].clone()
    valid = tensors["route_valid"].clone()
    if case == "missing":
        del tensors["expert_ids"]
        return tensors, meta
    if case == "shifted":  # one row short per sequence (the slice started one position late)
        keep = torch.ones(ids.shape[0], dtype=torch.bool)
        keep[off[1:] - 1] = False
        ids, valid = ids[keep], valid[keep]
        off = off - torch.arange(off.numel())
    elif case == "range":
        ids[3, 1, 0] = 9
    elif case == "duplicate":
        ids[5, 0, 1] = ids[5, 0, 0]
    elif case == "stale":  # a row without a route that still holds ids
        ids[int(off[1]) - 1] = 3
        ids[int(off[1]) - 1, :, 1] = 4
    elif case == "layers":
        ids = ids[:, :1].contiguous()
    elif case == "float":
        ids = ids.float()
    elif case == "experts":
        meta = {"num_experts": "16"}
    elif case == "no_meta":
        meta = {}
    elif case == "sequences":
        off = off[:-1].clone()
    elif case == "valid":
        valid = valid.to(torch.uint8)
    return {"expert_ids": ids, "route_offsets": off, "route_valid": valid}, meta


@pytest.mark.parametrize("case, field", [
    ("missing", r"missing tensor\(s\) \['expert_ids'\]"),
    ("shifted", "tensor 'route_offsets': sequence 0 holds 11 route rows, its context 12 tokens"),
    ("range", "tensor 'expert_ids': .*9"),
    ("duplicate", "tensor 'expert_ids'"),
    ("stale", "tensor 'expert_ids'"),
    ("layers", "tensor 'expert_ids': L=1 routed layers"),
    ("float", "tensor 'expert_ids': integer \\[S, L, K\\] expected"),
    ("experts", "metadata 'num_experts': 16"),
    ("no_meta", "metadata 'num_experts'"),
    ("sequences", "tensor 'route_offsets': 11 sequences, the rollouts hold 12"),
    ("valid", "tensor 'route_valid': bool"),
    ("junk", "not a readable safetensors file"),
])
def test_malformed_routes_files_exit_2_naming_the_file_and_field(saved, capsys, case, field):
    import re

    tmp, _ = saved
    bad = tmp / f"bad_{case}.safetensors"
    if case == "junk":
        bad.write_bytes(b"not a safetensors file")
    else:
        from safetensors import safe_open

        with safe_open(str(tmp / "sampler.safetensors"), framework="pt") as f:
            meta = dict(f.metadata())
        tensors, meta = _break(load_file(str(tmp / "sampler.safetensors")), meta, case)
        save_file(tensors, str(bad), metadata=meta)
    rc = _run(saved, f"bad_{case}", "--group-format", "q=nvfp4", "--routes", str(bad))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and sum(line.startswith("offpolicy diagnose:") for line in err.splitlines()) == 1
    assert f"--routes {bad}" in err and re.search(field, err), err


def test_routes_without_attribute_and_a_dense_model_are_refused(saved, capsys, tmp_path):
    tmp, path = saved
    rc = cli(["diagnose", str(path), "--model", str(tmp / "trainer"), "--out", str(tmp_path / "o"),
              "--routes", str(tmp / "sampler.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and "--routes: only read with --attribute" in err
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    rc = cli(["diagnose", str(path), "--model", str(tmp_path / "dense"), "--out", str(tmp_path / "o"), "--attribute",
              "--current-version", "0", "--group-format", "q=nvfp4", "--routes", str(tmp / "sampler.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and "has no supported MoE router" in err and "Traceback" not in err


def test_a_routes_file_round_trips_and_replays_the_rows_it_holds(saved):
    """load_routes gives back what save_routes wrote; batch() places each sequence's rows at its positions and pads
    past its end and on unrouted rows."""
    tmp, path = saved
    rollouts = load_rollouts(path)
    r = load_routes(tmp / "sampler.safetensors", rollouts)
    assert r.record.ids.dtype == torch.uint8 and r.record.ids.shape == (int(rollouts.contexts.offsets[-1]), 2, 2)
    assert torch.equal(r.offsets, rollouts.contexts.offsets)
    ids, pad = r.batch(torch.tensor([3, 0]), 14)
    lo, hi = int(r.offsets[3]), int(r.offsets[4])
    assert torch.equal(ids[0, : hi - lo], r.record.ids[lo:hi].long())
    assert pad[0].tolist() == [False] * (hi - lo - 1) + [True] * (14 - hi + lo + 1)
    assert int(ids[0, hi - lo:].abs().sum()) == 0
