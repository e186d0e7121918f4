"""Run the ``vllm`` backend for real (vLLM's CPU build here, any vLLM on a GPU box) and write
what came back as JSON. Called by ``tests/llm/test_vllm.py`` in a subprocess: vLLM starts its
workers with ``spawn``, which needs this ``__main__`` guard.

Usage: python tests/llm/vllm_check.py OUT.json
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.helpers


def main(out_path: str) -> None:
    from hydra.utils import instantiate

    from consolidate.config import PassConfig
    from consolidate.llm.decide import Neighbour, decide_request, parse_decisions
    from consolidate.llm.extract import Turn, extract_request, parse_facts
    from consolidate.llm.merger import merge_chat_request, parse_merge
    from consolidate.ops.merge import MergeMember, MergeRequest
    from consolidate.pipeline import run_pass
    from tests.helpers import compose_cfg, make_records

    # the merger exactly as `consolidate merge=vllm` builds it (consolidate/conf/merge/vllm.yaml)
    cfg = compose_cfg(
        "consolidate", overrides=["merge=vllm", "merge.cache_path=null", "merge.max_tokens=64"]
    )
    t = time.perf_counter()
    merger = instantiate(cfg.merge)
    start_s = time.perf_counter() - t
    be = merger.backend

    def mem(i, text):
        return MergeMember(i, text, 0.5, 1.0, 1.0, 1.0)

    clusters = [
        MergeRequest(
            "m1",
            "u",
            (mem("a", "Gina adopted 2 cats in May"), mem("b", "Gina adopted two cats in May 2023")),
        ),
        MergeRequest(
            "m2",
            "u",
            (mem("c", "Jon runs a dance studio"), mem("d", "Jon opened his own dance studio")),
        ),
        MergeRequest(
            "m3",
            "u",
            (
                mem("e", "Caroline is a counsellor"),
                mem("f", "Caroline works as a counsellor for LGBTQ youth"),
            ),
        ),
    ]
    nbs = [
        Neighbour(1, "x", "Gina has a cat", False),
        Neighbour(2, "y", "Gina lives in Paris", False),
    ]
    reqs = (
        [merge_chat_request(c, 64) for c in clusters]
        + [
            decide_request(["Gina has two cats", "Gina moved to Rome"], nbs, 96),
            decide_request(["Jon likes jazz"], [], 64),
        ]
        + [
            extract_request(
                Turn("t1", "u", "Gina", "I adopted two kittens last week!", 466000.0, "user"),
                "8 May 2023",
                96,
            )
        ]
    )
    t = time.perf_counter()
    resp = be.chat(reqs)
    batch_s = time.perf_counter() - t
    merges = [parse_merge(r.text) for r in resp[:3]]
    decides = [parse_decisions(resp[3].text, 2, nbs), parse_decisions(resp[4].text, 1, [])]
    facts = parse_facts(resp[5].text)

    # the pass with merge=llm over vllm: structure only
    recs = make_records(
        [
            {
                "id": "a",
                "namespace": "u",
                "text": "Gina adopted 2 cats in May",
                "vector": [1.0, 0.0],
                "importance": 0.7,
                "source_ids": ["D1:1"],
            },
            {
                "id": "b",
                "namespace": "u",
                "text": "Gina adopted two cats in May",
                "vector": [0.999, 0.04],
                "importance": 0.5,
                "source_ids": ["D1:2"],
            },
            {"id": "c", "namespace": "u", "text": "Jon likes jazz", "vector": [0.0, 1.0]},
        ]
    )
    res = run_pass(
        recs, cfg=PassConfig(threshold=0.9, now="6", decay=False), merger=merger, wall_h=7.0
    )
    out = {
        "backend": type(be).__name__,
        "start_s": start_s,
        "batch_s": batch_s,
        "n_requests": len(reqs),
        "raw": [r.text for r in resp],
        "tokens": [[r.prompt_tokens, r.completion_tokens] for r in resp],
        "finish": [r.extra.get("finish_reason") for r in resp],
        "merges_parsed": [m is not None for m in merges],
        "decides_parsed": [d is not None for d in decides],
        "decide_ops": [[x.op for x in d] if d else None for d in decides],
        "facts_parsed": facts is not None,
        "pass_stats": {k: v for k, v in res.stats.as_dict().items() if k != "time_s"},
        "pass_ops": [e["op"] for e in res.events],
        "pass_ids": sorted(res.records.meta["id"]),
        "pass_sources": sorted(x for s in res.records.meta["source_ids"] for x in s),
    }
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
