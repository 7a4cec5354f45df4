"""The demonstration: a mixed-fleet asynchronous RL run at toy scale, on CPU (``offpolicy demo``).

A tiny causal transformer learns to sort numbers (binary exact-answer reward) with GRPO-style RL. Its samples come
from a simulated fleet of sampler groups, each serving a stale copy of the trainer's weights in its own numerics
(NVFP4 / FP8 / BF16 weights, an FP8 KV path, another attention kernel), routed by capacity; the fp32 trainer applies
:func:`offpolicy.policy_loss` with each of the seed's corrections. See ``docs/demo.md``.

Modules: :mod:`~offpolicy.demo.task` (the task and its reward), :mod:`~offpolicy.demo.model` (the transformer),
:mod:`~offpolicy.demo.warmup` (cached supervised start), :mod:`~offpolicy.demo.simulated_fleet` (the simulated fleet),
:mod:`~offpolicy.demo.rollout` (reference-sampler calls), :mod:`~offpolicy.demo.arms` (the six arms),
:mod:`~offpolicy.demo.train` (one run), :mod:`~offpolicy.demo.report` (tables, files, plots),
:mod:`~offpolicy.demo.cli` (the command line).
"""
