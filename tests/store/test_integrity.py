"""Every byte of a small Lance store's newest manifest, of its newest transaction file and of
one data file flipped in turn: each load is a clean ``CorruptStoreError`` or the same records,
never another exception (a panic inside Lance included) and never different records."""

import json

import numpy as np
import pytest

from consolidate.config import PassConfig
from consolidate.pipeline import run_pass
from consolidate.store import CorruptStoreError
from tests.helpers import make_records
from tests.store.test_store import base_rows

pytest.importorskip("lance")
from consolidate.store.lance import CHECKSUMS, LanceStore  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = LanceStore(tmp_path_factory.mktemp("fuzz") / "s")
    s.create(make_records(base_rows()))
    with s.lock():
        snap = s.load()
        res = run_pass(snap.records, cfg=PassConfig(threshold=0.95, now="200", floor=0), version=2)
        s.commit(res.records, res.events, base=snap)
    s.mark_used(["c"], now=150.0)
    return s


def _same(a, b) -> bool:
    return a.records.meta.equals(b.records.meta) and np.array_equal(
        a.records.vectors, b.records.vectors
    )


def _flip_each_byte(store, rel):
    path = store.dataset_path / rel
    orig = path.read_bytes()
    ref = store.load()
    outcome = {"error": 0, "same": 0}
    try:
        for i in range(len(orig)):
            path.write_bytes(orig[:i] + bytes([orig[i] ^ 0xFF]) + orig[i + 1 :])
            try:
                got = store.load()
            except CorruptStoreError as e:
                assert str(e) and "\n" not in str(e).strip(), str(e)
                outcome["error"] += 1
                continue
            assert _same(got, ref), f"byte {i} of {rel}: a silent difference"
            outcome["same"] += 1
    finally:
        path.write_bytes(orig)
    assert _same(store.load(), ref)
    return outcome


def _newest(store, kind):
    ds = store._open()
    t = ds.tracked_files(min_version=ds.version).read_all().to_pandas()
    return t[(t["version"] == ds.version) & (t["type"] == kind)]["path"].iloc[0]


def test_every_byte_of_the_newest_manifest(store):
    rel = _newest(store, "manifest")
    assert rel in json.loads((store.root / CHECKSUMS).read_text())["files"]
    out = _flip_each_byte(store, rel)
    # every flip is caught by the manifest's CRC32 before Lance reads it
    assert out["same"] == 0 and out["error"] == (store.dataset_path / rel).stat().st_size


def test_every_byte_of_the_newest_transaction_file(store):
    out = _flip_each_byte(store, _newest(store, "transaction file"))
    assert out["same"] == 0 and out["error"] > 0


@pytest.mark.slow
def test_every_byte_of_a_data_file(store):
    out = _flip_each_byte(store, _newest(store, "data file"))
    assert out["error"] > 0


def _small(tmp_path, name="s"):
    s = LanceStore(tmp_path / name)
    s.create(make_records(base_rows()))
    return s


def test_a_deleted_checksums_file_is_a_corruption_error(tmp_path):
    s = _small(tmp_path)
    assert json.loads(s.pointer_path.read_text())["checksums"] is True
    (s.root / CHECKSUMS).unlink()
    with pytest.raises(CorruptStoreError, match="CHECKSUMS.json is missing"):
        s.load()
    with pytest.raises(CorruptStoreError, match="CHECKSUMS.json is missing"):
        s.append(make_records([{**base_rows()[2], "id": "new"}]))


def test_a_store_of_the_older_layout_gains_the_marker_flag(tmp_path):
    s = _small(tmp_path)
    marker = json.loads(s.pointer_path.read_text())
    del marker["checksums"]
    s.pointer_path.write_text(json.dumps(marker))
    (s.root / CHECKSUMS).unlink()  # a store written before checksums: loads unchecked
    assert len(s.load().records) == 4
    s.append(make_records([{**base_rows()[2], "id": "new"}]))  # records checksums
    assert json.loads(s.pointer_path.read_text())["checksums"] is True
    assert (s.root / CHECKSUMS).is_file() and len(s.load().records) == 5


def test_verify_checks_every_file_of_every_retained_version(tmp_path):
    from omegaconf import OmegaConf

    from consolidate.jobs.versions import run_versions

    s = _small(tmp_path)
    with s.lock():
        snap = s.load()
        res = run_pass(snap.records, cfg=PassConfig(threshold=0.95, now="200", floor=0), version=2)
        s.commit(res.records, res.events, base=snap)
    out = s.verify_all()
    assert [v["version"] for v in out] == sorted(int(v["version"]) for v in s._open().versions())
    assert all("error" not in v for v in out)
    # the first version: 1 data file + its manifest + its transaction file
    assert out[0]["checked"] == 3 and out[0]["unrecorded"] == 0
    base = {
        "store": {"name": "x", "dir": str(s.root), "init_from": None},
        "action": "verify",
        "version": None,
        "other": None,
        "ids": [],
        "out": None,
        "dry_run": False,
    }
    assert len(run_versions(OmegaConf.create(base))["verified"]) == len(out)
    # damage an old version's manifest: the newest still loads, verify names the old one
    old = s.dataset_path / s._manifests()[1]
    b = bytearray(old.read_bytes())
    b[10] ^= 0x01
    old.write_bytes(bytes(b))
    assert len(s.load().records) == len(res.records)
    bad = [v for v in s.verify_all() if "error" in v]
    assert [v["version"] for v in bad] == [1] and "manifest of version 1" in bad[0]["error"]
    with pytest.raises(CorruptStoreError, match=r"1 of \d+ retained versions .* version 1"):
        run_versions(OmegaConf.create(base))


def test_a_namespace_load_checks_its_files_before_reading_any_column(tmp_path, monkeypatch):
    """A load of some namespaces finds their fragments through the namespace index alone
    and checks those files' CRC32s before the first scan reads a column (a damaged data
    file can make Lance abort the process); the fragments found are those the scan then
    reads. Without the index, every file is checked first."""
    from consolidate.store.lance import reading
    from tests.helpers import random_rows

    s = LanceStore(tmp_path / "s")
    s.create(make_records(random_rows(40, 8, seed=1, namespaces=4)))
    more = [{**r, "id": f"x{k}"} for k, r in enumerate(random_rows(8, 8, seed=2, namespaces=1))]
    s.append(make_records(more))  # ns0 gets a second fragment
    order = []
    real_verify, real_scan = LanceStore.verify, reading._scan

    def verify(self, version=None, fragments=None):
        order.append(("verify", None if fragments is None else sorted(fragments)))
        return real_verify(self, version, fragments=fragments)

    def scan(ds, flt, dim, found=None, widths_out=None):
        out = real_scan(ds, flt, dim, found, widths_out)
        order.append(("scan", sorted(set((out[2] >> np.uint64(32)).tolist()))))
        return out

    monkeypatch.setattr(LanceStore, "verify", verify)
    monkeypatch.setattr(reading, "_scan", scan)
    s.load(namespaces=["ns0"])
    first, *rest = order
    assert first[0] == "verify" and first[1] == order[-1][1] and len(first[1]) == 2
    assert [o[0] for o in order][-1] == "scan"
    monkeypatch.setattr(reading, "_fragments_of", lambda ds, ns: None)  # no usable index
    order.clear()
    s.load(namespaces=["ns0"])
    assert order[0] == ("verify", None)
