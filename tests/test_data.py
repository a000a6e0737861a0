import gzip
import json

import pytest
import torch

from wushkv.data import DataNotFoundError, c4_documents, calibration_text, read_text_file, tokenize_chunks, wikitext2_test


def test_read_text_file_crlf(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes("a\r\nb é\r\n".encode("utf-8"))
    assert read_text_file(p) == "a\nb é\n"


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(DataNotFoundError, match="does not exist"):
        read_text_file(tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="UTF-8"):
        read_text_file(bad)


def test_missing_wikitext_names_places(tmp_path):
    with pytest.raises(DataNotFoundError, match=str(tmp_path)):
        wikitext2_test(search=[tmp_path])


def test_data_without_a_network_or_a_cached_copy_fails_at_once(tmp_path, monkeypatch):
    """A data file not found, the hub's host not resolving here, and datasets' cache holding no copy: the error comes at
    once and says so, instead of after ~25 s of datasets' hub retries. A cached copy (its folder in datasets' cache)
    is still asked for; offline mode (HF_DATASETS_OFFLINE too) asks no network and needs no probe."""
    import os
    import subprocess
    import sys
    import time

    import datasets.config

    from wushkv import data

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "ds"))
    (tmp_path / "ds" / "allenai___c4").mkdir(parents=True)
    assert data._datasets_cached("allenai/c4") and not data._datasets_cached("wikitext")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="https://hub.wushkv-test.invalid", HF_DATASETS_CACHE=str(tmp_path / "ds"))  # never resolves
    for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(v, None)
    code = f"from pathlib import Path; from wushkv.data import wikitext2_test; wikitext2_test(search=[Path({str(tmp_path)!r})])"
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t
    assert r.returncode != 0 and "hub.wushkv-test.invalid does not resolve here and datasets' cache holds no copy of " \
        "'wikitext'" in r.stderr, r.stderr[-2000:]
    assert seconds < 15, seconds  # measured: 2.7 s (26 s of retries before)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert data.hub_unresolved(offline=("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")) is None


def test_c4_jsonl(tmp_path):
    p = tmp_path / "c4.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"doc {i}", "url": "u"}) + "\n")
    assert c4_documents(p, limit=3) == ["doc 0", "doc 1", "doc 2"]
    assert calibration_text(p, documents=2) == "doc 0\n\ndoc 1"
    q = tmp_path / "bad.jsonl"
    q.write_text('{"nottext": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        c4_documents(q)


def test_tokenize_chunks_drops_remainder(char_tokenizer):
    text = "abcdefghij" * 10  # 100 tokens
    chunks = tokenize_chunks(char_tokenizer, text, 30)
    assert chunks.shape == (3, 30)
    ids = char_tokenizer(text).input_ids[0]
    assert torch.equal(chunks.reshape(-1), ids[:90])
    assert tokenize_chunks(char_tokenizer, text, 30, max_chunks=2).shape == (2, 30)
    with pytest.raises(ValueError, match="fewer than one chunk"):
        tokenize_chunks(char_tokenizer, "ab", 30)
    later = tokenize_chunks(char_tokenizer, text, 30, max_chunks=5, first=1)  # the chunks after the first, never overlapping
    assert later.shape == (2, 30) and torch.equal(later, chunks[1:])
    with pytest.raises(ValueError, match="first chunk 3 is past the text's 3 chunks"):
        tokenize_chunks(char_tokenizer, text, 30, first=3)


def test_shared_wikitext_is_found():
    text = wikitext2_test()
    assert "\r\n" not in text and len(text) > 1_000_000


def test_a_local_clone_finds_the_checkout_it_came_from(tmp_path):
    from wushkv.data import origin_checkout

    orig, clone = tmp_path / "work" / "main", tmp_path / "check"
    orig.mkdir(parents=True)
    for url, want in ((str(orig), orig), (f"file://{orig}", orig), ("https://github.com/x/y.git", None),
                      ("git@github.com:x/y.git", None), (str(tmp_path / "gone"), None)):
        (clone / ".git").mkdir(parents=True, exist_ok=True)
        (clone / ".git" / "config").write_text(f'[core]\n\tbare = false\n[remote "origin"]\n\turl = {url}\n'
                                               '\tfetch = +refs/heads/*:refs/remotes/origin/*\n')
        assert origin_checkout(clone) == want, url
    assert origin_checkout(tmp_path / "no-repo") is None
