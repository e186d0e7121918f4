"""The one lazy registry (consolidate.registry) and the four kinds registered with it:
similarity engines, LLM backends, external sources and store formats."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from consolidate.registry import Registry, did_you_mean


def test_a_name_is_imported_only_when_loaded(monkeypatch):
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    r = Registry("thing", {"hls": "colorsys:rgb_to_hls", "q": ("fractions:Fraction", "")})
    assert "colorsys" not in sys.modules
    assert list(r) == ["hls", "q"] and len(r) == 2 and r["hls"] == "colorsys:rgb_to_hls"
    f = r.load("hls")
    assert "colorsys" in sys.modules
    assert f(1.0, 0.0, 0.0) == (0.0, 0.5, 1.0)
    assert str(r.load("q")(6, 4)) == "3/2"


def test_an_unknown_name_lists_the_known_and_suggests_the_closest():
    r = Registry("similarity engine", {"torch": "m:a", "triton": "m:b", "faiss": "m:c"})
    with pytest.raises(ValueError) as e:
        r.load("fais")
    assert str(e.value) == (
        "unknown similarity engine 'fais'; known: torch, triton, faiss; did you mean 'faiss'?"
    )
    with pytest.raises(ValueError) as e:
        r.load("zzz")
    assert str(e.value) == "unknown similarity engine 'zzz'; known: torch, triton, faiss"
    assert did_you_mean("auot", ("auto", "torch")) == "; did you mean 'auto'?"
    assert did_you_mean("x", ()) == ""


def test_a_missing_package_names_its_install_hint():
    r = Registry("backend", {"nope": ("no_such_module_xyz.sub:C", "pip install xyz")})
    with pytest.raises(ImportError) as e:
        r.load("nope")
    assert "backend 'nope' needs packages that are missing" in str(e.value)
    assert str(e.value).endswith("install with: pip install xyz")
    bare = Registry("backend", {"nope": "no_such_module_xyz:C"})
    with pytest.raises(ModuleNotFoundError, match="no_such_module_xyz"):
        bare.load("nope")


def test_register_checks_the_target_and_replaces_a_binding():
    r = Registry("thing")
    for bad in ("colorsys", "colorsys:", ":rgb_to_hls", ""):
        with pytest.raises(ValueError, match="target must be 'module:attr'"):
            r.register("x", bad)
    assert len(r) == 0
    r.register("x", "colorsys:rgb_to_hls")
    r.register("x", "colorsys:hls_to_rgb")
    assert r.names() == ("x",) and r.load("x")(0.0, 0.5, 1.0) == (1.0, 0.0, 0.0)


def test_every_kind_goes_through_a_registry_with_did_you_mean(tmp_path):
    from consolidate.llm.base import BACKENDS, make_backend
    from consolidate.similarity import check_engine
    from consolidate.similarity.engines import REGISTRY, get_engine
    from consolidate.sources.open import SOURCE_KINDS, SOURCES, open_source
    from consolidate.store.base import FORMATS
    from consolidate.store.lance import LanceStore, open_store_dir
    from consolidate.store.store import ParquetStore

    assert REGISTRY.names() == ("torch", "triton", "faiss")
    assert BACKENDS.names() == ("transformers", "openai", "vllm")
    assert SOURCE_KINDS == SOURCES.names() == ("pgvector", "mem0", "jsonl", "lance")
    assert FORMATS.names() == ("lance", "parquet")
    with pytest.raises(ValueError, match="did you mean 'faiss'"):
        get_engine("fais")
    with pytest.raises(ValueError, match=r"engine must be one of .*did you mean 'triton'"):
        check_engine("trition", "cpu")
    with pytest.raises(ValueError, match="unknown LLM backend 'vlm'.*did you mean 'vllm'"):
        make_backend("vlm")
    with pytest.raises(ValueError, match="source must be store, .*got 'pgvectr'; did you mean"):
        open_source(SimpleNamespace(kind="pgvectr"))
    with pytest.raises(ValueError, match="store.format must be .*did you mean 'lance'"):
        open_store_dir(tmp_path / "s", format="lanse")
    lance = open_store_dir(tmp_path / "a", format="lance", retention_h=12.0)
    parquet = open_store_dir(tmp_path / "b", format="parquet", retention_h=12.0)
    assert type(lance) is LanceStore and lance.retention_h == 12.0
    assert type(parquet) is ParquetStore and not hasattr(parquet, "retention_h")
