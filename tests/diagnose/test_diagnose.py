"""offpolicy diagnose on the reference sampler's records: quiet on correct ones, names each planted mistake."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
import torch

import offpolicy as op
from offpolicy.__main__ import main as cli
from offpolicy.diagnose import (
    TrainerScores,
    diagnose,
    from_token_batch,
    load_rollouts,
    save_jsonl,
    save_safetensors,
)
from offpolicy.diagnose.divergence import divergence
from offpolicy.diagnose.recorded import from_lines
from offpolicy.fleet.sampler import sample
from support.diagnose_records import V, TinyLM, padded, prompts, record, support_of_ids

@pytest.fixture(scope="module")
def model():
    return TinyLM()


@pytest.mark.parametrize("kind,top_p,top_k", [("head", 1.0, None), ("support", 0.9, None), ("support", 0.95, 8),
                                              ("head", 1.0, None)])
def test_correct_records_raise_no_alarm(model, kind, top_p, top_k):
    rec = record(model, kind=kind, top_p=top_p, top_k=top_k)
    rep = diagnose(rec, model=model)
    assert rep.ok, rep.text()
    assert rep.overall.k3 < 1e-9 and rep.overall.extreme_share == 0.0
    assert rep.correction is not None and rep.correction.weights == "mis" and rep.correction.score_centering
    temp = next(f for f in rep.findings if f.check == "temperature")
    assert temp.ok and abs(temp.evidence["effective_temperature"] - 0.7) < 1e-3


def test_other_numerics_raise_no_alarm(model):
    """The trainer differs from the sampler (weights in bf16): divergence is measured, no mistake is named."""
    rec = record(model, kind="support", top_p=0.9)
    trainer = TinyLM()
    with torch.no_grad():
        for p in trainer.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    rep = diagnose(rec, model=trainer)
    assert rep.ok, rep.text()
    assert 0 < rep.overall.k3 < 1e-3


def test_raw_logprobs_named(model):
    """Tokens and log-probs of an untempered sampler, declared as T = 0.7."""
    rec = record(model, temperature=1.0, declared_temperature=0.7)
    rep = diagnose(rec, model=model)
    assert "raw_logprobs" in rep.mistakes and rep.correction is None
    temp = next(f for f in rep.findings if f.check == "temperature")
    assert abs(temp.evidence["effective_temperature"] - 1.0) < 0.02
    reading = next(f for f in rep.findings if f.check == "reading")
    assert reading.mistake == "raw_logprobs" and abs(reading.evidence["best_grid_temperature"] - 1.0) < 0.05


def test_temperature_twice_named(model):
    rec = record(model, temperature=0.49, declared_temperature=0.7, kind="support", top_p=0.9)
    rep = diagnose(rec, model=model)
    assert "temperature_twice" in rep.mistakes
    temp = next(f for f in rep.findings if f.check == "temperature")
    assert abs(temp.evidence["effective_temperature"] - 0.49) < 0.01


def _unrenormalise(rec, model):
    """The sampler's full-vocabulary tempered log-probs instead of the support-renormalised ones."""
    with torch.no_grad():
        z = model(rec.sequences)[rec.rows, rec.cols - 1].double()
    lt = torch.log_softmax(z / rec.temperature[:, None].double(), -1)
    c = padded(rec)
    lps = torch.where(c.ids >= 0, lt.gather(1, c.ids.clamp(min=0)), float("-inf")).float()
    from offpolicy import Candidates

    return replace(rec, sampler_logprobs=lt.gather(1, rec.tokens[:, None])[:, 0].float(),
                   candidates=Candidates(c.ids, lps, c.kind))


def test_missing_renormalisation_named(model):
    rec = _unrenormalise(record(model, kind="support", top_p=0.8), model)
    rep = diagnose(rec, model=model)
    assert "missing_renormalisation" in rep.mistakes
    checks = {f.check: f for f in rep.findings}
    assert checks["support_sum"].mistake == "missing_renormalisation"
    assert checks["reading"].mistake == "missing_renormalisation"
    assert checks["temperature"].ok  # the spread is right; only the per-row constant log P(S) is missing


