"""Every supported model family through the same checks, on tiny random models built in code.

The families are ``conftest.TINY_CONFIGS``; :func:`test_every_supported_family_is_checked` fails when the adapter
(``wushkv.models.FAMILIES``) supports a family without a tiny config here, so adding a family adds it to every check.
What each family exercises: MoE MLPs (qwen2_moe, qwen3_moe, gpt_oss), q/k norms per head (qwen3, gemma3, lfm2) and
over the whole projection (olmo2), a fused QKV projection (phi3), a logit softcap and query_pre_attn_scalar
(gemma2), attention multipliers (granite), learned sink logits and YaRN (gpt_oss), alternating sliding windows
(gemma2, gemma3, gpt_oss), layers without RoPE (smollm3) and decoder layers without attention (lfm2).
"""

from __future__ import annotations

import pytest
import torch

from wushkv.cache import WushKVCache
from wushkv.calibration import Calibration, CalibrationError
from wushkv.config import QuantConfig, WindowConfig
from wushkv.folding import apply_transforms
from wushkv.methods import parse
from wushkv.methods.install import transforms_for
from wushkv.models import FAMILIES, UnsupportedModelError, attention_modules, describe, fingerprint, projections
from wushkv.transforms import LayerTransforms, build_transforms

from conftest import ALL_FAMILIES, TINY_CONFIGS, CharTokenizer, TINY_CALIBRATION_TEXT, left_padded, padded_prefill_then_decode, tiny_model

# The three codecs of the issue: per-token QuEST, per-token affine, and keys in KVarN's tiles (+ktiles) with QuEST values.
CODECS = {
    "quest": QuantConfig(2, 2, "quest", windows=WindowConfig(4, 8, 4)),
    "affine": QuantConfig(4, 2, "affine", windows=WindowConfig(3, 5, 2)),
    "key-tiles": QuantConfig(2, 3, "quest", key_quantizer="kvarn", tile_clip=1.3, windows=WindowConfig(4, 5, 8)),
}


def _model_type(family: str) -> str:
    return "gemma3_text" if family == "gemma3" else family


def _transforms(model, name: str = "random") -> list[LayerTransforms]:
    spec = describe(model)
    return [build_transforms(name, spec.num_kv_heads, spec.head_dim, seed=l) for l in range(spec.num_layers)]


def _random_invertible(spec, gen) -> tuple[torch.Tensor, torch.Tensor]:
    A = torch.randn(spec.num_kv_heads, spec.head_dim, spec.head_dim, generator=gen, dtype=torch.float64)
    A = A / spec.head_dim**0.5 + torch.eye(spec.head_dim, dtype=torch.float64)
    return A, torch.linalg.inv(A)


@torch.no_grad()
def _stream(model, ids, cfg, chunks, inputs=None, **kw):
    cache = WushKVCache(model, cfg, inputs=inputs, **kw)
    out, t = [], 0
    for n in chunks:
        out.append(model(ids[:, t : t + n], cache=cache, use_cache=True).logits)
        t += n
    return torch.cat(out, 1), cache


def test_every_supported_family_is_checked():
    """The tiny configs cover exactly the adapter's families, and each builds the family it is named for."""
    assert sorted(_model_type(f) for f in TINY_CONFIGS) == sorted(FAMILIES)
    for f in ALL_FAMILIES:
        import transformers

        assert getattr(transformers, TINY_CONFIGS[f][0]).model_type == _model_type(f)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_describe(family):
    """The adapter finds every attention layer, its projections (the slices of a fused QKV) and the family's
    particulars; fingerprints of the families supported before hybrids and sinks keep their old fields."""
    model = tiny_model(family)
    spec = describe(model)
    cfg = model.config
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.group_size) == (4, 2, 32, 2)
    mods = attention_modules(model, spec)
    assert len(mods) == spec.num_layers == len(spec.attention_layers) == len(spec.layer_types)
    assert spec.num_decoder_layers == cfg.num_hidden_layers
    assert [m.layer_idx for m in mods] == list(spec.attention_layers)  # transformers' layer_idx is the decoder layer
    for m in mods:
        p = projections(m, spec)
        assert p.q.weight.shape == (4 * 32, cfg.hidden_size)
        assert p.k.weight.shape == p.v.weight.shape == (2 * 32, cfg.hidden_size)
        assert p.o.in_features == 4 * 32
    x = torch.randn(1, 5, cfg.hidden_size)
    p = projections(mods[0], spec)
    if spec.fused_qkv:  # the key and value rows are the fused output's middle and last Hkv·d columns
        out = p.k.linear(x)
        assert torch.equal(p.k.rows_of(out), out[..., 128:192]) and torch.equal(p.v.rows_of(out), out[..., 192:])
    assert spec.fused_qkv == (family == "phi3")
    assert spec.attention_sinks == (family == "gpt_oss")
    assert (spec.attn_logit_softcap is not None) == (family == "gemma2")
    assert spec.nope_layers == ((1,) if family == "smollm3" else ())
    assert spec.attention_layers == ((1, 3) if family == "lfm2" else (0, 1, 2))
    sliding = {"gemma2": (0, 2), "gemma3": (0, 1), "gpt_oss": (0, 2), "mistral": (0, 1, 2)}.get(family, ())
    assert spec.sliding_layers == sliding and (spec.sliding_window == 16) == bool(sliding)
    old = {"family", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "qk_norm", "layer_types",
           "sliding_window", "weights_sha256"}
    if family in ("llama", "mistral", "qwen2", "qwen3", "gemma3"):
        assert set(fingerprint(model)) == old
    assert spec.to_dict() == describe(cfg).to_dict()  # the config alone says the same (`wushkv info` reads only it)


