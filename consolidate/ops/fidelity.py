"""The fidelity checker: does a member's content survive in a merged text?

One rule, used by the pass on every merge (extractive or model-written), by the extractive
merger to decide which clauses are said twice, and by the evaluation's faithful recall.

A text is split into **clauses** (:func:`~consolidate.text.split_facts`: sentences and
``;``-separated parts). A clause's **terms** are its content words (lower case, the
stop-words of :data:`~consolidate.lexicon.CONTENT_STOP_WORDS` removed, stemmed by Porter's algorithm (M. F. Porter,
"An algorithm for suffix stripping", Program 14(3), 1980; the Snowball implementation in
PyStemmer), so "plays"/"playing" and "service"/"services" are one term); its **hard items** are the numbers (digits or number
words, which are not terms), date terms and names of :class:`~consolidate.ops.merge.Facts`,
which sentence embeddings do not tell apart.

A member clause ``c`` **survives** in a merged text ``M`` when all of:

1. every hard item of ``c`` is in ``M`` (a number or date term among ``M``'s, a name among
   ``M``'s words, possessives folded: "Nate's" holds "Nate");
2. its term coverage, ``|terms(c) & terms(M_k)| / |terms(c)|``, reaches ``threshold``
   (default :data:`DEFAULT_THRESHOLD`) for the clause ``M_k`` of ``M`` that covers it best;
   a clause with no term (``"It was so."``) is covered by any text;
3. polarity: if exactly one of ``c`` and that best clause is negated
   (:attr:`~consolidate.ops.merge.Facts.negated`), the words that negation denies
   (:attr:`~consolidate.ops.merge.Facts.negated_scope`, stemmed) share no term with the other
   clause: "likes fish" does not survive in "does not like fish", while "adopted 2 cats"
   survives in "adopted 2 cats and does not eat fish".

A member survives when every one of its clauses survives. The default threshold, 1.0, is
strict containment of terms: a merge may drop a clause only when another clause says at
least the same words. It was chosen on the hand-labelled merge cases in
``eval/fidelity/cases.jsonl`` (member text, merged text, kept/lost), where it agrees with the
labels at the rate recorded in ``eval/fidelity/report.md`` (the test
``tests/ops/test_fidelity.py`` recomputes it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import FrozenInstanceError

from ..lexicon import CONTENT_STOP_WORDS, NUMBER_WORDS
from ..text import content_tokens, split_facts
from .merge import _name_key, facts_from_tokens

__all__ = [
    "DEFAULT_THRESHOLD",
    "Clause",
    "clauses_of",
    "clause_covers",
    "coverage",
    "polarity_ok",
    "survives",
    "lost_clauses",
    "lost_members",
]

#: term coverage a clause needs in one merged clause to survive (1.0: every term)
DEFAULT_THRESHOLD = 1.0


@functools.cache
def _porter():  # noqa: ANN202 - PyStemmer's Stemmer
    import Stemmer  # PyStemmer: Snowball's C implementation, imported in a millisecond

    return Stemmer.Stemmer("porter")


@functools.lru_cache(maxsize=1 << 17)
def _stem(word: str) -> str:
    return str(_porter().stemWord(word))


def _is_number(t: str) -> bool:
    return t[:1].isdigit() or t in NUMBER_WORDS


_set = object.__setattr__  # how a (frozen) Clause sets its own slots


class Clause:
    """One clause of a text.

    Attributes:
        text: the clause as written (stripped).
        terms: its stemmed content words.
        items: its hard items (``("number", "2")``, ``("date", "may")``, ``("name", x)``).
        names: its names as written (looked up among a text's words).
        negated: whether it has a negation marker.
        scope: the stemmed content words its first negation denies (empty if none).
        words: its lower-case words, possessives also without ``'s`` (where names are
            looked up: :attr:`~consolidate.ops.merge.Facts.words`).
        key: the string its analysis was read from (:func:`_clause_key` of ``text``; two
            clauses with one key have one analysis); ``""`` for a clause built by hand.
            Not compared.

    A clause of :func:`clauses_of` reads its terms at once and the rest of its analysis
    (:class:`~consolidate.ops.merge.Facts`) the first time one of ``items``, ``names``,
    ``negated``, ``scope`` or ``words`` is asked for; ``names`` of a key whose cased
    letters are all lower case (``str.islower``) is empty without it. Most clauses of an
    extractive merge are only ever compared by their terms and key. Two clauses of one
    class are equal when all attributes but ``key`` are. A clause is hashable and frozen
    (setting an attribute raises :class:`dataclasses.FrozenInstanceError`: clauses are
    cached and shared), and pickles with every protocol (its analysis read first).
    """

    __slots__ = ("text", "terms", "key", "_rest", "__weakref__")
    __match_args__ = ("text", "terms", "items", "names", "negated", "scope", "words", "key")
    text: str
    terms: frozenset
    key: str
    _rest: tuple[frozenset, frozenset, bool, frozenset, frozenset] | None

    def __init__(
        self,
        text: str,
        terms: frozenset,
        items: frozenset,
        names: frozenset,
        negated: bool,
        scope: frozenset = frozenset(),
        words: frozenset = frozenset(),
        key: str = "",
    ) -> None:
        _set(self, "text", text)
        _set(self, "terms", terms)
        _set(self, "key", key)
        _set(self, "_rest", (items, names, negated, scope, words))

    @classmethod
    def _of_key(cls, text: str, key: str) -> Clause:
        """The clause ``text`` with analysis key ``key``: terms now, the rest when asked."""
        c = cls.__new__(cls)
        _set(c, "text", text)
        _set(c, "terms", _terms(key))
        _set(c, "key", key)
        _set(c, "_rest", None)
        return c

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.text, self.terms, *self._facts(), self.key))

    def _facts(self) -> tuple[frozenset, frozenset, bool, frozenset, frozenset]:
        rest = self._rest
        if rest is None:
            rest = _rest(self.key)
            _set(self, "_rest", rest)
        return rest

    @property
    def items(self) -> frozenset:
        return self._facts()[0]

    @property
    def names(self) -> frozenset:
        if self._rest is None and self.key.islower():
            return _NONE  # all cased letters lower case: no name (as in merge._names)
        return self._facts()[1]

    @property
    def negated(self) -> bool:
        return self._facts()[2]

    @property
    def scope(self) -> frozenset:
        return self._facts()[3]

    @property
    def words(self) -> frozenset:
        return self._facts()[4]

    def _compared(self) -> tuple:
        return (self.text, self.terms, *self._facts())

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    def __repr__(self) -> str:
        items, names, negated, scope, words = self._facts()
        return (
            f"Clause(text={self.text!r}, terms={self.terms!r}, items={items!r}, "
            f"names={names!r}, negated={negated!r}, scope={scope!r}, words={words!r})"
        )


def _clause_key(part: str) -> str:
    """What a clause's analysis depends on: ``part`` without a trailing ``.``, ``;``, ``,``
    or ``:`` and with its first letter in lower case. A merged text's clause written as a
    sentence (:func:`~consolidate.ops.merge._sentence`: "likes tea;" -> "Likes tea.") is then
    the member clause it came from, and is analysed once: none of the rules reads the first
    word's case (names skip a sentence's first word, terms and items are lower case) or a
    trailing mark (numbers need a digit after ``.``/``,``/``:``)."""
    key = part.rstrip(".;,:")
    return key[:1].lower() + key[1:]


@functools.lru_cache(maxsize=1 << 17)
def _term(t: str) -> str | None:
    """The term of a content token (its Porter stem), or ``None`` for a stop-word, the
    contraction ``n't`` or a number."""
    if t in CONTENT_STOP_WORDS or t == "n't" or _is_number(t):
        return None
    return _stem(t)


