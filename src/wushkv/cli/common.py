"""What the commands share: argument types, the model arguments, and the quantizer arguments generated from
:class:`~wushkv.config.QuantConfig`'s fields (:func:`add_quant_args` and :func:`quant_config` are the two ends:
a new field needs one row in ``QUANT_HELP``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import typing

from ..config import METADATA_DTYPES, QuantConfig, WindowConfig


def err(message: str) -> None:
    """A progress or diagnostic line, on stderr (stdout carries the results)."""
    print(message, file=sys.stderr)


# -- argument types ---------------------------------------------------------------------------------
def bits(s: str) -> int | None:
    """One bit width; 16 (or fp, none) = full precision (None)."""
    if s.lower() in ("16", "fp", "none"):
        return None
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be one of 2, 3, 4, 8 or 16 (full precision), got {s!r}") from None


def bits_list(s: str) -> list[int]:
    """Comma-separated bit widths, e.g. ``2,3,4``."""
    try:
        out = [int(b) for b in s.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated bit widths such as 2,3,4, got {s!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"no widths in {s!r}; give comma-separated bit widths such as 2,3,4")
    twice = sorted({b for b in out if out.count(b) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"width {twice[0]} given twice in {s!r}; give each width once")
    return out


def windows_pair(s: str) -> tuple[int, int]:
    """``SINK,KEEP``, e.g. ``16,128``."""
    try:
        sink, keep = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SINK,KEEP such as 16,128, got {s!r}") from None
    if sink < 0 or keep < 1:
        raise argparse.ArgumentTypeError(f"expected SINK >= 0 and KEEP >= 1, got {s!r}")
    return sink, keep


def context_list(s: str) -> list[int]:
    """Comma-separated context lengths in tokens, ``k`` = 1024: ``1k,2k,4096`` -> [1024, 2048, 4096]."""
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        try:
            out.append(int(float(x[:-1]) * 1024) if x.endswith("k") else int(x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected contexts such as 1k,2k,4096, got {s!r}") from None
    return out


def at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (a count of prompts, trials, documents), else the flag's error."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {s!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {v}")
        return v

    return parse


def non_negative(s: str) -> float:
    """An argparse type: a finite float >= 0 (a tolerance)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {s!r}")
    return v


def device_name(s: str) -> str:
    """An argparse type: a torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``), as given."""
    import torch

    try:
        d = torch.device(s)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{s!r} is not a torch device; expected cpu, cuda, cuda:N or mps") from None
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise argparse.ArgumentTypeError(f"{s!r}: this torch ({torch.__version__}) sees no CUDA device (a CPU build, or "
                                             "none visible); use --device cpu, or install a CUDA build of torch")
        if d.index is not None and d.index >= n:
            raise argparse.ArgumentTypeError(f"{s!r}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    elif d.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{s!r}: no MPS device here; use --device cpu")
    return s


def names(s: str) -> list[str]:
    """The non-empty comma-separated names of ``s``."""
    return [t.strip() for t in s.split(",") if t.strip()]


# -- the files a command writes ---------------------------------------------------------------------
OUTPUT_FLAGS = ("json", "out", "markdown", "plot")  # dests whose value is a file the command writes
INPUT_FLAGS = ("calibration", "clips", "text_file", "calib_text_file", "config")  # dests whose value is a file it reads


