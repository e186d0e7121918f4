"""The extractive merger deduplicates clauses, not members: every distinct clause of every
member is kept verbatim (in the order the facts became true), what another clause already
says is not repeated, and a merge longer than max_chars is declined, never cut. The pass's
fidelity checker refuses any merge (from any merger) that loses a member's content."""

import math

import pytest

from consolidate.config import PassConfig
from consolidate.ops.fidelity import lost_members
from consolidate.ops.merge import (
    ExtractiveMerger,
    MergeMember,
    MergeRequest,
    MergeResponse,
    lost_facts,
)
from consolidate.pipeline import run_pass
from tests.helpers import make_records


def mm(i, text, importance=0.5):
    return MergeMember(i, text, importance, 10.0, 1.0, 10.0)


def test_lost_facts_hand_checked():
    members = ["Gina adopted 2 cats in May 2023 in Paris", "Gina does not eat fish"]
    assert lost_facts("Gina adopted cats", members) == [
        "a negation",
        "date may",
        "name May",
        "name Paris",
        "number 2",
        "number 2023",
    ]
    assert (
        lost_facts("In Paris Gina adopted two cats in May 2023; she does not eat fish", members)
        == []
    )
    # a possessive keeps the name ("Nate's" holds "Nate")
    assert lost_facts("Joanna thanks Nate's family", ["Joanna thanks Nate"]) == []


def test_paraphrases_with_details_of_their_own_are_all_kept():
    m = [
        mm("a", "Joanna appreciates Nate's support and expresses her gratitude for it.", 0.6),
        mm("b", "Joanna is appreciative of Nate's support and kind words."),
        mm("c", "Joanna is grateful for Nate's support and encouragement."),
    ]
    # "kind words" and "encouragement" are said by one member each: nothing is dropped
    assert ExtractiveMerger().merge_text(m) == " ".join(x.text for x in m)


def test_a_clause_said_twice_is_kept_once_and_the_fuller_one_wins():
    m = [
        MergeMember("a", "Works on the billing service", 0.9, 10.0, 1.0, 1.0),
        MergeMember(
            "b", "Works on the billing service with the payments team", 0.5, 10.0, 1.0, 2.0
        ),
        MergeMember(
            "c", "Works on the billing service; on call every third week", 0.5, 10.0, 1.0, 3.0
        ),
    ]
    text = ExtractiveMerger().merge_text(m)
    assert text == "Works on the billing service with the payments team. On call every third week."
    assert lost_members(text, [(x.id, (x.text,)) for x in m]) == {}


def test_clauses_follow_the_time_their_facts_became_true():
    later = MergeMember(
        "a", "Caroline enjoys playing the console she bought.", 0.9, 10.0, 1.0, 50.0
    )
    earlier = MergeMember("b", "Caroline plans to play console games.", 0.5, 10.0, 1.0, 5.0)
    # the earlier fact first, whatever the ids or importance
    assert ExtractiveMerger().merge_text([later, earlier]) == (
        "Caroline plans to play console games. Caroline enjoys playing the console she bought."
    )


def test_distinct_dates_and_numbers_stay_apart():
    m = [mm("a", "Gina adopted 2 cats.", 0.9), mm("b", "Gina adopted cats in May 2023.")]
    assert ExtractiveMerger().merge_text(m) == "Gina adopted 2 cats. Gina adopted cats in May 2023."
    m = [mm("a", "Went to Paris in 2019."), mm("b", "Went to Paris in 2021.")]
    assert ExtractiveMerger().merge_text(m) == "Went to Paris in 2019. Went to Paris in 2021."


def test_a_negated_sentence_is_kept_unless_a_kept_one_says_it():
    m = [mm("a", "Gina moved to Berlin in 2020.", 0.9), mm("b", "Gina does not like Berlin.")]
    assert ExtractiveMerger().merge_text(m) == (
        "Gina moved to Berlin in 2020. Gina does not like Berlin."
    )
    m = [mm("a", "Gina does not eat meat, she said.", 0.9), mm("b", "Gina does not eat meat.")]
    assert ExtractiveMerger().merge_text(m) == "Gina does not eat meat, she said."
    # the same words with the other polarity are another fact
    m = [mm("a", "Gina eats meat."), mm("b", "Gina does not eat meat.")]
    assert ExtractiveMerger().merge_text(m) == "Gina eats meat. Gina does not eat meat."


