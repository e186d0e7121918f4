"""Cosine-similarity join and top-k within namespaces, on interchangeable engines.

The entry points live in :mod:`consolidate.similarity.api` (input checks, segment sorting,
float64 re-scoring); the engines (torch, triton, faiss) in
:mod:`consolidate.similarity.engines`, each imported only when chosen. Importing this
package imports no engine, triton or faiss.
"""

from .api import (
    DTYPE_MARGIN,
    ENGINES,
    Pairs,
    TopK,
    auto_tile,
    check_engine,
    threshold_pairs,
    topk_neighbours,
)

__all__ = [
    "Pairs",
    "TopK",
    "threshold_pairs",
    "topk_neighbours",
    "auto_tile",
    "DTYPE_MARGIN",
    "ENGINES",
    "check_engine",
]
