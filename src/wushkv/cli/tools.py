"""Argument parsing of the tool subcommands: ``wushkv calibration upgrade``, ``wushkv data heldout`` and
``wushkv merge compare|agree|passkey``.

:func:`register` adds them to the CLI's subparsers; each leaf sets ``func(args) -> int`` (the exit code). Refusals
raise :class:`ValueError` (or :class:`FileNotFoundError`), which the CLI's ``main`` prints as an error.
"""

from __future__ import annotations

import argparse
import sys

from ..data import HELDOUT_C4_DOCUMENTS, HELDOUT_C4_FIRST
from .common import at_least


def _model_of(args):
    """(model, tokenizer) of ``--model``, or (None, None): the tool loads the model the file names."""
    if args.model is None:
        return None, None
    from ..models import load

    return load(args.model)


def cmd_calibration_upgrade(args) -> int:
    from ..tools.upgrade import upgrade_file

    model, tok = _model_of(args)
    print(f"wrote {upgrade_file(args.calibration, args.out, seqs=args.seqs, text_file=args.text_file, model=model, tokenizer=tok)}")
    return 0


def cmd_calibration_cover(args) -> int:
    from ..tools.cover import cover_file

    model, _ = _model_of(args)
    print(f"wrote {cover_file(args.calibration, args.out, args.serve_len, model=model)}")
    return 0


def cmd_data_heldout(args) -> int:
    from ..tools.heldout import write_heldout

    text, what = write_heldout(args.out, args.source, args.first, args.documents)
    print(f"{what}, {len(text)} characters -> {args.out}")
    return 0


def cmd_merge_compare(args) -> int:
    from ..tools.merge import compare_report, merge_compare, read_runs

    first, rows = merge_compare(read_runs(args.files, "compare"))
    print(compare_report(first, rows, versus=args.versus, plot=args.plot))
    return 0


def cmd_merge_agree(args) -> int:
    from ..io import write_json
    from ..tools.merge import merge_agree, read_runs

    out = merge_agree(read_runs(args.files, "agree"))
    write_json(args.out, out)
    for method, done in out["state"]["rows"].items():
        print(f"{method:>16}: {len(done)} prompts")
    return 0


def cmd_merge_passkey(args) -> int:
    from ..io import write_json
    from ..tools.merge import merge_passkey, read_runs

    out = merge_passkey(read_runs(args.files, "passkey"))
    write_json(args.out, out)
    for method, cases in out["state"].items():
        print(f"{method:>16}: {len(cases)} cases")
    return 0


def _leaves(parser: argparse.ArgumentParser, dest: str):
    """Nested subcommands of ``parser``; ``wushkv calibration`` alone prints its help and exits 2."""
    sub = parser.add_subparsers(dest=dest, metavar="SUBCOMMAND")

    def usage(args) -> int:
        parser.print_help(sys.stderr)
        return 2

    parser.set_defaults(func=usage)
    return sub


