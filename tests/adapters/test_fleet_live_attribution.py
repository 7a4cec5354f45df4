"""Each live group's attribution (adapters/fleet_live/group_attribution.py) without engines or Ray: two in-process
groups (``LiveFleet.start_in_process``) sample from a tiny torch model loaded from the fleet's weight channel, in
their group's weight format, like an engine. Planted causes: group ``stale`` (fp32 weights) never loads past
version 0 while the trainer is at version 1 (weights far from version 0's); group ``quant`` serves version 1
through NVFP4. Stated before the run: the planted part holds >= 80% of its group's mean |log r|, the other cause
<= 5% (the format cause does not apply to fp32, staleness not to a current version)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from offpolicy.adapters.common import TurnRecord, csr_record
from offpolicy.adapters.fleet_live import LiveFleet, ServedTurn
from offpolicy.adapters.fleet_live.group_attribution import (attribute_groups, attribute_live_batch,
                                                            attribution_table, group_shares)
from offpolicy.adapters.fleet_live.toy_run import RunConfig, build_tiny_qwen3, train
from offpolicy.fleet import SamplerGroup
from offpolicy.fleet.quant import fake_quantize_module

V, H, T = 32, 24, 6
SP = {"temperature": 1.0, "max_tokens": T}


class TinyLM(nn.Module):
    """``input_ids [B, L] -> logits [B, L, V]`` fp32 (causal: each position sees a running mean of the past)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.head = nn.Linear(H, V)

    def forward(self, ids):
        e = self.emb(ids)
        run = e.cumsum(1) / torch.arange(1, ids.shape[1] + 1, device=ids.device)[None, :, None]
        return self.head(torch.tanh(self.mix(run) + e)) * 2.0


class MemoryChannel:
    def __init__(self):
        self.versions: dict[int, dict] = {}

    def publish(self, state_dict, version):
        self.versions[version] = {k: v.detach().clone() for k, v in state_dict.items()}

    def latest(self):
        return max(self.versions) if self.versions else None

    def fetch(self, version):
        return self.versions[version]


class ModelGroup:
    """EngineGroup's interface: loads the channel's weights in its group's format (``pin``: never past that
    version) and samples ``max_tokens`` tokens per request at temperature 1, recording ``log q``."""

    def __init__(self, group: SamplerGroup, channel: MemoryChannel, pin: int | None = None, seed: int = 0):
        self.group, self.channel, self.pin = group, channel, pin
        self.version, self.net, self.loads = None, None, 0
        self.gen = torch.Generator().manual_seed(seed)

    def sync(self) -> int:
        newest = self.channel.latest()
        want = newest if self.pin is None else min(newest, self.pin)
        if want != self.version:
            net = TinyLM(0)
            net.load_state_dict(self.channel.fetch(want))
            self.net = fake_quantize_module(net, self.group.weight_format).eval()
            self.version, self.loads = want, self.loads + 1
        return self.version

    def generate(self, requests, sampling_params, sync=True, min_version=None):
        version = self.sync() if sync or self.version is None else self.version
        out = []
        for sid, ctx in requests:
            seq, toks, lqs = list(ctx), [], []
            with torch.no_grad():
                for _ in range(int(sampling_params["max_tokens"])):
                    lp = torch.log_softmax(self.net(torch.tensor([seq])).double()[0, -1], -1)
                    t = int(torch.multinomial(lp.exp(), 1, generator=self.gen))
                    seq.append(t)
                    toks.append(t)
                    lqs.append(float(lp[t]))
            rec = TurnRecord(tuple(ctx), torch.tensor(toks), torch.tensor(lqs, dtype=torch.float32), None, 1.0, 1.0,
                             None, versions=(str(version),) * len(toks))
            out.append(ServedTurn(sid, self.group.name, version, rec))
        return out

    def info(self):
        return {"pid": 0, "rss_mib": 0.0, "version": self.version, "loads": self.loads}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A live batch trained at version 1: ``stale`` served version 0, ``quant`` version 1 in NVFP4."""
    groups = [SamplerGroup("stale", "CPU", "fp32", "fp32", 1.0), SamplerGroup("quant", "CPU", "nvfp4", "fp32", 1.0)]
    ch = MemoryChannel()
    fleet = LiveFleet(groups, "unused", tmp_path_factory.mktemp("fleet"), channel=ch)
    fleet.start_in_process({"stale": ModelGroup(groups[0], ch, pin=0, seed=1),
                            "quant": ModelGroup(groups[1], ch, seed=2)})
    v0 = TinyLM(0)
    fleet.publish(v0.state_dict(), 0)
    fleet.rollout([[3, 4]], SP)  # both groups load version 0 (the pinned one stays there)
    v1 = copy.deepcopy(v0)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    fleet.publish(v1.state_dict(), 1)
    prompts = torch.randint(2, V, (16, 3), generator=torch.Generator().manual_seed(7)).tolist()
    batch = fleet.rollout(prompts, SP, turns=2, between=[1])
    fleet.close()
    return batch, groups, v0, v1


def test_the_planted_cause_dominates_its_groups_row(run):
    batch, groups, v0, v1 = run
    served = {(groups[int(g)].name, int(v)) for g, v in zip(batch.group_ids, batch.batch.versions)}
    assert served == {("stale", 0), ("quant", 1)}
    shares = attribute_groups(batch, groups, model=v1, current_version=1, weights={0: v0})
    assert set(shares) == {"stale", "quant"}
    assert shares["stale"]["staleness"] >= 0.8 and abs(shares["stale"]["format"]) <= 0.05
    assert shares["quant"]["format"] >= 0.8 and abs(shares["quant"]["staleness"]) <= 0.05
    assert "routing" not in shares["stale"]  # no replay: routing is not a part
    for row in shares.values():
        assert math.isclose(sum(row[p] for p in ("semantics", "staleness", "format", "residual")), 1.0, abs_tol=1e-9)


def test_group_totals_match_an_independent_float64_rescore(run):
    """Each row's mean |log r| against the trainer's own float64 log-probs of that group's trained tokens."""
    batch, groups, v0, v1 = run
    shares = attribute_groups(batch, groups, model=v1, current_version=1, weights={0: v0})
    b = batch.batch
    ref = copy.deepcopy(v1).double().eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(batch.sequences)[b.rows, b.cols - 1], -1).gather(1, b.tokens[:, None])[:, 0]
    for gi, g in enumerate(groups):
        sel = b.loss_mask & (batch.group_ids == gi)
        want = (b.sampler_logprobs.double()[sel] - lp[sel]).abs().mean()
        assert shares[g.name]["tokens"] == int(sel.sum())
        assert shares[g.name]["mean_abs_log_r"] == pytest.approx(float(want), rel=1e-5)


