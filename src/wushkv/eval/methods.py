"""Transitional names over :mod:`wushkv.methods` (removed once every caller uses :class:`~wushkv.methods.MethodSpec`)."""

from __future__ import annotations

from ..config import QuantConfig
from ..methods.auto import AUTO_AFFINE_RECIPES, AUTO_CALIBRATION, AUTO_RECIPES, Recipe, auto_calibration_note, describe_resolved  # noqa: F401
from ..methods.auto import generation_method as _generation_method
from ..methods.auto import has_rope_mean as _has_rope_mean  # noqa: F401
from ..methods.auto import resolve_auto
from ..methods.install import feedback_hessians, method_cache, mix_sides, transforms_for, with_feedback, with_sign_pattern  # noqa: F401
from ..methods.spec import (  # noqa: F401
    AUTO_NAME as AUTO,
    FULL_PRECISION_NAME as FULL_PRECISION,
    SIDES_SEP,
    SIGNED_TRANSFORMS,
    STOCK_BACKENDS,
    MethodSpec,
    StockCache,
    parse,
    spec_of,
)

TILES_SUFFIX, KTILES_SUFFIX, LDLQ_SUFFIX, RMEAN_SUFFIX, SIGNS_SUFFIX = "+tiles", "+ktiles", "+ldlq", "+rmean", "+signs"
LDLQ_SIDES = {LDLQ_SUFFIX: "KV", "+ldlq-k": "K", "+ldlq-v": "V"}


def _spec(name) -> MethodSpec | None:
    m = parse(name)
    return m if isinstance(m, MethodSpec) else None


def method_transform(name: str) -> str:
    m = _spec(name)
    return name if m is None else (m.key_transform if m.key_transform == m.value_transform else f"{m.key_transform}{SIDES_SEP}{m.value_transform}")


def method_sides(name: str) -> tuple[str, str]:
    return spec_of(name).sides


def ldlq_sides(name: str) -> str:
    m = _spec(name)
    return "" if m is None else m.feedback


def uses_ldlq(name: str) -> bool:
    return bool(ldlq_sides(name))


def uses_rmean(name: str) -> bool:
    m = _spec(name)
    return m is not None and m.rope_mean


def uses_tiles(name: str) -> bool:
    m = _spec(name)
    return m is not None and m.tiles


def uses_key_tiles(name: str) -> bool:
    m = _spec(name)
    return m is not None and m.key_tiles


def sign_pattern(name: str) -> int | None:
    m = _spec(name)
    return None if m is None else m.signs


def is_transform_method(name: str) -> bool:
    try:
        return _spec(name) is not None
    except ValueError:
        return False


def uses_wush_a(name: str) -> bool:
    m = _spec(name)
    return m is not None and m.uses_wush_a


def needs_calibration(name: str) -> bool:
    return parse(name).needs_calibration


def parse_stock(name: str) -> tuple[str, int] | None:
    if not name.startswith("stock-"):
        return None
    m = parse(name)
    return m.backend, m.bits


def check_methods(names: list[str]) -> None:
    for n in names:
        if parse(n).name == AUTO:
            spec_of(n)  # raises: auto is resolved per model and width


def generation_method(calibration, cfg: QuantConfig) -> str:
    return _generation_method(calibration, cfg).name


def auto_method(model_key: str | None, calibration, cfg: QuantConfig) -> tuple[str, QuantConfig]:
    r = resolve_auto(model_key, calibration, cfg)
    return r.method.name, r.config
