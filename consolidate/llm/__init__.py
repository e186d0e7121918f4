"""LLM layer: one batch interface for every model call, backends imported only when chosen."""

from .base import ChatRequest, ChatResponse, LLMBackend, make_backend

__all__ = ["ChatRequest", "ChatResponse", "LLMBackend", "make_backend"]
