"""The native CPU backend's build cache (:mod:`offpolicy.ops.cpu_native`): what it loads, what it refuses, and how
it recovers. Every test has its own ``OFFPOLICY_CACHE_DIR``; the library built once for the module is copied in
where a test needs a cached one, so that only the rebuilds a test is about are compiled.

Files owned by another user are made with ``chown`` when the tests run as root, and simulated by patching the
stat calls of the loader otherwise.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from offpolicy.ops import cpu_native
from offpolicy.ops.logits_op import cpu_backend, torch_backend

from support.vocab_reference import grad_case

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="no C compiler: the CPU default is torch")

OTHER_UID = 65534


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[bytes, bytes]:
    """A library and its hash file, built once with the default settings."""
    root = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_native.CACHE_ENV_VAR, str(root))
        mp.setattr(cpu_native, "_STATE", {})
        assert cpu_native.load() is not None
        lib = cpu_native.library_path()
    return lib.read_bytes(), Path(f"{lib}.sha256").read_bytes()


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """A fresh cache root for this test, and a fresh loader state."""
    root = tmp_path / "cache"
    monkeypatch.setenv(cpu_native.CACHE_ENV_VAR, str(root))
    monkeypatch.setattr(cpu_native, "_STATE", {})
    return root


def seed(built: tuple[bytes, bytes]) -> Path:
    """Put the module's library where this configuration looks for it, as a build would leave it."""
    lib = cpu_native.library_path()
    lib.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lib.write_bytes(built[0])
    Path(f"{lib}.sha256").write_bytes(built[1])
    return lib


def replace(path: Path, data: bytes) -> None:
    """Write ``data`` as a new file at ``path`` (a new inode: a library this process mapped is left intact)."""
    tmp = path.with_name("planted")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def sha256_file(lib: Path) -> bytes:
    return hashlib.sha256(lib.read_bytes()).hexdigest().encode()


def assert_rebuilt(lib: Path, built: tuple[bytes, bytes]) -> None:
    """A good library is back at ``lib``, with its hash, the modes of a build, and no temporary file."""
    assert Path(f"{lib}.sha256").read_bytes() == sha256_file(lib)
    assert stat.S_IMODE(lib.stat().st_mode) == 0o644 and lib.stat().st_uid == os.geteuid()
    assert lib.stat().st_size > len(built[0]) // 2
    assert not list(lib.parent.glob("tmp*"))


