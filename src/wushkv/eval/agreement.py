"""Generation quality over long decoding: does the quantized cache keep the full-precision model's choices?

For each prompt (taken from the evaluation text) the full-precision greedy continuation ``y`` of
``new_tokens`` tokens is generated once (EOS ignored, so every prompt yields the same length). Then,
per method:

* **teacher-forced**: ``prompt + y`` goes through the method's cache (step by step after the prompt,
  or with ``single_pass`` in one forward — the exact emulation of that streaming, tested equal); at
  each generated position we record the KL divergence ``KL(P_fp ‖ P_q)`` of the next-token
  distributions and whether their top-1 tokens agree;
* **free-running**: greedy generation through the method's cache; the common prefix with ``y`` (the
  position of the first differing token; ``new_tokens`` if none differs).

Errors accumulate during decoding because every quantized key and value is re-read at every later
step; the per-position KL curve shows whether they grow.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from ..progress import progress


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, n: int, cache, reference: torch.Tensor | None = None) -> torch.Tensor:
    """``n`` greedy tokens after ``prompt`` (B, P) through ``cache`` (EOS ignored). Returns (B, ≤ n).

    With ``reference`` (B, n), generation stops once every row has produced a token that differs
    from its reference row: all a first-divergence measurement needs, without decoding the rest
    (rows that diverged earlier go on with their own tokens, which nothing reads). The prompt's
    logits are computed for its last position only. Rows of equal length need no padding; on a CPU,
    where decoding is bound by reading the weights, a batch costs little more than one row.
    """
    if reference is not None and (reference.shape[0] != prompt.shape[0] or reference.shape[1] < n):
        raise ValueError(f"reference {tuple(reference.shape)} must have {prompt.shape[0]} rows of at least {n} tokens")
    logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return greedy_from(model, logits, n, cache, reference)


@torch.no_grad()
def greedy_from(model, logits: torch.Tensor, n: int, cache, reference: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`greedy` after the prompt is already in ``cache``; ``logits`` (B, V): its last position's."""
    out = []
    alive = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    for i in range(n):
        t = logits.argmax(-1, keepdim=True)
        out.append(t)
        if reference is not None:
            alive &= t[:, 0] == reference[:, i]
            if not alive.any():
                break
        if i + 1 < n:
            logits = model(t, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(out, 1)


@torch.no_grad()
def streamed_logits(model, prompts: torch.Tensor, conts: torch.Tensor, cache) -> torch.Tensor:
    """Logits (B, n, V) predicting each token of ``conts`` (B, n) after ``prompts`` (B, P): the prompts
    prefilled into ``cache``, then the continuations fed token by token (real streaming)."""
    first = model(prompts, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
    out = first.new_empty(conts.shape[0], conts.shape[1], first.shape[-1])  # filled in place: no second copy
    out[:, 0] = first
    for t in range(conts.shape[1] - 1):
        out[:, t + 1] = model(conts[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1].float()
    return out


@torch.no_grad()
def next_token_logits(model, prompt: torch.Tensor, cont: torch.Tensor, cache=None, single_pass: bool = True) -> torch.Tensor:
    """Logits (n, V) predicting each token of ``cont`` (1, n) after ``prompt``, teacher-forced.

    ``cache`` None: one full-precision forward. Otherwise the prompt is prefilled into ``cache`` and
    the continuation follows token by token (``single_pass=False``: real streaming) or as one chunk
    (the cache's exact emulation of that streaming).
    """
    ids = torch.cat([prompt, cont[:, :-1]], 1)
    P = prompt.shape[1]
    if cache is None:
        return model(ids).logits[0, P - 1 :].float()
    if single_pass:
        return model(ids, cache=cache, use_cache=True).logits[0, P - 1 :].float()
    return streamed_logits(model, prompt, cont, cache)[0]


def kl_and_top1(ref_logits: torch.Tensor, logits: torch.Tensor, rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(P_ref ‖ P) in nats (float64) and top-1 agreement (bool).

    Positions (the leading dim) go ``rows`` at a time, so each float64 temporary holds ``rows ×
    vocabulary`` values (a few of them at once) instead of all positions': with Gemma-3's 262k
    vocabulary, 1024 positions at once took 2 GB per temporary.
    """
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match the reference's {tuple(ref_logits.shape)}")
    V = ref_logits.shape[-1]
    ref2, q2 = ref_logits.reshape(-1, V), logits.reshape(-1, V)  # positions as rows, whatever the leading dims
    kl = torch.zeros(ref2.shape[0], dtype=torch.float64, device=ref2.device)
    for a in range(0, ref2.shape[0], rows):
        lp_ref = F.log_softmax(ref2[a : a + rows].double(), -1)
        lp = F.log_softmax(q2[a : a + rows].double(), -1)
        kl[a : a + rows] = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp(min=0.0)
    return kl.view(ref_logits.shape[:-1]), ref_logits.argmax(-1) == logits.argmax(-1)


def common_prefixes(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Per row, the length of the common prefix of two (B, n) token batches (= position of the first
    difference); batches of different lengths are compared over the shorter one."""
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n]).long()
    return same.cumprod(1).sum(1).tolist()


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """:func:`common_prefixes` of two (1, n) rows."""
    return common_prefixes(a, b)[0]


MIN_GROWTH_TOKENS = 8  # late growth compares the 2nd and 4th quarters of the generated positions: 2+ positions each


def _quarter_means(kl: torch.Tensor) -> torch.Tensor:
    """(prompts, 2): each prompt's mean KL over the 2nd and the 4th quarter of its generated positions."""
    q = max(1, kl.shape[1] // 4)
    return torch.stack([kl[:, q : 2 * q].mean(1), kl[:, -q:].mean(1)], 1)


def late_growth(kl_rows: list[list[float]], reference_rows: list[list[float]] | None = None, boots: int = 5000,
                seed: int = 0) -> dict:
    """How a method's KL moves from the 2nd to the 4th quarter of a generation, with 95% bootstrap intervals over
    prompts (every method's KL falls in the 1st quarter, as a small model's continuations turn repetitive, so the
    1st → 4th ratio flatters them all alike):

    * ``ratio``: mean 4th-quarter KL / mean 2nd-quarter KL over the prompts, and ``ci``;
    * with ``reference_rows`` (another method on the same prompts, same order): ``vs_reference``, this ratio over
      the reference's, and ``vs_reference_ci``, resampling the same prompts for both (paired). An interval that
      holds 1 says the two grow alike within what these prompts can tell.
    """
    kl = torch.tensor(kl_rows, dtype=torch.float64)
    if kl.shape[1] < MIN_GROWTH_TOKENS:
        raise ValueError(f"late growth needs at least {MIN_GROWTH_TOKENS} generated positions (quarters of 2+), got {kl.shape[1]}")
    a = _quarter_means(kl)
    n = a.shape[0]
    idx = torch.randint(0, n, (boots, n), generator=torch.Generator().manual_seed(seed))

    def ratio(m: torch.Tensor, i: torch.Tensor) -> torch.Tensor:  # (boots,) from (prompts, 2) resampled by i
        q = m[i].mean(-2)
        return q[..., 1] / q[..., 0]

    def ci(x: torch.Tensor) -> list[float]:
        return [float(torch.quantile(x, 0.025)), float(torch.quantile(x, 0.975))]

    r = ratio(a, idx)
    out = {"ratio": float(ratio(a, torch.arange(n))), "ci": ci(r)}
    if reference_rows is not None:
        b = _quarter_means(torch.tensor(reference_rows, dtype=torch.float64))
        if b.shape[0] != n:
            raise ValueError(f"the reference has {b.shape[0]} prompts, this method {n}: compare over the same prompts")
        if not bool((b.mean(0) > 0).all()):
            raise ValueError("the reference's KL is zero in the 2nd or the 4th quarter (full precision, or lossless): "
                             "nothing to grow against; take a quantized method")
        out["vs_reference"] = out["ratio"] / float(ratio(b, torch.arange(n)))
        out["vs_reference_ci"] = ci(r / ratio(b, idx))
    return out


def late_growth_by_method(state: dict, res: dict, reference: str) -> dict[str, dict]:
    """Per reported method (``res``: :func:`report`'s result on ``state``): :func:`late_growth` of its KL against
    ``reference``'s, over the first prompts both have."""
    if reference not in res:
        raise ValueError(f"--growth-reference {reference!r} is not among the methods reported: {list(res)}")
    rows = state["rows"]
    out = {}
    for m, r in res.items():
        k = min(r["prompts"], res[reference]["prompts"])
        out[m] = late_growth([x["kl"] for x in rows[m][:k]], [x["kl"] for x in rows[reference][:k]])
    return out


def summarize(kl_rows: list[list[float]], top1_rows: list[list[bool]], prefixes: list[int]) -> dict:
    kl = torch.tensor(kl_rows, dtype=torch.float64)  # (prompts, n)
    top1 = torch.tensor(top1_rows, dtype=torch.float64)
    n = kl.shape[1]
    q = max(1, n // 4)
    first, last = float(kl[:, :q].mean()), float(kl[:, -q:].mean())
    second = float(kl[:, q : 2 * q].mean())
    if n < MIN_GROWTH_TOKENS or (second == 0 and last == 0):
        late = math.nan  # too few positions for quarters, or no error at all
    else:
        late = last / second if second > 0 else math.inf
    return {
        "mean_kl": float(kl.mean()),
        "top1": float(top1.mean()),
        "median_first_divergence": statistics.median(prefixes),
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "kl_first_quarter": first,
        "kl_last_quarter": last,
        "kl_growth": last / first if first > 0 else math.inf,  # > 1: error grows with position
        "kl_late_growth": late,  # 4th / 2nd quarter, past the 1st quarter's fall
        "kl_by_position": kl.mean(0).tolist(),
        "first_divergence": prefixes,
    }


def report(state: dict, methods: list[str], common: bool = True) -> dict:
    """Summaries of the rows ``state`` holds for ``methods``. ``common``: over the prompts every listed
    method has (a side-by-side comparison of a partial run); else each over all its own. Each summary
    records how many prompts it covers."""
    rows = state.get("rows", {})
    missing = [m for m in methods if not rows.get(m)]
    if missing:
        raise ValueError(f"no results for {missing}; the run holds {sorted(m for m, r in rows.items() if r)}")
    k = min(len(rows[m]) for m in methods) if common else None
    out = {}
    for m in methods:
        done = rows[m][:k]
        out[m] = summarize([r["kl"] for r in done], [r["top1"] for r in done], [r["prefix"] for r in done]) | {"prompts": len(done)}
    return out


def run_agreement(model, prompts: torch.Tensor, methods: list[str], calibration, cfg, new_tokens: int,
                  single_pass: bool = False, batch: int = 1, show_progress: bool = True, log=print,
                  state: dict | None = None, save=None, resolved: dict | None = None) -> dict:
    """Everything above for ``prompts`` (N, P) and every method name (see :mod:`wushkv.methods.spec`).

    ``resolved`` maps a listed name that stands for another method (``auto``) to ``(method, cfg)``: the method
    installed under that name and its own quantizer settings (the others run at ``cfg``); its results keep
    the listed name and record the method (``"method"``).

    ``batch`` prompts are decoded together (full-precision continuations, streaming, free-running);
    the reference and streamed logits of a batch take ``2 × batch × new_tokens × vocabulary`` floats.
    Batched float kernels are not batch-invariant, so a near-tie can resolve differently with another
    batch size: results agree across sizes to float precision, not bit for bit. Long runs resume: ``state`` (a
    dict, filled in place) holds the full-precision continuations and each method's per-prompt rows
    (``{"kl": [...], "top1": [...], "prefix": int}``); ``save(state)`` is called after every batch.
    Hand back a saved state for the same prompts and settings to skip what it already holds, with
    any batch size and any added methods.
    """
    from transformers import DynamicCache

    from ..methods.install import method_cache

    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    state = {} if state is None else state
    conts, rows = state.setdefault("continuations", []), state.setdefault("rows", {})
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    N = prompts.shape[0]
    t0 = time.perf_counter()
    for a in progress(range(len(conts), N, batch), desc=f"full precision (batches of {batch})", enabled=show_progress, unit="batch"):
        conts.extend(greedy(model, prompts[a : a + batch], new_tokens, DynamicCache(config=model.config)).tolist())
        if save:
            save(state)
    log(f"full-precision continuations: {N} x {new_tokens} tokens ({time.perf_counter() - t0:.0f}s)")

    # Batches outermost: the reference logits of a batch (on the unmodified model) serve every method.
    done = {name: rows.setdefault(name, []) for name in methods}
    seconds = dict.fromkeys(methods, 0.0)
    work = [(a, name) for a in range(0, N, batch) for name in methods if len(done[name]) < min(a + batch, N)]
    refs, refs_at = None, None
    for a, name in progress(work, desc="teacher-forced and free-running", enabled=show_progress, unit="batch"):
        lo, hi = len(done[name]), min(a + batch, N)  # lo > a: a saved run stopped inside this batch, or used another size
        if lo < a:
            raise RuntimeError(f"{name}: rows for prompts {lo}..{a - 1} are missing")
        if refs_at != a:
            refs = None  # free the previous batch's before computing these
            refs, refs_at = [next_token_logits(model, prompts[i : i + 1], torch.tensor([conts[i]], device=device)) for i in range(a, hi)], a
        P, Y = prompts[lo:hi], torch.tensor(conts[lo:hi], device=device)
        t0 = time.perf_counter()
        method, method_cfg = (resolved or {}).get(name, (name, cfg))
        one_pass = single_pass and not method.startswith("stock-")  # the stock cache's prefill does not see its quantization
        new = []
        with method_cache(model, calibration, method, method_cfg) as make:
            streamed = None if one_pass else streamed_logits(model, P, Y, make())
            prefixes = common_prefixes(greedy(model, P, new_tokens, make(), reference=Y), Y)
            for j in range(P.shape[0]):
                logits = next_token_logits(model, P[j : j + 1], Y[j : j + 1], make()) if one_pass else streamed[j]
                kl, top1 = kl_and_top1(refs[lo - a + j], logits)
                new.append({"kl": kl.tolist(), "top1": top1.tolist(), "prefix": prefixes[j]})
                del logits
            del streamed
        done[name].extend(new)  # whole batches only: a saved state never holds part of one
        seconds[name] += time.perf_counter() - t0
        if save:
            save(state)
    results = report(state, methods)
    for name in methods:
        r = results[name] | {"seconds": seconds[name]} | ({"method": resolved[name][0]} if name in (resolved or {}) else {})
        results[name] = r
        log(f"{name:>16}: mean KL {r['mean_kl']:.4f}  top-1 {100 * r['top1']:.1f}%  median first divergence "
            f"{r['median_first_divergence']}  KL last/first quarter {r['kl_growth']:.2f}  ({r['seconds']:.0f}s)")
    return results
