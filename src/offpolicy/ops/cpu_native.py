"""Build and load the CPU vocabulary kernels (``kernels/vocab_pass_cpu.c``, installed as ``offpolicy.kernels``).

The C file is compiled at first use with the machine's C compiler (``$CC``, split like a shell word list, so
``CC="ccache gcc"`` works; else ``cc``) for this CPU (``-O3 -march=native``; ``$OFFPOLICY_CPU_ARCH_FLAGS`` replaces
``-march=native``, e.g. ``-march=x86-64-v3`` for a cache shared by unlike machines) and loaded with :mod:`ctypes`;
calls release the GIL, so the row workers of :mod:`offpolicy.ops.row_threads` run them in parallel.

The build cache (``docs/performance.md``, "The build cache"): libraries live in a per-user folder ``cpu-<uid>``
(mode 0700) under ``$OFFPOLICY_CACHE_DIR`` (default ``~/.cache/offpolicy``), named by a hash of the source, the
compiler's resolved path and version, the flags and the CPU, each with its sha256 beside it (``<name>.so.sha256``,
files 0644). A library is loaded only if it and its hash file are regular files owned by this user and writable by
no one else, and its content matches the hash; otherwise it is deleted and rebuilt (with a warning saying why), as
is a library that fails to load, lacks a symbol or declares another ABI than :data:`SIGNATURES` (then, if the
rebuilt one fails too, the CPU default falls back). Where the folder cannot be trusted (another owner, or a cache
root everyone can write to without the sticky bit), the library is built in a private temporary folder for this
process instead, with a warning. Builds run under an advisory lock on the folder (released by the kernel if the
process dies), each within ``$OFFPOLICY_CPU_BUILD_TIMEOUT`` seconds (default :data:`DEFAULT_TIMEOUT_S`; the
compiler's process group is killed past it), in a temporary file renamed into place; leftovers of killed builds are
removed by the next build.

Where there is no compiler, or the build fails, :func:`load` returns None, says why once in a ``RuntimeWarning``,
and the CPU default falls back to the chunked PyTorch backend (``offpolicy.ops.logits_op.torch_backend``), which computes
the same quantities. ``OFFPOLICY_CPU_NATIVE=0`` turns the kernels off without a warning. fp16 kernels exist only
where the compiler has ``_Float16`` (:func:`dtypes` says which were built).
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import errno
import hashlib
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: load() says so and the CPU default is the PyTorch backend
    fcntl = None  # type: ignore[assignment]

ENV_VAR = "OFFPOLICY_CPU_NATIVE"
CACHE_ENV_VAR = "OFFPOLICY_CACHE_DIR"
ARCH_ENV_VAR = "OFFPOLICY_CPU_ARCH_FLAGS"
TIMEOUT_ENV_VAR = "OFFPOLICY_CPU_BUILD_TIMEOUT"
#: Seconds a compiler run (``--version`` or the build) may take before it is killed and the backend falls back.
DEFAULT_TIMEOUT_S = 120.0
FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared")
#: The dtypes the source can build; fp32 and bf16 are always built, fp16 where the compiler has ``_Float16``.
DTYPES = ("f32", "bf16", "f16")
REQUIRED_DTYPES = ("f32", "bf16")

_P, _I = ctypes.c_void_p, ctypes.c_int64
#: What ``offpolicy_abi()`` of the library must declare: the ABI version, then each exported function's return type
#: and parameters (name, ctypes type) in order; the ctypes declarations of :func:`_open` are made from these.
ABI_VERSION = "3"
SIGNATURES: dict[str, tuple[type | None, tuple[tuple[str, type], ...]]] = {
    "stats": (None, (("z", _P), ("z_stride", _I), ("v", _I), ("rows", _P), ("n_rows", _I), ("a", _P),
                     ("m_out", _P), ("s_out", _P), ("t_out", _P), ("q_out", _P), ("bad", _P))),
    "grad": (_I, (("z", _P), ("z_stride", _I), ("out", _P), ("out_stride", _I), ("v", _I), ("rows", _P),
                  ("n_rows", _I), ("shift", _P), ("a", _P), ("c", _P), ("cols", _P), ("g", _P), ("m_ids", _I),
                  ("scratch", _P), ("scratch_bytes", _I))),
}
_KIND = {_P: "ptr", _I: "i64", None: "void"}
_C_KIND = {"int64_t": "i64", "void": "void"}

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _reset_after_fork() -> None:
    """A child forked while another thread held ``_LOCK`` (a first build in progress) would wait on it forever: the
    child gets a fresh lock, and builds (or waits on the build file's ``flock``) itself if the library is not loaded."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


class Unavailable(Exception):
    """Why the kernels cannot be built or loaded (the message is the reason :func:`unavailable_reason` gives)."""


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
                _STATE["lib"], _STATE["dtypes"] = _load()
            except (Unavailable, OSError, subprocess.SubprocessError) as err:
                _STATE["lib"], _STATE["dtypes"] = None, frozenset()
                _STATE["reason"] = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                warnings.warn(f"offpolicy: the native CPU kernels are unavailable ({_STATE['reason']}); the CPU path "
                              "uses the chunked PyTorch backend", RuntimeWarning, stacklevel=3)
        return _STATE["lib"]  # type: ignore[return-value]


def dtypes() -> frozenset[str]:
    """The logits dtypes the loaded library has kernels for (a subset of :data:`DTYPES`; empty if unavailable)."""
    load()
    return _STATE.get("dtypes", frozenset())  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None if it has not failed)."""
    if not enabled():
        return f"{ENV_VAR}=0"
    return _STATE.get("reason")  # type: ignore[return-value]


def source_path() -> Path:
    """The C source shipped in the package (``kernels/vocab_pass_cpu.c``: beside ``offpolicy.kernels``'s
    ``__init__.py`` in a wheel, in the checkout's ``kernels/`` folder otherwise)."""
    from offpolicy import kernels

    return kernels.source("vocab_pass_cpu.c")


def declared_abi() -> str:
    """The ABI the loader declares, in the canonical form :func:`canonical_abi` gives the library's string."""
    protos = (f"{_KIND[ret]} {name}({', '.join(f'{_KIND[t]} {p}' for p, t in params)})"
              for name, (ret, params) in SIGNATURES.items())
    return ";".join([ABI_VERSION, *protos])


def canonical_abi(text: str) -> str:
    """``offpolicy_abi()``'s C prototypes in the form of :func:`declared_abi`: each parameter as ``ptr name``
    (any pointer) or ``i64 name`` (``int64_t``); other types are kept as written, so they never match."""
    version, *protos = text.split(";")
    out = [version.strip()]
    for proto in protos:
        head = re.fullmatch(r"\s*(\w+)\s+(\w+)\((.*)\)\s*", proto)
        if head is None:
            return text
        ret, name, params = head.groups()
        kinds = []
        for param in params.split(","):
            part = re.fullmatch(r"\s*(.*?)\s*(\w+)\s*", param)
            if part is None:
                return text
            ctype, pname = part.groups()
            kinds.append(f"{'ptr' if '*' in ctype else _C_KIND.get(ctype, ctype)} {pname}")
        out.append(f"{_C_KIND.get(ret, ret)} {name}({', '.join(kinds)})")
    return ";".join(out)


def timeout_s() -> float:
    """Seconds a compiler run may take: ``$OFFPOLICY_CPU_BUILD_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`."""
    text = os.environ.get(TIMEOUT_ENV_VAR)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise Unavailable(f"{TIMEOUT_ENV_VAR}={text!r} is not a number of seconds > 0")
    return value


def library_path() -> Path:
    """Where this configuration's library lives in the cache (built or not): ``<cache>/cpu-<uid>/<name>.so``."""
    return _folder_of(_cache_dir()) / f"vocab_pass_cpu-{_key(*_compiler())}.so"


def _compiler() -> tuple[list[str], list[str]]:
    """``$CC`` (else ``cc``) as words, and the same words with every command resolved to its real path."""
    text = os.environ.get("CC") or "cc"
    words = shlex.split(text)
    if not words or shutil.which(words[0]) is None:
        raise Unavailable(f"no C compiler: {text!r} is not on PATH (set CC)")
    resolved = [os.path.realpath(found) if (found := shutil.which(w)) else w for w in words]
    return words, resolved


def _flags() -> list[str]:
    return [*FLAGS, *shlex.split(os.environ.get(ARCH_ENV_VAR, "-march=native"))]


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV_VAR)
    return Path(root) if root else Path.home() / ".cache" / "offpolicy"


