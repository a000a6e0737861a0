"""Small file helpers: atomic writes, JSON with a checksum, and an exclusive lock for a run's output.

Every final file wushkv writes goes through :func:`atomic_write` (a temporary file beside it, renamed over it), so a
process killed at any point leaves either the old file or the new one under the final name, never a part of one
(a ``.NAME.*.tmp`` file may be left beside it; the next run that takes the file's lock, :func:`exclusive_output`,
removes it). JSON written by :func:`write_json` carries ``"sha256"``: the SHA-256
of the rest of the object (:func:`json_digest`); :func:`read_json` verifies it, so a file damaged on disk is refused
with its name rather than read as other results. Files without the key (older versions, hand-made) are read as they
are.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

CHECKSUM_KEY = "sha256"


class CorruptFileError(ValueError):
    """A file that cannot be read back as what wushkv wrote: the message names the file."""


def make_parent(path: str | Path) -> None:
    """Create the folder of output ``path``; ``ValueError`` naming the path when a part of it is a file."""
    path = Path(path)
    for folder in (path.parent, *path.parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"cannot write {path}: {folder} is a file, not a folder")
            break
    path.parent.mkdir(parents=True, exist_ok=True)


def usual_permissions(path: str | Path) -> None:
    """``path`` (and, a folder, everything in it) as the umask gives new ones (0644 and 0755 under 022): what mkstemp
    (0600) and mkdtemp (0700) withhold from other users, such as a serving engine reading a checkpoint."""
    umask = os.umask(0)
    os.umask(umask)
    path = Path(path)
    for p in (path, *(path.rglob("*") if path.is_dir() else ())):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path``: no half-written file survives an interrupt. A write that
    fails (a full disk: ENOSPC) leaves the previous file under ``path`` and no temporary; the ``OSError`` raised names
    ``path``."""
    path = Path(path)
    make_parent(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        usual_permissions(tmp)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None:  # the writer's message often lacks the file's name
            kept = "the previous file is kept" if path.exists() else "nothing was written"
            raise type(e)(e.errno, f"{e.strerror or e} while writing {path} ({kept})") from e
        raise
    return path


def json_digest(obj) -> str:
    """SHA-256 (hex) of ``obj`` as it reads back from JSON, serialized with sorted keys: the same for the object
    written and the object read back (tuples become lists, keys strings; floats round-trip exactly)."""
    canon = json.loads(json.dumps(obj))
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode("utf-8")).hexdigest()


def write_json(path: str | Path, obj, checksum: bool = True) -> Path:
    """Write ``obj`` as indented JSON atomically; a dict gets ``"sha256"`` (:func:`json_digest` of the rest) unless
    ``checksum`` is False."""
    if checksum and isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k != CHECKSUM_KEY}
        obj[CHECKSUM_KEY] = json_digest(obj)

    def w(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")

    return atomic_write(path, w)


def read_json(path: str | Path, what: str = "JSON file"):
    """The JSON value at ``path``, its checksum verified and removed. Raises :class:`CorruptFileError` (a
    ``ValueError``) naming ``what`` and the path for a file that is not UTF-8 JSON or whose checksum does not match;
    ``FileNotFoundError`` for a missing file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {p} does not exist")
    try:
        obj = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptFileError(f"{what} {p} is not readable JSON (damaged or truncated?): {e}") from None
    if not isinstance(obj, dict):
        return obj
    if CHECKSUM_KEY not in obj:
        if _misspelled_checksum(obj):
            raise CorruptFileError(f"{what} {p} is damaged: its {CHECKSUM_KEY!r} key is misspelled")
        return obj
    stored = obj.pop(CHECKSUM_KEY)
    if stored != json_digest(obj):
        raise CorruptFileError(f"{what} {p} is damaged or was edited: its contents do not match the {CHECKSUM_KEY} it was "
                               f"written with (to accept hand edits, delete the {CHECKSUM_KEY!r} line)")
    return obj


def lock_path(path: str | Path) -> Path:
    """The lock file of output ``path``: ``.NAME.lock`` beside it."""
    path = Path(path)
    return path.parent / f".{path.name}.lock"


class OutputLockedError(ValueError):
    """Another process holds the lock of an output file."""


@contextlib.contextmanager
def exclusive_output(path: str | Path | None) -> Iterator[None]:
    """Hold an exclusive lock on output ``path`` (``fcntl.flock`` on :func:`lock_path`, which records the holder's
    pid) for the body: a second run writing the same file is refused with :class:`OutputLockedError` instead of
    interleaving its results with the first's. The lock goes with the process (a killed run leaves no stale lock;
    the lock file itself stays, empty of meaning). Taking it removes the ``.NAME.*.tmp`` files a killed run left
    beside ``path`` (:func:`atomic_write`'s). None: no lock. Where ``fcntl`` is missing (Windows): no lock."""
    if path is None:
        yield
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    make_parent(path)
    lp = lock_path(path)
    try:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:  # (the lock file's name would say nothing to the user)
        raise PermissionError(f"cannot write {path}: no permission to create files in {Path(path).resolve().parent}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise OutputLockedError(f"another wushkv run is writing {path} (pid {holder}); wait for it to finish, or give "
                                    "another output path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        remove_temporaries(path)  # holding the lock, no run is writing this file: its temporaries were left by a killed run
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def exclusive_outputs(paths: Iterable[str | Path]) -> Iterator[None]:
    """:func:`exclusive_output` on each of ``paths`` (the files one run writes), all held for the body; the first one
    another run holds refuses the run (the locks taken so far are released)."""
    with contextlib.ExitStack() as stack:
        for p in paths:
            stack.enter_context(exclusive_output(p))
        yield


def remove_temporaries(path: str | Path) -> list[Path]:
    """Remove the temporary files :func:`atomic_write` makes for ``path`` (``.NAME.XXXXXXXX.tmp`` beside it, from
    mkstemp) and return them. Only for a caller that holds the file's lock (or owns its folder): then no write of it
    is under way, and any such file is a killed run's leftover. ``.r.json.x.abcd1234.tmp`` is another output's
    ("r.json.x") and stays."""
    path = Path(path)
    own = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")
    gone = []
    if path.parent.is_dir():
        for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
            if own.fullmatch(stale.name):
                stale.unlink(missing_ok=True)
                gone.append(stale)
    return gone


def remove_temporaries_in(folder: str | Path) -> list[Path]:
    """Remove every temporary file :func:`atomic_write` left in ``folder`` (``.NAME.XXXXXXXX.tmp``) and return them.
    Only for a folder one run owns whole (a sweep's ``jobs/``), while it holds the run's lock."""
    folder = Path(folder)
    temp = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")
    gone = [f for f in folder.glob(".*.tmp") if temp.fullmatch(f.name)] if folder.is_dir() else []
    for f in gone:
        f.unlink(missing_ok=True)
    return gone


def tensors_digest(tensors: dict, metadata: dict[str, str]) -> str:
    """SHA-256 (hex) of a safetensors file's content: every tensor's name, dtype, shape and bytes (names sorted) and
    the string metadata (sorted JSON, ``sha256`` itself left out). Stored in the header as ``sha256`` by the writers
    of calibration and export files and verified by their readers, so that a byte changed anywhere in the file is
    refused rather than read as another calibration."""
    import torch

    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in metadata.items() if k != CHECKSUM_KEY}, sort_keys=True).encode("utf-8"))
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode("utf-8"))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _misspelled_checksum(keys) -> bool:
    """Whether a key is one character away from the checksum's: the checksum key damaged on disk, not an older file
    without one."""
    return any(len(k) == len(CHECKSUM_KEY) and sum(a != b for a, b in zip(k, CHECKSUM_KEY)) == 1 for k in keys)


