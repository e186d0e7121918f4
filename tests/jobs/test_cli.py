"""The jobs' command line: user errors are one ``error:`` line and exit 2; ``--help`` shows
the job, its groups and choices, and nothing internal (run in-process, as the console
scripts run)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
        (consolidate_job.main, ["sleep.treshold=0.8"],
         "unknown key 'sleep.treshold' in consolidate's config; did you mean sleep.threshold?"),
        (consolidate_job.main, ["treshold=0.8"],
         "unknown key 'treshold' in consolidate's config; did you mean sleep.threshold?"),
        (consolidate_job.main, ["sleep.threshold=abc"],
         "sleep.threshold: Value 'abc' of type 'str' could not be converted to Float"),
        (consolidate_job.main, ["merge=vlm"],
         "merge=vlm: no such choice (choices: extractive, llm, vllm); did you mean merge=vllm?"),
        (consolidate_job.main, ["store=nope"],
         "store=nope: no such choice (choices: existing, locomo)"),
        (consolidate_job.main, ["sleep.threshold=0.9]"],
         "cannot read the override 'sleep.threshold=0.9]': extraneous input ']'"),
        (consolidate_job.main, ["experiment=nightly"],
         "store.dir has no value: set it on the command line (store.dir=...)"),
        (consolidate_job.main, ["+sleep.treshold=0.8"],
         "unknown key(s) ['treshold'] in 'sleep': did you mean sleep.threshold?"),
        (undo_job.main, ["merge=vllm"],
         "merge: no such config group in undo (groups: debug, paths, source, store)"),
        (undo_job.main, [], "consolidate-undo needs id=...: a merge id"),
        (consolidate_job.main, ["=0.8"], "'=0.8' has no key: write KEY=VALUE"),
        (consolidate_job.main, ["sleep.threshold=1.5", "store.dir=/nonexistent/store"],
         "sleep.threshold must be in [-1, 1], got 1.5"),
        (consolidate_job.main, ["~sleep", "store.dir=/nonexistent/store"],
         "the config has no 'sleep' settings (removed with ~sleep?)"),
        (evaluate_job.main, ["answer.questions=abc"],
         "answer.questions: Value 'abc' of type 'str' could not be converted to Integer"),
        (evaluate_job.main, ["answer.questons=3"],
         "unknown key 'answer.questons' in evaluate's config; did you mean answer.questions?"),
        (evaluate_job.main, ["ks=[1,x]"], "ks[1]: Value 'x' of type 'str' could not be converted"),
        # a model's backend: the key as typed, and the group choice it needs
        (consolidate_job.main, ["merge=llm", "llm@merge=opnai", "sleep.dry_run=true"],
         "error: llm@merge=opnai: no such choice (choices: openai, transformers, vllm); "
         "did you mean llm@merge=openai? ("),
        (consolidate_job.main, ["llm@merge=openai"],
         "error: llm@merge=openai sets the backend of the merge model, and merge=extractive has "
         "no model: add merge=llm (consolidate merge=llm llm@merge=openai) ("),
        (consolidate_job.main, ["llm@merge=opnai"],
         "add merge=llm (consolidate merge=llm llm@merge=openai) ("),
        (consolidate_job.main, ["~reflect", "llm@reflect=openai"],
         "error: llm@reflect=openai sets the backend of the reflect model, and reflect=null has "
         "no model: add reflect=llm (consolidate reflect=llm llm@reflect=openai) ("),
        (consolidate_job.main, ["llm=openai"],
         "error: llm=openai: each model takes the llm group at its own key: llm@merge=openai "
         "(with merge=llm), llm@reflect=openai (with reflect=llm) ("),
        (consolidate_job.main, ["merge.backend=openai"],
         "error: merge.backend=openai: a model's backend is chosen with its llm@ key, and "
         "merge=extractive has no model: write merge=llm llm@merge=openai ("),
        (evaluate_job.main, ["merge.backend=opnai"],
         "merge=extractive has no model: write merge=llm llm@merge=openai ("),
        (consolidate_job.main, ["merge.backend_kwargs.model=m"],
         "error: merge.backend_kwargs.model=m: merge=extractive has no model: add merge=llm "
         "(and llm@merge=<openai|transformers|vllm> for its backend) ("),
        (consolidate_job.main, ["ingest.backend=openai"],
         "error: ingest.backend=openai: consolidate has no ingest model (llm@ingest belongs to "
         "consolidate-ingest); its models: llm@merge (with merge=llm), llm@reflect (with "
         "reflect=llm) ("),
        (undo_job.main, ["llm@merge=openai"],
         "error: llm@merge=openai: consolidate-undo runs no model (llm@merge belongs to "
         "consolidate, consolidate-evaluate, consolidate-policy) ("),
    ],
)  # fmt: skip
def test_user_errors_are_one_line_and_exit_2(main, args, want, monkeypatch, capsys, tmp_path):
    code, out = _run(main, args, monkeypatch, capsys, tmp_path)
    assert code == 2
    lines = out.err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and len(lines) == 1, out.err
    assert want in errors[0], errors[0]
    assert "Traceback" not in out.err and out.out == ""
    run = tmp_path / "run"
    if any(
        w in want for w in ("no value", "unknown key(s)", "must be in", "no 'sleep'", "needs id=")
    ):
        # refused by the job once it started: its log says why
        (log,) = run.glob("*.log")
        hint = " (CONSOLIDATE_DEBUG=1 shows the traceback)"
        assert errors[0].endswith(hint)
        assert errors[0].removesuffix(hint) in log.read_text()
    else:  # refused while composing the config, before the run started
        assert not run.exists()


def _refuse_to_run(*_a, **_k):
    raise AssertionError("the job ran: the config should have been refused before it")


@pytest.mark.parametrize(
    ("job", "args", "want"),
    [
        ("consolidate", ["merge=llm", "merge.backend=openai"],
         "merge.backend=openai would keep the settings of llm@merge=transformers "
         "(merge.backend_kwargs): choose the backend with llm@merge=openai instead"),
        ("consolidate", ["reflect.backend=openai"],
         "reflect.backend=openai would keep the settings of llm@reflect=transformers "
         "(reflect.backend_kwargs): choose the backend with llm@reflect=openai instead"),
        ("consolidate", ["merge=vllm", "merge.backend=transformers"],
         "merge.backend=transformers would keep the settings of llm@merge=vllm "
         "(merge.backend_kwargs): choose the backend with llm@merge=transformers instead"),
        ("consolidate", ["+llm@merge=openai"],
         "llm@merge=openai sets the backend of the merge model, and merge=extractive has no "
         "model: add merge=llm (consolidate merge=llm llm@merge=openai)"),
        ("ingest", ["ingest.backend=openai"],
         "ingest.backend=openai would keep the settings of llm@ingest=transformers "
         "(ingest.backend_kwargs): choose the backend with llm@ingest=openai instead"),
        ("evaluate", ["answer.backend=openai"],
         "answer.backend=openai would keep the settings of llm@answer=transformers "
         "(answer.backend_kwargs): add llm@answer=openai"),
        ("evaluate", ["answer.backend=opnai"],
         "answer.backend=opnai: no such backend (choices: openai, transformers, vllm); did you "
         "mean answer.backend=openai llm@answer=openai?"),
        ("evaluate", ["llm@answer=openai"],
         "llm@answer=openai has no effect while answer.backend=null (no answer model): add "
         "answer.backend=openai"),
        ("policy", ["answer.backend=openai"],
         "answer.backend=openai would keep the settings of llm@answer=transformers "
         "(answer.backend_kwargs): add llm@answer=openai"),
    ],
)  # fmt: skip
def test_a_backend_that_disagrees_with_its_llm_choice_is_refused_before_the_job_runs(
    job, args, want, monkeypatch, capsys, tmp_path
):
    """``<use>.backend=X`` alone would keep the other backend's ``backend_kwargs`` (it used
    to run, exit 0): one ``error:`` line, exit 2, the run's log says why, nothing ran."""
    import importlib

    module = importlib.import_module(f"consolidate.jobs.{job}")
    for name in ("run_consolidate", "run_ingest", "run_evaluate", "run_policy"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _refuse_to_run)
    code, out = _run(module.main, args, monkeypatch, capsys, tmp_path)
    hint = " (CONSOLIDATE_DEBUG=1 shows the traceback)"
    assert code == 2 and out.out == "", out
    assert out.err.strip().splitlines() == [f"error: {want}{hint}"], out.err
    (log,) = (tmp_path / "run").glob("*.log")
    assert f"error: {want}" in log.read_text()


