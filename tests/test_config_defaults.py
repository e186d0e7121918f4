"""Defaults are written once: every value a config YAML sets equals the default of the
code it configures (the group's dataclass, the job's schema, the LLM backend's
constructor), or it is listed in :data:`OVERRIDES` with the reason it differs. A YAML value
that drifts from its dataclass default fails here."""

import ast
import dataclasses
import re

import pytest
import yaml

from consolidate import config as C
from consolidate.llm.base import BACKENDS
from tests.helpers import REPO

CONF = REPO / "consolidate" / "conf"

#: group folder -> the dataclass its ``base`` schema is (config.register_configs)
GROUPS = {
    "sleep": C.PassConfig,
    "similarity": C.SimilarityConfig,
    "embedder": C.EmbedderConfig,
    "store": C.StoreConfig,
    "paths": C.PathsConfig,
    "runner": C.RunnerConfig,
    "source": C.SourceConfig,
    "bench": C.BenchConfig,
}

#: (file under conf/, dotted key) -> why the YAML sets another value than the dataclass
OVERRIDES = {
    ("similarity/faiss.yaml", "engine"): "the group option's point",
    ("similarity/torch.yaml", "engine"): "the group option's point",
    ("similarity/triton.yaml", "engine"): "the group option's point",
    ("store/existing.yaml", "name"): "the group option's point",
    ("store/existing.yaml", "init_from"): "an existing store is never built",
    ("store/locomo.yaml", "dir"): "interpolated from paths (the dataclass has no paths)",
    ("store/locomo.yaml", "locomo_file"): "interpolated from paths.data_dir",
    ("paths/default.yaml", "root_dir"): "reads $CONSOLIDATE_ROOT",
    ("paths/default.yaml", "data_dir"): "reads $CONSOLIDATE_DATA_DIR",
    ("paths/default.yaml", "store_root"): "interpolated from paths.root_dir",
    ("runner/ray.yaml", "kind"): "the group option's point",
    ("source/jsonl.yaml", "kind"): "the group option's point",
    ("source/jsonl.yaml", "path"): "required (???) for this kind",
    ("source/lance.yaml", "kind"): "the group option's point",
    ("source/lance.yaml", "path"): "required (???) for this kind",
    ("source/lance.yaml", "columns"): "this kind's column names",
    ("source/mem0.yaml", "kind"): "the group option's point",
    ("source/mem0.yaml", "mem0"): "the Memory.from_config skeleton to fill in",
    ("source/pgvector.yaml", "kind"): "the group option's point",
    ("source/pgvector.yaml", "dsn"): "required (???) for this kind",
    ("source/pgvector.yaml", "table"): "required (???) for this kind",
    ("source/pgvector.yaml", "columns"): "this kind's column names",
    ("bench/gpu.yaml", "preset"): "the group option's point",
    ("bench/tiny.yaml", "preset"): "the group option's point",
    ("evaluate.yaml", "embedder"): "a group node: the benchmark truncates long texts",
    ("evaluate.yaml", "sleep"): "a group node: evaluation measures heavy drops",
    ("evaluate.yaml", "variants"): "the ablation arms",
    ("evaluate.yaml", "answer.variants"): "the arms answered",
    ("calibrate.yaml", "datasets"): "the calibration sets",
    ("calibrate.yaml", "embedder"): "a group node: no progress bars",
    ("ingest.yaml", "store"): "a group node: the ingested store's name",
    ("recall.yaml", "embedder"): "a group node: no progress bars",
    ("reembed.yaml", "embedder"): "a group node: no progress bars",
    ("reembed.yaml", "calibration"): "every pair for the new model's calibration",
}


def default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"


def differences(cls, node, where, prefix=""):
    """``(where, key)`` of every value in ``node`` (a YAML mapping) other than ``cls``'s
    default, and of every key ``cls`` has no field for."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for k, v in node.items():
        if k == "defaults":
            continue
        key = prefix + k
        if k not in fields:
            out.append((where, key, "no such field"))
            continue
        d = default(fields[k])
        if dataclasses.is_dataclass(d) and isinstance(v, dict):
            out += differences(type(d), v, where, key + ".")
        elif v != d:
            out.append((where, key, f"{v!r} != default {d!r}"))
    return out


def yaml_of(rel):
    return yaml.safe_load((CONF / rel).read_text()) or {}


def cases():
    for group, cls in GROUPS.items():
        for p in sorted((CONF / group).glob("*.yaml")):
            yield f"{group}/{p.name}", cls
    for name, cls in C.JOB_SCHEMAS.items():
        yield f"{name}.yaml", cls


@pytest.mark.parametrize(("rel", "cls"), list(cases()), ids=lambda x: str(x))
def test_every_yaml_value_is_its_default_or_a_listed_override(rel, cls):
    diff = [d for d in differences(cls, yaml_of(rel), rel) if d[:2] not in OVERRIDES]
    assert not diff, "\n".join(f"{w}: {k}: {why}" for w, k, why in diff)


def test_every_listed_override_still_differs():
    """A stale entry (the YAML now equals the default, or the key is gone) is removed."""
    found = {d[:2] for rel, cls in cases() for d in differences(cls, yaml_of(rel), rel)}
    assert not set(OVERRIDES) - found, sorted(set(OVERRIDES) - found)


def constructor_defaults(kind):
    """The keyword defaults of backend ``kind``'s ``__init__``, read from its source (the
    vLLM backend's module imports vLLM, which this machine need not have)."""
    module, name = BACKENDS[kind].split(":")
    path = REPO / (module.replace(".", "/") + ".py")
    cls = next(
        n
        for n in ast.parse(path.read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == name
    )
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[1:]
    defaults = [None] * (len(args) - len(init.args.defaults)) + init.args.defaults
    return {
        a.arg: (ast.literal_eval(d) if d is not None else "???")
        for a, d in zip(args, defaults, strict=True)
    }


@pytest.mark.parametrize("kind", ["transformers", "vllm", "openai"])
def test_the_llm_group_holds_the_backends_own_defaults(kind):
    node = yaml_of(f"llm/{kind}.yaml")
    assert node["backend"] == kind
    init = constructor_defaults(kind)
    assert {k: init[k] for k in node["backend_kwargs"]} == node["backend_kwargs"]


def test_no_other_config_writes_a_backend_block():
    """The LLM backend block lives in conf/llm/ only (merge, reflect, ingest and answer
    take it from there)."""
    bad = [
        str(p.relative_to(CONF))
        for p in sorted(CONF.rglob("*.yaml"))
        if p.parent.name != "llm" and re.search(r"^\s*backend_kwargs:", p.read_text(), re.M)
    ]
    assert not bad, bad
