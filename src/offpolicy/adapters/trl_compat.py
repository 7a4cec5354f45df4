"""What :mod:`offpolicy.adapters.trl` needs from TRL and from TRL's colocated vLLM engine, checked at construction.

* :func:`check_trl_api`: the adapter overrides or calls private TRL methods; it runs only on the TRL releases it was
  tested with (:data:`TESTED_TRL`), and only where those methods still take the parameters it passes.
* :func:`vllm_engine_options`: TRL 1.16 builds ``vllm.LLM`` itself with no way to set ``max_logprobs`` or ``dtype``;
  this context manager wraps the constructor TRL calls, for the duration of the trainer's ``__init__``, so the
  engine is built with what the record needs, and refuses an engine the adapter cannot keep in sync.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

from packaging.version import Version

#: TRL releases the adapter was tested with: ``low <= version < high``.
TESTED_TRL = ("1.16.0", "1.17.0")
#: ``(class name, method) -> parameter names`` of each private TRL method the adapter overrides or calls.
PRIVATE_API = {
    ("GRPOTrainer", "_generate_single_turn"): ("self", "prompt_ids", "images", "multimodal_fields",
                                               "num_generations", "has_tool_images"),
    ("GRPOTrainer", "_generate_and_score_completions"): ("self", "inputs"),
    ("GRPOTrainer", "_compute_loss"): ("self", "model", "inputs"),
    ("VLLMGeneration", "generate"): ("self", "prompts", "images", "num_generations", "profiler"),
    ("VLLMGeneration", "_iter_named_params"): ("self",),
}
#: vLLM's default ``max_logprobs``: never lowered.
VLLM_DEFAULT_MAX_LOGPROBS = 20


def check_trl_api(version: str, classes: dict[str, type]) -> None:
    """Raise unless ``version`` is in :data:`TESTED_TRL` and every method of :data:`PRIVATE_API` exists on
    ``classes[name]`` with the listed parameters.

    Raises:
        RuntimeError: naming the installed version or the changed method, and the TRL release to install.
    """
    low, high = TESTED_TRL
    fix = f"install a tested release: pip install 'trl>={low},<{high}'"
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(f"offpolicy.adapters.trl overrides private GRPOTrainer methods and was tested with "
                           f"trl>={low},<{high}; the installed trl is {version}: {fix}")
    for (cls_name, method), want in PRIVATE_API.items():
        fn = getattr(classes[cls_name], method, None)
        have = None if fn is None else tuple(inspect.signature(fn).parameters)
        if have != want:
            raise RuntimeError(f"offpolicy.adapters.trl relies on trl's private {cls_name}.{method}{want}; the "
                               f"installed trl {version} has {'no such method' if have is None else have}: {fix}")


def engine_dtype(args: Any, model_dtype: str) -> str:
    """The dtype the colocated engine computes in: the trainer's compute dtype (``bfloat16`` under ``bf16=True``,
    ``float16`` under ``fp16=True``, else the model's parameter dtype), so that sampler and trainer agree."""
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    return model_dtype


@contextlib.contextmanager
def vllm_engine_options(module: Any, options: Callable[[], dict[str, Any]]) -> Iterator[None]:
    """While open, ``module.LLM(...)`` (TRL's ``trl.generation.vllm_generation.LLM``) is built with ``options()``
    added to TRL's keyword arguments; nothing changes where ``module`` has no ``LLM`` (vLLM not installed).

    ``options`` is called when TRL builds the engine (after the trainer's model and args exist); it may raise to
    refuse the engine.

    Raises:
        RuntimeError: TRL already passes one of the options with another value.
    """
    original = getattr(module, "LLM", None)
    if original is None:
        yield
        return

    def build(*args: Any, **kwargs: Any) -> Any:
        for name, value in options().items():
            if name in kwargs and kwargs[name] != value:
                raise RuntimeError(f"TRL builds vllm.LLM with {name}={kwargs[name]!r}; offpolicy needs {value!r}")
            kwargs[name] = value
        return original(*args, **kwargs)

    module.LLM = build
    try:
        yield
    finally:
        module.LLM = original


__all__ = ["PRIVATE_API", "TESTED_TRL", "check_trl_api", "engine_dtype", "vllm_engine_options"]
