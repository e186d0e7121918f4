"""The conflict guard's rules (consolidate.ops.guard.conflict_reason), each on small pairs of
statements that an embedding scores as near-duplicates, with a paraphrase of each that must
stay mergeable."""

import pytest

from consolidate.ops.guard import conflict_reason, conflict_signature


@pytest.mark.parametrize(
    "a,b,why",
    [
        # exclusive values: a rare word, a name, an identifier, one character of an id
        ("Uses vim as main editor", "Uses emacs as main editor", "value"),
        ("Prefers PostgreSQL for work", "Prefers MySQL for work", "value"),
        ("Moved to Lisbon last year", "Moved to Porto last year", "value"),
        ("Backup plan is Plan B", "Backup plan is Plan C", "value"),
        ("Order x7f3k2 was shipped", "Order x7f3k9 was shipped", "value"),
        ("The door code is 4711A", "The door code is 4711B", "value"),
        ("Her key starts with sk-abc", "Her key starts with sk-abd", "value"),
        ("Keeps a cat at home", "Keeps a car at home", "value"),
        # polarity: opposite pairs and negative prefixes
        ("Dark mode is enabled", "Dark mode is disabled", "opposite"),
        ("Pets are allowed in the flat", "Pets are forbidden in the flat", "opposite"),
        ("Lives near the station", "Lives far from the station", "opposite"),
        ("Likes spicy noodle soup", "Hates spicy noodle soup", "opposite"),
        ("Is happy with the new job", "Is unhappy with the new job", "opposite"),
        ("Likes jazz concerts", "Dislikes jazz concerts", "opposite"),
        ("The bakery is open on Sundays", "The bakery is closed on Sundays", "opposite"),
        # roles: the same words, two of them swapped around a third
        ("Jon thanks Gina for the gift", "Gina thanks Jon for the gift", "roles"),
        ("The dog chases the cat in the garden", "The cat chases the dog in the garden", "roles"),
        # roles swapped around a preposition; a name after an abbreviation; big number words
        ("Moved from Boston to Denver", "Moved from Denver to Boston", "roles"),
        ("Prefers cats to dogs", "Prefers dogs to cats", "roles"),
        ("Saw Dr. Smith today", "Saw Dr. Jones today", "value"),
        ("Is sixty years old", "Is seventy years old", "number"),
        ("Finished her sixth book", "Finished her seventh book", "number"),
        # a lone capital letter inside a sentence is an identifier (a revision, a grade)
        ("Manual revision A covers the pump", "Manual revision B covers the pump", "value"),
        ("Is a grade A student", "Is a grade B student", "value"),
        # one more negation on one side is the opposite
        ("Takes coffee with no sugar", "Takes coffee with sugar", "negation"),
        # a prefixed word matches a negation only where the negation governs its stem
        ("Dislikes jazz", "Likes jazz, not rock", "negation"),
        ("Dislikes jazz", "Does not dislike jazz", "negation"),
        ("Dislikes hot weather", "Does not like cold weather", "negation"),
        # ... and only where the rest says the same words (a prefix that means "not")
        ("Tom is unhappy", "No, Tom is happy", "negation"),
        ("Tom is unhappy", "Tom is happy and Anna is not happy", "negation"),
        ("Tom is unhappy at work", "Tom is never anything but happy at work", "negation"),
        ("Tom dislikes cats", "Tom does not like dogs but likes cats", "negation"),
        ("Tom dislikes tea", "Tom doesn't like coffee; Tom likes tea", "negation"),
        ("Anna dislikes jazz", "Not only Anna likes jazz", "negation"),
        ("The report uncovers the fraud", "The report does not cover the fraud", "negation"),
        # the older rules still come first
        ("Has 2 cats", "Has 3 cats", "number"),
        ("Lives in Berlin", "Does not live in Berlin", "negation"),
        ("Moved on 3 March", "Moved on 3 June", "date"),
    ],
)
def test_flagged(a, b, why):
    assert conflict_reason(a, b) == why
    assert conflict_reason(b, a) == why


@pytest.mark.parametrize(
    "a,b",
    [
        ("Uses vim as main editor", "Uses vim as the main editor"),
        ("Prefers PostgreSQL for work", "For work she prefers PostgreSQL"),
        ("Gina lost her job at Door Dash", "Gina lost her job at Door Dash last month"),
        ("A man is slicing a potato", "A man is cutting a potato"),
        ("The kids play in the park", "The children play in the park"),
        ("Jon is grateful for Gina's support", "Jon appreciates Gina's support"),
        # a passive on one side only reverses the order without swapping the roles
        ("The dog chases the cat in the garden", "The cat is chased by the dog in the garden"),
        # a compound reordered ("slices of bread" / "bread slices") is no role swap
        ("A man puts garlic on slices of bread", "A man puts garlic on bread slices"),
        # a word on one side only is extra detail, not an opposite value
        ("Lives in a big house", "Lives in a house"),
        # forms of one name; inflections of common words ("shredding" -> "shred")
        ("Two blasts hit the Syria capital", "Two blasts hit the Syrian capital"),
        ("Kim is shredding cabbage with a knife", "Kim is chopping cabbage with a knife"),
        # two spellings of one word
        ("My car is grey", "My car is gray"),
        ("Likes to organise events", "Likes to organize events"),
        # in a title-case text capitals mark no names
        ("Local Team Wins Final Match At Home", "Local Team Wins Last Match At Home"),
        # as many negations on each side, in other words: the same polarity
        ("Takes coffee with no sugar", "Takes her coffee without sugar"),
        ("Never eats meat", "Does not eat meat"),
        # a negative prefix against a negation of its stem: the same polarity
        ("Dislikes loud music", "Does not like loud music"),
        ("Is unhappy at work", "Is not happy at work"),
        ("Dislikes jazz", "Doesn't really like jazz"),
        ("A manual covers the pump", "A manual covers the pump well"),
    ],
)
def test_not_flagged(a, b):
    assert conflict_reason(a, b) is None
    assert conflict_reason(b, a) is None