def _folder_of(root: Path) -> Path:
    return root / f"cpu-{os.geteuid()}"


def _cpu_id() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def _run(argv: list[str], stdin: bytes, timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv`` in its own process group; past ``timeout`` seconds kill the whole group and raise."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise Unavailable(f"{shlex.join(argv[:1])} did not finish within {timeout:g} s ({TIMEOUT_ENV_VAR})") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _key(words: list[str], resolved: list[str]) -> str:
    """The cache key: a hash of the source, the compiler (resolved paths and version), the flags and the CPU."""
    version = _run([*words, "--version"], b"", timeout_s())
    if version.returncode != 0:
        raise Unavailable(f"{shlex.join(words)} --version failed: {version.stderr.decode(errors='replace').strip()}")
    parts = [source_path().read_bytes(), "\0".join(resolved).encode(), version.stdout, "\0".join(_flags()).encode(),
             _cpu_id().encode()]
    return hashlib.sha256(b"\1".join(parts)).hexdigest()[:24]


def _unsafe_dir(st: os.stat_result, *, own: bool) -> str | None:
    """Why a folder with this ``lstat`` cannot hold trusted files (None if it can). ``own``: it must be this user's;
    otherwise root's will do (``/tmp``), and a folder everyone can write to needs the sticky bit."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_uid != os.geteuid() and (own or st.st_uid != 0):
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if not own and st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        return f"writable by all without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _unsafe_file(st: os.stat_result) -> str | None:
    """Why a cached file with this ``fstat`` must not be loaded (None if it may)."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _trusted_folder() -> Path | None:
    """This user's cache folder, made (0700) if missing; None (with a warning) where it cannot be trusted."""
    root = _cache_dir()
    folder = _folder_of(root)
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        why = _unsafe_dir(os.lstat(root), own=False)
        if why is None:
            why = _unsafe_dir(os.lstat(folder), own=True)
            where = folder
        else:
            where = root
    except OSError as err:
        why, where = f"{err.strerror or err}", folder
    if why is not None:
        warnings.warn(f"offpolicy: the native CPU kernels' cache folder {where} cannot be trusted or used ({why}); "
                      f"building in a private temporary folder instead (set {CACHE_ENV_VAR} to a folder of your own)",
                      RuntimeWarning, stacklevel=4)
        return None
    if stat.S_IMODE(os.lstat(folder).st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


def _load() -> tuple[ctypes.CDLL, frozenset[str]]:
    if fcntl is None:
        raise Unavailable("the build cache needs a POSIX system (fcntl)")
    words, resolved = _compiler()
    key = _key(words, resolved)
    folder = _trusted_folder()
    private = folder is None
    if private:
        folder = Path(tempfile.mkdtemp(prefix="offpolicy-cpu-"))
    try:
        path = _build(words, folder / f"vocab_pass_cpu-{key}.so")
        try:
            return _open(path)
        except Unavailable as err:  # a library built by another version, or damaged: build it again, once
            warnings.warn(f"offpolicy: rebuilding {path} ({err})", RuntimeWarning, stacklevel=3)
            _remove(path)
            return _open(_build(words, path))
    finally:
        if private:
            shutil.rmtree(folder, ignore_errors=True)  # the loaded library stays mapped


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _remove(lib: Path) -> None:
    for p in (lib, _digest_path(lib)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@contextlib.contextmanager
def _folder_lock(folder: Path, wait_s: float) -> Iterator[None]:
    """Hold the folder's advisory build lock (waiting at most ``wait_s``); the kernel drops it if we die."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise Unavailable(f"another process held the build lock {folder / '.lock'} for {wait_s:g} s") \
                        from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _read_trusted(path: Path) -> bytes | None:
    """The bytes of a cached file, None if it is missing; raises :class:`Unavailable` if it is not trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as err:  # O_NOFOLLOW on a symbolic link: ELOOP
        raise Unavailable(f"{path.name} cannot be opened safely ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as f:
        why = _unsafe_file(os.fstat(f.fileno()))
        if why is not None:
            raise Unavailable(f"{path} is {why}")
        return f.read()


def _cached(lib: Path) -> bool:
    """Whether ``lib`` and its hash file are trusted and agree; a file that is present but fails is deleted (with a
    warning saying why) so that it is built again."""
    try:
        data, digest = _read_trusted(lib), _read_trusted(_digest_path(lib))
        if data is None and digest is None:
            return False
        if data is None or digest is None or hashlib.sha256(data).hexdigest() != digest.decode(errors="replace"):
            raise Unavailable(f"{lib.name} does not match its sha256 file (truncated, damaged or half-written)")
    except Unavailable as err:
        warnings.warn(f"offpolicy: rebuilding the native CPU kernels: {err}", RuntimeWarning, stacklevel=5)
        _remove(lib)
        return False
    return True


def _build(words: list[str], lib: Path) -> Path:
    """Compile the source into ``lib`` (with its hash file beside it) unless a trusted copy is there; return ``lib``."""
    timeout = timeout_s()
    with _folder_lock(lib.parent, timeout + 10):
        if _cached(lib):
            return lib
        for stale in lib.parent.glob("tmp*"):  # under the lock, a temporary file is a killed build's
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="tmp", suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            res = _run([*words, *_flags(), "-o", tmp, "-x", "c", "-"], source_path().read_bytes(), timeout)
            if res.returncode != 0:
                raise Unavailable(f"{shlex.join(words)} failed: {res.stderr.decode(errors='replace').strip()}")
            os.chmod(tmp, 0o644)
            digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
            fd, tmp_digest = tempfile.mkstemp(prefix="tmp", suffix=".sha256", dir=lib.parent)
            with os.fdopen(fd, "w") as f:
                f.write(digest)
            os.chmod(tmp_digest, 0o644)
            os.replace(tmp, lib)
            os.replace(tmp_digest, _digest_path(lib))
        finally:
            for p in lib.parent.glob("tmp*"):
                p.unlink(missing_ok=True)
    return lib


def _open(path: Path) -> tuple[ctypes.CDLL, frozenset[str]]:
    """Load ``path`` and declare its functions; raises :class:`Unavailable` (after closing it) if it does not load,
    lacks a symbol or declares another ABI."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise Unavailable(f"it does not load: {err}") from None
    try:
        lib.offpolicy_abi.restype = lib.offpolicy_dtypes.restype = ctypes.c_char_p
        abi = lib.offpolicy_abi().decode(errors="replace")
        if canonical_abi(abi) != declared_abi():
            raise Unavailable(f"its ABI {canonical_abi(abi)!r} is not the loader's {declared_abi()!r}")
        built = frozenset(lib.offpolicy_dtypes().decode().split())
        if not set(REQUIRED_DTYPES) <= built <= set(DTYPES):
            raise Unavailable(f"it has kernels for {sorted(built)}, expected {list(REQUIRED_DTYPES)} (and maybe f16)")
        for dtype in built:
            for name, (ret, params) in SIGNATURES.items():
                fn = getattr(lib, f"{name}_{dtype}")
                fn.argtypes, fn.restype = [t for _, t in params], ret
    except (Unavailable, AttributeError) as err:
        _close(lib)
        raise Unavailable(f"{err}" if isinstance(err, Unavailable) else f"it lacks a symbol: {err}") from None
    return lib, built


def _close(lib: ctypes.CDLL) -> None:
    """Unload a library that failed its checks, so that a rebuilt file at the same path is really loaded (the
    dynamic loader would otherwise hand back the handle it has under that name)."""
    dlclose = getattr(_ctypes, "dlclose", None)  # POSIX
    if dlclose is not None:
        dlclose(lib._handle)
