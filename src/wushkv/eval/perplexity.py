"""GPTQ-style perplexity: non-overlapping chunks, PPL = exp(mean token NLL).

With a quantized-cache factory, every chunk runs through a fresh wushkv cache whose prefill attention
is the exact single-pass emulation of streaming decoding (docs/reference/math.md#32-full-precision-windows-and-the-batched-flush), so the score truly sees the
quantized keys and values.

Beside the NLL, a run can measure how far the quantized model's next-token distributions are from full precision's:
the mean KL(P_fp ‖ P_q) per position, against a :class:`Reference` that the full-precision pass keeps (its
``top`` most likely tokens per position and the rest as one outcome). The NLL's change mixes the damage with chance
(a 3-bit cache lowers the NLL of some chunks); the KL is the damage alone, and separates recipes on every chunk
where the NLL cannot (docs/lab/selection-by-kl.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..progress import progress


# Full precision's most likely tokens kept per position for the KL (:class:`Reference`): over them and the rest as one
# outcome, the KL of a 2-3-bit cache is 86-89% of the whole KL on SmolLM2 (49k-token vocabulary) and Gemma-3 (262k),
# the same share at both widths (docs/lab/selection-by-kl.md), and a chunk of 2048 positions keeps 6 MB instead of the
# 2 GB of Gemma-3's logits.
REFERENCE_TOP = 256
_ROWS = 256  # positions per block when a (rows x vocabulary) float32 temporary is needed


@dataclass(frozen=True)
class Reference:
    """Full precision's next-token distribution at each predicted position of one chunk, coarse-grained to its ``k``
    most likely tokens and one outcome for the rest of the vocabulary.

    ``ids`` (T, k) int32 token ids, most likely first; ``logp`` (T, k) float32 their log-probabilities; ``log_rest`` (T,)
    float64 the log of the mass outside them (-inf where there is none: ``k`` covers the vocabulary). The KL to it
    (:func:`coarse_kl`) is KL(P_fp ‖ P_q) over these k + 1 outcomes: exact when k covers the vocabulary, otherwise a
    lower bound of the full KL (merging outcomes never raises a KL), off by the rest's share of the divergence."""

    ids: torch.Tensor
    logp: torch.Tensor
    log_rest: torch.Tensor

    @staticmethod
    def of(logits: torch.Tensor, k: int = REFERENCE_TOP) -> "Reference":
        """The reference of full-precision ``logits`` (T, V)."""
        if k < 1:
            raise ValueError(f"a reference keeps k >= 1 tokens per position, got {k}")
        k = min(k, logits.shape[-1])
        ids, logp, rest = [], [], []
        for a in range(0, logits.shape[0], _ROWS):
            lp = F.log_softmax(logits[a : a + _ROWS].float(), -1)
            top = lp.topk(k, -1)
            ids.append(top.indices.to(torch.int32).cpu())
            logp.append(top.values.cpu())
            rest.append(_log_rest(lp, top.indices).cpu())
        return Reference(torch.cat(ids), torch.cat(logp), torch.cat(rest))


