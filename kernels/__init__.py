"""Triton kernels for vocabulary-sized work. They know nothing of RL."""
