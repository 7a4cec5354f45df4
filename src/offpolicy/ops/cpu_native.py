"""Build and load the CPU vocabulary kernels (``kernels/vocab_pass_cpu.c``, installed as ``offpolicy.kernels``).

The C file is compiled at first use with the machine's C compiler (``$CC``, else ``cc``) for this CPU
(``-O3 -march=native``; ``$OFFPOLICY_CPU_ARCH_FLAGS`` replaces ``-march=native``, e.g. ``-march=x86-64-v3`` for a
cache shared by unlike machines) and loaded with :mod:`ctypes`; calls release the GIL, so the row workers of
:mod:`offpolicy.ops.row_threads` run them in parallel. The shared library is cached under
``$OFFPOLICY_CACHE_DIR`` (default ``~/.cache/offpolicy``), named by a hash of the source, the compiler's version,
the flags and the CPU, so a source change, another compiler or another machine builds afresh. The build writes a
temporary file and renames it, so concurrent first uses (test workers, ranks) are safe.

Where there is no compiler, or the build fails, :func:`load` returns None, says why once in a ``RuntimeWarning``,
and the CPU default falls back to the chunked PyTorch backend (``offpolicy.ops.torch_backend``), which computes
the same quantities. ``OFFPOLICY_CPU_NATIVE=0`` turns the kernels off without a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from importlib import resources
from pathlib import Path

ENV_VAR = "OFFPOLICY_CPU_NATIVE"
CACHE_ENV_VAR = "OFFPOLICY_CACHE_DIR"
ARCH_ENV_VAR = "OFFPOLICY_CPU_ARCH_FLAGS"
FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared")
DTYPES = ("f32", "bf16", "f16")

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}

_P, _I = ctypes.c_void_p, ctypes.c_int64
#: stats(z, z_stride_bytes, v, rows, n_rows, a, m, s, t2, bad)
STATS_ARGS = [_P, _I, _I, _P, _I, _P, _P, _P, _P, _P]
#: grad(z, z_stride_bytes, out, out_stride_bytes, v, rows, n_rows, shift, a, c, cols, g, m_ids, scratch)
GRAD_ARGS = [_P, _I, _P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _I, _P]


def enabled() -> bool:
    """Whether the kernels may be used (``OFFPOLICY_CPU_NATIVE`` is not ``0``)."""
    return os.environ.get(ENV_VAR, "1") != "0"


def load() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None where disabled or unavailable (see
    :func:`unavailable_reason`)."""
    if not enabled():
        return None
    with _LOCK:
        if "lib" not in _STATE:
            try:
                _STATE["lib"] = _open(_build())
            except (OSError, subprocess.SubprocessError) as err:
                _STATE["lib"] = None
                _STATE["reason"] = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                warnings.warn(f"offpolicy: the native CPU kernels are unavailable ({_STATE['reason']}); the CPU path "
                              "uses the chunked PyTorch backend", RuntimeWarning, stacklevel=3)
        return _STATE["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None if it has not failed)."""
    if not enabled():
        return f"{ENV_VAR}=0"
    return _STATE.get("reason")  # type: ignore[return-value]


def source_path() -> Path:
    """The C source shipped in the package."""
    return Path(str(resources.files("offpolicy.kernels").joinpath("vocab_pass_cpu.c")))


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler: {cc!r} is not on PATH (set CC)")
    return cc


def _flags() -> list[str]:
    return [*FLAGS, *shlex.split(os.environ.get(ARCH_ENV_VAR, "-march=native"))]


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV_VAR)
    return Path(root) if root else Path.home() / ".cache" / "offpolicy"


def _cpu_id() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def _build() -> Path:
    """Compile the source into the cache (once per source, compiler, flags and CPU) and return the library's path."""
    cc = _compiler()
    src = source_path().read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    flags = _flags()
    key = hashlib.sha256(b"\0".join([src, version.encode(), " ".join(flags).encode(), _cpu_id().encode()]))
    target = _cache_dir() / f"vocab_pass_cpu-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, "-x", "c", "-"], input=src, capture_output=True)
        if res.returncode != 0:
            raise subprocess.SubprocessError(f"{cc} failed: {res.stderr.decode(errors='replace').strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name in DTYPES:
        getattr(lib, f"stats_{name}").argtypes = STATS_ARGS
        getattr(lib, f"grad_{name}").argtypes = GRAD_ARGS
        getattr(lib, f"stats_{name}").restype = getattr(lib, f"grad_{name}").restype = None
    return lib
