"""The ``*_cases.py`` files hold the tests that run inside a side environment (``.venv-trainers``, ``.venv-vllm``):
``test_verl.py``, ``test_skyrl.py`` and ``test_trl_vllm.py`` run them there with that environment's pytest and set
``OFFPOLICY_SIDE_VENV=1``. The main run does not collect them, so nothing is reported as skipped twice over."""

import os

collect_ignore_glob = [] if os.environ.get("OFFPOLICY_SIDE_VENV") == "1" else ["*_cases.py"]
