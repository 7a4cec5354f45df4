"""The Triton kernels for vocabulary-sized work (they know nothing of RL) and the C source of the CPU loops.

Their files live in the checkout's top-level ``kernels/`` folder, which is deliberately not a package (it has no
``__init__.py``): with the checkout's root on ``sys.path`` (``python -m`` or ``python -c`` run from it) a top-level
``import kernels`` then finds it only as a namespace portion, which never wins over a regular package of that name
anywhere on ``sys.path`` (the Hugging Face ``kernels`` that transformers imports), and where there is none,
transformers reads a namespace ``kernels`` as absent. (Only a working directory inside the package's own source,
``src/offpolicy/``, puts this package's folder on ``sys.path`` as a top-level ``kernels``, as it does every other
subpackage of offpolicy under its own name: Python does not support running from inside a package.) This package
is how the library reaches the folder:

- from a wheel (``pip install .``), setup.py has installed the folder's files here, beside this file;
- from a checkout (an editable install, or ``src`` on ``sys.path``), ``__path__`` is extended to the folder, so
  ``offpolicy.kernels.logsoftmax`` is ``kernels/logsoftmax.py``.

:func:`source` finds a non-Python file of the folder (the C source) in either case; ``importlib.resources`` reads
only this package's own folder, which holds the files in a wheel but not in a checkout.
"""

from pathlib import Path

# src/offpolicy/kernels/__init__.py -> the checkout's root -> its kernels/ folder
_CHECKOUT_KERNELS = Path(__file__).resolve().parents[3] / "kernels"

if not (Path(__file__).parent / "logsoftmax.py").is_file() and (_CHECKOUT_KERNELS / "logsoftmax.py").is_file():
    __path__.append(str(_CHECKOUT_KERNELS))  # noqa: F821 (a package's __path__ is set before its code runs)


def source(name: str) -> Path:
    """The path of the kernel folder's file ``name`` (e.g. ``"vocab_pass_cpu.c"``), installed or in a checkout.

    Raises FileNotFoundError naming the folders searched when no folder of this package holds it.
    """
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise ValueError(f"name: expected a file name in the kernel folder, got {name!r}")
    for folder in __path__:  # noqa: F821
        candidate = Path(folder) / name
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"name: no {name!r} in offpolicy's kernel folders {list(__path__)}")  # noqa: F821
