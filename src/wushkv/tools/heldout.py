"""``wushkv data heldout``: write a held-out evaluation text that no setting was chosen on.

Two sources:

* ``c4`` (default): C4 validation documents that no calibration reads. Settings are chosen on this text (never on
  the evaluation text): calibration reads the first documents of the C4 sample (600 for up to ~120 sequences of
  2048 tokens), this file starts far past them (:data:`wushkv.data.HELDOUT_C4_FIRST`).
* ``python``: another domain, for issue #9's "a text that played no part in choosing the settings": the source
  code of a fixed list of pure-Python standard-library modules of the running interpreter (no network, same bytes
  for the same Python minor version). The interpreter's version is printed; quote it with the numbers.
"""

from __future__ import annotations

import importlib
import inspect
import platform
from pathlib import Path

from ..data import HELDOUT_C4_DOCUMENTS, HELDOUT_C4_FIRST, heldout_c4_text
from ..io import atomic_write

# Pure-Python standard-library modules, in this order; long enough for 16 chunks of 2048 SmolLM2 tokens.
PYTHON_MODULES = ("argparse", "dataclasses", "fractions", "heapq", "textwrap", "difflib", "calendar",
                  "statistics", "shlex", "configparser", "ipaddress", "pprint")

SOURCES = ("c4", "python")


def python_text(modules: tuple[str, ...] = PYTHON_MODULES) -> tuple[str, str]:
    """(text, label): the source of ``modules`` of the running interpreter, each after a ``# ---- NAME.py ----``
    line, joined with blank lines."""
    parts = []
    for name in modules:
        source = inspect.getsource(importlib.import_module(name))
        parts.append(f"# ---- {name}.py ----\n{source}")
    version = platform.python_version()
    return "\n\n".join(parts), f"{len(modules)} standard-library modules of Python {version} ({', '.join(modules)})"


def heldout_text(source: str = "c4", first: int = HELDOUT_C4_FIRST, documents: int = HELDOUT_C4_DOCUMENTS) -> tuple[str, str]:
    """(text, label) of ``source`` (``first``/``documents`` apply to ``c4`` only)."""
    if source == "c4":
        return heldout_c4_text(first, documents)
    if source == "python":
        return python_text()
    raise ValueError(f"unknown held-out source {source!r}; known: {', '.join(SOURCES)}")


def write_heldout(out: str | Path, source: str = "c4", first: int = HELDOUT_C4_FIRST,
                  documents: int = HELDOUT_C4_DOCUMENTS) -> tuple[str, str]:
    """Write :func:`heldout_text` to ``out`` (UTF-8, atomically); returns (text, label)."""
    text, what = heldout_text(source, first, documents)
    atomic_write(out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return text, what
