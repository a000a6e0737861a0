"""Bit allocation: the budget is met exactly, the most sensitive pairs get the bits, sensitivities are
what they claim (ΔNLL of one quantized layer side), and a per-layer allocation is really stored."""

import json
import math

import pytest
import torch

from conftest import tiny_model
from wushkv.eval.allocation import SIDES, allocate_bits, allocation_configs, layer_sensitivity, mean_bits, random_allocation
from wushkv.cache import WushKVCache
from wushkv.config import QuantConfig, WindowConfig
from wushkv.eval.perplexity import perplexity


def _sens(key_lo, key_hi, val_lo, val_hi):
    return {"key": {2: key_lo, 3: key_hi}, "value": {2: val_lo, 3: val_hi}}


def test_allocation_meets_the_budget_and_upgrades_the_largest_gains():
    # gains s(2) - s(3): keys [0.5, 0.1, 0.9, 0.0], values [0.3, 0.8, 0.2, 0.05]
    sens = _sens([0.6, 0.2, 1.0, 0.1], [0.1, 0.1, 0.1, 0.1], [0.4, 0.9, 0.3, 0.15], [0.1, 0.1, 0.1, 0.1])
    assert allocate_bits(sens, 2, 3, 2.0) == [(2, 2)] * 4
    assert allocate_bits(sens, 2, 3, 3.0) == [(3, 3)] * 4
    a = allocate_bits(sens, 2, 3, 2.25)  # 2 upgrades of 8: key 2 (0.9) and value 1 (0.8)
    assert a == [(2, 2), (2, 3), (3, 2), (2, 2)] and mean_bits(a) == 2.25
    a = allocate_bits(sens, 2, 3, 2.5)  # + key 0 (0.5), value 0 (0.3)
    assert a == [(3, 3), (2, 3), (3, 2), (2, 2)] and mean_bits(a) == 2.5
    # JSON round trip (string widths) gives the same allocation
    assert allocate_bits(json.loads(json.dumps(sens)), 2, 3, 2.5) == a
    # ties: earlier layer, keys before values
    flat = _sens([1.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4)
    assert allocate_bits(flat, 2, 3, 2.25) == [(3, 2), (3, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("budget", [2.25, 2.5, 2.75])
def test_random_allocation_has_the_same_budget(budget):
    a = random_allocation(30, 2, 4, budget, seed=3)
    assert len(a) == 30 and mean_bits(a) == pytest.approx(budget, abs=1 / 60)
    assert a == random_allocation(30, 2, 4, budget, seed=3) != random_allocation(30, 2, 4, budget, seed=4)


def test_allocation_errors():
    sens = _sens([0.1], [0.0], [0.1], [0.0])
    with pytest.raises(ValueError, match="budget 3.5 must be a mean width between low=2 and high=3"):
        allocate_bits(sens, 2, 3, 3.5)
    with pytest.raises(ValueError, match="need low < high"):
        allocate_bits(sens, 3, 3, 3.0)
    with pytest.raises(ValueError, match="lacks width 4"):
        allocate_bits(sens, 2, 4, 3.0)
    with pytest.raises(ValueError, match="not finite"):
        allocate_bits(_sens([math.nan], [0.0], [0.1], [0.0]), 2, 3, 2.5)


@torch.no_grad()
def test_sensitivity_is_the_nll_increase_of_one_quantized_layer_side():
    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (2, 96), generator=torch.Generator().manual_seed(0))
    base = QuantConfig(windows=WindowConfig(4, 16, 4))
    seen = []
    sens = layer_sensitivity(model, chunks, base, widths=(2, 8), show_progress=False, on_result=lambda o: seen.append(1))
    L = model.config.num_hidden_layers
    assert len(seen) == 2 * 2 * L
    # the all-full-precision cache is the plain model
    assert sens["fp_nll"] == pytest.approx(perplexity(model, chunks, show_progress=False)["nll"], abs=1e-6)
    for side in SIDES:
        assert len(sens[side][2]) == len(sens[side][8]) == L
        # 8 bits barely moves the NLL; 2 bits moves it far more (a random model: either sign)
        assert all(abs(x) < 1e-4 for x in sens[side][8])
        assert sum(map(abs, sens[side][2])) > 5 * sum(map(abs, sens[side][8]))
    # one entry by hand: layer 1 values at 2 bits, everything else full precision
    cfgs = [QuantConfig(k_bits=None, v_bits=None, windows=base.windows)] * L
    cfgs[1] = QuantConfig(k_bits=None, v_bits=2, windows=base.windows)
    nll = perplexity(model, chunks, cache_factory=lambda: WushKVCache(model, cfgs), show_progress=False)["nll"]
    assert sens["value"][2][1] == pytest.approx(nll - sens["fp_nll"], abs=1e-9)
    # resuming from a partial, JSON-round-tripped result gives the same numbers
    part = json.loads(json.dumps({"fp_nll": sens["fp_nll"], "key": {2: sens["key"][2], 8: sens["key"][8][:1]}, "value": {}}))
    again = layer_sensitivity(model, chunks, base, widths=(2, 8), show_progress=False, done=part)
    for side in SIDES:
        for b in (2, 8):
            assert again[side][b] == pytest.approx(sens[side][b], abs=1e-9)


@torch.no_grad()
def test_per_layer_allocation_is_stored_at_its_widths():
    model = tiny_model("llama")
    alloc = [(2, 3), (4, 2), (3, 3)]
    cfgs = allocation_configs(QuantConfig(windows=WindowConfig(0, 0, 4)), alloc)
    cache = WushKVCache(model, cfgs)
    model(torch.randint(3, 96, (1, 64)), cache=cache, use_cache=True)
    H, d = model.config.num_key_value_heads, model.config.head_dim
    for layer, (k, v) in zip(cache.layers, alloc):
        nb = layer.nbytes()
        # 64 tokens quantized; codes packed at each side's width (d * bits / 8 bytes per token and head)
        assert nb["codes"] == 64 * H * (d * k // 8 + d * v // 8)