def output_files(args) -> list[str]:
    """Every file the command of ``args`` writes: the values of its ``--json``, ``--out``, ``--markdown`` and
    ``--plot`` (a flag that is not a path, such as ``info --json``, is none), or what its parser declares with
    ``set_defaults(outputs=f)``, ``f(args)`` a list of paths (calibrate: PATH.json beside ``--out``; demo: none, its
    ``--out`` is a folder whose compare run locks its own files). ``cli.main`` holds the lock of each for the whole run
    (:func:`wushkv.io.exclusive_outputs`). Raises ``ValueError`` when two outputs are one file, or an output is a file
    the run reads (``--calibration``, ``--text-file``, ...): it would be overwritten before or while it is read."""
    from pathlib import Path

    declared = getattr(args, "outputs", None)
    flagged = [(f, v) for f in OUTPUT_FLAGS if isinstance(v := getattr(args, f, None), str)]
    named = flagged if declared is None else [(next((f for f, v in flagged if v == p), None), p) for p in declared(args)]
    seen: dict[Path, str] = {}
    folders = getattr(args, "folder_outputs", ())  # flags whose value is a folder the command writes (export-model --out)
    for flag, path in named:
        what = f"--{flag} {path}" if flag else path
        if not path.strip():
            raise ValueError(f"{'--' + flag if flag else 'an output'} is empty ({path!r}): give a file path")
        if Path(path).is_dir() and flag not in folders:  # found before the work, not when its result is written
            raise ValueError(f"{what} is a folder: give a file path (inside it, for instance)")
        key = Path(path).resolve()
        if key in seen:
            raise ValueError(f"{seen[key]} and {what} are one file: give each output its own path")
        seen[key] = what
    for flag in INPUT_FLAGS:
        src = getattr(args, flag, None)
        if isinstance(src, str) and Path(src).resolve() in seen:
            raise ValueError(f"{seen[Path(src).resolve()]} is also the --{flag.replace('_', '-')} the run reads: an output "
                             "must differ from the run's inputs (it would be overwritten)")
    return [p for _, p in named]


def refuse_overwriting_a_run(path: str | None, flag: str = "--json") -> None:
    """A command that writes its result once (ppl, recon, lm-eval) refuses ``path`` when it holds a resumable run
    (``compare``, ``agree``, ``passkey``, ``tune-clip``, ``merge``: an object with ``"settings"``), which may be hours
    of results; a file of its own kind, a damaged file or none is overwritten as before."""
    from pathlib import Path

    from ..io import read_json

    if not path or not Path(path).is_file():
        return
    try:
        held = read_json(path, flag)
    except ValueError:  # damaged: nothing a rerun could lose
        return
    if isinstance(held, dict) and isinstance(held.get("settings"), dict):
        raise ValueError(f"{flag} {path} holds a resumable run (compare, agree, passkey, tune-clip or merge results) that "
                         "this command would overwrite; give another path, or delete it")


# -- the model -------------------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser) -> None:
    from ..models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="smollm2-135m | gemma3-270m | a .gguf file, model folder or hub id (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu", type=device_name, help="torch device: cpu, cuda, cuda:N, mps (default: %(default)s)")
    p.add_argument("--device-map", default=None,
                   help="accelerate device map ('auto', 'balanced', ...): split a model too large for one device over several; "
                        "every layer must stay resident (no cpu/disk offload)")


def load_model(args, positions: dict[str, int] | None = None):
    """(model, tokenizer) of ``--model``, saying how long loading took. ``positions``: {flag: tokens} the run will
    reach, refused past the model's positions (:func:`refuse_past_positions`) before the weights load: from a GGUF's
    header or the config (:func:`wushkv.models.max_positions`, a second or two); and after, from the loaded config."""
    from ..models import load, max_positions

    if positions:
        limit = max_positions(args.model)
        for flag, n in positions.items():
            refuse_past_positions(limit, n, flag, args.model)
    t0 = time.perf_counter()
    model, tok = load(args.model, dtype=args.dtype, device=args.device, device_map=getattr(args, "device_map", None))
    err(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s")
    for flag, n in (positions or {}).items():  # a GGUF that states no context length gets its class's default here
        refuse_past_positions(getattr(model.config, "max_position_embeddings", None), n, flag, args.model)
    return model, tok


def refuse_past_positions(limit: int | None, n: int, flag: str, name: str) -> None:
    """Refuse sequences of ``n`` tokens past the ``limit`` positions the model was trained for
    (``max_position_embeddings``; None: no limit stated): its rotary embedding and attention are untested there, so a
    result would say nothing about the cache."""
    if isinstance(limit, int) and n > limit:
        raise ValueError(f"{flag} {n} is past the {limit} positions {name} was trained for (max_position_embeddings); "
                         f"give {flag} <= {limit}")


def add_calibration_args(p: argparse.ArgumentParser, help: str | None = "calibration file; default: calibrate once and cache") -> None:
    """``--calibration`` and, for a calibration made on the fly, ``--calib-samples``/``--calib-seq-len``."""
    p.add_argument("--calibration", default=None, help=help)
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=2048)