def register(subparsers) -> None:
    """Add ``calibration``, ``data`` and ``merge`` (with their nested subcommands) to ``subparsers``."""
    raw = argparse.RawDescriptionHelpFormatter

    p = subparsers.add_parser("calibration", help="operations on calibration files (upgrade, cover)",
                              description="Operations on calibration files.")
    sub = _leaves(p, "calibration_command")
    q = sub.add_parser("upgrade", help="bring a calibration file to the current format (adding the pre-RoPE key mean where it lacks it)",
                       formatter_class=raw, description=(
                           "Write a calibration file made by an older wushkv in the current format version, keeping its\n"
                           "statistics, solved transforms and selections (WUSH stays the same solution, signs included), to a\n"
                           "new file atomically. A file made before the pre-RoPE key mean was collected (mu_K_pre, needed by\n"
                           "the +rmean methods) gets it, from the first --seqs calibration sequences (C4 by default, or\n"
                           "--text-file) of the file's own sequence length: that loads the model.\n\n"
                           "  wushkv calibration upgrade --calibration out/smollm2-c32.safetensors --out out/smollm2-c32-rmean.safetensors"))
    q.add_argument("--calibration", required=True, help="the calibration file to upgrade (kept as it is)")
    q.add_argument("--out", required=True, help="where to write the upgraded file (must differ from --calibration)")
    q.add_argument("--seqs", type=int, default=4, help="calibration sequences to average over (default 4)")
    q.add_argument("--model", default=None, help="the model the file was made for, where the name it records does not load from here (a relative path made elsewhere); checked against the file (default: the recorded name)")
    q.add_argument("--text-file", default=None, help="UTF-8 text instead of C4")
    q.set_defaults(func=cmd_calibration_upgrade, outputs=lambda a: [a.out, a.out + ".json"])  # Calibration.save writes both

    q = sub.add_parser("cover", help="cover a calibration's key statistics to the positions of a longer served context",
                       formatter_class=raw, description=(
                           "Write a calibration whose key-space statistics are averaged, in closed form, over the RoPE\n"
                           "positions of a --serve-len context (the calibration text read at every offset up to\n"
                           "serve-len − its sequence length), with its transforms solved again from them. For serving\n"
                           "contexts several times longer than the calibration's sequences (docs/lab/calibration-length.md).\n\n"
                           "  wushkv calibration cover --calibration out/smollm2-c16x1024.safetensors --serve-len 4096 \\\n"
                           "      --out out/smollm2-c16x1024-4k.safetensors"))
    q.add_argument("--calibration", required=True, help="the calibration file to cover (kept as it is)")
    q.add_argument("--serve-len", type=int, required=True, help="the context length you will serve, longer than the calibration's sequences")
    q.add_argument("--model", default=None, help="the model the file was made for, where the name it records does not load from here (a relative path made elsewhere); checked against the file (default: the recorded name)")
    q.add_argument("--out", required=True, help="where to write the covered file (must differ from --calibration)")
    q.set_defaults(func=cmd_calibration_cover, outputs=lambda a: [a.out, a.out + ".json"])

    p = subparsers.add_parser("data", help="write evaluation texts (heldout)", description="Write evaluation texts.")
    sub = _leaves(p, "data_command")
    q = sub.add_parser("heldout", help="write a held-out text that no setting was chosen on (C4 past calibration, or Python source)",
                       formatter_class=raw, description=(
                           "Write a held-out evaluation text that no setting was chosen on: C4 validation documents\n"
                           "that no calibration reads (--source c4), or the source of a fixed list of pure-Python\n"
                           "standard-library modules of the running interpreter (--source python; quote its version).\n\n"
                           f"  wushkv data heldout --out out/c4_heldout.txt          # C4 documents {HELDOUT_C4_FIRST}..{HELDOUT_C4_FIRST + HELDOUT_C4_DOCUMENTS - 1}\n"
                           "  wushkv data heldout --source python --out out/python_src.txt\n"
                           "  wushkv compare --text-file out/c4_heldout.txt --chunks 4 ..."))
    q.add_argument("--out", required=True)
    q.add_argument("--source", choices=("c4", "python"), default="c4", help="which text (default: %(default)s)")
    q.add_argument("--first", type=int, default=HELDOUT_C4_FIRST, help="c4: first document (default: %(default)s)")
    q.add_argument("--documents", type=at_least(1), default=HELDOUT_C4_DOCUMENTS, help="c4: how many documents (default: %(default)s)")
    q.set_defaults(func=cmd_data_heldout)

    p = subparsers.add_parser("merge", help="put together runs made in parallel (compare, agree, passkey)",
                              description="Put together runs made in parallel; files of other settings are refused, never mixed.")
    sub = _leaves(p, "merge_command")
    q = sub.add_parser("compare", help="merge `wushkv compare --json` files of the same text into one table and plot",
                       formatter_class=raw, description=(
                           "Merge several `wushkv compare --json` files run on the same text into one table and plot.\n"
                           "Files must share the text (hash), the model and the full-precision perplexity; a transform\n"
                           "that appears in two files is taken from the first.\n\n"
                           "  wushkv merge compare out/compare_c16.json out/compare_c16_oscar.json --plot docs/img/compare.png"))
    q.add_argument("files", nargs="+", metavar="JSON")
    q.add_argument("--plot", default=None)
    q.add_argument("--versus", default=None, help="also print every row's paired difference from this transform (95%% bootstrap "
                                                  "interval over chunks), at each width")
    q.set_defaults(func=cmd_merge_compare)
    q = sub.add_parser("agree", help="merge `wushkv agree --json` runs made in parallel into one resumable file",
                       formatter_class=raw, description=(
                           "Put together `wushkv agree` runs made in parallel (one process per method) into one resumable\n"
                           "file. Every input must hold the same settings and the same full-precision continuations; a\n"
                           "method in two files must hold the same per-prompt results over the prompts both have (the\n"
                           "longer is kept). Anything else is refused rather than mixed.\n\n"
                           "  wushkv merge agree a2.json a4.json --out agree_all.json\n"
                           "  wushkv agree --report-only --json agree_all.json --transforms ..."))
    q.add_argument("files", nargs="+", metavar="JSON")
    q.add_argument("--out", required=True)
    q.set_defaults(func=cmd_merge_agree)
    q = sub.add_parser("passkey", help="merge `wushkv passkey --json` runs made in parallel into one resumable file",
                       formatter_class=raw, description=(
                           "Put together `wushkv passkey` runs made in parallel (one process per method) into one\n"
                           "resumable file. Every input must hold the same settings (a run of only uncalibrated methods\n"
                           "fits any); a case (method, context/depth/trial) in two files must hold the same result, bit\n"
                           "for bit. Anything else is refused rather than mixed.\n\n"
                           "  wushkv merge passkey out/pk_*.json --out out/passkey_all.json\n"
                           "  wushkv passkey --json out/passkey_all.json --transforms ... --plot p.png"))
    q.add_argument("files", nargs="+", metavar="JSON")
    q.add_argument("--out", required=True)
    q.set_defaults(func=cmd_merge_passkey)
