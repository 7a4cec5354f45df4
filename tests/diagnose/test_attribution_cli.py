"""``offpolicy diagnose ROLLOUTS --model DIR --attribute``: a stale NVFP4 group and a fresh BF16 group of a saved
tiny Qwen3 are attributed end to end from their folders; every bad attribution flag exits 2 with one message
naming the flag, never a traceback."""

from __future__ import annotations

import json

import pytest
import torch

from offpolicy.__main__ import main as cli
from offpolicy.diagnose import save_jsonl
from offpolicy.fleet.quant import fake_quantize_module
from offpolicy.fleet.sampler import sample

V = 48


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Folders ``v2`` (the trainer) and ``v1`` (every weight 5% off), and rollouts: group ``b200`` served v1 in
    NVFP4, group ``a100`` served v2 in BF16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tmp = tmp_path_factory.mktemp("attr_cli")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    v2 = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        v2.lm_head.weight.mul_(40.0)
    v1 = Qwen3ForCausalLM(cfg).float().eval()
    v1.load_state_dict(v2.state_dict())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.abs().mean())
    v2.save_pretrained(tmp / "v2")
    v1.save_pretrained(tmp / "v1")
    lines = []
    for name, net, version in (("b200", fake_quantize_module(v1, "nvfp4"), 1), ("a100", fake_quantize_module(v2, "bf16"), 2)):
        prompts = torch.randint(0, V, (8, 3), generator=torch.Generator().manual_seed(version))
        ro = sample(net, prompts, 6, 1.0, 1.0, None, record=None, version=version,
                    generator=torch.Generator().manual_seed(10 + version))
        tb = ro.flatten()
        for b in range(ro.sequences.shape[0]):
            sel = tb.rows == b
            start = int(tb.cols[sel].min())
            lines.append({"group": name, "version": version, "input_ids": ro.sequences[b, :start].tolist(),
                          "tokens": tb.tokens[sel].tolist(), "sampler_logprobs": tb.sampler_logprobs[sel].tolist(),
                          "temperature": 1.0})
    path = save_jsonl(lines, tmp / "r.jsonl")
    return tmp, path


def _run(saved, *extra):
    tmp, path = saved
    return cli(["diagnose", str(path), "--model", str(tmp / "v2"), "--out", str(tmp / "out"), *extra])


def test_cli_attributes_a_stale_nvfp4_group(saved, capsys):
    tmp, _ = saved
    rc = _run(saved, "--attribute", "--version-weights", f"1={tmp / 'v1'}", "--group-format", "b200=nvfp4",
              "--group-format", "a100=bf16", "--step", "3")
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Shapley" in out.out and "attribution:" in out.out
    data = json.loads((tmp / "out" / "attribution.json").read_text())
    groups = {s["label"]: s for s in data["slices"] if s["kind"] == "group"}
    b200 = groups["b200"]["parts"]
    # staleness (every weight 5% off) and NVFP4 both move b200; no routing (a dense model); the record is honest
    assert b200["staleness"]["share_mean_abs_log_r"] > 0.1 and b200["format"]["share_mean_abs_log_r"] > 0.1
    assert abs(b200["routing"]["share_mean_abs_log_r"]) < 1e-9 and data["mistakes"] == []
    assert sum(p["mean_abs_log_r"] for p in b200.values()) == pytest.approx(groups["b200"]["total"]["mean_abs_log_r"])
    a100 = groups["a100"]["parts"]
    assert abs(a100["staleness"]["share_mean_abs_log_r"]) < 1e-9  # a100 served the current version
    for name in ("attribution.md", "attribution.png", "report.md"):
        assert (tmp / "out" / name).is_file()
    assert "## Attribution" in (tmp / "out" / "report.md").read_text()
    report = json.loads((tmp / "out" / "report.json").read_text())
    assert report["attribution"]["file"] == "attribution.json"
    assert [g["label"] for g in report["attribution"]["groups"]] == ["all", "b200", "a100"]
    # a second run with the first as its history draws the parts over steps
    hist = tmp / "step3.json"
    hist.write_text((tmp / "out" / "attribution.json").read_text())
    rc = _run(saved, "--attribute", "--version-weights", f"1={tmp / 'v1'}", "--group-format", "b200=nvfp4",
              "--group-format", "a100=bf16", "--step", "4", "--history", str(hist))
    assert rc == 0 and (tmp / "out" / "attribution_history.png").is_file()


@pytest.mark.parametrize("extra, flag", [
    (["--version-weights", "1"], "--version-weights '1': expected"),
    (["--version-weights", "x=/nowhere"], "--version-weights 'x=/nowhere': the version 'x' is not an integer"),
    (["--version-weights", "1=/nowhere/at/all", "--group-format", "b200=nvfp4", "--group-format", "a100=bf16"],
     "--version-weights 1=/nowhere/at/all: no such folder"),
    (["--group-format", "b200=nvfp4", "--group-format", "a100=bf16"],
     "--version-weights: the record holds tokens of version(s) [1]"),
    (["--version-weights", "1={v1}", "--group-format", "b200=nvfp4"], "--group-format: no weight format given"),
    (["--version-weights", "1={v1}", "--group-format", "b200=int3"], "--group-format: unknown weight format"),
    (["--version-weights", "1={v1}", "--version-weights", "1={v1}"], "--version-weights: 1 is given twice"),
    (["--attribute-tokens", "0"], "--attribute-tokens: must be >= 1"),
    (["--history", "{r}"], "--history"),
    (["--step", "2", "--history", "/nowhere.json"], "--history /nowhere.json: not a readable attribution.json"),
])
def test_bad_attribution_flags_exit_2_naming_the_flag(saved, capsys, extra, flag):
    tmp, path = saved
    extra = [e.format(v1=tmp / "v1", r=path) for e in extra]
    rc = _run(saved, "--attribute", *extra)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert flag in err and "Traceback" not in err, err


def test_attribute_needs_a_model(saved, capsys, tmp_path):
    tmp, path = saved
    torch.save({"logprobs": torch.full((96,), -1.0)}, tmp_path / "t.pt")
    rc = cli(["diagnose", str(path), "--trainer-logprobs", str(tmp_path / "t.pt"), "--attribute", "--out",
              str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--attribute: needs --model DIR" in err and "Traceback" not in err
