"""Fact extraction from one conversation turn (the write path's first model call).

The model returns short self-contained facts, each with importance 1-10 (stored as 0..1)
and, where the turn states it, when the fact became true. Turns from tool output or web text
are not sent unless allowed (a defence against poisoned memories); every fact records the
turn it came from. An unparseable answer is retried once by the caller; after that the turn
is skipped and logged, never guessed.
"""

from __future__ import annotations

import functools
import re
import unicodedata

from pydantic import BaseModel, Field

from ..lexicon import DAY_WORDS, MODALS, MONTHS, PLAIN_CAPITALISED
from ..text import _SUFFIXES, _common, _numbers, content_tokens
from ..turns import SOURCES, TRUSTED_SOURCES, Turn
from .base import ChatRequest, parse_json_model, quote

__all__ = [
    "EXTRACT_PROMPT_VERSION",
    "SOURCES",
    "TRUSTED_SOURCES",
    "Turn",
    "ExtractedFact",
    "ExtractOut",
    "trusted",
    "extract_request",
    "parse_facts",
    "ungrounded",
]

EXTRACT_PROMPT_VERSION = "extract-v2"


class ExtractedFact(BaseModel):
    """One fact the extraction model returns: its text (not blank), importance 1-10 as rated
    at write time, and the time it became true if the turn says (ISO date, else none)."""

    text: str = Field(min_length=1, pattern=r"\S")  # not whitespace only
    importance: int = Field(ge=1, le=10)
    valid_from: str | None = None


class ExtractOut(BaseModel):
    """The extract answer's schema."""

    facts: list[ExtractedFact]


def trusted(turn: Turn, allow_untrusted: bool = False) -> bool:
    """May this turn's content become memories? Tool and web text only when allowed."""
    return allow_untrusted or turn.source in TRUSTED_SOURCES


_SYSTEM = (
    "Extract short, self-contained facts about the speaker from one message. Name the "
    "speaker in each fact. Rate each fact's importance from 1 (trivial) to 10 (life "
    "event). If the message says when a fact became true, give it as valid_from. "
    'Reply with JSON only: {"facts": [{"text": "...", "importance": 5, '
    '"valid_from": null}]}. No facts: {"facts": []}'
)


def extract_request(
    turn: Turn, when: str, max_tokens: int = 192, retry: bool = False
) -> ChatRequest:
    """The chat request for one turn (``when``: the turn's date, for relative times)."""
    user = f"Date: {when}\nSpeaker: {quote(turn.speaker)}\nMessage: {quote(turn.text)}\n\nJSON:"
    if retry:
        user += "\n(Your previous answer was not valid JSON in the required form.)"
    return ChatRequest(
        ({"role": "system", "content": _SYSTEM}, *_EXAMPLE, {"role": "user", "content": user}),
        max_tokens=max_tokens,
        temperature=0.7 if retry else 0.0,
        seed=1 if retry else 0,
        json_schema=ExtractOut.model_json_schema(),
    )


#: one worked example (helps small models keep to the format)
_EXAMPLE = (
    {
        "role": "user",
        "content": 'Date: 3 March 2023\nSpeaker: "Anna"\nMessage: "I just got '
        'back from Kyoto! My sister Mia lives there now."\n\nJSON:',
    },
    {
        "role": "assistant",
        "content": '{"facts": [{"text": "Anna visited Kyoto", '
        '"importance": 5, "valid_from": "2023-03"}, {"text": '
        '"Anna\'s sister Mia lives in Kyoto", "importance": 7, '
        '"valid_from": null}]}',
    },
)


def parse_facts(raw: str) -> list[ExtractedFact] | None:
    """Facts from a model answer; ``None`` if it is not valid :class:`ExtractOut` JSON.
    Facts are stripped and de-duplicated (case-insensitive), order kept."""
    out = parse_json_model(raw, ExtractOut)
    if out is None:
        return None
    seen: set[str] = set()
    facts = []
    for f in out.facts:
        t = f.text.strip()
        if t and t.lower() not in seen:
            seen.add(t.lower())
            facts.append(f.model_copy(update={"text": t}))
    return facts


_WORD = re.compile(r"[^\W_]+")  # runs of letters or digits (apostrophes, hyphens split)


def _fold(word: str) -> str:
    """Case-folded, accents removed ("José" -> "jose")."""
    return "".join(
        c for c in unicodedata.normalize("NFKD", word.casefold()) if not unicodedata.combining(c)
    )


