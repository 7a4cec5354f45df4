"""The sparse log-softmax primitive and its backends (no RL here)."""

from offpolicy.ops.linear_log_softmax import linear_sparse_log_softmax
from offpolicy.ops.sparse_log_softmax import SparseLogSoftmax, VocabShard, sparse_log_softmax

__all__ = ["SparseLogSoftmax", "VocabShard", "linear_sparse_log_softmax", "sparse_log_softmax"]
