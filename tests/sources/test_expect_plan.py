"""``source.expect_plan``: the plan id a dry run printed binds the apply to that plan. Plan
ids are hex, and Hydra reads one such as ``661775e6`` (digits, one ``e``, digits) as the
float 6.61775e11; the job takes the text from its command line (under ``--multirun`` too),
and a config composed in Python that holds a number is refused before any work. The
undo job's ``id`` reads the same way."""

import sys

import pytest

from consolidate.factory import as_typed, expect_plan_text
from tests.helpers import run_job
from tests.sources.test_undo_sources import memory_file, one_pass


@pytest.mark.parametrize(
    "value, want", [(None, None), ("ABCD12", "abcd12"), (" 661775e6 ", "661775e6")]
)
def test_a_plan_id_given_as_text(value, want):
    assert expect_plan_text(value) == want


@pytest.mark.parametrize(
    "value, why",
    [
        (661775e6, r"source.expect_plan=661775000000.0 reached the job as a number"),
        (1234, r"source.expect_plan=1234 reached the job as a number"),
        ("abc", "give 4 characters of the plan id at least"),
        ("plan-1", "not a plan id"),
        ("661775000000.0", "not a plan id"),
        (True, "is not an id"),
    ],
)
def test_what_is_not_a_plan_id_outside_a_hydra_job(value, why):
    with pytest.raises(ValueError, match=why):
        expect_plan_text(value)


@pytest.mark.parametrize(
    "argv, key, value, want",
    [
        # a --multirun job: its own override says 9.3e+62, the arguments 930e60
        (["source.expect_plan=930e60"], "source.expect_plan", 930e60, "930e60"),
        (["++source.expect_plan=930e60"], "source.expect_plan", 930e60, "930e60"),
        # a field typed str holds the number's text
        (["id=930e60"], "id", "9.3e+62", "930e60"),
        (["id=1_000"], "id", "1000", "1_000"),
        # code set the value after the command line: the value, not the argument
        (["source.expect_plan=930e60"], "source.expect_plan", "ffff0000", "ffff0000"),
        (["source.expect_plan='930e60'"], "source.expect_plan", "930e60", "930e60"),
        (["source.expect_plan=${oc.env:PLAN}"], "source.expect_plan", "930e60", "930e60"),
        (["source.expect_plan=930e60", "id=1e35"], "id", 1e35, "1e35"),
    ],
)
def test_the_text_comes_from_the_argument_that_parses_to_the_value(
    monkeypatch, argv, key, value, want
):
    monkeypatch.setattr(sys, "argv", ["consolidate", *argv])
    assert as_typed(key, value, numbers=False) == want


def test_a_sweep_or_another_key_gives_no_text(monkeypatch):
    argv = ["consolidate", "source.expect_plan=ab12,930e60", "source.expect_plan = 9", "x=1"]
    monkeypatch.setattr(sys, "argv", argv)  # a sweep, a line Hydra cannot parse
    with pytest.raises(ValueError, match="reached the job as a number"):
        as_typed("source.expect_plan", 930e60, numbers=False)
    assert as_typed("x", 1.0) == "1"  # the text typed, which Hydra parses to 1 == 1.0
    assert as_typed("x", 2.0) == "2.0"  # not what x=1 parses to
    assert as_typed("y", 2.5) == "2.5"  # no argument names y


def test_a_composed_config_with_a_numeric_plan_id_is_refused_before_the_pass(tmp_path, compose_cfg):
    from consolidate.jobs.consolidate import run_consolidate

    path = memory_file(tmp_path)
    before = path.read_bytes()
    cfg = compose_cfg(
        "consolidate",
        overrides=[
            "source=jsonl",
            f"source.path={path}",
            "source.apply=true",
            "source.expect_plan=661775e6",  # Hydra: the float 661775000000.0
            "similarity.device=cpu",
            "sleep.force=true",
        ],
    )
    with pytest.raises(ValueError, match=r"source.expect_plan=661775000000.0 reached the job"):
        run_consolidate(cfg, out_dir=str(tmp_path / "run"))
    assert path.read_bytes() == before
    assert not (tmp_path / "run" / "plan.json").exists()  # refused before the pass


