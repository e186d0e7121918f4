"""Text normalisation, hashing and the conflict guard.

The conflict guard is deliberately conservative: a pair of memories whose texts differ by a
negation, a changed number or a changed date is never merged without a model, because sentence
embeddings score such pairs as near-duplicates (with all-MiniLM-L6-v2, "I live in Berlin" and
"I don't live in Berlin" have cosine ~0.87, see ``../shared/DESIGN.md``).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "normalise",
    "normalise_many",
    "utf8_ok",
    "normalise_arrow",
    "text_hash",
    "text_hashes",
    "conflict_reason",
    "conflict_signature",
    "conflict_between",
    "ConflictSignature",
    "EMPTY_SIGNATURE",
    "maybe_conflicting",
    "split_facts",
    "content_tokens",
]

_WS = re.compile(r"\s+")
_EDGE_PUNCT = re.compile(r"^[\s\"'`]+|[\s.!?,;:\"'`]+$")
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|n't")


_QUOTES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"'})


def normalise(text: str) -> str:
    """Normalise text for exact-duplicate detection.

    Unicode NFKC, case-folded, curly quotes made straight, whitespace collapsed, and
    sentence punctuation (``. ! ? , ; :`` and quotes) removed from the ends. Signs, currency,
    emoji and inner punctuation are kept, so "Has 2 cats." and "has 2 cats" collide but
    "-5 degrees" and "5 degrees", or ":)" and ":(", do not.

    Args:
        text: any ``str``.

    Returns:
        The normalised ``str`` (possibly empty).
    """
    t = unicodedata.normalize("NFKC", text).casefold().translate(_QUOTES)
    t = _WS.sub(" ", t).strip()
    core = _EDGE_PUNCT.sub("", t)
    return core if core else t


def text_hash(text: str) -> str:
    """SHA-256 hex digest (64 chars) of :func:`normalise` ``(text)`` encoded as UTF-8.

    Raises:
        UnicodeEncodeError: if ``text`` holds lone surrogates (not valid UTF-8).
    """
    return hashlib.sha256(normalise(text).encode("utf-8")).hexdigest()


# the same steps as :func:`normalise` for ASCII texts, in RE2 on whole columns. Python's
# ``\s`` and ``str.strip`` treat \x1c-\x1f as whitespace, RE2's ``\s`` does not (nor \v)
_WS_ASCII = r"[\t\n\x0b\x0c\r \x1c-\x1f]+"
_EDGE_ASCII = "^[ \"'`]+|[ .!?,;:\"'`]+$"


def normalise_arrow(texts: pa.Array) -> pa.Array:
    """:func:`normalise` of every text of an Arrow string array, as column operations
    (Arrow compute, RE2) for the ASCII texts and one :func:`normalise` call per non-ASCII
    text.

    Args:
        texts: ``pa.string()`` or ``pa.large_string()`` array without nulls.

    Returns:
        An array of the same type, element ``k`` equal to ``normalise(texts[k])``.

    Raises:
        TypeError: ``texts`` holds a null (the message names its position).
    """
    if texts.null_count:
        raise TypeError(f"normalise_arrow() takes str values; position "
                        f"{int(np.flatnonzero(np.asarray(texts.is_null()))[0])} is null")
    ascii_ = pc.string_is_ascii(texts)
    t = pc.utf8_lower(texts)
    t = pc.utf8_trim(pc.replace_substring_regex(t, _WS_ASCII, " "), " ")
    core = pc.replace_substring_regex(t, _EDGE_ASCII, "")
    t = pc.if_else(pc.equal(core, ""), t, core)
    if not pc.all(ascii_).as_py():
        slow = pc.invert(ascii_)
        fixed = [normalise(x) for x in texts.filter(slow).to_pylist()]
        t = pc.replace_with_mask(t, slow, pa.array(fixed, t.type))
    return t


def normalise_many(texts: Sequence[str]) -> list[str]:
    """:func:`normalise` of every text (see :func:`normalise_arrow`).

    Args:
        texts: ``str`` values.

    Returns:
        ``list[str]``, equal to ``[normalise(t) for t in texts]``.

    Raises:
        TypeError: an element is not a ``str``.
        UnicodeEncodeError: a text holds lone surrogates (not valid UTF-8).
    """
    vals = list(texts)
    if vals and pd.api.types.infer_dtype(vals, skipna=False) != "string":
        k = next(k for k, t in enumerate(vals) if not isinstance(t, str))
        raise TypeError(f"normalise_many() takes str values; position {k} is "
                        f"{type(vals[k]).__name__}")
    return normalise_arrow(pa.array(vals, pa.string())).to_pylist()


def text_hashes(texts: Sequence[object]) -> list[str]:
    """:func:`text_hash` of every text, ``""`` for a value that is not a ``str`` or is not
    valid UTF-8 (validation reports those records); normalisation as in
    :func:`normalise_many`, then one SHA-256 per text."""
    ok = [isinstance(t, str) and utf8_ok(t) for t in texts]
    norm = iter(normalise_many([t for t, k in zip(texts, ok, strict=True) if k]))
    return [hashlib.sha256(next(norm).encode("utf-8")).hexdigest() if k else "" for k in ok]


def utf8_ok(t: str) -> bool:
    """Whether ``t`` encodes as UTF-8 (``False`` for lone surrogates)."""
    try:
        t.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def content_tokens(text: str) -> list[str]:
    """Lower-case word tokens of ``text`` (contractions split so that "don't" -> "do", "n't")."""
    t = normalise(text).replace("n't", " n't")
    return _TOKEN.findall(t)


# ---------------------------------------------------------------- conflict guard
_NEGATIONS = {
    "not", "no", "never", "n't", "cannot", "nobody", "nothing", "none", "neither", "nor",
    "nowhere", "without", "stopped", "quit", "anymore",
}
_NUMBER_WORDS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "hundred": 100,
    "thousand": 1000, "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5,
    "once": 1, "twice": 2, "dozen": 12,
}
_MONTHS = {
    "january", "february", "march", "april", "may", "june", "july", "august", "september",
    "october", "november", "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug",
    "sep", "sept", "oct", "nov", "dec",
}
_WEEKDAYS = {
    "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday",
    "yesterday", "today", "tomorrow", "tonight", "weekend",
}
_RELATIVE_TIME = {"last", "next", "ago", "later", "earlier", "previous", "upcoming"}
_NUM = re.compile(r"(?<!\w)[-+\u2212]?\d+(?:[.,:/-]\d+)*")


def _negation_count(tokens: list[str]) -> Counter:
    return Counter(t for t in tokens if t in _NEGATIONS)


def _numbers(tokens: list[str], normalised: str) -> Counter:
    vals: Counter = Counter()
    for m in _NUM.findall(normalised):
        vals[m.replace(",", "")] += 1
    for t in tokens:
        if t in _NUMBER_WORDS:
            vals[str(_NUMBER_WORDS[t])] += 1
    return vals


def _date_terms(tokens: list[str]) -> Counter:
    # "may" is a month only in front of or after a number ("8 May", "May 2023"); as a modal
    # verb it is not a date.
    out: Counter = Counter()
    for k, t in enumerate(tokens):
        if t == "may":
            nb = tokens[max(0, k - 1) : k] + tokens[k + 1 : k + 2]
            if not any(x.isdigit() for x in nb):
                continue
        if t in _MONTHS or t in _WEEKDAYS or t in _RELATIVE_TIME:
            out[t] += 1
    return out


@dataclass(frozen=True)
class ConflictSignature:
    """What the conflict guard compares: negation markers, numbers and date terms of a text
    (multisets as sorted tuples). Compute once per text with :func:`conflict_signature`."""

    negations: tuple
    numbers: tuple
    dates: tuple


def conflict_signature(text: str) -> ConflictSignature:
    """The :class:`ConflictSignature` of ``text``."""
    norm = normalise(text)
    toks = _TOKEN.findall(norm.replace("n't", " n't"))  # content_tokens, normalised once
    return ConflictSignature(
        tuple(sorted(_negation_count(toks).items())),
        tuple(sorted(_numbers(toks, norm).items())),
        tuple(sorted(_date_terms(toks).items())),
    )


#: the signature of a text with no negation, number or date term
EMPTY_SIGNATURE = ConflictSignature((), (), ())


def _prefilter_pattern() -> str:
    words = sorted((_NEGATIONS | set(_NUMBER_WORDS) | _MONTHS | _WEEKDAYS | _RELATIVE_TIME)
                   - {"n't"})
    return (r"[0-9]|[^\x00-\x7f]|n't|(^|[^a-z0-9])(" + "|".join(words) + r")([^a-z0-9]|$)")


_PREFILTER = _prefilter_pattern()


def maybe_conflicting(texts: Sequence[str]) -> np.ndarray:
    """``bool [n]``: texts whose :func:`conflict_signature` may be non-empty, found by one
    vectorised regular-expression pass (Arrow's RE2). ``False`` guarantees
    :data:`EMPTY_SIGNATURE`: the text is ASCII and has no digit, no ``n't`` and no
    negation, number, month, weekday or relative-time word between non-alphanumeric
    characters (a superset of the tokens :func:`conflict_signature` reads)."""
    if not len(texts):
        return np.zeros(0, bool)
    arr = pa.array(list(texts), pa.string())
    return pc.match_substring_regex(arr, _PREFILTER, ignore_case=True).to_numpy(
        zero_copy_only=False).astype(bool)


def conflict_between(a: ConflictSignature, b: ConflictSignature) -> str | None:
    """:func:`conflict_reason` on precomputed signatures (O(1) per pair)."""
    if a.negations != b.negations:
        return "negation"
    if a.numbers and b.numbers and a.numbers != b.numbers:
        return "number"
    if a.dates and b.dates and a.dates != b.dates:
        return "date"
    return None


def conflict_reason(a: str, b: str) -> str | None:
    """Why two texts must not be merged without a model, or ``None``.

    Rules, checked in order:

    * ``"negation"``: the multisets of negation markers differ ("lives in Berlin" vs
      "doesn't live in Berlin"; "still plays" vs "stopped playing").
    * ``"number"``: both texts state numbers (digits or number words) and the multisets differ
      ("has 2 cats" vs "has three cats"). A number present on one side only is extra detail,
      not a conflict.
    * ``"date"``: both texts state date terms (month, weekday, relative time words) and the
      multisets differ ("in May" vs "in June").

    Args:
        a, b: the two texts (``str``).

    Returns:
        One of ``"negation"``, ``"number"``, ``"date"`` or ``None``.
    """
    return conflict_between(conflict_signature(a), conflict_signature(b))


_SENT = re.compile(r"(?<=[.!?;])\s+")


def split_facts(text: str) -> list[str]:
    """Split a memory text into sentence-level facts (on ``.``, ``!``, ``?``, ``;``)."""
    return [s.strip() for s in _SENT.split(text.strip()) if s.strip()]
