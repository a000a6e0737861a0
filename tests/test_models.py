import pytest
import torch

from wushkv.models import UnsupportedModelError, attention_modules, describe, fingerprint, load_config, projections

from conftest import tiny_model


def test_describe_tiny_families(family):
    model = tiny_model(family)
    spec = describe(model)
    assert spec.num_layers == 3 and spec.num_heads == 4 and spec.num_kv_heads == 2 and spec.head_dim == 32
    assert spec.group_size == 2
    assert spec.gqa_map == (0, 0, 1, 1)
    assert list(spec.query_heads_of(1)) == [2, 3]
    assert spec.qk_norm == (family in ("qwen3", "gemma3"))
    if family == "gemma3":
        assert spec.sliding_layers == (0, 1) and spec.sliding_window == 16
    else:
        assert spec.sliding_layers == ()
    mods = attention_modules(model, spec)
    assert len(mods) == 3
    p = projections(mods[0], spec)
    assert p.q.weight.shape == (4 * 32, 64) and p.k.weight.shape == p.v.weight.shape == (2 * 32, 64) and p.o.in_features == 4 * 32
    if spec.qk_norm:
        assert hasattr(mods[0], "q_norm") and hasattr(mods[0], "k_norm")


def test_gqa_map_matches_transformers_repeat_kv():
    # transformers' repeat_kv expands KV head h to query heads h*G .. h*G+G-1
    from transformers.models.llama.modeling_llama import repeat_kv

    spec = describe(tiny_model("llama"))
    kv = torch.arange(spec.num_kv_heads, dtype=torch.float32).view(1, -1, 1, 1)
    rep = repeat_kv(kv, spec.group_size).view(-1)
    assert tuple(int(x) for x in rep) == spec.gqa_map


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama"):
        describe(model)


def test_fingerprint_changes_with_weights():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    fa, fb = fingerprint(a), fingerprint(b)
    assert fa["weights_sha256"] != fb["weights_sha256"]
    assert fingerprint(a) == fa  # deterministic
    assert fa["num_layers"] == 3


def test_missing_model_is_clear(tmp_path):
    from wushkv.models import load

    with pytest.raises((FileNotFoundError, ValueError)):
        load(str(tmp_path / "nope.txt"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="not a .gguf"):
        load(str(tmp_path / "x.txt"))


def test_a_hub_whose_host_does_not_resolve_is_asked_of_its_cache_alone(tmp_path, monkeypatch):
    """A hub id where the hub's host does not resolve (a machine without a network): the hub client would retry it
    for 48 s; only its cache is read instead, at once, and the error says why. A local folder, the hub's offline mode
    and a proxy leave the hub client alone. Through the command line in a fresh process (the hub client reads its
    offline mode when imported, and this suite runs offline): a clear error in seconds."""
    import os
    import subprocess
    import sys
    import time

    from wushkv import models

    for v in ("HF_HUB_OFFLINE", *models._PROXIES):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.wushkv-test.invalid")  # .invalid never resolves (RFC 2606)
    kw, why = models._hub_kwargs("no-such-org/no-such-model")
    assert kw == {"local_files_only": True} and "hub.wushkv-test.invalid does not resolve here" in why
    for local in (str(tmp_path), "/data/not-there-yet", "./not-there-yet"):  # paths, there or not: no hub ids
        assert models._hub_kwargs(local) == ({}, "")
    monkeypatch.setenv("HF_ENDPOINT", "hub.wushkv-test.invalid")  # no scheme: the host still
    assert "hub.wushkv-test.invalid does not resolve" in models._hub_kwargs("gpt2")[1]
    for offline in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_OFFLINE", "yes"), ("TRANSFORMERS_OFFLINE", "TRUE")):
        monkeypatch.setenv(*offline)
        assert models._hub_kwargs("no-such-org/no-such-model") == ({}, "")
        monkeypatch.delenv(offline[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert models._hub_kwargs("no-such-org/no-such-model")[0] == {"local_files_only": True}
    monkeypatch.setenv("https_proxy", "http://proxy.wushkv-test.invalid:3128")
    assert models._hub_kwargs("no-such-org/no-such-model") == ({}, "")
    monkeypatch.delenv("https_proxy")

    (tmp_path / "t.txt").write_text("hello world\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "wushkv.cli", "ppl", "--model", "no-such-org/no-such-model", "--text-file",
                        str(tmp_path / "t.txt")], env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t
    assert r.returncode == 2 and "hub.wushkv-test.invalid does not resolve here" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and ".. " not in r.stderr
    assert seconds < 20, seconds  # measured: 2.3 s (48 s of the hub client's retries before)


def test_bad_dtype():
    from wushkv.models import parse_dtype

    with pytest.raises(ValueError, match="int8.*bfloat16"):
        parse_dtype("int8")


@pytest.mark.slow
def test_real_smollm2_config():
    from wushkv.models import max_positions

    config = load_config("smollm2-135m")
    spec = describe(config)
    assert (spec.family, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == ("llama", 30, 9, 3, 64)
    assert not spec.qk_norm and spec.sliding_layers == ()
    assert max_positions("smollm2-135m") == config.max_position_embeddings == 8192  # the header alone, as transformers maps it


def test_a_ggufs_positions_come_from_its_header_alone(tmp_path):
    """max_positions reads ``{arch}.context_length`` and stops there: the vocabulary after it is never parsed (an array
    cut short after the key goes unnoticed), while a file cut before it, or not GGUF, is refused by name."""
    gguf = pytest.importorskip("gguf")
    from wushkv.models import gguf_metadata, max_positions

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_block_count(2)
    w.add_token_list([f"token{i}" for i in range(5000)])
    w.add_token_scores([0.0] * 5000)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert max_positions(str(path)) == 4096
    meta = gguf_metadata(path, lambda m: {"nothing.stops.here"})  # every field, arrays skipped
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2 and meta["llama.context_length"] == 4096
    assert meta["tokenizer.ggml.tokens"] is None and meta["tokenizer.ggml.scores"] is None
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    at = data.index(b"tokenizer.ggml.tokens")
    cut.write_bytes(data[: at + 100])  # the vocabulary cut short: not read, not noticed
    assert max_positions(str(cut)) == 4096
    cut.write_bytes(data[: data.index(b"llama.context_length") + 8])
    with pytest.raises(ValueError, match="cut short in its metadata"):
        max_positions(str(cut))
    cut.write_bytes(b"PK" + data)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        max_positions(str(cut))
    cut.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(ValueError, match="is a big-endian GGUF file, which transformers does not read"):
        max_positions(str(cut))
    cut.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="is a GGUF file of version 1; transformers reads versions 2 and 3"):
        max_positions(str(cut))
    at = data.index(b"general.architecture") - 8  # the key's length: a damaged one, past the file's end
    cut.write_bytes(data[:at] + (2**62).to_bytes(8, "little") + data[at + 8:])
    with pytest.raises(ValueError, match="cut short in its metadata .or a damaged length."):
        max_positions(str(cut))


def test_only_an_absent_model_package_reads_as_not_installed(tmp_path):
    """The real-model tests skip on ModelNotInstalledError alone: an absent package raises it, while a model file that
    is there but does not load raises another error (so a corrupt GGUF fails the suite instead of hiding as a skip)."""
    from wushkv.models import ModelNotInstalledError, _package_dir, load

    with pytest.raises(ModelNotInstalledError, match="pip install no-such-model"):
        _package_dir("wushkv_no_such_model_package", "pip install no-such-model")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(Exception) as e:
        load(str(bad))
    assert not isinstance(e.value, ModelNotInstalledError)
