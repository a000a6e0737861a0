"""Method names: KEYS:VALUES takes each side from another transform."""

import pytest
import torch
from conftest import tiny_model

from wushkv.config import QuantConfig, WindowConfig
from wushkv.eval.compare import quantized_perplexity
from wushkv.methods import AUTO, MethodSpec, parse, spec_of
from wushkv.methods.install import transforms_for


def check_methods(names):
    """What every command does with a --transforms list: parse each name, refuse an unresolved auto."""
    for n in names:
        if parse(n) is AUTO:
            spec_of(n)


def config_for(name, base):
    return parse(name).quant_config(base)


def test_sides_of_a_method_name():
    assert parse("wush").sides == ("wush", "wush")
    assert parse("wush:hadamard").sides == ("wush", "hadamard")
    assert parse("wush:hadamard+tiles").sides == ("wush", "hadamard") and parse("wush:hadamard+tiles").tiles
    assert parse("hadamard:wush").needs_calibration and not parse("hadamard:random").needs_calibration
    check_methods(["wush:hadamard", "hadamard:oscar+tiles", "full-precision"])
    with pytest.raises(ValueError, match="KEYS:VALUES"):
        check_methods(["wush:nope"])
    with pytest.raises(ValueError, match="kvarn cannot be one side"):
        check_methods(["kvarn:wush"])


def test_keys_from_one_values_from_the_other():
    model = tiny_model("llama")
    had, rnd = transforms_for(model, None, "hadamard"), transforms_for(model, None, "random")
    mixed = transforms_for(model, None, "hadamard:random")
    for h, r, m in zip(had, rnd, mixed):
        assert torch.equal(m.T_K, h.T_K) and torch.equal(m.T_K_inv, h.T_K_inv)
        assert torch.equal(m.T_V, r.T_V) and torch.equal(m.T_V_inv, r.T_V_inv)
        assert not torch.equal(m.T_V, h.T_V)
    chunks = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    cfg = QuantConfig(2, 2, windows=WindowConfig(4, 16, 4))
    same = quantized_perplexity(model, chunks, None, "hadamard:hadamard", cfg, show_progress=False)["ppl"]
    assert same == quantized_perplexity(model, chunks, None, "hadamard", cfg, show_progress=False)["ppl"]
    with pytest.raises(ValueError, match="needs a calibration"):
        transforms_for(model, None, "hadamard:wush")


