"""LOCOMO official F1 rules, Mem0 F1, BLEU-1 and evidence recall, by hand."""

import math

import pytest

from consolidate.evaluation.metrics import (
    bleu1,
    category_label,
    evidence_recall,
    locomo_f1,
    locomo_normalise,
    mem0_f1,
)


def test_normalisation_drops_articles_and_punctuation():
    assert locomo_normalise("The cat, and a Dog!") == "cat dog"


def test_stemming_and_articles():
    # "running" / "runs" -> "run"; "the" dropped: pred tokens [run, marathon], gold [run, marathon]
    assert locomo_f1("running the marathon", "runs marathon", 4) == 1.0
    # pred [she, paint, sunris], gold [paint] -> P=1/3, R=1 -> F1=0.5
    assert locomo_f1("She painted sunrises", "painting", 2) == pytest.approx(0.5)


def test_category1_comma_split():
    # gold parts: "adoption agencies", "counseling"; pred parts: "counseling", "pottery"
    # best F1 for "adoption agencies" = 0; for "counseling" = 1 -> mean 0.5
    assert locomo_f1("counseling, pottery", "adoption agencies, counseling", 1) == 0.5
    # without the split the whole strings would overlap on one stem out of 3 and 2 tokens
    assert locomo_f1("counseling pottery", "adoption agencies, counseling", 1) == pytest.approx(
        (0 + 2 * 0.5 * 1 / 1.5) / 2
    )


def test_category3_keeps_text_before_semicolon():
    assert locomo_f1("Likely no", "Likely no; she would still pursue it", 3) == 1.0
    assert locomo_f1("Likely no", "Likely no; she would still pursue it", 4) < 1.0


def test_category5_abstention():
    assert locomo_f1("No information available.", "", 5) == 1.0
    assert locomo_f1("That is not mentioned in the conversation", "x", 5) == 1.0
    assert locomo_f1("self-care is important", "", 5) == 0.0
    with pytest.raises(ValueError):
        locomo_f1("a", "b", 7)


def test_mem0_f1_and_bleu1():
    # no stemming: "paintings" != "painting"
    assert mem0_f1("she likes paintings", "paintings") == pytest.approx(2 * (1 / 3) / (4 / 3))
    assert mem0_f1("painted", "painting") == 0.0
    # BLEU-1: pred 4 tokens, 2 match, longer than the 3-token gold -> BP 1 -> 0.5
    assert bleu1("the cat sat down", "the cat slept") == 0.5
    # pred shorter: 1 token, matches, gold 3 -> BP exp(1-3) -> exp(-2)
    assert bleu1("cat", "the cat slept") == pytest.approx(math.exp(-2))
    assert bleu1("", "x") == 0.0


def test_evidence_recall_merged_memory_covers_two():
    # one merged memory whose source_ids cover two dia_ids, plus an unrelated one
    retrieved = [["D1:3", "D2:7"], ["D9:1"]]
    assert evidence_recall(["D1:3", "D2:7", "D4:4"], retrieved) == pytest.approx(2 / 3)
    assert evidence_recall(["D1:3"], retrieved[:0]) == 0.0
    assert math.isnan(evidence_recall([], retrieved))


def test_category_labels_give_both_conventions():
    assert category_label(1) == "1 multi-hop / single-hop"
    assert category_label(4) == "4 single-hop / open-domain"