def test_debug_env_gives_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["prog", "sleep.treshold=0.8"])
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
    groups = text.split("Config groups")[1].split("\n\n")[0]
    rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in groups.strip().splitlines()[1:]}
    assert rows["merge"] == "*extractive, llm, vllm"
    assert rows["similarity"] == "*default, faiss, torch, triton"
    assert rows["experiment"] == "nightly, *null"
    assert rows["source"] == "jsonl, lance, mem0, pgvector, *store"
    assert "base" not in groups and "hydra" not in rows
    assert "  threshold: 0.9\n" in text and "hydra:" not in text
    # the overrides given with --help are applied to what it shows
    text = _help(consolidate_job.main, ["merge=vllm", "sleep.threshold=0.8"], monkeypatch, capsys)
    assert "*vllm" in text and "  threshold: 0.8\n" in text


def test_evaluate_help_offers_only_its_own_presets(monkeypatch, capsys):
    text = _help(evaluate_job.main, [], monkeypatch, capsys)
    groups = text.split("Config groups")[1].split("\n\n")[0]
    assert "sweep_decay" in groups and "nightly" not in groups and "runner" not in groups


def test_bench_help_lists_its_presets(monkeypatch, capsys):
    from consolidate.jobs import bench as bench_job

    text = _help(bench_job.main, ["bench=tiny"], monkeypatch, capsys)
    assert text.startswith("`consolidate-bench`: ours against what a user would write instead")
    groups = text.split("Config groups")[1].split("\n\n")[0]
    rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in groups.strip().splitlines()[1:]}
    assert rows["bench"] == "cpu, gpu, *tiny"
    assert "  preset: tiny\n" in text and "  pass_baseline: null\n" in text


