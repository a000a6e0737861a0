"""Passkey retrieval: a random number hidden in filler text at a given depth; the model must repeat it.

The standard test (Mohtashami & Jaggi, 2023, "Landmark Attention"), generated locally and
deterministically: the key and the prompt depend only on (seed, context, depth, trial). Prompts are
assembled from token pieces (intro, filler, needle, filler, question) so that every prompt has
exactly ``context`` tokens and the needle starts at ``depth`` of the filler.

The filler is the same in every trial; trials differ only in the key, so the trials of one cell are
far from independent: a method that tips the model from the key to prose at one needle position
tends to do so for every key there. Each case therefore also records the teacher-forced
log-probability of the right answer, a continuous score that shows how far a method moved the model
where a hit only shows which side of the edge it landed on.
"""

from __future__ import annotations

import copy
import hashlib
import random
import re
import time

import torch

from ..progress import progress

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information there.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


def trial_seed(seed: int, context: int, depth: float, trial: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{context}/{depth:.6f}/{trial}".encode()).digest()[:8], "little")


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if torch.is_tensor(ids):
        ids = ids.reshape(-1).tolist()
    elif ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids)


def passkey_prompt(tokenizer, context: int, depth: float, seed: int) -> tuple[torch.Tensor, int]:
    """(ids (1, context), key): a 5-digit key at ``depth`` ∈ [0, 1] of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = random.Random(seed).randint(10000, 99999)
    enc = lambda s: _encode(tokenizer, s)  # noqa: E731
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    head, needle, question = bos + enc(INTRO), enc(NEEDLE.format(key=key)), enc(QUESTION)
    n_fill = context - len(head) - len(needle) - len(question)
    if n_fill < 16:
        raise ValueError(f"context {context} is too short for the passkey prompt (needs at least {context - n_fill + 16} tokens)")
    unit = enc(FILLER)
    filler = (unit * (n_fill // len(unit) + 1))[:n_fill]
    cut = round(depth * n_fill)
    ids = head + filler[:cut] + needle + filler[cut:] + question
    assert len(ids) == context
    return torch.tensor([ids]), key


def answer_key(text: str) -> int | None:
    """The first integer of the model's answer, or None."""
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


def key_tokens(tokenizer, key: int) -> list[int]:
    """The tokens of the right answer, ``" {key}"``, as they follow the prompt's question: taken from the
    encoding of question + answer (a tokenizer that marks word starts would encode ``" {key}"`` alone
    with a spurious extra space)."""
    q = _encode(tokenizer, QUESTION)
    full = _encode(tokenizer, QUESTION + f" {key}")
    if full[: len(q)] != q or len(full) == len(q):
        raise ValueError(f"this tokenizer merges the question's last token with the answer {key}; cannot score the answer")
    return full[len(q) :]


@torch.no_grad()
def answer_and_logprob(model, ids: torch.Tensor, answer: list[int], new_tokens: int, make_cache) -> tuple[torch.Tensor, float]:
    """(greedy tokens (1, ≤ new_tokens), log P(answer | prompt) in nats), from one prefill of ``ids``.

    The log-probability is teacher-forced: the answer's tokens are fed one by one (real streaming)
    into a copy of the cache taken after the prompt, so it is what the cache gives the right answer
    whatever the model generates. Unlike a hit, it moves smoothly: a small model often ranks the
    key a few tenths of a nat above or below prose ("a key that is used to..."), and a hit flips on
    that. The copy doubles the cache's memory for a moment; a cache that cannot be copied is filled
    again from the prompt instead (twice the prefill time).
    """
    if not answer:
        raise ValueError("the answer has no tokens")
    cache = make_cache()
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    try:
        fork, first = copy.deepcopy(cache), logits
    except torch.OutOfMemoryError:
        raise
    except (TypeError, RuntimeError, NotImplementedError, copy.Error):  # state that cannot be copied: prefill again
        fork = make_cache()
        first = model(ids, cache=fork, use_cache=True, logits_to_keep=1).logits[:, -1]
    lp, step = 0.0, first
    for i, t in enumerate(answer):
        lp += torch.log_softmax(step[0].double(), -1)[t].item()
        if i + 1 < len(answer):
            step = model(torch.tensor([[t]], device=ids.device), cache=fork, use_cache=True).logits[:, -1]
    del fork
    from .agreement import greedy_from

    return greedy_from(model, logits, new_tokens, cache), lp


