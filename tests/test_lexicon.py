"""The shared word lists: the relations the rules that read them rely on, and every word a
token the tokenizer can produce (a word it never yields would be a dead entry)."""

import datetime as dt

import pytest

from consolidate import lexicon as L
from consolidate.text import content_tokens


@pytest.mark.parametrize("name", L.__all__)
def test_every_word_is_one_token_of_the_tokenizer(name):
    words = getattr(L, name)
    dead = sorted(w for w in words if content_tokens(w) != [w])
    assert not dead, f"{name}: {dead}"


def test_polarity_markers_are_negations_and_stop_words_but_not_content_stop_words():
    assert {"not", "no", "never", "n't"} == L.POLARITY_MARKERS
    assert L.POLARITY_MARKERS < L.NEGATIONS
    assert L.POLARITY_MARKERS < L.STOP_WORDS
    assert not L.POLARITY_MARKERS & L.CONTENT_STOP_WORDS
    # the other negation cues are content: "nothing", "without" say something
    assert not (L.NEGATIONS - L.POLARITY_MARKERS) & (L.STOP_WORDS | L.CONTENT_STOP_WORDS)


def test_content_stop_words_extend_the_stop_words_and_hold_the_guards_function_words():
    assert L.STOP_WORDS - L.POLARITY_MARKERS < L.CONTENT_STOP_WORDS
    assert L.GUARD_FUNCTION_WORDS < L.CONTENT_STOP_WORDS
    # no number and no date term is a stop word: a merge must keep them
    for stop in (L.STOP_WORDS, L.CONTENT_STOP_WORDS, L.GUARD_FUNCTION_WORDS):
        assert not stop & L.NUMBER_WORDS.keys() - {"once"}
        assert not stop & L.DATE_WORDS - {"may"}


def test_number_words_by_hand():
    n = L.NUMBER_WORDS
    assert [n[w] for w in ("zero", "seven", "ten", "eleven", "nineteen", "twenty")] == [
        0,
        7,
        10,
        11,
        19,
        20,
    ]
    assert [n[w] for w in ("ninety", "hundred", "million", "third", "twelfth", "dozen")] == [
        90,
        100,
        10**6,
        3,
        12,
        12,
    ]
    assert len(n) == 50
    assert [n[w] for w in L.SMALL_CARDINALS] == list(range(1, 11))


def test_weekdays_in_pythons_order():
    friday = dt.date(2026, 12, 4)
    assert L.WEEKDAYS[friday.weekday()] == "friday"
    assert L.DATE_WORDS == L.MONTHS | L.DAY_WORDS | L.RELATIVE_TIME
    assert "weekend" in L.DAY_WORDS and "ago" in L.RELATIVE_TIME and "sept" in L.MONTHS
