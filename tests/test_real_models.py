"""Smoke tests on a small slice of the real SmolLM2-135M (slow: loading takes ~30 s on 2 cores)."""

import pytest
import torch

from test_float32_paths import check_paths

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from wushkv.models import ModelNotInstalledError, load

    try:
        return load("smollm2-135m")
    except ModelNotInstalledError as e:  # only an absent package skips: a broken install or file fails
        pytest.skip(f"real model not installed: {e}")


@torch.no_grad()
def test_smollm2_wush_invariance_and_streaming(smollm2, tmp_path):
    from wushkv.cache import WushKVCache
    from wushkv.calibration import calibrate
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.data import wikitext2_test
    from wushkv.folding import apply_transforms
    from wushkv.models import describe

    model, tok = smollm2
    spec = describe(model)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    cal = calibrate(model, tok, samples=1, seq_len=256, show_progress=False)
    ids = tok(wikitext2_test()[:2000], return_tensors="pt").input_ids[:, :72]
    ref = model(ids).logits
    for method in ("wush", "oscar", "hadamard"):
        with apply_transforms(model, cal.transforms(method), method):
            assert (model(ids).logits - ref).abs().max() < 1e-3, method
    # Streaming decode through the real cache equals the single-pass emulation. In float64 every code
    # is decided the same way on both paths, so they agree to rounding.
    cfg = QuantConfig(2, 2, "quest", windows=WindowConfig(4, 16, 4))
    model.to(torch.float64)
    try:
        with apply_transforms(model, cal.transforms("wush"), "wush"):
            single = model(ids, cache=WushKVCache(model, cfg), use_cache=True).logits
            cache = WushKVCache(model, cfg)
            steps = [model(ids[:, :40], cache=cache, use_cache=True).logits]
            steps += [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(40, 72)]
            fp = model(ids).logits
    finally:
        model.to(torch.float32)
    assert float((single - fp).abs().max()) > 0.1  # 2-bit quantization is really seen
    assert float((single - torch.cat(steps, 1)).abs().max()) < 1e-5
    # float32, the path users run (fused decode kernels, fused SDPA): equal to float32 rounding except behind a
    # flipped code or float16 scale, the kernels really used, flips rare (tests/test_float32_paths.py). Logits
    # reach ~35 here; on an 80-token slice under Hadamard: 1.3e-4 at most where no code flipped (no code did; 6 of
    # 10800 float16 scales did), 1710 calls of each kernel.
    with apply_transforms(model, cal.transforms("wush"), "wush"):
        check_paths(model, ids, cfg, tight=5e-4, metadata_flip=2e-3)


def test_select_reproduces_smollm2s_recorded_2bit_choice_on_a_small_budget(smollm2):
    """The selection, on a small budget (a 4 x 512 calibration, one 1024-token chunk of held-out C4), still picks the
    recorded 2-bit recipe over the paper recipe, and `auto` then runs it from the calibration's own selection. (On the
    file's statistics, ``cover="no"``: the recorded recipes were chosen on them; the covered twins a 1024-token chunk
    would add have their own tests on tiny models.)"""
    from wushkv.calibration import calibrate
    from wushkv.config import PERPLEXITY_WINDOWS, QuantConfig
    from wushkv.data import heldout_c4_text, tokenize_chunks
    from wushkv.eval.select import run_selection, selection_record
    from wushkv.methods.auto import RECORDED, resolve_auto

    model, tok = smollm2
    recorded = next(r for r in RECORDED["smollm2-135m"] if r["setting"]["quantizer"] == "quest")["choices"]["2"]["recipe"]
    cal = calibrate(model, tok, samples=4, seq_len=512, show_progress=False)
    chunks = tokenize_chunks(tok, heldout_c4_text()[0], 1024, 1)
    base = QuantConfig(windows=PERPLEXITY_WINDOWS)
    out = run_selection(model, chunks, cal, ["wush", recorded], [2], base, cover="no", show_progress=False, log=lambda m: None)
    assert out["choices"]["2"]["recipe"] == recorded, out["results"]
    cal.set_selection(selection_record(out, "held-out C4"))
    got = resolve_auto("smollm2-135m", cal, QuantConfig(2, 2, windows=PERPLEXITY_WINDOWS))
    assert got.source == "calibration" and got.record()["recipe"] == recorded
