"""Triton kernels for vocabulary-sized work. They know nothing of RL.

This folder installs as ``offpolicy.kernels``. With an offpolicy checkout's root on ``sys.path`` (``python -m`` run
from that root puts it there) it is also found as a top-level ``kernels`` and shadows the Hugging Face package of
that name, which transformers imports where it is installed; it then warns, naming the fix. (transformers also
probes a top-level ``kernels`` by importing it where the Hugging Face package is absent, so it must not raise.)
"""

if __name__ == "kernels":
    import importlib.metadata
    import warnings

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        warnings.warn(
            f"{__file__} (offpolicy's kernel folder, installed as offpolicy.kernels) was found as the top-level "
            "package 'kernels' because the offpolicy checkout's root is on sys.path, and it shadows the installed "
            "Hugging Face 'kernels' package that transformers imports. Run from another folder, or with python -P "
            "(Python >= 3.11).",
            stacklevel=2,
        )
