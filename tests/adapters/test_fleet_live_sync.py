"""offpolicy.adapters.fleet_live without engines: the disk weight channel's versions and each group's numerics at
sync (the checkpoint a group loads is exactly ``fake_quantize_module`` of the trainer's weights)."""

import pytest
import torch

from offpolicy.adapters.fleet_live import DiskWeightChannel, EngineSettings, LiveFleet, group_checkpoint
from offpolicy.fleet import SamplerGroup
from offpolicy.fleet.quant import fake_quantize_module

pytest.importorskip("safetensors")


def tiny_lm() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg).float()


def test_channel_versions_grow_and_round_trip(tmp_path):
    ch = DiskWeightChannel(tmp_path / "w")
    assert ch.latest() is None
    a = {"x.weight": torch.randn(3, 4), "b": torch.randn(4)}
    ch.publish(a, 0)
    b = {k: v + 1 for k, v in a.items()}
    ch.publish(b, 2)
    assert ch.latest() == 2
    for version, want in ((0, a), (2, b)):
        got = ch.fetch(version)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="version must grow"):
        ch.publish(a, 2)
    with pytest.raises(FileNotFoundError, match=r"version 1 is not under .* \(never published, or collected"):
        ch.fetch(1)
    with pytest.raises(ValueError, match="version must be an integer >= 0"):
        ch.publish(a, -1)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["LATEST", "v000000", "v000002"]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_group_checkpoint_is_fake_quantize_module(fmt):
    model = tiny_lm()
    ckpt = group_checkpoint(model.state_dict(), fmt)
    want = fake_quantize_module(model, fmt).state_dict()  # a deep copy: its own leaves
    assert ckpt.keys() == want.keys()
    changed = [k for k in want if not torch.equal(ckpt[k], model.state_dict()[k])]
    for k in want:
        assert torch.equal(ckpt[k], want[k]), k
    assert "lm_head.weight" in changed and "model.layers.0.mlp.down_proj.weight" in changed
    assert "model.embed_tokens.weight" not in changed and not any("norm" in k for k in changed)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="weight_format must be one of"):
        group_checkpoint({"w": torch.zeros(2, 2)}, "int4")
    with pytest.raises(ValueError, match="kv_cache_mib must be an integer >= 1"):
        EngineSettings(kv_cache_mib=0)
    groups = [SamplerGroup("a", "CPU", "bf16", "fp32", 1.0), SamplerGroup("b", "CPU", "nvfp4", "fp32", 1.0)]
    with pytest.raises(ValueError, match=r"no EngineSettings for groups \['b'\]"):
        LiveFleet(groups, "m", tmp_path, settings={"a": EngineSettings()})
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        LiveFleet(groups, "m", tmp_path, timeout_s=0)
    with pytest.raises(RuntimeError, match="publish a weight version first"):
        LiveFleet(groups, "m", tmp_path).rollout([[1, 2]], {"temperature": 1.0})
    from offpolicy.adapters.fleet_live.toy_run import RunConfig, train

    with pytest.raises(RuntimeError, match="publish the model's weights first"):
        train(LiveFleet(groups, "m", tmp_path), torch.nn.Linear(1, 1), RunConfig())


def test_history_plot_series_and_png(tmp_path):
    from offpolicy.adapters.fleet_live.history_plot import history_series, write_history_plot

    steps = [{"reward": 0.5, "seconds": 2.0, "metrics": {"group/0/kl_k3": 0.1, "group/1/kl_k3": 0.3,
                                                         "staleness/0/kl_k3": 0.2}},
             {"reward": 0.75, "seconds": 1.0, "metrics": {"group/0/kl_k3": 0.0, "staleness/1/kl_k3": 0.4}}]
    history = {"command": "x", "steps": steps, "groups": [{"name": "g-bf16"}, {"name": "g-nvfp4"}]}
    s = history_series(history)
    assert s["reward"] == {"reward": [0.5, 0.75]} and s["step time"] == {"seconds": [2.0, 1.0]}
    assert s["group KL"]["g-bf16"] == [0.1, 0.0]
    assert s["group KL"]["g-nvfp4"][0] == 0.3 and s["group KL"]["g-nvfp4"][1] != s["group KL"]["g-nvfp4"][1]
    assert list(s["staleness KL"]) == ["staleness 0", "staleness 1"]
    assert s["staleness KL"]["staleness 1"][1] == 0.4
    with pytest.raises(ValueError, match=r"history\['steps'\] is empty"):
        history_series({"steps": [], "groups": []})
    pytest.importorskip("matplotlib")
    path = write_history_plot(history, tmp_path / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
