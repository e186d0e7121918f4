"""What a result was measured with: the commit, the packages, the machine.

One place for the evaluation jobs' :class:`~consolidate.evaluation.results.Results` and
the benchmarks' reports, so that every report names its environment the same way.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "PACKAGES",
    "git_commit",
    "package_versions",
    "cpu_name",
    "device_name",
    "machine",
    "environment",
    "usable_cpus",
]

#: distributions whose versions a result records (those installed)
PACKAGES = (
    "consolidate",
    "torch",
    "numpy",
    "pandas",
    "pyarrow",
    "datasets",
    "sentence-transformers",
    "transformers",
    "hydra-core",
    "nltk",
    "faiss-cpu",
    "triton",
    "pylance",
)

_HERE = Path(__file__).resolve().parent


def git_commit(short: bool = False, dirty: bool = False) -> str | None:
    """The commit of the package's checkout (``git rev-parse``), or ``None`` outside a git
    checkout or without git.

    Args:
        short: the abbreviated hash.
        dirty: append ``+dirty`` when a tracked file has uncommitted changes.
    """

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=_HERE, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        out = git("rev-parse", *(["--short"] if short else []), "HEAD")
        if out and dirty and git("status", "--porcelain", "--untracked-files=no"):
            out += "+dirty"
        return out or None
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """``{distribution: version}`` of the installed distributions among ``names``."""
    out = {}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s ``model name``, else :func:`platform.processor`)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_name(device: Any) -> str:
    """``cuda``: the GPU's name; otherwise ``"cpu: <model>"`` (:func:`cpu_name`).

    Args:
        device: a ``torch.device`` or a device string.
    """
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "cpu: " + cpu_name()


def machine() -> dict[str, Any]:
    """``{"python", "cpus", "cpu"}``: the Python version, CPU count and CPU model."""
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "cpu": cpu_name()}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else
    :func:`os.cpu_count`); at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def environment(device: str) -> dict[str, Any]:
    """``{"git_commit", "packages", "device", "python"}``: the environment fields of an
    evaluation result (:class:`~consolidate.evaluation.results.Results`)."""
    return {
        "git_commit": git_commit(),
        "packages": package_versions(),
        "device": device,
        "python": platform.python_version(),
    }
