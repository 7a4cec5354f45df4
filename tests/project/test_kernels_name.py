"""The top-level ``kernels/`` folder installs as ``offpolicy.kernels`` and never stands in for the Hugging Face
``kernels`` package, which transformers imports whenever it is installed."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _hugging_face_kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_kernels_found_from_the_checkout_root_warns_naming_the_fix_where_hugging_faces_is_installed():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    out = subprocess.run([sys.executable, "-c", "import kernels"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr  # transformers probes it by importing it: it must load
    if _hugging_face_kernels_installed():
        assert "UserWarning" in out.stderr and "offpolicy.kernels" in out.stderr and "python -P" in out.stderr
    else:
        assert "offpolicy" not in out.stderr


def test_the_test_session_does_not_see_the_checkout_root():
    assert all(Path(p or os.getcwd()).resolve() != ROOT for p in sys.path)
    import offpolicy.kernels

    assert Path(offpolicy.kernels.__file__).resolve().parent == ROOT / "kernels"


def test_hugging_face_kernels_is_the_top_level_kernels_where_installed():
    if not _hugging_face_kernels_installed():
        pytest.skip("the Hugging Face kernels package is not installed here")
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and Path(spec.origin).resolve() != ROOT / "kernels" / "__init__.py"
