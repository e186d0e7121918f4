"""Memories from plain files (consolidate.sources.files, consolidate-import file=...): an
export in each format reads back unchanged; hand-written files get defaults, generated ids
and embeddings; bad files are refused naming the file and the line, with nothing written."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from consolidate.sources import FileSource, read_memories
from consolidate.store import InvalidRecordsError
from consolidate.store.lance import LanceStore
from consolidate.store.schema import COLUMNS
from tests.helpers import make_records, random_rows, tree_digest


@pytest.fixture
def store(tmp_path):
    """A store whose rows use every column: a pinned row, provenance, a validity interval,
    a merged member with its tombstone and the merged record, a dropped one."""
    rows = random_rows(12, 8, namespaces=3)
    rows[0].update(pinned=True, valid_from=10.0, valid_to=900.0)
    rows[1].update(
        deleted_at=995.0, deleted_reason="merged", merged_into=rows[2]["id"], strength=2.0
    )
    rows[2].update(strength=3.0, last_pass=2.0)
    rows[3].update(deleted_at=996.0, deleted_reason="floor", text='line one\nline, two "q"')
    s = LanceStore(tmp_path / "s")
    s.create(make_records(rows))
    return s


def same_records(a, b):
    ia = np.argsort(a.meta["id"].to_numpy(str))
    ib = np.argsort(b.meta["id"].to_numpy(str))
    ma = a.meta.iloc[ia].reset_index(drop=True)
    mb = b.meta.iloc[ib].reset_index(drop=True)
    for c in COLUMNS:
        assert ma[c].tolist() == mb[c].tolist() or ma[c].equals(mb[c]), c
    np.testing.assert_array_equal(a.vectors[ia], b.vectors[ib])


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_an_export_reads_back_unchanged(tmp_path, store, suffix):
    path = tmp_path / f"out{suffix}"
    store.export(path)
    got = read_memories(path)
    assert got.generated_ids == 0 and not got.embedded and got.ignored_columns == []
    same_records(store.load().records, got.records)
    # and into a new store through the job: the same rows again
    out = run_import(tmp_path, path, "copy")
    assert out["created"] and out["memories"] == 12
    same_records(store.load().records, LanceStore(tmp_path / "copy").load().records)


def run_import(tmp_path, path, name, **more):
    from consolidate.jobs.import_store import run_import as job

    cfg = OmegaConf.create(
        {
            "store": {"name": name, "dir": str(tmp_path / name), "init_from": None},
            "embedder": {"name": "minilm", "device": "cpu", "show_progress": False},
            "file": str(path),
            "namespace": "default",
            **more,
        }
    )
    return job(cfg)


def test_a_hand_written_file_gets_defaults_ids_and_embeddings(tmp_path):
    lines = [
        {"text": "Anna moved to Berlin in 2021."},
        {"text": "Anna moved to Berlin in 2021."},  # the same twice: two ids
        {
            "text": "Anna likes jazz.",
            "namespace": "anna",
            "importance": 0.9,
            "created_at": "2024-03-01T10:00:00",
            "note": "kept aside",
        },
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = run_import(tmp_path, path, "s")
    assert out["memories"] == 3 and out["generated_ids"] == 3 and out["embedded"]
    assert out["ignored_columns"] == ["note"]
    recs = LanceStore(tmp_path / "s").load().records
    m = recs.meta.set_index("text", drop=False)
    assert recs.dim == 384 and np.allclose(np.linalg.norm(recs.vectors, axis=1), 1, atol=1e-5)
    assert sorted(recs.meta["namespace"]) == ["anna", "default", "default"]
    assert recs.meta["id"].nunique() == 3 and all(i.startswith("imp-") for i in recs.meta["id"])
    jazz = m.loc["Anna likes jazz."]
    assert jazz["importance"] == 0.9 and jazz["strength"] == 1.0 and not jazz["pinned"]
    # 2024-03-01T10:00 UTC in hours since the epoch; last_used defaults to created_at
    want = pd.Timestamp("2024-03-01T10:00:00", tz="UTC").value / 3.6e12
    assert jazz["created_at"] == jazz["last_used"] == pytest.approx(want, abs=1e-9)
    assert set(m.loc["Anna moved to Berlin in 2021.", "importance"]) == {0.5}
    # the two equal texts embed to the same vector
    same = recs.vectors[(recs.meta["text"] == "Anna moved to Berlin in 2021.").to_numpy()]
    np.testing.assert_array_equal(same[0], same[1])
    # the same file again: refused as duplicate ids, the store unchanged
    before = tree_digest(tmp_path / "s")
    with pytest.raises(InvalidRecordsError, match="duplicate id"):
        run_import(tmp_path, path, "s")
    assert tree_digest(tmp_path / "s") == before


def test_a_csv_with_vectors_appends_to_an_existing_store(tmp_path, store):
    path = tmp_path / "new.csv"
    path.write_text(
        "id,namespace,text,vector,pinned,source_ids,last_used\n"
        'n1,ns0,"a new fact, with a comma","[0.0, 3.0, 4.0, 0, 0, 0, 0, 0]",'
        'true,"[""D9""]",2024-01-01T00:00:00Z\n'
    )
    out = run_import(
        tmp_path, path, "s", store={"name": "s", "dir": str(store.root), "init_from": None}
    )
    assert not out["created"] and out["memories"] == 1
    m = store.load().records
    row = m.meta.set_index("id").loc["n1"]
    assert row["text"] == "a new fact, with a comma" and row["pinned"]
    assert list(row["source_ids"]) == ["D9"]
    np.testing.assert_allclose(
        m.vectors[m.meta["id"].tolist().index("n1")], [0, 0.6, 0.8, 0, 0, 0, 0, 0], atol=1e-7
    )


@pytest.mark.parametrize(
    "name,text,match",
    [
        (
            "a.jsonl",
            '{"text": "ok", "vector": [1, 0]}\n{"text": "bad"\n',
            r"a.jsonl line 2: not JSON",
        ),
        (
            "b.jsonl",
            '{"text": "ok", "vector": [1, 0]}\n["a list"]\n',
            r"b.jsonl line 2: a JSON list",
        ),
        (
            "c.jsonl",
            '{"text": "ok", "vector": [1, 0]}\n{"vector": [0, 1]}\n',
            r"c.jsonl line 2: no text",
        ),
        (
            "d.jsonl",
            '{"text": "ok", "vector": [1, 0]}\n{"text": "no vector"}\n',
            r"d.jsonl line 2: no vector, while 1 other rows have one",
        ),
        ("e.csv", 'text,vector,pinned\nok,"[1, 0]",maybe\n', r"e.csv line 2: pinned is not"),
        ("f.csv", 'text,vector\nok,"[1, 0"\n', r"f.csv line 2: vector is not a JSON array"),
        ("g.txt", "hello\n", r"must end in .jsonl, .parquet, .csv"),
        ("h.jsonl", "", r"h.jsonl: no memories"),
        ("i.jsonl", '{"text": "no vectors at all"}\n', r"give an embedder"),
    ],
)
def test_bad_files_name_the_file_and_the_line(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_memories(path)


def test_records_that_break_the_rules_are_named_by_id_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [
        {"id": "ok", "text": "fine", "vector": [1, 0]},
        {"id": "hi", "text": "too important", "vector": [0, 1], "importance": 2},
        {
            "id": "later",
            "text": "from the future",
            "vector": [0, 1],
            "created_at": "2099-01-01T00:00:00",
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(InvalidRecordsError) as e:
        read_memories(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "importance outside [0, 1]: 1 record(s): 'hi (line 2)'" in msg
    assert "created_at in the future: 1 record(s): 'later (line 3)'" in msg
    # through the job: nothing written
    with pytest.raises(InvalidRecordsError):
        run_import(tmp_path, path, "s")
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_the_docs_example_runs_as_written(tmp_path):
    """The files example of docs/source-settings.md, from an empty folder: import, a pass (the two Berlin
    notes merge), an export to CSV that imports back."""
    import os
    import re
    import subprocess

    from tests.helpers import REPO

    text = (REPO / "docs/source-settings.md").read_text()
    block = re.search(r"<!-- example: files -->\n```bash\n(.*?)```", text, re.S).group(1)
    script = block.replace(".venv/bin/", f"{REPO}/.venv/bin/")
    env = {**os.environ, "CONSOLIDATE_ROOT": str(tmp_path)}
    p = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "3 memories from my_memories.jsonl" in p.stdout
    store = LanceStore(tmp_path / "stores" / "mine")
    recs = store.load().records
    live = recs.meta[recs.live_mask()]
    assert sorted(recs.meta["deleted_reason"].dropna()) == ["merged", "merged"]
    assert len(live) == 2 and "Anna likes jazz." in set(live["text"])
    same_records(recs, read_memories(tmp_path / "mine.csv").records)


def test_more_bad_inputs_are_one_clear_error(tmp_path):
    cases = {
        "ka.jsonl": (
            '{"text": "a", "vector": [1, 0], "keep_apart": 5}\n',
            InvalidRecordsError,
            "keep_apart is not a list of strings",
        ),
        "big.jsonl": (
            '{"text": "a", "vector": [1' + "0" * 400 + ", 0]}\n",
            ValueError,
            "big.jsonl line 1: a number of 401 digits",
        ),
        "deep.jsonl": (
            '{"text": "a", "vector": [1, 0], "x": ' + "[" * 100000 + "]" * 100000 + "}\n",
            ValueError,
            "deep.jsonl line 1",
        ),
        "empty.jsonl": (
            '{"text": "a", "vector": []}\n',
            ValueError,
            "empty.jsonl line 1: an empty vector",
        ),
        "sur.jsonl": (
            '{"text": "a \\ud800", "vector": [1, 0]}\n',
            ValueError,
            "sur.jsonl line 1: the text holds a lone surrogate",
        ),
    }
    for name, (text, err, match) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(err, match=match):
            read_memories(path)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "ok", "vector": [1, 0]}\n{"text": "caf\xe9", "vector": [1, 0]}\n')
    with pytest.raises(ValueError, match="latin.jsonl line 2: not UTF-8 at byte 14 of the line"):
        read_memories(latin)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "ok", "vector": [1, 0]}\n')
    assert len(read_memories(bom).records) == 1


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "int8"])
def test_a_partial_export_of_an_encoded_store_decodes_its_vectors(tmp_path, dtype):
    """A store's Parquet export with a column dropped reads as a hand-written file; its
    vectors in the store's encoding (bf16 bits, fp16, int8 with a scale) are decoded."""
    import pyarrow.parquet as pq

    s = LanceStore(tmp_path / "s", vector_dtype=dtype)
    s.create(make_records(random_rows(6, 8)))
    s.export(tmp_path / "full.parquet")
    t = pq.read_table(tmp_path / "full.parquet").drop_columns(["last_pass"])
    pq.write_table(t, tmp_path / "part.parquet")
    want = s.load().records
    got = read_memories(tmp_path / "part.parquet").records
    at = [list(want.meta["id"]).index(i) for i in got.meta["id"]]
    w = want.vectors[at]
    cos = (got.vectors * w).sum(1) / np.linalg.norm(w, axis=1)  # got: unit length
    assert cos.min() > 0.9999, cos  # decoded (the store's values, rescaled to unit length)


