"""WUSH-KV served by vLLM (CPU) against stock vLLM, in one run: cache capacity, agreement with wushkv's transformers
cache, and decode speed (issue #32; docs/reference/serving.md, performance.md).

From one calibration it exports the model three times (``wushkv export-model``, ``--method`` (default ``auto``:
the model's recorded selection, e.g. SmolLM2's key tiles at 2 bits), QuEST, windows ``--sink 128 --keep 128 --flush
16``: a sink of one 128-token block, which key tiles need, and for a key-tile recipe the tail that keeps the average
number of full-precision tokens, 128/72/128; per-token recipes are served at 128/128/1; ``--metadata-dtype``: K4V2's
QuEST steps in one byte (e5m3) by default): K2V2, K4V2, and the same
weights without a side file (stock vLLM, plugin installed). Then, in the vLLM environment (``.venv-vllm``, ``make vllm-venv``; ``python -m wushkv_vllm.jobs``):

* **capacity**: the tokens vLLM's paged cache holds for the same ``VLLM_CPU_KVCACHE_SPACE`` (its
  ``CPU KV cache size`` line: blocks × block size), bfloat16 as served;
* **agreement** (float32 on both sides, like for like): ``--prompts`` rows of WikiText-2 test of ``--prompt-len``
  tokens (the first prompts of ``wushkv agree``), ``--new-tokens`` greedy tokens each through the plugin;
  teacher-forced, wushkv's transformers cache at the same windows predicts every prompt and generated position; top-1
  agreement and the largest log-probability gap;
* **quality against full precision**, on the same tokens: the model's full-precision log-probabilities (the exported
  weights, transformers, float32) against vLLM's served ones and against wushkv's transformers cache: top-1 agreement
  and the mean KL(full precision ‖ served). vLLM returns the top ``--topk`` log-probabilities of a position, not its
  whole vocabulary, so its KL is that of the two distributions coarsened to those tokens and one bucket for the rest
  (a lower bound on the KL; :func:`wushkv_vllm.jobs.coarse_kl`); the transformers cache gets both its full KL and the
  same coarsened one, for a like-for-like comparison;
* **decode speed** at each of ``--contexts``: ``--requests`` requests of that many prompt tokens, generated once for
  1 token (the prefill, timed; it fills the prefix cache), then again for ``--decode-tokens`` from the prefix cache:
  the mean decode step is vLLM's inter-token latency (time per output token); decode tokens/s of the batch, plugin
  over stock, and the prefill seconds of both;
* **prefix-cache hits** (K2V2, float32): ``--requests`` prompts of ``--prefix-len`` WikiText-2 tokens generated
  ``--prefix-first`` tokens each, then the same prompts again for ``--decode-tokens`` greedy tokens, which hit the
  prefix cache (their last full block before the last token) with the first requests ended and their windows' copies
  under the pool's trim since; against the same requests on an engine without prefix caching: each request's first
  differing token, the first token's |Δ log p|, the largest |Δ log p| and the mean coarsened KL up to the first
  difference (the tokens both top-k lists hold and the rest; the hit should read its recent window from the copies:
  the same tokens, log-probabilities float32 sums apart).

    python benchmarks/vllm_serving.py --calibration out/smollm2-c32.safetensors --work out/vllm-bench \\
        --json out/vllm_serving.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path


from wushkv.config import QuantConfig, WindowConfig
from wushkv.data import tokenize_chunks, wikitext2_test
from wushkv.io import write_json
from wushkv.report import format_table
from wushkv.serving import served_logprobs
from wushkv_vllm.jobs import coarse_kl, compare, versus_reference

ROOT = Path(__file__).resolve().parents[1]


def export(model, tok, cal, out: Path, method: str, k_bits: int, v_bits: int, windows: WindowConfig, model_key: str,
           metadata_dtype: str = "float16", quantizer: str = "quest") -> Path:
    """The folder ``out`` exported (kept if it holds a side file: its name carries the method, quantizer, widths,
    windows and metadata dtype)."""
    from wushkv.serving import export_model

    if not (out / "wushkv" / "kv_cache.safetensors").is_file():
        if out.exists():
            shutil.rmtree(out)
        cfg = QuantConfig(k_bits=k_bits, v_bits=v_bits, quantizer=quantizer, windows=windows, metadata_dtype=metadata_dtype)
        export_model(model, tok, out, method=method, cfg=cfg, calibration=cal, model_key=model_key)
    return out


def served_method(folder: Path) -> str:
    """The method an exported folder serves (``auto`` resolved) and its windows, from its side file's JSON copy."""
    meta = json.loads((folder / "wushkv" / "kv_cache.json").read_text())
    q = meta["quantization"]
    w = q["windows"]
    steps = "" if q.get("metadata_dtype", "float16") == "float16" else f", {q['metadata_dtype']} steps"
    quantizer = "" if q["quantizer"] in ("quest", meta["method"]) else f" {q['quantizer']}"
    return f"{meta['method']}{quantizer} {w['S_sink']}/{w['S_keep']}/{w['S_flush']}{steps}"