def test_signature_fields():
    s = conflict_signature("Jon uses vim with GPU v2 in Berlin. Nice dogs")
    values = {w for w, v in s.words if v}
    # identifiers, a name inside the sentence, a word outside the embedder's vocabulary; a
    # capitalised word that starts a sentence is not a value by its capital alone
    assert values == {"vim", "gpu", "v2", "berlin"}
    assert s.roles == ("jon", "use", "vim", "gpu", "v2", "in", "berlin", "nice", "dog")
    assert s.poles  # "in" is a pole of the in/out group
    assert conflict_signature("unhappy and disabled").negated_stems == {"happy", "abled"}
    # capitals inside a sentence make names, unless half the longer words are capitalised
    assert [v for _, v in conflict_signature("Team Wins Final At Home").words] == [False] * 5
    assert [v for _, v in conflict_signature("Gina met Jon at home").words] == [
        False,
        False,
        True,
        False,
        False,
    ]


def test_long_texts_stay_linear_enough():
    """Texts of thousands of words that differ in many places: the alignment is bounded
    (no quadratic difflib), and a name changed at the start is still found."""
    words = [f"w{k}x" for k in range(3000)]
    a = "Gina met " + " ".join(words) + "."
    b = "Gina met " + " ".join(reversed(words)) + "."
    # the same words reversed: more than _MAX_ROLES of them, so no roles check; no value
    # replaced by one the other text lacks
    assert conflict_reason(a, b) is None and conflict_reason(b, a) is None
    c = "Jon said " + " ".join(words)
    d = "Max said " + " ".join(words)
    assert conflict_reason(c, d) is None  # sentence-initial names are no values
    e = "He told Jon " + " ".join(words)
    f = "He told Max " + " ".join(words)
    assert conflict_reason(e, f) == "value"


def test_hand_written_identifier_and_paraphrase_pairs():
    """The calibration report's pair set: every identifier pair flagged, paraphrases at most
    5% (one pair: "Is vegetarian" / "Does not eat meat", which needs world knowledge)."""
    from consolidate.evaluation.calibrate import guard_pair_rates, load_guard_pairs

    df = load_guard_pairs()
    assert (df["kind"] == "identifier").sum() >= 40 and (df["kind"] == "paraphrase").sum() >= 40
    rates = {r["kind"]: r for r in guard_pair_rates()}
    assert rates["identifier"]["flagged"] == rates["identifier"]["pairs"] == 45
    assert rates["paraphrase"]["flagged"] == 1 and rates["paraphrase"]["reasons"] == "negation 1"
    assert rates["paraphrase"]["flagged_share"] <= 0.05


def test_guard_pairs_bad_line_is_named(tmp_path):
    from consolidate.evaluation.calibrate import load_guard_pairs

    p = tmp_path / "pairs.jsonl"
    p.write_text('{"a": "x", "b": "y", "kind": "identifier"}\n{"a": "x", "kind": "paraphrase"}\n')
    with pytest.raises(ValueError, match=r"pairs\.jsonl: line 2: needs text a, text b"):
        load_guard_pairs(p)


@pytest.mark.parametrize(
    "text",
    [
        "Jordan Opens First Tent Camp",
        "He doesn't dislike the new flat. She moved in May!",
        "the the cat follows the fish to the cat",
        "Uses GPU v2 at 3 pm on Monday",
        "",
    ],
)
def test_signature_is_the_dataclass_it_would_construct(text):
    """conflict_signature builds its signature without the dataclass's __init__: it must be
    the same object the constructor makes (equal, same hash, frozen, replace works)."""
    import dataclasses

    from consolidate.ops.guard import ConflictSignature

    sig = conflict_signature(text)
    built = ConflictSignature(**{f.name: getattr(sig, f.name) for f in dataclasses.fields(sig)})
    assert sig == built and hash(sig) == hash(built)
    assert vars(sig) == vars(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sig.poles = ()  # type: ignore[misc]
    assert dataclasses.replace(sig, poles=((0, 1),)).poles == ((0, 1),)
    # the first word of a sentence is read as it stands, the later ones as kept inside one
    if text.startswith("Jordan"):
        assert sig.word_list == ("jordan", "opens", "first", "tent", "camp")
        assert sig.value_set == frozenset()  # title case: capitals are no names
