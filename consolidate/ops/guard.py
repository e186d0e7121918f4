"""The conflict guard: why two near-duplicate texts must not be merged without a model.

The guard is deliberately conservative: a pair of memories whose texts differ by a negation,
a changed number or a changed date is never merged without a model, because sentence
embeddings score such pairs as near-duplicates (with all-MiniLM-L6-v2, "I live in Berlin"
and "I don't live in Berlin" have cosine ~0.87, see ``../shared/DESIGN.md``). The rules are
in :func:`conflict_reason`; the pass computes each text's :class:`ConflictSignature` once and
compares signatures (:func:`conflict_between`). The guard is symmetric: the order of the two
texts does not change its answer.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import operator
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..lexicon import (
    DATE_WORDS,
    GUARD_FUNCTION_WORDS,
    NEGATION_GAP_WORDS,
    NEGATIONS,
    NUMBER_WORDS,
)
from ..text import (
    _DIGIT,
    _QUOTES,
    _TOKEN,
    _common,
    _date_terms,
    _negation_count,
    _numbers,
    _singular,
    _vocabulary,
    split_sentences,
)

__all__ = [
    "conflict_reason",
    "conflict_signature",
    "conflict_between",
    "ConflictSignature",
    "EMPTY_SIGNATURE",
]

# Opposite poles: (group, words of pole 0, words of pole 1). Two texts that each use a pole
# of one group that the other text does not use state opposite values ("is near" / "is far",
# "is enabled" / "is disabled"). General English antonym pairs (space, size, temperature,
# state, preference, outcome, quantity), the antonymy feature of lexical NLI baselines;
# inflected forms are listed, nothing is stemmed.
_OPPOSITE_GROUPS: tuple[tuple[str, str, str], ...] = (
    ("distance", "near nearby close closer closest", "far farther faraway distant"),
    ("inout", "in into inside indoors indoor within", "out outside outdoors outdoor"),
    ("onoff", "on onto", "off"),
    (
        "updown",
        "up upward upwards uphill climb climbs climbing climbed ascend ascends "
        "ascending ascended rise rises rising rose",
        "down downward downwards downhill descend descends descending descended",
    ),
    ("topbottom", "top upper above", "bottom lower below underneath beneath"),
    ("frontback", "front ahead", "behind rear"),
    (
        "size",
        "big bigger biggest large larger largest huge giant enormous",
        "small smaller smallest little tiny",
    ),
    ("length", "long longer longest", "short shorter shortest"),
    (
        "height",
        "tall taller tallest high higher highest",
        "short shorter shortest low lower lowest",
    ),
    ("thickness", "thick thicker wide wider", "thin thinner narrow narrower"),
    ("heat", "hot hotter warm warmer heated", "cold colder cool cooler chilly frozen"),
    ("wetness", "wet wetter damp soaked", "dry drier dried"),
    ("fullness", "full filled", "empty emptied"),
    ("openness", "open opened opens", "closed shut"),
    ("toggle", "enabled enable enables enabling", "disabled disable disables disabling"),
    (
        "permission",
        "allowed allow allows permitted permit permits",
        "forbidden forbid forbids banned ban bans prohibited prohibit prohibits disallowed",
    ),
    ("truth", "true correct", "false incorrect wrong"),
    (
        "preference",
        "like likes liked love loves loved enjoy enjoys enjoyed prefer prefers",
        "dislike dislikes disliked hate hates hated detest detests",
    ),
    (
        "outcome",
        "win wins won winning passed succeed succeeded",
        "lose loses lost losing fail fails failed",
    ),
    (
        "acceptance",
        "accept accepts accepted approve approved",
        "reject rejects rejected decline declines declined deny denied",
    ),
    ("life", "alive", "dead died deceased"),
    ("marriage", "married", "single divorced unmarried"),
    ("age", "young younger youngest", "old older oldest elderly"),
    ("novelty", "new newer newest", "old older"),
    (
        "speed",
        "fast faster fastest quick quickly quicker rapid rapidly",
        "slow slower slowest slowly",
    ),
    ("lateness", "early earlier earliest", "late later latest"),
    ("brightness", "bright", "dark darker dim"),
    ("mood", "happy happier glad", "sad sadder unhappy"),
    ("difficulty", "easy easier easily", "hard harder difficult"),
    ("price", "cheap cheaper inexpensive", "expensive pricey costly"),
    ("wealth", "rich wealthy", "poor"),
    ("cleanliness", "clean cleaner", "dirty dirtier"),
    ("health", "healthy healthier", "sick ill unhealthy"),
    ("loudness", "loud louder noisy", "quiet quieter silent"),
    ("sameness", "same", "different"),
    ("quantity", "more most", "less least fewer"),
    ("whole", "all every everyone everything always", "none nobody nothing never"),
    ("buying", "buy buys bought buying", "sell sells sold selling"),
    (
        "beginning",
        "start starts started starting begin begins began",
        "stop stops stopped stopping quit quits",
    ),
    (
        "change",
        "increase increases increased increasing",
        "decrease decreases decreased decreasing",
    ),
    ("presence", "present", "absent"),
    ("safety", "safe", "dangerous unsafe"),
    ("strength", "strong stronger", "weak weaker"),
    ("weight", "heavy heavier", "light lighter"),
    ("count", "one single alone", "both"),
)
_POLES: dict[str, tuple[tuple[int, int], ...]] = {}
for _g, (_name, _p0, _p1) in enumerate(_OPPOSITE_GROUPS):
    for _pole, _words in enumerate((_p0, _p1)):
        for _w in _words.split():
            _POLES[_w] = (*_POLES.get(_w, ()), (_g, _pole))
_POLE_WORDS = frozenset(_POLES)

# negative prefixes: "unhappy" / "happy", "dislikes" / "likes", "nonsmoker" / "smoker";
# and positive ones that take their place: "disabled" / "enabled"
_NEG_PREFIXES = ("un", "dis", "non")
_POS_PREFIXES = ("en", "em")
# prepositions that mark who does what to whom: kept among the role words, so that "from
# Boston to Denver" / "from Denver to Boston" swap around "to"
_ROLE_PIVOTS = frozenset({"to", "for", "from", "than"})
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?")
# identifiers: letters and digits together, acronyms, internal capitals
_IDENT = re.compile(r"^(?=.*\d)(?=.*[^\W\d_])|^[A-Z]{2,}$|^[^\W\d_]+[A-Z]")


@dataclass(frozen=True)
class ConflictSignature:
    """What the conflict guard compares (see :func:`conflict_reason`), computed once per text
    with :func:`conflict_signature`.

    Attributes:
        negations, numbers, dates: multisets as sorted ``(item, count)`` tuples.
        poles: sorted ``(group, pole)`` pairs of the opposite-pair words the text uses.
        negated_stems: stems of its words with a negative prefix (``un``, ``dis``, ``non``).
        stems: its words, and those with a positive prefix (``en``, ``em``) without it.
        words: ``(word, is_value)`` per word in order, lower case; ``is_value``: an
            identifier (letters with digits, an acronym, internal capitals), a capitalised
            word inside a sentence (unless the text is in title case), or a word outside the
            embedder's vocabulary.
        roles: its content words in order (function words and numbers dropped, plurals made
            singular).
    """

    negations: tuple
    numbers: tuple
    dates: tuple
    poles: tuple = ()
    negated_stems: frozenset = frozenset()
    stems: frozenset = frozenset()
    words: tuple = ()
    roles: tuple = ()
    # derived from ``words`` and ``roles`` once, for the pair rules (not compared)
    word_list: tuple = field(default=(), compare=False)
    word_set: frozenset = field(default=frozenset(), compare=False)
    value_set: frozenset = field(default=frozenset(), compare=False)
    role_pos: Mapping = field(default_factory=dict, compare=False)


@functools.lru_cache(maxsize=1 << 16)
def _word(w: str) -> tuple[str, str, bool, bool, bool, bool, str | None, str | None, str | None]:
    """What the guard reads from one word as written: ``(lower case, as kept after a
    sentence's first word, is a value wherever it stands, is a name or value after a
    sentence's first word, counts as a longer word there, counts as a capitalised longer
    word there, negated stem, stem without a positive prefix, role word)``. Cached: a
    store's words repeat."""
    low = w.casefold()
    if w.isdigit():  # numbers have a rule of their own
        return low, low, False, False, False, False, None, None, None
    function = low in GUARD_FUNCTION_WORDS
    value = bool(_IDENT.search(w)) or (
        low.isascii()
        and low.isalpha()
        and len(low) >= 3
        and not function
        and not _common(low, _vocabulary())
    )
    inner = value or (w[:1].isupper() and not function)
    # inside a sentence, a lone capital letter other than "I" is an identifier
    # ("revision A" / "revision B"), not the article: kept in its case
    letter = len(w) == 1 and w.isupper() and w != "I"
    longer = len(low) >= 4 and low.isalpha()
    neg = next(
        (low[len(p) :] for p in _NEG_PREFIXES if low.startswith(p) and len(low) - len(p) >= 4), None
    )
    pos = next(
        (low[len(p) :] for p in _POS_PREFIXES if low.startswith(p) and len(low) - len(p) >= 4), None
    )
    role = None if function and low not in _ROLE_PIVOTS else _singular(low)
    later_low = w if letter else low
    return low, later_low, value, inner or letter, longer, longer and inner, neg, pos, role


