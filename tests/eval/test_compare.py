"""Methods of the comparison table: ``<transform>+tiles``, resuming a run from its JSON."""

import json
import math
from dataclasses import replace

import pytest
import torch

from conftest import tiny_model
from wushkv.config import QuantConfig, WindowConfig
from wushkv.eval.compare import quantized_perplexity, run_compare
from wushkv.methods import AUTO, parse, spec_of
from wushkv.methods.install import transforms_for
from wushkv.methods.spec import KVARN_TILE, key_tile_windows
from wushkv.methods.spec import method_config as config_for


def check_methods(names):
    for n in names:
        if parse(n) is AUTO:
            spec_of(n)


def method_transform(name):
    return parse(name).key_transform


def uses_tiles(name):
    return parse(name).tiles


def uses_key_tiles(name):
    return parse(name).key_tiles


def test_tiles_suffix_names_a_transform_and_the_tile_quantizer():
    base = QuantConfig(k_bits=3, v_bits=2, quantizer="quest", windows=WindowConfig(16, 128, 16))
    assert method_transform("wush+tiles") == "wush" and method_transform("wush") == "wush"
    assert uses_tiles("kvarn") and uses_tiles("identity+tiles") and not uses_tiles("wush")
    for name in ("kvarn", "wush+tiles", "hadamard+tiles"):
        c = config_for(name, base)
        assert (c.quantizer, c.k_bits, c.v_bits) == ("kvarn", 3, 2)
        assert (c.windows.S_sink, c.windows.S_keep, c.windows.S_flush) == (KVARN_TILE, 0, KVARN_TILE)
    assert config_for("wush", base) == base
    check_methods(["wush+tiles", "oscar+tiles", "full-precision"])
    with pytest.raises(ValueError, match="unknown method 'bogus\\+tiles'.*\\+tiles"):
        check_methods(["bogus+tiles"])


@torch.no_grad()
def test_hadamard_plus_tiles_is_kvarn_and_the_transform_matters():
    """KVarN ships as Hadamard + tiles: the two names give the same perplexity; another transform
    under the same tiles gives another (the transform is really installed)."""
    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (2, 300), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ppl = {m: quantized_perplexity(model, chunks, None, m, config_for(m, QuantConfig(k_bits=2, v_bits=2)), show_progress=False)["ppl"]
           for m in ("kvarn", "hadamard+tiles", "identity+tiles")}
    assert ppl["hadamard+tiles"] == pytest.approx(ppl["kvarn"], rel=1e-6)
    assert abs(ppl["identity+tiles"] / ppl["kvarn"] - 1) > 1e-4
    after = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(after[k], v) for k, v in before.items())  # every method restored the weights


@torch.no_grad()
def test_compare_resumes_whatever_the_transform_list(tmp_path):
    """A finished (transform, bits) is reused by a later run that lists other transforms or widths;
    a file from other chunks or quantizer settings is refused and left as it was."""

    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(1))
    base = QuantConfig(windows=WindowConfig(4, 16, 4))
    path = tmp_path / "c.json"
    first = run_compare(model, None, chunks, None, ["hadamard"], [2], base, json_path=path, meta={"transforms": ["hadamard"], "bits": [2]},
                        show_progress=False, log=lambda m: None)
    logged = []
    second = run_compare(model, None, chunks, None, ["identity", "hadamard"], [2], base, json_path=path,
                         meta={"transforms": ["identity", "hadamard"], "bits": [2]}, show_progress=False, log=logged.append)
    assert [m.split()[0] for m in logged if " PPL " in m and "over full precision" in m] == ["identity"]  # only the new method ran
    calls = []
    assert second["results"]["hadamard"]["2"] == first["results"]["hadamard"]["2"]
    assert json.loads(path.read_text())["settings"]["transforms"] == ["identity", "hadamard"]
    calls.clear()
    kept = path.read_text()
    with pytest.raises(ValueError, match=r"other settings \(differing: base\)"):
        run_compare(model, None, chunks, None, ["hadamard"], [2], replace(base, k_alpha=1.1), json_path=path, show_progress=False,
                    log=calls.append)
    with pytest.raises(ValueError, match=r"differing: chunks"):
        run_compare(model, None, torch.cat([chunks, chunks]), None, ["hadamard"], [2], base, json_path=path, show_progress=False,
                    log=calls.append)
    assert not [m for m in calls if " PPL " in m] and path.read_text() == kept  # refused before anything ran; the file is untouched
    # the same calibration recipe made again (another date and timing) resumes; another recipe is refused
    from types import SimpleNamespace

    recipe = {"model": "m", "samples": 4, "damping": 0.01}
    quiet = dict(json_path=path, show_progress=False, log=calls.append)
    run_compare(model, None, chunks, SimpleNamespace(meta=recipe | {"date": "d1", "seconds": 1.0}), ["hadamard"], [2], base, **quiet)
    run_compare(model, None, chunks, SimpleNamespace(meta=recipe | {"date": "d2", "seconds": 2.0}), ["hadamard"], [2], base, **quiet)
    assert not [m for m in calls if " PPL " in m] and json.loads(path.read_text())["settings"]["calibration"]["date"] == "d2"
    with pytest.raises(ValueError, match=r"differing: calibration"):
        run_compare(model, None, chunks, SimpleNamespace(meta=recipe | {"damping": 0.1}), ["hadamard"], [2], base, **quiet)
    with pytest.raises(ValueError, match=r"differing: text_sha256"):  # other text of the same shape
        run_compare(model, None, chunks.flip(1), None, ["hadamard"], [2], base, **quiet)
    with pytest.raises(ValueError, match=r"differing: dtype"):
        run_compare(model, None, chunks, None, ["hadamard"], [2], base, meta={"dtype": "bfloat16"}, **quiet)
    # a file from before dtype and the text's hash were recorded resumes
    stored = json.loads(path.read_text())
    del stored["settings"]["text_sha256"], stored["sha256"]  # nor the file's checksum
    path.write_text(json.dumps(stored))
    run_compare(model, None, chunks, None, ["hadamard"], [2], base, meta={"dtype": "float32"}, **quiet)
    assert not [m for m in calls if " PPL " in m]


