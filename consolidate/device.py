"""Device resolution, shared by compute (similarity engines, the pass), models and storage.

It lives at the package root so that compute and models never import from ``store/``.
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/``None`` -> cuda if available else cpu; anything else via ``torch.device``.

    Args:
        device: ``"auto"``, ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
            ``torch.device``.

    Returns:
        The ``torch.device``.

    Raises:
        ValueError: an unknown device string, or a cuda device where CUDA is not available
            (one clear line instead of torch's assertion deep in a kernel call).
    """
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r} (auto, cpu, cuda, cuda:N)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} asked for, but CUDA is not available here "
            f"(set similarity.device=auto or cpu)"
        )
    return dev
