"""Config composition: every job's primary config composes, typos fail at compose time."""

import shutil

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from consolidate.config import PassConfig, SimilarityConfig, StoreConfig
from consolidate.jobs.common import CONFIG_DIR, pass_cfg, sim_cfg, typed
from tests.helpers import compose_cfg


@pytest.mark.parametrize("name", ["consolidate", "undo", "import"])
def test_primary_configs_compose(name):
    cfg = compose_cfg(name, ["merge_id=m-x"] if name == "undo" else [])
    assert cfg.task_name == name


def test_defaults_are_typed():
    cfg = compose_cfg("consolidate")
    pc = pass_cfg(cfg)
    assert isinstance(pc, PassConfig) and pc.threshold == 0.9 and pc.tau_hours == 2160
    assert isinstance(sim_cfg(cfg), SimilarityConfig)
    st = typed(cfg, "store", StoreConfig)
    assert st.dir.endswith("stores/locomo") and st.locomo_file.endswith("locomo/locomo10.json")


def test_data_dir_from_environment(monkeypatch):
    monkeypatch.setenv("CONSOLIDATE_DATA_DIR", "/data/x")
    st = typed(compose_cfg("consolidate"), "store", StoreConfig)
    assert st.locomo_file == "/data/x/locomo/locomo10.json"


def test_presets():
    cfg = compose_cfg("consolidate", ["experiment=nightly", "store.dir=/tmp/s"])
    assert pass_cfg(cfg).now == "wall" and cfg.store.init_from is None
    cfg = compose_cfg("consolidate", ["debug=default"])
    assert cfg.store.conversations == 2 and cfg.store.name == "locomo-debug"


def test_mistyped_override_fails():
    with pytest.raises(ConfigCompositionException, match="treshold"):
        compose_cfg("consolidate", ["sleep.treshold=0.5"])
    with pytest.raises(ConfigCompositionException):
        compose_cfg("consolidate", ["sleep.tau_hours=many"])


def test_mistyped_key_in_a_yaml_file_fails(tmp_path):
    d = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, d)
    (d / "sleep" / "typo.yaml").write_text("defaults:\n  - base\n  - _self_\ntreshold: 0.5\n")
    with pytest.raises((ConfigCompositionException, ConfigKeyError), match="treshold"):
        compose_cfg("consolidate", ["sleep=typo"], config_dir=d)


