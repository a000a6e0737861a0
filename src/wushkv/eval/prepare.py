"""What an evaluation needs before it starts, checked before anything long runs: known method names, the
calibration, a clip table, what ``auto`` stands for. The commands of :mod:`wushkv.cli` call these; they raise
``ValueError``/``FileNotFoundError`` with messages that name the command-line options."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config import QuantConfig


def check_transforms(transforms: Sequence[str], tiles: bool = True, auto: bool = False) -> None:
    """Known transforms; with ``tiles``, also ``<transform>+tiles`` (the transform under KVarN's tile quantizer)
    and the other method suffixes; with ``auto``, also ``auto`` (the calling command resolves it per model,
    quantizer and width)."""
    from ..transforms import TRANSFORMS
    from .methods import AUTO, KTILES_SUFFIX, LDLQ_SUFFIX, SIDES_SEP, TILES_SUFFIX, check_methods, is_transform_method

    for t in transforms:
        if t == AUTO:
            if not auto:
                check_methods([t])  # raises, saying which commands resolve auto
            continue
        if not (is_transform_method(t) if tiles else t in TRANSFORMS):
            also = (f", each optionally with the suffix {TILES_SUFFIX!r} (KVarN's tile quantizer), {KTILES_SUFFIX!r} (keys in "
                    f"KVarN's tiles), {LDLQ_SUFFIX!r} "
                    f"(error-feedback rounding) or +signsN (WUSH's N-th eigenvector sign pattern), or KEYS{SIDES_SEP}VALUES "
                    f"(e.g. wush{SIDES_SEP}hadamard: keys of one, values of the other)"
                    + (f", or {AUTO!r} (the WUSH variant chosen on held-out C4 for the model, quantizer and width)" if auto else "")) if tiles else ""
            raise ValueError(f"unknown transform {t!r}; known: {sorted(TRANSFORMS)}{also}")
        if tiles:
            check_methods([t])


def check_methods_list(s: str, auto: bool = False) -> list[str]:
    """The comma-separated method names of ``s``, checked; with ``auto``, ``auto`` too (see :func:`resolve_auto`)."""
    from .methods import AUTO, check_methods

    names = [t.strip() for t in s.split(",") if t.strip()]
    check_methods([n for n in names if not (auto and n == AUTO)])
    return names


def check_recon_transforms(names: Sequence[str]) -> None:
    """``recon`` measures transforms under one per-token quantizer, each token rounded alone: no tile or
    error-feedback methods."""
    from .methods import KTILES_SUFFIX, LDLQ_SUFFIX, TILES_SUFFIX, uses_key_tiles, uses_ldlq, uses_tiles

    check_transforms(names)
    if any(uses_tiles(n) or uses_key_tiles(n) for n in names):
        raise ValueError(f"recon measures transforms under --quantizer; tile methods ({TILES_SUFFIX}, {KTILES_SUFFIX}, kvarn) bring their own quantizer: "
                         f"drop them from --transforms (got {list(names)})")
    if any(uses_ldlq(n) for n in names):
        raise ValueError(f"recon rounds every token independently; error-feedback methods ({LDLQ_SUFFIX}) are measured by ppl, "
                         f"compare, agree and passkey: drop them from --transforms (got {list(names)})")


def load_calibration(path: str | None, model):
    """The calibration file at ``path`` for ``model``; None without a path."""
    from ..calibration import Calibration

    return Calibration.load(path, model) if path else None


def calibration_for(model, tokenizer, transforms: Sequence[str], path: str | None = None, samples: int = 16,
                    seq_len: int = 2048, log=print):
    """The calibration file at ``path``, or else a cached calibration of ``samples`` x ``seq_len`` tokens when a
    calibrated transform is asked for (attention-aware statistics when one needs them); None otherwise."""
    from .compare import cached_calibration
    from .methods import AUTO, needs_calibration, uses_wush_a

    check_transforms([t for t in transforms if t != AUTO])  # a command that takes auto has resolved or refused it
    if path:
        return load_calibration(path, model)
    if any(needs_calibration(t) for t in transforms):
        wush_a = any(uses_wush_a(t) for t in transforms)
        return cached_calibration(model, tokenizer, samples, seq_len, wush_a=wush_a, log=log)
    return None


def check_clips(path: str | None, cfg: QuantConfig | None) -> bool | None:
    """Fail fast on ``--clips`` with settings it cannot apply to; True if a table is to be loaded (None without
    ``path``). ``cfg``: the run's quantization (None: a full-precision run)."""
    if not path:
        return None
    if cfg is None:
        raise ValueError("--clips needs a quantized run (--transform)")
    if cfg.quantizer != "quest":
        raise ValueError(f"--clips holds QuEST clip multipliers; got --quantizer {cfg.quantizer!r}")
    if (cfg.k_alpha, cfg.v_alpha) != (1.0, 1.0):
        raise ValueError("give either --clips or --k-alpha/--v-alpha, not both")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--clips {path} does not exist (make one with `wushkv tune-clip --out {path}`)")
    return True


def check_heldout_calibration(cal) -> None:
    """``tune-clip`` on the held-out C4 text: refuse a calibration that read into it."""
    from ..calibration import calibration_documents
    from ..data import HELDOUT_C4_FIRST

    if cal is None:
        return
    used = calibration_documents(cal.meta)
    if used is not None and used > HELDOUT_C4_FIRST:
        raise ValueError(f"the calibration read C4 documents 0..{used - 1}, past {HELDOUT_C4_FIRST} where the held-out C4 text "
                         "starts: pass a held-out --text-file")


def resolve_auto(model_name: str, methods: Sequence[str], model, cal, cfg: QuantConfig, log=print) -> tuple[dict, dict]:
    """For ``agree`` and ``passkey``: ``({"auto": (method, its cfg)}, {"auto": what it resolved to})`` when ``auto``
    is listed (the second goes into the run's settings, so a resumed run refuses rows of another resolution),
    else two empty dicts. Says what it resolved to through ``log``."""
    from ..runs import as_json
    from .compare import config_for
    from .methods import AUTO, auto_calibration_note, auto_method, describe_resolved, transforms_for

    if AUTO not in methods:
        return {}, {}
    method, c = auto_method(model_name, cal, cfg)
    config_for(method, c)  # checks the method against the quantizer,
    transforms_for(model, cal, method)  # and against what the calibration holds, before anything long runs
    log(f"auto: {describe_resolved(method, c)} (chosen on held-out C4 for {model_name}, {cfg.label()})")
    if note := auto_calibration_note(model_name, cal):
        log(note)
    return {AUTO: (method, c)}, {"auto": {"method": method, "quantization": as_json(c.to_dict())}}


def calibration_recipe_of(cal) -> dict | None:
    """What a calibration's results depend on (its metadata less the date, timing and version); None for none."""
    from ..calibration import calibration_recipe

    return calibration_recipe(cal.meta if cal is not None else None)
