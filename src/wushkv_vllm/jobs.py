"""Run vLLM engine jobs in the vLLM environment (``.venv-vllm``), for the plugin's tests and benchmarks:
``python -m wushkv_vllm.jobs JOBS OUT``.

JOBS (JSON): a list of jobs, run one after another in this process (vLLM's import is paid once), each with
``folder``, ``engine`` (keyword arguments of ``vllm.LLM``), optional ``env`` (environment variables set while the
engine runs, e.g. ``VLLM_CPU_OMP_THREADS_BIND`` for tensor parallelism on CPU) and ``batches``, each one ``generate`` call: ``prompts``
(lists of token ids), ``max_tokens``, optional ``prompt_logprobs`` (true: the top-1 token at every prompt position and
the prompt token's log-probability; k > 1: also the top-k log-probabilities there) and ``logprobs`` (k: the top-k
log-probabilities of every generated token). OUT (JSON): per job, per batch each prompt's generated ``outputs``, the
call's wall ``seconds`` and ``prompt_top1``, ``prompt_logprob`` (and ``prompt_topk``) where asked; then the cache vLLM
allocated (``num_blocks``, ``block_size``) and its counters
(``metrics``: preemptions, prefix-cache hits, ...), or ``error`` (the exception's type and message) if the engine
refused to start. vLLM starts its engine in another process, hence the ``__main__`` guard.
"""

import gc
import json
import sys
import time


def compare(ref, prompt: list, gen: list, top: list, prompt_logprob: list, logprobs: list) -> tuple[int, int, float]:
    """(agreeing positions, positions, largest |Δ log p|) of one request served by vLLM against reference
    log-probabilities ``ref`` (n, vocab) of the same tokens ``prompt + gen`` (row i predicts token i + 1): vLLM's
    prompt top-1 ``top`` and ``prompt_logprob`` (None first) and, per generated token, its top ``logprobs``."""
    am = ref.argmax(-1).tolist()
    n = len(prompt)
    pairs = [(am[i - 1], top[i]) for i in range(1, n)] + [(am[n - 1 + j], g) for j, g in enumerate(gen)]
    gaps = [abs(float(ref[i - 1, prompt[i]]) - prompt_logprob[i]) for i in range(1, n)]
    gaps += [abs(float(ref[n - 1 + j, int(t)]) - x) for j, lp in enumerate(logprobs) for t, x in lp.items()]
    return sum(a == b for a, b in pairs), len(pairs), max(gaps, default=0.0)


def coarse_kl(ref_row, topk: dict) -> float:
    """KL(p ‖ q) of a reference distribution, log-probabilities ``ref_row`` (vocab,), against a served one known only
    by its top-k log-probabilities ``topk`` ({token id: log q}), both coarsened to those k tokens and one bucket for
    the rest of the vocabulary: a lower bound on the full KL (merging outcomes never raises a divergence), and the
    full KL where the rest holds no mass."""
    import math

    ids = [int(t) for t in topk]
    p = [math.exp(float(ref_row[t])) for t in ids]
    q = [math.exp(x) for x in topk.values()]
    kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)
    p_rest, q_rest = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 1e-300)
    return max(kl + (p_rest * (math.log(p_rest) - math.log(q_rest)) if p_rest > 0 else 0.0), 0.0)


def versus_reference(ref, prompt: list, gen: list, prompt_topk: list, gen_topk: list) -> tuple[int, list[float]]:
    """(positions whose top-1 equals the reference's, per-position coarsened KL (:func:`coarse_kl`)) of one request
    served by vLLM, known by its top-k log-probabilities at every prompt position after the first (``prompt_topk``,
    None first) and every generated one (``gen_topk``), against reference log-probabilities ``ref`` (n, vocab) of
    ``prompt + gen`` (row i predicts token i + 1), e.g. full precision's."""
    am = ref.argmax(-1).tolist()
    n = len(prompt)
    rows = [(i - 1, prompt_topk[i]) for i in range(1, n)] + [(n - 1 + j, lp) for j, lp in enumerate(gen_topk)]
    agree = sum(am[r] == int(max(lp, key=lp.get)) for r, lp in rows)
    return agree, [coarse_kl(ref[r], lp) for r, lp in rows]


def run(job: dict) -> dict:
    import os

    saved = {k: os.environ.get(k) for k in job.get("env", {})}
    os.environ.update(job.get("env", {}))  # vLLM's engine processes are started with this environment
    try:
        return _run(job)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(model=job["folder"], disable_log_stats=False, **job.get("engine", {}))
    except Exception as e:  # noqa: BLE001 (the test reads what the user would see)
        return {"error": f"{type(e).__name__}: {e}"}
    res = {"batches": []}
    for batch in job["batches"]:  # one generate call each: a later batch can hit the prefix cache of an earlier one
        k = int(batch.get("prompt_logprobs") or 0)  # true counts as 1
        sp = SamplingParams(temperature=0, max_tokens=batch.get("max_tokens", 16), ignore_eos=True,
                            prompt_logprobs=k or None, logprobs=batch.get("logprobs"))
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]], sp, use_tqdm=False)
        b = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": time.perf_counter() - t}
        if batch.get("prompt_logprobs"):
            b["prompt_top1"] = [[None if lp is None else next(t for t, x in lp.items() if x.rank == 1) for lp in o.prompt_logprobs]
                                for o in outs]
            b["prompt_logprob"] = [[None if lp is None else lp[t].logprob for t, lp in zip(p, o.prompt_logprobs)]
                                   for p, o in zip(batch["prompts"], outs)]
            if k > 1:  # the top k of each position (vLLM adds the prompt token where it ranks lower: left out here)
                b["prompt_topk"] = [[None if lp is None else {str(t): x.logprob for t, x in lp.items() if x.rank <= k}
                                     for lp in o.prompt_logprobs] for o in outs]
        if batch.get("logprobs"):  # per generated token: {token id: log-probability} of the top ``logprobs``
            b["logprobs"] = [[{str(t): x.logprob for t, x in lp.items()} for lp in o.outputs[0].logprobs] for o in outs]
        res["batches"].append(b)
    cc = llm.llm_engine.vllm_config.cache_config
    res |= {"num_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
            "metrics": _metrics(llm.get_metrics())}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return res


def _metrics(metrics) -> dict:
    """vLLM's counters and gauges by name, and its histograms as NAME_sum / NAME_count (e.g. the inter-token latency:
    the mean decode step of the engine is ``vllm:inter_token_latency_seconds_sum / _count``)."""
    out = {}
    for m in metrics:
        if not m.name.startswith("vllm:"):
            continue
        if hasattr(m, "value"):
            out[m.name] = m.value
        elif hasattr(m, "sum") and hasattr(m, "count"):
            out[m.name + "_sum"], out[m.name + "_count"] = m.sum, m.count
    return out


if __name__ == "__main__":
    jobs = json.load(open(sys.argv[1]))
    json.dump([run(j) for j in jobs], open(sys.argv[2], "w"))
