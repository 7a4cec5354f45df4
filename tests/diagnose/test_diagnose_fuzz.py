"""Seeded fuzz of malformed diagnose inputs (issue 40): valid rollouts, trainer and model files, mutated
(truncations, wrong types, missing keys, shifted blocks, ragged rows, huge rows, NaN / inf, binary junk, corrupt
safetensors and pickles, empty files, deep nesting), each run through the CLI's main function in-process.

Every file must end in exit 2 with one message naming the file and the line / tensor / field, or in a right
report (exit 0 / 1 and a strict report.json); never a traceback (exit 3 or an exception); a shifted candidate
block is always refused, never diagnosed."""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path

import pytest
import torch

from offpolicy.__main__ import main as cli
from offpolicy.diagnose import save_jsonl, save_safetensors
from support.diagnose_records import rollout_lines, trainer_logprobs

SEED = 40
WHERE = re.compile(r"line \d+|field '|tensor '|metadata '|not a readable|--model |no rollouts|not a rollouts file|"
                   r"trainer log-probs for|No such file")


def _jsonl_mutants(lines: list[dict], rng: random.Random) -> list[tuple[str, object, bool]]:
    """``(name, content, must_refuse)``: content a list of line dicts or raw bytes."""
    out: list[tuple[str, object, bool]] = []

    def mutate(name, fn, refuse=True):
        ls = copy.deepcopy(lines)
        fn(ls, rng.randrange(len(ls)))
        out.append((name, ls, refuse))

    for key in ("group", "input_ids", "tokens", "sampler_logprobs", "temperature"):
        mutate(f"missing_{key}", lambda ls, i, k=key: ls[i].pop(k))
    for key in ("kind", "ids", "logprobs"):
        mutate(f"missing_candidates_{key}", lambda ls, i, k=key: ls[i]["candidates"].pop(k))
    wrong = {"group": [1], "input_ids": "1 2", "tokens": {"a": 1}, "sampler_logprobs": -0.5, "temperature": "0.7",
             "top_p": [0.9], "top_k": "16", "version": "3", "versions": 3, "seq_id": 1.5, "candidates": [1, 2]}
    for key, value in wrong.items():
        mutate(f"wrong_type_{key}", lambda ls, i, k=key, v=value: ls[i].__setitem__(k, v))
    for name, value in (("float", 5.9), ("bool", True), ("negative", -2), ("huge", 1 << 40), ("null", None),
                        ("string", "7")):
        mutate(f"token_{name}", lambda ls, i, v=value: ls[i]["tokens"].__setitem__(0, v))
        mutate(f"input_id_{name}", lambda ls, i, v=value: ls[i]["input_ids"].__setitem__(0, v))
    for name, value in (("nan", float("nan")), ("inf", float("inf")), ("ninf", float("-inf")), ("positive", 0.25),
                        ("null", None), ("bool", False)):
        mutate(f"lq_{name}", lambda ls, i, v=value: ls[i]["sampler_logprobs"].__setitem__(-1, v))
        mutate(f"candidate_lp_{name}", lambda ls, i, v=value: ls[i]["candidates"]["logprobs"][0].__setitem__(0, v))
    for name, value in (("zero", 0), ("negative", -0.7), ("nan", float("nan")), ("inf", float("inf"))):
        mutate(f"temperature_{name}", lambda ls, i, v=value: ls[i].__setitem__("temperature", v))
    for name, value in (("zero", 0), ("above_one", 1.01), ("nan", float("nan")), ("negative", -0.5)):
        mutate(f"top_p_{name}", lambda ls, i, v=value: ls[i].__setitem__("top_p", v))
    for name, value in (("minus_five", -5), ("float", 2.5), ("bool", True)):
        mutate(f"top_k_{name}", lambda ls, i, v=value: ls[i].__setitem__("top_k", v))
    mutate("empty_context", lambda ls, i: ls[i].__setitem__("input_ids", []))
    mutate("empty_tokens", lambda ls, i: ls[i].update(tokens=[], sampler_logprobs=[],
                                                     candidates={"kind": "support", "ids": [], "logprobs": []}))
    mutate("short_lq", lambda ls, i: ls[i]["sampler_logprobs"].pop())
    mutate("short_versions", lambda ls, i: ls[i].update(versions=[0] * (len(ls[i]["tokens"]) - 1)))
    mutate("version_minus_two", lambda ls, i: ls[i].__setitem__("version", -2))
    mutate("seq_id_negative", lambda ls, i: ls[i].__setitem__("seq_id", -1))
    mutate("kind_full", lambda ls, i: ls[i]["candidates"].__setitem__("kind", "full"))
    mutate("kind_mixed", lambda ls, i: ls[i]["candidates"].__setitem__("kind", "head"))
    mutate("candidates_dropped_on_one_line", lambda ls, i: ls[i].__setitem__("candidates", None))
    mutate("short_ids_block", lambda ls, i: ls[i]["candidates"]["ids"].pop())
    mutate("short_logprobs_block", lambda ls, i: ls[i]["candidates"]["logprobs"].pop())
    mutate("ragged_row", lambda ls, i: ls[i]["candidates"]["logprobs"][0].pop())
    mutate("duplicate_id", lambda ls, i: ls[i]["candidates"]["ids"][0].__setitem__(-1, ls[i]["candidates"]["ids"][0][0])
           if len(ls[i]["candidates"]["ids"][0]) > 1 else ls[i]["candidates"]["ids"][0].append(
               ls[i]["candidates"]["ids"][0][0]))
    mutate("negative_candidate_id", lambda ls, i: ls[i]["candidates"]["ids"][0].__setitem__(0, -3))
    mutate("padding_id_with_value", lambda ls, i: ls[i]["candidates"]["ids"][0].__setitem__(0, -1))
    mutate("context_not_extended", lambda ls, i: ls[i].update(seq_id=ls[(i + 1) % len(ls)]["seq_id"]))

    # still valid: a right report, whatever it finds
    mutate("unknown_key", lambda ls, i: ls[i].__setitem__("engine", {"name": "vllm"}), refuse=False)
    mutate("versions_per_token", lambda ls, i: ls[i].update(versions=[0] * len(ls[i]["tokens"])), refuse=False)
    mutate("lines_reordered", lambda ls, i: ls.reverse(), refuse=False)
    mutate("lq_changed", lambda ls, i: ls[i]["sampler_logprobs"].__setitem__(0, -3.0), refuse=False)

    # shifted blocks: one row moved from a line's candidate block to the next line's, counts kept per file
    for name, field in (("shifted_ids_block", "ids"), ("shifted_logprobs_block", "logprobs"),
                        ("shifted_both_blocks", None)):
        ls = copy.deepcopy(lines)
        i = rng.randrange(len(ls) - 1)
        for f in ("ids", "logprobs") if field is None else (field,):
            ls[i + 1]["candidates"][f].insert(0, ls[i]["candidates"][f].pop())
        out.append((name, ls, True))
    # a huge (100k-wide) head row: valid, read as CSR
    ls = copy.deepcopy(lines[:2])
    for line in ls:
        line["candidates"] = {"kind": "head", "ids": [[t] for t in line["tokens"]],
                              "logprobs": [[v] for v in line["sampler_logprobs"]]}
    tok, lq = ls[0]["tokens"][0], ls[0]["sampler_logprobs"][0]
    rest = [j for j in range(100_001) if j != tok][:99_999]
    ls[0]["candidates"]["ids"][0] = [tok] + rest
    ls[0]["candidates"]["logprobs"][0] = [lq] + [-40.0] * len(rest)
    out.append(("huge_head_row", ls, False))

    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    for k in range(4):
        cut = rng.randrange(1, len(text) - 1)
        out.append((f"truncated_{k}", text[:cut], cut < len(text) - 1 and text[cut - 1:cut] != b"\n"))
    out.append(("empty_file", b"", True))
    out.append(("blank_lines", b"\n\n  \n", True))
    out.append(("binary_junk", bytes(rng.randrange(256) for _ in range(2000)), True))
    out.append(("junk_appended", text + b"\x00\xff\xfe garbage\n", True))
    out.append(("nan_literal", text.replace(b'"temperature": 0.7', b'"temperature": NaN', 1), True))
    out.append(("infinity_literal", text.replace(b'"temperature": 0.7', b'"temperature": Infinity', 1), True))
    out.append(("deep_nesting", b'{"tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", True))
    out.append(("deep_nesting_in_a_field", text.replace(b'"group": "ref"', b'"group": ' + b"[" * 5000 + b"]" * 5000,
                                                        1), True))
    out.append(("a_json_list", b"[1, 2, 3]\n", True))
    out.append(("one_number", b"42\n", True))
    return out


def _safetensors_mutants(rec, path: Path) -> list[tuple[str, dict, dict, bool]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    save_safetensors(rec, path)
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    t = load_file(str(path))
    n = len(rec)
    cases = []

    def case(name, **changes):
        tt = dict(t)
        mm = dict(meta)
        for k, v in changes.items():
            if k.startswith("meta_"):
                mm[k[5:]] = v
            elif v is None:
                tt.pop(k)
            else:
                tt[k] = v
        cases.append((name, tt, mm, True))

    off = t["candidate_offsets"].clone()
    a, b = int(off[2]), int(off[3])
    off[2], off[3] = b + 1, a
    case("offsets_decreasing", candidate_offsets=off)
    big = t["candidate_offsets"].clone()
    big[1] = 1 << 40
    case("offsets_huge", candidate_offsets=big)
    case("offsets_short", candidate_offsets=t["candidate_offsets"][:-1].clone())
    ids = t["candidate_ids"].clone()
    ids[0] = -5
    case("candidate_id_negative", candidate_ids=ids)
    case("rows_out_of_range", rows=t["rows"] + 100)
    case("cols_zero", cols=torch.zeros_like(t["cols"]))
    case("tokens_misaligned", tokens=t["tokens"].roll(1))
    case("temperature_nan", temperature=torch.full((n,), float("nan")))
    case("top_p_zero", top_p=torch.zeros(n))
    case("lq_positive", sampler_logprobs=torch.full((n,), 0.5))
    case("tokens_float", tokens=t["tokens"].float())
    case("group_index_out_of_range", group_index=t["group_index"] + 3)
    case("missing_rows", rows=None)
    case("groups_not_json", meta_groups="not json")
    case("groups_empty", meta_groups="[]")
    case("kind_bad", meta_candidate_kind="full")
    case("candidates_missing", candidate_logprobs=None)
    coff = t["context_offsets"].clone()
    coff[1] = int(coff[2]) + 1
    case("context_offsets_decreasing", context_offsets=coff)
    case("context_ids_negative", context_ids=t["context_ids"] - 100)
    case("contexts_missing", context_ids=None)
    return cases


def _run(args, capsys) -> tuple[int, str]:
    code = cli(["diagnose", *args])
    captured = capsys.readouterr()
    return code, captured.err


def _check(name: str, code: int, err: str, path: Path, out: Path, must_refuse: bool, counts: dict) -> None:
    assert code in (0, 1, 2), f"{name}: exit {code}: {err}"
    assert "Traceback" not in err, f"{name}: {err}"
    if code == 2:
        assert str(path.name) in err and WHERE.search(err), f"{name}: the message names no file / place: {err}"
        assert sum(line.startswith("offpolicy diagnose:") for line in err.splitlines()) == 1, f"{name}: {err}"
        counts["refused"] += 1
    else:
        assert not must_refuse, f"{name}: must be refused, got a report (exit {code})"
        data = json.loads((out / "report.json").read_text(),
                          parse_constant=lambda c: pytest.fail(f"{name}: report.json holds {c}"))
        assert data["overall"]["tokens"] > 0
        counts["reported"] += 1


def test_malformed_files_fuzz(tmp_path, capsys):
    rng = random.Random(SEED)
    lines, rec = rollout_lines(n=6)
    lp = trainer_logprobs(rec)
    from safetensors.torch import save_file

    trainer = tmp_path / "trainer.safetensors"
    save_file({"logprobs": lp}, str(trainer))
    counts = {"files": 0, "refused": 0, "reported": 0}
    out = tmp_path / "out"

    for k, (name, content, must_refuse) in enumerate(_jsonl_mutants(lines, rng)):
        path = tmp_path / f"m{k}_{name}.jsonl"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            save_jsonl(content, path)
        n_tok = sum(len(line.get("tokens", [])) for line in content) if isinstance(content, list) else 0
        tr = trainer
        if isinstance(content, list) and n_tok != len(rec) and n_tok > 0:  # trainer file for the mutated count
            tr = tmp_path / f"t{k}.safetensors"
            save_file({"logprobs": torch.full((n_tok,), -1.0)}, str(tr))
        code, err = _run([str(path), "--trainer-logprobs", str(tr), "--out", str(out)], capsys)
        _check(name, code, err, path, out, must_refuse, counts)
        counts["files"] += 1

    for k, (name, tensors, meta, must_refuse) in enumerate(_safetensors_mutants(rec, tmp_path / "valid.safetensors")):
        path = tmp_path / f"s{k}_{name}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        code, err = _run([str(path), "--trainer-logprobs", str(trainer), "--out", str(out)], capsys)
        _check(name, code, err, path, out, must_refuse, counts)
        counts["files"] += 1
    valid_st = tmp_path / "valid.safetensors"
    raw = valid_st.read_bytes()
    for name, data in (("st_truncated", raw[: len(raw) // 2]), ("st_header_junk", b"\xff" * 8 + raw[8:]),
                       ("st_empty", b""), ("st_binary", bytes(rng.randrange(256) for _ in range(500)))):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        code, err = _run([str(path), "--trainer-logprobs", str(trainer), "--out", str(out)], capsys)
        _check(name, code, err, path, out, True, counts)
        counts["files"] += 1

    roll = save_jsonl(lines, tmp_path / "valid.jsonl")
    n = len(rec)
    bad_trainers = {
        "trainer_pickle_junk.pt": b"\x80\x04\x95junk",
        "trainer_zip_junk.pt": b"PK\x03\x04" + bytes(100),
        "trainer_truncated.safetensors": trainer.read_bytes()[:20],
        "trainer_empty.pt": b"",
    }
    tensors = {"trainer_short.safetensors": {"logprobs": lp[:-1]},
               "trainer_nan.safetensors": {"logprobs": torch.full((n,), float("nan"))},
               "trainer_positive.safetensors": {"logprobs": torch.full((n,), 0.5)},
               "trainer_int.safetensors": {"logprobs": torch.zeros(n, dtype=torch.int64)},
               "trainer_no_logprobs.safetensors": {"other": lp},
               "trainer_cand_shape.safetensors": {"logprobs": lp, "candidate_logprobs": torch.zeros(3, 2) - 1},
               "trainer_2d.safetensors": {"logprobs": torch.zeros(n, 3) - 1}}
    for name, data in bad_trainers.items():
        (tmp_path / name).write_bytes(data)
    for name, t in tensors.items():
        save_file(t, str(tmp_path / name))
    for name in [*bad_trainers, *tensors]:
        path = tmp_path / name
        code, err = _run([str(roll), "--trainer-logprobs", str(path), "--out", str(out)], capsys)
        _check(name, code, err, path, out, True, counts)
        counts["files"] += 1

    for name, files in (("model_config_junk", {"config.json": "{not json"}),
                        ("model_weights_junk", {"config.json": json.dumps({"model_type": "qwen3"}),
                                                "model.safetensors": "\x00" * 64}),
                        ("model_pickle_junk", {"config.json": json.dumps({"model_type": "qwen3"}),
                                               "pytorch_model.bin": "\x80\x04junk"}),
                        ("model_unknown_type", {"config.json": json.dumps({"model_type": "no-such-model"})})):
        folder = tmp_path / name
        folder.mkdir()
        for f, text in files.items():
            (folder / f).write_text(text)
        code, err = _run([str(roll), "--model", str(folder), "--out", str(out)], capsys)
        _check(name, code, err, folder, out, True, counts)
        counts["files"] += 1

    print(f"diagnose fuzz (seed {SEED}): {counts}")
    assert counts["files"] >= 60 and counts["refused"] + counts["reported"] == counts["files"]
    assert counts["reported"] >= 2  # the fuzz also reaches real reports (a huge row, a truncation at a line end)


def test_a_malformed_file_through_the_installed_command_line(tmp_path):
    """The same contract through ``python -m offpolicy`` in a subprocess: a shifted candidate block exits 2 with one
    line naming the file, the line and the field, and no traceback."""
    import subprocess
    import sys

    lines, rec = rollout_lines(n=3)
    lines[1]["candidates"]["logprobs"].insert(0, lines[0]["candidates"]["logprobs"].pop())
    path = save_jsonl(lines, tmp_path / "shifted.jsonl")
    from safetensors.torch import save_file

    save_file({"logprobs": rec.sampler_logprobs.float()}, str(tmp_path / "trainer.safetensors"))
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "offpolicy", "diagnose", str(path), "--trainer-logprobs",
                           str(tmp_path / "trainer.safetensors"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"{path}, line 1, field 'candidates.logprobs': holds" in done.stderr
    assert not (tmp_path / "o").exists()
