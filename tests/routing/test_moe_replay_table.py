"""tools/moe_replay_table.py at a tiny size, and the committed table against the docs that quote it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("moe_replay_table", ROOT / "tools" / "moe_replay_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_script_runs_at_a_tiny_size(tmp_path):
    tool = _tool()
    result = tool.main(["--tiny", "--formats", "fp32,nvfp4", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "moe_replay_table.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    control, nvfp4 = saved["rows"]
    # the unquantised sampler is the trainer: no mismatch, no flip, nothing to attribute
    assert control["format"] == "fp32" and control["k3_natural"] == 0 and control["k3_replay"] == 0
    assert control["flipped_layers"] == 0 and control["flipped_layers_with_prompt"] == 0
    assert control["routing_share"] is None and control["routing_shapley"] is None
    assert nvfp4["k3_natural"] > 0 and nvfp4["tokens"] == 8 * 8
    assert nvfp4["routing_share"] == pytest.approx(1 - nvfp4["k3_replay"] / nvfp4["k3_natural"])
    if nvfp4["flipped_layers_with_prompt"] == 0:  # no flip anywhere: replay changes nothing
        assert nvfp4["k3_replay"] == nvfp4["k3_natural"]
    # diagnose --attribute on the same tokens: the parts add up to the observed mismatch, which is the table's
    shap = nvfp4["shapley"]
    assert shap["total"]["mean_abs_log_r"] == pytest.approx(nvfp4["mean_abs_log_r_natural"], rel=1e-5)
    assert sum(p["mean_abs_log_r"] for p in shap["parts"].values()) == pytest.approx(shap["total"]["mean_abs_log_r"])
    assert nvfp4["routing_shapley"] == shap["parts"]["routing"]["share_mean_abs_log_r"]
    assert shap["parts"]["staleness"]["mean_abs_log_r"] == 0  # one version
    if nvfp4["flipped_layers_with_prompt"] > 0:
        assert nvfp4["routing_shapley"] > 0
    md = (tmp_path / "moe_replay_table.md").read_text()
    assert "| nvfp4 |" in md and "| fp32 |" in md


def test_the_flip_count_compares_expert_sets():
    import torch

    tool = _tool()
    a = torch.tensor([[[[0, 1], [2, 3], [4, 5]]]])           # [1, 1, 3, 2]
    b = torch.tensor([[[[1, 0], [2, 4], [6, 7]]]])           # same set, one changed, both changed
    assert tool.flipped_layers(a, b).tolist() == [[2]]


def test_the_docs_quote_the_committed_table():
    tool = _tool()
    result = json.loads((ROOT / "benchmarks" / "results" / "moe_replay_table.json").read_text())
    table = tool.markdown(result)
    assert table == (ROOT / "benchmarks" / "results" / "moe_replay_table.md").read_text()
    doc = (ROOT / "docs" / "routing_replay.md").read_text()
    for line in table.splitlines():
        if line.startswith("| fp8") or line.startswith("| nvfp4") or line.startswith("| mxfp4"):
            assert line in doc, f"docs/routing_replay.md does not quote the committed row {line!r}"
