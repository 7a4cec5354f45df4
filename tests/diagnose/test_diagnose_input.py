"""diagnose's input boundary (issue 40): every malformed rollouts, trainer or model input is refused once, where it
is read, with the CLI's exit-2 message naming the file, the line (or tensor) and the field; records are held in
CSR and never padded; report.json is strict JSON; a model folder's own code never runs; labels are bounded."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from offpolicy.__main__ import main as cli
from offpolicy.diagnose import RolloutsError, diagnose, from_lines, load_rollouts, save_jsonl, save_safetensors
from support.diagnose_records import TinyLM, record, rollout_lines

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def valid():
    lines, rec = rollout_lines(n=6)
    return lines, rec


def _strict(text: str):
    """json.loads that refuses NaN / Infinity, as strict (RFC 8259) readers do."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def test_a_short_logprobs_block_is_refused_not_shifted(valid):
    """Line 2's candidate log-probs lose their last row: before, every later row slid onto the wrong token and
    the shift was reported as the engine's; now the line is refused, naming it."""
    lines = copy.deepcopy(valid[0])
    lines[1]["candidates"]["logprobs"] = lines[1]["candidates"]["logprobs"][:-1]
    with pytest.raises(RolloutsError, match=r"line 2, field 'candidates.logprobs': holds \d+ entries for \d+ tokens"):
        from_lines(lines)
    lines = copy.deepcopy(valid[0])  # the missing row moved to the next line's block: every count still adds up
    row = lines[1]["candidates"]["logprobs"].pop()
    lines[2]["candidates"]["logprobs"].insert(0, row)
    with pytest.raises(RolloutsError, match="line 2, field 'candidates.logprobs'"):
        from_lines(lines)


def test_a_ragged_row_is_refused(valid):
    lines = copy.deepcopy(valid[0])
    lines[0]["candidates"]["ids"][1] = [3, 4, 5]
    lines[0]["candidates"]["logprobs"][1] = [-0.5, -1.0]
    with pytest.raises(RolloutsError, match=r"line 1, field 'candidates.logprobs\[1\]': holds 2 log-probs for 3 ids"):
        from_lines(lines)


def test_an_empty_context_is_refused(valid):
    """``input_ids: []`` made the first token read the logits at position -1."""
    lines = copy.deepcopy(valid[0])
    lines[0]["input_ids"] = []
    with pytest.raises(RolloutsError, match="line 1, field 'input_ids': empty"):
        from_lines(lines)


def test_a_token_outside_the_sequences_is_refused(valid, tmp_path):
    """safetensors rows / cols are checked against ``sequences`` (a row outside kept ``torch.empty`` memory)."""
    rec = valid[1]
    rows = rec.rows.clone()
    rows[0] = rec.sequences.shape[0] + 3
    st = tmp_path / "r.safetensors"
    save_safetensors(rec, st)
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(st), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(st))
    t["rows"] = rows
    save_file(t, str(st), metadata=meta)
    with pytest.raises(RolloutsError, match=r"r.safetensors.*field 'rows': token 0 sits in row \d+, outside"):
        load_rollouts(st)
    t["rows"] = rec.rows.clone()
    t["cols"] = rec.cols.clone()
    t["cols"][2] = 0
    save_file(t, str(st), metadata=meta)
    with pytest.raises(RolloutsError, match="field 'cols': token 2 sits at column 0"):
        load_rollouts(st)
    t["cols"] = rec.cols + 1  # every token one column off its place in sequences
    save_file(t, str(st), metadata=meta)
    with pytest.raises(RolloutsError, match="misaligned|column"):
        load_rollouts(st)


BAD_VALUES = [
    ("temperature", 0, "must be > 0"), ("temperature", -0.7, "must be > 0"), ("temperature", float("nan"), "finite"),
    ("top_p", 0, r"\(0, 1\]"), ("top_p", 1.5, r"\(0, 1\]"), ("top_k", -3, "outside"), ("top_k", 2.5, "integer"),
    ("tokens", [5.9], "integer"), ("tokens", [True], "integer"), ("tokens", [-4], "outside"),
    ("sampler_logprobs", [float("nan")], "finite"), ("sampler_logprobs", [0.3], "> 0"),
    ("sampler_logprobs", [None], "null"), ("sampler_logprobs", [float("inf")], "finite"),
    ("version", True, "integer"), ("version", -2, "outside"), ("seq_id", -1, "outside"), ("group", 7, "string"),
]


@pytest.mark.parametrize("field,value,message", BAD_VALUES)
def test_bad_values_are_refused_naming_line_and_field(field, value, message):
    line = {"group": "a", "version": 0, "input_ids": [1], "tokens": [2], "sampler_logprobs": [-0.5],
            "temperature": 0.7, "top_p": 1.0, "top_k": None}
    good = dict(line)
    line[field] = value
    with pytest.raises(RolloutsError, match=rf"line 2, field '{field}(\[0\])?': .*{message}"):
        from_lines([good, line])


