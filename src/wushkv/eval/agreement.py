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
    """``n`` greedy tokens after ``prompt`` (1, P) through ``cache`` (EOS ignored). Returns (1, ≤ n).

    With ``reference`` (1, n), generation stops at the first token that differs from it (that token
    is the last returned): all a first-divergence measurement needs, without decoding the rest. The
    prompt's logits are computed for its last position only.
    """
    logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    out = []
    for i in range(n):
        t = logits.argmax(-1, keepdim=True)
        out.append(t)
        if reference is not None and int(t) != int(reference[0, i]):
            break
        if i + 1 < n:
            logits = model(t, cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(out, 1)


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
    out = [model(prompt, cache=cache, use_cache=True).logits[0, -1:]]
    for t in range(cont.shape[1] - 1):
        out.append(model(cont[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1:])
    return torch.cat(out).float()


def kl_and_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(P_ref ‖ P) in nats (float64) and top-1 agreement (bool)."""
    lp_ref = F.log_softmax(ref_logits.double(), -1)
    lp = F.log_softmax(logits.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp(min=0.0)
    return kl, ref_logits.argmax(-1) == logits.argmax(-1)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two (1, n) token rows (= position of the first difference);
    rows of different lengths are compared over the shorter one."""
    n = min(a.shape[1], b.shape[1])
    diff = (a[0, :n] != b[0, :n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def summarize(kl_rows: list[list[float]], top1_rows: list[list[bool]], prefixes: list[int]) -> dict:
    kl = torch.tensor(kl_rows, dtype=torch.float64)  # (prompts, n)
    top1 = torch.tensor(top1_rows, dtype=torch.float64)
    n = kl.shape[1]
    q = max(1, n // 4)
    first, last = float(kl[:, :q].mean()), float(kl[:, -q:].mean())
    return {
        "mean_kl": float(kl.mean()),
        "top1": float(top1.mean()),
        "median_first_divergence": statistics.median(prefixes),
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "kl_first_quarter": first,
        "kl_last_quarter": last,
        "kl_growth": last / first if first > 0 else math.inf,  # > 1: error grows with position
        "kl_by_position": kl.mean(0).tolist(),
        "first_divergence": prefixes,
    }


def run_agreement(model, prompts: torch.Tensor, methods: list[str], calibration, cfg, new_tokens: int,
                  single_pass: bool = False, show_progress: bool = True, log=print,
                  state: dict | None = None, save=None) -> dict:
    """Everything above for ``prompts`` (N, P) and every method name (see :mod:`wushkv.eval.methods`).

    Long runs resume: ``state`` (a dict, filled in place) holds the full-precision continuations and
    each method's per-prompt rows (``{"kl": [...], "top1": [...], "prefix": int}``); ``save(state)`` is
    called after every prompt. Hand back a saved state for the same prompts and settings to skip
    what it already holds.
    """
    from transformers import DynamicCache

    from .methods import method_cache

    state = {} if state is None else state
    conts, rows = state.setdefault("continuations", []), state.setdefault("rows", {})
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    t0 = time.perf_counter()
    for i in progress(range(len(conts), prompts.shape[0]), desc="full precision", enabled=show_progress, unit="prompt"):
        conts.append(greedy(model, prompts[i : i + 1], new_tokens, DynamicCache(config=model.config))[0].tolist())
        if save:
            save(state)
    log(f"full-precision continuations: {prompts.shape[0]} x {new_tokens} tokens ({time.perf_counter() - t0:.0f}s)")
    refs: dict[int, torch.Tensor] = {}  # fp logits per prompt, recomputed (one forward) rather than stored

    def ref_logits(i):
        if i not in refs:
            refs[i] = next_token_logits(model, prompts[i : i + 1], torch.tensor([conts[i]], device=device))
        return refs[i]

    results = {}
    for name in methods:
        done = rows.setdefault(name, [])
        t0 = time.perf_counter()
        if len(done) < prompts.shape[0]:
            with method_cache(model, calibration, name, cfg) as make:
                for i in progress(range(len(done), prompts.shape[0]), desc=name, enabled=show_progress, unit="prompt"):
                    p, y = prompts[i : i + 1], torch.tensor([conts[i]], device=device)
                    logits = next_token_logits(model, p, y, make(), single_pass=single_pass and not name.startswith("stock-"))
                    kl, top1 = kl_and_top1(ref_logits(i), logits)
                    prefix = common_prefix(greedy(model, p, new_tokens, make(), reference=y), y)
                    done.append({"kl": kl.tolist(), "top1": top1.tolist(), "prefix": prefix})
                    if save:
                        save(state)
        results[name] = summarize([r["kl"] for r in done], [r["top1"] for r in done], [r["prefix"] for r in done]) | {
            "seconds": time.perf_counter() - t0}
        r = results[name]
        log(f"{name:>16}: mean KL {r['mean_kl']:.4f}  top-1 {100 * r['top1']:.1f}%  median first divergence "
            f"{r['median_first_divergence']}  KL last/first quarter {r['kl_growth']:.2f}  ({r['seconds']:.0f}s)")
    return results
