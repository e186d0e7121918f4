"""``MemoryBatch``: a store's live records as torch tensors on one device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..device import resolve_device
from .schema import Records

__all__ = ["MemoryBatch", "resolve_device"]


@dataclass
class MemoryBatch:
    """Tensors of ``n`` records on one device plus a pandas table view.

    Attributes:
        vectors: ``float32 [n, d]`` unit vectors.
        importance: ``float32 [n]`` in [0, 1].
        last_used: ``float64 [n]`` hours since the Unix epoch (UTC).
        strength: ``float32 [n]`` (>= 1).
        pinned: ``bool [n]``.
        namespace: ``int64 [n]`` codes into ``namespaces``.
        namespaces: namespace names, ``namespaces[code]``.
        table: ``DataFrame`` with id, namespace, text and the other metadata (no vectors).
    """

    vectors: torch.Tensor
    importance: torch.Tensor
    last_used: torch.Tensor
    strength: torch.Tensor
    pinned: torch.Tensor
    namespace: torch.Tensor
    namespaces: list[str]
    table: pd.DataFrame

    @staticmethod
    def from_records(recs: Records, device: str | torch.device = "cpu") -> MemoryBatch:
        dev = resolve_device(device)
        m = recs.meta
        codes, names = pd.factorize(m["namespace"], sort=True)
        return MemoryBatch(
            vectors=torch.from_numpy(np.ascontiguousarray(recs.vectors, np.float32)).to(dev),
            importance=torch.tensor(m["importance"].to_numpy(np.float32)).to(dev),
            last_used=torch.tensor(m["last_used"].to_numpy(np.float64)).to(dev),
            strength=torch.tensor(m["strength"].to_numpy(np.float32)).to(dev),
            pinned=torch.tensor(m["pinned"].to_numpy(bool)).to(dev),
            namespace=torch.from_numpy(codes.astype(np.int64)).to(dev),
            namespaces=[str(x) for x in names],
            table=m.reset_index(drop=True),
        )

    def __len__(self) -> int:
        return int(self.vectors.shape[0])
