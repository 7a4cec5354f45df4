"""A weight channel on an object store, for fleets without a shared disk.

:class:`ObjectStoreWeightChannel` keeps versions as objects under a key prefix of any store with four calls
(:class:`ObjectStore`: ``put``, ``get``, ``list``, ``delete``, the subset of fsspec's file-system calls a channel
needs; an S3 / GCS bucket through fsspec fits it). :class:`RayObjectStore` is that interface on Ray's object store
(a named actor holding each object's reference: no shared disk, Ray moves the bytes between nodes);
:class:`FsspecObjectStore` on any fsspec file system (``s3://bucket/path``, ``gs://...``, ``memory://``, a local
path); :class:`LocalObjectStore` on a local directory (tests, and a single machine). Layout under
``prefix``: ``v000007/model.safetensors`` (the trainer's weights), ``v000007/<format>/model.safetensors`` (each
format's copy, quantised once at ``publish``), and ``LATEST``, put after every object of the version, so a reader
that sees ``LATEST = 7`` finds all of version 7. Old versions are collected as the disk channel's are.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from offpolicy.adapters.fleet_live.weight_sync import (
    WEIGHTS_FILE,
    _check_version,
    check_channel_settings,
    check_publish,
    group_checkpoint,
    private_folder,
)


class ObjectStore(Protocol):
    """Bytes under string keys (``/``-separated)."""

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, whole (a reader sees the old object or the new one)."""

    def get(self, key: str) -> bytes:
        """The object under ``key``; raises ``FileNotFoundError`` when there is none."""

    def list(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``."""

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error when it is missing)."""


def _check_key(key: str) -> str:
    """``key`` if it is a relative ``/``-separated name without empty, ``.`` or ``..`` parts or a ``.tmp`` end."""
    if not isinstance(key, str) or not key or any(p in ("", ".", "..") for p in key.split("/")) \
            or key.endswith(".tmp"):
        raise ValueError(f"key must be a relative '/'-separated name without '.', '..' or a '.tmp' end, got "
                         f"{key!r}")
    return key


class LocalObjectStore:
    """:class:`ObjectStore` on a private local directory: one file per key, written to a temporary name and
    renamed into place.

    Args:
        root: the directory (created 0700 if missing; one another user owns is refused).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        private_folder(self.root)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*_check_key(key).split("/"))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"no object {key!r} in {self.root}")
        return path.read_bytes()

    def list(self, prefix: str) -> list[str]:
        keys = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(k for k in keys if k.startswith(prefix) and not k.endswith(".tmp"))

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        for parent in path.parents:  # drop folders left empty, up to the root
            if parent == self.root or any(parent.iterdir()):
                break
            parent.rmdir()


class FsspecObjectStore:
    """:class:`ObjectStore` on an fsspec file system under ``url`` (``"s3://bucket/run1"``, ``"gs://..."``,
    ``"memory://..."``, a local path): one object per key. Each object is written under a temporary name beside
    its key and then moved onto it, so a reader sees the old object or the whole new one (on S3 / GCS a move is a
    server-side copy; the key appears whole). The store pickles as its URL and options and reconnects where it is
    unpickled (each engine actor reaches the same bucket; ``memory://`` is per process, for tests).

    Args:
        url: the root, any URL fsspec resolves (its protocol's package installed, e.g. ``s3fs`` for ``s3://``).
        storage_options: passed to fsspec (credentials, endpoint, ...).
    """

    def __init__(self, url: str, **storage_options: object):
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty string, got {url!r}")
        from fsspec.core import url_to_fs

        self.url, self.storage_options = url, storage_options
        self.fs, root = url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")

    def __getstate__(self) -> dict[str, object]:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["url"], **state["storage_options"])

    def _path(self, key: str) -> str:
        return f"{self.root}/{_check_key(key)}"

    def put(self, key: str, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"data must be bytes, got {type(data).__name__}")
        path = self._path(key)
        tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(tmp, bytes(data))
        self.fs.mv(tmp, path)

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise FileNotFoundError(f"no object {key!r} in {self.url}") from None

    def list(self, prefix: str) -> list[str]:
        # find() under the deepest folder the prefix names, then the keys that start with the whole prefix
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = f"{self.root}/{folder}".rstrip("/")
        if not self.fs.exists(base):
            return []
        keys = (path[len(self.root) + 1:] if path.startswith(self.root + "/") else path
                for path in self.fs.find(base))
        return sorted(k for k in keys if k.startswith(prefix) and not k.endswith(".tmp"))

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass


class _RefIndex:
    """The body of :class:`RayObjectStore`'s named actor: each key's object reference (inside a one-item list, so
    Ray passes the reference, not the object) and its size. It holds references only: the bytes stay in Ray's
    object store, and an object is freed once its key is deleted here and its writer dropped it."""

    def __init__(self):
        self.refs: dict[str, tuple[object, int]] = {}

    def put(self, key: str, box: list, size: int) -> None:
        self.refs[key] = (box[0], int(size))

    def get(self, key: str) -> list | None:
        entry = self.refs.get(key)
        return None if entry is None else [entry[0]]

    def list(self, prefix: str) -> list[str]:
        return sorted(k for k in self.refs if k.startswith(prefix))

    def delete(self, key: str) -> None:
        self.refs.pop(key, None)

    def nbytes(self) -> int:
        return sum(size for _, size in self.refs.values())


class RayObjectStore:
    """:class:`ObjectStore` on Ray's object store, for a fleet with no shared disk: the writer puts each object with
    ``ray.put`` and a named actor (the index, ``name`` in ``namespace``, no CPU reserved) keeps its reference by
    key; a reader on any node of the cluster asks the index for the reference and ``ray.get`` s it (Ray moves the
    bytes between nodes). Deleting a key drops the index's reference, and Ray frees the object.

    The index is created at first use (``ray.init`` must have run: :meth:`~.fleet_runner.LiveFleet.start` does),
    and lives as long as the process that created it (the trainer; so do the objects it put: a new trainer starts
    with an empty store). A pickled copy (what each engine actor gets) carries the name only and finds the index by
    it.

    Args:
        name: the index actor's name (one per channel in a cluster; default a fresh unique name).
        namespace: its Ray namespace.
    """

    def __init__(self, name: str | None = None, namespace: str = "offpolicy"):
        if name is None:
            name = f"offpolicy-weights-{uuid.uuid4().hex[:12]}"
        for what, v in (("name", name), ("namespace", namespace)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{what} must be a non-empty string, got {v!r}")
        self.name, self.namespace = name, namespace
        self._index: object | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"name": self.name, "namespace": self.namespace, "_index": None}

    def index(self) -> object:
        """The index actor's handle (created, or found by name, at first use)."""
        if self._index is None:
            import ray

            if not ray.is_initialized():
                raise RuntimeError("RayObjectStore: Ray is not initialised (call ray.init() or LiveFleet.start() "
                                   "before the first publish)")
            self._index = ray.remote(_RefIndex).options(
                name=self.name, namespace=self.namespace, get_if_exists=True, num_cpus=0).remote()
        return self._index

    def put(self, key: str, data: bytes) -> None:
        import ray

        _check_key(key)
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"data must be bytes, got {type(data).__name__}")
        ray.get(self.index().put.remote(key, [ray.put(bytes(data))], len(data)))

    def get(self, key: str) -> bytes:
        import ray

        _check_key(key)
        box = ray.get(self.index().get.remote(key))
        if box is None:
            raise FileNotFoundError(f"no object {key!r} in the Ray object store {self.namespace}/{self.name}")
        return ray.get(box[0])

    def list(self, prefix: str) -> list[str]:
        import ray

        return ray.get(self.index().list.remote(prefix))

    def delete(self, key: str) -> None:
        import ray

        _check_key(key)
        ray.get(self.index().delete.remote(key))

    def nbytes(self) -> int:
        """Bytes of the objects the index holds (what the channel's retention keeps in Ray's object store)."""
        import ray

        return ray.get(self.index().nbytes.remote())


class ObjectStoreWeightChannel:
    """A :class:`~.weight_sync.WeightChannel` on an :class:`ObjectStore` (no shared disk needed).

    Args:
        store: the object store (pickled into every engine's actor: it must reach the same objects there).
        prefix: the key prefix of this channel's objects (no leading or trailing ``/``).
        keep: how many of the newest versions to keep (``>= 1``; ``None``: keep every version).
        formats: weight formats quantised once per version at ``publish`` (a group of one of them fetches that
            copy with :meth:`fetch` ``(version, format)`` instead of quantising).
        dtype: the dtype of the per-format copies (the engines' dtype).

    Attributes:
        quantised: per-format copies this process has put; bytes_written: bytes of weights it has put.
    """

    def __init__(self, store: ObjectStore, prefix: str = "weights", keep: int | None = 4,
                 formats: Iterable[str] = (), dtype: torch.dtype = torch.float32):
        if not isinstance(prefix, str) or not prefix or prefix.startswith("/") or prefix.endswith("/"):
            raise ValueError(f"prefix must be a non-empty key without a leading or trailing '/', got {prefix!r}")
        formats = check_channel_settings(keep, formats, dtype)
        self.store, self.prefix, self.keep, self.formats, self.dtype = store, prefix, keep, formats, dtype
        self.quantised = 0
        self.bytes_written = 0

    def key(self, version: int, weight_format: str | None = None) -> str:
        """The key of ``version``'s weights, or of its ``weight_format`` copy."""
        base = f"{self.prefix}/v{_check_version(version):06d}"
        if weight_format is None:
            return f"{base}/{WEIGHTS_FILE}"
        if weight_format not in self.formats:
            raise ValueError(f"weight_format {weight_format!r} is not one this channel quantises {self.formats}")
        return f"{base}/{weight_format}/{WEIGHTS_FILE}"

    def publish(self, state_dict: Mapping[str, Tensor], version: int,
                in_use: Iterable[int] | Callable[[], Iterable[int]] = ()) -> None:
        """Put ``version`` and its per-format copies, then ``LATEST``, then :meth:`collect` (``in_use`` kept; a
        callable is read after ``LATEST`` names ``version``, as :meth:`DiskWeightChannel.publish` says)."""
        from safetensors.torch import save

        version = check_publish(state_dict, version, self.latest())
        blobs = {self.key(version): save({k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()})}
        for fmt in self.formats:
            blobs[self.key(version, fmt)] = save(group_checkpoint(state_dict, fmt, self.dtype))
            self.quantised += 1
        for key, data in blobs.items():
            self.store.put(key, data)
            self.bytes_written += len(data)
        self.store.put(f"{self.prefix}/LATEST", str(version).encode())
        self.collect(in_use)

    def versions(self) -> list[int]:
        """The versions in the store, oldest first."""
        found = set()
        for key in self.store.list(f"{self.prefix}/v"):
            name = key[len(self.prefix) + 1:].split("/", 1)[0]
            if name[1:].isdigit():
                found.add(int(name[1:]))
        return sorted(found)

    def collect(self, in_use: Iterable[int] | Callable[[], Iterable[int]] = ()) -> list[int]:
        """Delete every version but the newest ``keep`` and those ``in_use``; returns the versions deleted."""
        if self.keep is None:
            return []
        have = self.versions()
        kept = set(have[-self.keep:]) | {int(v) for v in (in_use() if callable(in_use) else in_use)}
        gone = [v for v in have if v not in kept]
        for v in gone:
            for key in self.store.list(f"{self.prefix}/v{v:06d}/"):
                self.store.delete(key)
        return gone

    def latest(self) -> int | None:
        try:
            return int(self.store.get(f"{self.prefix}/LATEST").decode())
        except FileNotFoundError:
            return None

    def fetch(self, version: int, weight_format: str | None = None) -> dict[str, Tensor]:
        """The weights of ``version`` as published, or its ``weight_format`` copy (on CPU)."""
        from safetensors.torch import load

        key = self.key(version, weight_format)
        try:
            data = self.store.get(key)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"fetch: version {version} is not in the store ({key!r}: never published, or "
                                    f"collected: the channel keeps the newest {self.keep})") from exc
        return load(data)
