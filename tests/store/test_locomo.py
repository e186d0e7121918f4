"""LOCOMO importer on the real file (read in place from ../shared/data)."""

from datetime import datetime, timezone

import numpy as np
import pytest

from consolidate.config import ImportanceConfig
from consolidate.store.locomo import (
    LOCOMO_SHA256,
    heuristic_importance,
    locomo_records,
    parse_evidence,
    parse_session_time,
    read_locomo_observations,
)
from tests.helpers import LOCOMO

needs_locomo = pytest.mark.skipif(not LOCOMO.exists(), reason=f"{LOCOMO} not present")


def test_parse_session_time():
    assert parse_session_time("1:56 pm on 8 May, 2023") == datetime(
        2023, 5, 8, 13, 56, tzinfo=timezone.utc
    )
    assert parse_session_time("10:04 am on 19 December, 2023").hour == 10
    with pytest.raises(ValueError, match="unrecognised"):
        parse_session_time("yesterday")


def test_parse_evidence_shapes():
    assert parse_evidence("D1:3") == (["D1:3"], [])
    assert parse_evidence(["D15:3", "D15:5"]) == (["D15:3", "D15:5"], [])
    assert parse_evidence("D26:14, D26:34; D26:42 D1:1") == (
        ["D26:14", "D26:34", "D26:42", "D1:1"],
        [],
    )
    assert parse_evidence("D:5 D2:1") == (["D2:1"], ["D:5"])


def test_heuristic_importance_by_hand():
    cfg = ImportanceConfig()
    assert heuristic_importance("Gina likes tea", cfg) == pytest.approx(0.4)
    assert heuristic_importance("Gina has 2 cats", cfg) == pytest.approx(0.55)
    assert heuristic_importance("Gina plans to move in May 2024", cfg) == pytest.approx(0.85)


@needs_locomo
def test_every_observation_becomes_a_memory():
    obs, rep = read_locomo_observations(LOCOMO)
    assert len(obs) == 2541 and rep.conversations == 10 and rep.observations == 2541
    assert rep.sha256 == LOCOMO_SHA256
    assert len({o.id for o in obs}) == 2541
    assert len({o.namespace for o in obs}) == 20
    assert rep.malformed_evidence == [] and rep.bad_times == []
    multi = [o for o in obs if len(o.source_ids) > 1]
    assert len(multi) == 15  # 10 list-valued + 5 comma-joined evidence strings
    first = obs[0]
    assert first.namespace == "conv-26/Caroline" and first.source_ids == ["D1:3"]
    assert first.time_h == datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc).timestamp() / 3600


class FakeEmbedder:
    dim = 8

    def encode(self, texts):
        g = np.random.default_rng(len(texts))
        v = g.normal(size=(len(texts), self.dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


@needs_locomo
def test_locomo_records_validate():
    from consolidate.store.schema import validate

    recs, _ = locomo_records(LOCOMO, FakeEmbedder(), conversations=2)
    assert len(recs) == len(read_locomo_observations(LOCOMO, 2)[0])
    assert validate(recs, dim=8) == []
    m = recs.meta
    assert (m["created_at"] == m["last_used"]).all() and (m["strength"] == 1).all()
    assert m["importance"].between(0, 1).all()
