"""The vLLM engine arguments that both vLLM backends pass: the in-process engine
(:mod:`~consolidate.llm.vllm_backend`) and Ray Data's engine processor
(:mod:`~consolidate.llm.ray_data_backend`). Imports nothing of vLLM."""

from __future__ import annotations

from typing import Any

__all__ = ["engine_args"]


def engine_args(
    dtype: str,
    tensor_parallel_size: int,
    gpu_memory_utilization: float,
    max_model_len: int,
    enforce_eager: bool,
    engine_kwargs: dict | None,
) -> dict[str, Any]:
    """The keyword arguments of vLLM's engine (``vllm.LLM`` or ``engine_kwargs`` of a Ray
    Data processor): the backend's settings, then ``engine_kwargs`` (any other engine
    argument).

    Args:
        dtype: engine dtype (``bfloat16``, ``float16``, ``float32``, ``auto``).
        tensor_parallel_size: GPUs per engine.
        gpu_memory_utilization: share of device memory (on CPU: of the NUMA node's memory)
            for weights and KV cache, in (0, 1].
        max_model_len: longest prompt + answer in tokens.
        enforce_eager: no CUDA graphs (faster start, what the CPU build needs).
        engine_kwargs: other engine arguments, or ``None``.

    Raises:
        ValueError: ``gpu_memory_utilization`` outside (0, 1], or ``engine_kwargs``
            repeats one of the settings above (it would be set twice).
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    out: dict[str, Any] = dict(
        dtype=dtype,
        tensor_parallel_size=int(tensor_parallel_size),
        gpu_memory_utilization=float(gpu_memory_utilization),
        max_model_len=int(max_model_len),
        enforce_eager=bool(enforce_eager),
    )
    twice = sorted(set(out) & set(engine_kwargs or {}))
    if twice:
        raise ValueError(
            f"engine_kwargs repeats {', '.join(twice)}: set it with the backend's own key "
            "instead (e.g. merge.dtype), once"
        )
    return {**out, **dict(engine_kwargs or {})}
