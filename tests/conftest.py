"""Make ``from tests import reference`` work however pytest is started.

``python -m pytest`` puts the repository root on ``sys.path``; the plain
``pytest`` entry point (or a run from another directory) does not, and the
test modules share the float64 reference in ``tests/reference.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