def test_ldlq_method_names_and_errors():
    from wushkv.codecs import make_codec
    assert parse("wush+ldlq") == MethodSpec("wush", feedback="KV") and parse("wush:hadamard+ldlq").feedback == "KV"
    assert [parse(n).feedback for n in ("wush+ldlq", "wush+ldlq-k", "wush+ldlq-v", "wush")] == ["KV", "K", "V", ""]
    with pytest.raises(ValueError, match="use one of"):
        check_methods(["wush+ldlq-k+ldlq-v"])
    assert parse("wush:hadamard+ldlq").sides == ("wush", "hadamard") and not parse("wush+ldlq").tiles
    assert parse("hadamard+ldlq").needs_calibration and not parse("hadamard").needs_calibration
    check_methods(["wush+ldlq", "hadamard:wush+ldlq"])
    for bad in ("wush+ldlq+tiles", "kvarn+ldlq"):
        with pytest.raises(ValueError, match="cannot be combined"):
            check_methods([bad])
    with pytest.raises(ValueError, match="needs a calibration"):
        transforms_for(tiny_model("llama"), None, "hadamard+ldlq")
    with pytest.raises(ValueError, match="per-token quantizer"):
        make_codec(QuantConfig(2, 2, "kivi", windows=WindowConfig(2, 4, 4)), "key", 32, torch.eye(32).expand(2, 32, 32))
    tiles = QuantConfig(2, 2, "kvarn", windows=WindowConfig(8, 0, 8))
    assert make_codec(tiles, "key", 32, torch.eye(32).expand(2, 32, 32)).feedback is not None  # key tiles take feedback
    with pytest.raises(ValueError, match="KVarN's key tiles, got 'kvarn' for the values"):
        make_codec(tiles, "value", 32, torch.eye(32).expand(2, 32, 32))
    with pytest.raises(ValueError, match="e.g. wush\\+ktiles\\+ldlq"):
        check_methods(["wush+tiles+ldlq"])
    check_methods(["wush+tiles+ldlq-k", "kvarn+ldlq-k"])  # both sides in tiles, feedback on the key tiles only
    c = config_for("wush+tiles+ldlq-k", QuantConfig(2, 2, "quest", windows=WindowConfig(16, 128, 16)))
    assert (c.side_quantizer("key"), c.side_quantizer("value")) == ("kvarn", "kvarn")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_ldlq_streaming_equals_single_pass(family, tiny_cal):
    """The cache rounds with feedback when it flushes; the single-pass emulation must see the same codes."""
    from wushkv.folding import apply_transforms
    from wushkv.quantizers.feedback import feedback_matrix

    model = tiny_model(family).double()
    cal = tiny_cal(model)
    trs = transforms_for(model, cal, "wush+ldlq")
    st, tr = cal.stats[0], trs[0]
    Ti = tr.T_K_inv.double()
    torch.testing.assert_close(tr.F_K, feedback_matrix(Ti.mT @ st["H_K"] @ Ti, cal.meta["damping"]))
    cfg = QuantConfig(2, 2, "quest", windows=WindowConfig(4, 8, 4))
    ids = torch.randint(3, 96, (1, 45), generator=torch.Generator().manual_seed(0))

    def run(method, sizes):
        with torch.no_grad(), apply_transforms(model, transforms_for(model, cal, method), method) as installed:
            cache, out, t = installed.cache(cfg), [], 0
            for n in sizes:
                out.append(model(ids[:, t : t + n], cache=cache, use_cache=True).logits)
                t += n
            return torch.cat(out, 1), cache.nbytes()

    assert tr.F_V is not None and transforms_for(model, cal, "wush+ldlq-k")[0].F_V is None
    assert transforms_for(model, cal, "wush+ldlq-v")[0].F_K is None
    single, nb = run("wush+ldlq", [45])
    tokenwise, nb2 = run("wush+ldlq", [1] * 45)
    plain, nb3 = run("wush", [45])
    assert (single - tokenwise).abs().max() < 1e-5
    assert (single - plain).abs().max() > 1e-4  # the feedback changes the codes
    assert nb == nb2 == nb3  # same storage


def test_key_tile_feedback_streaming_equals_single_pass(tiny_cal):
    """``+ktiles+ldlq``: the key tiles are rounded with feedback along their channels when a tile flushes; a prefill
    (the single-pass emulation for its logits) and token-by-token decoding give the same logits and key codes, and
    the storage is that of plain ``+ktiles``."""
    from wushkv.folding import apply_transforms

    model = tiny_model("llama").double()
    cal = tiny_cal(model)
    base = QuantConfig(2, 2, "quest", windows=WindowConfig(4, 16, 4))
    ids = torch.randint(3, 96, (1, 300), generator=torch.Generator().manual_seed(1))

    def run(method, sizes):
        cfg = config_for(method, base)
        with torch.no_grad(), apply_transforms(model, transforms_for(model, cal, method), method) as installed:
            cache, out, t = installed.cache(cfg), [], 0
            for n in sizes:
                out.append(model(ids[:, t : t + n], cache=cache, use_cache=True).logits)
                t += n
            keys = cache.layers[0].k_side.store.view()
            return torch.cat(out, 1), cache.nbytes(), keys

    single, nb, keys = run("wush+ktiles+ldlq", [300])
    streamed, nb2, keys2 = run("wush+ktiles+ldlq", [130] + [1] * 170)
    plain, nb3, keys3 = run("wush+ktiles", [300])
    assert keys["codes"].shape[2] == 256 and set(keys) == {"codes", "scale", "zero", "s_fold"}
    assert (single - streamed).abs().max() < 1e-5 and torch.equal(keys["codes"], keys2["codes"])
    assert not torch.equal(keys["codes"], keys3["codes"])  # the feedback changes the key codes
    assert nb == nb2 == nb3


