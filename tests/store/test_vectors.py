"""Vector storage dtypes: the codec, stores that keep int8/bf16/fp16, and the pass over them."""

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.pipeline import run_pass
from consolidate.pipeline.near import similar_pairs
from consolidate.store import CorruptStoreError, InvalidRecordsError, Store
from consolidate.store.schema import records_from_arrow, records_to_arrow
from consolidate.store.vectors import (
    VECTOR_DTYPES,
    bytes_per_vector,
    decode_vectors,
    encode_vectors,
    stored_vectors,
)
from tests.helpers import make_records, pair_reference, random_rows


def _unit(n, d, seed=0):
    v = np.random.default_rng(seed).normal(size=(n, d))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def test_int8_hand_computed():
    # v = (0.6, 0.8, 0): q = rint(127 v / 0.8) = (95, 127, 0), scale = 1 / sqrt(95^2 + 127^2)
    cols = encode_vectors(np.array([[0.6, 0.8, 0.0]], np.float32), "int8")
    q = cols["vector"].values.to_numpy().tolist()
    assert q == [95, 127, 0]
    scale = 1 / math.sqrt(95**2 + 127**2)
    assert cols["vector_scale"].to_pylist()[0] == pytest.approx(scale, rel=1e-7)
    d = decode_vectors(cols["vector"], cols["vector_scale"])
    np.testing.assert_allclose(d[0], [95 * scale, 127 * scale, 0.0], rtol=1e-6)
    assert np.linalg.norm(d[0].astype(np.float64)) == pytest.approx(1.0, abs=1e-7)


def test_codecs_against_references():
    v = _unit(500, 384, seed=1)
    np.testing.assert_array_equal(stored_vectors(v, "fp32"), v)
    np.testing.assert_array_equal(
        stored_vectors(v, "fp16"), v.astype(np.float16).astype(np.float32)
    )
    np.testing.assert_array_equal(
        stored_vectors(v, "bf16"), torch.from_numpy(v).bfloat16().float().numpy()
    )
    q = stored_vectors(v, "int8")
    # float64 reference of symmetric per-vector quantisation, rescaled to unit length
    v64 = v.astype(np.float64)
    ref = np.rint(v64 * 127 / np.abs(v64).max(axis=1, keepdims=True))
    assert np.abs(ref).max() == 127
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(q, ref, atol=2e-7)
    np.testing.assert_allclose(np.linalg.norm(q.astype(np.float64), axis=1), 1.0, atol=1e-6)
    # rounding moves each component by at most half a step (max|v| / 127): for these 384-d
    # vectors that bounds 1 - cosine by about (sqrt(384 / 12) * step)^2 / 2 ~ 4e-5
    cosine = (q.astype(np.float64) * v64).sum(1)
    assert cosine.min() > 1 - 2e-4 and cosine.mean() > 1 - 6e-5


@pytest.mark.parametrize("dtype", VECTOR_DTYPES)
def test_reencoding_is_stable_and_sizes(dtype):
    v = _unit(200, 64, seed=2)
    a = encode_vectors(v, dtype)
    b = encode_vectors(decode_vectors(a["vector"], a.get("vector_scale")), dtype)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].equals(b[k]), k  # a nightly re-write does not drift
    nbytes = sum(c.nbytes for c in a.values())
    assert nbytes == 200 * bytes_per_vector(64, dtype)
    assert (
        bytes_per_vector(384, dtype) == {"fp32": 1536, "fp16": 768, "bf16": 768, "int8": 388}[dtype]
    )


