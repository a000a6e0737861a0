"""Resumable long runs: one JSON file holds a run's settings and its results, and a run with the same settings
continues from it; a file from other settings is refused, never overwritten (it may hold hours of results).

``agree``, ``passkey`` and the ``merge`` tools keep ``{"settings", "state"}`` (:func:`resumable`); ``compare`` keeps
``{"settings", "fp", "results"}`` and ``tune-clip`` its clip table, both through :func:`read_run` and
:func:`resume_settings` with their own settings key. (``sweep`` needs none of this: each job's file is named by a
hash of every setting it depends on, so other settings make another file.)
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .config import QuantConfig
from .io import read_json, write_json


def as_json(obj):
    """``obj`` as it reads back from JSON (tuples become lists, keys strings): what a resumed run compares."""
    return json.loads(json.dumps(obj))


def settings_key(settings) -> str:
    """A short stable name for JSON-shaped settings (16 hex digits of the SHA-256 of their sorted JSON): the file
    name of a result that depends on exactly these settings (a sweep's jobs, cached calibrations), so results of other
    settings never collide and need no reconciling."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def differing(old: dict, new: dict) -> list[str]:
    """The keys whose values differ between two settings (a key missing on one side differs), sorted."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


COMMAND = "command"  # a run file's key: the wushkv command that wrote it (files from before session 61 lack it)


def refuse_other_command(run: dict, command: str, where: str) -> None:
    """Refuse a run file (parsed, ``run``) that another wushkv command wrote than ``command``, by its record
    (:data:`COMMAND`); a file without one (before session 61) passes, to be checked by its structure and settings.
    ``where``: how the message names the file."""
    if run.get(COMMAND, command) != command:
        raise ValueError(f"{where} holds a run of `wushkv {run[COMMAND]}`, not of `wushkv {command}`; give another path "
                         "or delete it")


def read_run(path: str | Path | None, parts: Sequence[str] = ("settings", "state"), writer: str = "this command",
             flag: str = "--json", command: str | None = None) -> dict | None:
    """The JSON object a run saved at ``path``; None if there is no file (or no path). A file that cannot be read,
    or is not an object holding each of ``parts`` as an object, is refused (``writer``: who writes such files, for
    the message; ``flag``: the option that named the path); so is one another ``command`` wrote (by its record,
    :data:`COMMAND`, where it has one)."""
    if not path or not Path(path).exists():
        return None
    try:
        prev = read_json(path, "the file")
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path}: cannot resume from it ({e}); give another path or delete it") from None
    if not isinstance(prev, dict) or not all(isinstance(prev.get(p), dict) for p in parts):
        raise ValueError(f"{flag} {path}: not a file {writer} wrote (no {'/'.join(parts)}); give another path or delete it")
    if command is not None:
        refuse_other_command(prev, command, f"{flag} {path}")
    return prev


def reconcile_settings(old: dict, new: dict, key: Callable[[dict], dict] | None = None,
                       since: Sequence[str] = ()) -> tuple[dict, list[str]]:
    """(settings of both runs together, keys that differ). A ``calibration`` of None (no calibrated method
    listed) is compatible with any calibration and takes the other run's; so is a missing ``auto`` (``auto``
    not listed) with any resolution of it. Quantizations written by an older version read with the fields
    added since at their defaults.

    ``key``: what stored results depend on, from settings (default: the settings themselves), compared after the
    rules above; ``since``: settings keys a later version added: an ``old`` run without one matches any value."""
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
    ko, kn = (key(old), key(new)) if key is not None else (old, new)
    ko, kn = dict(ko), dict(kn)
    for k_ in (ko, kn):  # where auto's choice came from is recorded, not a setting: the same method resumes
        if isinstance(k_.get("auto"), dict):
            k_["auto"] = {a: b for a, b in k_["auto"].items() if a != "why"}
    for k in since:
        if k not in ko:  # a file from before the key was recorded
            ko[k] = kn.get(k)
    return new, differing(ko, kn)


def resume_settings(path, old: dict, new: dict, key: Callable[[dict], dict] | None = None, since: Sequence[str] = ()) -> dict:
    """The settings a resumed run continues under (:func:`reconcile_settings`); a stored run of other settings is
    refused, saying which differ (and, where only ``auto`` does, what it ran as)."""
    merged, differ = reconcile_settings(old, new, key=key, since=since)
    if differ == ["auto"]:
        was, now = old["auto"].get("method"), new["auto"].get("method")
        raise ValueError(f"--json {path} holds `auto` rows run as {was} at other settings than `auto` stands for now ({now}; "
                         "the calibration or this version's recipes differ): list the method by name, drop auto from "
                         "--transforms, or give another path")
    if differ:
        raise ValueError(f"--json {path} holds a run with other settings (differing: {', '.join(differ)}); "
                         "give another path to start afresh, or delete it")
    return merged


def resumable(path: str | None, settings: dict, command: str | None = None):
    """(state, save, settings) for a long run of ``command`` that resumes from its ``--json``.

    A file holding a run with the same settings gives back its state; a missing file starts afresh.
    A file from other settings is refused rather than overwritten (so is one whose ``auto`` rows were run as
    another method than ``auto`` stands for now). ``settings["calibration"]`` None
    (no listed method is calibrated) is compatible with any calibration, and keeps the stored one. A file another
    command wrote is refused by name (:func:`read_run`), and ``command`` is recorded in the file.
    """
    settings = as_json(settings)
    state = {}
    if (prev := read_run(path, command=command)) is not None:
        settings = resume_settings(path, prev["settings"], settings)
        state = prev["state"]
        print(f"resuming from {path}", file=sys.stderr)
    head = {COMMAND: command} if command else {}
    save = (lambda st: write_json(path, head | {"settings": settings, "state": st})) if path else None
    return state, save, settings