def test_sign_pattern_names_and_errors():
    assert parse("wush+signs3") == MethodSpec("wush", signs=3)
    assert parse("wush:hadamard+signs12+ldlq-v") == MethodSpec("wush", "hadamard", feedback="V", signs=12)
    assert parse("wush+signs2+tiles").tiles and parse("wush+tiles+signs2").signs == 2 and parse("wush").signs is None
    check_methods(["wush+signs1", "hadamard:wush+signs2", "wush-a+signs3+ldlq"])
    for bad, match in (("hadamard+signs1", "has none"), ("kvarn+signs1", "has none"), ("wush+signs0", "numbered from 1"),
                       ("wush+signs1+signs2", "given twice")):
        with pytest.raises(ValueError, match=match):
            check_methods([bad])


def test_sign_patterns_are_exact_wush_solutions(tiny_cal):
    """+signsN: T' = (𝓗 D 𝓗ᵀ) T per WUSH side, still an exact inverse pair with the same constant diagonal
    of T M Tᵀ; other sides untouched; patterns differ; +ldlq's feedback is that of the new transforms."""
    from wushkv.quantizers.feedback import feedback_matrix
    from wushkv.transforms import hadamard_matrix

    model = tiny_model("llama").double()
    cal = tiny_cal(model)
    base, one, two = (transforms_for(model, cal, m) for m in ("wush", "wush+signs1", "wush+signs2"))
    Hd = hadamard_matrix(base[0].T_K.shape[-1], dtype=torch.float64)
    for b, s, t, st in zip(base, one, two, cal.stats):
        for side in "KV":
            T, Ti, T0 = getattr(s, f"T_{side}").double(), getattr(s, f"T_{side}_inv").double(), getattr(b, f"T_{side}").double()
            I = torch.eye(T.shape[-1], dtype=torch.float64)
            torch.testing.assert_close(T @ Ti, I.expand_as(T), atol=1e-5, rtol=0)
            D = Hd.mT @ (T @ torch.linalg.inv(T0)) @ Hd  # 𝓗ᵀ R 𝓗 = D, a ±1 diagonal
            torch.testing.assert_close(D, torch.diag_embed(torch.diagonal(D, dim1=-2, dim2=-1).round()), atol=1e-4, rtol=0)
            M = st[f"M_{side}"].double()
            Md = M + cal.meta["damping"] * (torch.diagonal(M, dim1=-2, dim2=-1).mean(-1))[..., None, None] * I  # M̃
            dg = lambda A, X: torch.diagonal(A @ X @ A.mT, dim1=-2, dim2=-1)  # noqa: E731
            torch.testing.assert_close(dg(T, Md), dg(T0, Md), rtol=1e-4, atol=1e-6)  # the same constant diagonal of T M̃ Tᵀ
            torch.testing.assert_close(dg(T, M).sum(-1), dg(T0, M).sum(-1), rtol=1e-6, atol=0)  # same trace: same expected error
            assert not torch.allclose(T, T0) and not torch.allclose(T, getattr(t, f"T_{side}").double())
    mixed = transforms_for(model, cal, "hadamard:wush+signs1")
    had = transforms_for(model, cal, "hadamard")
    assert torch.equal(mixed[0].T_K, had[0].T_K) and torch.equal(mixed[0].T_V, one[0].T_V)
    fb = transforms_for(model, cal, "wush+signs1+ldlq")[0]
    Ti = one[0].T_K_inv.double()
    torch.testing.assert_close(fb.F_K, feedback_matrix(Ti.mT @ cal.stats[0]["H_K"] @ Ti, cal.meta["damping"]))


