"""Write a held-out evaluation text that no setting was chosen on.

Two sources:

* ``--source c4`` (default): C4 validation documents that no calibration reads. Settings are chosen
  on this text (never on the evaluation text): calibration reads the first documents of the C4
  sample (600 for up to ~120 sequences of 2048 tokens), this file starts far past them.
* ``--source python``: another domain, for issue #9's "a text that played no part in choosing the
  settings": the source code of a fixed list of pure-Python standard-library modules of the running
  interpreter (no network, same bytes for the same Python minor version). The interpreter's version
  is printed; quote it with the numbers.

    python benchmarks/heldout_text.py --out out/c4_heldout.txt                 # C4 documents 1200..1999
    python benchmarks/heldout_text.py --source python --out out/python_src.txt
    wushkv compare --text-file out/c4_heldout.txt --chunks 4 ...
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wushkv.data import HELDOUT_C4_DOCUMENTS, HELDOUT_C4_FIRST, heldout_c4_text  # noqa: E402
from wushkv.io import atomic_write  # noqa: E402

# Pure-Python standard-library modules, in this order; long enough for 16 chunks of 2048 SmolLM2 tokens.
PYTHON_MODULES = ("argparse", "dataclasses", "fractions", "heapq", "textwrap", "difflib", "calendar",
                  "statistics", "shlex", "configparser", "ipaddress", "pprint")


def python_text(modules: tuple[str, ...] = PYTHON_MODULES) -> tuple[str, str]:
    parts = []
    for name in modules:
        source = inspect.getsource(importlib.import_module(name))
        parts.append(f"# ---- {name}.py ----\n{source}")
    version = platform.python_version()
    return "\n\n".join(parts), f"{len(modules)} standard-library modules of Python {version} ({', '.join(modules)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--source", choices=("c4", "python"), default="c4", help="which text (default: %(default)s)")
    ap.add_argument("--first", type=int, default=HELDOUT_C4_FIRST, help="c4: first document (default: %(default)s)")
    ap.add_argument("--documents", type=int, default=HELDOUT_C4_DOCUMENTS, help="c4: how many documents (default: %(default)s)")
    args = ap.parse_args()
    text, what = heldout_c4_text(args.first, args.documents) if args.source == "c4" else python_text()
    atomic_write(args.out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    print(f"{what}, {len(text)} characters -> {args.out}")


if __name__ == "__main__":
    main()
