"""Weight sync with versions: the trainer publishes each step's weights on a channel, every engine group fetches
the newest version when it is free and applies its own numerics before loading it.

A channel has three operations (:class:`WeightChannel`): ``publish(state_dict, version)`` on the trainer,
``latest()`` and ``fetch(version)`` on the engines. :class:`DiskWeightChannel` is the one implemented here: one
directory per version (``v000007/model.safetensors``, written whole, then renamed into place) and a ``LATEST`` file
replaced atomically after it, so a reader never sees a half-written version; the folder is private (0700, this
user's) and old versions are collected (the newest ``keep`` and those still served stay). Built with ``formats``
(the fleet passes its groups' weight formats), ``publish`` also writes each format's checkpoint once
(``v000007/nvfp4/model.safetensors``, :func:`group_checkpoint`): the groups of one format load that one copy, so a
version is quantised once per format, not once per group. An NCCL channel (a broadcast from the
trainer rank into each engine's weights, as vLLM's ``collective_rpc`` and SGLang's ``update_weights_from_distributed``
allow) fits the same three calls: ``publish`` broadcasts, ``fetch`` receives.

:func:`group_checkpoint` is the group's numerics at sync: every weight matrix (each 2-D floating tensor except the
token embeddings, that is every ``nn.Linear`` weight of a Hugging Face causal LM, ``lm_head`` included) rounded
through the group's weight format (:func:`offpolicy.fleet.quant.fake_quantize`) and stored in the engine's dtype,
the same tensors :func:`offpolicy.fleet.quant.fake_quantize_module` gives with its defaults.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from offpolicy.fleet.quant import FAKE_FORMATS, fake_quantize

#: The file every version directory holds (what vLLM's loader reads).
WEIGHTS_FILE = "model.safetensors"


class WeightChannel(Protocol):
    """How weights travel from the trainer to the engine groups (disk here; NCCL fits the same calls)."""

    def publish(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Make ``state_dict`` (the trainer's full-precision weights) the newest version ``version``."""

    def latest(self) -> int | None:
        """The newest published version, or ``None`` before the first ``publish``."""

    def fetch(self, version: int) -> dict[str, Tensor]:
        """The weights of ``version`` (on CPU, as published)."""


def channel_formats(channel: object) -> tuple[str, ...]:
    """The weight formats ``channel`` publishes quantised copies of (``()`` for a channel without them)."""
    return tuple(getattr(channel, "formats", ()) or ())


class DiskWeightChannel:
    """Versions as directories under ``root`` (shared by the trainer and every engine: a local or network disk).

    The folder is private: created with mode 0700; an existing one must belong to this user (a folder another user
    owns is refused: in a shared temporary folder that user could feed weights to the engines or block
    ``publish``) and is brought back to 0700 if it is open to others. Old versions are collected after each
    ``publish``: the newest ``keep`` stay, and any version passed to :meth:`collect` as in use.

    Args:
        root: the channel's directory (created if missing).
        keep: how many of the newest versions to keep (``>= 1``; ``None``: keep every version).
        formats: weight formats (of :data:`offpolicy.fleet.quant.FAKE_FORMATS`) quantised once per version at
            ``publish``, each into :meth:`format_dir` (duplicates are dropped). A group whose ``weight_format`` is
            among them loads that copy instead of quantising the version itself.
        dtype: the dtype of the per-format copies (the engines' dtype: ``torch.float32`` for vLLM on CPU).

    Attributes:
        quantised: how many per-format copies this process has written (one per version and format).
        bytes_written: bytes of safetensors files this process has written (published weights and copies).
    """

    def __init__(self, root: str | os.PathLike, keep: int | None = 4, formats: Iterable[str] = (),
                 dtype: torch.dtype = torch.float32):
        formats = check_channel_settings(keep, formats, dtype)
        self.root, self.keep, self.formats, self.dtype = Path(root), keep, formats, dtype
        self.quantised = 0
        self.bytes_written = 0
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        private_folder(self.root)

    def path(self, version: int) -> Path:
        """The directory of ``version``."""
        return self.root / f"v{_check_version(version):06d}"

    def format_dir(self, version: int, weight_format: str) -> Path:
        """The directory of ``version``'s ``weight_format`` copy (what an engine of that format reloads)."""
        if weight_format not in self.formats:
            raise ValueError(f"weight_format {weight_format!r} is not one this channel quantises {self.formats}")
        return self.path(version) / weight_format

    def publish(self, state_dict: Mapping[str, Tensor], version: int,
                in_use: Iterable[int] | Callable[[], Iterable[int]] = ()) -> None:
        """Write ``version``, make it the newest, then :meth:`collect` old versions (``in_use`` kept).

        ``in_use`` may be a callable: it is then read after ``version`` is the newest, so a reader that resolves
        the newest version after that moment loads ``version``, and one that resolved it before is seen by
        ``in_use`` (the fleet registers a syncing call before sending it); no window in between."""
        from safetensors.torch import save_file

        version = check_publish(state_dict, version, self.latest())
        final = self.path(version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}, str(tmp / WEIGHTS_FILE))
        self.bytes_written += (tmp / WEIGHTS_FILE).stat().st_size
        for fmt in self.formats:  # once per format, whatever the number of groups serving it
            (tmp / fmt).mkdir(mode=0o700)
            save_file(group_checkpoint(state_dict, fmt, self.dtype), str(tmp / fmt / WEIGHTS_FILE))
            self.quantised += 1
            self.bytes_written += (tmp / fmt / WEIGHTS_FILE).stat().st_size
        os.replace(tmp, final)
        latest_tmp = self.root / "LATEST.tmp"
        latest_tmp.write_text(str(version))
        os.replace(latest_tmp, self.root / "LATEST")
        self.collect(in_use)

    def versions(self) -> list[int]:
        """The versions on disk, oldest first."""
        return sorted(int(p.name[1:]) for p in self.root.glob("v[0-9]*") if p.name[1:].isdigit())

    def collect(self, in_use: Iterable[int] | Callable[[], Iterable[int]] = ()) -> list[int]:
        """Delete every version but the newest ``keep`` and those ``in_use`` (e.g. still served); returns the
        versions deleted."""
        if self.keep is None:
            return []
        have = self.versions()
        kept = set(have[-self.keep:]) | {int(v) for v in (in_use() if callable(in_use) else in_use)}
        gone = [v for v in have if v not in kept]
        for v in gone:
            shutil.rmtree(self.path(v), ignore_errors=True)
        return gone

    def latest(self) -> int | None:
        try:
            return int((self.root / "LATEST").read_text())
        except FileNotFoundError:
            return None

    def fetch(self, version: int, weight_format: str | None = None) -> dict[str, Tensor]:
        """The weights of ``version`` as published, or (``weight_format``) its quantised copy in that format."""
        from safetensors.torch import load_file

        base = self.path(version) if weight_format is None else self.format_dir(version, weight_format)
        path = base / WEIGHTS_FILE
        if not path.exists():
            raise FileNotFoundError(f"fetch: version {version} is not under {self.root} (never published, or "
                                    f"collected: the channel keeps the newest {self.keep})")
        return load_file(str(path))


