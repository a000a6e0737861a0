"""A method installed on a model: its per-layer transforms, and a factory of caches for it.

:func:`transforms_for` builds what :func:`wushkv.folding.apply_transforms` installs for a :class:`MethodSpec`
(from the calibration, or built for calibration-free transforms); :func:`method_cache` installs any method
(full precision and stock caches too) for the duration of a ``with`` block.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from ..calibration import cover_positions, why_not_covered
from ..config import QuantConfig
from ..folding import apply_transforms
from ..models import describe, rope_parameters
from ..quantizers.feedback import feedback_matrix
from ..transforms import TRANSFORMS, LayerTransforms, build_transforms
from ..transforms.wush import with_signs
from .spec import FULL_PRECISION, SIGNED_TRANSFORMS, Method, MethodSpec, StockCache, parse, spec_of


def mix_sides(keys: list[LayerTransforms], values: list[LayerTransforms]) -> list[LayerTransforms]:
    """Per-layer transforms with the key side (T_K, its inverse, μ_K) of ``keys`` and the value side
    (T_V, its inverse, μ_V) of ``values``."""
    return [LayerTransforms(**k.side("K"), **v.side("V")) for k, v in zip(keys, values, strict=True)]


def feedback_hessians(calibration, method: MethodSpec) -> list[dict]:
    """Per layer, the Hessians the cache's error feedback weighs keys and values by: the calibration's
    H_K and H_V (WUSH-A's attention-aware ones for a ``wush-a`` side), [Hkv, d, d] float64."""
    ks, vs = method.sides
    keys = ("H_K_A" if ks == "wush-a" else "H_K", "H_V_A" if vs == "wush-a" else "H_V")
    out = []
    for st in calibration.stats:
        missing = [k for k in keys if k not in st]
        if missing:
            raise ValueError(f"method {method.name!r} needs calibration statistics {missing} for its error feedback; recalibrate")
        out.append({"K": st[keys[0]], "V": st[keys[1]]})
    return out


def with_feedback(trs: list[LayerTransforms], hessians: list[dict], damping: float = 0.01, sides: str = "KV") -> list[LayerTransforms]:
    """Add ``F_K``/``F_V`` (for ``sides``) to per-layer transforms: the feedback matrices of the Hessians seen
    in the transformed space, T^{-T} H T⁻¹ (the cached vector is T x, its error e costs eᵀ T^{-T} H T⁻¹ e)."""
    out = []
    for tr, hs in zip(trs, hessians, strict=True):
        f = {}
        for s in sides:
            Ti = getattr(tr, f"T_{s}_inv").double()
            Hs = Ti.mT @ hs[s].double().to(Ti.device) @ Ti
            f[f"F_{s}"] = feedback_matrix(Hs, damping)
        out.append(tr.replace(**f))
    return out


def with_sign_pattern(trs: list[LayerTransforms], sides: tuple[str, str], pattern: int) -> list[LayerTransforms]:
    """Per-layer transforms with the ``pattern``-th random sign pattern on the eigenvectors of the sides
    (keys, values) whose transform is in :data:`SIGNED_TRANSFORMS` (the others unchanged). The draws go
    layer by layer, keys then values, from one generator seeded with ``pattern``, for every side alike,
    so a pattern is the same whichever sides it applies to."""
    gen = torch.Generator().manual_seed(int(pattern))
    out = []
    for tr in trs:
        new = {}
        for s, t in zip("KV", sides):
            T, T_inv = getattr(tr, f"T_{s}"), getattr(tr, f"T_{s}_inv")
            D = torch.randint(0, 2, T.shape[:-1], generator=gen).double() * 2 - 1
            if t in SIGNED_TRANSFORMS:
                new[f"T_{s}"], new[f"T_{s}_inv"] = with_signs(T, T_inv, D.to(T.device))
        out.append(tr.replace(**new))
    return out


def _plain(model, calibration, transform: str) -> list[LayerTransforms]:
    """One registered transform on both sides, per layer: the calibration's, or built when it needs none."""
    if calibration is not None:
        return calibration.transforms(transform)
    if TRANSFORMS[transform].needs_calibration:
        raise ValueError(f"transform {transform!r} needs a calibration (--calibration PATH)")
    spec = describe(model)
    return [build_transforms(transform, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]


def covered_calibration(model, calibration, positions: int):
    """``calibration`` with its key-space statistics covered to ``positions`` (``+coverN``;
    :func:`wushkv.calibration.cover_positions` with ``model``'s RoPE frequencies), kept on the calibration so that
    every method covered to the same length reads one copy. Refused, with what to do, where covering would not be
    what ``+coverN`` says: ``positions`` no longer than the calibration's sequences (nothing to cover), or a file
    already covered (covering twice averages twice; a file covered to exactly ``positions`` is returned as it is)."""
    if (why := why_not_covered(calibration.meta, positions)) is not None:
        raise ValueError(why)
    if calibration.meta.get("positions") is not None:  # covered to exactly ``positions`` already
        return calibration
    cache = calibration.derived.setdefault("covered", {})
    if positions not in cache:
        spec = describe(model)
        cache[positions] = cover_positions(calibration, [rope_parameters(model, l, spec) for l in range(spec.num_layers)], positions)
    return cache[positions]


def transforms_for(model, calibration, method: str | Method) -> list[LayerTransforms]:
    """Per-layer transforms of a method (:class:`~wushkv.transforms.LayerTransforms`: the four matrices and, as the
    method needs, ``F_K``/``F_V`` feedback matrices, ``mu_K_rope`` the pre-RoPE key mean [Hkv, d]).

    Built in this order: the statistics covered to the served positions (``+coverN``), each side's transform (the
    calibration's, or built for calibration-free ones), the sign pattern redrawn on the WUSH sides, the feedback
    matrices of the transforms so obtained, the rotating mean."""
    m = spec_of(method, "transforms_for")
    if m.cover is not None:
        if calibration is None:
            raise ValueError(f"method {m.name!r} covers calibration statistics to {m.cover} positions; it needs a calibration "
                             "(--calibration PATH)")
        return transforms_for(model, covered_calibration(model, calibration, m.cover), replace(m, cover=None))
    if m.rope_mean:
        if calibration is None:
            raise ValueError(f"method {m.name!r} centers keys on the calibration's pre-RoPE key mean; it needs a calibration (--calibration PATH)")
        if any("mu_K_pre" not in st for st in calibration.stats):
            for layer in range(describe(model).num_layers):  # a RoPE wushkv cannot read: say so, not "old file"
                rope_parameters(model, layer)
            raise ValueError(f"method {m.name!r} needs the pre-RoPE key mean (mu_K_pre), which this calibration file predates; "
                             "make a new one with `wushkv calibrate`, or add the mean to this file's statistics (same transforms) "
                             "with `wushkv calibration upgrade --calibration FILE --out NEW`")
        trs = transforms_for(model, calibration, replace(m, key_centering="none"))
        return [t.replace(mu_K_rope=st["mu_K_pre"].float()) for t, st in zip(trs, calibration.stats)]
    if m.feedback:
        if calibration is None:
            raise ValueError(f"method {m.name!r} rounds with error feedback from calibration Hessians; it needs a calibration (--calibration PATH)")
        trs = transforms_for(model, calibration, replace(m, feedback=""))
        return with_feedback(trs, feedback_hessians(calibration, m), calibration.meta.get("damping", 0.01), m.feedback)
    ks, vs = m.sides
    trs = _plain(model, calibration, ks) if ks == vs else mix_sides(_plain(model, calibration, ks), _plain(model, calibration, vs))
    return trs if m.signs is None else with_sign_pattern(trs, m.sides, m.signs)


@contextmanager
def method_cache(model, calibration, method: str | Method, cfg: QuantConfig):
    """Install a method on ``model`` for the duration; yields a factory of fresh caches. ``cfg`` is the configured
    quantization; a wushkv method runs at its :meth:`MethodSpec.quant_config` of it."""
    from transformers import DynamicCache

    m = parse(method)
    if m is FULL_PRECISION:
        yield lambda: DynamicCache(config=model.config)
    elif isinstance(m, StockCache):
        from transformers import QuantizedCache

        try:
            __import__("optimum.quanto" if m.backend == "quanto" else "hqq")
        except ImportError as e:
            raise ValueError(f"{m.name} needs the {m.backend} package: pip install 'wushkv[stock]' ({e})") from None
        yield lambda: QuantizedCache(backend=m.backend, config=model.config, nbits=m.bits)
    else:
        m = spec_of(m, "method_cache")
        c = m.quant_config(cfg)
        with apply_transforms(model, transforms_for(model, calibration, m), m.name) as installed:
            yield lambda: installed.cache(c)
