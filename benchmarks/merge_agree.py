"""Put together ``wushkv agree`` runs made in parallel (one process per method) into one resumable file.

    cp agree.json a2.json; cp agree.json a4.json       # the same full-precision continuations in each
    wushkv agree ... --transforms stock-hqq-2 --json a2.json &
    wushkv agree ... --transforms stock-hqq-4 --json a4.json &
    python benchmarks/merge_agree.py a2.json a4.json --out agree_all.json
    wushkv agree --report-only --json agree_all.json --transforms wush,random,stock-hqq-2,stock-hqq-4

Every input must hold a run with the same settings (model, prompts, tokens, quantization, calibration
recipe) and the same full-precision continuations, token for token. A method present in two files must
hold the same per-prompt results over the prompts both have, bit for bit; the longer of the two is kept.
Anything else is refused rather than mixed. The output is what ``wushkv agree --json`` resumes from.
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
    settings, conts, rows = None, None, {}
    for path, run in runs:
        state = run.get("state")
        if not isinstance(run.get("settings"), dict) or not isinstance(state, dict) or "continuations" not in state:
            raise ValueError(f"{path}: not a file `wushkv agree --json` wrote (no settings/state)")
        if settings is None:
            settings, conts = dict(run["settings"]), state["continuations"]
        else:
            settings, differ = reconcile_settings(settings, run["settings"])
            if differ:
                raise ValueError(f"{path}: other settings than the files before it (differing: {', '.join(differ)})")
            n = min(len(conts), len(state["continuations"]))
            if conts[:n] != state["continuations"][:n]:
                raise ValueError(f"{path}: its full-precision continuations differ from the files before it")
            if len(state["continuations"]) > len(conts):
                conts = state["continuations"]
        for method, done in state.get("rows", {}).items():
            have = rows.get(method, [])
            n = min(len(have), len(done))
            if have[:n] != done[:n]:
                raise ValueError(f"{path}: {method}'s results differ from an earlier file's over their common prompts")
            rows[method] = done if len(done) > len(have) else have
    return {"settings": settings, "state": {"continuations": conts, "rows": rows}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = merge([(f, json.loads(Path(f).read_text())) for f in args.files])
    write_json(args.out, out)
    for method, done in out["state"]["rows"].items():
        print(f"{method:>16}: {len(done)} prompts")


if __name__ == "__main__":
    main()
