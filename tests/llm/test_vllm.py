"""The ``vllm`` backend with the real engine (vLLM's CPU build in ``.venv-vllm``; see
``scripts/setup_vllm.sh``): batched ``LLM.chat``, JSON-schema outputs, token accounting, and
a pass with ``merge=llm`` over it. Structure only: SmolLM2-135M's wording means nothing.

Skipped where vLLM is not installed (the main ``.venv``); ``scripts/test.sh`` runs this file
in ``.venv-vllm``.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from consolidate.llm.decide import DecideOut
from consolidate.llm.extract import ExtractOut
from consolidate.llm.merger import MergeOut
from tests.helpers import require_smollm2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm not installed (.venv-vllm has it)"
    ),
]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    require_smollm2()
    path = tmp_path_factory.mktemp("vllm") / "out.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "llm" / "vllm_check.py"), str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(path.read_text())


def test_batched_chat_with_json_schema(out):
    assert out["backend"] == "VLLMBackend"  # built from consolidate/conf/merge/vllm.yaml
    assert out["n_requests"] == len(out["raw"]) == len(out["tokens"]) == 6
    assert all(pt > 0 and ct > 0 for pt, ct in out["tokens"])
    schemas = [MergeOut] * 3 + [DecideOut] * 2 + [ExtractOut]
    for raw, fin, schema in zip(out["raw"], out["finish"], schemas, strict=True):
        assert fin in ("stop", "length")
        if fin == "stop":  # constrained decoding: a finished answer is valid schema JSON
            schema.model_validate(json.loads(raw))
        else:  # cut at max_tokens: still a JSON prefix in the schema's shape
            assert raw.lstrip().startswith("{")
    # our parsers accept every finished decide/extract answer
    finished = [f == "stop" for f in out["finish"]]
    assert all(p for p, f in zip(out["decides_parsed"], finished[3:5], strict=True) if f)
    assert out["facts_parsed"] or not finished[5]


def test_pass_with_the_vllm_merger(out):
    s = out["pass_stats"]
    assert s["merger"] == "llm:vllm" and s["clusters"] == 1
    assert 1 <= s["model_calls"] <= 2  # one call, one retry at most
    assert s["prompt_tokens"] > 0 and s["completion_tokens"] > 0
    ops = out["pass_ops"]
    assert ops in (["merge"], ["merge_declined"])
    ids = out["pass_ids"]
    assert {"a", "b", "c"} <= set(ids)  # nothing lost: members stay as tombstones
    assert len(ids) == (4 if ops == ["merge"] else 3)
    # provenance kept: the merged record carries both members' sources
    if ops == ["merge"]:
        assert out["pass_sources"] == ["D1:1", "D1:1", "D1:2", "D1:2"]


class _CacheOnly:
    """vLLM's backend name and the model folder, without an engine: every answer must come
    from the response cache (a call fails the test)."""

    name = "vllm"

    def __init__(self, model):
        self.model = model

    def chat(self, requests):
        raise AssertionError(f"{len(requests)} requests missed the cache")


def test_fleet_run_with_ray_data_llm_as_the_merge_stage(tmp_path, monkeypatch, compose_cfg):
    """runner=ray runner.llm=ray_data merge=vllm: the merge prompts of every shard go to
    Ray Data's vLLM processor (ray.data.llm, vLLM's CPU build on a local 2-CPU cluster);
    the records equal a single-process pass's with the same answers, which it finds in the
    response cache the fleet run filled."""
    pytest.importorskip("ray.data.llm")
    require_smollm2()
    from omegaconf import OmegaConf

    import consolidate.store.lance.writing as ls
    from consolidate.config import PassConfig, RunnerConfig, SimilarityConfig
    from consolidate.fleet import run_fleet_pass
    from consolidate.llm.merger import LLMMerger
    from consolidate.pipeline import run_pass
    from consolidate.store.lance import LanceStore
    from tests.test_fleet import WALL, events, fleet_records, same_store

    monkeypatch.setattr(ls, "REWRITE_FRACTION", 1.01)  # both commits upsert (test_fleet)
    cfg = compose_cfg(
        "consolidate",
        overrides=[
            "merge=vllm",
            "runner=ray",
            "runner.llm=ray_data",
            "runner.num_cpus=2",
            "runner.actors=1",
            f"merge.cache_path={tmp_path / 'llm_cache.sqlite'}",
            "merge.max_tokens=48",
        ],
    )
    merge = OmegaConf.to_container(cfg.merge, resolve=True)
    rc = RunnerConfig(**OmegaConf.to_container(cfg.runner, resolve=True))
    recs = fleet_records(n=200)  # 2 namespaces, planted near-duplicates
    a, b = LanceStore(tmp_path / "single"), LanceStore(tmp_path / "fleet")
    for s in (a, b):
        s.create(recs)
    pc, sim = PassConfig(force=True), SimilarityConfig(device="cpu")
    with b.lock():
        out = run_fleet_pass(
            b, namespaces=None, pass_cfg=pc, sim_cfg=sim, runner=rc, merge=merge, wall_h=WALL
        )
    fs, llm = out["stats"], out["fleet"]["llm"]
    assert fs.merger == "llm:vllm" and fs.clusters > 0
    assert llm["requests"] == fs.model_calls >= fs.clusters and llm["cached"] == 0
    assert llm["rounds"] == 1 + (fs.model_calls > fs.clusters)
    assert fs.prompt_tokens > 0 and fs.completion_tokens > 0
    from consolidate.llm.transformers_backend import resolve_model_path

    model = str(resolve_model_path(None, merge["backend_kwargs"]["cache_dir"]))
    merger = LLMMerger(backend=_CacheOnly(model), cache_path=merge["cache_path"], max_tokens=48)
    with a.lock():
        snap = a.load()
        res = run_pass(
            snap.records, cfg=pc, sim_cfg=sim, merger=merger, version=snap.version + 1, wall_h=WALL
        )
        info = a.commit(res.records, res.events, base=snap, pass_time_h=WALL)
    same_store(a, b)
    assert events(a, info["changelog"]) == events(b, out["commit"]["changelog"])
    assert res.stats.merges == fs.merges