def test_suggest_and_keys():
    keys = config_keys("consolidate")
    assert {"sleep.threshold", "store.dir", "merge._target_", "task_name"} <= set(keys)
    assert suggest("sleep.treshold", keys) == "sleep.threshold"
    assert suggest("tau", ["sleep.tau_hours", "store.dir"]) is None
    assert suggest("tau_hour", ["sleep.tau_hours", "store.dir"]) == "sleep.tau_hours"


def test_the_old_pass_group_name_is_read_as_sleep(capsys):
    from consolidate.jobs.cli import renamed_overrides

    got = renamed_overrides(
        ["pass.threshold=0.8", "+pass.x=1", "~pass", "pass=default", "bypass.x=1", "passes=2",
         "sleep.floor=0.1"]
    )  # fmt: skip
    assert got == ["sleep.threshold=0.8", "+sleep.x=1", "~sleep", "sleep=default", "bypass.x=1",
                   "passes=2", "sleep.floor=0.1"]  # fmt: skip
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 4 and notes[0].startswith("note: the config group 'pass' is now 'sleep'")


def test_every_job_config_has_a_schema(tmp_path, monkeypatch, capsys):
    """Each primary config starts from its schema (``<job>_schema``, or evaluate's for the
    policy job), so a key a YAML file adds without one is an error naming the file."""
    from consolidate.config import JOB_SCHEMAS
    from consolidate.jobs.common import CONFIG_DIR

    primaries = sorted(p.stem for p in Path(CONFIG_DIR).glob("*.yaml"))
    assert set(primaries) == set(JOB_SCHEMAS) | {"policy"}
    for job in JOB_SCHEMAS:
        head = (Path(CONFIG_DIR) / f"{job}.yaml").read_text().split("defaults:")[1]
        assert head.lstrip().startswith(f"- {job}_schema"), job
    (tmp_path / "sleep").mkdir()
    (tmp_path / "sleep" / "mine.yaml").write_text(
        "defaults:\n  - base\n  - _self_\ntreshold: 0.5\n"
    )
    code, out = _run(consolidate_job.main, [f"hydra.searchpath=[file://{tmp_path}]", "sleep=mine"],
                     monkeypatch, capsys, tmp_path)  # fmt: skip
    assert code == 2 and "error: In 'sleep/mine': Key 'treshold' not in 'PassConfig'" in out.err