def test_merging_a_merged_text_again_does_not_grow_it():
    merger = ExtractiveMerger()
    first = merger.merge_text(
        [mm("a", "Gina adopted 2 cats in 2021.", 0.9), mm("b", "Gina moved to Berlin.")]
    )
    assert first == "Gina adopted 2 cats in 2021. Gina moved to Berlin."
    # the merged record's facts are older than the members that join it later
    again = merger.merge_text(
        [
            MergeMember("m", first, 0.9, 10.0, 2.0, 5.0),
            MergeMember("c", "Gina adopted two cats in 2021.", 0.5, 10.0, 1.0, 10.0),
            MergeMember("d", "Gina moved to Berlin.", 0.5, 10.0, 1.0, 10.0),
        ]
    )
    assert again == first


def test_a_merged_member_is_merged_again_from_its_sources():
    merged = MergeMember(
        "m",
        "Gina has cats.",
        0.9,
        10.0,
        2.0,
        1.0,
        sources=("Gina adopted 2 cats.", "Gina has cats."),
    )
    new = MergeMember("c", "Gina has cats and a dog.", 0.5, 10.0, 1.0, 2.0)
    # the drifted text of the merged record is not read; its sources are
    assert ExtractiveMerger().merge_text([merged, new]) == (
        "Gina adopted 2 cats. Gina has cats and a dog."
    )


def test_max_chars_declines_instead_of_cutting():
    req = MergeRequest(
        "c",
        "u",
        (mm("a", "Gina adopted 2 cats in 2021.", 0.9), mm("b", "Gina moved to Berlin in 2019.")),
    )
    full = ExtractiveMerger().merge_batch([req])[0]
    assert full.text == "Gina adopted 2 cats in 2021. Gina moved to Berlin in 2019."
    short = ExtractiveMerger(max_chars=40).merge_batch([req])[0]
    assert short.text is None and "58 characters > max_chars 40" in short.note


class Lossy:
    """A merger that drops the members' numbers (as a careless model might)."""

    name = "lossy"
    handles_conflicts = False

    def merge_batch(self, requests):
        return [MergeResponse("Gina has cats") for _ in requests]


def test_the_pass_refuses_a_merge_that_loses_a_fact():
    rows = [
        {
            "id": "a",
            "namespace": "u",
            "text": "Gina has 2 cats",
            "vector": [1.0, 0.0],
            "created_at": 10.0,
            "last_used": 10.0,
            "importance": 0.6,
        },
        {
            "id": "b",
            "namespace": "u",
            "text": "Gina has two cats",
            "vector": [0.999, 0.03],
            "created_at": 20.0,
            "last_used": 20.0,
            "importance": 0.5,
        },
    ]
    res = run_pass(
        make_records(rows),
        cfg=PassConfig(threshold=0.9, now="100", decay=False),
        merger=Lossy(),
        wall_h=200.0,
    )
    assert res.stats["merges"] == 0 and res.stats["merges_losing_facts"] == 1
    assert res.stats["members_lost"] == 0 and res.stats["members_lost_refused"] == 2
    [ev] = [e for e in res.events if e["op"] == "merge_declined"]
    assert ev["ids"] == ["a", "b"]
    assert ev["lost_members"] == {"a": ["Gina has 2 cats"], "b": ["Gina has two cats"]}
    assert ev["note"] == (
        "merged text loses the content of 2 member(s): a: Gina has 2 cats; b: Gina has two cats"
    )
    m = res.records.meta.set_index("id")
    assert math.isnan(m.loc["a", "deleted_at"]) and math.isnan(m.loc["b", "deleted_at"])
    assert "merge_text_ratio_mean" not in res.stats


class Recorder(ExtractiveMerger):
    """The extractive merger, keeping every request it was sent."""

    def __init__(self):
        super().__init__()
        self.requests = []

    def merge_batch(self, requests):
        self.requests += requests
        return super().merge_batch(requests)


