"""A paraphrase tier tried against the hand labels (not adopted): token-level MiniLM recall.

For each case, every content word-piece of the member (word-pieces of words outside
``consolidate.lexicon.CONTENT_STOP_WORDS``) is matched to its most similar word-piece of the merged
text by the cosine of MiniLM's contextual token embeddings (the packaged all-MiniLM-L6-v2,
``output_value="token_embeddings"``), as in BERTScore recall (Zhang et al., 2020,
arXiv:1904.09675, without idf weights). A member is called kept when the lexical checker
keeps it, or when the mean of those best cosines reaches ``t`` and their minimum reaches
``u``. Prints agreement and false accepts (kept called for a lost label) over a grid.

Run from the repository root: ``.venv/bin/python eval/fidelity/token_tier.py``.
"""

import json
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from consolidate import fidelity
from consolidate.embed import packaged_model_path
from consolidate.lexicon import CONTENT_STOP_WORDS

HERE = Path(__file__).parent
model = SentenceTransformer(str(packaged_model_path()), device="cpu")
tok = model.tokenizer
cases = [json.loads(line) for line in (HERE / "cases.jsonl").open()]


def pieces(text: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Word-pieces, their unit embeddings, and a content mask (a piece of a content word)."""
    emb = model.encode([text], output_value="token_embeddings", convert_to_tensor=True)[0]
    names = tok.convert_ids_to_tokens(tok(text)["input_ids"])
    words: list[str] = []
    owner = []
    for p in names:
        if p in ("[CLS]", "[SEP]"):
            owner.append(-1)
        elif p.startswith("##") and words:
            words[-1] += p[2:]
            owner.append(len(words) - 1)
        else:
            words.append(p)
            owner.append(len(words) - 1)
    content = np.array(
        [o >= 0 and words[o].isalnum() and words[o] not in CONTENT_STOP_WORDS for o in owner]
    )
    inner = np.array([o >= 0 for o in owner])
    return names, torch.nn.functional.normalize(emb, dim=-1).numpy(), content & inner


rows = []
for c in cases:
    _, em, mk = pieces(c["member"])
    _, eg, gk = pieces(c["merged"])
    inner = np.array([True] * len(eg))
    inner[0] = inner[-1] = False
    best = (em[mk] @ eg[inner].T).max(axis=1)
    rows.append(
        (c["label"] == "kept", best.mean(), best.min(), fidelity.survives(c["member"], c["merged"]))
    )

print("t     u    agree  false_accepts")
for t in np.arange(0.60, 0.86, 0.02):
    for u in (0.0, 0.3, 0.4):
        pred = [lex or (m >= t and lo >= u) for _, m, lo, lex in rows]
        agree = sum(p == lab for p, (lab, *_) in zip(pred, rows, strict=True))
        fa = sum(p and not lab for p, (lab, *_) in zip(pred, rows, strict=True))
        print(f"{t:.2f}  {u:.1f}  {agree:5d}  {fa:5d}")
