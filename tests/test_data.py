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
