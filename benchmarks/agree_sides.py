"""Which side's error grows over a long generation: keys only, values only, or both.

Re-scores the full-precision continuations an earlier ``wushkv agree --json`` run stored (same prompts,
same tokens, no new generation), teacher-forced with the exact single-pass emulation, with only the
keys quantized (values full precision), only the values, or both, and prints the KL of each quarter
of the generation. Also measures how much of each continuation repeats itself (positions whose last
8 tokens occurred before), since greedy continuations of a small model fall into loops.

    python benchmarks/agree_sides.py --agree out/agree_smollm2_full.json --calibration out/smollm2-c32.safetensors \\
        --methods wush,random --sides keys,values --json out/agree_sides_smollm2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from wushkv.calibration import Calibration  # noqa: E402
from wushkv.config import QuantConfig  # noqa: E402
from wushkv.data import load_eval_text, tokenize_chunks  # noqa: E402
from wushkv.eval.agreement import kl_and_top1, next_token_logits  # noqa: E402
from wushkv.eval.methods import method_cache  # noqa: E402
from wushkv.io import write_json  # noqa: E402
from wushkv.models import load  # noqa: E402
from wushkv.progress import progress  # noqa: E402

SIDES = ("keys", "values", "both")


def load_agree_run(path: str):
    """(saved run, model, tokenizer, prompts (N, P)) of a ``wushkv agree --json`` file, its prompts rebuilt
    from its text and checked against the hash it recorded."""
    saved = json.loads(Path(path).read_text())
    st = saved["settings"]
    model, tok = load(st["model"], dtype=st.get("dtype", "float32"))
    text, _ = load_eval_text(None if st["text"] == "wikitext2-test" else st["text"])
    prompts = tokenize_chunks(tok, text, st["prompt_len"], st["prompts"] * st["stride"])[:: st["stride"]]
    if hashlib.sha256(prompts.numpy().tobytes()).hexdigest() != st["prompt_sha256"]:
        raise SystemExit(f"{path}: its prompts cannot be rebuilt here (prompt hash differs)")
    return saved, model, tok, prompts


def side_config(cfg: QuantConfig, side: str) -> QuantConfig:
    """``cfg`` with only the keys, only the values, or both quantized (the other side full precision)."""
    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}; choose from {SIDES}")
    return dataclasses.replace(cfg, k_bits=cfg.k_bits if side != "values" else None, v_bits=cfg.v_bits if side != "keys" else None)


def repeated_positions(tokens: list[int], n: int = 8) -> list[bool]:
    """Per position t: whether the n tokens ending at t - 1 (the context that predicts token t) occurred before."""
    seen, out = set(), [False]
    for t in range(len(tokens) - 1):
        g = tuple(tokens[max(0, t - n + 1) : t + 1])
        out.append(len(g) == n and g in seen)
        seen.add(g)
    return out


def quarters(rows: list[list[float]]) -> list[float]:
    kl = torch.tensor(rows, dtype=torch.float64)
    q = kl.shape[1] // 4
    return [float(kl[:, i * q : (i + 1) * q].mean()) for i in range(4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agree", required=True, help="JSON of an earlier `wushkv agree` run (its continuations are reused)")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--methods", default="wush,random")
    ap.add_argument("--sides", default="keys,values", help=f"comma-separated, from {','.join(SIDES)}")
    ap.add_argument("--prompts", type=int, default=None, help="first N prompts only (default: all the run has)")
    ap.add_argument("--json", default=None, help="results; resumes (one row per method and side)")
    args = ap.parse_args()

    saved, model, tok, prompts = load_agree_run(args.agree)
    st = saved["settings"]
    conts = saved["state"]["continuations"][: args.prompts]
    cal = Calibration.load(args.calibration, model)
    base = QuantConfig.from_dict(st["quantization"])
    out = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).is_file() else {"agree": args.agree, "rows": {}}
    rep = [repeated_positions(c) for c in conts]
    out["repeated_by_quarter"] = quarters([[float(x) for x in r] for r in rep])

    torch.set_grad_enabled(False)
    refs = [next_token_logits(model, prompts[i : i + 1], torch.tensor([conts[i]])) for i in progress(range(len(conts)), desc="full precision", unit="prompt")]
    for m in args.methods.split(","):
        for side in args.sides.split(","):
            name = f"{m} {side}"
            if name in out["rows"] and len(out["rows"][name]["kl"]) >= len(conts):
                continue
            t0, kl_rows = time.perf_counter(), []
            with method_cache(model, cal, m, side_config(base, side)) as make:
                for i in progress(range(len(conts)), desc=name, unit="prompt"):
                    logits = next_token_logits(model, prompts[i : i + 1], torch.tensor([conts[i]]), make())
                    kl_rows.append(kl_and_top1(refs[i], logits)[0].tolist())
            out["rows"][name] = {"kl": kl_rows, "quarters": quarters(kl_rows), "seconds": time.perf_counter() - t0}
            if args.json:
                write_json(args.json, out)
    print(f"positions inside a repeat (8-gram seen before), by quarter: {' / '.join(f'{x:.1%}' for x in out['repeated_by_quarter'])}")
    print(f"{'method, side quantized':28s} KL by quarter (1st / 2nd / 3rd / 4th)   4th/2nd")
    for name, r in out["rows"].items():
        q = r["quarters"]
        print(f"{name:28s} {' / '.join(f'{x:.4f}' for x in q)}   x{q[3] / q[1]:.2f}")


if __name__ == "__main__":
    main()
