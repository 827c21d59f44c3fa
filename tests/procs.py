"""The environment of the programs tests start: a PYTHONPATH that names the folders a program
needs and keeps what the suite put there (tests/warm: warm starts, see conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path


def pythonpath(*folders: str | Path) -> str:
    """`folders` first, then the PYTHONPATH this process was given."""
    return os.pathsep.join([*(str(f) for f in folders), *filter(None, [os.environ.get("PYTHONPATH")])])
