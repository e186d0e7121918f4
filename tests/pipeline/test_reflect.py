"""Reflection in the pass: one new memory per group of related memories, linked to them."""

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from consolidate.config import PassConfig
from consolidate.llm.reflect import LLMReflector, ReflectOut, invented
from consolidate.pipeline import run_pass
from tests.helpers import Scripted, make_records

CFG = PassConfig(
    threshold=0.9, now="100", decay=False, reflect=True, reflect_threshold=0.75, reflect_min_size=3
)


def rows():
    # three notes at pairwise cosine 1/1.3025 = 0.768 (related, not duplicates), one apart
    texts = ["Gina adopted 2 cats", "Gina walks her dog daily", "Gina volunteers at a shelter"]
    out = []
    for k, t in enumerate(texts):
        v = [1.0, 0.0, 0.0, 0.0, 0.0]
        v[k + 1] = 0.55
        out.append(
            {
                "id": f"g{k}",
                "namespace": "u",
                "text": t,
                "vector": v,
                "importance": 0.3 + 0.1 * k,
                "last_used": 10.0 + k,
                "created_at": 5.0 + k,
                "source_ids": [f"D1:{k}"],
            }
        )
    out.append(
        {
            "id": "z",
            "namespace": "u",
            "text": "Gina dislikes rain",
            "vector": [0.0, 0.0, 0.0, 0.0, 1.0],
        }
    )
    return out


def run(answers, recs=None, version=1):
    be = Scripted(answers)
    res = run_pass(
        recs or make_records(rows()),
        cfg=CFG,
        version=version,
        reflector=LLMReflector(be, cache_path=None),
        wall_h=200.0,
    )
    return res, be


def test_reflection_is_a_new_memory_linked_to_its_sources():
    res, be = run([json.dumps({"text": "Gina cares for animals"})])
    m = res.records.meta.set_index("id")
    refl = m[m["derived_from"].map(len) > 0]
    assert len(refl) == 1
    r = refl.iloc[0]
    assert r["text"] == "Gina cares for animals"
    assert r["derived_from"] == ["g0", "g1", "g2"]
    assert r["source_ids"] == ["D1:0", "D1:1", "D1:2"]
    assert r["importance"] == pytest.approx(0.5) and r["strength"] == 1.0
    assert r["last_used"] == 12.0
    # members untouched and live; 4 in, 5 out
    assert m.loc[["g0", "g1", "g2", "z"], "deleted_at"].isna().all() and len(m) == 5
    assert res.stats["reflections"] == 1 and res.stats["reflect_calls"] == 1
    assert res.stats["reflect_prompt_tokens"] == 7 and res.stats["merges"] == 0
    # the prompt shows every member, most important first
    prompt = be.seen[0].messages[-1]["content"]
    assert prompt.index("shelter") < prompt.index("dog") < prompt.index("cats")
    assert be.seen[0].json_schema == ReflectOut.model_json_schema()
    # its vector is the normalised centroid of the (equal-strength) members:
    # sum = (3, .55, .55, .55, 0), norm = sqrt(9 + 3 * .3025)
    v = res.records.vectors[list(m.index).index(refl.index[0])]
    norm = (9 + 3 * 0.55**2) ** 0.5
    assert v.tolist() == pytest.approx(
        [3 / norm, 0.55 / norm, 0.55 / norm, 0.55 / norm, 0], abs=1e-6
    )


def test_covered_groups_are_not_reflected_again():
    first, _ = run([json.dumps({"text": "Gina cares for animals"})])
    again, be = run([], recs=first.records, version=2)
    assert again.stats["reflections"] == 0 and again.stats["reflect_calls"] == 0
    assert be.seen == []


def test_invented_names_are_rejected_after_one_retry():
    bad = json.dumps({"text": "Gina and Bob care for animals"})
    res, be = run([bad, bad])
    assert res.stats["reflections"] == 0 and res.stats["reflect_calls"] == 2
    ev = [e for e in res.events if e["op"] == "reflect_declined"]
    assert len(ev) == 1 and "added name Bob" in ev[0]["note"]
    assert len(be.seen) == 2 and "rejected" in be.seen[1].messages[-1]["content"]


def test_invented_by_hand():
    members = ["Gina adopted 2 cats", "Gina walks her dog"]
    assert invented("Gina loves her 2 cats and dog", members) == []
    assert invented("Gina has 3 pets, says Tom", members) == ["added name Tom", "added number 3"]


def test_reflect_needs_a_reflector():
    with pytest.raises(ValueError, match="reflector"):
        run_pass(make_records(rows()), cfg=CFG, wall_h=200.0)


# ---------------------------------------------------------------- regressions (break-it review)
def test_a_reflection_is_never_merged_with_its_members():
    # its vector (the centroid) is at cosine 0.92 to each member, above the merge threshold
    first, _ = run([json.dumps({"text": "Gina cares for animals"})])
    again, be = run([], recs=first.records, version=2)
    assert again.stats["merges"] == 0 and again.stats["pairs"] == 0
    assert again.records.meta["deleted_at"].isna().all()


def test_a_dropped_reflection_is_not_written_again_every_night():
    # members at strength 2, the reflection at 1: with decay it scores lowest and the cap of
    # 3 drops it
    cfg = dataclasses.replace(CFG, cap=3, decay=True, floor=0.0)
    recs = make_records([dict(r, strength=2.0, importance=0.5, last_used=12.0) for r in rows()[:3]])
    calls = []
    for night in (1, 2, 3):
        be = Scripted([json.dumps({"text": "Gina cares for animals"})])
        res = run_pass(
            recs,
            cfg=cfg,
            version=night,
            wall_h=200.0 + night,
            reflector=LLMReflector(be, cache_path=None),
        )
        calls.append(len(be.seen))
        recs = res.records
    assert calls == [1, 0, 0]
    m = recs.meta
    assert (m["derived_from"].map(len) > 0).sum() == 1  # one reflection record, dropped by cap
    assert m.loc[m["derived_from"].map(len) > 0, "deleted_reason"].tolist() == ["cap"]


def test_derived_from_follows_merges():
    first, _ = run([json.dumps({"text": "Gina cares for animals"})])
    dup = make_records([dict(rows()[0], id="g0b", text="Gina adopted 2 cats!")])
    recs = type(first.records)(
        pd.concat([first.records.meta, dup.meta], ignore_index=True),
        np.concatenate([first.records.vectors, dup.vectors]),
    )
    again, be = run([], recs=recs, version=2)
    m = again.records.meta.set_index("id")
    merged = next(e for e in again.events if e["op"] == "exact_merge")
    assert merged["members"] == ["g0", "g0b"]
    refl = m[m["derived_from"].map(len) > 0]
    assert len(refl) == 1 and be.seen == []  # still covered: no second reflection
    assert refl.iloc[0]["derived_from"] == sorted(["g1", "g2", merged["id"]])
    assert m.loc[refl.iloc[0]["derived_from"], "deleted_at"].isna().all()


@pytest.mark.parametrize(
    "bad",
    [
        {"reflect_threshold": float("nan")},
        {"reflect_min_size": 0},
        {"reflect_max_per_namespace": 1.5},
    ],
)
def test_bad_reflect_settings_are_refused(bad):
    with pytest.raises(ValueError, match="sleep.reflect"):
        run_pass(
            make_records(rows()),
            cfg=dataclasses.replace(CFG, **bad),
            wall_h=200.0,
            reflector=LLMReflector(Scripted([]), cache_path=None),
        )