def _memory_file(tmp_path, suffix=".jsonl"):
    """A store's export as a user's memory file: planted near-duplicates in 2 namespaces."""
    s = LanceStore(tmp_path / "src")
    rows = random_rows(60, 16, namespaces=2, dup_frac=0.3, noise=0.01, seed=7, t0=2000.0)
    s.create(make_records(rows))
    path = tmp_path / f"mem{suffix}"
    s.export(path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_a_memory_file_as_source_dry_run_then_apply(tmp_path, suffix):
    from consolidate.config import PassConfig, SimilarityConfig
    from consolidate.pipeline import run_pass
    from consolidate.sources import FileSource

    path = _memory_file(tmp_path, suffix)
    original = path.read_bytes()
    src = FileSource(path)
    snap = src.read(["ns0"])
    assert snap.scope.sum() == 30 and len(snap.records) == 60
    res = run_pass(
        src.records(snap),
        cfg=PassConfig(force=True),
        version=1,
        sim_cfg=SimilarityConfig(device="cpu"),
        wall_h=2001.0,
    )
    merged = {e["id"]: sorted(e["members"]) for e in res.events if e["op"] == "merge"}
    assert merged
    plan = src.plan(snap, res.records)
    assert sorted(tuple(u["ids"]) for u in plan.units if u["kind"] == "merge") == sorted(
        tuple(m) for m in merged.values()
    )
    # a dry run writes the result elsewhere; the file is untouched
    rep = src.apply(plan, out_dir=tmp_path / "out")
    assert rep.written == str(tmp_path / "out" / f"consolidated{suffix}")
    assert rep.dry_run and path.read_bytes() == original
    assert len(read_memories(rep.written).records) == len(res.records) + 30
    # the apply: a copy of the file as it was, then the result over it
    rep = src.apply(plan, dry_run=False)
    assert Path(rep.backup).read_bytes() == original and rep.written == str(path)
    back = read_memories(path).records.meta.set_index("id")
    for into, members in merged.items():  # nothing lost: members are tombstones
        assert back.loc[into, "text"] == res.records.meta.set_index("id").loc[into, "text"]
        assert (back.loc[members, "merged_into"] == into).all()
        assert back.loc[members, "deleted_at"].notna().all()
    other = read_memories(rep.backup).records.meta.set_index("id")
    ns1 = other.index[other["namespace"] == "ns1"]
    assert back.loc[ns1, "text"].equals(other.loc[ns1, "text"])  # untouched namespace
    assert back.loc[ns1, "deleted_at"].isna().all()
    # a plan of a file that changed since the read writes nothing
    snap2 = src.read()
    plan2 = src.plan(snap2, snap2.records)
    path.write_bytes(b" " + path.read_bytes())  # another writer (a Parquet file: broken)
    changed = path.read_bytes()
    with pytest.raises(ValueError, match="changed since it was read"):
        src.apply(plan2, dry_run=False)
    assert path.read_bytes() == changed


@pytest.mark.slow
def test_the_docs_jsonl_source_example_runs_as_written(tmp_path):
    """The `source=jsonl` example of docs/source-settings.md: a dry run leaves the file alone, the apply
    rewrites it with the two Porto notes merged (the file holds the live notes, the sidecar
    the two tombstones: ``source.write=live``, the default) and a copy of the file as it
    was."""
    from tests.helpers import run_readme_example

    p = run_readme_example("jsonl", tmp_path, doc="docs/source-settings.md")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "would apply      1 merge" in p.stdout and "applied          1 merge" in p.stdout
    backup = list(tmp_path.glob("notes.pre-consolidate-*.jsonl"))
    assert len(backup) == 1 and len(read_memories(backup[0], embedder=_Stub()).records) == 3
    in_file = read_memories(tmp_path / "notes.jsonl").records
    assert len(in_file) == 2 and in_file.live_mask().all()
    side = pd.read_parquet(tmp_path / "notes.jsonl.consolidate" / "tombstones.parquet")
    assert sorted(side["deleted_reason"]) == ["merged", "merged"]
    recs = FileSource(tmp_path / "notes.jsonl").read().records  # the two joined
    live = recs.meta[recs.live_mask()]
    assert len(recs) == 4 and len(live) == 2 and "Ben runs on Sundays." in set(live["text"])
    assert set(live["id"]) == set(in_file.meta["id"])
    # the dry run and the apply planned the same merge, under the same merged id
    plans = sorted(tmp_path.glob("outputs/**/plan.json"), key=lambda q: q.stat().st_mtime)
    dry, applied = (json.loads(q.read_text()) for q in plans)
    assert dry["dry_run"] and not applied["dry_run"]
    assert dry["units"] == applied["units"] and dry["plan_id"] == applied["plan_id"]
    assert dry["units"][0]["into"] in set(live["id"])


class _Stub:
    """Embeds nothing: only counts the rows of a file without vectors."""

    def encode(self, texts):
        return np.eye(len(texts), 4, dtype=np.float32) + 0.1


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_a_file_apply_keeps_columns_permissions_links_and_every_backup(tmp_path, suffix):
    """What a user's file holds besides the schema survives an apply: its own columns (null
    in merged records), its permissions; a symlink is followed; two applies in one second
    keep two backups; a text with a bare carriage return reads back whole (CSV)."""
    import os

    from consolidate.config import PassConfig, SimilarityConfig
    from consolidate.pipeline import run_pass
    from consolidate.sources import FileSource

    rows = random_rows(12, 8, namespaces=1, dup_frac=0.5, noise=0.01, seed=3, t0=2000.0)
    df = pd.DataFrame(
        [
            {
                "id": r["id"],
                "namespace": r["namespace"],
                "text": r["text"] + ("\r second line" if k == 2 else ""),
                "vector": [float(x) for x in r["vector"]],
                "created_at": r["created_at"],
                "tags": f"tag{k}",
            }
            for k, r in enumerate(rows)
        ]
    )
    real = tmp_path / "data" / f"mem{suffix}"
    real.parent.mkdir()
    if suffix == ".jsonl":
        real.write_text("".join(json.dumps(r) + "\n" for r in df.to_dict("records")))
    elif suffix == ".csv":
        df.assign(vector=df["vector"].map(json.dumps)).to_csv(
            real, index=False, quoting=1
        )  # QUOTE_ALL
    else:
        df.to_parquet(real)
    os.chmod(real, 0o600)
    link = tmp_path / f"link{suffix}"
    link.symlink_to(real)
    src = FileSource(link)
    for _ in range(2):
        snap = src.read()
        res = run_pass(
            snap.records,
            cfg=PassConfig(force=True),
            version=1,
            sim_cfg=SimilarityConfig(device="cpu"),
            wall_h=2001.0,
        )
        rep = src.apply(src.plan(snap, res.records), dry_run=False)
    assert link.is_symlink() and rep.written == str(real)
    assert (os.stat(real).st_mode & 0o777) == 0o600
    assert len(list(real.parent.glob(f"mem.pre-consolidate-*{suffix}"))) == 2
    back = read_memories(real)
    assert back.ignored_columns == ["tags"]
    m = back.records.meta.set_index("id")
    tags = back.extra["tags"]
    assert all(tags[r["id"]] == f"tag{k}" for k, r in enumerate(rows))
    # a merged record takes its oldest member's
    merged = m.index[~m.index.isin([r["id"] for r in rows])]
    assert len(merged)
    for i in merged:
        members = m.index[m["merged_into"] == i]
        oldest = min(members, key=lambda j: (m.at[j, "created_at"], j))
        assert tags[i] == tags[oldest] and tags[i].startswith("tag")
    assert m.loc[rows[2]["id"], "text"].endswith("\r second line")


@pytest.mark.parametrize(
    "text,match",
    [
        # a comma in an unquoted text shifts nothing: the row is refused with its line
        (
            'id,text,importance,vector\nc0,fine,0.5,"[1, 0]"\nc1,hello, world,0.9,"[1, 0]"\n',
            r"x.csv line 3: 5 cells, the header has 4",
        ),
        ("id,text,vector\nc1,too few\n", r"x.csv line 2: 2 cells, the header has 3"),
        # a quoted line break: the next record starts on line 4
        ('id,text,vector\nc1,"two\nlines","[1, 0]"\nc2,"[1, 0]"\n', r"x.csv line 4: 2 cells"),
        ('id,text,vector\nc1,"open quote,"[1, 0]"\n', r"x.csv line 2: not CSV"),
        ("id,text,text\nc1,a,b\n", r"x.csv line 1: the header .* repeated column name"),
        ('id,text,vector\nc1,ok,"[1, 0]"\n\nc2,ok,"[0, 1]"\n', r"x.csv line 3: an empty line"),
        ("", r"x.csv: empty"),
    ],
)
def test_csv_is_read_with_a_strict_dialect(tmp_path, text, match):
    path = tmp_path / "x.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_memories(path)


def test_csv_quoted_cells_and_line_numbers_of_records(tmp_path):
    path = tmp_path / "ok.csv"
    path.write_text(
        'id,text,importance,vector\nc1,"hello, world",0.9,"[1, 0]"\n'
        'c2,"two\nlines ""quoted""",0.4,"[0, 1]"\nc3,three,2.0,"[1, 1]"\n'
    )
    with pytest.raises(InvalidRecordsError, match=r"c3 \(line 5\)"):
        read_memories(path)  # importance 2.0 on the record that starts on line 5
    path.write_text(path.read_text().replace("2.0", "0.2"))
    m = read_memories(path).records.meta.set_index("id")
    assert m.loc["c1", "text"] == "hello, world" and m.loc["c1", "importance"] == 0.9
    assert m.loc["c2", "text"] == 'two\nlines "quoted"' and len(m) == 3


def test_a_bad_byte_is_named_by_its_own_line(tmp_path):
    path = tmp_path / "late.csv"
    good = "".join(f'c{k},"text {k}","[1, 0]"\n' for k in range(600))
    raw = ("id,text,vector\n" + good).encode()
    lines = raw.split(b"\n")
    lines[499] = lines[499].replace(b"text", b"t\xe9xt")  # line 500 of the file
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=r"late.csv line 500: not UTF-8 at byte 8 "):
        read_memories(path)


