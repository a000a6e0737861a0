"""``export-model``: a folder plain transformers loads, with the same logits; a side file that holds, read back from
disk, inverse key transforms and everything the quantized cache needs; refusals; nothing half-written."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from wushkv.calibration import CalibrationError, calibrate
from wushkv.config import QuantConfig, WindowConfig
from wushkv.folding import apply_transforms
from wushkv.io import CorruptFileError, write_json
from wushkv.methods.install import method_cache, transforms_for
from wushkv.serving import (SIDE_FILE, SIDE_JSON, check_exported_model, export_model, read_side_file, served_config,
                            served_transforms)

from conftest import TINY_CALIBRATION_TEXT, hf_char_tokenizer, tiny_model

VOCAB = 128  # hf_char_tokenizer's
CFG = QuantConfig(k_bits=2, v_bits=2, quantizer="quest", windows=WindowConfig(4, 8, 4))
# Logits of the reloaded folder against the original model, relative to the largest |logit|: folding computes T_V·W_v
# and W_o·T_V⁻¹ in float64 and rounds them to float32, so only that rounding separates them.
ORIGINAL_TOL = 1e-5


def _model(family, seed=0):
    return tiny_model(family, seed=seed, vocab_size=VOCAB)


def _cal(model, tmp_path, seq_len=64):
    text = tmp_path / "calib.txt"
    text.write_text(TINY_CALIBRATION_TEXT)
    return calibrate(model, hf_char_tokenizer(), samples=3, seq_len=seq_len, text_file=str(text), show_progress=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny llama and its calibration, shared: every export leaves the model as it was (checked below)."""
    model = _model("llama")
    return model, _cal(model, tmp_path_factory.mktemp("cal"))


def _ids(n=40, seed=1):
    return torch.randint(4, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids, **kw):
    return model(ids, **kw).logits.double()


def _rel(a, b, ref):
    return float((a - b).abs().max()) / max(1.0, float(ref.abs().max()))


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# families: plain (llama), per-head key norm (qwen3), key norm + sliding layers (gemma3), fused QKV (phi3),
# a key norm over the whole projection (olmo2), convolution layers between attention layers (lfm2)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3", "olmo2", "lfm2"])
def test_export_reloads_with_plain_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _model(family)
    cal = _cal(model, tmp_path)
    ids = _ids()
    original = _logits(model, ids)
    before = _snapshot(model)
    out = tmp_path / "served"
    meta = export_model(model, hf_char_tokenizer(), out, method="wush", cfg=CFG, calibration=cal)

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "wushkv"} <= names, names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".served.")], "the temporary folder was left behind"
    # the model handed in is left as it was: weights back, no key transform installed
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert not any(n.endswith("wushkv_key") for n, _ in model.named_modules())

    reloaded = AutoModelForCausalLM.from_pretrained(out)  # no wushkv code in the loop
    assert reloaded.dtype == torch.float32
    # T_V really is in the weights (not an identity export), and cancels: the logits are the original model's
    assert any(not torch.equal(reloaded.state_dict()[k], before[k]) for k in before if "v_proj" in k or "qkv_proj" in k)
    got = _logits(reloaded, ids)
    assert _rel(got, original, original) <= ORIGINAL_TOL
    assert meta["checks"]["reload_vs_folded"] == 0.0  # same weights, same arithmetic: bit for bit
    assert meta["checks"]["reload_vs_original"] <= ORIGINAL_TOL
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("pack my box").input_ids == hf_char_tokenizer()("pack my box").input_ids


def test_bfloat16_export_reloads_bit_for_bit(tmp_path):
    """A model loaded in bfloat16 exports bfloat16 weights that reload to the same logits, bit for bit."""
    from transformers import AutoModelForCausalLM

    _model("llama").save_pretrained(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16)
    meta = export_model(model, None, tmp_path / "bf16", method="random", cfg=CFG)
    assert meta["checks"]["reload_vs_folded"] == 0.0 and meta["checks"]["reload_vs_original"] <= meta["checks"]["original_tolerance"]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_the_folder_is_readable_as_the_umask_allows(tmp_path):
    """The folder is written in a temporary folder (mkdtemp: 0700) renamed into place: it and every file in it get
    the permissions new ones get under the umask (0755 and 0644 under 022), so a serving engine running as another
    user can read the checkpoint."""
    import os

    old = os.umask(0o022)
    try:
        export_model(_model("llama"), hf_char_tokenizer(), tmp_path / "served", method="hadamard", cfg=CFG)
    finally:
        os.umask(old)
    served = tmp_path / "served"
    modes = {str(p.relative_to(tmp_path)): (p.is_dir(), p.stat().st_mode & 0o777) for p in (served, *served.rglob("*"))}
    assert "served/model.safetensors" in modes, modes
    assert all(m == (0o755 if is_dir else 0o644) for is_dir, m in modes.values()), modes