def _mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _entry(v) -> dict:
    """A case's stored result; files from before log-probabilities held a bare hit."""
    return v if isinstance(v, dict) else {"hit": bool(v)}


def case_key(context: int, depth: float, trial: int) -> str:
    return f"{context}/{depth:g}/{trial}"


def run_passkey(model, tokenizer, methods: list[str], calibration, cfg, contexts: list[int], depths: list[float],
                trials: int, seed: int = 0, new_tokens: int = 8, show_progress: bool = True, log=print,
                state: dict | None = None, save=None, resolved: dict | None = None) -> dict:
    """Accuracy per (method, context, depth); ``full-precision`` is the ceiling.

    ``resolved`` maps a listed name that stands for another method (``auto``) to ``(method, cfg)``: the method
    installed under that name and its own quantizer settings (the others run at ``cfg``); its results keep
    the listed name and record the method (``"method"``).

    Contexts run shortest first, every method at one context before the next, so a partial run
    already holds whole columns of the table. Long runs resume: ``state`` (filled in place) maps
    method -> case (``context/depth/trial``) -> hit, and ``save(state)`` is called after every prompt.
    Returns, per method, the accuracy per ``context/depth`` cell over the cases done.
    """
    from ..methods.install import method_cache

    device = next(model.parameters()).device
    state = {} if state is None else state
    hits = {name: state.setdefault(name, {}) for name in methods}
    seconds = dict.fromkeys(methods, 0.0)
    for c in contexts:  # bad contexts or depths fail before any work
        for d in depths:
            passkey_prompt(tokenizer, c, d, 0)
    for c in sorted(contexts):
        cases = [(c, d, t) for d in depths for t in range(trials)]
        for name in methods:
            # cases stored by older versions (a bare hit) stay done: their cells get no log-probability
            todo = [k for k in cases if case_key(*k) not in hits[name]]
            if not todo:
                continue
            t0 = time.perf_counter()
            method, method_cfg = (resolved or {}).get(name, (name, cfg))
            with method_cache(model, calibration, method, method_cfg) as make:
                for case in progress(todo, desc=f"{name} {c}", enabled=show_progress, unit="prompt"):
                    ids, key = passkey_prompt(tokenizer, case[0], case[1], trial_seed(seed, *case))
                    gen, lp = answer_and_logprob(model, ids.to(device), key_tokens(tokenizer, key), new_tokens, make)
                    hit = answer_key(tokenizer.decode(gen[0], skip_special_tokens=True)) == key
                    hits[name][case_key(*case)] = {"hit": hit, "logprob": lp}
                    if save:
                        save(state)
            seconds[name] += time.perf_counter() - t0
    out = {}
    for name in methods:
        cells, lps = {}, {}
        for c in contexts:
            for d in depths:
                got = [_entry(hits[name][k]) for t in range(trials) if (k := case_key(c, d, t)) in hits[name]]
                if got:
                    cells[f"{c}/{d}"] = _mean([g["hit"] for g in got])
                    if all("logprob" in g for g in got):
                        lps[f"{c}/{d}"] = _mean([g["logprob"] for g in got])
        out[name] = {"accuracy": cells, "mean": _mean(list(cells.values())),
                     "logprob": lps, "logprob_mean": _mean(list(lps.values())), "seconds": seconds[name]}
        if name in (resolved or {}):
            out[name]["method"] = resolved[name][0]
        log(f"{name:>16}: mean accuracy {100 * out[name]['mean']:.1f}%, mean log P(key) {out[name]['logprob_mean']:.3f} "
            f"({out[name]['seconds']:.0f}s)")
    return out