def test_codec_errors():
    with pytest.raises(ValueError, match="one of fp32, fp16, bf16, int8"):
        encode_vectors(_unit(2, 4), "int4")
    bad = _unit(3, 4)
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="row 1 has NaN"):
        encode_vectors(bad, "int8")
    cols = encode_vectors(_unit(3, 4), "int8")
    with pytest.raises(ValueError, match="vector_scale"):
        decode_vectors(cols["vector"])
    recs = make_records(random_rows(4, 8))
    t = records_to_arrow(recs, "int8").drop_columns(["vector_scale"])
    with pytest.raises(ValueError, match="vector_scale"):
        records_from_arrow(t)
    ints = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8, np.int32)), 4)
    with pytest.raises(ValueError, match="not a stored vector dtype"):
        decode_vectors(ints)
    # a null vector (or a null scale) decodes to NaN, which validation refuses by name
    col = pa.array([[1, 2], None, [3, 4]], pa.list_(pa.int8(), 2))
    out = decode_vectors(col, pa.array([0.5, 0.5, None], pa.float32()))
    assert out[0].tolist() == [0.5, 1.0] and np.isnan(out[1]).all() and np.isnan(out[2]).all()
    # a sliced column decodes its own rows
    sl = encode_vectors(np.arange(12, dtype=np.float32).reshape(6, 2), "fp16")["vector"]
    np.testing.assert_array_equal(decode_vectors(sl.slice(2, 3)), [[4, 5], [6, 7], [8, 9]])


@pytest.mark.parametrize("dtype", ["int8", "bf16", "fp16"])
def test_store_keeps_its_dtype(tmp_path, dtype):
    recs = make_records(random_rows(40, 16, seed=3))
    s = Store(tmp_path / "s", vector_dtype=dtype)
    snap = s.create(recs)
    assert s.head().vector_dtype == dtype
    assert json.loads(s.pointer_path.read_text())["vector_dtype"] == dtype
    np.testing.assert_array_equal(snap.records.vectors, stored_vectors(recs.vectors, dtype))
    table = pq.read_table(tmp_path / "s" / "snapshots" / s.head().snapshot)
    assert (
        table.column("vector").type.value_type
        == {"int8": pa.int8(), "bf16": pa.uint16(), "fp16": pa.float16()}[dtype]
    )
    # a handle without a dtype keeps the store's; appends are stored the same way
    s2 = Store(tmp_path / "s")
    new = make_records(random_rows(45, 16, seed=4)[40:])
    s2.append(new)
    delta = next((tmp_path / "s" / "deltas").glob("*.parquet"))
    assert pq.read_table(delta).column("vector").type == table.column("vector").type
    view = s2.load()
    np.testing.assert_array_equal(view.records.vectors[40:], stored_vectors(new.vectors, dtype))
    # an unchanged commit rewrites the same vector bytes
    with s2.lock():
        s2.commit(view.records, [], base=view)
    t2 = pq.read_table(tmp_path / "s" / "snapshots" / s2.head().snapshot)
    assert t2.column("vector").slice(0, 40).equals(table.column("vector"))
    assert s2.head().vector_dtype == dtype


@pytest.mark.parametrize("dtype", ["fp32", "int8", "fp16"])
def test_a_snapshot_in_many_row_groups_loads_group_by_group(tmp_path, monkeypatch, dtype):
    """A snapshot is written in row groups of ROW_GROUP_ROWS; the load decodes its vectors
    group by group into one array (the same values as one read of the whole file), and
    the unchanged-commit check compares the file group by group, the last one included."""
    import consolidate.store.store as store_mod

    monkeypatch.setattr(store_mod, "ROW_GROUP_ROWS", 7)
    recs = make_records(random_rows(40, 16, seed=8))
    s = Store(tmp_path / "s", vector_dtype=dtype)
    s.create(recs)
    path = tmp_path / "s" / "snapshots" / s.head().snapshot
    assert pq.ParquetFile(path).metadata.num_row_groups == 6  # 5 x 7 + 5
    whole = records_from_arrow(pq.read_table(path), dim=16)
    snap = s.load()
    assert snap.records.vectors.dtype == np.float32 and snap.records.vectors.shape == (40, 16)
    np.testing.assert_array_equal(snap.records.vectors, whole.vectors)
    np.testing.assert_array_equal(snap.records.vectors, stored_vectors(recs.vectors, dtype))
    pd.testing.assert_frame_equal(snap.records.meta, whole.meta)
    table = records_to_arrow(snap.records, dtype)
    assert s._same_as_stored(s.head(), table)
    assert not s._same_as_stored(s.head(), table.slice(0, 39))  # a row short
    last = table.slice(39, 1).to_pylist()[0]
    changed = pa.Table.from_pylist(
        table.slice(0, 39).to_pylist() + [{**last, "importance": last["importance"] / 2}],
        schema=table.schema,
    )
    assert not s._same_as_stored(s.head(), changed)  # a change in the last group
    with s.lock():
        assert s.commit(snap.records, [], base=snap)["unchanged"] is True