def test_rmean_methods(tiny_cal):
    """``+rmean`` adds the calibration's pre-RoPE key mean to every layer's transforms; clear errors without it."""
    model = tiny_model("llama")
    cal = tiny_cal(model)
    assert parse("wush+rmean+ldlq") == MethodSpec("wush", feedback="KV", key_centering="rope-mean")
    assert parse("hadamard:wush+rmean").rope_mean
    assert parse("hadamard+rmean").needs_calibration and not parse("wush+rmean").tiles
    check_methods(["wush+rmean", "wush+rmean+tiles", "wush+rmean+ldlq"])
    trs = transforms_for(model, cal, "wush+rmean")
    plain = transforms_for(model, cal, "wush")
    for t, p, st in zip(trs, plain, cal.stats):
        torch.testing.assert_close(t.mu_K_rope, st["mu_K_pre"].float())
        torch.testing.assert_close(t.T_K, p.T_K)
    with pytest.raises(ValueError, match="needs a calibration"):
        transforms_for(model, None, "hadamard+rmean")
    for st in cal.stats:
        st.pop("mu_K_pre")
    with pytest.raises(ValueError, match="predates.*wushkv calibrate.*wushkv calibration upgrade"):
        transforms_for(model, cal, "wush+rmean")


def test_generation_method(tiny_cal):
    """``generate --transform auto``: centered WUSH keys with the affine quantizer when the calibration holds the
    pre-RoPE key mean; plain WUSH with another quantizer, without a calibration, or with a file that predates the mean."""
    from wushkv.methods.auto import generation_method

    model = tiny_model("llama")
    cal = tiny_cal(model)
    affine, quest = QuantConfig(quantizer="affine"), QuantConfig(quantizer="quest")
    assert generation_method(cal, affine).name == "wush+rmean"
    assert generation_method(cal, quest).name == "wush"
    assert generation_method(None, affine).name == "wush"
    cal.stats[-1].pop("mu_K_pre")  # one layer without the mean: the centered method could not run
    assert generation_method(cal, affine).name == "wush"


def test_auto_method_resolves_per_model_width_and_quantizer(tiny_cal):
    """``auto`` without a selection in the calibration: each shipped model's recorded QuEST recipe at K = V bits (its
    clip multipliers on top of the configured ones), the generation choice with the affine quantizer, the paper recipe
    elsewhere, each with why; the resolved settings are the method's own quantizer settings of the recipe-adjusted
    configuration."""
    from dataclasses import replace

    from wushkv.methods.auto import RECORDED, parse_recipe, resolve_auto

    model = tiny_model("llama")
    cal = tiny_cal(model)
    assert cal.selections == []
    for key, records in RECORDED.items():
        quest = [r for r in records if r["setting"]["quantizer"] == "quest"]
        assert len(quest) == 1 and set(quest[0]["choices"]) == {"2", "3", "4"} and len(quest[0]["calibration"]) == 2
        for b, choice in quest[0]["choices"].items():
            r = parse_recipe(choice["recipe"])
            assert r.name == choice["recipe"] and r.method.key_transform.startswith("wush")
            base = QuantConfig(int(b), int(b), quantizer="quest", k_alpha=1.1)
            got = resolve_auto(key, cal, base)
            c = got.config
            assert got.source == "recorded" and key in got.why and "chosen under quest 16/128/16" in got.why  # other windows: said
            assert got.method == r.method and c.k_alpha == pytest.approx(1.1 * r.k_alpha) and c.v_alpha == pytest.approx(r.v_alpha)
            assert (c.k_bits, c.v_bits, c.quantizer, c.tile_clip) == (int(b), int(b), "quest", r.tile_clip)
            assert c == r.method.quant_config(replace(base, k_alpha=1.1 * r.k_alpha, v_alpha=r.v_alpha, tile_clip=r.tile_clip))
    got = resolve_auto("smollm2-135m", cal, QuantConfig(2, 2, quantizer="quest", windows=WindowConfig(16, 128, 16)))
    c = got.config  # what compare and generate run: keys in clipped tiles, QuEST values under the +ktiles windows
    assert got.method.name == "wush+ktiles+ldlq" and (c.side_quantizer("key"), c.side_quantizer("value"), c.tile_clip) == ("kvarn", "quest", 3.0)
    assert (c.windows.S_sink, c.windows.S_keep, c.windows.S_flush) == (16, 72, 128)
    assert "chosen under" not in got.why and got.record()["recipe"] == "wush+ktiles+ldlq@tc=3"
    quest = QuantConfig(3, 2, quantizer="quest")
    got = resolve_auto("smollm2-135m", cal, quest)
    assert (got.method.name, got.config) == ("wush", quest) and "K = V" in got.why  # K ≠ V
    name = lambda key, cfg: resolve_auto(key, cal, cfg).method.name  # noqa: E731
    assert name("my-model", replace(quest, v_bits=3)) == "wush"  # a model without recipes
    assert "wushkv select --calibration" in resolve_auto("my-model", cal, replace(quest, v_bits=3)).why
    assert name("smollm2-135m", QuantConfig(8, 8, quantizer="quest")) == "wush"  # a width without one
    assert name("gemma3-270m", QuantConfig(2, 2, quantizer="affine")) == "wush+rmean"  # no affine recipe
    assert name("smollm2-135m", QuantConfig(3, 3, quantizer="affine")) == "wush+rmean"  # nor at 3 bits
    assert name("smollm2-135m", QuantConfig(2, 2, quantizer="kivi")) == "wush"
    with pytest.raises(ValueError, match="`compare`, `generate`, `agree` and `passkey` only"):
        check_methods(["auto"])  # ppl, sweep, tune-clip: name the method
    assert parse("auto") is AUTO and AUTO.needs_calibration


