"""What a method answers on passkey prompts, and which side of the cache makes it fail.

`wushkv passkey` scores hits; this prints the answers themselves, for each method and for each
(key bits, value bits) pair asked, on the same deterministic prompts (seed, context, depth, trial as
in `wushkv passkey`):

    python benchmarks/passkey_probe.py --calibration out/smollm2-c32.safetensors --contexts 1k \\
        --depths 0.1,0.5 --trials 5 --methods hadamard,wush,hadamard:wush,wush:hadamard --bits K2V2,K4V2,K2V4

Methods are those of `wushkv passkey`; ``KEYS:VALUES`` takes the key transform from one and the value
transform from another (``hadamard:wush``: Hadamard keys, WUSH values), to tell which side loses
the needle. Each
line also gives the teacher-forced log-probability of the key; the summary, its mean.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wushkv.calibration import Calibration  # noqa: E402
from wushkv.cli import _context_list  # noqa: E402
from wushkv.config import GENERATION_WINDOWS, QuantConfig  # noqa: E402
from wushkv.eval.methods import method_cache  # noqa: E402
from wushkv.eval.passkey import answer_and_logprob, answer_key, key_tokens, passkey_prompt, trial_seed  # noqa: E402
from wushkv.models import load  # noqa: E402


def parse_bits(s: str) -> list[tuple[int, int]]:
    out = []
    for x in s.split(","):
        m = re.fullmatch(r"K(\d)V(\d)", x.strip())
        if not m:
            raise SystemExit(f"--bits: expected pairs such as K2V2,K4V2, got {x!r}")
        out.append((int(m[1]), int(m[2])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--methods", default="hadamard,wush")
    ap.add_argument("--bits", default="K2V2", help="key/value widths, e.g. K2V2,K4V2,K2V4 (default: %(default)s)")
    ap.add_argument("--quantizer", default="affine")
    ap.add_argument("--contexts", default="1k")
    ap.add_argument("--depths", default="0.5")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model, tok = load(args.model)
    cal = Calibration.load(args.calibration) if args.calibration else None
    contexts = _context_list(args.contexts)
    cases = [(c, float(d), t) for c in contexts for d in args.depths.split(",") for t in range(args.trials)]
    rows = []
    base = QuantConfig(2, 2, args.quantizer, windows=GENERATION_WINDOWS)
    for name in args.methods.split(","):
        for kb, vb in parse_bits(args.bits):
            with method_cache(model, cal, name, replace(base, k_bits=kb, v_bits=vb)) as make:
                hits, lps = 0, []
                for case in cases:
                    ids, key = passkey_prompt(tok, *case[:2], trial_seed(args.seed, *case))
                    gen, lp = answer_and_logprob(model, ids, key_tokens(tok, key), 8, make)
                    text = tok.decode(gen[0], skip_special_tokens=True)
                    hit = answer_key(text) == key
                    hits += hit
                    lps.append(lp)
                    rows.append({"method": name, "bits": f"K{kb}V{vb}", "context": case[0], "depth": case[1], "trial": case[2],
                                 "key": key, "answer": text, "hit": hit, "logprob": lp})
                    print(f"{name:>10} K{kb}V{vb} {case[0]:>5}/{case[1]:.1f}/{case[2]}  key {key}  log P {lp:6.2f}  answer {text!r}", flush=True)
                print(f"{name:>10} K{kb}V{vb}: {hits}/{len(cases)}, mean log P(key) {sum(lps) / len(lps):.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
