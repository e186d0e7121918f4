"""pytest fixtures shared by the tests (helpers: ``tests/helpers.py``)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return request.param