_FP: dict = {}  # the full-precision model, loaded once


def full_precision_logprobs(folder: Path, ids: list[int]):
    """Log-probabilities (n, vocab) float64 of ``ids`` teacher-forced through the folder's model in full precision
    (transformers, float32, no quantized cache); row i predicts token i + 1."""
    import torch
    from transformers import AutoModelForCausalLM

    if _FP.get("folder") != folder:
        _FP.update(folder=folder, model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    model = _FP["model"]
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].double().log_softmax(-1)


def run_jobs(vllm_python: str, jobs: list, work: Path, space_gib: int) -> list:
    jp, op = work / "jobs.json", work / "jobs.out.json"
    jp.write_text(json.dumps(jobs))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(space_gib), PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([vllm_python, "-m", "wushkv_vllm.jobs", str(jp), str(op)], env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    (work / "jobs.log").write_text(r.stdout)
    if r.returncode:
        raise SystemExit(f"vLLM jobs failed (exit {r.returncode}); log in {work / 'jobs.log'}:\n{r.stdout[-3000:]}")
    return json.loads(op.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calibration", required=True)
    p.add_argument("--method", default="auto", help="the method exported at K2V2 and K4V2 (default: %(default)s)")
    p.add_argument("--windows", default="128,128,16", help="S_sink,S_keep,S_flush given to export-model (default: %(default)s)")
    p.add_argument("--quantizer", default="quest", choices=("quest", "affine", "kivi"),
                   help="export-model's --quantizer (kivi: the KIVI baseline, keys per channel over tiles of S_flush tokens, "
                        "with --method identity) (default: %(default)s)")
    p.add_argument("--metadata-dtype", default=None,
                   help="export-model's --metadata-dtype at K2V2,K4V2: e5m3 stores each QuEST step in one byte, which takes "
                        "K4V2's cell from 52 to 50 bytes; auto's K2V2 key tiles gain nothing (37 bytes pad to 38) "
                        "(default: float16,e5m3 with QuEST, float16,float16 otherwise)")
    p.add_argument("--work", default="out/vllm-bench", help="folder for the exported models and the vLLM logs")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--topk", type=int, default=20, help="log-probabilities vLLM returns per position (its max_logprobs: 20)")
    p.add_argument("--contexts", default="1024,4096,8192")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024, help="prefix-cache hits: prompt tokens (default: %(default)s)")
    p.add_argument("--prefix-first", type=int, default=512,
                   help="prefix-cache hits: tokens the first requests generate before the hits (default: %(default)s)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: capacity, agreement, speed, prefix")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    from wushkv.calibration import Calibration
    from wushkv.models import load

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, tok = load(args.model)
    cal = Calibration.load(args.calibration, model)
    win = WindowConfig(*(int(x) for x in args.windows.split(",")))
    if args.metadata_dtype is None:
        args.metadata_dtype = "float16,e5m3" if args.quantizer == "quest" else "float16,float16"
    meta = args.metadata_dtype.split(",")
    if len(meta) != 2 or not set(meta) <= {"float16", "e5m3"} or ("e5m3" in meta and args.quantizer != "quest"):
        raise SystemExit(f"--metadata-dtype takes two of float16, e5m3 (K2V2,K4V2; e5m3 with --quantizer quest only), got "
                         f"{args.metadata_dtype!r}")
    q = "" if args.quantizer == "quest" else f"-{args.quantizer}"
    tags = [f"{args.method}{q}-{win.S_sink}-{win.S_keep}-{win.S_flush}" + ("" if m == "float16" else f"-{m}") for m in meta]
    k2v2 = export(model, tok, cal, work / f"k2v2-{tags[0]}", args.method, 2, 2, win, args.model, meta[0], args.quantizer)
    k4v2 = export(model, tok, cal, work / f"k4v2-{tags[1]}", args.method, 4, 2, win, args.model, meta[1], args.quantizer)
    stock = work / "stock"
    if not stock.exists():
        shutil.copytree(k2v2, stock)
        shutil.rmtree(stock / "wushkv")
    del model
    text_ids = tokenize_chunks(tok, wikitext2_test(), args.prompt_len, args.prompts).tolist()
    long_ids = tokenize_chunks(tok, wikitext2_test(), max(int(c) for c in args.contexts.split(",")), args.requests, first=1)
    out = {"settings": vars(args), "served": {"K2V2": served_method(k2v2), "K4V2": served_method(k4v2)}}
    print(f"served: K2V2 {out['served']['K2V2']}, K4V2 {out['served']['K4V2']}", flush=True)
    bf16 = {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 2048, "max_num_seqs": 8}

    if "capacity" not in skip:
        res = run_jobs(args.vllm_python, [{"folder": str(f), "engine": bf16, "batches": []} for f in (stock, k2v2, k4v2)], work,
                       args.kv_space)
        tokens = [r["num_blocks"] * r["block_size"] for r in res]
        out["capacity"] = {name: {"tokens": t, "vs_stock": t / tokens[0]} for name, t in zip(("stock bf16", "K2V2", "K4V2"), tokens)}
        print(format_table(["cache", "tokens", "vs stock"], [[n, f"{v['tokens']:,}", f"{v['vs_stock']:.2f}x"]
                                                             for n, v in out["capacity"].items()]), flush=True)

    if "agreement" not in skip:
        f32 = bf16 | {"dtype": "float32", "max_model_len": args.prompt_len + args.new_tokens}
        res = run_jobs(args.vllm_python, [{"folder": str(f), "engine": f32, "batches": [
            {"prompts": text_ids, "max_tokens": args.new_tokens, "prompt_logprobs": args.topk, "logprobs": args.topk}]}
            for f in (k2v2, k4v2)], work, args.kv_space)
        out["agreement"], out["versus_full_precision"] = {}, {}
        for name, folder, r in zip(("K2V2", "K4V2"), (k2v2, k4v2), res):
            b = r["batches"][0]
            agree = total = 0
            worst = 0.0
            q = {"vllm_top1": 0, "vllm_coarse_kl": [], "wushkv_top1": 0, "wushkv_kl": [], "wushkv_coarse_kl": []}
            for prompt, gen, top, plp, ptk, glp in zip(text_ids, b["outputs"], b["prompt_top1"], b["prompt_logprob"],
                                                       b["prompt_topk"], b["logprobs"]):
                ids = prompt + gen
                mine = served_logprobs(folder, ids)
                a, t, w = compare(mine, prompt, gen, top, plp, glp)
                agree, total, worst = agree + a, total + t, max(worst, w)
                fp = full_precision_logprobs(stock, ids)
                a, kls = versus_reference(fp, prompt, gen, ptk, glp)
                q["vllm_top1"] += a
                q["vllm_coarse_kl"] += kls
                rows = range(len(ids) - 1)  # every position predicting a token of the request (the first excluded)
                own = [{str(int(i)): float(mine[r, i]) for i in mine[r].topk(args.topk).indices} for r in rows]
                q["wushkv_top1"] += int((fp[:-1].argmax(-1) == mine[:-1].argmax(-1)).sum())
                q["wushkv_kl"] += (fp[:-1].exp() * (fp[:-1] - mine[:-1])).sum(-1).clamp_min(0).tolist()
                q["wushkv_coarse_kl"] += [coarse_kl(fp[r], lp) for r, lp in zip(rows, own)]
            out["agreement"][name] = {"top1": agree / total, "positions": total, "max_logprob_gap": worst}
            n = len(q["vllm_coarse_kl"])
            out["versus_full_precision"][name] = {
                "positions": n, "vllm_top1": q["vllm_top1"] / n, "vllm_mean_coarse_kl": sum(q["vllm_coarse_kl"]) / n,
                "wushkv_top1": q["wushkv_top1"] / n, "wushkv_mean_kl": sum(q["wushkv_kl"]) / n,
                "wushkv_mean_coarse_kl": sum(q["wushkv_coarse_kl"]) / n, "topk": args.topk}
        print(format_table(["cache", "top-1 vs wushkv's cache", "positions", "max |Δ log p|"],
                           [[n, f"{100 * v['top1']:.2f}%", v["positions"], f"{v['max_logprob_gap']:.1e}"]
                            for n, v in out["agreement"].items()]), flush=True)
        print(format_table(["cache", "positions", "top-1 vs FP: vLLM", "wushkv cache", f"KL top-{args.topk}+rest: vLLM",
                            "wushkv cache", "full KL: wushkv cache"],
                           [[n, v["positions"], f"{100 * v['vllm_top1']:.2f}%", f"{100 * v['wushkv_top1']:.2f}%",
                             f"{v['vllm_mean_coarse_kl']:.4f}", f"{v['wushkv_mean_coarse_kl']:.4f}", f"{v['wushkv_mean_kl']:.4f}"]
                            for n, v in out["versus_full_precision"].items()]), flush=True)
        write_json(args.json, out)

    if "speed" not in skip:
        rows, out["speed"] = [], {}
        max_pos = json.loads((k2v2 / "config.json").read_text()).get("max_position_embeddings", 1 << 30)
        for C in (int(c) for c in args.contexts.split(",")):
            P = min(C, max_pos - args.decode_tokens)  # the model's last position ends the decode: 8k is 8,192 in all
            eng = bf16 | {"max_model_len": P + args.decode_tokens, "max_num_seqs": args.requests}
            prompts = [row[:P] for row in long_ids.tolist()]
            # prefill once (its time: the first call), then the same prompts again from the prefix cache for N tokens;
            # a decode step of the batch is vLLM's own inter-token latency (its histogram's mean over that call)
            batches = [{"prompts": prompts, "max_tokens": 1}, {"prompts": prompts, "max_tokens": args.decode_tokens}]
            res = run_jobs(args.vllm_python, [{"folder": str(f), "engine": eng, "batches": batches} for f in (stock, k2v2)], work,
                           args.kv_space)
            for f, r in zip(("stock", "K2V2"), res):
                if "error" in r:
                    raise SystemExit(f"vLLM refused the {f} engine at context {C}: {r['error']}")
            itl = "vllm:inter_token_latency_seconds"
            steps = [r["metrics"][itl + "_sum"] / r["metrics"][itl + "_count"] for r in res]
            tps = [args.requests / s for s in steps]
            tpot = [1000 * s for s in steps]
            prefill = [r["batches"][0]["seconds"] for r in res]  # the first call: every prompt prefilled, one token
            out["speed"][C] = {"prompt_tokens": P, "stock_prefill_s": prefill[0], "k2v2_prefill_s": prefill[1],
                               "stock_tokens_per_s": tps[0], "k2v2_tokens_per_s": tps[1], "ratio": tps[1] / tps[0],
                               "stock_ms_per_step": tpot[0], "k2v2_ms_per_step": tpot[1]}
            rows.append([C, f"{tps[0]:.1f}", f"{tps[1]:.1f}", f"{tpot[0]:.0f}", f"{tpot[1]:.0f}", f"{tps[1] / tps[0]:.3f}",
                         f"{prefill[0]:.1f}", f"{prefill[1]:.1f}"])
            write_json(args.json, out)
        print(format_table(["context", "stock tok/s", "K2V2 tok/s", "stock ms/step", "K2V2 ms/step", "K2V2 / stock",
                            "stock prefill s", "K2V2 prefill s"], rows),
              flush=True)
    if "prefix" not in skip:
        out["prefix"] = prefix_hits(args, tok, k2v2, work)
    write_json(args.json, out)
    return 0


def prefix_hits(args, tok, folder: Path, work: Path) -> dict:
    """The prefix-cache part (module docstring): the hits' greedy tokens and log-probabilities against an engine
    without prefix caching, both float32."""
    prompts = tokenize_chunks(tok, wikitext2_test(), args.prefix_len, args.requests).tolist()
    eng = {"dtype": "float32", "enforce_eager": True, "max_model_len": args.prefix_len + args.prefix_first + 1,
           "max_num_seqs": args.requests}
    again = {"prompts": prompts, "max_tokens": args.decode_tokens, "logprobs": args.topk}
    hit, alone = run_jobs(args.vllm_python, [
        {"folder": str(folder), "engine": eng | {"enable_prefix_caching": True},
         "batches": [{"prompts": prompts, "max_tokens": args.prefix_first}, again]},
        {"folder": str(folder), "engine": eng | {"enable_prefix_caching": False}, "batches": [again]}], work, args.kv_space)
    a, b = hit["batches"][1], alone["batches"][0]
    first, kls, gaps, gap0 = [], [], [], []
    for ta, tb, la, lb in zip(a["outputs"], b["outputs"], a["logprobs"], b["logprobs"]):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        first.append(n)
        upto = len(ta) if n is None else n + 1  # the positions before the first difference and that one (same context)
        for j in range(upto):  # KL(alone ‖ hit) coarsened to the tokens both top-k lists hold and the rest
            pa, pb = {int(t): x for t, x in la[j].items()}, {int(t): x for t, x in lb[j].items()}
            common = [t for t in pb if t in pa]
            qb, qa = [math.exp(pb[t]) for t in common], [math.exp(pa[t]) for t in common]
            rb, ra = max(1 - sum(qb), 1e-12), max(1 - sum(qa), 1e-12)
            kls.append(sum(x * (pb[t] - pa[t]) for x, t in zip(qb, common)) + rb * math.log(rb / ra))
            gaps += [abs(pa[t] - pb[t]) for t in common]
        if str(tb[0]) in la[0]:  # (alone's first token out of the hit's top-k: counted in the KL only)
            gap0.append(abs(float(la[0][str(tb[0])]) - float(lb[0][str(tb[0])])))
    res = {"hits": hit["metrics"].get("vllm:prefix_cache_hits"), "requests": args.requests, "prompt_tokens": args.prefix_len,
           "first_generated": args.prefix_first, "first_difference": first,
           "first_token_abs_dlogp_mean": sum(gap0) / max(len(gap0), 1), "first_token_abs_dlogp_max": max(gap0, default=0.0),
           "max_abs_dlogp": max(gaps, default=0.0), "mean_coarse_kl": sum(kls) / max(len(kls), 1)}
    print(format_table(["prefix-cache hits", "first differences", "first token |Δ log p| mean / max", "max |Δ log p|",
                        "coarse KL"],
                       [[res["hits"], ", ".join("none" if n is None else str(n) for n in first),
                         f"{res['first_token_abs_dlogp_mean']:.1e} / {res['first_token_abs_dlogp_max']:.1e}",
                         f"{res['max_abs_dlogp']:.1e}", f"{res['mean_coarse_kl']:.1e}"]]), flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