@functools.lru_cache(maxsize=1 << 16)
def _later(w: str) -> tuple[str, bool, bool, bool, bool, bool, str | None]:
    """:func:`_word` of a word after a sentence's first, as :func:`_read_words` takes it:
    ``(lower case as kept, is a value or a name, is a value only as a name, counts as a
    longer word, counts as a capitalised longer word, has a negated or positively
    prefixed stem, role word)``. Cached."""
    x = _word(w)
    return (
        x[1],
        x[2] or x[3],
        x[3] and not x[2],
        x[4],
        x[5],
        x[6] is not None or x[7] is not None,
        x[8],
    )


def _read_words(orig: str) -> tuple[list[str], list[bool], set[str], set[str], list[str]]:
    """The words of ``orig`` (NFKC, quotes straight) as :func:`conflict_signature` reads
    them: ``(lower-case words, is a value, negated stems, positively prefixed stems, role
    words)``, in order (see :func:`_word` and :func:`_later`)."""
    lows: list[str] = []
    flags: list[bool] = []  # a value: wherever it stands, or as a name inside a sentence
    names: list[int] = []  # positions of the words that are values only as names
    negated: set[str] = set()
    pos_stems: set[str] = set()
    roles: list[str] = []
    add_low, add_flag, add_role = lows.append, flags.append, roles.append
    caps = longer = 0
    # a text without ".", "!" or "?" is one sentence (split_sentences finds no end in it)
    sents = split_sentences(orig) if ("." in orig or "!" in orig or "?" in orig) else (orig,)
    for sent in sents:
        ws = iter(_WORD.findall(sent))
        for w in ws:  # the sentence's first word: as it stands
            x = _word(w)
            add_low(x[0])
            add_flag(x[2])
            if x[6] is not None:
                negated.add(x[6])
            if x[7] is not None:
                pos_stems.add(x[7])
            if x[8] is not None:
                add_role(x[8])
            break
        for w in ws:  # the later words
            low, flag, name, long_, cap, prefixed, role = _later(w)
            add_low(low)
            add_flag(flag)
            if name:
                names.append(len(flags) - 1)
            if long_:
                longer += 1
                caps += cap
            if prefixed:
                x = _word(w)
                if x[6] is not None:
                    negated.add(x[6])
                if x[7] is not None:
                    pos_stems.add(x[7])
            if role is not None:
                add_role(role)
    # a title-case text ("Jordan Opens First Tent Camp") capitalises words that are no names
    if names and longer >= 3 and caps >= 0.5 * longer:
        for k in names:
            flags[k] = False
    return lows, flags, negated, pos_stems, roles