def test_swapped_parts_would_fail_the_planted_check(run):
    batch, groups, v0, v1 = run
    shares = attribute_groups(batch, groups, model=v1, current_version=1, weights={0: v0})
    swapped = {n: dict(r, staleness=r["format"], format=r["staleness"]) for n, r in shares.items()}
    assert not (swapped["stale"]["staleness"] >= 0.8 and swapped["quant"]["format"] >= 0.8)


def test_table_rows_and_report(run):
    batch, groups, v0, v1 = run
    rep = attribute_live_batch(batch, groups, model=v1, current_version=1, weights={0: v0}, step=3)
    assert rep.step == 3 and rep.causes == ["staleness", "format"]
    shares = group_shares(rep)
    text = attribution_table(shares)
    lines = text.splitlines()
    assert lines[0].split() == ["group", "tokens", "|log", "r|", "semantics", "staleness", "format", "residual"]
    row = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert set(row) == {"stale", "quant"}
    assert row["stale"][4] == f"{shares['stale']['staleness']:.1%}"
    assert row["quant"][5] == f"{shares['quant']['format']:.1%}"
    still = {"idle": {"tokens": 4.0, "mean_abs_log_r": 0.0, "semantics": None, "staleness": float("nan"),
                      "format": None, "residual": None}}
    assert attribution_table(still).splitlines()[2].split() == ["idle", "4", "0.00e+00", "-", "-", "-", "-"]


def test_bad_inputs_name_the_argument(run):
    batch, groups, v0, v1 = run
    with pytest.raises(ValueError, match="--version-weights"):
        attribute_live_batch(batch, groups, model=v1, current_version=1)
    with pytest.raises(ValueError, match="group_ids"):
        attribute_live_batch(batch, groups[:1], model=v1, current_version=1, weights={0: v0})
    from dataclasses import replace
    none = replace(batch, batch=replace(batch.batch, loss_mask=torch.zeros_like(batch.batch.loss_mask)))
    with pytest.raises(ValueError, match="no trained token"):
        attribute_live_batch(none, groups, model=v1, current_version=1, weights={0: v0})
    with pytest.raises(TypeError, match="LiveBatch"):
        attribute_live_batch(batch.batch, groups, model=v1, current_version=1)


