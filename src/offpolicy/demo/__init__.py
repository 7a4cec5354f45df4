"""The demonstration: mixed-fleet RL at toy scale, on CPU (``offpolicy demo``).

A tiny causal transformer learns to sort 12 numbers (vocabulary of 256 with a never-correct tail, binary
exact-answer reward) with GRPO-style RL. Its samples come from a simulated fleet of sampler groups, each serving
the trainer's weights in its own numerics (NVFP4 / FP8 / BF16 weights, an FP8 KV path, another attention kernel),
routed by capacity; the fp32 trainer applies :func:`offpolicy.policy_loss` with each of the corrections of the
mixed-fleet study (docs/spec.md#sources). See ``docs/demo.md``.

Modules: :mod:`~offpolicy.demo.task` (the task and its reward), :mod:`~offpolicy.demo.model` (the transformer),
:mod:`~offpolicy.demo.warmup` (cached supervised start), :mod:`~offpolicy.demo.simulated_fleet` (the fleets),
:mod:`~offpolicy.demo.rollout` (reference-sampler calls), :mod:`~offpolicy.demo.arms` (the arms),
:mod:`~offpolicy.demo.mismatch` (calibration: numerics KL, step KL), :mod:`~offpolicy.demo.probe` (the drift
probe), :mod:`~offpolicy.demo.train` (one run), :mod:`~offpolicy.demo.report` (tables, files, figures),
:mod:`~offpolicy.demo.cli` (the command line).
"""
