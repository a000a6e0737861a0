"""Methods: what a method is (:mod:`.spec`), what ``auto`` picks (:mod:`.auto`), and installing one (:mod:`.install`).

``spec`` and ``auto`` are pure descriptions (config and the transform registry only); ``install`` sits above the
cache and folding. Import from the submodules; this package re-exports the description names only, so that
importing it never loads the model-side code.
"""

from .auto import RECORDED, Recipe, Resolved, describe_resolved, parse_recipe, resolve_auto
from .spec import (
    AUTO,
    FULL_PRECISION,
    Auto,
    FullPrecision,
    Method,
    MethodSpec,
    StockCache,
    canonical_name,
    grammar_help,
    key_tile_windows,
    method_config,
    parse,
    spec_of,
)

__all__ = [
    "AUTO", "FULL_PRECISION", "Auto", "FullPrecision", "Method",
    "MethodSpec", "Recipe", "Resolved", "StockCache", "canonical_name", "describe_resolved", "grammar_help",
    "RECORDED", "key_tile_windows", "method_config", "parse", "parse_recipe", "resolve_auto", "spec_of",
]