@pytest.mark.parametrize("ids,lps,message", [
    ([[2, -3]], [[-0.5, -1.0]], "outside"),            # negative id (not the -1 / null padding)
    ([[2, 2]], [[-0.5, -0.5]], "appears twice"),        # duplicate id in a row
    ([[2, -1]], [[-0.5, -1.0]], "outside"),            # -1 with a finite log-prob is not padding
    ([[2]], [[float("nan")]], "finite"), ([[2]], [[0.5]], "> 0"), ([[2.0]], [[-0.5]], "integer"),
])
def test_bad_candidate_rows_are_refused(ids, lps, message):
    line = {"group": "a", "version": 0, "input_ids": [1], "tokens": [2], "sampler_logprobs": [-0.5],
            "temperature": 0.7, "candidates": {"kind": "head", "ids": ids, "logprobs": lps}}
    with pytest.raises(RolloutsError, match=rf"line 1, field 'candidates\.(ids|logprobs)\[0\](\[\d\])?': .*{message}"):
        from_lines([line])


def test_candidates_on_some_lines_only_are_refused(valid):
    """Candidates absent on the first line and present later used to be collected without their tokens'
    positions."""
    lines = copy.deepcopy(valid[0])
    lines[0]["candidates"] = None
    with pytest.raises(RolloutsError, match="line 2, field 'candidates': present although line 1"):
        from_lines(lines)


def test_records_are_csr_and_neither_reading_nor_scoring_pads(monkeypatch):
    """One 2,000-wide head row among 3-wide ones: the record holds exactly the file's entries, and the model path
    (support mask, candidate log-probs) never builds a padded [N, K] record."""
    from offpolicy.records.candidates import Candidates
    from offpolicy.records.csr_candidates import CSRCandidates

    vocab = 2048
    emb = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))

    class Wide(torch.nn.Module):
        def forward(self, ids):
            return emb[ids]

    with torch.no_grad():
        lt = torch.log_softmax(emb[[1, 2, 3]] / 0.7, -1)
    lines = []
    for i, (ctx, tok) in enumerate([(1, 2), (2, 3), (3, 4)]):
        width = vocab if i == 0 else 3
        ids = [tok] + [j for j in range(width) if j != tok][: width - 1]
        lines.append({"group": "g", "version": 0, "input_ids": [ctx], "tokens": [tok],
                      "sampler_logprobs": [float(lt[i, tok])], "temperature": 0.7,
                      "candidates": {"kind": "head", "ids": [ids], "logprobs": [[float(lt[i, j]) for j in ids]]}})
    rec = from_lines(lines)
    assert isinstance(rec.candidates, CSRCandidates) and rec.candidates.nnz == vocab + 6

    def refuse(*a, **k):
        raise AssertionError("diagnose padded a candidate record")

    monkeypatch.setattr(Candidates, "from_csr", classmethod(refuse))
    monkeypatch.setattr(CSRCandidates, "to_padded", refuse)
    rep = diagnose(rec, model=Wide())
    assert rep.ok, rep.text()


def test_report_json_is_strict(tmp_path):
    """Every trainer log-prob -inf: k1 / k3 are NaN; report.json writes them as null, never NaN / Infinity."""
    rec = record(TinyLM(), n=4)
    rep = diagnose(rec, trainer_logprobs=torch.full((len(rec),), float("-inf")), out_dir=tmp_path)
    text = (tmp_path / "report.json").read_text()
    data = _strict(text)
    assert math.isnan(rep.overall.k1) and data["overall"]["k1"] is None and data["overall"]["non_finite"] == len(rec)
    assert "NaN" not in text and "Infinity" not in text


REMOTE_CODE = '''
from pathlib import Path
Path(__file__).with_name("RAN").write_text("the folder's code ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "evil"
'''


def _remote_code_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    (path / "evil.py").write_text(REMOTE_CODE)
    return path


