"""The algorithms of the pass's stages, on arrays and texts, without the pass's state.

* :mod:`~consolidate.ops.cluster`: centroid-checked clusters over candidate pairs
  (the cluster stage, :mod:`consolidate.pipeline.near`).
* :mod:`~consolidate.ops.guard`: the conflict guard (the cluster stage).
* :mod:`~consolidate.ops.minhash`: MinHash candidates for long texts
  (:mod:`consolidate.pipeline.long_texts`).
* :mod:`~consolidate.ops.merge`: merge requests, responses and the extractive merger
  (:mod:`consolidate.pipeline.merging`).
* :mod:`~consolidate.ops.fidelity`: the fidelity checker every merge passes (the merge
  stage, and the evaluation's faithful recall).
* :mod:`~consolidate.ops.scoring`: the retention score, floor and cap
  (:mod:`consolidate.pipeline.retention`).

Nothing here imports the pipeline: each module is importable and testable alone.
"""