class QwenGroup:
    """EngineGroup's calls on the tiny Qwen3: loads the channel's weights in its group's format (``pin``: never past
    that version) and samples ``max_tokens`` tokens per request at temperature 1 from the top-``top_k`` support,
    returning the support record."""

    def __init__(self, group: SamplerGroup, channel: MemoryChannel, pin: int | None = None, seed: int = 0):
        self.group, self.channel, self.pin = group, channel, pin
        self.version, self.net, self.loads = None, None, 0
        self.gen = torch.Generator().manual_seed(seed)

    def sync(self) -> int:
        newest = self.channel.latest()
        want = newest if self.pin is None else min(newest, self.pin)
        if want != self.version:
            net = build_tiny_qwen3(None, seed=0)
            net.load_state_dict(self.channel.fetch(want))
            self.net = fake_quantize_module(net, self.group.weight_format).eval()
            self.version, self.loads = want, self.loads + 1
        return self.version

    def generate(self, requests, sampling_params, sync=True, min_version=None):
        version = self.sync() if sync or self.version is None else self.version
        k = int(sampling_params["top_k"])
        out = []
        for sid, ctx in requests:
            seq, toks, lqs, ids, lps = list(ctx), [], [], [], []
            with torch.no_grad():
                for _ in range(int(sampling_params["max_tokens"])):
                    z = self.net(torch.tensor([seq])).logits.double()[0, -1]
                    top = torch.topk(z, k).indices
                    lp = torch.log_softmax(z[top], -1)
                    j = int(torch.multinomial(lp.exp(), 1, generator=self.gen))
                    seq.append(int(top[j]))
                    toks.append(int(top[j]))
                    lqs.append(float(lp[j]))
                    ids.append(top.tolist())
                    lps.append(lp.tolist())
            rec = TurnRecord(tuple(ctx), torch.tensor(toks), torch.tensor(lqs, dtype=torch.float32),
                             csr_record(ids, lps), 1.0, 1.0, k, versions=(str(version),) * len(toks))
            out.append(ServedTurn(sid, self.group.name, version, rec))
        return out

    def info(self):
        return {"pid": 0, "rss_mib": 0.0, "version": self.version, "loads": self.loads, "vocab_size": 128}


def test_the_training_loop_logs_each_groups_attribution(tmp_path):
    """toy_run.train(attribute_every=1): every step's log holds both groups' rows. Step 0 trains version 0 tokens
    only: the NVFP4 group's row is >= 80% format, no staleness anywhere. From step 1 on the pinned group's tokens are
    stale and its (fp32) row is >= 80% staleness, <= 5% format; the NVFP4 group's tokens are one version behind
    (the batch is sampled during the previous step), so its row holds both parts."""
    pytest.importorskip("transformers")
    groups = [SamplerGroup("stale", "CPU", "fp32", "fp32", 1.0), SamplerGroup("quant", "CPU", "nvfp4", "fp32", 1.0)]
    ch = MemoryChannel()
    fleet = LiveFleet(groups, "unused", tmp_path, channel=ch)
    fleet.start_in_process({"stale": QwenGroup(groups[0], ch, pin=0, seed=1),
                            "quant": QwenGroup(groups[1], ch, seed=2)})
    model = build_tiny_qwen3(None, seed=0)
    fleet.publish(model.state_dict(), 0)
    cfg = RunConfig(steps=3, prompts=2, samples=2, turns=2, turn_tokens=4, top_p=1.0, top_k=24, lr=3e-2)
    try:
        history, _ = train(fleet, model, cfg, attribute_every=1)
    finally:
        fleet.close()
    for log in history:
        assert set(log.attribution) == {"stale", "quant"}, log.step
        for r in log.attribution.values():
            if r["mean_abs_log_r"] > 0:
                assert math.isclose(sum(r[p] for p in ("semantics", "staleness", "format", "residual")), 1.0,
                                    abs_tol=1e-9)
    q0 = history[0].attribution["quant"]
    assert q0["format"] >= 0.8 and abs(q0["staleness"]) <= 1e-12, q0
    s0 = history[0].attribution["stale"]
    assert s0["staleness"] in (None, 0.0) or abs(s0["staleness"]) <= 1e-12, s0
    for log in history[1:]:
        s, q = log.attribution["stale"], log.attribution["quant"]
        assert s["staleness"] >= 0.8 and abs(s["format"]) <= 0.05, (log.step, s)
        assert q["staleness"] > 0.05 and q["format"] > 0.01, (log.step, q)
    with pytest.raises(ValueError, match="attribute_every"):
        train(fleet, model, cfg, attribute_every=0)