def _log_rest(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per row of log-probabilities ``logp`` (rows, V), the log of the mass outside the columns ``ids`` (rows, k), as a
    log-sum-exp over the other columns (float64; -inf where ``ids`` cover the vocabulary). Not 1 - sum(top): that
    cancels to float32 rounding where the top holds nearly all the mass."""
    return torch.logsumexp(logp.scatter(-1, ids, -math.inf), -1).double()


def coarse_kl(ref: Reference, logits: torch.Tensor) -> torch.Tensor:
    """Per position, KL(P_ref ‖ P) in nats (float64) over ``ref``'s outcomes (its k tokens and the rest) of the
    distributions of ``logits`` (T, V): exact when the reference covers the vocabulary, a lower bound otherwise."""
    if logits.shape[0] != ref.ids.shape[0]:
        raise ValueError(f"logits for {logits.shape[0]} positions against a reference of {ref.ids.shape[0]}")
    out = torch.empty(logits.shape[0], dtype=torch.float64)
    for a in range(0, logits.shape[0], _ROWS):
        b = min(a + _ROWS, logits.shape[0])
        ids = ref.ids[a:b].long().to(logits.device)
        lq_all = F.log_softmax(logits[a:b].float(), -1)
        lq, rest_q = lq_all.gather(-1, ids).cpu().double(), _log_rest(lq_all, ids).cpu()
        lp, rest_p = ref.logp[a:b].double(), ref.log_rest[a:b]
        kl = (lp.exp() * (lp - lq)).sum(-1)
        # the rest as one outcome; a rest of mass 0 (the top covers the vocabulary) contributes 0
        kl = kl + torch.where(torch.isfinite(rest_p), rest_p.exp() * (rest_p - rest_q), torch.zeros_like(kl))
        out[a:b] = kl.clamp(min=0.0)  # >= 0 in exact arithmetic; float32 log-probs can leave -1e-9
    return out


@torch.no_grad()
def chunk_logits(model, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
    """The model's logits (B, L, V) over ``input_ids`` [B, L], through ``cache`` when given."""
    device = next(model.parameters()).device
    kwargs = {"use_cache": cache is not None}
    if cache is not None:
        kwargs["cache"] = cache
    return model(input_ids.to(device), **kwargs).logits


def _nll(logits: torch.Tensor, input_ids: torch.Tensor) -> float:
    """Summed next-token NLL (float64) of ``input_ids`` [B, L] under ``logits`` (B, L, V)."""
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1).to(logits.device),
                                 reduction="sum").double())


def perplexity(
    model,
    chunks: torch.Tensor,
    cache_factory: Callable[[], object] | None = None,
    show_progress: bool = True,
    desc: str = "ppl",
    reference: list[Reference] | None = None,
    keep_reference: int = 0,
) -> dict:
    """Perplexity of ``model`` over ``chunks`` [N, L] (int64 token ids).

    ``cache_factory`` returns a fresh cache per chunk (None: full precision, no cache).
    Returns ``{"ppl", "nll", "chunk_nll", "tokens", "chunks", "seconds"}`` with ``nll`` the mean token NLL
    and ``chunk_nll`` the mean token NLL of each chunk (for paired comparisons over chunks).
    ``reference`` (one :class:`Reference` per chunk, from a full-precision run): also ``"kl"`` and ``"chunk_kl"``, the
    mean KL(P_ref ‖ P) per position over all chunks and per chunk (:func:`coarse_kl`). ``keep_reference`` = k > 0: also
    ``"reference"``, this run's own distributions, one :class:`Reference` of k tokens per chunk.
    """
    if reference is not None and len(reference) != chunks.shape[0]:
        raise ValueError(f"a reference of {len(reference)} chunks for {chunks.shape[0]} chunks")
    total, count, per_chunk, kl_sum, per_chunk_kl, kept = 0.0, 0, [], 0.0, [], []
    t0 = time.perf_counter()
    for i in progress(range(chunks.shape[0]), desc=desc, enabled=show_progress, unit="chunk"):
        cache = cache_factory() if cache_factory is not None else None
        ids = chunks[i : i + 1]
        logits = chunk_logits(model, ids, cache)
        s, n = _nll(logits, ids), ids[:, 1:].numel()
        total += s
        count += n
        per_chunk.append(s / n)
        positions = logits[:, :-1].reshape(-1, logits.shape[-1])
        if reference is not None:
            kl = coarse_kl(reference[i], positions)
            kl_sum += float(kl.sum())
            per_chunk_kl.append(float(kl.mean()))
        if keep_reference:
            kept.append(Reference.of(positions, keep_reference))
        del logits, positions
    mean = total / count
    out = {"ppl": math.exp(mean), "nll": mean, "chunk_nll": per_chunk, "tokens": count, "chunks": int(chunks.shape[0]),
           "seconds": time.perf_counter() - t0}
    if reference is not None:
        out["kl"], out["chunk_kl"] = kl_sum / count, per_chunk_kl
    if keep_reference:
        out["reference"] = kept
    return out