def write_checked_safetensors(path: str | Path, tensors: dict, header: dict[str, str]) -> Path:
    """Write ``tensors`` with the string metadata ``header`` plus its ``sha256`` (:func:`tensors_digest`), atomically:
    the writer of calibration and export files (:func:`read_checked_safetensors` reads them back)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    header = dict(header, **{CHECKSUM_KEY: tensors_digest(tensors, header)})

    def write(tmp):
        try:
            save_file(tensors, tmp, metadata=header)
        except SafetensorError as e:  # an I/O error (a full disk) comes back as this, "I/O error: ... (os error 28)"
            code = re.search(r"os error (\d+)", str(e))
            if code is None and "I/O error" not in str(e):
                raise
            raise OSError(int(code.group(1)) if code else errno.EIO, str(e)) from e

    return atomic_write(path, write)


def expect_format(path, fmt: str, version: int, what: str):
    """A ``check_format`` for :func:`read_checked_safetensors`: the header must name ``fmt`` at ``version``, else a
    :class:`CorruptFileError` naming the file and what it holds instead (``what``: "a wushkv export", ...)."""
    def check(header: dict[str, str]) -> None:
        if header.get("format") != fmt or header.get("format_version") != str(version):
            raise CorruptFileError(f"{str(path)!r} is not {what} of format version {version} (format {header.get('format')!r}, "
                                   f"version {header.get('format_version')!r})")

    return check


def read_checked_safetensors(path: str | Path, what: str,
                             check_header: Callable[[dict[str, str]], None] | None = None) -> tuple[dict[str, str], dict]:
    """(header, {name: tensor}) of a safetensors file, its ``sha256`` verified where it has one (older files have
    none). Raises :class:`CorruptFileError` naming ``what`` and the path for a file safetensors cannot read or whose
    content does not match its checksum. ``check_header`` (the caller's format and version check) runs first, so a
    file of another format or version is named as such rather than as damaged."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types on damaged files
        raise CorruptFileError(f"{what} {str(path)!r} is corrupted or not a safetensors file: {type(e).__name__}: {e}") from None
    if check_header is not None:
        check_header(header)
    check_tensors_digest(path, tensors, header, what)
    return header, tensors


def check_tensors_digest(path, tensors: dict, metadata: dict[str, str], what: str) -> None:
    """Raise :class:`CorruptFileError` naming ``path`` when the header's ``sha256`` does not match the content (a file
    without one, from an older version, passes; a header key one character away from it is the key damaged)."""
    if CHECKSUM_KEY not in metadata:
        if _misspelled_checksum(metadata):
            raise CorruptFileError(f"{what} {str(path)!r} is damaged: its {CHECKSUM_KEY!r} header key is misspelled")
        return
    if metadata[CHECKSUM_KEY] != tensors_digest(tensors, metadata):
        raise CorruptFileError(f"{what} {str(path)!r} is damaged: its contents do not match the {CHECKSUM_KEY} it was written "
                               "with; make it again")
