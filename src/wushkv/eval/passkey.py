"""Passkey retrieval: a random number hidden in filler text at a given depth; the model must repeat it.

The standard test (Mohtashami & Jaggi, 2023, "Landmark Attention"), generated locally and
deterministically: the key and the prompt depend only on (seed, context, depth, trial). Prompts are
assembled from token pieces (intro, filler, needle, filler, question) so that every prompt has
exactly ``context`` tokens and the needle starts at ``depth`` of the filler.
"""

from __future__ import annotations

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


def run_passkey(model, tokenizer, methods: list[str], calibration, cfg, contexts: list[int], depths: list[float],
                trials: int, seed: int = 0, new_tokens: int = 8, show_progress: bool = True, log=print) -> dict:
    """Accuracy per (method, context, depth); ``full-precision`` is the ceiling. Prompts are built once."""
    from .agreement import greedy
    from .methods import method_cache

    device = next(model.parameters()).device
    cases = [(c, d, t) for c in contexts for d in depths for t in range(trials)]
    prompts = {k: passkey_prompt(tokenizer, k[0], k[1], trial_seed(seed, *k)) for k in cases}
    out = {}
    for name in methods:
        t0 = time.perf_counter()
        hits = {}
        with method_cache(model, calibration, name, cfg) as make:
            for case in progress(cases, desc=name, enabled=show_progress, unit="prompt"):
                ids, key = prompts[case]
                gen = greedy(model, ids.to(device), new_tokens, make())
                got = answer_key(tokenizer.decode(gen[0], skip_special_tokens=True))
                hits.setdefault(f"{case[0]}/{case[1]}", []).append(got == key)
        acc = {k: sum(v) / len(v) for k, v in hits.items()}
        out[name] = {"accuracy": acc, "mean": sum(acc.values()) / len(acc), "seconds": time.perf_counter() - t0}
        log(f"{name:>16}: mean accuracy {100 * out[name]['mean']:.1f}% ({out[name]['seconds']:.0f}s)")
    return out
