"""Evaluation and calibration text: WikiText-2 test, the C4 sample, or any UTF-8 file.

Defaults point at ``../shared/data`` beside the repository root (override with ``WUSHKV_DATA``), or
beside the checkout a local clone was made from (``git clone . /tmp/check`` finds the data of ``.``);
where files are missing and the hub is reachable, WikiText-2 and C4 fall back to ``datasets``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import torch

from .models import hub_unresolved

WIKITEXT_REL = "wikitext-2-raw/wiki.test.raw"
C4_REL = "c4/c4-validation-2k.jsonl.gz"


class DataNotFoundError(FileNotFoundError):
    """Evaluation or calibration text could not be found."""


def origin_checkout(repo_root: Path) -> Path | None:
    """The local checkout ``repo_root`` was cloned from (git's ``remote.origin.url`` when it names a local
    folder), or None: a clean clone made for a check finds the data beside the original."""
    try:
        lines = (repo_root / ".git" / "config").read_text().splitlines()
    except OSError:  # not a git checkout (an installed wheel), or .git is a file (worktree)
        return None
    section = None
    for line in lines:
        s = line.strip()
        if s.startswith("["):
            section = s
        elif section == '[remote "origin"]' and s.split("=", 1)[0].strip() == "url":
            url = s.split("=", 1)[1].strip()
            url = url[len("file://"):] if url.startswith("file://") else url
            p = Path(url) if "://" not in url and not url.startswith("git@") else None
            p = (repo_root / p).resolve() if p is not None and not p.is_absolute() else p
            return p if p is not None and p.is_dir() else None
    return None


def data_dirs() -> list[Path]:
    """Where data is looked for, in order: $WUSHKV_DATA, ../shared/data from the repo root, from the
    checkout it was cloned from (a local clone) and from the cwd."""
    dirs = []
    if os.environ.get("WUSHKV_DATA"):
        dirs.append(Path(os.environ["WUSHKV_DATA"]))
    repo_root = Path(__file__).resolve().parents[2]
    dirs.append(repo_root.parent / "shared" / "data")
    origin = origin_checkout(repo_root)
    if origin is not None:
        dirs.append(origin.parent / "shared" / "data")
    dirs += [Path.cwd().parent / "shared" / "data", Path.cwd() / "shared" / "data"]
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _find(rel: str, dirs: list[Path] | None = None) -> Path | None:
    for d in data_dirs() if dirs is None else dirs:
        if (d / rel).is_file():
            return d / rel
    return None


def read_text_file(path: str | Path) -> str:
    """A UTF-8 text file with CRLF turned into LF."""
    p = Path(path)
    if p.is_dir():
        raise DataNotFoundError(f"text file {str(p)!r} is a folder, not a file")
    if not p.is_file():
        raise DataNotFoundError(f"text file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"text file {str(p)!r} is not valid UTF-8: {e}") from e
    return text.replace("\r\n", "\n")


def _datasets_cached(name: str) -> bool:
    """Whether ``datasets``' cache holds a copy of the hub dataset ``name`` ("wikitext", "allenai/c4"): where its
    ``load_dataset`` falls back to when the hub cannot be asked (``CachedDatasetModuleFactory``'s folder)."""
    try:
        from datasets import config
        from datasets.naming import camelcase_to_snakecase
    except ImportError:
        return False
    *org, last = name.split("/")
    return (Path(config.HF_DATASETS_CACHE) / "___".join([*org, camelcase_to_snakecase(last)])).is_dir()


def _hub_fallback(what: str, loader, dirs: list[Path] | None = None, name: str | None = None):
    looked = ", ".join(str(d) for d in (data_dirs() if dirs is None else dirs))
    advice = "Put the file under one of these folders, set WUSHKV_DATA to a folder holding it, or pass --text-file."
    # without a network, datasets would retry the hub for ~25 s before reading its cache: where that holds no copy,
    # say so at once
    host = hub_unresolved(offline=("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if host is not None and name is not None and not _datasets_cached(name):
        raise DataNotFoundError(f"{what} not found: looked in {looked}; the hub's host {host} does not resolve here "
                                f"and datasets' cache holds no copy of {name!r}. {advice}")
    try:
        return loader()
    except Exception as e:  # noqa: BLE001 - any hub failure means "not available"
        raise DataNotFoundError(
            f"{what} not found: looked in {looked} and the hub was not reachable ({type(e).__name__}). {advice}"
        ) from None


def wikitext2_test(path: str | Path | None = None, search: list[Path] | None = None) -> str:
    """WikiText-2 raw test split as one string (CRLF → LF): ``path``, else the first of the folders ``search``
    (default :func:`data_dirs`) holding it, else the hub."""
    if path is not None:
        return read_text_file(path)
    p = _find(WIKITEXT_REL, search)
    if p is not None:
        return read_text_file(p)

    def hub():
        from datasets import load_dataset  # optional

        ds = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
        return "".join(ds["text"])

    return _hub_fallback(f"WikiText-2 test ({WIKITEXT_REL})", hub, search, "wikitext")


def c4_documents(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Texts of the C4 validation sample (JSON lines, optionally gzipped)."""
    p = Path(path) if path is not None else _find(C4_REL)
    if p is None:

        def hub():
            from datasets import load_dataset  # optional

            ds = load_dataset("allenai/c4", data_files="en/c4-validation.00000-of-00008.json.gz", split="train")
            return list(ds["text"][: limit or 2000])

        return _hub_fallback(f"C4 calibration sample ({C4_REL})", hub, name="allenai/c4")
    if not p.is_file():
        raise DataNotFoundError(f"calibration file {str(p)!r} does not exist")
    opener = gzip.open if p.suffix == ".gz" else open
    docs = []
    with opener(p, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and len(docs) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                docs.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{str(p)!r} line {i + 1} is not a JSON object with a 'text' field: {e}") from None
    return docs


def tokenize_chunks(tokenizer, text: str, seq_len: int, max_chunks: int | None = None, first: int = 0) -> torch.Tensor:
    """GPTQ-style: tokenize ``text`` once, cut non-overlapping ``seq_len`` chunks, drop the remainder.

    ``first`` skips that many chunks (more evaluation text beyond a fixed protocol's chunks, never the same
    tokens twice). Returns int64 ``[num_chunks, seq_len]``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if first < 0:
        raise ValueError(f"first chunk must be >= 0, got {first}")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one chunk of seq_len={seq_len}")
    if first >= n:
        raise ValueError(f"first chunk {first} is past the text's {n} chunks of seq_len={seq_len}")
    n -= first
    if max_chunks is not None:
        if max_chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {max_chunks}")
        n = min(n, max_chunks)
    return ids[first * seq_len : (first + n) * seq_len].view(n, seq_len)


def calibration_text(path: str | Path | None = None, documents: int = 600) -> str:
    """Calibration text: the first ``documents`` C4 documents joined with blank lines, or a UTF-8 file.

    A ``.jsonl``/``.jsonl.gz`` path is read as C4-style JSON lines; any other path as plain text.
    """
    if path is not None and not (str(path).endswith(".jsonl") or str(path).endswith(".jsonl.gz")):
        return read_text_file(path)
    return "\n\n".join(c4_documents(path, limit=documents))


HELDOUT_C4_FIRST = 1200  # past the documents any calibration here reads (600 for up to ~120 x 2048 tokens)
HELDOUT_C4_DOCUMENTS = 800


def heldout_c4_text(first: int = HELDOUT_C4_FIRST, documents: int = HELDOUT_C4_DOCUMENTS) -> tuple[str, str]:
    """(text, label): C4 validation documents ``first``..``first + documents − 1`` joined with blank lines.

    Text of the calibration's domain that no calibration reads: settings are chosen on it, never on the
    evaluation text (``wushkv data heldout`` writes it to a file)."""
    if first < 0 or documents < 1:
        raise ValueError(f"expected a first document >= 0 and at least 1 document, got first={first}, documents={documents}")
    held = c4_documents(limit=first + documents)  # all of them where the sample has fewer
    docs = held[first:]
    if len(docs) < documents:
        raise ValueError(f"the C4 sample has {len(held)} documents; asked for {first}..{first + documents - 1}")
    return "\n\n".join(docs), f"{len(docs)} C4 documents ({first}..{first + len(docs) - 1})"


def load_eval_text(text_file: str | Path | None = None) -> tuple[str, str]:
    """(text, label) for evaluation: ``--text-file`` if given, else WikiText-2 test."""
    if text_file is not None:
        return read_text_file(text_file), str(text_file)
    return wikitext2_test(), "wikitext2-test"
