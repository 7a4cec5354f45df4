"""The two vocabulary-sized primitives (no RL here), one folder each: the sparse log-softmax on logits
(:mod:`offpolicy.ops.logits_op`) and its fused-linear twin on hidden states x weight
(:mod:`offpolicy.ops.linear_op`). Shared here: the backend registry (:mod:`offpolicy.ops.backend_registry`), the
boundary checks (:mod:`offpolicy.ops.input_checks`), the custom ops for ``torch.compile``
(:mod:`offpolicy.ops.library`), the online-softmax algebra, vocabulary parallelism, the CPU row threads and
gradient workspace, and the native library's loader (:mod:`offpolicy.ops.cpu_native`)."""

from offpolicy.ops.linear_op import linear_sparse_log_softmax
from offpolicy.ops.logits_op import SparseLogSoftmax, sparse_log_softmax
from offpolicy.ops.vocab_parallel import VocabShard

__all__ = ["SparseLogSoftmax", "VocabShard", "linear_sparse_log_softmax", "sparse_log_softmax"]
