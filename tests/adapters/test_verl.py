"""Runs tests/adapters/test_verl_cases.py inside .venv-trainers (verl==0.9.1 pins transformers<5.11, which
excludes TRL 1.16's 5.24, so verl, and SkyRL beside it, get their own venv). A missing venv fails with the command
that builds it, unless OFFPOLICY_SKIP_TRAINER_TESTS=1 (an explicit opt-out)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("OFFPOLICY_TRAINERS_VENV", ROOT / ".venv-trainers"))


def run_in_trainers_venv(case_file: str, venv: Path = VENV) -> None:
    """Run ``tests/adapters/<case_file>`` with ``venv``'s pytest; fail with its output."""
    if os.environ.get("OFFPOLICY_SKIP_TRAINER_TESTS") == "1":
        pytest.skip("OFFPOLICY_SKIP_TRAINER_TESTS=1: trainer-adapter tests opted out")
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{venv} is missing: run tools/setup_test_envs.sh (about 2 minutes) to create it, or set "
                    "OFFPOLICY_SKIP_TRAINER_TESTS=1 to opt out")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # This checkout's offpolicy, not the one the side venv's editable install points at.
    env["PYTHONPATH"] = str(ROOT / "src")
    env["OFFPOLICY_SIDE_VENV"] = "1"
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
         str(ROOT / "tests" / "adapters" / case_file)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail


def test_verl_adapter_in_its_venv():
    run_in_trainers_venv("test_verl_cases.py")