@pytest.mark.parametrize("family", ALL_FAMILIES)
@torch.no_grad()
def test_fold_invariance(family):
    """float64: any invertible T_K (online) and T_V (folded into v rows and o columns) leave the logits unchanged to
    1e-6; restore() brings the exact weights back."""
    model = tiny_model(family).double()
    spec = describe(model)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    weights = {n: p.clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    trs = []
    for _ in range(spec.num_layers):
        T_K, T_K_inv = _random_invertible(spec, gen)
        T_V, T_V_inv = _random_invertible(spec, gen)
        trs.append(LayerTransforms(T_K, T_K_inv, T_V, T_V_inv))
    with apply_transforms(model, trs):
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, weights[n])]
        assert changed and all(any(s in n for s in ("v_proj", "o_proj", "qkv_proj", "out_proj")) for n in changed), changed
        out = model(ids).logits
    assert (out - ref).abs().max() < 1e-6
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("family", ALL_FAMILIES)
@torch.no_grad()
def test_centering_is_exact_or_refused(family):
    """Centered keys and values (mu_K, mu_V) are exact where the softmax allows (float64, 1e-6); under a logit
    softcap (key shift) or learned sink logits (key and value shifts) they are refused by name, not run wrong."""
    model = tiny_model(family).double()
    spec = describe(model)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    ref = model(ids).logits
    gen = torch.Generator().manual_seed(1)
    mu = lambda: torch.randn(spec.num_kv_heads, spec.head_dim, generator=gen, dtype=torch.float64)  # noqa: E731
    for name in ("mu_K", "mu_V"):
        trs = [t.replace(**{name: mu()}) for t in _transforms(model)]
        refused = spec.attention_sinks or (name == "mu_K" and spec.attn_logit_softcap)
        if refused:
            why = "learned sink logits" if spec.attention_sinks else "logit softcap"
            with pytest.raises(ValueError, match=f"{name}.*{why}"):
                apply_transforms(model, trs, "centered")
            assert not any(hasattr(a, "wushkv_key") for a in attention_modules(model, spec))  # nothing half-installed
            continue
        with apply_transforms(model, trs):
            # 1e-5, not 1e-6: RMSNorms compute in float32 even in a float64 model, and OLMo-2 normalizes the attention
            # output itself (post-norm), where the shifted o_proj bias meets that rounding
            assert (model(ids).logits - ref).abs().max() < 1e-5, name


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_single_pass_equals_streaming(family, codec):
    """float64: the single-pass emulation of a prefill equals token-by-token streaming and mixed chunks (1e-5), with
    quantization really seen; the cache holds the same bytes either way."""
    cfg = CODECS[codec]
    model = tiny_model(family).double()
    ids = torch.randint(3, 96, (1, 34), generator=torch.Generator().manual_seed(0))  # past the sliding window of 16, 2 tiles
    name = "kvarn" if cfg.key_quantizer == "kvarn" else "random"
    with apply_transforms(model, _transforms(model, name), name) as inst:
        single, c1 = _stream(model, ids, cfg, [34], inst.cache_inputs)
        tokenwise, c2 = _stream(model, ids, cfg, [1] * 34, inst.cache_inputs)
        chunked, c3 = _stream(model, ids, cfg, [7, 1, 13, 2, 11], inst.cache_inputs)
        ref = model(ids).logits
    assert (single - tokenwise).abs().max() < 1e-5
    assert (single - chunked).abs().max() < 1e-5
    assert (single - ref).abs().max() > 1e-2  # quantization is really seen
    assert c1.nbytes() == c2.nbytes() == c3.nbytes() and c1.nbytes()["codes"] > 0