#: how :func:`conflict_signature` makes a (frozen) signature without its ``__init__``
_new = object.__new__
_set = object.__setattr__


def conflict_signature(text: str) -> ConflictSignature:
    """The :class:`ConflictSignature` of ``text`` (``str``)."""
    # NFKC and the quote table change no ASCII text
    orig = text if text.isascii() else unicodedata.normalize("NFKC", text).translate(_QUOTES)
    low = orig.casefold()
    lows, flags, negated, pos_stems, roles = _read_words(orig)
    word_list = tuple(lows)
    words = tuple(zip(word_list, flags, strict=True))
    word_set = frozenset(word_list)
    stems = word_set | pos_stems if pos_stems else word_set
    hit = word_set & _POLE_WORDS
    poles = sorted({gp for t in hit for gp in _POLES[t]}) if hit else ()
    # the multisets, from content_tokens, skipped where the text has none of their words
    # (most texts)
    negs: tuple[tuple[Any, int], ...] = ()
    nums: tuple[tuple[Any, int], ...] = ()
    dates: tuple[tuple[Any, int], ...] = ()
    has_num = _DIGIT.search(low) is not None or not NUMBER_WORDS.keys().isdisjoint(word_set)
    has_neg = "n't" in low or not NEGATIONS.isdisjoint(word_set)
    has_date = not DATE_WORDS.isdisjoint(word_set)
    if has_num or has_neg or has_date:
        toks = _TOKEN.findall(low.replace("n't", " n't"))
        if has_neg:
            negs = tuple(sorted(_negation_count(toks).items()))
        if has_num:
            nums = tuple(sorted(_numbers(toks, low).items()))
        if has_date:
            dates = tuple(sorted(_date_terms(toks).items()))
    role_t = tuple(roles)
    role_pos = dict(zip(role_t, range(len(role_t)), strict=True))
    if len(role_pos) != len(role_t):  # a repeated word has no one position: left out
        seen: dict[str, int] = {}
        for k, w in enumerate(role_t):
            seen[w] = -1 if w in seen else k
        role_pos = {w: k for w, k in seen.items() if k >= 0}
    # built without the dataclass's __init__ (a dozen frozen-field writes): the pass makes
    # one per distinct text of every paired memory
    sig = _new(ConflictSignature)
    _set(
        sig,
        "__dict__",
        {
            "negations": negs,
            "numbers": nums,
            "dates": dates,
            "poles": tuple(poles),
            "negated_stems": frozenset(negated),
            "stems": stems,
            "words": words,
            "roles": role_t,
            "word_list": word_list,
            "word_set": word_set,
            "value_set": frozenset(itertools.compress(word_list, flags)),
            "role_pos": role_pos,
        },
    )
    return sig