def test_side_file_read_from_disk_holds_inverse_key_transforms(llama, tmp_path):
    model, cal = llama
    out = tmp_path / "served"
    export_model(model, hf_char_tokenizer(), out, method="wush+rmean+ldlq", cfg=CFG, calibration=cal)
    trs = transforms_for(model, cal, "wush+rmean+ldlq")
    # read the raw file, not through the library's reader
    with safe_open(str(out / SIDE_FILE), "pt") as f:
        header = f.metadata()
        meta = json.loads(header["meta"])
        assert header["format"] == "wushkv-served-model" and "sha256" in header
        eye = torch.eye(32, dtype=torch.float64)
        for l in range(3):
            key, query = f.get_tensor(f"layers.{l}.key"), f.get_tensor(f"layers.{l}.query")
            assert key.dtype == torch.float32 and key.shape == (2, 32, 32)
            # the row-vector pair: K' = K·key, Q' = Q·query with Q'K'ᵀ = QKᵀ, i.e. query·keyᵀ = T_K⁻¹·T_K = I
            assert float((query.double() @ key.double().mT - eye).abs().max()) <= 1e-4
            assert torch.equal(key, trs[l].T_K.float().mT)  # keyᵀ is the T_K the method installs
            assert torch.equal(f.get_tensor(f"layers.{l}.key_feedback"), trs[l].F_K.float())
            assert torch.equal(f.get_tensor(f"layers.{l}.key_mean_pre_rope"), trs[l].mu_K_rope.float())
            assert f.get_tensor(f"layers.{l}.rope_inv_freq").shape == (16,)
    assert meta["method"] == "wush+rmean+ldlq" and meta["features"]["feedback"] == "KV"
    assert meta["features"]["key_centering"] == "rope-mean" and len(meta["rope_scaling"]) == 3
    assert QuantConfig.from_dict(meta["quantization"]) == CFG
    assert meta["calibration"]["fingerprint"] == cal.meta["fingerprint"]
    assert meta["source_fingerprint"] == cal.meta["fingerprint"]  # the model it was made from
    assert meta["fingerprint"]["weights_sha256"] != cal.meta["fingerprint"]["weights_sha256"]  # the folded weights'
    assert json.loads((out / SIDE_JSON).read_text())["sha256"]  # the readable copy is checksummed too


# tokens: past the first flush (sink 4 + keep 8 + flush 4; +ktiles: sink 4 + one tile of 128 keys)
@pytest.mark.parametrize("method,n", [("wush+rmean+ldlq", 48), ("wush-c:wush+ktiles", 160), ("hadamard", 48)])
def test_folder_and_side_file_reproduce_the_quantized_cache(method, n, llama, tmp_path):
    """Everything the cache needs is in the folder: the reloaded model with the side file's transforms and quantization
    gives the quantized-cache logits of the method installed on the original model."""
    from transformers import AutoModelForCausalLM

    model, cal = llama
    out = tmp_path / "served"
    cfg = replace(CFG, quantizer="affine")  # +ktiles quantizes values per token: quest or affine
    meta = export_model(model, hf_char_tokenizer(), out, method=method, cfg=cfg, calibration=cal)
    ids = _ids(n=n)
    with method_cache(model, cal, method, cfg) as make:
        cache = make()
        want = _logits(model, ids, cache=cache, use_cache=True)
    # the cache was used and quantized (a transformers without the cache= keyword would ignore it silently)
    assert cache.get_seq_length() == ids.shape[1] and _rel(want, _logits(model, ids), want) > 1e-3
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    meta_read, tensors = read_side_file(out)
    assert meta_read == meta
    check_exported_model(meta_read, reloaded)
    with apply_transforms(reloaded, served_transforms(meta_read, tensors), meta_read["method"]) as installed:
        got = _logits(reloaded, ids, cache=installed.cache(served_config(meta_read)), use_cache=True)
    assert _rel(got, want, want) <= 1e-5, _rel(got, want, want)


