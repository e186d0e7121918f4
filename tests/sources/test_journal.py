"""The undo journal beside a file source (``<path>.consolidate``): a line cut by a crash,
damaged lines, merges of merges kept apart, an undone drop never dropped again, one key in
several plans, and the undo job's id and exit status."""

import json
import subprocess
import sys

import pytest

from consolidate.sources.journal import Journal, JournalError, expand_apart, match_target
from tests.sources.test_undo_sources import live, memory_file, one_pass


def _unit(key, ids, kind="merge"):
    return {"kind": kind, "key": key, "namespace": "a", "ids": ids}


def test_a_line_cut_by_a_crash_is_cut_off_before_the_next_append(tmp_path):
    j = Journal(tmp_path / "j")
    j.record_apply("p1", [_unit("m1", ["a", "b"])])
    path = tmp_path / "j" / "applied.jsonl"
    good = path.read_bytes()
    path.write_bytes(good + b'{"plan_id": "p2", "units": [{"ke')  # the crash
    assert [p["plan_id"] for p in j.plans()] == ["p1"]  # the cut line was never done
    j.record_apply("p3", [_unit("m3", ["c", "d"])])
    assert [p["plan_id"] for p in j.plans()] == ["p1", "p3"]
    text = path.read_text()
    assert text.startswith(good.decode()) and text.count("\n") == 2 and '"p2"' not in text


@pytest.mark.parametrize(
    "line, why",
    [
        ("not json at all", "line 2: not JSON"),
        ("[1, 2]", "line 2: not a journal line .* missing plan_id, units"),
        ('{"plan_id": "p9"}', "line 2: not a journal line .* missing units"),
        ('{"plan_id": "p9", "units": [{"key": "k"}]}', "line 2: units is not a list"),
    ],
)
def test_a_damaged_line_is_an_error_that_names_the_file_and_the_line(tmp_path, line, why):
    j = Journal(tmp_path / "j")
    j.record_apply("p1", [_unit("m1", ["a", "b"])])
    path = tmp_path / "j" / "applied.jsonl"
    with open(path, "a") as f:
        f.write(line + "\n")
    j.record_apply("p2", [_unit("m2", ["c", "d"])])  # a good line after it
    with pytest.raises(JournalError, match=why) as e:
        j.plans()
    assert str(path) in str(e.value)


def test_a_journal_that_is_not_utf8_is_an_error(tmp_path):
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "undone.jsonl").write_bytes(b'{"plan_id": "\xff"}\n')
    with pytest.raises(JournalError, match="undone.jsonl: not UTF-8"):
        Journal(tmp_path / "j").undone()


def test_expand_apart_keeps_the_members_of_an_inner_merge_apart_from_the_others():
    # m1 = {a, b}; m2 = {m1, c}; both undone: a, b, m1 each apart from c; a apart from b
    got = expand_apart([("m2", ["m1", "c"]), ("m1", ["a", "b"])])
    assert got == {
        "m1": {"c"},
        "a": {"b", "c"},
        "b": {"a", "c"},
        "c": {"m1", "a", "b"},
    }
    assert expand_apart([(None, ["x", "y", "z"])]) == {
        "x": {"y", "z"},
        "y": {"x", "z"},
        "z": {"x", "y"},
    }
    assert expand_apart([("m", ["m", "q"])]) == {"m": {"q"}, "q": {"m"}}  # no endless loop


def test_a_key_held_by_two_plans_names_the_newest_unit_not_undone():
    plans = [
        {"plan_id": "p-old", "units": [{"key": "r7", "kind": "drop"}]},
        {"plan_id": "p-new", "units": [{"key": "r7", "kind": "drop"}]},
    ]
    assert match_target("r7", plans)[0] == "p-new"
    assert match_target("r7", plans, undone={("p-new", "r7")})[0] == "p-old"
    assert match_target("r7", plans, undone={("p-new", "r7"), ("p-old", "r7")})[0] == "p-new"


def test_an_undone_drop_is_read_as_pinned_and_the_next_pass_keeps_it(tmp_path):
    from consolidate.sources import FileSource

    path = memory_file(tmp_path)
    src = FileSource(path)
    before = live(src)
    _, _, plan, _ = one_pass(src)
    drops = [u["key"] for u in plan.units if u["kind"] == "drop"]
    old = {f"r{k:05d}" for k in range(0, 60, 9)}  # every 9th of 60 rows is long unused
    assert drops and set(drops) <= old
    rep = src.undo(drops[0])
    assert rep.undone == [drops[0]] and rep.restored == [drops[0]]
    assert live(src)[drops[0]] == before[drops[0]]
    assert Journal(tmp_path / "mem.jsonl.consolidate").kept() == {drops[0]}
    m = src.read().records.meta
    assert m.loc[m["id"] == drops[0], "pinned"].tolist() == [True]
    assert int(m["pinned"].sum()) == 1
    _, res, plan2, _ = one_pass(src, apply=False)
    assert drops[0] in set(res.records.meta["id"])  # not dropped again
    assert drops[0] not in {u["key"] for u in plan2.units}