def test_auto_reads_the_calibrations_own_selection_first(tiny_cal, tmp_path):
    """A selection in the calibration file wins over a recorded one and the paper recipe, exactly at its setting or,
    said so, at the same quantizer's other windows; a recipe the calibration cannot run (+rmean without the pre-RoPE
    mean) falls through, with the reason; the selection survives the file's save and load."""
    from dataclasses import replace

    from wushkv.calibration import Calibration
    from wushkv.methods.auto import resolve_auto, selection_setting

    model = tiny_model("llama")
    cal = tiny_cal(model)
    q = QuantConfig(quantizer="quest", windows=WindowConfig(4, 16, 4))
    cal.set_selection({"setting": selection_setting(q), "text": "held.txt", "chunks": 4, "serve_len": 160, "rule": "lowest",
                       "choices": {"2": {"recipe": "wush+ldlq-v@ka=1.2", "why": "lowest"}, "3": {"recipe": "wush+rmean+ldlq"}}})
    cal.set_selection({"setting": selection_setting(QuantConfig(quantizer="affine")), "choices": {"2": {"recipe": "wush+ldlq"}}})
    cal.set_selection({"setting": selection_setting(q), "text": "held.txt", "chunks": 4, "serve_len": 160, "rule": "lowest",
                       "choices": {"2": {"recipe": "wush+ldlq-v@ka=1.2", "why": "lowest"}, "3": {"recipe": "wush+rmean+ldlq"}}})
    assert len(cal.selections) == 2  # one per setting: choosing again replaces
    path = cal.save(tmp_path / "c.safetensors")
    cal = Calibration.load(path, model)
    got = resolve_auto("smollm2-135m", cal, replace(q, k_bits=2, v_bits=2))  # over SmolLM2's recorded recipe
    assert (got.source, got.method.name, got.config.k_alpha) == ("calibration", "wush+ldlq-v", pytest.approx(1.2))
    assert "selected by `wushkv select` on held.txt (4 x 160 tokens, rule lowest): lowest" == got.why
    other = resolve_auto("my-model", cal, QuantConfig(2, 2, quantizer="quest", windows=WindowConfig(8, 16, 4)))
    assert other.method.name == "wush+ldlq-v" and "chosen under quest 4/16/4, this run is quest 8/16/4" in other.why
    assert resolve_auto("my-model", cal, QuantConfig(2, 2, quantizer="affine")).method.name == "wush+ldlq"
    got = resolve_auto("my-model", cal, replace(q, k_bits=3, v_bits=3))
    assert got.method.name == "wush+rmean+ldlq" and got.source == "calibration"  # the tiny calibration holds the mean
    for st in cal.stats:
        st.pop("mu_K_pre")
    got = resolve_auto("my-model", cal, replace(q, k_bits=3, v_bits=3))
    assert got.method.name == "wush" and "calibration selection wush+rmean+ldlq not run" in got.why