def calibration(args, model, tok, transforms):
    """The ``--calibration`` file, or a cached calibration when a calibrated transform is asked for."""
    from ..eval.prepare import calibration_for

    return calibration_for(model, tok, transforms, path=args.calibration, samples=args.calib_samples,
                           seq_len=args.calib_seq_len, log=err)


# -- the quantizer, from QuantConfig's fields ------------------------------------------------------------
# field -> (flag name or None for --field-name, argparse keywords besides type/default). A QuantConfig field that
# is neither here nor in NO_FLAG fails tests/test_cli.py::test_every_quant_field_has_a_flag.
QUANT_HELP: dict[str, tuple[str | None, dict]] = {
    "k_bits": (None, {"type": bits, "help": "key bits: 2, 3, 4, 8 (16 = full precision) (default: %(default)s)"}),
    "v_bits": (None, {"type": bits, "help": "value bits (default: %(default)s)"}),
    "quantizer": (None, {"help": "quest | affine | kivi | kvarn (default: %(default)s)"}),
    "key_quantizer": (None, {"metavar": "Q", "help": "the keys' quantizer when it is not --quantizer, e.g. kvarn: keys per channel in "
                             "KVarN's tiles of --flush tokens, values per token (the +ktiles methods set this and their windows themselves)"}),
    "k_clip": (None, {"help": "affine key clip ratio κ_K (default: %(default)s)"}),
    "v_clip": (None, {"help": "affine value clip ratio κ_V (default: %(default)s)"}),
    "k_alpha": (None, {"help": "QuEST key clip multiplier on α_b (default: %(default)s)"}),
    "v_alpha": (None, {"help": "QuEST value clip multiplier on α_b (default: %(default)s)"}),
    "clip_search": (None, {"metavar": "N", "help": "quest/affine: each token picks the clip of least squared error among N+1 candidates "
                           "(same bytes; 0 = the fixed clip) (default: %(default)s)"}),
    "tile_clip": (None, {"metavar": "M", "help": "kvarn, +tiles and +ktiles: quantize each tile row over its mean ± M·α_b·σ instead of its "
                         "min-max (same bytes; 0 = KVarN as published) (default: %(default)s)"}),
    "group_size": (None, {"help": "channels per quantization group (default: head_dim)"}),
    "metadata_dtype": (None, {"choices": METADATA_DTYPES, "help": "stored scales: float16, bfloat16, float32, or e5m3 (QuEST sides: "
                              "one byte per step, codes rounded on the rounded step; smaller cells) (default: %(default)s)"}),
}
# WindowConfig's fields: their flags and help (the defaults are each command's windows)
WINDOW_HELP: dict[str, tuple[str, str]] = {
    "S_sink": ("--sink", "S_sink full-precision first tokens (default: %(default)s)"),
    "S_keep": ("--keep", "S_keep full-precision recent tokens (default: %(default)s)"),
    "S_flush": ("--flush", "S_flush tokens quantized per flush (default: %(default)s)"),
}
NO_FLAG = {"windows": "one flag per WindowConfig field (WINDOW_HELP)", "version": "the file format's, not a setting"}


