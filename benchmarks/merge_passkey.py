"""Put together ``wushkv passkey`` runs made in parallel (one process per method) into one resumable file.

    python benchmarks/merge_passkey.py out/pk_*.json --out out/passkey_all.json
    wushkv passkey --json out/passkey_all.json --transforms full-precision,hadamard,wush ... --plot p.png

Every input must hold a run with the same settings (model, trials, seed, quantization, calibration
recipe); a run of only uncalibrated methods (full precision) has none and fits any. Cases are keyed by
method and ``context/depth/trial``; a case present in two files must hold the same result, bit for bit,
so files of one case made on different devices or library versions are refused rather than mixed. The output
is what ``wushkv passkey --json`` resumes from: running the command on it with the same methods runs
no prompt again and prints the tables and plots of all of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wushkv.runs import reconcile_settings  # noqa: E402
from wushkv.io import write_json  # noqa: E402


def merge(runs: list[tuple[str, dict]]) -> dict:
    settings, state = None, {}
    for path, run in runs:
        if not isinstance(run.get("settings"), dict) or not isinstance(run.get("state"), dict):
            raise ValueError(f"{path}: not a file `wushkv passkey --json` wrote (no settings/state)")
        if settings is None:
            settings = dict(run["settings"])
        else:
            settings, differ = reconcile_settings(settings, run["settings"])
            if differ:
                raise ValueError(f"{path}: other settings than the files before it (differing: {', '.join(differ)})")
        for method, cases in run["state"].items():
            into = state.setdefault(method, {})
            for key, result in cases.items():
                if key in into and into[key] != result:
                    raise ValueError(f"{path}: {method} case {key} differs from an earlier file ({result} vs {into[key]})")
                into[key] = result
    return {"settings": settings, "state": state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = merge([(f, json.loads(Path(f).read_text())) for f in args.files])
    write_json(args.out, out)
    for method, cases in out["state"].items():
        print(f"{method:>16}: {len(cases)} cases")


if __name__ == "__main__":
    main()
