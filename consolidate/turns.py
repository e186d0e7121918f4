"""A conversation turn: what the write path reads and the LOCOMO reader produces (a data
type of its own, so that storage and the model layer both use it without importing each
other)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SOURCES", "TRUSTED_SOURCES", "Turn"]

#: turn sources whose content is the user's or the assistant's own words
TRUSTED_SOURCES = ("user", "assistant")
#: every turn source; each write names one (there is no default to trust by accident)
SOURCES = ("user", "assistant", "tool", "web")


@dataclass(frozen=True)
class Turn:
    """One turn: ``source`` is ``user``, ``assistant``, ``tool`` or ``web`` (required: only
    user and assistant text becomes memories unless ``allow_untrusted``); ``time_h`` in hours
    since the epoch.

    Raises:
        ValueError: ``source`` is not one of :data:`SOURCES`.
    """

    id: str
    namespace: str
    speaker: str
    text: str
    time_h: float
    source: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(
                f"turn {self.id!r}: source must be one of {', '.join(SOURCES)} "
                f"(who wrote the text decides whether it may become a memory), "
                f"got {self.source!r}"
            )