def test_plus_added_typo_is_refused_when_the_job_reads_the_config():
    cfg = compose_cfg("consolidate", ["+sleep.treshold=0.5"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['treshold'\] in 'sleep'"):
        pass_cfg(cfg)


def test_nightly_requires_a_store_dir():
    from omegaconf import OmegaConf

    cfg = compose_cfg("consolidate", ["experiment=nightly"])
    assert OmegaConf.is_missing(cfg.store, "dir")


class KwargsEmbedder:
    """Records the keyword arguments it was built with (for the ``_target_`` test)."""

    def __init__(self, **kw):
        self.kw = kw


def test_the_embedder_and_llm_backends_are_built_from_target():
    from consolidate.config import EmbedderConfig
    from consolidate.factory import make_embedder
    from consolidate.llm.merger import LLMMerger

    emb = make_embedder(EmbedderConfig(_target_=f"{__name__}.KwargsEmbedder", device="cpu"))
    assert isinstance(emb, KwargsEmbedder)
    assert emb.kw == {
        "name": "all-MiniLM-L6-v2", "model_path": None, "device": "cpu", "batch_size": 128,
        "show_progress": True, "dtype": "fp32", "pipeline": "packed", "batch_tokens": 16384,
        "long_text": "error",
    }  # fmt: skip
    cfg = compose_cfg("consolidate", ["merge=llm", "+merge.backend._target_=tests.helpers.Scripted",
                                   "+merge.backend.answers=[]", "merge.cache_path=null"])  # fmt: skip
    from hydra.utils import instantiate

    merger = instantiate(cfg.merge)
    assert isinstance(merger, LLMMerger) and merger.name == "llm:scripted"
    direct = LLMMerger({"_target_": "tests.helpers.Scripted"}, {"answers": ["x"]}, cache_path=None)
    assert direct.backend.answers == ["x"]


@pytest.mark.parametrize("now", ["yesterday", "today", "now", "soon", "05/08/2023"])
def test_sleep_now_that_is_no_time_is_refused_before_any_work(now):
    from consolidate.config import PassConfig
    from consolidate.pipeline import check_settings

    with pytest.raises(ValueError, match=r"^sleep\.now must be 'wall', 'latest', hours"):
        check_settings(PassConfig(now=now))


@pytest.mark.parametrize(
    "now", ["wall", "latest", "1000.5", "2023-05-08T10:00", "2023-05-08T10:00+02:00"]
)
def test_sleep_now_forms_accepted(now):
    from consolidate.config import PassConfig
    from consolidate.pipeline import check_settings

    check_settings(PassConfig(now=now))


def test_a_missing_policy_or_calibration_file_is_named_by_its_key(tmp_path):
    from consolidate.consolidation import _settings_file
    from consolidate.evaluation.thresholds import load_calibration

    with pytest.raises(ValueError, match=r"^sleep\.policy_file=/nowhere/p\.json: no such file$"):
        _settings_file(load_calibration, "sleep.policy_file", "/nowhere/p.json")
    with pytest.raises(ValueError, match=r"is a folder, not a file$"):
        _settings_file(load_calibration, "sleep.calibration_file", str(tmp_path))
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"^sleep\.calibration_file=.*c\.json: "):
        _settings_file(load_calibration, "sleep.calibration_file", str(bad))


def test_sleep_now_not_finite_is_refused():
    from consolidate.config import PassConfig
    from consolidate.pipeline import check_settings

    with pytest.raises(ValueError, match=r"^sleep\.now must be finite hours"):
        check_settings(PassConfig(now="nan"))


def test_the_llm_uses_of_each_job_are_what_composing_gives():
    """:func:`llm_uses` reads the YAML files; composing each job with each choice it names
    gives that use its ``llm@<use>`` key, and the job's other choices do not."""
    from consolidate.jobs.cli import _compose, _groups, _options
    from consolidate.jobs.llm_keys import llm_uses

    assert llm_uses("consolidate") == {"merge": ["merge=llm", "merge=vllm"],
                                       "reflect": ["reflect=llm"]}  # fmt: skip
    assert llm_uses("evaluate") == llm_uses("policy") == {
        "merge": ["merge=llm", "merge=vllm"], "answer": []
    }  # fmt: skip
    assert llm_uses("ingest") == {"ingest": []}
    assert llm_uses("undo") == {} and llm_uses("recall") == {}
    for job in ("consolidate", "evaluate"):
        for use, homes in llm_uses(job).items():
            for choice in _options(use, job) if homes else []:
                choices = _groups(job, _compose(job, [f"{use}={choice}"]))
                assert (f"llm@{use}" in choices) == (f"{use}={choice}" in homes), (job, choice)


@pytest.mark.parametrize(
    ("job", "overrides", "backend"),
    [
        ("consolidate", ["merge=llm", "llm@merge=openai"], ("merge", "openai")),
        ("consolidate", ["merge=vllm"], ("merge", "vllm")),
        ("consolidate", ["merge=llm", "merge.backend=transformers"], ("merge", "transformers")),
        ("consolidate", ["llm@reflect=vllm", "sleep.reflect=true"], ("reflect", "vllm")),
        ("consolidate", ["merge=llm", "+merge.backend._target_=tests.helpers.Scripted"], None),
        ("ingest", ["llm@ingest=openai"], ("ingest", "openai")),
        ("evaluate", [], ("answer", None)),
        ("evaluate", ["answer.backend=transformers"], ("answer", "transformers")),
        ("evaluate", ["answer.backend=openai", "llm@answer=openai"], ("answer", "openai")),
        ("policy", ["answer.backend=openai", "llm@answer=openai"], ("answer", "openai")),
    ],
)  # fmt: skip
def test_backends_chosen_with_their_llm_key_pass_the_check(job, overrides, backend):
    """The forms docs/models.md gives compose, and check_llm_backends lets them through."""
    from omegaconf import OmegaConf

    from consolidate.jobs.cli import _compose
    from consolidate.jobs.llm_keys import check_llm_backends

    cfg = _compose(job, overrides)
    check_llm_backends(job, cfg, cfg.hydra.runtime.choices, overrides)
    if backend is not None:
        use, name = backend
        assert cfg[use].backend == name
        if name is not None:
            assert cfg.hydra.runtime.choices[f"llm@{use}"] == name
            # the settings are the chosen backend's own (conf/llm/<name>.yaml)
            own = OmegaConf.load(f"{CONFIG_DIR}/llm/{name}.yaml").backend_kwargs
            assert set(cfg[use].backend_kwargs) == set(own)
