"""A seeded fuzz of malformed routing records (issue 46): shifted, out of range, negative, duplicated, stale
padded rows, missing layers, wrong dtypes, malformed CSR offsets (at construction and changed in place afterwards),
bad router weights, and malformed engine payloads. Each must end in a ``ValueError`` / ``TypeError`` (``RecordError``
is one) whose message names the field, never another exception or a crash; honest records of the same shapes
pass and agree with themselves. The whole fuzz runs in a child process, so a crash is a failed test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CASES = int(os.environ.get("OFFPOLICY_ROUTES_FUZZ_CASES", "300"))
ROOT = Path(__file__).resolve().parents[2]

BREAKS = ("honest", "shifted_rows", "shifted_content", "out_of_range", "negative", "duplicate", "stale_padded",
          "stale_padded_csr", "missing_layer_shape", "missing_layer_zero_row", "missing_layer_csr_row",
          "missing_layer_csr_count", "missing_layer_cat", "wrong_dtype_ids", "wrong_dtype_float", "wrong_dtype_valid",
          "wrong_dtype_weights", "csr_offsets_start", "csr_offsets_end", "csr_offsets_decreasing",
          "csr_offsets_changed_later", "bad_weights", "payload_base64", "payload_size", "payload_positions",
          "payload_layers")

_CHILD = r'''
import base64, json, random, sys, traceback
import torch
from offpolicy.records.routed_experts import RoutedExperts, check_route_alignment, route_flips
from offpolicy.adapters import sglang, vllm

BREAKS = %r


def sample_ids(rng, t, layers, k, e):
    return torch.tensor([[rng.sample(range(e), k) for _ in range(layers)] for _ in range(t)], dtype=torch.int64)


def make(seed):
    rng = random.Random(seed)
    brk = BREAKS[seed %% len(BREAKS)]
    t, layers = rng.randint(5, 14), rng.randint(1, 5)
    k = rng.randint(2, 4)
    e = rng.choice([k + 1, 8, 64, 256, 257, 1000])
    ids = sample_ids(rng, t, layers, k, e)
    return rng, brk, t, layers, k, e, ids


def run(seed):
    rng, brk, t, layers, k, e, ids = make(seed)
    expect = "RoutedExperts."
    if brk == "shifted_rows" or brk.startswith("payload"):
        expect = "routed_experts"
    valid = torch.ones(t, dtype=torch.bool)

    def build():
        if brk == "honest":
            rec = RoutedExperts.from_ids(ids, e)
            csr = rec.to_csr()
            assert route_flips(rec, csr).tolist() == [0] * t
            assert csr.take_rows(torch.arange(t - 1, -1, -1)).to_dense().ids.equal(rec.ids.flip(0))
            return None
        if brk == "shifted_rows":
            RoutedExperts.from_ids(ids[1:], e).check_aligned(t)
        if brk == "shifted_content":
            rec = RoutedExperts.from_ids(ids, e)
            check_route_alignment(rec.take_rows(torch.clamp(torch.arange(t) + 1, max=t - 1)), rec)
            return "no-op"   # too few distinct neighbours can leave it aligned: not a failure (checked below)
        if brk == "out_of_range":
            bad = ids.clone(); bad[rng.randrange(t), rng.randrange(layers), 0] = e + rng.randint(0, 3)
            RoutedExperts.from_ids(bad, e)
        if brk == "negative":
            bad = ids.clone(); bad[rng.randrange(t), rng.randrange(layers), rng.randrange(k)] = -rng.randint(1, 5)
            if e > 256 and rng.random() < 0.5:
                RoutedExperts(bad.to(torch.int16), e)
            RoutedExperts.from_ids(bad, e)
        if brk == "duplicate":
            bad = ids.clone(); i, j = rng.randrange(t), rng.randrange(layers)
            bad[i, j, 1] = bad[i, j, 0]
            RoutedExperts.from_ids(bad, e).to_csr() if rng.random() < 0.5 else RoutedExperts.from_ids(bad, e)
        if brk == "stale_padded":
            valid[rng.randrange(t)] = False
            RoutedExperts.from_ids(ids, e, valid=valid)
        if brk == "stale_padded_csr":
            valid[rng.randrange(t)] = False
            off = torch.arange(0, t * layers * k + 1, k)
            RoutedExperts.from_csr(ids.reshape(-1), off, e, layers, valid=valid)
        if brk == "missing_layer_shape":
            RoutedExperts.from_ids(ids, e, num_layers=layers + rng.randint(1, 3))
        if brk == "missing_layer_zero_row":
            bad = ids.clone(); bad[rng.randrange(t), rng.randrange(layers)] = 0
            RoutedExperts.from_ids(bad, e)
        if brk == "missing_layer_csr_row":
            lengths = torch.full((t * layers,), k); lengths[rng.randrange(t * layers)] = 0
            off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            RoutedExperts.from_csr(ids.reshape(-1)[: int(off[-1])], off, e, layers)
        if brk == "missing_layer_csr_count":
            decl = max(layers, 2)
            rows = t * decl - 1                      # one (token, layer) row short of whole tokens
            off = torch.arange(0, rows * k + 1, k)
            RoutedExperts.from_csr(sample_ids(rng, rows, 1, k, e).reshape(-1), off, e, decl)
        if brk == "missing_layer_cat":
            other = RoutedExperts.from_ids(sample_ids(rng, 3, layers + 1, k, e), e)
            RoutedExperts.cat([RoutedExperts.from_ids(ids, e), other])
        if brk == "wrong_dtype_ids":
            RoutedExperts(ids.to(rng.choice([torch.int32, torch.int64])), e)
        if brk == "wrong_dtype_float":
            RoutedExperts.from_ids(ids.float(), e)
        if brk == "wrong_dtype_valid":
            RoutedExperts.from_ids(ids, e, valid=torch.ones(t, dtype=torch.int64))
        if brk == "wrong_dtype_weights":
            RoutedExperts.from_ids(ids, e, weights=torch.ones(t, layers, k, dtype=torch.int64))
        if brk.startswith("csr_offsets"):
            flat = ids.reshape(-1)
            off = torch.arange(0, t * layers * k + 1, k)
            if brk == "csr_offsets_start":
                off = off.clone(); off[0] = rng.choice([-3, 1])
            elif brk == "csr_offsets_end":
                off = off.clone(); off[-1] = off[-1] + rng.choice([-1, 5, 1 << 40])
            elif brk == "csr_offsets_decreasing":
                off = off.clone(); i = rng.randrange(1, off.numel() - 1); off[i] = off[i + 1] + 3
            else:
                rec = RoutedExperts.from_csr(flat, off, e, layers)
                rec.offsets[rng.randrange(1, off.numel())] = rng.choice([-7, 10 ** 9])
                getattr(rec, rng.choice(["take_rows", "to_dense", "check_values"]))(
                    *([torch.arange(t)] if rng.random() < 2 else []))
            RoutedExperts.from_csr(flat, off, e, layers)
        if brk == "bad_weights":
            w = torch.rand(t, layers, k); w[rng.randrange(t), 0, 0] = rng.choice([float("nan"), -0.5, float("inf")])
            RoutedExperts.from_ids(ids, e, weights=w)
        if brk.startswith("payload"):
            p = rng.randint(1, 6)
            pos = sample_ids(rng, p + t - 1, layers, k, e)
            raw = pos.to(torch.int32).numpy().tobytes()
            meta = {"routed_experts": base64.b64encode(raw).decode()}
            if brk == "payload_base64":
                meta["routed_experts"] = "%%%%not base64%%%%"
            elif brk == "payload_size":
                meta["routed_experts"] = base64.b64encode(raw[: -rng.choice([1, 2, 4])]).decode()
            elif brk == "payload_positions":
                meta["routed_experts"] = base64.b64encode(sample_ids(rng, p + t, layers, k, e).to(torch.int32)
                                                          .numpy().tobytes()).decode()
            resp = {"output_ids": list(range(t)), "meta_info": meta}
            kw = dict(num_experts=e, num_hidden_layers=layers, top_k=k)
            if brk == "payload_layers":
                kw["num_layers"] = layers + 1
            if rng.random() < 0.5 or brk != "payload_layers":
                sglang.parse_routed_experts(resp, {"input_ids": [1] * p}, **kw)
            vllm.parse_routed_experts({"choices": [{"index": 0, "routed_experts": pos.tolist()}]}, num_experts=e,
                                      prompt_len=p, num_tokens=t, num_layers=layers + 1)
        return "accepted"

    try:
        res = build()
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        if brk == "honest":
            return brk, "error on an honest record: " + msg
        if expect not in msg and not (brk.startswith("csr_offsets") and "RoutedExperts.offsets" in msg) \
                and not (brk == "shifted_content" and "routed_experts" in msg):
            return brk, f"error without the field name ({expect}): {type(exc).__name__}: {msg}"
        return brk, None
    except Exception as exc:  # noqa: BLE001 - the point: anything else is a failure
        return brk, f"{type(exc).__name__} (not a clear error): {exc}\n" + traceback.format_exc()[-800:]
    if brk in ("honest", "shifted_content"):
        return brk, None
    return brk, f"accepted a malformed record ({res})"


seen, failures = {}, []
for seed in range(int(sys.argv[1])):
    brk, fail = run(seed)
    seen[brk] = seen.get(brk, 0) + 1
    if fail:
        failures.append(f"seed {seed} [{brk}]: {fail}")
print(json.dumps({"cases": int(sys.argv[1]), "breaks": seen, "failures": failures}))
''' % (BREAKS,)


def test_malformed_routes_get_clear_errors_naming_the_field():
    res = subprocess.run([sys.executable, "-c", _CHILD, str(CASES)], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert res.returncode == 0, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["failures"] == [], summary["failures"][:10]
    assert summary["cases"] == CASES
    assert set(summary["breaks"]) == set(BREAKS)