def _flag_type(field: dataclasses.Field, hints: dict):
    """The argparse type of a field: its annotation less ``None`` (``int | None`` -> int)."""
    t = hints[field.name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t


def quant_fields() -> list[dataclasses.Field]:
    """QuantConfig's fields that have a flag, in the dataclass's order (the order of the flags in --help)."""
    return [f for f in dataclasses.fields(QuantConfig) if f.name in QUANT_HELP]


def _dest(field: str, flag: str | None) -> str:
    return (flag or "--" + field.replace("_", "-")).lstrip("-").replace("-", "_")


GIVEN = "given_settings"  # the Namespace attribute: {setting: (flag, value)} of the quantizer flags on the command line


class _Given(argparse.Action):
    """Stores the value as ``store`` does, and notes the setting as given on the command line: a default value given
    explicitly is given too, which comparing values cannot tell (:func:`refuse_unread_settings`)."""

    def __init__(self, *args, setting: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.setting = setting

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, {**(getattr(namespace, GIVEN, None) or {}), self.setting: (option_string, values)})


def add_quant_args(p: argparse.ArgumentParser, windows: WindowConfig) -> None:
    """One flag per quantizer field of QuantConfig (default: the dataclass's) and per window (default: ``windows``)."""
    defaults, hints = QuantConfig(), typing.get_type_hints(QuantConfig)
    for f in quant_fields():
        flag, kw = QUANT_HELP[f.name]
        kw = {"type": _flag_type(f, hints)} | kw
        if kw["type"] is str:
            del kw["type"]  # argparse's own
        p.add_argument(flag or "--" + f.name.replace("_", "-"), default=getattr(defaults, f.name), action=_Given,
                       setting=f.name, **kw)
    for f in dataclasses.fields(WindowConfig):
        flag, help = WINDOW_HELP[f.name]
        p.add_argument(flag, type=int, default=getattr(windows, f.name), help=help, action=_Given, setting=f.name)


def given_settings(args) -> dict[str, tuple[str, object]]:
    """{setting: (flag, value)} of the quantizer and window flags given on the command line (:func:`add_quant_args`)."""
    return dict(getattr(args, GIVEN, None) or {})


def bits_set_by(command: str, flag: str = "--bits") -> dict[str, str]:
    """``set_here`` of :func:`refuse_unread_settings` for a command whose ``flag`` sets both widths."""
    why = f"{command} runs each width of {flag} on keys and values alike"
    return {"k_bits": why, "v_bits": why}


def refuse_unread_settings(args, runs, set_here: dict[str, str] | None = None, none_read: str | None = None) -> None:
    """Refuse each quantizer or window flag given on the command line that changes nothing this command runs
    (:func:`wushkv.methods.spec.refuse_unread`, whose arguments these are but for ``args``, the parsed command line)."""
    from ..methods.spec import refuse_unread

    given = {setting: f"{flag} {16 if value is None and setting in ('k_bits', 'v_bits') else value}"
             for setting, (flag, value) in given_settings(args).items()}
    refuse_unread(runs, given, set_here, none_read)


def refuse_unread_by_auto(args, autos, others=(), set_here: dict[str, str] | None = None) -> None:
    """:func:`refuse_unread_settings` again once ``auto`` is resolved, with the command's ``others`` runs. ``autos``:
    per setting auto runs at, (the configured QuantConfig, (the method it resolved to, the configured settings with
    the recipe's)). What the recipes' methods do not read is refused, and so is a tile clip a recipe sets itself
    (``@tc=``), which replaces the configured one."""
    given = given_settings(args)
    for cfg, (method, base) in autos:
        if "tile_clip" in given and base.tile_clip != cfg.tile_clip:
            flag, value = given["tile_clip"]
            raise ValueError(f"{flag} {value} changes nothing here: auto stands for {getattr(method, 'name', method)} with "
                             f"its recipe's own tile clip ({base.tile_clip:g}) at {cfg.label()}; name that method to run it "
                             "at another clip")
    refuse_unread_settings(args, [resolved for _, resolved in autos] + list(others), set_here)


def quant_config(args, **override) -> QuantConfig:
    """The QuantConfig of the parsed quantizer arguments; ``override``: fields set by the command (e.g. the widths)."""
    fields = {f.name: getattr(args, _dest(f.name, QUANT_HELP[f.name][0])) for f in quant_fields()}
    windows = WindowConfig(*(getattr(args, _dest(f.name, WINDOW_HELP[f.name][0])) for f in dataclasses.fields(WindowConfig)))
    return QuantConfig(**(fields | override), windows=windows)
