"""A backend that answers from a book of responses and asks for the rest.

A fleet run with a separate LLM stage (:mod:`consolidate.fleet`, ``runner.llm=ray_data``)
runs the pass in rounds: the pass actors' merger talks to an :class:`AnswerBook`; a chat call
with any request the book lacks raises :class:`NeedAnswers` naming those requests; the driver
has the LLM stage answer every shard's requests at once, adds the answers to the book, and
runs the shards again. The pass is a pure function of its snapshot, so each round makes the
same requests up to the point where the previous one stopped: a merger that calls its backend
twice (first answers, then retries of rejected ones) needs three rounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import ChatRequest, ChatResponse
from .cache import request_key

__all__ = ["AnswerBook", "NeedAnswers"]


class NeedAnswers(Exception):
    """A chat call asked for requests the :class:`AnswerBook` has no answer to.

    Attributes:
        requests: the unanswered requests, each once, in the order first asked.
    """

    def __init__(self, requests: Sequence[ChatRequest]) -> None:
        super().__init__(f"{len(requests)} chat requests have no answer yet")
        self.requests = list(requests)

    def __reduce__(self):  # pickles (Ray sends it between processes) with its requests
        return (NeedAnswers, (self.requests,))


class AnswerBook:
    """A backend (``chat``) answering from ``answers``, keyed as the response cache keys
    them (:func:`~consolidate.llm.cache.request_key` of ``name``, ``model``,
    ``prompt_version`` and the request), so the answers of one engine serve the requests
    that engine's backend would have been sent.

    Args:
        name, model: the answering engine's backend name and model (e.g. ``vllm`` and its
            model folder).
        prompt_version: the merger's prompt version
            (:func:`~consolidate.llm.merger.merge_prompt_version`).
        answers: key -> response.

    Raises:
        NeedAnswers: from :meth:`chat`, when a request has no answer (nothing is answered).
    """

    def __init__(
        self, name: str, model: str, prompt_version: str, answers: Mapping[str, ChatResponse]
    ) -> None:
        self.name, self.model, self.prompt_version = name, model, prompt_version
        self.answers = answers

    def key(self, r: ChatRequest) -> str:
        """The key of one request."""
        return request_key(self.name, self.model, self.prompt_version, r)

    def chat(self, requests: Sequence[ChatRequest]) -> list[ChatResponse]:
        keys = [self.key(r) for r in requests]
        missing: dict[str, ChatRequest] = {}
        for k, r in zip(keys, requests, strict=True):
            if k not in self.answers:
                missing.setdefault(k, r)
        if missing:
            raise NeedAnswers(list(missing.values()))
        return [self.answers[k] for k in keys]