@pytest.mark.parametrize(
    "row,match",
    [
        ({"text": "t", "vector": [True, 0.5]}, r"vector is not a flat list of numbers: 1 record"),
        (
            {"text": "t", "vector": [1, 0], "deleted_at": 5.0, "deleted_reason": "because"},
            r"deleted_reason not one of merged, updated",
        ),
        (
            {
                "text": "t",
                "vector": [1, 0],
                "deleted_at": 5.0,
                "deleted_reason": "merged",
                "merged_into": "ghost",
            },
            r"merged_into names no record of the same input",
        ),
    ],
)
def test_import_refuses_booleans_and_unknown_tombstone_fields(tmp_path, row, match):
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps({"id": "ok", "text": "fine", "vector": [0, 1]})
        + "\n"
        + json.dumps({"id": "bad", **row})
        + "\n"
    )
    with pytest.raises(InvalidRecordsError, match=match) as e:
        read_memories(path)
    assert "bad (line 2)" in str(e.value)


def test_import_message_for_each_kind_of_run():
    import dataclasses

    from consolidate.jobs.import_store import import_message
    from consolidate.store.locomo import ImportReport

    # a LOCOMO build: its report names the LOCOMO file, and has no "created"
    rep = dataclasses.asdict(ImportReport(file="locomo10.json", sha256="0" * 64))
    rep.update(observations=2509, conversations=10)
    msg = import_message({"store": "stores/x", "version": 1, **rep})
    assert msg == (
        "built stores/x: 2509 memories from 10 conversations; 0 with malformed evidence "
        "(kept, listed in import_report.json)"
    )
    assert import_message({"store": "s", "version": 3}) == (
        "s already exists (snapshot 3); nothing to do"
    )
    out = {"store": "s", "version": 2, "file": "m.csv", "memories": 4, "created": False}
    out.update(embedded=True, generated_ids=1, ignored_columns=["tags"])
    assert import_message(out) == (
        "added to s (version 2): 4 memories from m.csv (1 ids generated; texts embedded; "
        "columns ignored: tags)"
    )


