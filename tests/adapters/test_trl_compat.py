"""offpolicy.adapters.trl_compat: the TRL version / private-API check and the scoped vLLM engine options (the
engine itself is built in tests/adapters/test_trl_vllm_cases.py)."""

import os
import types

import pytest

if os.environ.get("OFFPOLICY_SKIP_TRAINER_TESTS") == "1":
    pytest.skip("OFFPOLICY_SKIP_TRAINER_TESTS=1: trainer-adapter tests opted out", allow_module_level=True)

import trl  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

from offpolicy.adapters.trl_compat import check_trl_api, engine_dtype, vllm_engine_options  # noqa: E402

CLASSES = {"GRPOTrainer": GRPOTrainer, "VLLMGeneration": VLLMGeneration}


def test_installed_trl_passes():
    check_trl_api(trl.__version__, CLASSES)


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "2.0.0.dev0"])
def test_untested_trl_version_raises_with_the_install_line(version):
    with pytest.raises(RuntimeError, match=rf"installed trl is {version}.*pip install 'trl>=1.16.0,<1.17.0'"):
        check_trl_api(version, CLASSES)


def test_changed_private_method_raises_naming_it():
    class Changed(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, num_generations):  # TRL main's shape differs
            raise AssertionError

    with pytest.raises(RuntimeError, match=r"GRPOTrainer\._generate_single_turn.*has \('self', 'prompt_ids', "
                                           r"'images', 'num_generations'\)"):
        check_trl_api(trl.__version__, {**CLASSES, "GRPOTrainer": Changed})
    with pytest.raises(RuntimeError, match=r"VLLMGeneration\.generate.*no such method"):
        check_trl_api(trl.__version__, {**CLASSES, "VLLMGeneration": object})


def test_engine_options_scoped_and_conflicts_refused():
    calls = []
    module = types.SimpleNamespace(LLM=lambda **kw: calls.append(kw))
    original = module.LLM
    with vllm_engine_options(module, lambda: {"max_logprobs": 64, "dtype": "float32"}):
        module.LLM(model="m", seed=0)
        with pytest.raises(RuntimeError, match="dtype='bfloat16'; offpolicy needs 'float32'"):
            module.LLM(model="m", dtype="bfloat16")
    assert module.LLM is original
    assert calls == [{"model": "m", "seed": 0, "max_logprobs": 64, "dtype": "float32"}]
    with vllm_engine_options(types.SimpleNamespace(), dict):  # no vLLM: nothing to wrap
        pass


def test_engine_dtype_is_the_trainers_compute_dtype():
    assert engine_dtype(types.SimpleNamespace(bf16=True, fp16=False), "float32") == "bfloat16"
    assert engine_dtype(types.SimpleNamespace(bf16=False, fp16=True), "float32") == "float16"
    assert engine_dtype(types.SimpleNamespace(bf16=False, fp16=False), "float32") == "float32"