def test_sources_follow_merges_of_merges_down_to_the_original_records():
    from consolidate.store.schema import Records

    def row(i, text, vec, t):
        return {
            "id": i,
            "namespace": "u",
            "text": text,
            "vector": vec,
            "created_at": t,
            "last_used": t,
            "importance": 0.5,
        }

    cfg = PassConfig(threshold=0.9, now="100", decay=False)
    recs = make_records(
        [
            row("a", "Gina adopted 2 cats.", [1.0, 0.0], 1.0),
            row("b", "Gina adopted two cats.", [0.999, 0.03], 2.0),
        ]
    )
    r1 = run_pass(recs, cfg=cfg, wall_h=101.0)
    recs = Records.concat(
        [r1.records, make_records([row("c", "Gina has 2 cats.", [0.998, 0.05], 3.0)])], 2
    )
    r2 = run_pass(recs, cfg=cfg, version=2, wall_h=102.0)
    [m2] = [e["id"] for e in r2.events if e["op"] == "merge"]
    recs = Records.concat(
        [r2.records, make_records([row("d", "Gina keeps 2 cats.", [0.997, 0.06], 4.0)])], 2
    )
    rec = Recorder()
    run_pass(recs, cfg=cfg, merger=rec, version=3, wall_h=103.0)
    [req] = rec.requests
    by_id = {m.id: m for m in req.members}
    # the second merge's record stands for a, b (through the first merge) and c
    assert by_id[m2].sources == (
        "Gina adopted 2 cats.",
        "Gina adopted two cats.",
        "Gina has 2 cats.",
    )
    assert by_id[m2].merge_texts == by_id[m2].sources
    assert by_id["d"].sources == () and by_id["d"].merge_texts == ("Gina keeps 2 cats.",)


@pytest.mark.parametrize(
    "texts,want",
    [
        # a negated sentence stays unless a kept one denies the same thing
        (
            ("Caroline is not going to the gym in May.", "Caroline is not vegan."),
            "Caroline is not going to the gym in May. Caroline is not vegan.",
        ),
        (("I don't like cats", "I don't like dogs"), "I don't like cats. I don't like dogs."),
        # "encourages" is not "tells warmly": both are kept
        (
            ("Gina encourages Jon not to give up.", "Gina tells Jon warmly not to give up."),
            "Gina encourages Jon not to give up. Gina tells Jon warmly not to give up.",
        ),
        # the member that says more is the base
        (
            ("I have 2 cats", "I have 2 cats and I'm allergic to peanuts"),
            "I have 2 cats and I'm allergic to peanuts",
        ),
        # names in any script, acronyms, after an abbreviation, with an apostrophe
        (("I met José today", "I met José and Zoë today"), "I met José and Zoë today"),
        (("I met NASA engineers", "I met NASA and ESA engineers"), "I met NASA and ESA engineers"),
        (("O'Brien came to the party", "O'Brien came to the party!"), "O'Brien came to the party"),
        # an appended clause becomes a sentence
        (
            ("Gina moved to Berlin in 2019 with Jon", "Gina moved in 2019; she works at Zalando"),
            "Gina moved to Berlin in 2019 with Jon. She works at Zalando.",
        ),
    ],
)
def test_what_the_merger_keeps(texts, want):
    members = [mm(str(k), t, 0.9 - 0.1 * k) for k, t in enumerate(texts)]
    text, why = ExtractiveMerger().checked_text(members)
    assert (text, why) == (want, "")
    assert lost_facts(text, list(texts)) == []


@pytest.mark.parametrize("texts", [("   ", "x"), (",", "."), ("...", "!")])
def test_members_without_words_give_no_empty_merge(texts):
    members = [mm(str(k), t) for k, t in enumerate(texts)]
    text, why = ExtractiveMerger().checked_text(members)
    assert text is None or any(c.isalnum() for c in text)
    if text is None:
        assert "no words" in why


def test_lost_facts_names_in_any_script():
    assert lost_facts("I met José", ["I met José and Zoë"]) == ["name Zoë"]
    assert lost_facts("Jon thanks Maria", ["Jon thanks Maria's family"]) == []
    assert lost_facts("I saw him", ["I saw Dr. Smith"]) == ["name Dr", "name Smith"]