def owned_by_another_user(monkeypatch, path: Path) -> None:
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)
        return
    ino = path.stat().st_ino
    real_fstat, real_lstat = os.fstat, os.lstat

    def fake(st: os.stat_result) -> os.stat_result:
        if st.st_ino != ino:
            return st
        fields = list(st[:10])
        fields[4] = OTHER_UID
        return os.stat_result(fields)

    monkeypatch.setattr(cpu_native.os, "fstat", lambda fd: fake(real_fstat(fd)))
    monkeypatch.setattr(cpu_native.os, "lstat", lambda p: fake(real_lstat(p)))


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting for its reaper counts) within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_build_is_private_hashed_and_reused(cache):
    """The library lands in a 0700 per-user folder, 0644, with its sha256 beside it; a second load reuses it."""
    assert cpu_native.load() is not None
    lib = cpu_native.library_path()
    assert lib.parent == cache / f"cpu-{os.geteuid()}"
    assert stat.S_IMODE(lib.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(lib.stat().st_mode) == 0o644
    assert Path(f"{lib}.sha256").read_bytes() == sha256_file(lib)
    assert sorted(p.name for p in lib.parent.iterdir()) == sorted([".lock", lib.name, f"{lib.name}.sha256"])
    stamp = lib.stat().st_mtime_ns
    cpu_native._STATE.clear()
    assert cpu_native.load() is not None and lib.stat().st_mtime_ns == stamp


def test_flags_and_source_are_in_the_key(cache, built, monkeypatch, tmp_path):
    """Other flags never reuse a library built with these: here a build without fp16 kernels (the define that
    simulates a compiler without ``_Float16``), whose fp16 logits then take the PyTorch backend, once warned, while
    bf16 stays native. Another source gives another name."""
    native = seed(built)
    monkeypatch.setenv(cpu_native.ARCH_ENV_VAR, "-march=native -DOFFPOLICY_NO_FLOAT16")
    assert cpu_native.library_path() != native
    assert cpu_native.load() is not None
    assert cpu_native.dtypes() == {"f32", "bf16"}
    assert not hasattr(cpu_native.load(), "grad_f16")
    gen = torch.Generator().manual_seed(4)
    z, ids, inv_temp, lse, grad, grad_sum = grad_case(5, 300, 4, torch.float16, gen)
    monkeypatch.setattr(cpu_backend, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="built without torch.float16"):
        got = cpu_backend.full_stats(z, inv_temp, None)
    for g, w in zip(got[:3], torch_backend.full_stats(z, inv_temp, None)[:3]):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    out = cpu_backend.full_grad(z, ids, inv_temp, lse, grad, grad_sum, torch.empty_like(z))
    want = torch_backend.full_grad(z, ids, inv_temp, lse, grad, grad_sum, torch.empty_like(z))
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    zb = z.bfloat16()
    m, s, t, _ = cpu_backend.full_stats(zb, inv_temp, None)  # bf16: the C loops (no warning, close to torch's)
    torch.testing.assert_close(s, torch_backend.full_stats(zb, inv_temp, None)[1], rtol=1e-5, atol=0,
                               equal_nan=True)
    monkeypatch.delenv(cpu_native.ARCH_ENV_VAR)
    changed = tmp_path / "changed.c"
    changed.write_bytes(cpu_native.source_path().read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(cpu_native, "source_path", lambda: changed)
    assert cpu_native.library_path() != native


def test_truncated_library_is_rebuilt(cache, built):
    lib = seed(built)
    replace(lib, built[0][: len(built[0]) // 2])
    with pytest.warns(RuntimeWarning, match="does not match its sha256"):
        assert cpu_native.load() is not None
    assert_rebuilt(lib, built)


def test_garbage_with_a_matching_hash_is_rebuilt(cache, built):
    """A file that passes the hash but is no library (never loaded before in this process): the load fails, the
    file is deleted and built again."""
    lib = seed(built)
    garbage = os.urandom(len(built[0]))
    replace(lib, garbage)
    Path(f"{lib}.sha256").write_text(hashlib.sha256(garbage).hexdigest())
    with pytest.warns(RuntimeWarning, match="does not load"):
        assert cpu_native.load() is not None
    assert_rebuilt(lib, built)


def test_library_missing_a_symbol_is_rebuilt(cache, built, tmp_path):
    lib = seed(built)
    other = tmp_path / "other.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(other), "-x", "c", "-"],
                   input=b"int unrelated(void) { return 0; }", check=True)
    replace(lib, other.read_bytes())
    Path(f"{lib}.sha256").write_bytes(sha256_file(lib))
    with pytest.warns(RuntimeWarning, match="lacks a symbol"):
        loaded = cpu_native.load()
    assert loaded is not None and hasattr(loaded, "stats_f32")
    assert_rebuilt(lib, built)


def test_abi_mismatch_rebuilds_then_falls_back(cache, built, monkeypatch):
    """The loader declares another ABI than the library's: rebuilt once, then the backend falls back, saying why."""
    seed(built)
    monkeypatch.setattr(cpu_native, "ABI_VERSION", "0")
    with pytest.warns(RuntimeWarning) as record:
        assert cpu_native.load() is None
    assert "its ABI" in cpu_native.unavailable_reason() and "not the loader's" in cpu_native.unavailable_reason()
    assert any("rebuilding" in str(w.message) for w in record)


def test_canonical_abi():
    text = "2;void stats(const void *z, int64_t v);int64_t grad(float *out, int32_t n)"
    assert cpu_native.canonical_abi(text) == "2;void stats(ptr z, i64 v);i64 grad(ptr out, int32_t n)"
    lib = cpu_native.load()
    assert cpu_native.canonical_abi(lib.offpolicy_abi().decode()) == cpu_native.declared_abi()


def test_world_writable_library_is_refused(cache, built):
    lib = seed(built)
    lib.chmod(0o666)
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert cpu_native.load() is not None
    assert_rebuilt(lib, built)


@pytest.mark.parametrize("which", ["library", "hash file"])
def test_group_writable_file_is_refused(cache, built, which):
    """Writable by the group only (no bit for others): refused as well, deleted and built again."""
    lib = seed(built)
    (lib if which == "library" else Path(f"{lib}.sha256")).chmod(0o664)
    with pytest.warns(RuntimeWarning, match=r"writable by group or others \(mode 664\)"):
        assert cpu_native.load() is not None
    assert_rebuilt(lib, built)
    assert stat.S_IMODE(Path(f"{lib}.sha256").stat().st_mode) == 0o644


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o770, 0o711])
def test_an_existing_folder_is_brought_back_to_0700(cache, built, mode):
    """A ``cpu-<uid>`` folder of one's own that others can read or enter (made by hand, or by an older version) is
    used, and left at 0700."""
    lib = seed(built)
    lib.parent.chmod(mode)
    assert cpu_native.load() is not None
    assert stat.S_IMODE(lib.parent.stat().st_mode) == 0o700
    assert lib.read_bytes() == built[0]  # the trusted library was used as it was


def test_a_second_builder_waits_for_the_lock_and_reuses_the_first_ones_library(cache, built, monkeypatch):
    """While one builder holds the folder's build lock (taken as a build takes it), a second ``load`` neither
    compiles nor reads the cache: it waits, then loads the library the first builder left, without compiling."""
    import threading

    folder = cpu_native.library_path().parent
    folder.mkdir(mode=0o700, parents=True)
    real_flock, real_run = fcntl.flock, cpu_native._run
    events: list[str] = []  # the second builder's lock attempts and compiler runs, in order
    holder = threading.get_ident()

    def flock(fd, op):
        try:
            return real_flock(fd, op)
        except OSError:
            if threading.get_ident() != holder:
                events.append("blocked")
            raise

    def run(argv, stdin, timeout):
        if "-o" in argv:
            events.append("compile")
        return real_run(argv, stdin, timeout)

    monkeypatch.setattr(cpu_native.fcntl, "flock", flock)
    monkeypatch.setattr(cpu_native, "_run", run)
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(cpu_native.load()), daemon=True)
    with cpu_native._folder_lock(folder, 5.0):
        worker.start()
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events and events[0] == "blocked", events  # not past the lock, not compiling
        lib = seed(built)  # what the first builder leaves before it lets go
    worker.join(60)
    assert not worker.is_alive() and result and result[0] is not None
    assert "compile" not in events, events
    assert lib.read_bytes() == built[0]


