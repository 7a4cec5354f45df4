"""Parallel layouts the loss accepts: packed ``THD`` batches and context-parallel index maps
(:mod:`offpolicy.parallel.packing`), vocabulary-sharded ``DTensor`` logits (:mod:`offpolicy.parallel.dtensor`)."""