def _plain_number(n: str) -> str:
    """A number as :func:`~consolidate.text._numbers` gives it, without its sign and, when
    all digits, without leading zeros ("03" -> "3", "-5" -> "5", "3:00" -> "3:00")."""
    body = n.lstrip("+-\u2212")
    return body.lstrip("0") or "0" if body.isdigit() else body


def _number_forms(n: str) -> set[str]:
    """:func:`_plain_number` of ``n`` and of its parts ("2019-2021" -> {"2019-2021",
    "2019", "2021"}; "3:00" -> {"3:00", "3", "0"})."""
    body = _plain_number(n)
    return {body} | {_plain_number(p) for p in re.split(r"[.,:/-]", body) if p}


@functools.lru_cache(maxsize=1)
def _web2() -> tuple[frozenset[str], frozenset[str]]:
    """``(common, proper)``: the entries of Webster's Second International dictionary
    (``web2``, via the ``english-words`` package) written in lower case ("kestrel",
    "dislike", "tom") and those written capitalised, its proper nouns ("Tom", "Paris")."""
    from english_words import get_english_words_set

    words = get_english_words_set(["web2"], lower=False)
    return (
        frozenset(w for w in words if w.islower()),
        frozenset(w for w in words if w[:1].isupper()),
    )


#: inflections stripped to find a sentence-initial word in the dictionary: the conflict
#: guard's, and "-ied"/"-ily" -> "-y" ("studied", "happily"); "-d" ("moved")
_INFLECTIONS = (*_SUFFIXES, ("ied", "y"), ("ily", "y"), ("d", ""))


def _is_common_word(w: str) -> bool:
    """A capitalised word at the start of a sentence is an ordinary word, not a name: a
    modal, or an English word in one of its inflected forms (:data:`_INFLECTIONS`) that the
    dictionary does not also list as a proper noun ("Dislikes", "Commutes", "Honestly" are
    words; "Mia", "Tom", "Paris" are names)."""
    common, proper = _web2()
    lw = w.casefold()
    if lw in MODALS:
        return True
    return w not in proper and _common(lw, common, _INFLECTIONS, min_stem=2)  # "has", "goes"


_SENTENCE_END = tuple(".!?:;\"'\u201c\u2018(")


def ungrounded(fact: str, turn: Turn, when: str = "") -> list[str]:
    """What an extracted fact states that its turn does not: each number (digits or number
    words) and each name (a capitalised word that is not a pronoun, article or date word;
    at the start of a sentence, a capitalised word is a name only when it is no English
    word in any inflected form, :func:`_is_common_word`, so the subject-less "Dislikes
    spicy noodle soup" or "Lives in Porto" adds no name while "Mia lives in Porto" adds
    "Mia") found neither in the turn's text, nor in its speaker's name, nor in ``when``
    (the turn's date as the extract prompt showed it).
    Words compare case- and accent-insensitively, split at apostrophes and hyphens
    ("Mia's" is grounded by "Mia", "Jose" by "José", "Brien" by "O'Brien"); numbers
    compare without leading zeros, and a range or time by its parts ("2019-2021" by
    "2019 to 2021").

    Returns:
        ``["number 3", "name Mia", ...]``, sorted; empty when every specific is grounded.
    """
    have: set[str] = set()
    nums: set[str] = set()
    for src in (turn.text, turn.speaker, when):
        for w in _WORD.findall(src):
            have |= {w.casefold(), _fold(w)}
        for n in _numbers(content_tokens(src), src):
            nums |= _number_forms(n)
    out = []
    for n in _numbers(content_tokens(fact), fact):
        whole, forms = _plain_number(n), _number_forms(n)
        if whole not in nums and not (len(forms) > 1 and forms - {whole} <= nums):
            out.append(f"number {n}")
    for m in _WORD.finditer(fact):
        w = m.group()
        if not w[0].isupper():
            continue
        lw = w.casefold()
        if (
            lw in have
            or _fold(w) in have
            or lw in PLAIN_CAPITALISED
            or lw in MONTHS
            or lw in DAY_WORDS
        ):
            continue
        before = fact[: m.start()].rstrip()
        if (not before or before.endswith(_SENTENCE_END)) and _is_common_word(w):
            continue  # a sentence-initial English word, not a name
        out.append(f"name {w}")
    return sorted(set(out))
