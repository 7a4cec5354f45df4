"""The top-level ``kernels/`` folder is ``offpolicy.kernels`` and never stands in for another top-level ``kernels``
(the Hugging Face package that transformers imports), from any working directory, installed or not.

kernels/ has no ``__init__.py``: from the checkout's root (``python -m`` / ``python -c`` put it first on
``sys.path``) a top-level ``import kernels`` finds it only as a namespace portion, which loses to a regular package
anywhere on ``sys.path``. ``offpolicy.kernels`` is src/offpolicy/kernels/__init__.py, whose ``__path__`` reaches the
folder in a checkout; a wheel holds the folder's files beside it (setup.py's build_py, checked here on a copy).
"""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import offpolicy.kernels

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return {**env, **extra}


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize("how", ["-c", "-m"])
def test_another_top_level_kernels_wins_from_the_checkout_root(tmp_path, how):
    """A stand-in ``kernels`` package later on ``sys.path`` (PYTHONPATH comes after the root that ``-c`` / ``-m``
    put first) is the one imported: the checkout's folder does not shadow it."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("STAND_IN = True\n")
    (tmp_path / "probe_kernels.py").write_text(
        "import os, sys, kernels\nprint(kernels.__file__, os.path.abspath(sys.path[0]), sep='|')\n")
    args = ["-c", "import runpy; runpy.run_module('probe_kernels', run_name='__main__')"] if how == "-c" else \
        ["-m", "probe_kernels"]
    found, first = _run(args, ROOT, _env(PYTHONPATH=str(tmp_path))).split("|")
    assert Path(first).resolve() == ROOT  # the checkout's root is on sys.path, ahead of the stand-in
    assert Path(found) == tmp_path / "kernels" / "__init__.py"


def test_with_no_other_kernels_the_folder_is_a_namespace_that_transformers_reads_as_absent():
    """Without site-packages (``-S``) the only top-level ``kernels`` is the folder: a namespace package with no
    ``__file__`` and no ``__version__``, which transformers' availability check treats as not installed."""
    out = _run(["-S", "-c", "import kernels; print(getattr(kernels, '__file__', None), "
                "getattr(kernels, '__version__', None), *kernels.__path__)"], ROOT, _env())
    assert out.split() == ["None", "None", str(ROOT / "kernels")]


@pytest.mark.skipif(not (_installed("kernels") and _installed("transformers")),
                    reason="the Hugging Face kernels package or transformers is not installed here")
def test_transformers_imports_hugging_faces_kernels_from_the_checkout_root():
    """The reported failure (``cannot import name 'CUDAProperties' from 'kernels'``), where it could happen."""
    out = _run(["-c", "import transformers.integrations.hub_kernels, kernels; print(kernels.__file__)"], ROOT, _env())
    assert Path(out).parent != ROOT / "kernels"


def test_the_cli_runs_from_the_checkout_root():
    assert "diagnose" in _run(["-m", "offpolicy", "--help"], ROOT, _env())


def test_offpolicy_kernels_reaches_the_folder_in_a_checkout():
    import offpolicy.kernels.logsoftmax

    assert Path(offpolicy.kernels.__file__).resolve() == ROOT / "src" / "offpolicy" / "kernels" / "__init__.py"
    assert Path(offpolicy.kernels.logsoftmax.__file__).resolve() == ROOT / "kernels" / "logsoftmax.py"
    assert offpolicy.kernels.source("vocab_pass_cpu.c").resolve() == ROOT / "kernels" / "vocab_pass_cpu.c"
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_offpolicy_kernels_from_src_on_sys_path_without_an_install(tmp_path):
    """``src`` on ``sys.path`` and no install (as the side environments run the checkout): with ``-S`` and the
    site-packages added as a plain folder, no .pth file runs, so the editable install's finder is absent and only
    this package's ``__path__`` can reach the folder's modules and C source."""
    import sysconfig

    probe = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT / "src")!r}, {sysconfig.get_paths()["purelib"]!r}]
        import offpolicy.kernels as k, offpolicy.kernels.logsoftmax as l
        assert not any("editable" in type(f).__module__ for f in sys.meta_path), sys.meta_path
        print(l.__file__, k.source("vocab_pass_cpu.c"), sep="|")
    """)
    found = _run(["-S", "-c", probe], tmp_path, _env()).split("|")
    assert found == [str(ROOT / "kernels" / "logsoftmax.py"), str(ROOT / "kernels" / "vocab_pass_cpu.c")]


@pytest.mark.parametrize("name", ["", "../setup.py", "kernels/logsoftmax.py", 3])
def test_source_refuses_what_is_not_a_file_name(name):
    with pytest.raises(ValueError, match="name: expected a file name"):
        offpolicy.kernels.source(name)


def test_source_names_the_folders_it_searched():
    with pytest.raises(FileNotFoundError, match=r"name: no 'nope\.c' in offpolicy's kernel folders"):
        offpolicy.kernels.source("nope.c")


def test_a_wheel_holds_the_kernel_files_beside_the_package_init(tmp_path):
    """setup.py's build_py, run on a copy of the checkout, lays out ``offpolicy/kernels`` as a wheel holds it; from
    there the package finds its modules and its C source (also through ``importlib.resources``) in its own folder."""
    src = tmp_path / "checkout"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("src", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    build = tmp_path / "build"
    _run(["setup.py", "-q", "build_py", "--build-lib", str(build)], src, _env())
    kernels = build / "offpolicy" / "kernels"
    assert {p.name for p in kernels.iterdir()} >= {"__init__.py", "logsoftmax.py", "linear_logsoftmax.py",
                                                    "blockwise_quant.py", "vocab_pass_cpu.c"}
    assert (kernels / "__init__.py").read_text() == (ROOT / "src" / "offpolicy" / "kernels" / "__init__.py").read_text()
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(build)!r})
        import importlib.resources, offpolicy.kernels as k
        assert k.__path__ == [{str(kernels)!r}], k.__path__
        assert importlib.resources.files("offpolicy.kernels").joinpath("vocab_pass_cpu.c").is_file()
        print(k.source("vocab_pass_cpu.c"))
    """)
    assert _run(["-c", probe], tmp_path, _env()) == str(kernels / "vocab_pass_cpu.c")
