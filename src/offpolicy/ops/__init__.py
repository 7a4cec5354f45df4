"""The two vocabulary-sized primitives (no RL here): the sparse log-softmax on logits and its fused-linear twin on
hidden states x weight, with their backends (:mod:`offpolicy.ops.backend_registry`)."""

from offpolicy.ops.linear_log_softmax import linear_sparse_log_softmax
from offpolicy.ops.sparse_log_softmax import SparseLogSoftmax, sparse_log_softmax
from offpolicy.ops.vocab_parallel import VocabShard

__all__ = ["SparseLogSoftmax", "VocabShard", "linear_sparse_log_softmax", "sparse_log_softmax"]
