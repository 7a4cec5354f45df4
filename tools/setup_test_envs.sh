#!/usr/bin/env bash
# Create the separate virtual environments that the trainer-adapter tests run in (tests/adapters/test_verl*.py).
#
#   tools/setup_test_envs.sh            # creates .venv-verl (verl 0.9.1) beside the repository's own .venv
#
# verl 0.9.1 pins a transformers range (<5.11) that excludes TRL 1.16's (5.24), so it gets its own venv; the tests
# run its python in a subprocess. torch is pinned to the CPU build (2.13.0) served to this kind of machine: an
# unpinned torch pulls a multi-GB CUDA build. Re-running is cheap: an existing, working venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERL_VENV=${OFFPOLICY_VERL_VENV:-.venv-verl}

if [ -x "$VERL_VENV/bin/python" ] && "$VERL_VENV/bin/python" -c "import verl, offpolicy" 2>/dev/null; then
    echo "$VERL_VENV: ready"
else
    start=$(date +%s)
    "$PY" -m venv "$VERL_VENV"
    "$VERL_VENV/bin/pip" install -q torch==2.13.0
    "$VERL_VENV/bin/pip" install -q --no-deps verl==0.9.1
    "$VERL_VENV/bin/pip" install -q torch==2.13.0 "tensordict>=0.8,<=0.10,!=0.9.0" omegaconf codetiming ray \
        "transformers>=5.5.3,<5.11,!=5.6.0" datasets pillow numpy einops jaxtyping pytest hypothesis
    "$VERL_VENV/bin/pip" install -q --no-deps -e .
    echo "$VERL_VENV: created in $(( $(date +%s) - start )) s"
fi
