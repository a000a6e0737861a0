"""Bit allocation at a fixed average budget: more bits where quantization hurts most (issue #9).

Sensitivity of one (layer, side) at width ``b``: the increase of the mean next-token NLL on
calibration text when only that layer's keys (or values) are quantized at ``b`` bits and everything
else stays in full precision, measured through the same single-pass emulation as perplexity
(windows and quantizer of ``base``). Nothing here looks at the evaluation text.

Allocation (:func:`allocate_bits`): every (layer, side) starts at ``low`` bits; the ones whose
upgrade to ``high`` bits buys the largest NLL drop, s(low) − s(high), are upgraded until the mean
width over all (layer, side) pairs reaches the budget. Every pair stores the same number of
elements per token (same head count and head_dim in every layer) and the same metadata per token,
so the mean width is the mean of the stored bits per element.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..cache import WushKVCache
from ..config import CACHE_BITS, QuantConfig
from ..models import describe
from ..progress import progress
from .perplexity import perplexity

SIDES = ("key", "value")


def allocate_bits(sensitivity: dict, low: int, high: int, budget: float) -> list[tuple[int, int]]:
    """Per-layer ``(k_bits, v_bits)`` with mean width ``budget`` (rounded to whole upgrades).

    ``sensitivity``: ``{"key": {b: [ΔNLL per layer]}, "value": {b: [...]}}`` holding ``low`` and ``high``.
    Ties go to the earlier layer, keys before values (deterministic).
    """
    if low not in CACHE_BITS or high not in CACHE_BITS or not low < high:
        raise ValueError(f"need low < high among {list(CACHE_BITS)}, got low={low!r}, high={high!r}")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not (low <= budget <= high):
        raise ValueError(f"budget {budget!r} must be a mean width between low={low} and high={high}")
    gains = []
    for side in SIDES:
        s = {int(b): v for b, v in sensitivity[side].items()}  # JSON keys are strings
        for b in (low, high):
            if b not in s:
                raise ValueError(f"sensitivity of {side}s lacks width {b}; it has {sorted(s)}")
        lo, hi = s[low], s[high]
        if len(lo) != len(hi):
            raise ValueError(f"sensitivity of {side}s: {len(lo)} layers at {low} bits, {len(hi)} at {high}")
        for layer, (a, c) in enumerate(zip(lo, hi)):
            if not (math.isfinite(a) and math.isfinite(c)):
                raise ValueError(f"sensitivity of layer {layer} {side}s is not finite ({a}, {c})")
            gains.append((a - c, layer, side))
    L = len(gains) // 2
    if sum(g[2] == "key" for g in gains) != L:
        raise ValueError("keys and values have sensitivities for different numbers of layers")
    upgrades = round((budget - low) / (high - low) * 2 * L)
    order = sorted(range(len(gains)), key=lambda i: (-gains[i][0], i))
    alloc = {(layer, side): low for layer in range(L) for side in SIDES}
    for i in order[:upgrades]:
        _, layer, side = gains[i]
        alloc[(layer, side)] = high
    return [(alloc[(layer, "key")], alloc[(layer, "value")]) for layer in range(L)]


def random_allocation(num_layers: int, low: int, high: int, budget: float, seed: int = 0) -> list[tuple[int, int]]:
    """The control: as many upgrades as :func:`allocate_bits` would make, on pairs drawn at random."""
    g = torch.Generator().manual_seed(seed)
    fake = {side: {low: torch.rand(num_layers, generator=g).tolist(), high: [0.0] * num_layers} for side in SIDES}
    return allocate_bits(fake, low, high, budget)


def mean_bits(alloc: list[tuple[int, int]]) -> float:
    return sum(k + v for k, v in alloc) / (2 * len(alloc))


def allocation_configs(base: QuantConfig, alloc: list[tuple[int, int]]) -> list[QuantConfig]:
    """One :class:`QuantConfig` per layer (what :class:`wushkv.cache.WushKVCache` takes as ``config``)."""
    return [replace(base, k_bits=k, v_bits=v) for k, v in alloc]


@torch.no_grad()
def layer_sensitivity(model, chunks: torch.Tensor, base: QuantConfig, widths=(2, 3), show_progress: bool = True,
                      done: dict | None = None, on_result=None, inputs=None) -> dict:
    """``{"fp_nll", "key": {b: [ΔNLL per layer]}, "value": {...}}`` on ``chunks`` (calibration text).

    Install the transform first (:func:`wushkv.folding.apply_transforms`) and pass its handle's ``cache_inputs`` as
    ``inputs`` when the method rounds with error feedback or centers keys on their rotating mean. ``done`` holds
    results of an earlier, interrupted call (same layout), which are kept; ``on_result(partial)`` is called after
    each measurement (for resumable runs).
    """
    L = describe(model).num_layers
    out = {"fp_nll": None, "key": {}, "value": {}} if done is None else dict(done)
    for side in SIDES:  # JSON round trips turn the widths into strings
        out[side] = {int(b): list(v) for b, v in out.get(side, {}).items()}
    fp_cfg = replace(base, k_bits=None, v_bits=None)
    if out["fp_nll"] is None:
        out["fp_nll"] = perplexity(model, chunks, cache_factory=lambda: WushKVCache(model, [fp_cfg] * L, inputs=inputs), show_progress=False)["nll"]
    todo = [(side, b, layer) for side in SIDES for b in widths for layer in range(L)
            if len(out[side].get(b, [])) <= layer]
    for side, b, layer in progress(todo, desc="sensitivity", enabled=show_progress, unit="eval"):
        cfgs = [fp_cfg] * L
        cfgs[layer] = replace(base, k_bits=b if side == "key" else None, v_bits=b if side == "value" else None)
        nll = perplexity(model, chunks, cache_factory=lambda: WushKVCache(model, cfgs, inputs=inputs), show_progress=False)["nll"]
        out[side].setdefault(b, []).append(nll - out["fp_nll"])
        if on_result is not None:
            on_result(out)
    return out
