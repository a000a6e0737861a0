"""The ``wushkv`` command line: one entry point, one subcommand per job.

Each module of ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its subcommands with
``set_defaults(func=...)``; a command parses its arguments, calls the library and prints. The order of the
modules (and of the commands within each) is the order of ``wushkv --help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from .common import context_list

COMMAND_MODULES = ("misc", "evaluate", "select", "generation", "tools", "serve")  # wushkv.cli.<name>, each with register(subparsers)
# the order of `wushkv --help`'s command list; a command not listed follows these, in the order it was registered
HELP_ORDER = ("info", "ppl", "calibrate", "recon", "compare", "tune-clip", "select", "demo", "generate", "export", "export-model", "agree", "passkey",
              "sweep", "lm-eval", "calibration", "data", "merge")

__all__ = ["COMMAND_MODULES", "build_parser", "context_list", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wushkv", description="WUSH-KV: low-bit KV caches with data-aware transforms.")
    parser.add_argument("--version", action="version", version=f"wushkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    _order(sub, HELP_ORDER)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option of every (sub)command says its default in ``--help`` where its help does not already speak of one
    and there is one to say (not None, not a switch's False)."""
    for action in parser._actions:  # (argparse keeps no public handle on them)
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                _show_defaults(sub)
            continue
        if (not action.option_strings or action.required or action.default in (None, False, argparse.SUPPRESS)
                or action.help == argparse.SUPPRESS or "default" in (action.help or "").lower()):
            continue
        action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"


def _order(sub, order) -> None:
    """List the subcommands of ``sub`` in ``order`` (the modules register them grouped by topic)."""
    rank = {n: i for i, n in enumerate(order)}
    key = lambda n: rank.get(n, len(rank))  # noqa: E731  (sorted is stable: unlisted ones keep their order)
    parsers = dict(sub.choices)
    sub.choices.clear()
    sub.choices.update((n, parsers[n]) for n in sorted(parsers, key=key))
    sub._choices_actions.sort(key=lambda a: key(a.dest))  # the help lines (argparse keeps no public handle on them)


def main(argv: list[str] | None = None) -> int:
    from ..io import exclusive_outputs
    from .common import output_files

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # one run per output file: a second run writing the same file is refused, never interleaved with the first
        with exclusive_outputs(output_files(args)):
            return args.func(args)
    except (ValueError, OSError) as e:  # OSError: a file that cannot be written (disk full, a folder that is a file)
        print(f"wushkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # every write is atomic: what is on disk is whole, and a --json run resumes from it
        resumes = " (run again with the same --json, it resumes from its file)" if isinstance(getattr(args, "json", None), str) else ""
        print(f"wushkv {args.command}: interrupted; the files it wrote are whole{resumes}", file=sys.stderr)
        return 130