def test_a_row_group_shorter_than_its_footer_says_is_refused_not_shifted(tmp_path, monkeypatch):
    """Every column of a row comes from one row group: a group that yields a row fewer than
    the footer's total (a miscounted group in a damaged footer, under a CURRENT without
    ``rows`` or a checksum) is a CorruptStoreError naming the file, never vectors shifted
    against their ids."""
    import consolidate.store.store as store_mod

    monkeypatch.setattr(store_mod, "ROW_GROUP_ROWS", 7)
    recs = make_records(random_rows(40, 16, seed=8))
    s = Store(tmp_path / "s")
    s.create(recs)
    ptr = json.loads(s.pointer_path.read_text())
    ptr.pop("snapshot_sha256", None)
    ptr.pop("rows", None)
    s.pointer_path.write_text(json.dumps(ptr))
    real = pq.ParquetFile.read_row_group

    def short_group_2(self, i, *args, **kwargs):
        got = real(self, i, *args, **kwargs)
        return got.slice(0, got.num_rows - 1) if i == 2 else got

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", short_group_2)
    snapshot = tmp_path / "s" / "snapshots" / s.head().snapshot
    with pytest.raises(CorruptStoreError, match="hold 39 rows, its footer says 40") as e:
        s.load()
    assert str(snapshot) in str(e.value)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", real)
    snap = s.load()  # the file itself is whole
    np.testing.assert_array_equal(snap.records.vectors, recs.vectors)
    assert snap.records.meta["id"].tolist() == recs.meta["id"].tolist()


def test_store_conversion_and_bad_pointer(tmp_path):
    recs = make_records(random_rows(20, 8, seed=5))
    s = Store(tmp_path / "s")
    s.create(recs)
    assert s.head().vector_dtype == "fp32"
    conv = Store(tmp_path / "s", vector_dtype="int8")
    snap = conv.load()
    with conv.lock():
        conv.commit(snap.records, [], base=snap)
    assert Store(tmp_path / "s").head().vector_dtype == "int8"
    np.testing.assert_array_equal(
        Store(tmp_path / "s").load().records.vectors, stored_vectors(recs.vectors, "int8")
    )
    # a pointer naming no dtype we know is a corrupt pointer, not a silent fp32 read
    p = json.loads(s.pointer_path.read_text())
    s.pointer_path.write_text(json.dumps({**p, "vector_dtype": "int4"}))
    with pytest.raises(CorruptStoreError, match="int4"):
        s.head()
    with pytest.raises(ValueError, match="one of fp32"):
        Store(tmp_path / "x", vector_dtype="fp8")


def test_append_of_nan_vector_to_int8_store_writes_nothing(tmp_path):
    s = Store(tmp_path / "s", vector_dtype="int8")
    s.create(make_records(random_rows(10, 8, seed=6)))
    row = {**random_rows(11, 8, seed=6)[10], "vector": [float("nan")] * 8}
    with pytest.raises(InvalidRecordsError, match="NaN or inf"):
        s.append([row])
    assert not list((tmp_path / "s" / "deltas").glob("*.parquet"))