def test_tensor_only_trainer(model):
    """Without a model: trainer log-probs and candidate log-probs from a file still expose the mistakes."""
    rec = record(model, kind="support", top_p=0.8)
    with torch.no_grad():
        z = model(rec.sequences)[rec.rows, rec.cols - 1].double()
    lt = torch.log_softmax(z / 0.7, -1)
    ids = padded(rec).ids
    sup = support_of_ids(ids)
    lp = (torch.where(sup, lt, float("-inf")) - torch.logsumexp(torch.where(sup, lt, float("-inf")), -1,
                                                                   keepdim=True)).gather(1, rec.tokens[:, None])[:, 0]
    cand = torch.where(ids >= 0, lt.gather(1, ids.clamp(min=0)), float("-inf"))
    assert diagnose(rec, trainer_logprobs=TrainerScores(lp, cand)).ok
    bad = _unrenormalise(rec, model)
    rep = diagnose(bad, trainer_logprobs=TrainerScores(lp, cand))
    assert "missing_renormalisation" in rep.mistakes
    assert next(f for f in rep.findings if f.check == "ratio_sign").mistake == "missing_renormalisation"
    raw = record(model, temperature=1.0, declared_temperature=0.7)
    with torch.no_grad():
        zr = model(raw.sequences)[raw.rows, raw.cols - 1].double()
    lr = torch.log_softmax(zr / 0.7, -1)
    rids = padded(raw).ids
    rep = diagnose(raw, trainer_logprobs=TrainerScores(lr.gather(1, raw.tokens[:, None])[:, 0],
                                                        torch.where(rids >= 0, lr.gather(1, rids.clamp(min=0)),
                                                                    float("-inf"))))
    assert rep.mistakes == ["raw_logprobs"]


def test_record_checks_coverage_sums_versions(model):
    rec = record(model, kind="support", top_p=0.9)
    c = padded(rec)
    ids = c.ids.clone()
    ids[ids == rec.tokens[:, None]] = -1  # drop the sampled token from every support row
    from offpolicy import Candidates

    rep = diagnose(replace(rec, candidates=Candidates(ids, torch.where(ids >= 0, c.logprobs, float("-inf")),
                                                      "support")), model=model)
    assert "candidates_miss_sampled" in rep.mistakes
    v = rec.versions.clone()
    first = (rec.seq_ids == 0).nonzero().flatten()
    v[first[0]] = 5  # the first token of sequence 0 claims newer weights than the rest
    rep = diagnose(replace(rec, versions=v), model=model, current_version=5)
    assert "versions_backwards" in rep.mistakes
    head = record(model)
    boosted = Candidates(padded(head).ids, (padded(head).logprobs + 0.5).clamp(max=0.0), "head")
    rep = diagnose(replace(head, candidates=boosted), model=model)
    assert "head_renormalised" in rep.mistakes


def test_staleness_groups_and_recommendation(model):
    rec = record(model, kind="head", versions=(0, 1, 2), n=48)
    gi = (torch.arange(len(rec)) % 2).to(torch.int64)
    rec = replace(rec, group_names=("bf16", "fp8"), group_index=gi)
    rep = diagnose(rec, trainer_logprobs=rec.sampler_logprobs.double() - 0.01 * (2 - rec.versions).double())
    assert sorted(rep.by_staleness) == [0, 1, 2] and set(rep.by_group) == {"bf16", "fp8"}
    assert rep.by_staleness[0].k3 < 1e-12 < rep.by_staleness[1].k3 < rep.by_staleness[2].k3
    assert abs(rep.by_staleness[2].k1 - 0.02) < 1e-6  # k1 = -log r = 0.02 at staleness 2
    far = diagnose(rec, trainer_logprobs=rec.sampler_logprobs.double() - 2.0 * (2 - rec.versions).double())
    assert far.correction.veto == 1e-4 and far.correction.kl_rejection is not None
    assert far.overall.extreme_share > 0.5
    # Recommended by name: the first reason is the call that builds it from the preset catalogue.
    for report, name in ((rep, "sc_mis"), (far, "sc_mis")):
        call = report.reasons[0].removeprefix("by name: ").split(" (the preset")[0]
        assert call.startswith(f"op.presets.correction({name!r}") and eval(call, {"op": op}) == report.correction
    assert rep.correction == op.presets.correction("sc_mis")
    assert far.reasons[0].startswith("by name: op.presets.correction('sc_mis', veto=0.0001, kl_rejection=op.KLRej")