_NONE: frozenset = frozenset()
#: a letter or a digit (``str.isalnum``: ``\w`` is that and ``_``)
_ALNUM = re.compile(r"[^\W_]")


@functools.lru_cache(maxsize=1 << 14)
def _terms(key: str) -> frozenset:
    """The terms of the clause with analysis key ``key`` (:func:`_term` of its tokens)."""
    terms = frozenset(map(_term, content_tokens(key)))
    return terms - {None} if None in terms else terms


@functools.lru_cache(maxsize=1 << 14)
def _rest(key: str) -> tuple[frozenset, frozenset, bool, frozenset, frozenset]:
    """The rest of the analysis of the clause with key ``key``: ``(items, names, negated,
    scope, words)`` (:class:`Clause`), from its :class:`~consolidate.ops.merge.Facts`."""
    f = facts_from_tokens(key, content_tokens(key))
    items = (
        frozenset({("number", x) for x in f.numbers} | {("date", x) for x in f.dates})
        if f.numbers or f.dates
        else _NONE
    )
    scope = (
        frozenset(_stem(t) for t in f.negated_scope if t not in CONTENT_STOP_WORDS)
        if f.negated_scope
        else _NONE
    )
    return items, f.names, f.negated, scope, f.words


@functools.lru_cache(maxsize=1 << 13)
def clauses_of(text: str) -> tuple[Clause, ...]:
    """The :class:`Clause` of each part of ``text`` (``str``) that has a letter or a digit,
    in order; cached (members recur across clusters and passes), and each clause's analysis
    cached apart (:func:`_clause_key`), so a merged text made of member clauses costs a
    split and lookups."""
    out = []
    for part in _parts(str(text)):
        key = _clause_key(part)
        out.append(Clause._of_key(part, key))
    return tuple(out)


def _parts(text: str) -> list[str]:
    """The parts of ``text`` that :func:`clauses_of` reads (stripped, with a letter or a
    digit), in order."""
    if not _CLAUSE_END.search(text):  # one part: split_facts has nowhere to split
        part = text.strip()
        return [part] if _ALNUM.search(part) is not None else []
    return [p.strip() for p in split_facts(text) or [text] if _ALNUM.search(p) is not None]


