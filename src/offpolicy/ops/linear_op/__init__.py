"""The fused-linear op: :func:`linear_sparse_log_softmax`, the logits op on ``hidden [N, D] x weight [V, D]``
without the ``[N, V]`` logits.

Public function (:mod:`.linear_log_softmax`), autograd function (:mod:`.linear_function`), float64 reference
(:mod:`.linear_naive`) and backends: ``torch`` (:mod:`.linear_torch_backend`, also the ``cpu`` backend's) and
``triton`` (:mod:`.linear_triton_backend`, the kernels of ``kernels/linear_logsoftmax.py``).
"""

from offpolicy.ops.linear_op.linear_log_softmax import linear_sparse_log_softmax

__all__ = ["linear_sparse_log_softmax"]