def test_auto_records_what_it_resolved_to_and_why(llama, tmp_path):
    model, cal = llama
    meta = export_model(model, hf_char_tokenizer(), tmp_path / "served", method="auto", cfg=replace(CFG, quantizer="affine"),
                        calibration=cal, model_key="tiny-llama")
    choice = meta["choice"]
    # no selection for a tiny model: the paper recipe, centered on the rotating mean under affine (the calibration holds it)
    assert choice["requested"] == "auto" and choice["source"] == "paper" and choice["method"] == meta["method"] == "wush+rmean"
    assert "no selection" in choice["why"]


def test_refuses_a_calibration_of_another_model(tmp_path):
    cal = _cal(_model("llama", seed=1), tmp_path)
    with pytest.raises(CalibrationError, match="does not match.*weights_sha256"):
        export_model(_model("llama"), hf_char_tokenizer(), tmp_path / "served", method="wush", cfg=CFG, calibration=cal)
    assert not (tmp_path / "served").exists()


@pytest.mark.parametrize("method,message", [
    ("full-precision", "installs no wushkv transform"),
    ("stock-quanto-2", "installs no wushkv transform"),
    ("wush-c", r"centers values, which adds \['model.layers.0.self_attn.o_proj.bias'.*wush-c:wush"),
    ("wush+tiles+ldlq", "error feedback on the values cannot be combined"),
])
def test_refuses_methods_the_folder_cannot_carry(method, message, llama, tmp_path):
    model, cal = llama
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        export_model(model, hf_char_tokenizer(), tmp_path / "served", method=method, cfg=CFG, calibration=cal)
    assert list(tmp_path.iterdir()) == []
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)  # biases taken off again


def test_refuses_a_calibrated_method_without_calibration_and_an_existing_folder(tmp_path):
    with pytest.raises(ValueError, match="needs a calibration"):
        export_model(_model("llama"), None, tmp_path / "a", method="wush", cfg=CFG)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        export_model(_model("llama"), None, tmp_path / "b", method="hadamard", cfg=CFG)
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["config.json"]
    (tmp_path / "c").mkdir()  # an empty folder is taken
    export_model(_model("llama"), None, tmp_path / "c", method="hadamard", cfg=CFG)
    assert (tmp_path / "c" / SIDE_FILE).is_file() and not (tmp_path / "c" / "tokenizer.json").exists()


class _FailingTokenizer:
    """Writes part of its files, then fails: an export interrupted after the weights are on disk."""

    def save_pretrained(self, folder):
        Path(folder, "tokenizer.json").write_text('{"trunc')
        raise OSError("disk full")


def test_a_failure_mid_write_leaves_nothing_under_out(tmp_path):
    out = tmp_path / "served"
    with pytest.raises(OSError, match="disk full"):
        export_model(_model("llama"), _FailingTokenizer(), out, method="hadamard", cfg=CFG)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor the temporary one beside it


def test_damaged_or_mismatched_side_files_are_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    a, b = tmp_path / "a", tmp_path / "b"
    export_model(_model("llama"), None, a, method="hadamard", cfg=CFG)
    export_model(_model("llama", seed=1), None, b, method="random", cfg=CFG)
    meta, _ = read_side_file(a)
    with pytest.raises(ValueError, match="written for other weights"):
        check_exported_model(meta, AutoModelForCausalLM.from_pretrained(b))
    (a / SIDE_JSON).write_bytes((b / SIDE_JSON).read_bytes())  # the readable copy of another export
    with pytest.raises(CorruptFileError, match="does not say what"):
        read_side_file(a)
    edited = json.loads((b / SIDE_JSON).read_text())
    edited["method"] = "wush"
    write_json(b / SIDE_JSON, edited)  # a consistent checksum, different content
    with pytest.raises(CorruptFileError, match="does not say what"):
        read_side_file(b)
    raw = bytearray((b / SIDE_FILE).read_bytes())
    raw[-5] ^= 0xFF  # a byte of the last tensor
    (b / SIDE_FILE).write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="damaged"):
        read_side_file(b)
    with pytest.raises(FileNotFoundError, match="no wushkv side file"):
        read_side_file(tmp_path)