def test_paired_difference_and_margins():
    from wushkv.eval.compare import margins, paired_difference

    b = [2.0, 2.5, 3.0, 2.2]
    d, lo, hi = paired_difference([x + 0.01 for x in b], b)  # a constant shift: no spread at all
    assert d == pytest.approx(100 * (math.exp(0.01) - 1)) and lo == pytest.approx(d) and hi == pytest.approx(d)
    a = [x + s for x, s in zip(b, [0.02, -0.01, 0.03, 0.0])]
    d, lo, hi = paired_difference(a, b)
    assert lo < d < hi and lo > 100 * (math.exp(-0.01) - 1) - 1e-9 and hi < 100 * (math.exp(0.03) - 1) + 1e-9
    d2, lo2, hi2 = paired_difference(b, a)
    assert d2 == pytest.approx(100 * (math.exp(-math.log1p(d / 100)) - 1))
    with pytest.raises(ValueError, match="paired chunks"):
        paired_difference([1.0], [1.0, 2.0])
    nll = lambda xs: {"ppl": math.exp(sum(xs) / len(xs)), "chunk_nll": xs}  # noqa: E731
    out = {"results": {"x": {"2": nll(a)}, "y": {"2": nll(b)}, "z": {"2": {"ppl": 99.0}, "3": {"ppl": 5.0}}}}
    m = margins(out, ["x", "y", "z"], [2, 3])
    assert list(m) == [2] and m[2]["best"] == "y" and m[2]["second"] == "x"
    assert m[2]["delta_pct"] == pytest.approx(d2) and m[2]["ci"][0] < m[2]["delta_pct"] < m[2]["ci"][1]
    out["results"]["y"]["2"].pop("chunk_nll")  # results of older versions: no interval
    assert margins(out, ["x", "y"], [2])[2]["ci"] is None
    one = {"results": {"x": {"2": nll([2.1])}, "y": {"2": nll([2.0])}}}  # one chunk: no interval
    assert margins(one, ["x", "y"], [2])[2]["ci"] is None


@torch.no_grad()
def test_compare_auto_runs_the_models_recipe_at_each_width(tiny_cal):
    """``auto`` in compare runs the calibration's selected recipe at each width: the same perplexity as naming that
    method at its settings, and the entry records which method it was and why."""
    from wushkv.methods.auto import selection_setting

    model = tiny_model("llama")
    cal = tiny_cal(model)
    base = QuantConfig(windows=WindowConfig(4, 16, 4))
    cal.set_selection({"setting": selection_setting(base), "choices": {"2": {"recipe": "wush+ldlq-v"}, "3": {"recipe": "wush@ka=1.2"}}})
    chunks = torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(2))
    quiet = {"show_progress": False, "log": lambda m: None}
    out = run_compare(model, None, chunks, cal, ["auto", "wush+ldlq-v"], [2, 3], base, meta={"model": "tiny"}, **quiet)
    auto, named = out["results"]["auto"], out["results"]["wush+ldlq-v"]
    assert auto["2"]["method"] == "wush+ldlq-v" and auto["2"]["ppl"] == pytest.approx(named["2"]["ppl"], rel=1e-9)
    assert auto["3"]["method"] == "wush" and auto["3"]["config"]["k_alpha"] == pytest.approx(1.2)
    assert auto["2"]["why"].startswith("selected by `wushkv select`") and "wush+ldlq-v" not in out["results"]["wush+ldlq-v"]["2"].get("why", "")
    direct = quantized_perplexity(model, chunks, cal, "wush", replace(base, k_bits=3, v_bits=3, k_alpha=1.2), show_progress=False)
    assert auto["3"]["ppl"] == pytest.approx(direct["ppl"], rel=1e-9)