#: the signature of a text without words
EMPTY_SIGNATURE = ConflictSignature((), (), ())


def _opposite(a: ConflictSignature, b: ConflictSignature, prefixes: bool = True) -> bool:
    """Each side uses a pole of one opposite group that the other does not; or (when
    ``prefixes``) a negatively prefixed word on one side has its stem on the other side, not
    negated there."""
    if a.poles != b.poles:
        pa, pb = set(a.poles), set(b.poles)
        if {g for g, _ in pa - pb} & {g for g, _ in pb - pa}:
            return True
    if not prefixes or not (a.negated_stems or b.negated_stems):
        return False
    return bool(
        ((a.negated_stems - b.negated_stems) & b.stems)
        or ((b.negated_stems - a.negated_stems) & a.stems)
    )


#: British and American spellings of one word ("grey" / "gray", "organise" / "organize")
_SPELLINGS = (
    ("grey", "gray"),
    ("ise", "ize"),
    ("isa", "iza"),
    ("yse", "yze"),
    ("our", "or"),
    ("tre", "ter"),
    ("ence", "ense"),
    ("ogue", "og"),
)


def _variant(x: str, y: str) -> bool:
    """One spelling of a word against the other (see :data:`_SPELLINGS`)."""
    return x != y and any(x.replace(a, b) == y.replace(a, b) for a, b in _SPELLINGS)


def _one_char_apart(x: str, y: str) -> bool:
    """Equal length (at least 3), exactly one differing character, and not two spellings
    of one word."""
    return len(x) == len(y) >= 3 and sum(map(operator.ne, x, y)) == 1 and not _variant(x, y)


