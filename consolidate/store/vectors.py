"""How vectors are stored: fp32, fp16, bf16 or int8 with one scale per vector.

In memory the pass always works on ``float32 [n, d]`` vectors; this module turns them into the
Arrow columns a snapshot stores and back. The stored form decides what the pass sees: its
similarities are the cosines of the *decoded* (stored) vectors, re-scored in float64, so the
pass's pair set equals a float64 brute force over the vectors as stored. (fp16 and bf16
rows are off unit length by their rounding; the pass rescales its own copy of such rows,
never the store's, whose bits would otherwise change at every re-write.)

========  ==========================================  =====================  ===============
dtype     Arrow columns                               bytes per vector       decoded
========  ==========================================  =====================  ===============
``fp32``  ``vector: fixed_size_list<float32>[d]``     ``4 d``                exact
``fp16``  ``vector: fixed_size_list<halffloat>[d]``   ``2 d``                IEEE half, RNE
``bf16``  ``vector: fixed_size_list<uint16>[d]``      ``2 d``                bfloat16 bits, RNE
``int8``  ``vector: fixed_size_list<int8>[d]`` and    ``d + 4``              ``q * scale``
          ``vector_scale: float32``
========  ==========================================  =====================  ===============

int8 is symmetric per-vector quantisation (as in the seed notes: 4x smaller than fp32):
``q = rint(127 v / max|v|)``, and the stored scale is ``1 / ||q||_2`` rather than
``max|v| / 127``, so a decoded vector has unit length to float32 precision and its dot
products stay cosines. Encoding a decoded vector again gives the same bytes (a store
re-written by every nightly pass does not drift). bfloat16 (the upper 16 bits of a float32,
round-to-nearest-even) has no Arrow type; its bits are stored as ``uint16``, which no other
dtype uses, so the column type names the dtype.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "VECTOR_DTYPES",
    "check_vector_dtype",
    "encode_vectors",
    "decode_vectors",
    "empty_vectors",
    "vector_dtype_of",
    "stored_vectors",
    "bytes_per_vector",
]

#: storage dtypes, most to least precise
VECTOR_DTYPES = ("fp32", "fp16", "bf16", "int8")
SCALE_COLUMN = "vector_scale"
_VALUE_TYPE = {"fp32": pa.float32(), "fp16": pa.float16(), "bf16": pa.uint16(), "int8": pa.int8()}


def check_vector_dtype(dtype: object) -> str:
    """Return ``dtype`` if it is one of :data:`VECTOR_DTYPES`.

    Raises:
        ValueError: any other value (the message lists the choices).
    """
    if dtype not in VECTOR_DTYPES:
        raise ValueError(f"vector dtype must be one of {', '.join(VECTOR_DTYPES)}; got {dtype!r}")
    return str(dtype)


def bytes_per_vector(dim: int, dtype: str) -> int:
    """Stored bytes of one ``dim``-dimensional vector in ``dtype`` (values plus scale)."""
    return {"fp32": 4 * dim, "fp16": 2 * dim, "bf16": 2 * dim, "int8": dim + 4}[
        check_vector_dtype(dtype)
    ]


def _bf16_bits(v: np.ndarray) -> np.ndarray:
    """``uint16`` bfloat16 bits of ``float32`` values, rounded to nearest, ties to even."""
    u = np.ascontiguousarray(v, np.float32).view(np.uint32)
    bias = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    out = ((u + bias) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(v)
    if nan.any():  # rounding could carry a NaN's payload into the sign bit
        out[nan] = np.uint16(0x7FC0)
    return out


def _int8(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [n, d], scale float32 [n])`` with ``q * scale`` of unit length."""
    v64 = v.astype(np.float64)
    m = np.abs(v64).max(axis=1, keepdims=True) if v.shape[1] else np.zeros((len(v), 1))
    q = np.rint(v64 * (127.0 / np.where(m > 0, m, 1.0)))
    norm = np.sqrt(np.einsum("ij,ij->i", q, q))
    scale = np.where(norm > 0, 1.0 / np.where(norm > 0, norm, 1.0), 0.0)
    return q.astype(np.int8), scale.astype(np.float32)


def encode_vectors(vectors: np.ndarray, dtype: str = "fp32") -> dict[str, pa.Array]:
    """The Arrow columns that store ``vectors`` in ``dtype``.

    Args:
        vectors: ``float32 [n, d]`` (other float dtypes are converted).
        dtype: one of :data:`VECTOR_DTYPES`.

    Returns:
        ``{"vector": FixedSizeListArray}`` plus ``{"vector_scale": float32 [n]}`` for int8.

    Raises:
        ValueError: an unknown dtype, a ``vectors`` array that is not 2-D, or (int8 only)
            NaN or inf in a vector, naming the first such row.
    """
    check_vector_dtype(dtype)
    v = np.asarray(vectors)
    if v.ndim != 2:
        raise ValueError(f"vectors must be 2-D [n, d], got shape {v.shape}")
    n, d = v.shape
    v = np.ascontiguousarray(v, np.float32)
    out: dict[str, pa.Array] = {}
    if dtype == "fp32":
        flat = v.reshape(-1)
    elif dtype == "fp16":
        flat = v.astype(np.float16).reshape(-1)
    elif dtype == "bf16":
        flat = _bf16_bits(v).reshape(-1)
    else:
        bad = np.flatnonzero(~np.isfinite(v).all(axis=1))
        if len(bad):
            raise ValueError(
                f"int8 storage needs finite vectors; row {int(bad[0])} has NaN "
                f"or inf ({len(bad)} rows in all)"
            )
        q, scale = _int8(v)
        flat = q.reshape(-1)
        out[SCALE_COLUMN] = pa.array(scale, pa.float32())
    out["vector"] = pa.FixedSizeListArray.from_arrays(pa.array(flat, _VALUE_TYPE[dtype]), d)
    assert len(out["vector"]) == n
    return out