def _job(tmp_path, *args, **env):
    return run_job(tmp_path, *args, **env)


def test_the_job_reads_a_numeric_plan_id_as_the_text_typed(tmp_path):
    """``source.expect_plan=1e35`` on the command line is compared as ``1e35`` (not
    ``1e+35``): no plan starts with it, so exit 2, one line, nothing written; so is
    ``0e12`` read through ``${oc.env:PLAN}``; the 12 characters the first line names apply
    the plan."""
    path = memory_file(tmp_path)
    before = path.read_bytes()
    args = [
        "source=jsonl",
        f"source.path={path}",
        "source.apply=true",
        "similarity.device=cpu",
        "sleep.force=true",
        "sleep.max_drop_fraction=0.5",
    ]
    r = _job(tmp_path, *args, "source.expect_plan=1e35", f"hydra.run.dir={tmp_path}/r1")
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "source.expect_plan=1e35: the plan made now is " in err[0], err
    assert "1e+35" not in r.stderr
    assert path.read_bytes() == before
    plan_id = err[0].split("the plan made now is ")[1][:12]
    assert len(plan_id) == 12 and not set(plan_id) - set("0123456789abcdef")
    # an interpolation gives what it resolved to (oc.env: always text)
    r = _job(
        tmp_path, *args, "source.expect_plan=${oc.env:PLAN}", f"hydra.run.dir={tmp_path}/r3",
        PLAN="0e12",
    )  # fmt: skip
    assert r.returncode == 2 and "error: source.expect_plan=0e12: the plan made now" in r.stderr
    assert path.read_bytes() == before
    # --multirun: the job's own override is rewritten from the parsed value (1e+35)
    r = _job(
        tmp_path, "--multirun", *args, "source.expect_plan=1e35", f"hydra.sweep.dir={tmp_path}/m"
    )
    assert r.returncode == 2 and "error: source.expect_plan=1e35: the plan made now" in r.stderr
    assert path.read_bytes() == before
    # a dry run only says whether the plan made now matches
    r = _job(
        tmp_path, *args[:2], *args[3:], f"source.expect_plan={plan_id}",
        f"hydra.run.dir={tmp_path}/r4",
    )  # fmt: skip
    assert (
        r.returncode == 0 and f"the plan made now is {plan_id} (matches it)" in r.stdout + r.stderr
    )
    assert path.read_bytes() == before
    r = _job(tmp_path, *args, f"source.expect_plan={plan_id}", f"hydra.run.dir={tmp_path}/r2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "applied" in r.stdout and path.read_bytes() != before


def test_an_override_with_a_relative_interpolation(tmp_path):
    """``source.state_dir=${.path}.state``: the job reads its overrides without resolving
    them (the model check and :func:`~consolidate.factory.as_typed` read them as text)."""
    path = memory_file(tmp_path)
    r = _job(
        tmp_path, "source=jsonl", f"source.path={path}", "source.apply=true",
        "similarity.device=cpu", "sleep.force=true", "sleep.max_drop_fraction=0.5",
        "source.state_dir=${.path}.state", f"hydra.run.dir={tmp_path}/r",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "mem.jsonl.state" / "applied.jsonl").is_file()
    assert not (tmp_path / "mem.jsonl.consolidate").exists()


def test_a_file_plans_the_same_id_by_any_path_to_it(tmp_path, monkeypatch):
    """A dry run given ``mem.jsonl`` and an apply given its absolute path, or a link to it,
    plan the same id (the plan hashes the file's real path), so ``source.expect_plan``
    binds them; another file's plan has another id."""
    from consolidate.sources import FileSource

    path = memory_file(tmp_path)
    (tmp_path / "link.jsonl").symlink_to(path)
    monkeypatch.chdir(tmp_path)
    ids = {
        one_pass(FileSource(p), apply=False)[2].plan_id
        for p in ("mem.jsonl", path, tmp_path / "link.jsonl")
    }
    assert len(ids) == 1
    other = tmp_path / "other.jsonl"
    other.write_bytes(path.read_bytes())
    assert one_pass(FileSource(other), apply=False)[2].plan_id not in ids
