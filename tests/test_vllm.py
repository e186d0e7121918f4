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
from tests.conftest import require_smollm2

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm not installed (.venv-vllm has it)")]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    require_smollm2()
    path = tmp_path_factory.mktemp("vllm") / "out.json"
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_check.py"), str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(path.read_text())


def test_batched_chat_with_json_schema(out):
    assert out["backend"] == "VLLMBackend"  # built from configs/merge/vllm.yaml
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
