"""``RayDataVLLM``: chat requests answered by Ray Data's vLLM processor (``ray.data.llm``).

A fleet run (``runner=ray runner.llm=ray_data``) gathers the merge requests of every shard
and sends them here in one Ray Data dataset, so vLLM batches prompts from many shards on the
cluster's engines (``concurrency`` of them, each on ``gpus_per_engine`` GPUs, or on one CPU
bundle with vLLM's CPU build) instead of each pass actor holding an engine of its own.

It is a backend like :class:`~consolidate.llm.vllm_backend.VLLMBackend` and keys its answers
alike (name ``vllm``, the model folder), so the response cache is shared: a single-process
run with ``merge=vllm`` after a fleet run finds every answer cached, and the other way round.

Each :meth:`RayDataVLLM.chat` call runs one dataset through a processor built for it, so
every call starts its engines (tens of seconds with a small model on the CPU; a fleet run
makes at most two calls). Needs ``ray[data]`` and vLLM in the same environment (on the CPU:
``.venv-vllm`` from ``scripts/setup_vllm.sh``, which installs both).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from .base import ChatRequest, ChatResponse

__all__ = ["RayDataVLLM"]

log = logging.getLogger("consolidate")


class RayDataVLLM:
    """Batched chat completions through ``ray.data.llm``'s vLLM engine processor on the
    running Ray cluster (``ray.init`` first).

    Args:
        model_path, cache_dir, dtype, tensor_parallel_size, gpu_memory_utilization,
            max_model_len, enforce_eager, engine_kwargs: as for
            :class:`~consolidate.llm.vllm_backend.VLLMBackend` (the ``merge=vllm``
            settings); the model folder is resolved the same way.
        concurrency: engines (Ray actors) answering in parallel (>= 1).
        batch_size: requests per Ray Data batch sent to an engine (>= 1).
        gpus_per_engine: 0 runs each engine on one CPU (vLLM's CPU build); > 0 gives each
            engine ``tensor_parallel_size`` GPUs.

    Raises:
        ValueError: ``concurrency``, ``batch_size`` < 1 or ``gpu_memory_utilization``
            outside (0, 1].
        FileNotFoundError: ``model_path`` does not exist.
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
        concurrency: int = 1,
        batch_size: int = 16,
        gpus_per_engine: float = 0.0,
    ) -> None:
        from .transformers_backend import resolve_model_path
        from .vllm_args import engine_args

        for key, v in (("concurrency", concurrency), ("batch_size", batch_size)):
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"runner.llm_{key} must be an integer >= 1, got {v!r}")
        self.engine_kwargs = engine_args(
            dtype,
            tensor_parallel_size,
            gpu_memory_utilization,
            max_model_len,
            enforce_eager,
            engine_kwargs,
        )
        self.model = str(resolve_model_path(model_path, cache_dir))
        self.concurrency, self.batch_size = concurrency, batch_size
        self.gpus_per_engine = float(gpus_per_engine)
        self.calls = 0
        self.seconds = 0.0

    def _processor(self) -> Any:
        from ray.data.llm import build_processor, vLLMEngineProcessorConfig

        kw: dict[str, Any] = {}
        engine = dict(self.engine_kwargs)
        if self.gpus_per_engine <= 0:
            # vLLM's CPU build: one CPU bundle per engine, workers as processes (Ray's
            # executor backend would ask for GPU bundles)
            engine.setdefault("distributed_executor_backend", "mp")
            kw.update(accelerator_type=None, placement_group_config={"bundles": [{"CPU": 1}]})
        cfg = vLLMEngineProcessorConfig(
            model_source=self.model,
            engine_kwargs=engine,
            concurrency=self.concurrency,
            batch_size=self.batch_size,
            log_engine_metrics=False,
            **kw,
        )

        def pre(row: dict[str, Any]) -> dict[str, Any]:
            sp = json.loads(row["sampling"])
            schema = sp.pop("json_schema", None)
            if schema is not None:
                sp["structured_outputs"] = {"json": schema}
            return {"i": row["i"], "messages": json.loads(row["messages"]), "sampling_params": sp}

        def post(row: dict[str, Any]) -> dict[str, Any]:
            return {
                "i": row["i"],
                "text": row["generated_text"],
                "prompt_tokens": int(row["num_input_tokens"]),
                "completion_tokens": int(row["num_generated_tokens"]),
                "latency_s": float(row.get("time_taken_llm") or 0.0),
            }

        return build_processor(cfg, preprocess=pre, postprocess=post)

    def chat(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        """Answer every request in one Ray Data run; order is preserved.

        ``latency_s`` is the engine's time for that request (requests overlap in continuous
        batching); ``extra`` holds the run's wall time (engine start included) and size.

        Raises:
            RuntimeError: the run returned a different set of rows than it was given.
        """
        if not requests:
            return []
        import ray

        # the schema travels as a JSON string: rows of differing schemas share one column
        rows = [
            {
                "i": k,
                "messages": json.dumps(list(r.messages)),
                "sampling": json.dumps(
                    {
                        "temperature": r.temperature,
                        "max_tokens": r.max_tokens,
                        "seed": r.seed,
                        "json_schema": None if r.json_schema is None else json.dumps(r.json_schema),
                    }
                ),
            }
            for k, r in enumerate(requests)
        ]
        t = time.perf_counter()
        out = self._processor()(ray.data.from_items(rows)).take_all()
        wall = time.perf_counter() - t
        self.calls += 1
        self.seconds += wall
        got = {int(o["i"]): o for o in out}
        if sorted(got) != list(range(len(requests))) or len(out) != len(requests):
            raise RuntimeError(
                f"ray.data.llm returned {len(out)} rows for {len(requests)} requests"
            )
        log.info("ray.data.llm answered %d requests in %.1f s", len(requests), wall)
        return [
            ChatResponse(
                str(got[k]["text"]).strip(),
                got[k]["prompt_tokens"],
                got[k]["completion_tokens"],
                got[k]["latency_s"],
                {"batch_s": wall, "batch_size": len(requests)},
            )
            for k in range(len(requests))
        ]