def test_library_of_another_user_is_refused(cache, built, monkeypatch):
    lib = seed(built)
    owned_by_another_user(monkeypatch, lib)
    with pytest.warns(RuntimeWarning, match=f"owned by uid {OTHER_UID}"):
        assert cpu_native.load() is not None
    monkeypatch.undo()  # the fake stat (if any) and the cache directory
    assert lib.stat().st_uid == os.geteuid()


@pytest.mark.parametrize("case", ["folder of another user", "root writable by all"])
def test_untrusted_folder_builds_privately(case, cache, built, monkeypatch):
    """The cache cannot be trusted: the library is built in a private temporary folder, used, and removed; nothing
    is written to the cache."""
    lib = seed(built)
    if case == "folder of another user":
        owned_by_another_user(monkeypatch, lib.parent)
        expected = f"owned by uid {OTHER_UID}"
    else:
        cache.chmod(0o777)
        expected = "writable by all without the sticky bit"
    before = sorted(lib.parent.iterdir())
    with pytest.warns(RuntimeWarning, match=expected):
        assert cpu_native.load() is not None
    assert sorted(lib.parent.iterdir()) == before
    cache.chmod(0o700)


def test_concurrent_first_use_with_a_truncated_library_and_a_killed_build(cache, built):
    """Two fresh processes load at once from a cache holding a truncated library (which would SIGBUS inside
    ``dlopen``) and a killed build's temporary file: both load, and one good library is left."""
    lib = seed(built)
    replace(lib, built[0][: len(built[0]) // 3])
    (lib.parent / "tmpkilled.so").write_bytes(b"half a build")
    script = "from offpolicy.ops import cpu_native; assert cpu_native.load() is not None; print('loaded')"
    env = {**os.environ, cpu_native.CACHE_ENV_VAR: str(cache), "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and "loaded" in out, err[-2000:]
    assert sorted(p.name for p in lib.parent.iterdir()) == sorted([".lock", lib.name, f"{lib.name}.sha256"])
    assert_rebuilt(lib, built)


def test_hanging_compiler_times_out(cache, monkeypatch, tmp_path):
    """A compiler that never finishes is killed (its whole process group) after the timeout; the backend falls
    back, the lock is free and no temporary file is left."""
    pid_file = tmp_path / "pid"
    fake = tmp_path / "hanging-cc"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then exec cc --version; fi
        sleep 60 &
        echo $! > {pid_file}
        wait
        """))
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv(cpu_native.TIMEOUT_ENV_VAR, "1")
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not finish within 1 s"):
        assert cpu_native.load() is None
    assert time.monotonic() - start < 20  # 1 s and the fallback on a loaded machine, not the 60 s of the child
    assert cpu_native.TIMEOUT_ENV_VAR in cpu_native.unavailable_reason()
    assert gone(int(pid_file.read_text()))  # the compiler's child too: it held the output pipes
    folder = cache / f"cpu-{os.geteuid()}"
    assert not list(folder.glob("tmp*"))
    with open(folder / ".lock") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free


def test_bad_timeout_is_named(cache, monkeypatch):
    monkeypatch.setenv(cpu_native.TIMEOUT_ENV_VAR, "soon")
    with pytest.warns(RuntimeWarning, match=cpu_native.TIMEOUT_ENV_VAR):
        assert cpu_native.load() is None
    assert "'soon' is not a number of seconds > 0" in cpu_native.unavailable_reason()


def test_compiler_words_and_resolved_path(cache, monkeypatch, tmp_path):
    """``CC`` is split into words (``CC="ccache gcc"``), and the key holds the compiler's resolved path: a wrapper
    with the same ``--version`` gets its own library."""
    cc = shutil.which("cc")
    monkeypatch.setenv("CC", "cc")
    plain = cpu_native.library_path()
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "cc"  # the same command word, another program
    wrapper.write_text(f'#!/bin/sh\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    assert cpu_native.library_path() != plain
    monkeypatch.setenv("CC", f"env {cc}")
    assert cpu_native.library_path() != plain
    assert cpu_native.load() is not None
