"""Method names: KEYS:VALUES takes each side from another transform."""

import pytest
import torch

from wushkv.config import QuantConfig, WindowConfig
from wushkv.eval.compare import quantized_perplexity
from wushkv.eval.methods import check_methods, method_sides, needs_calibration, transforms_for, uses_tiles

from conftest import tiny_model


def test_sides_of_a_method_name():
    assert method_sides("wush") == ("wush", "wush")
    assert method_sides("wush:hadamard") == ("wush", "hadamard")
    assert method_sides("wush:hadamard+tiles") == ("wush", "hadamard") and uses_tiles("wush:hadamard+tiles")
    assert needs_calibration("hadamard:wush") and not needs_calibration("hadamard:random")
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
        assert torch.equal(m["T_K"], h["T_K"]) and torch.equal(m["T_K_inv"], h["T_K_inv"])
        assert torch.equal(m["T_V"], r["T_V"]) and torch.equal(m["T_V_inv"], r["T_V_inv"])
        assert not torch.equal(m["T_V"], h["T_V"])
    chunks = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    cfg = QuantConfig(2, 2, windows=WindowConfig(4, 16, 4))
    same = quantized_perplexity(model, chunks, None, "hadamard:hadamard", cfg, show_progress=False)["ppl"]
    assert same == quantized_perplexity(model, chunks, None, "hadamard", cfg, show_progress=False)["ppl"]
    with pytest.raises(ValueError, match="needs a calibration"):
        transforms_for(model, None, "hadamard:wush")