def _value_candidates(a: ConflictSignature, b: ConflictSignature) -> bool:
    """Whether :func:`_values_differ` can hold in either direction: each text has a word
    the other lacks, and either each has a value among those words or two of those words
    are one character apart. Symmetric in ``a`` and ``b``."""
    in_a, in_b = a.word_set, b.word_set
    only_a, only_b = in_a - in_b, in_b - in_a
    if not only_a or not only_b:
        return False
    if (a.value_set & only_a) and (b.value_set & only_b):
        return True
    for x in only_a:
        n = len(x)
        if n >= 3:
            for y in only_b:
                if len(y) == n and _one_char_apart(x, y):
                    return True
    return False


def _values_differ(a: ConflictSignature, b: ConflictSignature) -> bool:
    """In the word alignment of the two texts, a replaced span of at most 3 words on each
    side holds, on each side, a value that the other text does not contain and that is no
    form of the other (:func:`_related`); or one word is replaced by a word one character
    apart, each absent from the other text. Only meaningful where
    :func:`_value_candidates` holds (the caller checks it once for both directions)."""
    in_a, in_b = a.word_set, b.word_set
    only_a, only_b = in_a - in_b, in_b - in_a
    wa, wb = a.word_list, b.word_list
    # near-duplicates mostly differ in one place: the words between the common prefix and
    # suffix are the one replaced span, no alignment needed
    n = min(len(wa), len(wb))
    i = 0
    while i < n and wa[i] == wb[i]:
        i += 1
    j = 0
    while j < n - i and wa[-1 - j] == wb[-1 - j]:
        j += 1
    if len(wa) - i - j <= 3 and len(wb) - i - j <= 3:
        spans = [("replace", i, len(wa) - j, i, len(wb) - j)]
    elif (len(wa) - i - j) * (len(wb) - i - j) > _MAX_ALIGN:
        # long texts that differ in many places: align only the differing middle's ends
        # (difflib is quadratic); such pairs are no near-duplicate sentences anyway
        spans = [
            ("replace", i, min(i + 3, len(wa) - j), i, min(i + 3, len(wb) - j)),
            ("replace", max(i, len(wa) - j - 3), len(wa) - j, max(i, len(wb) - j - 3), len(wb) - j),
        ]
    else:
        spans = list(difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).get_opcodes())
    for op, i1, i2, j1, j2 in spans:
        if op != "replace" or i2 - i1 > 3 or j2 - j1 > 3 or i1 == i2 or j1 == j2:
            continue
        if (
            i2 - i1 == 1
            and j2 - j1 == 1
            and wa[i1] in only_a
            and wb[j1] in only_b
            and _one_char_apart(wa[i1], wb[j1])
        ):
            return True  # "sk-abc" / "sk-abd", "has a cat" / "has a car"
        va = [w for w, v in a.words[i1:i2] if v and w not in in_b]
        vb = [w for w, v in b.words[j1:j2] if v and w not in in_a]
        if any(not _related(x, y) for x in va for y in vb):
            return True
    return False


def _related(x: str, y: str) -> bool:
    """One word starts with the other, at least 3 characters ("syria" / "syrian", "tim" /
    "timothy"), or two spellings of one word: forms of one value, not two values."""
    short, long_ = sorted((x, y), key=len)
    return (len(short) >= 3 and long_.startswith(short)) or _variant(x, y)


#: the pair rules' budget: word-alignment cells, and content words compared for roles
_MAX_ALIGN = 40_000
_MAX_ROLES = 64


