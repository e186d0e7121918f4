"""consolidate: batch consolidation ("sleep" pass) and evaluation for LLM-agent long-term memory.

Main entry points:

* :func:`consolidate.store.open_store_dir` -- a store of record behind one interface
  (:class:`consolidate.store.MemoryStore`): the Lance store (the default: one versioned
  dataset) or the Parquet store (a snapshot per version).
* :func:`consolidate.pipeline.run_pass` -- the offline pass, a pure function over a snapshot.
* :func:`consolidate.similarity.threshold_pairs` -- tiled cosine join, cpu or cuda.
* :func:`consolidate.consolidation.run_consolidate` -- the ``consolidate`` job from Python.
"""

__version__ = "0.1.0"
