"""How ``make test`` spreads the suite over pytest-xdist workers (``-n 2 --dist loadgroup``).

Tests that share a module- or class-scoped fixture (a vLLM process, an exported model, a calibration) are marked
``xdist_group(<their module>)`` as they are collected, so xdist sends them to one worker as one unit, run one after
another: the fixture is built once. The rest are spread test by test. xdist reads the marker into each test's id when
collection ends (``test.py::name@group``); pytest 9.2 keeps ids where xdist 3.8 cannot change them, hence pytest's
pin in pyproject.toml, which ``tests/test_suite_workers.py`` checks. Without xdist the marker does nothing.
"""

from __future__ import annotations

import pytest


def pytest_itemcollected(item):
    info = getattr(item, "_fixtureinfo", None)
    scopes = {d.scope for defs in (info.name2fixturedefs.values() if info else ()) for d in defs}
    if scopes & {"module", "class", "package"}:
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))
