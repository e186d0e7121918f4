"""consolidate: batch consolidation ("sleep" pass) and evaluation for LLM-agent long-term memory.

Main entry points:

* :class:`consolidate.store.Store` -- Parquet snapshots with an atomic pointer swap.
* :func:`consolidate.pipeline.run_pass` -- the offline pass, a pure function over a snapshot.
* :func:`consolidate.similarity.threshold_pairs` -- tiled cosine join, cpu or cuda.
"""

__version__ = "0.1.0"
