"""The English word lists the text rules share, written once.

Every rule that needs to know what a word *is* (a negation, a number, a date term, a word
with no content of its own) reads it from here, so that two rules cannot disagree about the
same word. The lists are hand-made for short first-person memory facts ("I moved to Denver
in May 2023.", "Bob is not allergic to nuts."); they are lower case and match the tokens of
:func:`consolidate.text.content_tokens` (contractions split, so "don't" gives "do", "n't").

Which rule reads which list:

- :data:`NEGATIONS`: the conflict guard's polarity cues (:mod:`consolidate.text`) and the
  merge's negated-sentence rule (:mod:`consolidate.ops.merge`).
- :data:`POLARITY_MARKERS`: the four plain negation markers, a subset of
  :data:`NEGATIONS`; :data:`STOP_WORDS` holds them, :data:`CONTENT_STOP_WORDS` does not.
- :data:`NUMBER_WORDS`: numbers written as words (cardinals, ordinals, "once", "dozen"),
  for the guard, the merge and the fidelity checker; :data:`SMALL_CARDINALS` ("one" to
  "ten") for the write path's relative dates ("three days ago").
- :data:`MONTHS`, :data:`WEEKDAYS`, :data:`DAY_WORDS`, :data:`RELATIVE_TIME`,
  :data:`DATE_WORDS`: date terms a merge must keep and the guard compares.
- :data:`STOP_WORDS`: what the merge's base rules skip (articles, conjunctions,
  prepositions, auxiliaries, pronouns, and the polarity markers).
- :data:`CONTENT_STOP_WORDS`: words that carry no fact, for the fidelity checker's clause
  coverage and the LLM merger's invented-content check: :data:`STOP_WORDS` without the
  polarity markers (polarity is checked on its own), with more pronouns, auxiliaries,
  modals and quantifiers.
- :data:`GUARD_FUNCTION_WORDS`: words the conflict guard never takes as a value or a role;
  a subset of :data:`CONTENT_STOP_WORDS`. :data:`NEGATION_GAP_WORDS`: the words the guard
  lets stand between a negation and the word it negates ("does not really like").
- :data:`MODALS` and :data:`PLAIN_CAPITALISED`: capitalised words the write path's
  grounding check never takes for a name ("Will move to Porto", "The user ...").

``tests/test_lexicon.py`` holds the relations between the lists; ``tests/test_layers.py``
fails when another module writes a copy of one of them.
"""

from __future__ import annotations

__all__ = [
    "CONTENT_STOP_WORDS",
    "DATE_WORDS",
    "DAY_WORDS",
    "GUARD_FUNCTION_WORDS",
    "MODALS",
    "MONTHS",
    "NEGATION_GAP_WORDS",
    "NEGATIONS",
    "NUMBER_WORDS",
    "PLAIN_CAPITALISED",
    "POLARITY_MARKERS",
    "RELATIVE_TIME",
    "SMALL_CARDINALS",
    "STOP_WORDS",
    "WEEKDAYS",
]


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def _words_in_order(text: str) -> tuple[str, ...]:
    return tuple(text.split(" "))


#: the four plain negation markers
POLARITY_MARKERS = _words("not no never n't")

#: polarity cues: negation markers, negative pronouns and adverbs, and the verbs of stopping
#: ("stopped", "quit", "anymore") that turn "I smoke" into its opposite
NEGATIONS = POLARITY_MARKERS | _words(
    "cannot nobody nothing none neither nor nowhere without stopped quit anymore"
)

#: "one" to "ten", in order (the write path's "N days ago")
SMALL_CARDINALS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

_TEENS = _words_in_order(
    "eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen"
)
_TENS = _words_in_order("twenty thirty forty fifty sixty seventy eighty ninety")
_ORDINALS = _words_in_order("first second third fourth fifth sixth seventh eighth ninth tenth")

#: a number written as a word -> its value (int); ordinals give their cardinal
NUMBER_WORDS: dict[str, int] = {
    "zero": 0,
    **{w: k for k, w in enumerate(SMALL_CARDINALS, 1)},
    **{w: k for k, w in enumerate(_TEENS, 11)},
    **{w: 10 * k for k, w in enumerate(_TENS, 2)},
    "hundred": 100,
    "thousand": 1000,
    "million": 10**6,
    "billion": 10**9,
    **{w: k for k, w in enumerate(_ORDINALS, 1)},
    "eleventh": 11,
    "twelfth": 12,
    "twentieth": 20,
    "hundredth": 100,
    "once": 1,
    "twice": 2,
    "thrice": 3,
    "dozen": 12,
}

#: month names and their usual abbreviations ("may" is both a month and a modal)
MONTHS = _words(
    "january february march april may june july august september october november december"
    " jan feb mar apr jun jul aug sep sept oct nov dec"
)

#: the seven day names, Monday first (``WEEKDAYS.index(day)`` is Python's ``weekday()``)
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")

#: day names and the words that name a day relative to now
DAY_WORDS = frozenset(WEEKDAYS) | _words("yesterday today tomorrow tonight weekend")

#: words that place a time relative to another
RELATIVE_TIME = _words("last next ago later earlier previous upcoming")

#: every date term a merge must keep
DATE_WORDS = MONTHS | DAY_WORDS | RELATIVE_TIME

#: what the merge's base rules skip: articles, conjunctions, prepositions, auxiliaries,
#: pronouns, and the polarity markers
STOP_WORDS = POLARITY_MARKERS | _words(
    "a an the and or but of to in on at for with is was are were be been has had have"
    " her his she he they their it its that this as by from also who which about into very"
    " so i i'm my me we our you your do does did"
)

#: the modal auxiliaries
MODALS = _words("will would can could shall should must might")

#: words that carry no fact of their own (see the module docstring)
CONTENT_STOP_WORDS = (
    (STOP_WORDS - POLARITY_MARKERS)
    | MODALS
    | _words(
        "s am being doing having him hers mine ours theirs yours them these those what whom"
        " here there now then again once only just still too more most some any all each"
        " same such own than over out up both may"
    )
)

#: words the conflict guard never takes as a value or a role (function words, auxiliaries)
GUARD_FUNCTION_WORDS = _words(
    "a an the is are was were be being been am of its his her their our my your some and"
    " or to for with at as that this these those it he she they we i you him them who"
    " which has have had does do did s"
)

#: words that may stand between a negation and the word it negates ("does not really like")
NEGATION_GAP_WORDS = _words(
    "do does did is are was were be been am really quite very much so too at all"
    " particularly exactly that"
)

#: capitalised words that open or join a fact without naming anyone or anything
PLAIN_CAPITALISED = _words(
    "i we you she he they it this that these those there the a an my our your his her"
    " their its user assistant speaker when while after before since during in on at for"
    " with and but or not no all some many most every each both last next"
)