def test_auto_method_in_the_generation_setting(tiny_cal):
    """With the affine quantizer (generate, agree, passkey) ``auto`` takes the model's affine recipe at K = V bits: on
    SmolLM2 at 2 bits centered keys in clipped tiles with error feedback, affine values, under the +ktiles windows of
    64/256/8."""
    from wushkv.methods.auto import RECORDED, describe_resolved, parse_recipe, resolve_auto

    model = tiny_model("llama")
    cal = tiny_cal(model)
    for records in RECORDED.values():
        for rec in records:
            for b, choice in rec["choices"].items():
                assert parse_recipe(choice["recipe"]).method.key_transform.startswith("wush") and 2 <= int(b) <= 8
    affine = QuantConfig(2, 2, quantizer="affine", windows=WindowConfig(64, 256, 8))
    got = resolve_auto("smollm2-135m", cal, affine)
    m, c = got.method, got.config
    assert m.name == "wush+rmean+ktiles+ldlq" and c.tile_clip == 1.7 and (c.k_clip, c.v_clip) == (affine.k_clip, affine.v_clip)
    assert describe_resolved(m, c) == got.describe() == "wush+rmean+ktiles+ldlq (tile clip 1.7)"
    transforms_for(model, cal, m)  # the tiny calibration holds what it needs: the pre-RoPE mean and the Hessians
    assert (c.side_quantizer("key"), c.side_quantizer("value")) == ("kvarn", "affine")
    assert (c.windows.S_sink, c.windows.S_keep, c.windows.S_flush) == (64, 196, 128)
    assert resolve_auto("smollm2-135m", cal, QuantConfig(2, 4, quantizer="affine")).method.name == "wush+rmean"  # K ≠ V
    for st in cal.stats:  # a calibration made before the pre-RoPE mean was stored: the centered recipe cannot run
        st.pop("mu_K_pre")
    got = resolve_auto("smollm2-135m", cal, affine)
    assert (got.method.name, got.config) == ("wush", affine)
    assert describe_resolved("wush+ldlq", QuantConfig(2, 2, quantizer="quest", k_alpha=1.15, v_alpha=1.45)) == "wush+ldlq (αK×1.15 αV×1.45)"
    assert describe_resolved("wush", affine) == "wush"


def test_auto_calibration_note(tiny_cal):
    from types import SimpleNamespace

    from wushkv.methods.auto import auto_calibration_note, selection_setting

    same = SimpleNamespace(meta={"samples": 32, "seq_len": 2048}, selections=[])
    assert auto_calibration_note("smollm2-135m", same) is None
    assert auto_calibration_note("my-model", same) is None and auto_calibration_note("smollm2-135m", None) is None
    note = auto_calibration_note("gemma3-270m", same)
    assert "16 x 2048" in note and "32 x 2048" in note and "--samples 16" in note and "wushkv select" in note
    q = QuantConfig(quantizer="quest")
    own = SimpleNamespace(meta={"samples": 8, "seq_len": 512}, selections=[{"setting": selection_setting(q), "choices": {}}])
    assert auto_calibration_note("gemma3-270m", own, q) is None  # its own selection applies: no recorded one is used


