"""Shared test set-up.

``from tests import reference`` must work however pytest is started:
``python -m pytest`` puts the repository root on ``sys.path``; the plain
``pytest`` entry point (or a run from another directory) does not.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> Iterator[None]:
    """Test tensors are tiny: on a busy 2-core machine one intra-op thread is many times faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