def test_a_parquet_column_with_invalid_utf8_is_named_by_row_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = pa.array([b"ok", b"fine", b"caf\xe9"], pa.binary())
    text = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # declared UTF-8
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": text, "vector": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]}), path)
    with pytest.raises(ValueError, match=r"bad.parquet row 2: column 'text' is not valid UTF-8"):
        read_memories(path)


def test_an_embedder_refusal_names_the_record_and_its_line(tmp_path):
    from consolidate.embed import EmbedInputError

    class Refuses:
        dim = 2

        def encode(self, texts):
            k = next(i for i, t in enumerate(texts) if len(t) > 10)
            raise EmbedInputError(k, "has 900 tokens, the model reads at most 256")

    path = tmp_path / "m.jsonl"
    rows = [{"id": "a1", "text": "short"}, {"id": "b2", "text": "a very long text indeed"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        ValueError, match=r"embed: 'b2' \(.*m\.jsonl line 2\): its text has 900 tokens"
    ):
        read_memories(path, embedder=Refuses())


def test_a_duplicate_id_is_named_with_both_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"id": "a", "text": "one", "vector": [1, 0]},
        {"id": "b", "text": "two", "vector": [0, 1]},
        {"id": "a", "text": "three", "vector": [1, 1]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InvalidRecordsError, match=r"duplicate id.*a \(lines 1 and 3\)"):
        read_memories(path)


