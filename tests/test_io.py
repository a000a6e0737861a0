import os

import pytest

from wushkv.io import atomic_write, write_json


def test_atomic_write_permissions_and_no_leftovers(tmp_path):
    p = write_json(tmp_path / "a.json", {"x": 1})
    assert p.read_text().strip().startswith("{")
    umask = os.umask(0)
    os.umask(umask)
    assert (p.stat().st_mode & 0o777) == (0o666 & ~umask)

    def boom(tmp):
        open(tmp, "w").write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "b.json", boom)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.json"]