def vector_dtype_of(value_type: pa.DataType) -> str | None:
    """The storage dtype of a fixed-size vector column with values of ``value_type``
    (``None`` for a type no dtype uses; float64 reads as fp32)."""
    if value_type in (pa.float32(), pa.float64()):
        return "fp32"
    for name, t in _VALUE_TYPE.items():
        if value_type == t:
            return name
    return None


def empty_vectors(n: int, d: int) -> np.ndarray:
    """A writable, uninitialised ``float32 [n, d]`` array allocated in Arrow's memory pool.

    A store's read decodes its vectors into such an array: Arrow's allocator keeps the
    pages the read itself freed (Parquet decoding, Lance batches) and hands them out again,
    where a NumPy allocation would add ``n * d * 4`` bytes on top (0.7 GB more peak RSS
    when loading 10^6 x 384 from Parquet, measured)."""
    buf = pa.allocate_buffer(max(n * d * 4, 1))
    return np.frombuffer(buf, dtype=np.float32, count=n * d).reshape(n, d)


def decode_vectors(
    column: pa.Array | pa.ChunkedArray, scale: pa.Array | pa.ChunkedArray | None = None
) -> np.ndarray:
    """``float32 [n, d]`` vectors from a stored fixed-size list column.

    Args:
        column: ``fixed_size_list<T>[d]`` with ``T`` float32/float64 (fp32), halffloat
            (fp16), uint16 (bf16 bits) or int8.
        scale: the ``vector_scale`` column (``float32 [n]``), required for int8.

    Returns:
        A new, writable ``float32`` array (a null list, a null element, or a null or
        negative scale decodes to NaN, which validation reports as "NaN or inf in
        vector").

    Raises:
        ValueError: a column that is not a fixed-size list, a value type no dtype uses, or an
            int8 column without its scale column (or of another length).
    """
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_fixed_size_list(col.type):
        raise ValueError(f"vector column must be a fixed-size list, got {col.type}")
    dtype = vector_dtype_of(col.type.value_type)
    if dtype is None:
        raise ValueError(
            f"vector values of type {col.type.value_type} are not a stored "
            f"vector dtype ({', '.join(VECTOR_DTYPES)})"
        )
    n, d = len(col), col.type.list_size
    # .values ignores the parent's nulls and offset: slice to this array's rows
    vals = col.values.slice(col.offset * d, n * d)
    # null elements are read as 0 here and their rows set to NaN below
    raw = (
        (pc.fill_null(vals, 0) if vals.null_count else vals)
        .to_numpy(zero_copy_only=False)
        .reshape(n, d)
    )
    if dtype in ("fp32", "fp16"):
        out = raw.astype(np.float32)
    elif dtype == "bf16":
        out = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        if scale is None:
            raise ValueError(f"int8 vectors need the {SCALE_COLUMN!r} column")
        sc = scale.combine_chunks() if isinstance(scale, pa.ChunkedArray) else scale
        if len(sc) != n:
            raise ValueError(f"{SCALE_COLUMN!r} has {len(sc)} rows, the vectors {n}")
        s = sc.cast(pa.float32()).to_numpy(zero_copy_only=False).astype(np.float32)
        # a scale is 1 / ||q|| > 0 (0 only for a zero vector): any other is not a stored one
        s[np.asarray(sc.is_null()) | ~(s >= 0)] = np.nan
        out = raw.astype(np.float32) * s[:, None]
    if col.null_count:
        out[np.asarray(col.is_null())] = np.nan
    if vals.null_count:  # a null element: the row is not a vector (bf16 bits would read 0)
        bad = np.asarray(vals.is_null()).reshape(n, d).any(axis=1)
        out[bad] = np.nan
    return out


def stored_vectors(vectors: np.ndarray, dtype: str) -> np.ndarray:
    """``float32 [n, d]``: ``vectors`` as a store in ``dtype`` gives them back (encode, then
    decode), e.g. to measure what a storage dtype costs in recall.

    Raises:
        ValueError: as :func:`encode_vectors`.
    """
    cols = encode_vectors(vectors, dtype)
    return decode_vectors(cols["vector"], cols.get(SCALE_COLUMN))
