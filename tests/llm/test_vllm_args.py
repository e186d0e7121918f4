"""The vLLM engine arguments both vLLM backends pass (consolidate.llm.vllm_args)."""

import pytest

from consolidate.llm.vllm_args import engine_args


def test_engine_args_are_the_settings_and_engine_kwargs():
    got = engine_args("float32", "2", 0.5, 1024.0, 0, {"max_num_seqs": 4})
    assert got == {
        "dtype": "float32",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 1024,
        "enforce_eager": False,
        "max_num_seqs": 4,
    }
    assert [type(got[k]) for k in ("tensor_parallel_size", "max_model_len")] == [int, int]
    assert engine_args("bfloat16", 1, 1.0, 2048, True, None)["gpu_memory_utilization"] == 1.0


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_memory_share_outside_zero_one_is_refused(share):
    with pytest.raises(
        ValueError, match=rf"gpu_memory_utilization must be in \(0, 1\], got {share}"
    ):
        engine_args("bfloat16", 1, share, 2048, True, None)


def test_engine_kwargs_may_not_set_a_setting_twice():
    with pytest.raises(ValueError, match="engine_kwargs repeats dtype, max_model_len: set it"):
        engine_args("bfloat16", 1, 0.3, 2048, True, {"max_model_len": 8, "dtype": "auto"})
