"""The one resumable-run mechanism (wushkv.runs): reading a saved run, and when two runs' settings are the same."""

import json

import pytest

from wushkv.runs import read_run, reconcile_settings, resumable


def test_read_run_refuses_what_it_cannot_resume(tmp_path):
    assert read_run(None) is None and read_run(tmp_path / "missing.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--json .*bad.json: cannot resume from it"):
        read_run(bad)
    bad.write_text(json.dumps({"settings": {}, "results": []}))
    with pytest.raises(ValueError, match=r"--out .*: not a file compare wrote \(no settings/results\)"):
        read_run(bad, ("settings", "results"), "compare", flag="--out")
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match=r"not a file this command wrote \(no settings/state\)"):
        read_run(bad)


def test_reconcile_with_a_settings_key_and_added_keys():
    """``key`` compares what results depend on; a key in ``since`` missing from the old run matches any value;
    a calibration of None on either side matches any and the merged settings keep the known one."""
    key = lambda s: {k: v for k, v in s.items() if k != "transforms"}  # noqa: E731
    old = {"model": "m", "transforms": ["a"], "calibration": {"samples": 4}}
    new = {"model": "m", "transforms": ["a", "b"], "calibration": None, "text_sha256": "x"}
    merged, differ = reconcile_settings(old, new, key=key, since=("text_sha256",))
    assert differ == [] and merged["calibration"] == {"samples": 4} and merged["transforms"] == ["a", "b"]
    assert reconcile_settings(old, new, key=key)[1] == ["text_sha256"]
    assert reconcile_settings(old | {"text_sha256": "y"}, new, key=key, since=("text_sha256",))[1] == ["text_sha256"]
    assert reconcile_settings(old, new)[1] == ["text_sha256", "transforms"]


def test_resumable_round_trip(tmp_path, capsys):
    path = tmp_path / "r.json"
    state, save, settings = resumable(str(path), {"model": "m", "window": (1, 2)})
    assert state == {} and settings["window"] == [1, 2]  # as it reads back from JSON
    save({"rows": [1]})
    state, _, _ = resumable(str(path), {"model": "m", "window": (1, 2)})
    assert state == {"rows": [1]} and "resuming from" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"other settings \(differing: model\)"):
        resumable(str(path), {"model": "n", "window": (1, 2)})


def test_settings_key_is_order_free_and_stable():
    """The file names of sweep jobs and cached calibrations: key order does not matter, any change of a value does,
    and the formula is the one earlier versions named their files with (so old results are found again)."""
    import hashlib
    import json

    from wushkv.runs import settings_key

    a, b = {"job": {"bits": 2, "model": "m"}, "eval": [1, 2]}, {"eval": [1, 2], "job": {"model": "m", "bits": 2}}
    assert settings_key(a) == settings_key(b) and len(settings_key(a)) == 16
    assert settings_key(a) != settings_key({**a, "eval": [1, 3]})
    assert settings_key(a) == hashlib.sha256(json.dumps(a, sort_keys=True).encode()).hexdigest()[:16]


def test_a_run_records_its_command_and_another_commands_is_refused_by_name(tmp_path):
    path = tmp_path / "run.json"
    state, save, settings = resumable(str(path), {"model": "m"}, command="agree")
    save({"rows": {"wush": [1]}})
    assert json.loads(path.read_text())["command"] == "agree"
    assert resumable(str(path), {"model": "m"}, command="agree")[0] == {"rows": {"wush": [1]}}
    with pytest.raises(ValueError, match=r"holds a run of `wushkv agree`, not of `wushkv passkey`; give another path"):
        resumable(str(path), {"model": "m"}, command="passkey")
    # a file from before commands were recorded resumes as before, under the settings' check alone
    path.write_text(json.dumps({"settings": {"model": "m"}, "state": {"x": 1}}))
    assert resumable(str(path), {"model": "m"}, command="passkey")[0] == {"x": 1}
    assert read_run(str(path), command="compare", parts=("settings",)) is not None
