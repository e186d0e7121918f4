"""Optional compute kernels for :mod:`consolidate.similarity`.

Nothing here is imported by the rest of the package unless an engine asks for it: the
Triton kernels live in :mod:`consolidate.kernels.triton_join`, which imports ``triton`` at
module import time, so import that module only after choosing ``engine="triton"`` (and, on
a machine without CUDA, only with ``TRITON_INTERPRET=1`` set before ``triton`` is first
imported).
"""

__all__: list[str] = []