def test_lines_appended_during_a_pass_are_carried_into_the_file_written(tmp_path):
    """An agent appends JSONL lines after the read (one through ``append_memories``, one
    by hand): the apply carries both, after the result's rows, and says so; the copy holds
    the file as it was just before the replace; the next read sees both memories live. A
    file changed otherwise is still refused."""
    from consolidate.config import PassConfig, SimilarityConfig
    from consolidate.pipeline import run_pass
    from consolidate.sources.files import append_memories

    path = _memory_file(tmp_path)
    n = len(read_memories(path).records)
    src = FileSource(path)
    snap = src.read()
    res = run_pass(
        snap.records,
        cfg=PassConfig(force=True),
        version=1,
        sim_cfg=SimilarityConfig(device="cpu"),
        wall_h=2000.0,
    )
    plan = src.plan(snap, res.records)
    assert plan.counts().get("merge")
    vec = [1.0] + [0.0] * 15
    append_memories(path, [{"id": "late-1", "text": "appended by an agent", "vector": vec}])
    with open(path, "a") as f:
        f.write(json.dumps({"id": "late-2", "text": "appended by hand", "vector": vec}) + "\n")
    rep = src.apply(plan, dry_run=False)
    assert rep.carried == 2
    back = read_memories(path).records.meta.set_index("id")
    assert back.loc["late-1", "text"] == "appended by an agent"
    assert back.loc["late-2", "text"] == "appended by hand"
    assert back.loc[["late-1", "late-2"], "deleted_at"].isna().all()
    assert len(read_memories(rep.backup).records) == n + 2
    snap2 = src.read()
    plan2 = src.plan(snap2, snap2.records)
    path.write_text(path.read_text().replace("appended by hand", "edited by hand"))
    with pytest.raises(ValueError, match="changed since it was read"):
        src.apply(plan2, dry_run=False)


def test_lines_appended_without_a_vector_are_embedded_by_the_model_of_the_others(tmp_path):
    """A file whose rows carry vectors, then an agent's text-only line: with an embedder of
    the same width only that line is embedded (the others keep their vectors exactly);
    an embedder of another width is refused, naming the line and the widths."""
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"id": "a", "text": "one", "vector": [0.0, 0.0, 0.0, 1.0]}\n'
        '{"id": "b", "text": "two", "vector": [0.0, 0.0, 1.0, 0.0]}\n'
        '{"id": "c", "text": "appended by an agent"}\n'
    )
    got = read_memories(path, embedder=_Stub()).records
    v = dict(zip(got.meta["id"], got.vectors, strict=True))
    assert v["a"].tolist() == [0.0, 0.0, 0.0, 1.0] and v["b"].tolist() == [0.0, 0.0, 1.0, 0.0]
    want = np.array([1.1, 0.1, 0.1, 0.1], np.float32)
    assert np.allclose(v["c"], want / np.linalg.norm(want))

    class Wide:
        def encode(self, texts):
            return np.ones((len(texts), 8), np.float32)

    with pytest.raises(ValueError, match=r"m.jsonl line 3: no vector, and the embedder gives 8 "):
        read_memories(path, embedder=Wide())
