"""``openai`` backend: any OpenAI-compatible chat-completions server (``vllm serve``,
llama.cpp's server, Ollama), with bounded concurrency, timeouts and retries with
exponential backoff. Standard library only (``urllib`` + a thread pool)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from .base import ChatRequest, ChatResponse

__all__ = ["OpenAIBackend", "BackendError"]


class BackendError(RuntimeError):
    """A request failed after all retries (names the URL and the last error)."""


class OpenAIBackend:
    """Chat completions over HTTP.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000/v1``.
        model: model name sent to the server.
        api_key: bearer token (default: ``OPENAI_API_KEY`` or none).
        concurrency: requests in flight at most.
        timeout_s: per-request timeout, seconds.
        retries: attempts after the first, on timeouts, connection errors, 429 and 5xx.
        backoff_s: first retry delay, doubled each retry.
        structured: send a request's ``json_schema`` as ``response_format`` (``json_schema``
            type; ``vllm serve``, llama.cpp's server and Ollama accept it). Turn off for
            servers that reject the field.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        structured: bool = True,
        **_: object,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.concurrency = max(1, concurrency)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.structured = structured

    def _one(self, r: ChatRequest) -> ChatResponse:
        body = {
            "model": self.model,
            "messages": list(r.messages),
            "max_tokens": r.max_tokens,
            "temperature": r.temperature,
            "seed": r.seed,
        }
        if self.structured and r.json_schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "strict": True, "schema": r.json_schema},
            }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            t = time.perf_counter()
            try:
                req = urllib.request.Request(self.url, data=data, headers=headers)
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    out = json.loads(resp.read())
                usage = out.get("usage") or {}
                return ChatResponse(
                    out["choices"][0]["message"]["content"] or "",
                    int(usage.get("prompt_tokens", 0)),
                    int(usage.get("completion_tokens", 0)),
                    time.perf_counter() - t,
                    {"attempts": attempt + 1},
                )
            except urllib.error.HTTPError as e:
                last = e
                if e.code != 429 and e.code < 500:
                    break  # a client error will not get better
            except (urllib.error.URLError, TimeoutError, OSError) as e:
                last = e
            except (KeyError, IndexError, ValueError) as e:
                last = e
                break
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise BackendError(f"{self.url}: request failed after {attempt + 1} attempt(s): {last!r}")

    def chat(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        """Send every request (at most ``concurrency`` at once); order is preserved.

        Raises:
            BackendError: a request failed after its retries.
        """
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, requests))
