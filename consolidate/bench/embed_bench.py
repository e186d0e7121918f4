"""Embedding throughput: the packed pipeline against a plain ``SentenceTransformer.encode``
call, same model, same texts (the LOCOMO observations), same run.

Usage: .venv/bin/python -m consolidate.bench.embed_bench [--device auto] [--dtype fp32|fp16|bf16]
           [--n 2541] [--out eval/embed_cpu]
Writes ``<out>/embed.json`` and prints texts/s and the ratio last.
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from consolidate.embed import Embedder
from consolidate.environment import machine
from consolidate.store.locomo import read_locomo_observations

#: words of the synthetic sentences used where LOCOMO is not at hand (LOCOMO-like lengths)
_VOCAB = [
    "Gina",
    "Jon",
    "adopted",
    "two",
    "cats",
    "dance",
    "studio",
    "in",
    "May",
    "because",
    "she",
    "said",
    "they",
    "went",
    "to",
    "the",
    "park",
    "and",
    "loved",
    "it",
    "every",
    "weekend",
    "with",
    "friends",
]


def _texts(a: argparse.Namespace) -> tuple[list[str], str]:
    """The texts to embed and what they are: ``--texts`` lines, LOCOMO's observations, or
    synthetic sentences of 5-39 words where no data travels."""
    src = Path(a.data) / "locomo" / "locomo10.json"
    if a.texts:
        return Path(a.texts).read_text().splitlines()[: a.n], a.texts
    if src.exists():
        return [o.text for o in read_locomo_observations(src)[0]][: a.n], "LOCOMO observations"
    g = np.random.default_rng(0)
    return [
        " ".join(g.choice(_VOCAB, int(n))) for n in g.integers(5, 40, a.n)
    ], "synthetic sentences"


def main() -> None:
    """Command line (``python -m consolidate.bench.embed_bench``): embed LOCOMO's
    observations (or ``--texts``) with the packed pipeline and with plain
    ``SentenceTransformer.encode``, and write the timings and their agreement to
    ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--n", type=int, default=2541, help="texts (LOCOMO observations)")
    ap.add_argument("--data", default=os.environ.get("CONSOLIDATE_DATA_DIR", "../shared/data"))
    ap.add_argument("--model", default=None, help="model folder (default: packaged MiniLM)")
    ap.add_argument("--texts", default=None, help="one text per line, instead of LOCOMO")
    ap.add_argument("--out", default="eval/embed_cpu")
    a = ap.parse_args()
    texts, source = _texts(a)
    res = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "n": len(texts),
        "texts": source,
        "device": a.device,
        "dtype": a.dtype,
        "torch": torch.__version__,
        **machine(),
    }
    vecs = {}
    for name in ("st", "packed"):
        e = Embedder(a.model, a.device, show_progress=False, dtype=a.dtype, pipeline=name)
        e.encode(texts[:64])  # warm-up
        best = float("inf")
        for _ in range(2):
            if e.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            vecs[name] = e.encode(texts)
            if e.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        res[name] = {"seconds": round(best, 4), "texts_per_s": round(len(texts) / best, 1)}
        res["device"] = str(e.device)
    res["max_abs_diff"] = float(np.abs(vecs["st"] - vecs["packed"]).max())
    res["ratio"] = round(res["st"]["seconds"] / res["packed"]["seconds"], 3)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "embed.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(
        f"embed {len(texts)} {source} on {res['device']} {a.dtype}: packed "
        f"{res['packed']['texts_per_s']} texts/s, plain encode {res['st']['texts_per_s']} "
        f"texts/s: {res['ratio']}x"
    )


if __name__ == "__main__":
    main()