def _roles_swapped(a: ConflictSignature, b: ConflictSignature) -> bool:
    """The same content words (at least 80% of the longer side's, each once), two of them in
    opposite order with a third between them on both sides ("the turtle follows the fish" /
    "the fish follows the turtle"). A passive (``by``) on one side only reverses the order
    without swapping the roles: exempt."""
    ra, rb = a.roles, b.roles
    if ra == rb or ("by" in ra) != ("by" in rb):
        return False
    pa, pb = a.role_pos, b.role_pos
    n_common = len(pa.keys() & pb.keys())
    if n_common > _MAX_ROLES:
        return False  # long texts: roles of single statements only
    if n_common < 3 or n_common < 0.8 * max(len(ra), len(rb)):
        return False  # not the same words reordered: a paraphrase that moves clauses
    common = [w for w in pa if w in pb]
    in_a, in_b = [pa[w] for w in common], [pb[w] for w in common]
    if in_a == sorted(in_a) and in_b == sorted(in_b):
        return False  # every two common words in one order on both sides (the usual case)
    for x, y in itertools.combinations(common, 2):
        if (pa[x] - pa[y]) * (pb[x] - pb[y]) > 0:
            continue  # same order
        lo_a, hi_a = sorted((pa[x], pa[y]))
        lo_b, hi_b = sorted((pb[x], pb[y]))
        if any(lo_a < pa[z] < hi_a and lo_b < pb[z] < hi_b for z in common):
            return True
    return False


def _without(a: ConflictSignature, stems: frozenset) -> ConflictSignature:
    """``a`` with the poles of the words of ``stems`` (in any prefixed or inflected form)
    left out, for :func:`_opposite`."""

    def keep(t: str) -> bool:
        return (
            _singular(t) not in stems
            and not any(
                t.startswith(p) and (t[len(p) :] in stems or _singular(t[len(p) :]) in stems)
                for p in _NEG_PREFIXES
            )
            and t not in stems
        )

    poles = sorted({gp for t in a.word_set if keep(t) for gp in _POLES.get(t, ())})
    return replace(a, poles=tuple(poles))


def _negated_word(w: str) -> bool:
    return w in NEGATIONS or w.endswith("n't") or w == "cannot"


#: stems whose negative prefix means plain "not" ("dislikes" = "does not like"); for other
#: words a prefix changes the meaning ("uncovers" is not "does not cover")
_PREFIX_IS_NOT = frozenset(
    [
        "like",
        "happy",
        "able",
        "aware",
        "sure",
        "willing",
        "likely",
        "comfortable",
        "employed",
        "married",
        "available",
        "familiar",
        "healthy",
        "safe",
        "fair",
        "important",
        "kind",
        "lucky",
        "usual",
        "clear",
        "interested",
        "satisfied",
        "agree",
        "approve",
        "pleased",
        "certain",
        "honest",
        "friendly",
        "tidy",
        "well",
    ]
)


def _content(sig: ConflictSignature, drop: frozenset) -> frozenset:
    """The words of ``sig`` without negations, function words and ``drop``, prefixed words
    of :data:`_PREFIX_IS_NOT` as their stems, plurals singular."""
    out = set()
    for w in sig.word_list:
        if _negated_word(w) or w in GUARD_FUNCTION_WORDS or w in NEGATION_GAP_WORDS or w in drop:
            continue
        for p in _NEG_PREFIXES:
            if w.startswith(p) and _singular(w[len(p) :]) in _PREFIX_IS_NOT:
                w = w[len(p) :]
                break
        out.add(_singular(w))
    return frozenset(out)


def _stems_in(stems: frozenset, this: ConflictSignature, other: ConflictSignature) -> set[str]:
    """The prefixed ``stems`` of ``this`` (those of :data:`_PREFIX_IS_NOT`) that ``other``
    states as the stem right after a negation ("does not like", "doesn't really like";
    only :data:`NEGATION_GAP_WORDS` words may stand between), when the two texts otherwise say the
    same words (:func:`_content`): "dislikes cats" and "does not like cats" agree, "does
    not like dogs but likes cats" does not."""
    want = {x for x in stems if _singular(x) in _PREFIX_IS_NOT}
    if not want:
        return set()
    by_form = {_singular(y): y for y in want}  # "likes" and "like" name one stem
    out = set()
    wl = other.word_list
    for k, w in enumerate(wl):
        x = by_form.get(_singular(w))
        if x is None:
            continue
        j = k - 1
        while j >= 0 and wl[j] in NEGATION_GAP_WORDS:
            j -= 1
        if j >= 0 and _negated_word(wl[j]):
            out.add(x)
    if out and _content(this, frozenset()) != _content(other, frozenset()):
        return set()
    return out


