"""Resumable long runs: one JSON file holds a run's settings and its state, and a run with the same settings
continues from it (``agree``, ``passkey`` and the ``merge`` tools share this; a file from other settings is refused,
never overwritten: it may hold hours of results)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .config import QuantConfig
from .io import write_json


def reconcile_settings(old: dict, new: dict) -> tuple[dict, list[str]]:
    """(settings of both runs together, keys that differ). A ``calibration`` of None (no calibrated method
    listed) is compatible with any calibration and takes the other run's; so is a missing ``auto`` (``auto``
    not listed) with any resolution of it."""
    old, new = dict(old), dict(new)
    for d in (old, new):  # quantizations written by an older version: fields added since take their defaults
        if isinstance(d.get("quantization"), dict):
            d["quantization"] = QuantConfig.current_dict(d["quantization"])
        if isinstance(d.get("auto"), dict) and isinstance(d["auto"].get("quantization"), dict):
            d["auto"] = d["auto"] | {"quantization": QuantConfig.current_dict(d["auto"]["quantization"])}
    if new.get("calibration") is None:
        new["calibration"] = old.get("calibration")
    elif old.get("calibration") is None:
        old["calibration"] = new["calibration"]
    for a, b in ((old, new), (new, old)):  # a run that did not list auto is compatible with any resolution of it
        if "auto" in a and "auto" not in b:
            b["auto"] = a["auto"]
    return new, sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def resumable(path: str | None, settings: dict):
    """(state, save, settings) for a long run that resumes from its ``--json``.

    A file holding a run with the same settings gives back its state; a missing file starts afresh.
    A file from other settings is refused rather than overwritten (so is one whose ``auto`` rows were run as
    another method than ``auto`` stands for now). ``settings["calibration"]`` None
    (no listed method is calibrated) is compatible with any calibration, and keeps the stored one.
    """
    settings = json.loads(json.dumps(settings))  # as it reads back from JSON
    state = {}
    if path and Path(path).exists():
        try:
            prev = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--json {path}: cannot resume from it ({e}); give another path or delete it") from None
        if not isinstance(prev, dict) or not isinstance(prev.get("settings"), dict) or not isinstance(prev.get("state"), dict):
            raise ValueError(f"--json {path}: not a file this command wrote (no settings/state); give another path or delete it")
        merged, differ = reconcile_settings(prev["settings"], settings)
        if differ == ["auto"]:
            was, now = prev["settings"]["auto"].get("method"), settings["auto"].get("method")
            raise ValueError(f"--json {path} holds `auto` rows run as {was} at other settings than `auto` stands for now ({now}; "
                             "the calibration or this version's recipes differ): list the method by name, drop auto from "
                             "--transforms, or give another path")
        if differ:
            raise ValueError(f"--json {path} holds a run with other settings (differing: {', '.join(differ)}); "
                             "give another path to start afresh, or delete it")
        settings = merged
        state = prev["state"]
        print(f"resuming from {path}", file=sys.stderr)
    save = (lambda st: write_json(path, {"settings": settings, "state": st})) if path else None
    return state, save, settings
