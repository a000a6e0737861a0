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
    from ..methods.spec import AUTO, UnknownMethodError, grammar_help, parse, spec_of
    from ..transforms import TRANSFORMS

    for t in transforms:
        if not tiles:
            if t not in TRANSFORMS:
                raise ValueError(f"unknown transform {t!r}; known: {sorted(TRANSFORMS)}")
            continue
        try:
            m = parse(t)
        except UnknownMethodError:
            raise ValueError(f"unknown transform {t!r}; {grammar_help()}") from None
        if not (m is AUTO and auto):  # auto: the calling command resolves it per model, quantizer and width
            spec_of(m)  # a wushkv method (auto refused, saying which commands resolve it)


def check_methods_list(s: str, auto: bool = False) -> list[str]:
    """The comma-separated method names of ``s``, checked and canonical (results are keyed by the canonical name);
    with ``auto``, ``auto`` too (see :func:`resolve_auto`)."""
    from ..methods.spec import AUTO, canonical_name, parse, spec_of

    names = [canonical_name(t.strip()) for t in s.split(",") if t.strip()]
    if not names:
        raise ValueError(f"no methods in {s!r}; give comma-separated method names such as hadamard,wush")
    for n in names:
        if parse(n) is AUTO and not auto:
            spec_of(n)  # raises, saying which commands resolve auto
    return names


def check_recon_transforms(names: Sequence[str]) -> None:
    """``recon`` measures transforms under one per-token quantizer, each token rounded alone: no tile or
    error-feedback methods."""
    from ..methods.spec import spec_of

    check_transforms(names)
    if any(spec_of(n).key_layout == "tiles" for n in names):
        raise ValueError(f"recon measures transforms under --quantizer; tile methods (+tiles, +ktiles, kvarn) bring their own quantizer: "
                         f"drop them from --transforms (got {list(names)})")
    if any(spec_of(n).feedback for n in names):
        raise ValueError(f"recon rounds every token independently; error-feedback methods (+ldlq) are measured by ppl, "
                         f"compare, agree and passkey: drop them from --transforms (got {list(names)})")


def load_calibration(path: str | None, model):
    """The calibration file at ``path`` for ``model``; None without a path."""
    from ..calibration import Calibration

    return Calibration.load(path, model) if path else None


def calibration_for(model, tokenizer, transforms: Sequence[str], path: str | None = None, samples: int = 16,
                    seq_len: int = 2048, log=print):
    """The calibration file at ``path``, or else a cached calibration of ``samples`` x ``seq_len`` tokens when a
    calibrated transform is asked for (attention-aware statistics when one needs them); None otherwise."""
    from ..methods.spec import MethodSpec, parse
    from .compare import cached_calibration

    methods = [parse(t) for t in transforms]  # full precision and stock caches need none; auto needs one
    check_transforms([t for t, m in zip(transforms, methods) if isinstance(m, MethodSpec)])
    if path:
        return load_calibration(path, model)
    if any(m.needs_calibration for m in methods):
        wush_a = any(isinstance(m, MethodSpec) and m.uses_wush_a for m in methods)
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
    from ..methods.auto import auto_calibration_note
    from ..runs import as_json
    from ..methods.auto import resolve_auto as resolve
    from ..methods.install import transforms_for
    from ..methods.spec import AUTO_NAME

    if AUTO_NAME not in methods:
        return {}, {}
    r = resolve(model_name, cal, cfg)
    r.config  # checks the method against the quantizer,
    transforms_for(model, cal, r.method)  # and against what the calibration holds, before anything long runs
    log(f"auto: {r.describe()} at {cfg.label()} ({r.why})")
    if note := auto_calibration_note(model_name, cal, cfg):
        log(note)
    # the configured quantization with the recipe's settings; the method's own layout is applied where it runs
    # (``why`` is recorded, not compared on resume: :func:`wushkv.runs.reconcile_settings`)
    return {AUTO_NAME: (r.method.name, r.base)}, {"auto": {"method": r.method.name, "quantization": as_json(r.base.to_dict()), "why": r.why}}


def calibration_recipe_of(cal) -> dict | None:
    """What a calibration's results depend on (its metadata less the date, timing and version); None for none."""
    from ..calibration import calibration_recipe

    return calibration_recipe(cal.meta if cal is not None else None)