def test_a_model_folder_with_remote_code_is_refused_without_prompting(tmp_path, monkeypatch, capsys):
    """transformers prompted on stdin for a folder with custom code (answering y ran it); now
    trust_remote_code=False: refused at once, exit 2, stdin never read, the folder's Python never run."""
    folder = _remote_code_folder(tmp_path / "model")
    lines, _ = rollout_lines(n=2)
    roll = save_jsonl(lines, tmp_path / "r.jsonl")

    asked = []

    class NoStdin:
        def __getattr__(self, name):
            asked.append(f"sys.stdin.{name}")
            raise EOFError("stdin is closed")

    def no_input(*args):
        asked.append("input()")
        raise EOFError("stdin is closed")

    monkeypatch.setattr(sys, "stdin", NoStdin())
    monkeypatch.setattr("builtins.input", no_input)
    assert cli(["diagnose", str(roll), "--model", str(folder), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(folder) in err and "trust_remote_code" in err
    assert asked == [] and not (folder / "RAN").exists()


def test_a_model_folder_with_remote_code_in_a_subprocess_with_stdin_closed(tmp_path):
    folder = _remote_code_folder(tmp_path / "model")
    lines, _ = rollout_lines(n=2)
    roll = save_jsonl(lines, tmp_path / "r.jsonl")
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "offpolicy", "diagnose", str(roll), "--model", str(folder),
                           "--out", str(tmp_path / "o")], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "trust_remote_code" in done.stderr
    assert not (folder / "RAN").exists()


def test_long_group_names_are_bounded_and_plotted_quickly(tmp_path):
    """A 1 MB group name took 600 s to plot; labels are now cut to 40 characters with an ellipsis (text, markdown,
    plot legend), report.json keeps the name whole."""
    from offpolicy.diagnose.findings import LABEL_WIDTH, short_label

    name = "x" * (1 << 20)
    rec = replace(record(TinyLM(), n=4), group_names=(name,))
    trainer = rec.sampler_logprobs.double()
    assert short_label(name) == "x" * (LABEL_WIDTH - 1) + "\u2026"
    text = diagnose(rec, trainer_logprobs=trainer, current_version=0).text()  # no plot yet: fails fast when unbounded
    assert max(len(line) for line in text.splitlines()) < 400
    t0 = time.perf_counter()
    diagnose(rec, trainer_logprobs=trainer, out_dir=tmp_path, current_version=0)
    assert time.perf_counter() - t0 < 30
    assert max(len(line) for line in (tmp_path / "report.md").read_text().splitlines()) < 2000
    assert name in _strict((tmp_path / "report.json").read_text())["by_group"]
    assert short_label("a\nb$c") == "a?b$c"
    from offpolicy.diagnose.plots import plot_label

    assert plot_label("$x^$") == r"\$x^\$"


def test_trainer_and_model_files_that_do_not_parse_are_named(tmp_path, capsys):
    lines, _ = rollout_lines(n=2)
    roll = save_jsonl(lines, tmp_path / "r.jsonl")
    junk = tmp_path / "trainer.pt"
    junk.write_bytes(b"\x80\x04junk that is not a pickle")
    assert cli(["diagnose", str(roll), "--trainer-logprobs", str(junk), "--out", str(tmp_path / "o")]) == 2
    assert "trainer.pt: not a readable torch file" in capsys.readouterr().err
    st = tmp_path / "trainer.safetensors"
    st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert cli(["diagnose", str(roll), "--trainer-logprobs", str(st), "--out", str(tmp_path / "o")]) == 2
    assert "trainer.safetensors: not a readable safetensors file" in capsys.readouterr().err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3", "vocab_size": 48}')
    (model / "model.safetensors").write_bytes(b"\x00" * 40)
    assert cli(["diagnose", str(roll), "--model", str(model), "--out", str(tmp_path / "o")]) == 2
    assert f"--model {model}: the model does not load" in capsys.readouterr().err


def test_contexts_are_csr_and_fed_in_chunks_padded_to_their_own_longest(monkeypatch):
    """One 20,000-token context among 40 one-token ones: the record holds their ids back to back (not 41 x 20,001),
    and the model sees chunks of 16 sequences padded only to the chunk's longest."""
    from offpolicy.diagnose.contexts import Contexts

    vocab = 32
    emb = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1))

    class Bigram(torch.nn.Module):
        def forward(self, ids):
            return emb[ids]

    def line(ctx, tok):
        lq = float(torch.log_softmax(emb[ctx[-1]], -1)[tok])
        return {"group": "g", "version": 0, "input_ids": ctx, "tokens": [tok], "sampler_logprobs": [lq],
                "temperature": 1.0}

    lines = [line([3] * 20_000, 5)] + [line([i % vocab], (i + 1) % vocab) for i in range(40)]
    rec = from_lines(lines)
    assert isinstance(rec.contexts, Contexts) and rec.contexts.ids.numel() == 20_001 + 40 * 2
    shapes = []
    padded = Contexts.padded

    def spy(self, start=0, stop=None):
        out = padded(self, start, stop)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(Contexts, "padded", spy)
    rep = diagnose(rec, model=Bigram())
    assert rep.ok and rep.overall.k3 < 1e-9, rep.text()
    assert shapes == [(16, 20_001), (16, 2), (9, 2)]


def test_an_older_safetensors_file_with_padded_sequences_reads(valid, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    rec = valid[1]
    st = save_safetensors(rec, tmp_path / "new.safetensors")
    with safe_open(str(st), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(st))
    t.pop("context_ids")
    t.pop("context_offsets")
    t["sequences"] = rec.sequences
    save_file(t, str(tmp_path / "old.safetensors"), metadata=meta)
    back = load_rollouts(tmp_path / "old.safetensors")
    assert torch.equal(back.sequences, rec.sequences) and torch.equal(back.tokens, rec.tokens)
    t["context_offsets"] = torch.tensor([0, 5, 3, 9])
    t["context_ids"] = torch.zeros(9, dtype=torch.int64)
    save_file(t, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(RolloutsError, match="bad.safetensors.*field 'contexts.offsets'"):
        load_rollouts(tmp_path / "bad.safetensors")