def test_recommendation_by_name_without_candidates_and_after_a_mistake():
    from offpolicy.diagnose.recommend import recommend

    calm = divergence(torch.full((50,), 0.01, dtype=torch.float64))
    corr, reasons = recommend(calm, {}, None, [])
    assert corr == op.presets.correction("icepop") == op.Correction(weights="mis", bounds=(0.5, 5.0))
    assert reasons[0].startswith("by name: op.presets.correction('icepop') (the preset 'icepop'")
    wild = divergence(torch.cat([torch.full((10,), 3.0), torch.zeros(40)]).double())
    corr, reasons = recommend(wild, {}, "head", [])
    assert corr == op.presets.correction("sc_mis", veto=1e-4)
    assert reasons[0].startswith("by name: op.presets.correction('sc_mis', veto=0.0001)")
    assert recommend(wild, {}, "head", ["log_base_2"])[0] is None


def test_divergence_estimators():
    lr = torch.tensor([0.0, 0.5, -0.5, float("-inf")], dtype=torch.float64)
    d = divergence(lr)
    assert d.non_finite == 1 and d.tokens == 4
    # k1 = mean(-log r) = 0; k3 = mean(r - 1 - log r) = ((e^0.5 - 1.5) + (e^-0.5 - 0.5)) / 3
    want_k3 = ((0.5 ** 0 * 1.6487212707001282 - 1.5) + (0.6065306597126334 - 0.5)) / 3
    assert abs(d.k1) < 1e-12 and abs(d.k3 - want_k3) < 1e-12
    assert divergence(torch.tensor([0.19, 0.2, 5.0, 5.1], dtype=torch.float64).log()).extreme_share == 0.5


def test_files_cli_and_report(model, tmp_path, capsys):
    rec = record(model, kind="support", top_p=0.9, versions=(0, 1), n=16)
    st = save_safetensors(rec, tmp_path / "roll.safetensors")
    back = load_rollouts(st)
    assert torch.equal(back.tokens, rec.tokens) and torch.equal(back.candidates.ids, rec.candidates.ids)
    assert torch.equal(back.candidates.offsets, rec.candidates.offsets)
    from safetensors.torch import save_file

    rep = diagnose(rec, model=model)
    save_file({"logprobs": rep_lp(rec, model)}, str(tmp_path / "trainer.safetensors"))
    out = tmp_path / "out"
    code = cli(["diagnose", str(st), "--trainer-logprobs", str(tmp_path / "trainer.safetensors"), "--out", str(out),
                "--strict"])
    text = capsys.readouterr().out
    assert code == 0 and "offpolicy diagnose: OK" in text and "recommended correction" in text
    assert {p.name for p in out.iterdir()} >= {"report.md", "report.json", "ratio_hist.png", "kl_by_staleness.png"}
    assert json.loads((out / "report.json").read_text())["ok"] is True
    assert "| staleness 1 |" in (out / "report.md").read_text()
    assert rep.ok
    assert cli(["diagnose", str(tmp_path / "missing.jsonl"), "--trainer-logprobs", "x.pt"]) == 2
    assert "offpolicy diagnose:" in capsys.readouterr().err
    buf = io.StringIO()
    rep.print(buf)  # not a TTY: plain text
    assert buf.getvalue().startswith("offpolicy diagnose: OK")


def rep_lp(rec, model):
    with torch.no_grad():
        z = model(rec.sequences)[rec.rows, rec.cols - 1].double()
    lt = torch.log_softmax(z / rec.temperature[:, None].double(), -1)
    ids = padded(rec).ids
    sup = support_of_ids(ids)
    sub = torch.where(sup, lt, float("-inf"))
    return (sub - torch.logsumexp(sub, -1, keepdim=True)).gather(1, rec.tokens[:, None])[:, 0].float()


