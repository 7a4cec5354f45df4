"""The sparse log-softmax primitive and its backends (no RL here)."""

from offpolicy.ops.sparse_log_softmax import SparseLogSoftmax, VocabShard, sparse_log_softmax

__all__ = ["SparseLogSoftmax", "VocabShard", "sparse_log_softmax"]
