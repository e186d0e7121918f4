"""The jobs' command line: user errors are one ``error:`` line and exit 2; ``--help`` shows
the job, its groups and choices, and nothing internal (run in-process, as the console
scripts run)."""

from __future__ import annotations

import sys

import pytest

from consolidate.jobs import consolidate as consolidate_job
from consolidate.jobs import evaluate as evaluate_job
from consolidate.jobs import undo as undo_job
from consolidate.jobs.cli import config_keys, suggest


def _run(main, args, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["prog", *args, f"hydra.run.dir={tmp_path}/run"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # main() sets it; restored after the test
    monkeypatch.delenv("CONSOLIDATE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as ex:
        main()
    return ex.value.code, capsys.readouterr()


@pytest.mark.parametrize(
    ("main", "args", "want"),
    [
        (consolidate_job.main, ["pass.treshold=0.8"],
         "unknown key 'pass.treshold' in consolidate's config; did you mean pass.threshold?"),
        (consolidate_job.main, ["treshold=0.8"],
         "unknown key 'treshold' in consolidate's config; did you mean pass.threshold?"),
        (consolidate_job.main, ["pass.threshold=abc"],
         "pass.threshold: Value 'abc' of type 'str' could not be converted to Float"),
        (consolidate_job.main, ["merge=vlm"],
         "merge=vlm: no such choice (choices: extractive, llm, vllm); did you mean merge=vllm?"),
        (consolidate_job.main, ["store=nope"],
         "store=nope: no such choice (choices: existing, locomo)"),
        (consolidate_job.main, ["pass.threshold=0.9]"],
         "'pass.threshold=0.9]' does not parse: extraneous input ']'"),
        (consolidate_job.main, ["experiment=nightly"],
         "store.dir has no value: set it on the command line (store.dir=...)"),
        (consolidate_job.main, ["+pass.treshold=0.8"],
         "unknown key(s) ['treshold'] in 'pass': did you mean pass.threshold?"),
        (undo_job.main, ["merge=vllm"],
         "merge: no such config group in undo (groups: debug, paths, store)"),
        (undo_job.main, [], "merge_id has no value: set it on the command line (merge_id=...)"),
    ],
)  # fmt: skip
def test_user_errors_are_one_line_and_exit_2(main, args, want, monkeypatch, capsys, tmp_path):
    code, out = _run(main, args, monkeypatch, capsys, tmp_path)
    assert code == 2
    lines = out.err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and len(lines) == 2, out.err
    assert want in errors[0], errors[0]
    assert "Traceback" not in out.err and out.out == ""
    run = tmp_path / "run"
    if "no value" in want or "unknown key(s)" in want:  # refused by the job: its log says why
        (log,) = run.glob("*.log")
        assert errors[0] in log.read_text()
    else:  # refused while composing the config, before the run started
        assert not run.exists()


def test_debug_env_gives_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["prog", "pass.treshold=0.8"])
    monkeypatch.setenv("CONSOLIDATE_DEBUG", "1")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="treshold"):
        consolidate_job.main()


def _help(main, args, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["prog", *args, "--help"])
    with pytest.raises(SystemExit) as ex:
        main()
    assert ex.value.code == 0
    return capsys.readouterr().out


def test_help_shows_the_job_its_groups_and_choices(monkeypatch, capsys):
    text = _help(consolidate_job.main, [], monkeypatch, capsys)
    assert text.startswith("`consolidate`: the nightly sleep pass over one store")
    groups = text.split("Config groups")[1].split("Settings")[0]
    rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in groups.strip().splitlines()[1:]}
    assert rows["merge"] == "*extractive, llm, vllm"
    assert rows["similarity"] == "*default, faiss, torch, triton"
    assert rows["experiment"] == "nightly, *null"
    assert rows["source"] == "jsonl, lance, mem0, pgvector, *store"
    assert "base" not in groups and "hydra" not in rows
    assert "  threshold: 0.9\n" in text and "hydra:" not in text
    # the overrides given with --help are applied to what it shows
    text = _help(consolidate_job.main, ["merge=vllm", "pass.threshold=0.8"], monkeypatch, capsys)
    assert "*vllm" in text and "  threshold: 0.8\n" in text


def test_evaluate_help_offers_only_its_own_presets(monkeypatch, capsys):
    text = _help(evaluate_job.main, [], monkeypatch, capsys)
    groups = text.split("Config groups")[1].split("Settings")[0]
    assert "sweep_decay" in groups and "nightly" not in groups and "runner" not in groups


def test_bench_help_lists_its_presets(monkeypatch, capsys):
    from consolidate.jobs import bench as bench_job

    text = _help(bench_job.main, ["bench=tiny"], monkeypatch, capsys)
    assert text.startswith("`consolidate-bench`: ours against what a user would write instead")
    groups = text.split("Config groups")[1].split("Settings")[0]
    rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in groups.strip().splitlines()[1:]}
    assert rows["bench"] == "cpu, gpu, *tiny"
    assert "  preset: tiny\n" in text and "  pass_baseline: null\n" in text


def test_suggest_and_keys():
    keys = config_keys("consolidate")
    assert {"pass.threshold", "store.dir", "merge._target_", "task_name"} <= set(keys)
    assert suggest("pass.treshold", keys) == "pass.threshold"
    assert suggest("tau", ["pass.tau_hours", "store.dir"]) is None
    assert suggest("tau_hour", ["pass.tau_hours", "store.dir"]) == "pass.tau_hours"