def test_jsonl_lines_and_errors(tmp_path):
    lines = [
        {"group": "a", "version": 1, "seq_id": 0, "input_ids": [1, 2], "tokens": [3, 4],
         "sampler_logprobs": [-0.5, -1.0], "temperature": 1.0, "top_p": 1.0, "top_k": None,
         "candidates": {"kind": "head", "ids": [[3, 5], [7, -1]], "logprobs": [[-0.5, -1.5], [-0.3, None]]}},
        {"group": "b", "version": 2, "seq_id": 0, "input_ids": [1, 2, 3, 4, 9], "tokens": [6],
         "sampler_logprobs": [-0.2], "temperature": 1.0, "candidates": {"kind": "head", "ids": [[6]],
                                                                         "logprobs": [[-0.2]]}},
    ]
    rec = load_rollouts(save_jsonl(lines, tmp_path / "r.jsonl"))
    assert rec.sequences.tolist() == [[1, 2, 3, 4, 9, 6]] and rec.cols.tolist() == [2, 3, 5]
    assert rec.group_names == ("a", "b") and rec.versions.tolist() == [1, 1, 2]
    assert rec.candidates.lengths.tolist() == [2, 1, 1]  # the (-1, null) padding entry is dropped
    assert rec.candidates.ids.tolist() == [3, 5, 7, 6]
    bad = [dict(lines[1], input_ids=[1, 9])]
    with pytest.raises(ValueError, match="do not extend the context"):
        from_lines([lines[0], *bad])
    with pytest.raises(ValueError, match="line 1, field 'tokens': missing"):
        from_lines([{k: v for k, v in lines[0].items() if k != "tokens"}])
    with pytest.raises(ValueError, match="must be .jsonl or .safetensors"):
        load_rollouts(tmp_path / "r.csv")
    with pytest.raises(ValueError, match="exactly one of"):
        diagnose(rec)