def private_folder(path: Path) -> None:
    """Check that ``path`` (an existing directory) belongs to this user, and make it 0700.

    Raises:
        PermissionError: naming the folder and its owner when another user owns it.
    """
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"weight channel: {path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"weight channel: {path} belongs to user id {st.st_uid}, not to this user "
                              f"({os.getuid()}); another user could feed weights to the engines through it. Use a "
                              "folder of your own")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an integer >= 0, got {version!r}")
    return version


def check_channel_settings(keep: object, formats: Iterable[str], dtype: object) -> tuple[str, ...]:
    """A weight channel's settings checked at its construction (the disk and object-store channels share them):
    ``keep`` ``None`` or an integer >= 1, ``formats`` a collection of fake-quantiser format names, ``dtype`` a floating
    torch dtype. Returns the formats de-duplicated in order."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None or an integer >= 1, got {keep!r}")
    if isinstance(formats, str):
        raise ValueError(f"formats must be a collection of format names, got the string {formats!r}")
    formats = tuple(dict.fromkeys(formats))
    bad = [f for f in formats if f not in FAKE_FORMATS]
    if bad:
        raise ValueError(f"formats must be among {FAKE_FORMATS}, got {bad}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return formats


def check_publish(state_dict: Mapping[str, Tensor], version: int, newest: int | None) -> int:
    """``version`` checked for a channel's ``publish``: an integer >= 0 above the channel's ``newest`` one, with a
    non-empty ``state_dict``."""
    version = _check_version(version)
    if newest is not None and version <= newest:
        raise ValueError(f"publish: version must grow, got {version} after {newest}")
    if not state_dict:
        raise ValueError("publish: state_dict is empty")
    return version


def is_quantized_weight(name: str, tensor: Tensor) -> bool:
    """Whether :func:`group_checkpoint` rounds ``name``: a 2-D floating weight that is not a token embedding."""
    return tensor.dim() == 2 and tensor.is_floating_point() and "embed" not in name


def group_checkpoint(
    state_dict: Mapping[str, Tensor], weight_format: str, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """The checkpoint a group of ``weight_format`` loads: weight matrices fake-quantised, everything in ``dtype``.

    Args:
        state_dict: the trainer's weights (Hugging Face names), any floating dtype.
        weight_format: one of :data:`offpolicy.fleet.quant.FAKE_FORMATS` (a group's ``weight_format``).
        dtype: the engine's dtype (``torch.float32`` for vLLM on CPU).

    Returns:
        A new dict with the same keys; rounded matrices hold exactly the format's representable values (times
        their block scales), so the engine computes with the group's weight precision.
    """
    if weight_format not in FAKE_FORMATS:
        raise ValueError(f"group_checkpoint: weight_format must be one of {FAKE_FORMATS}, got {weight_format!r}")
    out = {}
    for name, t in state_dict.items():
        t = t.detach().to("cpu", torch.float32)
        out[name] = (fake_quantize(t, weight_format) if is_quantized_weight(name, t) else t).to(dtype).contiguous()
    return out
