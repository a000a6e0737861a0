"""The transformers integration: wushkv attention plugged in through ``AttentionInterface``.

One registered function, ``"wushkv"``, does three jobs, decided by what it is handed:

* a :class:`~wushkv.views.LayerView` from the wushkv cache as ``key``: attention over the quantized
  cache (exact single-pass emulation of streaming decoding in prefill, [sink; dequantized middle;
  recent] in decode);
* plain tensors: full-precision attention, with the online key transform of the module (if one is
  installed by :func:`wushkv.folding.apply_transforms`) applied to keys (``k' = T_K k``) and queries
  (``q' = T_K^{-T} q``), which leaves ``qᵀk`` unchanged;
* a ``wushkv_observer`` keyword (calibration, reconstruction): the observer sees the raw queries,
  keys and values of every layer before attention runs.

A boolean mask function is registered under the same name: transformers builds no mask at all for an
unknown name, which would make attention silently non-causal.

The math is :mod:`wushkv.attention`'s. Shapes: queries ``(B, Hq, T, d)``, keys/values
``(B, Hkv, S, d)``, ``Hq = G·Hkv`` with query head ``g`` reading KV head ``g // G`` (transformers'
``repeat_kv`` order).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .attention import as_allowed, fast_attention
from .views import LayerView
from .models import attention_modules
from .progress import progress

ATTN_IMPLEMENTATION = "wushkv"
_log = logging.get_logger(__name__)


def wushkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """The registered attention function (signature of transformers' ``AttentionInterface``)."""
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kwargs.get("output_attentions", False):  # (as transformers' sdpa says it: an empty tuple is no answer)
        _log.warning_once("wushkv attention computes no attention weights (output_attentions=True gets None for each "
                          "layer); it attends over packed codes, block by block, and never forms the full matrix")
    if softcap is None:
        softcap = getattr(module, "attn_logit_softcapping", None)
    sinks = kwargs.get("s_aux")  # learned per-query-head sink logits (gpt-oss): one more softmax column, zero value
    if isinstance(key, LayerView):
        return key.attend(module, query, attention_mask, scaling, softcap, sinks), None
    observer = kwargs.get("wushkv_observer")
    if observer is not None:
        observer.observe(module, query, key, value, as_allowed(attention_mask, key.shape[-2]), scaling, softcap, sinks=sinks)
    transform = getattr(module, "wushkv_key", None)
    if transform is not None:
        query, key = transform.queries(query), transform.keys(key)
    return fast_attention(query, key, value, as_allowed(attention_mask, key.shape[-2]), scaling, softcap, sinks), None


def _bool_mask(*args, **kwargs):
    """transformers' boolean mask (True = attend). None, no mask, only where transformers may skip it and there is one
    query position: full attention without padding, every column visible, so a decode step reads no mask at all. A
    chunk of several queries always gets its causal mask, which the single-pass emulation reads."""
    from transformers.masking_utils import sdpa_mask

    skip = kwargs.pop("allow_is_causal_skip", True) and kwargs.get("q_length") == 1
    return sdpa_mask(*args, allow_is_causal_skip=skip, **kwargs)


def register() -> str:
    """Register the ``"wushkv"`` attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, wushkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _bool_mask)
    return ATTN_IMPLEMENTATION


def use_wushkv_attention(model) -> str:
    """Switch ``model`` to the wushkv attention; returns the previous implementation name."""
    register()
    previous = model.config._attn_implementation
    if previous != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return previous


def restore_attention(model, previous: str) -> None:
    if previous and model.config._attn_implementation != previous:
        model.set_attn_implementation(previous)


@torch.no_grad()
def observe_sequences(model, sequences: torch.Tensor, observer, desc: str, show_progress: bool = True) -> None:
    """Run ``model`` over ``sequences`` (N, L), one at a time, with ``observer.observe`` seeing every
    layer's raw queries, keys and values. The model must carry no installed transforms; its attention
    implementation is restored afterwards, also on error."""
    if any(hasattr(a, "wushkv_key") for a in attention_modules(model)):
        raise RuntimeError(f"{desc}: run on the original model (transforms are installed; call restore() first)")
    device = next(model.parameters()).device
    previous = use_wushkv_attention(model)
    try:
        for i in progress(range(sequences.shape[0]), desc=desc, enabled=show_progress, unit="seq"):
            model(sequences[i : i + 1].to(device), use_cache=False, wushkv_observer=observer)
    finally:
        restore_attention(model, previous)