def test_cli_with_a_transformers_model_and_jsonl(tmp_path, capsys):
    """JSONL rollouts from the reference sampler on a saved tiny Qwen3; diagnose loads the model from its folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    net = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        net.lm_head.weight.mul_(40.0)
    net.save_pretrained(tmp_path / "model")
    ro = sample(net, prompts(6), 5, 0.7, 0.9, None, record="support", version=2, filter_semantics="vllm",
                generator=torch.Generator().manual_seed(0))
    rec = from_token_batch(ro.flatten(), ro.sequences, top_p=0.9)
    lines = []
    for b in range(ro.sequences.shape[0]):
        sel = rec.rows == b
        start = int(rec.cols[sel].min())
        c = padded(rec)
        lines.append({"group": "ref", "version": 2, "input_ids": ro.sequences[b, :start].tolist(),
                      "tokens": rec.tokens[sel].tolist(), "sampler_logprobs": rec.sampler_logprobs[sel].tolist(),
                      "temperature": 0.7, "top_p": 0.9, "top_k": None,
                      "candidates": {"kind": "support", "ids": c.ids[sel].tolist(),
                                     "logprobs": [[v if v > float("-inf") else None for v in row]
                                                  for row in c.logprobs[sel].tolist()]}})
    path = save_jsonl(lines, tmp_path / "r.jsonl")
    assert cli(["diagnose", str(path), "--model", str(tmp_path / "model"), "--out", str(tmp_path / "o"),
                "--strict"]) == 0, capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "report.json").read_text())["mistakes"] == []
    bad = [dict(line, temperature=1.0) for line in lines]  # declared T = 1 for a T = 0.7 sampler
    save_jsonl(bad, tmp_path / "bad.jsonl")
    assert cli(["diagnose", str(tmp_path / "bad.jsonl"), "--model", str(tmp_path / "model"), "--out",
                str(tmp_path / "o2"), "--strict"]) == 1
    assert "temperature" in capsys.readouterr().out


def test_turn_to_json_versions():
    from offpolicy.adapters.common import TurnRecord
    from offpolicy.diagnose import turn_to_json

    rec = TurnRecord(input_ids=(1, 2), tokens=torch.tensor([3, 4]), sampler_logprobs=torch.tensor([-0.1, -0.2]),
                     candidates=None, temperature=1.0, top_p=1.0, top_k=None, versions=("6", "7"))
    line = turn_to_json(rec, group="g")
    assert line["versions"] == [6, 7] and "version" not in line
    assert from_lines([line]).versions.tolist() == [6, 7]
    assert turn_to_json(rec, group="g", version=3)["version"] == 3
    with pytest.raises(ValueError, match="not integers"):
        turn_to_json(replace(rec, versions=("a", "b")), group="g")
    with pytest.raises(ValueError, match="pass version="):
        turn_to_json(replace(rec, versions=None), group="g")
    with pytest.raises(ValueError, match="field .versions.: holds 1 entries for 2 tokens"):
        from_lines([dict(line, versions=[6])])


def test_documented_examples_script(capsys):
    """tools/diagnose_examples.py (quoted in docs/diagnose.md) still gives the documented verdicts."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "diagnose_examples.py"
    spec = importlib.util.spec_from_file_location("diagnose_examples", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main()
    verdicts = [line for line in capsys.readouterr().out.splitlines() if line.startswith("offpolicy diagnose:")]
    assert verdicts == ["offpolicy diagnose: OK", "offpolicy diagnose: MISTAKES FOUND: raw_logprobs",
                        "offpolicy diagnose: MISTAKES FOUND: temperature_twice",
                        "offpolicy diagnose: MISTAKES FOUND: missing_renormalisation"]


def _line(**sampling):
    return {"group": "a", "version": 0, "input_ids": [1], "tokens": [2, 3], "sampler_logprobs": [-0.5, -1.0],
            "temperature": 1.0, **sampling}


@pytest.mark.parametrize("sampling,top_p,top_k", [
    ({}, 1.0, -1), ({"top_p": None, "top_k": None}, 1.0, -1),
    ({"top_k": 0}, 1.0, -1),    # vLLM's "all tokens" (its default)
    ({"top_k": -1}, 1.0, -1),   # vLLM's and SGLang's request-side "off"
    ({"top_p": 0.9, "top_k": 16}, 0.9, 16), ({"top_p": 1.0, "top_k": 1}, 1.0, 1),
])
def test_record_reader_maps_each_engines_off_to_minus_one(sampling, top_p, top_k):
    """The JSONL reader stores the declared filter per token, ``top_k = -1`` for "off" whichever way the line
    says it; a real top-k (1 included) is kept, so diagnose then treats the tokens as filtered."""
    rec = from_lines([_line(**sampling)])
    assert rec.top_p.tolist() == pytest.approx([top_p] * 2) and rec.top_k.tolist() == [top_k] * 2


def test_record_reader_maps_the_other_off_sentinels_to_minus_one():
    """SGLang's all-tokens top_k (1 << 30) in a JSONL line and vLLM's top_k = 0 passed to from_token_batch are
    "off", not filters."""
    assert from_lines([_line(top_k=1 << 30)]).top_k.tolist() == [-1, -1]
    ro = sample(TinyLM(), prompts(1), 2, record="head")
    assert from_token_batch(ro.flatten(), ro.sequences, top_k=0).top_k.tolist() == [-1, -1]


def test_the_recommended_correction_is_printed_as_a_short_call_that_builds_it():
    """The text report names only the keywords that differ from their defaults (the family's full repr is a line of
    several hundred characters), and the printed call builds the recommended correction back."""
    from offpolicy.diagnose.summary import correction_call

    for corr in (op.Correction(), op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True, veto=1e-4),
                 op.Correction(weights="tis", level="geometric", max_staleness=2)):
        call = correction_call(corr)
        assert eval(call, {"Correction": op.Correction}) == corr
        assert len(call) < 120
    assert correction_call(op.Correction()) == "Correction()"