@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_pass_pairs_equal_float64_brute_force_over_stored_vectors(tmp_path, dtype):
    # pairs planted with cosines spread tightly around the threshold, so that storage
    # rounding moves some of them across it
    g = np.random.default_rng(7)
    n_pairs, d, t = 150, 64, 0.9
    a = g.normal(size=(n_pairs, d))
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    noise = g.normal(size=(n_pairs, d))
    noise -= (noise * a).sum(1, keepdims=True) * a
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    cos = t + g.uniform(-3e-3, 3e-3, n_pairs)
    b = cos[:, None] * a + np.sqrt(1 - cos[:, None] ** 2) * noise
    v = np.concatenate([a, b]).astype(np.float32)
    rows = [
        {
            "id": f"m{k:04d}",
            "namespace": f"ns{k % n_pairs % 3}",
            "text": f"memory {k}",
            "vector": v[k],
            "importance": 0.5,
            "created_at": 1.0,
            "last_used": 1.0,
        }
        for k in range(len(v))
    ]
    s = Store(tmp_path / "s", vector_dtype=dtype)
    snap = s.create(make_records(rows))
    stored = snap.records.vectors
    seg = np.unique(snap.records.meta["namespace"], return_inverse=True)[1]
    ref = pair_reference(stored, seg, t)
    assert ref != pair_reference(v, seg, t)  # the dtype changes the answer near t
    p = similar_pairs(torch.from_numpy(stored), seg, t, SimilarityConfig(device="cpu"))
    assert set(zip(p.i.tolist(), p.j.tolist(), strict=True)) == ref
    np.testing.assert_allclose(
        p.sim,
        [stored[i].astype(np.float64) @ stored[j] for i, j in zip(p.i, p.j, strict=True)],
        rtol=0,
        atol=1e-12,
    )
    # the pass works on cosines of the stored vectors (bf16 rows are rescaled in its copy)
    unit = stored.astype(np.float64) / np.linalg.norm(
        stored.astype(np.float64), axis=1, keepdims=True
    )
    cos_ref = pair_reference(unit.astype(np.float32), seg, t)
    assert (cos_ref == ref) == (dtype == "int8")  # int8 decodes to unit length already
    res = run_pass(
        snap.records,
        cfg=PassConfig(
            threshold=t, decay=False, cap=None, exact_dedup=False, minhash_min_chars=None
        ),
        sim_cfg=SimilarityConfig(device="cpu"),
        wall_h=2.0,
    )
    assert res.stats.pairs == len(cos_ref)


def test_bf16_rows_off_unit_length_cluster_without_breaking_the_centroid_check(tmp_path):
    # bf16-representable 2-d vectors with norms 0.998 and 1.002: at threshold 0.999 the
    # cluster bound holds only for unit vectors, so the pass rescales its copy of them
    v = [[-0.3203125, 0.9453125], [-0.33203125, 0.9453125]]
    rows = [
        {
            "id": k,
            "namespace": "n",
            "text": t,
            "vector": x,
            "strength": s,
            "created_at": 1.0,
            "last_used": 1.0,
        }
        for k, t, x, s in (
            ("a", "likes green tea", v[0], 1.0),
            ("b", "enjoys green tea", v[1], 2.0),
        )
    ]
    from consolidate.store.schema import records_from_rows

    s = Store(tmp_path / "s", vector_dtype="bf16")
    recs = records_from_rows(rows)
    recs.vectors = np.asarray(v, np.float32)  # as stored: create would rescale them
    snap = s.create(recs)
    norms = np.linalg.norm(snap.records.vectors.astype(np.float64), axis=1)
    assert abs(norms[0] - 1) > 1e-3 or abs(norms[1] - 1) > 1e-3
    res = run_pass(
        snap.records,
        cfg=PassConfig(threshold=0.999, cap=None, decay=False),
        sim_cfg=SimilarityConfig(device="cpu"),
        wall_h=2.0,
    )
    assert res.stats.merges == 1
    # the store's bits are untouched: an unchanged re-write gives the same vector column
    with s.lock():
        s.commit(snap.records, [], base=snap)
    assert np.array_equal(s.load().records.vectors, snap.records.vectors)


def test_decoding_refuses_what_it_cannot_read_as_stored():
    recs = make_records(random_rows(3, 4))
    for dtype in ("int8", "bf16"):
        t = records_to_arrow(recs, dtype)
        col = t.column("vector").combine_chunks()
        # a round trip through pandas turns the fixed-size list into a plain list
        plain = pa.array(col.to_pylist(), pa.list_(col.type.value_type))
        t2 = t.set_column(t.schema.get_field_index("vector"), "vector", plain)
        with pytest.raises(ValueError, match="not a stored vector column"):
            records_from_arrow(t2)
    # a null element of a bf16 vector is not 0.0, and a negative int8 scale is no scale
    bits = pa.array([[16256, None], [16256, 0]], pa.list_(pa.uint16(), 2))
    out = decode_vectors(bits)
    assert np.isnan(out[0]).all() and out[1].tolist() == [1.0, 0.0]
    q = pa.array([[127, 0], [127, 0]], pa.list_(pa.int8(), 2))
    out = decode_vectors(q, pa.array([1 / 127, -1 / 127], pa.float32()))
    assert out[0].tolist() == pytest.approx([1.0, 0.0]) and np.isnan(out[1]).all()