@pytest.mark.parametrize("codec", ["quest", "key-tiles"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
@torch.no_grad()
def test_left_padded_rows_equal_each_alone(family, codec):
    """Each row of a left-padded batch gets, at its real tokens, what it gets alone (float64, 1e-6; prefill then
    decode): per-token codes share a store, key tiles keep a layer per row."""
    model = tiny_model(family).double()
    cfg = CODECS[codec]
    g = torch.Generator().manual_seed(3)
    lengths, steps = [30, 23], 6
    rows = [torch.randint(3, 96, (1, n), generator=g) for n in lengths]
    ids, mask = left_padded(rows)
    nxt = torch.randint(3, 96, (2, steps), generator=g)
    name = "kvarn" if cfg.key_quantizer == "kvarn" else "random"
    with apply_transforms(model, _transforms(model, name), name) as inst:
        batch = padded_prefill_then_decode(model, inst.cache(cfg, attention_mask=mask), ids, mask, nxt)
        for b, r in enumerate(rows):
            alone, _ = _stream(model, torch.cat([r, nxt[b : b + 1]], 1), cfg, [r.shape[1]] + [1] * steps, inst.cache_inputs)
            n = r.shape[1] + steps
            assert (batch[b, -n:] - alone[0]).abs().max() < 1e-6, b


@pytest.mark.parametrize("family", ALL_FAMILIES)
@torch.no_grad()
def test_greedy_generate_through_the_cache(family):
    """generate() through the quantized cache (float32, the kernels' path) gives the greedy continuation of the
    same model fed token by token through a cache, and the 8-bit cache (unclipped where clipping does not pay)
    keeps stock generate's tokens."""
    model = tiny_model(family)
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(5))
    cfg = CODECS["quest"]
    with apply_transforms(model, _transforms(model)) as inst:
        out = model.generate(ids, cache=inst.cache(cfg), max_new_tokens=10, do_sample=False, pad_token_id=0)
        seq, cache = ids, inst.cache(cfg)
        logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(10):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = model(nxt, cache=cache, use_cache=True).logits[:, -1]
    assert out.shape == (1, 34) and torch.equal(out, seq)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_calibrate_install_and_refuse_another_family(family, tmp_path):
    """A real (small) calibration of the family: its WUSH transforms install and give finite logits; the file loads
    for the model it was made on and is refused, naming the family, for a model of another family."""
    from wushkv.calibration import calibrate

    model = tiny_model(family)
    text = tmp_path / "c.txt"
    text.write_text(TINY_CALIBRATION_TEXT)
    cal = calibrate(model, CharTokenizer(), samples=2, seq_len=48, text_file=str(text), show_progress=False)
    assert len(cal.stats) == describe(model).num_layers
    path = cal.save(tmp_path / "c.safetensors")
    loaded = Calibration.load(path, model)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    methods = ["wush", "wush+rmean"] + ([] if describe(model).attention_sinks or describe(model).attn_logit_softcap else ["wush-c"])
    for method in methods:
        with apply_transforms(model, transforms_for(model, loaded, parse(method)), method) as inst:
            logits, _ = _stream(model, ids, CODECS["quest"], [20, 1, 1, 8], inst.cache_inputs)
        assert torch.isfinite(logits).all(), method
    other = next(f for f in ALL_FAMILIES if _model_type(f) != _model_type(family) and f != "mistral")
    with pytest.raises(CalibrationError, match=f"family: file '{_model_type(family)}' vs model '{_model_type(other)}'"):
        Calibration.load(path, tiny_model(other))


@pytest.mark.parametrize("family", ["gpt2", "bloom", "falcon_mamba"])
def test_unsupported_families_are_named(family):
    """A family wushkv does not support is refused by name, with the list of supported ones."""
    import transformers

    cfg = transformers.AutoConfig.for_model(family, vocab_size=64, num_hidden_layers=1, hidden_size=32, n_embd=32,
                                            num_attention_heads=2, n_head=2)
    with pytest.raises(UnsupportedModelError, match=rf"unsupported architecture '{family}'.*'gpt_oss'.*'lfm2'.*'qwen3_moe'"):
        describe(cfg)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_pre_rope_key_mean_matches_slow_reference(family):
    """The RoPE wushkv reads off the model (rope_parameters) is the one the model applies: post-RoPE keys rotated
    back by their position (the calibration's mu_K_pre) average to the keys taken before RoPE at the key projection
    (its key rows of a fused QKV, through the key norm per head or over the projection). On a layer without RoPE the
    two means are the same; elsewhere they differ."""
    from wushkv.calibration import collect_statistics, pre_rope_key_mean

    model = tiny_model(family).double()
    spec = describe(model)
    seqs = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    stats = collect_statistics(model, seqs, show_progress=False)
    ref = pre_rope_key_mean(model, seqs, show_progress=False)
    for l, st in enumerate(stats):
        torch.testing.assert_close(st["mu_K_pre"], ref[l], rtol=1e-5, atol=1e-6)
        assert torch.allclose(st["mu_K_pre"], st["mu_K"], atol=1e-3) == (l in spec.nope_layers), l


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_command_runs_on_the_family(family, tmp_path, capsys):
    """The commands a user runs, on a tiny saved model of the family with a real tokenizer: calibrate, ppl, compare,
    recon, generate, agree, passkey and export finish and report finite numbers (quantization error visible)."""
    import json
    import math

    from wushkv.cli import main

    from conftest import hf_char_tokenizer

    model = tiny_model(family, vocab_size=128, max_position_embeddings=1024)
    m = tmp_path / "m"
    model.save_pretrained(m)
    hf_char_tokenizer().save_pretrained(m)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cal = tmp_path / "c.safetensors"
    win = ["--sink", "4", "--keep", "8", "--flush", "4"]
    methods = "wush,hadamard" + ("" if describe(model).attention_sinks or describe(model).attn_logit_softcap else ",wush-c")
    runs = [
        ["info", str(m)],
        ["info", str(m), "--json"],
        ["calibrate", "--model", str(m), "--samples", "2", "--seq-len", "64", "--calib-text-file", str(text), "--out", str(cal)],
        ["ppl", "--model", str(m), "--transform", "wush", "--calibration", str(cal), "--text-file", str(text), "--chunks", "1",
         "--seq-len", "128", *win, "--json", str(tmp_path / "ppl.json")],
        ["compare", "--model", str(m), "--transforms", methods, "--calibration", str(cal), "--text-file", str(text),
         "--chunks", "1", "--seq-len", "128", "--bits", "2", *win, "--json", str(tmp_path / "compare.json")],
        ["recon", "--model", str(m), "--calibration", str(cal), "--transforms", "wush,hadamard", "--bits", "2",
         "--samples", "1", "--seq-len", "64", "--text-file", str(text), "--json", str(tmp_path / "recon.json")],
        ["generate", "--model", str(m), "--calibration", str(cal), "--transform", "wush", "--prompt", "the quick brown fox ",
         "--max-new-tokens", "12", *win],
        ["agree", "--model", str(m), "--calibration", str(cal), "--transforms", "wush", "--prompts", "1", "--prompt-len", "40",
         "--new-tokens", "6", "--stride", "1", "--text-file", str(text), *win, "--json", str(tmp_path / "agree.json")],
        ["passkey", "--model", str(m), "--calibration", str(cal), "--transforms", "wush", "--contexts", "300", "--depths", "0.5",
         "--trials", "1", *win, "--json", str(tmp_path / "passkey.json")],
        ["export", "--calibration", str(cal), "--transform", "wush", "--out", str(tmp_path / "wush.safetensors")],
    ]
    for argv in runs:
        assert main(argv) == 0, argv[0]
        capsys.readouterr()
    ppl = json.loads((tmp_path / "ppl.json").read_text())
    compare = json.loads((tmp_path / "compare.json").read_text())
    finite = [v for v in json.dumps([ppl, compare]).replace("[", " ").replace("]", " ").replace(",", " ").split() if v == "NaN"]
    assert not finite, "NaN in results"
    rows = compare["results"]
    fp = rows["full-precision"]["ppl"] if "full-precision" in rows else None
    for name in methods.split(","):
        ppl_2 = rows[name]["2"]["ppl"] if "2" in rows[name] else rows[name]["ppl"]
        assert math.isfinite(ppl_2) and (fp is None or ppl_2 != fp), (name, rows[name])
    assert (tmp_path / "wush.safetensors").stat().st_size > 0


def test_partial_rotary_refuses_the_rotating_mean_by_its_reason(tmp_path):
    """A RoPE over part of the head (Phi-4-mini's partial_rotary_factor): every method runs but the rotating key mean,
    which is refused with the real reason (not as an old calibration file)."""
    from wushkv.calibration import calibrate

    model = tiny_model("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    text = tmp_path / "c.txt"
    text.write_text(TINY_CALIBRATION_TEXT)
    cal = calibrate(model, CharTokenizer(), samples=2, seq_len=48, text_file=str(text), show_progress=False)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    with apply_transforms(model, transforms_for(model, cal, parse("wush")), "wush") as inst:
        assert torch.isfinite(_stream(model, ids, CODECS["quest"], [20, 1, 9], inst.cache_inputs)[0]).all()
    with pytest.raises(UnsupportedModelError, match="rotates 16 of the 32 dims"):
        transforms_for(model, cal, parse("wush+rmean"))
