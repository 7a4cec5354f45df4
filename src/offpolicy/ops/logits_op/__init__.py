"""The logits op: :func:`sparse_log_softmax` of ``logits [N, V]`` at each row's sampled token and candidates.

Public function (:mod:`.sparse_log_softmax`), autograd function (:mod:`.logits_function`), float64 reference
(:mod:`.logits_naive`) and backends: ``torch`` (:mod:`.torch_backend`), ``cpu`` (:mod:`.cpu_backend`, the C loops of
``kernels/vocab_pass_cpu.c``) and ``triton`` (:mod:`.triton_backend`, the kernels of ``kernels/logsoftmax.py``).
"""

from offpolicy.ops.logits_op.sparse_log_softmax import SparseLogSoftmax, sparse_log_softmax

__all__ = ["SparseLogSoftmax", "sparse_log_softmax"]