def test_an_import_error_of_our_own_is_a_bug_not_a_user_error():
    from consolidate.jobs.common import user_errors

    with pytest.raises(ImportError, match="cannot import name"), user_errors():
        raise ImportError("cannot import name 'x' from 'consolidate.pipeline.run'",
                          name="consolidate.pipeline.run")  # fmt: skip
    with pytest.raises(SystemExit) as ex, user_errors():  # a missing package is the user's
        raise ImportError("install it with pip install 'consolidate[pgvector]'", name="psycopg")
    assert ex.value.code == 2


def test_help_skips_the_values_of_hydras_flags(monkeypatch, capsys):
    text = _help(consolidate_job.main, ["--cfg", "job", "sleep.threshold=0.8"], monkeypatch, capsys)
    assert "  threshold: 0.8\n" in text
    text = _help(consolidate_job.main, ["-m", "sleep.threshold=0.5,0.6"], monkeypatch, capsys)
    assert "  threshold: 0.9\n" in text


HELP_WITHOUT_TORCH = """
import importlib, sys
from importlib.metadata import entry_points
scripts = {e.name: e.value for e in entry_points(group="console_scripts")
           if e.value.startswith("consolidate.")}
assert len(scripts) >= 13, scripts  # [project.scripts]
for name, target in sorted(scripts.items()):
    module = importlib.import_module(target.split(":")[0])
    assert "torch" not in sys.modules, f"importing {target} imported torch"
    sys.argv = [name, "--help"]
    try:
        getattr(module, target.split(":")[1])()
    except SystemExit as e:
        assert e.code in (0, None), (name, e.code)
    assert "torch" not in sys.modules, f"{name} --help imported torch"
sys.argv = ["consolidate", "sleep.treshold=0.8"]
try:
    importlib.import_module("consolidate.jobs.consolidate").main()
except SystemExit as e:
    assert e.code == 2, e.code
assert "torch" not in sys.modules, "a mistyped setting imported torch"
from consolidate.jobs import consolidate, evaluate, policy
print(consolidate.run_consolidate.__module__, evaluate.full_context.__module__,
      policy.policy_verdict.__module__, "torch" in sys.modules)
"""


def test_help_and_a_mistyped_setting_do_not_import_torch():
    """Every console script of the package (``[project.scripts]``) answers ``--help``, and ``consolidate``
    a mistyped setting, without importing torch (about 1.2 s against 5 s with it); the
    library names the job modules give still load, with torch, when named."""
    import subprocess

    from tests.helpers import REPO

    p = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_TORCH],
        cwd=REPO,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == (
        "consolidate.consolidation consolidate.evaluation.evaluate consolidate.evaluation.policy "
        "True"
    )
    assert "did you mean sleep.threshold?" in p.stderr


def test_a_job_module_names_only_its_library():
    """The job modules' ``__getattr__`` (``lazy_library``) gives its library's names and
    raises ``AttributeError`` for any other, as a module does."""
    import json

    from consolidate.jobs.cli import lazy_library

    get = lazy_library("consolidate.jobs.x", "json", ("dumps",))
    assert get("dumps") is json.dumps
    with pytest.raises(
        AttributeError, match="module 'consolidate.jobs.x' has no attribute 'loads'"
    ):
        get("loads")
    assert not hasattr(consolidate_job, "run_pass")  # a name of no job library