def test_the_undo_job_reads_a_numeric_id_as_the_text_typed(tmp_path):
    """``id=1e35`` is a float to Hydra; the job looks for the text ``1e35``, not
    ``1e+35``; an id that matches nothing exits 2 with one line."""
    from consolidate.sources import FileSource

    path = memory_file(tmp_path)
    one_pass(FileSource(path))
    cmd = [sys.executable, "-m", "consolidate.jobs.undo", "source=jsonl", f"source.path={path}"]
    out = subprocess.run(
        [*cmd, "id=1e35", f"hydra.run.dir={tmp_path}/h"], capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "'1e35'" in err[0] and "1e+35" not in err[0], err
    assert err[0].endswith("(CONSOLIDATE_DEBUG=1 shows the traceback)")
    plan_id = json.loads((tmp_path / "mem.jsonl.consolidate" / "applied.jsonl").read_text())[
        "plan_id"
    ]
    out = subprocess.run(
        [*cmd, f"id={plan_id[:8]}", f"hydra.run.dir={tmp_path}/h2"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("undid "), out.stderr


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_write_live_keeps_tombstones_beside_the_file_and_undo_reads_both(tmp_path, suffix):
    from consolidate.sources import FileSource
    from consolidate.sources.files import read_memories

    path = memory_file(tmp_path, suffix)
    src = FileSource(path, write="live")
    before = live(src)
    _, _, plan, _ = one_pass(src)
    merges = [u for u in plan.units if u["kind"] == "merge"]
    drops = [u for u in plan.units if u["kind"] == "drop"]
    n_live = 60 - sum(len(u["ids"]) for u in merges) + len(merges) - len(drops)
    in_file = read_memories(path).records
    assert len(in_file) == n_live and in_file.live_mask().all()
    side = tmp_path / f"mem{suffix}.consolidate" / "tombstones.parquet"
    tombs = read_memories(side, known_ids=in_file.meta["id"]).records
    assert len(tombs) == 60 + len(merges) - n_live and not tombs.live_mask().any()
    assert len(FileSource(path).read().records) == 60 + len(merges)  # a reader of both
    rep = src.undo(plan.plan_id[:8])
    assert sorted(rep.undone) == sorted(u["key"] for u in plan.units)
    assert live(src) == before
    assert len(read_memories(path).records) == 60  # every member live in the file again
    assert len(read_memories(side, known_ids=before).records) == len(merges)  # retired
    # write=all: the next apply moves the tombstones back into the file, no sidecar
    one_pass(FileSource(path, write="all"))
    assert not side.exists()
    assert len(read_memories(path).records) == 60 + len(merges)
    with pytest.raises(ValueError, match="source.write must be all or live, got 'some'"):
        FileSource(path, write="some")


@pytest.mark.parametrize("line", ['{"at": oops', '{"plan_id": "p", "ids": 5}', "null"])
def test_a_damaged_keep_apart_line_stops_the_undo_before_it_writes(tmp_path, line):
    from consolidate.sources import FileSource

    path = memory_file(tmp_path)
    src = FileSource(path)
    _, _, plan, _ = one_pass(src)
    merges = [u["key"] for u in plan.units if u["kind"] == "merge"]
    src.undo(merges[0])
    apart = tmp_path / "mem.jsonl.consolidate" / "keep_apart.jsonl"
    with open(apart, "a") as f:
        f.write(line + "\n")
    data = path.read_bytes()
    with pytest.raises(JournalError, match="keep_apart.jsonl line 2"):
        src.undo(merges[1])
    assert path.read_bytes() == data  # nothing undone
    with pytest.raises(JournalError, match="keep_apart.jsonl line 2"):
        src.read()


def test_a_unit_applied_again_after_a_roll_back_is_live_and_recorded_once(tmp_path):
    """A unit rolled back (recorded undone by the apply itself) and applied again under the
    same plan id by a later run: the journal holds it once, as applied and not undone, so a
    user's undo undoes the second application; a unit recorded twice by a recovery is one
    unit too."""

    j = Journal(tmp_path / "j")
    u = {"kind": "merge", "key": "m-1", "namespace": "n", "ids": ["a", "b"]}
    v = {"kind": "merge", "key": "m-2", "namespace": "n", "ids": ["c", "d"]}
    j.record_apply("p1", [u, v])
    j.record_undone("p1", u, [], why="interrupted")
    assert set(j.undone()) == {("p1", "m-1")}
    j.record_apply("p1", [u])  # the next run applies the same unit of the same plan
    j.record_apply("p1", [v])  # a recovery records v again
    (p,) = j.plans()
    assert [x["key"] for x in p["units"]] == ["m-1", "m-2"]
    assert j.undone() == {}
    j.record_undone("p1", u, ["a", "b"])  # a user's undo of the second application
    assert set(j.undone()) == {("p1", "m-1")}
    assert j.keep_apart() == {"a": {"b"}, "b": {"a"}}


def test_every_path_to_a_file_shares_its_journal(tmp_path, caplog):
    """An apply through a link journals beside the real file, so an undo by the real path
    finds its plan (and both paths take one lock); a journal that an earlier version kept
    beside a link is still used, with a warning to move it."""
    from consolidate.sources import FileSource
    from consolidate.sources.journal import default_state_dir

    path = memory_file(tmp_path)
    (tmp_path / "link.jsonl").symlink_to(path)
    _, _, plan, _ = one_pass(FileSource(tmp_path / "link.jsonl"))
    assert (tmp_path / "mem.jsonl.consolidate" / "applied.jsonl").is_file()
    assert not (tmp_path / "link.jsonl.consolidate").exists()
    rep = FileSource(path).undo(plan.plan_id[:8])
    assert rep.plan_id == plan.plan_id and rep.undone
    # an older journal beside a link, none beside the real file
    (tmp_path / "old").mkdir()
    real = tmp_path / "old" / "m.jsonl"
    real.write_text("")
    (tmp_path / "old" / "l.jsonl").symlink_to(real)
    (tmp_path / "old" / "l.jsonl.consolidate").mkdir()
    with caplog.at_level("WARNING", logger="consolidate"):
        got = default_state_dir(tmp_path / "old" / "l.jsonl")
    assert got == tmp_path / "old" / "l.jsonl.consolidate"
    assert f"move it to {real}.consolidate" in caplog.text
    assert default_state_dir(real) == tmp_path / "old" / "m.jsonl.consolidate"
