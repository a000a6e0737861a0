"""Write a held-out calibration-domain text: C4 validation documents that no calibration reads.

Settings are chosen on this text (never on the evaluation text): calibration reads the first
documents of the C4 sample (600 for up to ~120 sequences of 2048 tokens), this file starts far past
them.

    python benchmarks/heldout_text.py --out out/c4_heldout.txt      # documents 1200..1999
    wushkv compare --text-file out/c4_heldout.txt --chunks 4 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wushkv.data import c4_documents  # noqa: E402
from wushkv.io import atomic_write  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--first", type=int, default=1200, help="first document (default: %(default)s)")
    ap.add_argument("--documents", type=int, default=800, help="how many documents (default: %(default)s)")
    args = ap.parse_args()
    docs = c4_documents(limit=args.first + args.documents)[args.first :]
    if len(docs) < args.documents:
        raise SystemExit(f"the C4 sample has {args.first + len(docs)} documents; asked for {args.first}..{args.first + args.documents - 1}")
    text = "\n\n".join(docs)
    atomic_write(args.out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    print(f"{len(docs)} C4 documents ({args.first}..{args.first + len(docs) - 1}), {len(text)} characters -> {args.out}")


if __name__ == "__main__":
    main()
