"""Keeps the method-name reference in the docs generated from :mod:`wushkv.methods.spec`.

    python -m wushkv.methods.reference docs/reference/methods.md     # rewrite the generated part in place

The part between :data:`BEGIN` and :data:`END` is :func:`wushkv.methods.spec.grammar_markdown`; a test fails
when the file is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..io import atomic_write
from .spec import grammar_markdown

BEGIN = "<!-- BEGIN GENERATED: method names -->"
END = "<!-- END GENERATED: method names -->"


def render(text: str) -> str:
    """``text`` with the generated part replaced; ValueError when the markers are missing or out of order."""
    a, b = text.find(BEGIN), text.find(END)
    if a < 0 or b < a:
        raise ValueError(f"expected the markers {BEGIN!r} and {END!r}, in that order")
    return text[: a + len(BEGIN)] + "\n" + grammar_markdown() + text[b:]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m wushkv.methods.reference docs/reference/methods.md", file=sys.stderr)
        return 2
    path = Path(args[0])
    new = render(path.read_text())
    if new != path.read_text():
        atomic_write(path, lambda tmp: Path(tmp).write_text(new, encoding="utf-8"))
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
