"""Progress bars (tqdm) that stay quiet when asked to and write to stderr."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress(iterable=None, *, total=None, desc: str = "", enabled: bool = True, unit: str = "it"):
    """A tqdm bar with ETA on stderr; a plain iterator when ``enabled`` is False."""
    return tqdm(iterable, total=total, desc=desc, disable=not enabled, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