@torch.no_grad()
def test_tile_clip_reaches_the_cache_and_keeps_the_bytes():
    """``tile_clip`` changes what the tiles store (another perplexity), not how much (same bytes)."""
    from wushkv.cache import WushKVCache
    from wushkv.folding import apply_transforms

    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 300), generator=torch.Generator().manual_seed(3))
    base = config_for("kvarn", QuantConfig(k_bits=2, v_bits=2))
    clipped = replace(base, tile_clip=1.3)
    assert clipped.quantizer == "kvarn" and config_for("wush+tiles", replace(QuantConfig(), tile_clip=1.3)).tile_clip == 1.3
    ppl = [quantized_perplexity(model, chunks, None, "kvarn", c, show_progress=False)["ppl"] for c in (base, clipped)]
    assert abs(ppl[1] / ppl[0] - 1) > 1e-4
    sizes = []
    for c in (base, clipped):
        with apply_transforms(model, transforms_for(model, None, "kvarn"), "kvarn"):
            cache = WushKVCache(model, c)
            model(chunks, cache=cache, use_cache=True)
            sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] and sizes[0]["codes"] > 0


def test_key_tiles_put_the_keys_in_tiles_at_the_same_average_full_precision_tokens():
    """``+ktiles``: keys in KVarN's tiles, values with the configured per-token quantizer, under windows that hold
    as many full-precision tokens on average (over a period of both flush grids) as the configured ones."""

    for w, want in ((WindowConfig(16, 128, 16), (16, 72, 128)), (WindowConfig(64, 256, 8), (64, 196, 128))):
        kw = key_tile_windows(w)
        assert (kw.S_sink, kw.S_keep, kw.S_flush) == want
        fp = [sum(n - x.quantized_count(n) for n in range(4096, 4096 + 2 * KVARN_TILE)) for x in (w, kw)]
        assert fp[0] == fp[1]
        assert key_tile_windows(kw) == kw
    assert key_tile_windows(WindowConfig(0, 8, 4)).S_keep == 0  # never negative
    base = QuantConfig(k_bits=2, v_bits=3, quantizer="quest", tile_clip=1.3, windows=WindowConfig(16, 128, 16))
    c = config_for("wush+ktiles+ldlq-v", base)
    assert uses_key_tiles("wush+ktiles+ldlq-v") and not uses_key_tiles("wush+tiles") and not uses_tiles("wush+ktiles")
    assert (c.side_quantizer("key"), c.side_quantizer("value"), c.tile_clip) == ("kvarn", "quest", 1.3)
    assert (c.windows.S_sink, c.windows.S_keep, c.windows.S_flush) == (16, 72, 128)
    assert "Kkvarn/Vquest clip1.3" in c.label()
    check_methods(["wush+ktiles", "wush+ktiles+ldlq-v", "hadamard+ktiles", "wush+ktiles+ldlq", "wush+ktiles+ldlq-k"])
    with pytest.raises(ValueError, match="keys in KVarN's tiles"):
        check_methods(["wush+tiles+ktiles"])
    with pytest.raises(ValueError, match="per token.*quest or affine, got 'kivi'"):
        config_for("wush+ktiles", replace(base, quantizer="kivi"))
    with pytest.raises(ValueError, match="unknown key quantizer 'bogus'"):
        replace(base, key_quantizer="bogus")


@torch.no_grad()
def test_key_tiles_store_tiles_for_keys_and_tokens_for_values():
    """A ``+ktiles`` cache holds KVarN tiles for the keys (one scale/zero per channel and tile, one fold scale per
    token) and QuEST codes for the values (one step per token), and its perplexity differs from both parents'."""
    from wushkv.cache import WushKVCache
    from wushkv.folding import apply_transforms

    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 300), generator=torch.Generator().manual_seed(4))
    base = QuantConfig(k_bits=2, v_bits=2, windows=WindowConfig(4, 16, 4))
    cfg = config_for("hadamard+ktiles", base)
    with apply_transforms(model, transforms_for(model, None, "hadamard"), "hadamard"):
        cache = WushKVCache(model, cfg)
        model(chunks, cache=cache, use_cache=True)
    layer = cache.layers[0]
    keys, values = layer.k_side.store.view(), layer.v_side.store.view()
    assert set(keys) == {"codes", "scale", "zero", "s_fold"} and set(values) == {"codes", "scale"}
    n = keys["codes"].shape[2]
    assert n > 0 and n % KVARN_TILE == 0 and values["codes"].shape[2] == n
    assert keys["scale"].shape[2] == n // KVARN_TILE and values["scale"].shape[2] == n
    ppl = {m: quantized_perplexity(model, chunks, None, m, config_for(m, base), show_progress=False)["ppl"]
           for m in ("hadamard", "hadamard+ktiles", "kvarn")}
    assert len({round(p, 6) for p in ppl.values()}) == 3
