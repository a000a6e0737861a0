"""The suite's own setup: ``make test``'s workers keep the tests of a shared fixture together (tests/xdist_groups.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

SHARED = """
import os
import pytest

@pytest.fixture(scope="module")
def built():
    with open(os.path.join(os.environ["SHARED_OUT"], "builds"), "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    return os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.parametrize("i", range(6))
def test_uses_it(built, i):
    assert built == os.environ["PYTEST_XDIST_WORKER"]
    with open(os.path.join(os.environ["SHARED_OUT"], f"shared-{i}"), "w") as f:
        f.write(built)

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass
"""


def test_tests_sharing_a_module_fixture_run_in_one_worker(tmp_path):
    """In two workers under ``--dist loadgroup``, the six tests of a module-scoped fixture run in one worker with the
    fixture built once, and the ids xdist schedules by carry the group (what pytest 9.2 broke: pytest is pinned)."""
    (tmp_path / "conftest.py").write_text("from xdist_groups import pytest_itemcollected  # noqa: F401\n")
    (tmp_path / "test_shared.py").write_text(SHARED)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SHARED_OUT=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                        "-v", str(tmp_path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    workers = {(tmp_path / f"shared-{i}").read_text() for i in range(6)}
    assert len(workers) == 1, workers
    assert (tmp_path / "builds").read_text().split() == list(workers)  # built once
    assert "PASSED test_shared.py::test_uses_it[0]@test_shared" in r.stdout, r.stdout[-3000:]
