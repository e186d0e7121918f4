"""The offline "sleep" pass: a pure function from one snapshot to the next, in stages.

One module per stage, in the order the data flows; each stage is a plain function from the
typed, columnar :class:`~consolidate.pipeline.state.PassState` to the next:

1. :mod:`~consolidate.pipeline.purge`: tombstones past retention are removed.
2. :mod:`~consolidate.pipeline.exact`: exact duplicates by normalised-text hash
   (a vectorised group-by; no model call).
3. :mod:`~consolidate.pipeline.near`: the similarity join (one engine call for all
   namespaces); :mod:`~consolidate.pipeline.long_texts`: MinHash candidates for long texts;
   then centroid-checked clusters with the conflict guard on paired texts only.
4. :mod:`~consolidate.pipeline.merging`: one merge request per cluster (one batch call),
   supersedes, merged records (vectors as segment reductions on the device).
5. :mod:`~consolidate.pipeline.reflect`: optional reflections.
6. :mod:`~consolidate.pipeline.retention`: retention score, floor, cap.

:func:`run_pass` composes them (:mod:`~consolidate.pipeline.run`); it does no I/O and keeps
no global state, so a shard of namespaces can run it anywhere. New records of merges and
reflections come from one constructor (:func:`~consolidate.pipeline.rows.new_records`).
"""

from .clock import resolve_now, trigger
from .retention import MassDropError
from .run import check_settings, run_pass
from .state import PassResult, PassState, PassStats, merged_id
from .undo import undo_merge

__all__ = [
    "run_pass",
    "check_settings",
    "PassResult",
    "PassState",
    "PassStats",
    "MassDropError",
    "merged_id",
    "resolve_now",
    "trigger",
    "undo_merge",
]