def test_cli_export_model(llama, tmp_path, capsys):
    from wushkv.cli import main

    model, cal = llama
    src = tmp_path / "model"
    model.save_pretrained(src)
    hf_char_tokenizer().save_pretrained(src)
    cal.save(tmp_path / "cal.safetensors")
    rc = main(["export-model", "--model", str(src), "--calibration", str(tmp_path / "cal.safetensors"), "--method", "wush",
               "--bits", "4", "--sink", "4", "--keep", "8", "--out", str(tmp_path / "served")])
    printed = capsys.readouterr().out
    assert rc == 0 and "wush, K4V4 affine windows 4/8/8" in printed and "logits 0.00e+00 from the folded model" in printed
    assert read_side_file(tmp_path / "served")[0]["quantization"]["k_bits"] == 4
    assert "note:" not in capsys.readouterr().err
    # key tiles after a sink of 4 tokens: exported (the folder is engine-agnostic), with a note of what vLLM needs
    rc = main(["export-model", "--model", str(src), "--calibration", str(tmp_path / "cal.safetensors"), "--method", "wush+ktiles",
               "--bits", "2", "--sink", "4", "--keep", "8", "--flush", "4", "--out", str(tmp_path / "tiles")])
    err = capsys.readouterr().err
    assert rc == 0 and "note: key tiles of 128 tokens start after the sink of 4 tokens" in err and "export with --sink 128" in err
    # no --sink: the default (64) is raised to one whole tile, the recent window shortened by as much: servable
    rc = main(["export-model", "--model", str(src), "--calibration", str(tmp_path / "cal.safetensors"), "--method", "wush+ktiles",
               "--bits", "2", "--keep", "256", "--out", str(tmp_path / "tiles-default")])
    out, err = capsys.readouterr()
    assert rc == 0 and "sink 64 -> 128, recent window 256 -> 192" in err and "key tiles of 128 tokens start" not in err
    w = read_side_file(tmp_path / "tiles-default")[0]["quantization"]["windows"]
    assert (w["S_sink"], w["S_keep"], w["S_flush"]) == (128, 132, 128)  # key_tile_windows of 128/192/8
    # a method without key tiles keeps the default sink, silently
    rc = main(["export-model", "--model", str(src), "--calibration", str(tmp_path / "cal.safetensors"), "--method", "wush",
               "--bits", "2", "--out", str(tmp_path / "plain-default")])
    assert rc == 0 and "note:" not in capsys.readouterr().err
    assert read_side_file(tmp_path / "plain-default")[0]["quantization"]["windows"]["S_sink"] == 64

    other = _cal(_model("llama", seed=1), tmp_path)
    other.save(tmp_path / "other.safetensors")
    rc = main(["export-model", "--model", str(src), "--calibration", str(tmp_path / "other.safetensors"), "--method", "wush",
               "--out", str(tmp_path / "served2")])
    assert rc == 2 and "does not match" in capsys.readouterr().err and not (tmp_path / "served2").exists()


@pytest.mark.slow
def test_smollm2_exports_auto_and_reloads(tmp_path):
    """The real GGUF-loaded SmolLM2 (its loader's quantizer refuses save_pretrained): the folder reloads, tokenizer
    included, with the original logits; ``auto`` at K2V2 affine is its recorded selection."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wushkv.models import ModelNotInstalledError, load

    try:
        model, tok = load("smollm2-135m")
    except ModelNotInstalledError as e:  # only an absent package skips
        pytest.skip(f"real model not installed: {e}")
    text = tmp_path / "calib.txt"
    text.write_text(TINY_CALIBRATION_TEXT * 4)
    cal = calibrate(model, tok, samples=2, seq_len=256, text_file=str(text), show_progress=False)
    out = tmp_path / "served"
    cfg = QuantConfig(k_bits=2, v_bits=2, quantizer="affine", windows=WindowConfig(64, 256, 8))
    meta = export_model(model, tok, out, method="auto", cfg=cfg, calibration=cal, model_key="smollm2-135m")
    assert meta["choice"]["source"] == "recorded" and meta["method"] == "wush+rmean+ktiles+ldlq"
    assert meta["checks"]["reload_vs_folded"] == 0.0 and meta["checks"]["reload_vs_original"] <= 1e-4
    assert hasattr(model, "hf_quantizer")  # the GGUF loader is put back on the model handed in
    ids = tok("The history of the KV cache begins", return_tensors="pt").input_ids
    assert AutoTokenizer.from_pretrained(out)("The history of the KV cache begins").input_ids == ids[0].tolist()
    with torch.no_grad():
        want, got = model(ids).logits, AutoModelForCausalLM.from_pretrained(out)(ids).logits
    assert _rel(got.double(), want.double(), want) <= 1e-4