#: where :func:`~consolidate.text.split_facts` may split
_CLAUSE_END = re.compile(r"[.!?;]")


def coverage(c: Clause, k: Clause) -> float:
    """Share of ``c``'s terms that ``k`` has (1.0 when ``c`` has none)."""
    if not c.terms:
        return 1.0
    return len(c.terms & k.terms) / len(c.terms)


def polarity_ok(c: Clause, k: Clause) -> bool:
    """Rule 3 of the module docstring: ``c`` and ``k`` do not deny each other's words."""
    if c.negated == k.negated:
        return True
    neg, other = (c, k) if c.negated else (k, c)
    return not (neg.scope & other.terms)


def clause_covers(k: Clause, c: Clause, threshold: float = DEFAULT_THRESHOLD) -> bool:
    """Does clause ``k`` alone say clause ``c``? Rules 1-2 of the module docstring with
    ``k`` as the whole merged text, and the same polarity (both negated or neither: the
    extractive merger never drops a clause for one of the other polarity)."""
    # at threshold 1.0 coverage is containment, the test that fails first for most pairs
    if threshold == 1.0 and not c.terms <= k.terms:
        return False
    if c.negated != k.negated or not c.items <= k.items:
        return False
    if c.names and any(_name_key(n) not in k.words for n in c.names):
        return False
    return threshold == 1.0 or coverage(c, k) >= threshold


def lost_clauses(member: str, merged: str, threshold: float = DEFAULT_THRESHOLD) -> list[str]:
    """The clauses of ``member`` that do not survive in ``merged`` (module docstring), as
    written, in order; empty = the member survives.

    Args:
        member: a member's text.
        merged: the merged text.
        threshold: term coverage a clause needs, in (0, 1].

    Raises:
        ValueError: ``threshold`` outside (0, 1].
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"fidelity threshold must be in (0, 1], got {threshold}")
    return _lost(member, _Merged(merged), threshold)


class _Merged:
    """A merged text as the check reads it. ``keys``: the analysis keys of its clauses
    (:func:`_clause_key`), read at once. :meth:`read`: its clauses with the union of their
    items and of their words, read only when a member clause's key is not among ``keys``
    or its names are not among its own words."""

    __slots__ = ("text", "keys", "_read")

    def __init__(self, merged: str) -> None:
        self.text = str(merged)
        self.keys = frozenset(map(_clause_key, _parts(self.text)))
        self._read: tuple[tuple[Clause, ...], frozenset, frozenset] | None = None

    def read(self) -> tuple[tuple[Clause, ...], frozenset, frozenset]:
        """``(clauses, items, words)`` of the merged text."""
        if self._read is None:
            have = clauses_of(self.text)
            items = frozenset().union(*(k.items for k in have))
            words = frozenset().union(*(k.words for k in have))
            self._read = (have, items, words)
        return self._read


def _lost(member: str, merged: _Merged, threshold: float) -> list[str]:
    """:func:`lost_clauses` with the merged text read already (:class:`_Merged`)."""
    out = []
    for c in clauses_of(member):
        if c.key in merged.keys and (not c.names or all(_name_key(n) in c.words for n in c.names)):
            # the merged text has a clause with c's key, hence c's analysis: rules 1-3
            # hold against that clause (its terms, items and words are c's, its polarity
            # too), and the names of c are among c's own words
            continue
        have, items, words = merged.read()
        if not c.items <= items or any(_name_key(n) not in words for n in c.names):
            out.append(c.text)
            continue
        if not c.terms:
            continue
        # a merged clause with every term of c and no polarity clash is the best one there
        # is
        if any(c.terms <= k.terms and polarity_ok(c, k) for k in have):
            continue
        best = max(have, key=lambda k: (coverage(c, k), polarity_ok(c, k)), default=None)
        if best is None or coverage(c, best) < threshold or not polarity_ok(c, best):
            out.append(c.text)
    return out


def survives(member: str, merged: str, threshold: float = DEFAULT_THRESHOLD) -> bool:
    """Does every clause of ``member`` survive in ``merged``? (:func:`lost_clauses`)"""
    return not lost_clauses(member, merged, threshold)


def lost_members(
    merged: str,
    members: Iterable[tuple[str, Sequence[str]]],
    threshold: float = DEFAULT_THRESHOLD,
) -> dict[str, list[str]]:
    """For a merge: each member whose content does not survive, with its lost clauses.

    Args:
        merged: the merged text.
        members: ``(id, texts)`` per member; ``texts`` are what the member stands for (its
            own text, or the source texts of a record an earlier pass merged).
        threshold: see :func:`lost_clauses`.

    Returns:
        ``{member id: [lost clause, ...]}`` for the members that lose something (empty =
        nothing lost).

    Raises:
        ValueError: ``threshold`` outside (0, 1].
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"fidelity threshold must be in (0, 1], got {threshold}")
    out: dict[str, list[str]] = {}
    read = _Merged(merged)
    for mid, texts in members:
        lost = [c for t in texts for c in _lost(t, read, threshold)]
        if lost:
            out[mid] = lost
    return out