def conflict_between(a: ConflictSignature, b: ConflictSignature) -> str | None:
    """:func:`conflict_reason` on precomputed signatures."""
    na = sum(c for _, c in a.negations) if a.negations else 0
    nb = sum(c for _, c in b.negations) if b.negations else 0
    prefixes = True
    if na != nb:
        # as many negations each: "with no sugar" / "without sugar", "never" / "doesn't"
        # say the same; one more on one side is the opposite. A word with a negative prefix
        # whose stem the other side has counts as a negation ("dislikes" / "does not like")
        xa = _stems_in(a.negated_stems - b.negated_stems, a, b) if a.negated_stems else ()
        xb = _stems_in(b.negated_stems - a.negated_stems, b, a) if b.negated_stems else ()
        if not (xa or xb) or na + len(xa) != nb + len(xb):
            return "negation"
        # the prefixed words are matched by the negations: neither they nor their stems
        # are opposites of each other
        matched = frozenset(xa) | frozenset(xb)
        if _opposite(_without(a, matched), _without(b, matched), prefixes=False):
            return "opposite"
        prefixes = False
    if a.numbers and b.numbers and a.numbers != b.numbers:
        return "number"
    if a.dates and b.dates and a.dates != b.dates:
        return "date"
    if a == b:
        return None
    if prefixes and _opposite(a, b):
        return "opposite"
    # the candidates are symmetric, difflib's alignment is not: both directions when any
    if _value_candidates(a, b) and (_values_differ(a, b) or _values_differ(b, a)):
        return "value"
    if _roles_swapped(a, b):
        return "roles"
    return None


def conflict_reason(a: str, b: str) -> str | None:
    """Why two texts must not be merged without a model, or ``None``.

    Sentence embeddings score such pairs as near-duplicates: each rule finds the same
    statement with one fact changed. Rules, checked in order:

    * ``"negation"``: one text has more negation markers than the other ("lives in Berlin"
      vs "doesn't live in Berlin"; "still plays" vs "stopped playing"); a word with a
      negative prefix whose stem the other text has counts as one ("dislikes loud music"
      and "does not like loud music" agree).
    * ``"number"``: both texts state numbers (digits or number words) and the multisets differ
      ("has 2 cats" vs "has three cats"). A number present on one side only is extra detail,
      not a conflict.
    * ``"date"``: both texts state date terms (month, weekday, relative time words) and the
      multisets differ ("in May" vs "in June").
    * ``"opposite"``: each text uses a word of one opposite pair that the other does not
      ("near" / "far", "enabled" / "disabled", "into" / "out", "likes" / "hates"), from a
      fixed lexicon of general English antonym pairs (``_OPPOSITE_GROUPS``); or one text has
      a word with a negative prefix (``un``, ``dis``, ``non``) whose stem the other has
      without it ("happy" / "unhappy", "likes" / "dislikes").
    * ``"value"``: in the word-by-word alignment (``difflib``) of the two texts, a value is
      replaced by another value that the first text lacks. Values are identifiers (letters
      with digits such as ``v2``, acronyms such as ``GPU``, internal capitals such as
      ``iPhone``), capitalised words inside a sentence (names; not in a title-case text,
      where half the longer words are capitalised), and words outside the embedder's
      vocabulary (rare names such as ``vim`` / ``emacs``). A value that starts with the
      other ("Syria" / "Syrian") is a form of it, not another value.
    * ``"roles"``: the same content words (80% or more), two of them in opposite order with
      a third word between them on both sides ("Jon thanks Gina for the gift" / "Gina
      thanks Jon for the gift"); a passive with ``by`` on one side only is exempt.

    Measured by ``consolidate-calibrate`` on SICK's contradiction and mutual-entailment pairs
    above the calibrated merge threshold (``guard_flags_contradictions`` and
    ``guard_flags_duplicates`` in its report).

    Args:
        a, b: the two texts (``str``).

    Returns:
        One of ``"negation"``, ``"number"``, ``"date"``, ``"opposite"``, ``"value"``,
        ``"roles"`` or ``None``.
    """
    return conflict_between(conflict_signature(a), conflict_signature(b))
