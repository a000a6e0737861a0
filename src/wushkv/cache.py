"""The wushkv quantized KV cache: a ``transformers`` ``Cache`` of :class:`~wushkv.layer.WushKVLayer` layers.

Creating it switches the model to the ``"wushkv"`` attention (:mod:`wushkv.hf`), which reads each
layer's view; the layout of a layer (full-precision sink, packed quantized middle, full-precision
recent buffer) and the attention over it are :mod:`wushkv.layer`'s.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache

from .config import QuantConfig
from .hf import use_wushkv_attention
from .layer import NO_INPUTS, CacheInputs, WushKVLayer, left_padding
from .models import ATTENTION_LAYER_TYPES, attention_modules, describe, require_materialized

__all__ = ["WushKVCache"]


class WushKVCache(Cache):
    """Quantized KV cache for ``model`` (any family :mod:`wushkv.models` supports).

    ``config``: one :class:`QuantConfig` for every layer, or a list with one per layer (bit allocation).
    Creating the cache switches the model to the ``"wushkv"`` attention, which is what reads it, and
    takes each layer's key transform from :func:`wushkv.folding.apply_transforms` (if installed).
    ``inputs``: per layer, what the cache needs of the installed method besides ``config``
    (:class:`~wushkv.layer.CacheInputs`: error-feedback matrices, the rotating key mean), explicitly;
    :meth:`wushkv.folding.Installed.cache` passes the installed method's. None: plain rounding.

    Left-padded batches: pass the prompt's 2-D ``attention_mask`` (or ``pad_lengths``, one per row) so
    that each row's sink and windows start at its first real token; every row then gets what it would
    get alone. Per-token quantizers (quest, affine) share one store across rows; quantizers of token
    blocks (KVarN's tiles, ``+ktiles``, KIVI) keep ragged rows (each row's tokens from its own column), a decode step
    of the whole batch in one call, prompts and chunks row by row.

    Hybrid models (LFM2): ``config`` and ``inputs`` have one entry per *attention* layer (``describe(model).num_layers``);
    a decoder layer without attention (convolution, linear attention) gets transformers' own cache layer for its
    type, untouched (its state is a fixed-size recurrence, not a per-token cache: nothing to quantize).
    """

    def __init__(
        self,
        model,
        config: QuantConfig | list[QuantConfig] | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        pad_lengths=None,
        inputs: list[CacheInputs] | None = None,
    ):
        bad = next((c for c in (config if isinstance(config, (list, tuple)) else [config])
                    if c is not None and not isinstance(c, QuantConfig)), None)
        if bad is not None:
            raise ValueError(f"config must be a QuantConfig, or a list of one per attention layer; got {type(bad).__name__} "
                             f"{bad!r:.80}")
        require_materialized(model, "a WushKVCache")
        spec = describe(model)
        configs = list(config) if isinstance(config, (list, tuple)) else [config or QuantConfig()] * spec.num_layers
        if len(configs) != spec.num_layers:
            raise ValueError(f"got {len(configs)} per-layer configs for a model with {spec.num_layers} layers")
        inputs = [NO_INPUTS] * spec.num_layers if inputs is None else list(inputs)
        if len(inputs) != spec.num_layers:
            raise ValueError(f"got cache inputs for {len(inputs)} layers, the model has {spec.num_layers}")
        use_wushkv_attention(model)
        layers = [None if t in ATTENTION_LAYER_TYPES else DYNAMIC_LAYER_TYPE_MAPPING[t]() for t in spec.decoder_layer_types]
        for i, attn in enumerate(attention_modules(model, spec)):
            kt = getattr(attn, "wushkv_key", None)
            sliding = spec.sliding_window if spec.layer_types[i] == "sliding_attention" else None
            layers[spec.attention_layers[i]] = WushKVLayer(configs[i], spec.head_dim, kt, sliding, inputs[i])
        super().__init__(layers=layers)
        self.configs = configs
        order = spec.attention_layers  # each attention layer's predecessor in a step (the first's: the last), for update
        self._before = {i: (k, order[k - 1]) for k, i in enumerate(order)}
        if attention_mask is not None:
            if pad_lengths is not None:
                raise ValueError("give attention_mask or pad_lengths, not both")
            pad_lengths = left_padding(attention_mask)
        if pad_lengths is not None:
            for layer in self.quantized_layers:
                layer.set_padding(pad_lengths)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last tokens from every layer, or from none. Where every attention layer can take them back
        with no trace (``WushKVLayer.take_back``: back to what the last update coded, of a prompt up to ``UNDO_TOKENS``
        tokens; sliding windows only while recording their past, no padding), the cache is then what appending the
        tokens kept would have made: assisted
        decoding's crop of the drafts it rejects, after which it decodes as decoding alone does. Else each layer
        removes its full-precision tail (``WushKVLayer.crop``; what was coded stays coded), all of them checked
        before any changes (layers differ in what they can crop: sliding windows, per-layer configurations)."""
        layers = self.quantized_layers
        if layers and all(layer.can_take_back(tokens_to_remove) for layer in layers):
            for layer in self.layers:
                if isinstance(layer, WushKVLayer):
                    layer.take_back(tokens_to_remove)
                else:  # a hybrid's convolution or recurrent state: transformers' own
                    layer.crop(tokens_to_remove)
            return
        for layer in layers:
            layer._crop_plan(tokens_to_remove)
        super().crop(tokens_to_remove)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``, once the layer's length is checked against the step: a step updates every
        attention layer in order with the same tokens, so a layer whose length does not follow from the one before it
        (the first: from the last's) was left behind by a step that stopped part-way (an error raised in an earlier
        forward, after some layers took its tokens). That cannot be undone, and going on would attend over layers of
        different lengths, so it is refused."""
        layer = self.layers[layer_idx]
        if isinstance(layer, WushKVLayer):
            k, before = self._before[layer_idx]  # the attention layer before it in a step (the first's: the last)
            if layer.n != (self.layers[before].n - (key_states.shape[-2] if k else 0)):
                lengths = [other.n for other in self.quantized_layers]
                raise RuntimeError(
                    f"this WushKVCache's attention layers hold {lengths} tokens: a step stopped part-way (an error in "
                    "an earlier forward, after some layers had taken its tokens), which cannot be undone; create a new "
                    "WushKVCache, or reset() this one"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def quantized_layers(self) -> list[WushKVLayer]:
        """The cache's attention layers, in order (every layer but those of a hybrid's non-attention decoder layers)."""
        return [layer for layer in self.layers if isinstance(layer, WushKVLayer)]

    def nbytes(self) -> dict[str, int]:
        """Bytes actually held by the attention layers: packed codes, metadata (scales/offsets), full-precision
        windows, total (a hybrid's convolution or recurrent states are not counted: they do not grow with the context)."""
        tot = {"codes": 0, "metadata": 0, "full_precision": 0}
        for layer in self.quantized_layers:
            for k, v in layer.nbytes().items():
                tot[k] += v
        tot["total"] = sum(tot.values())
        return tot

    def full_precision_nbytes(self, torch_dtype_size: int = 2) -> int:
        """Bytes a ``DynamicCache`` (sliding layers: ``DynamicSlidingWindowLayer``) would hold for the same tokens."""
        total = 0
        for layer in self.quantized_layers:
            if layer.is_initialized:
                B, H, _, d = layer.sink_k.shape
                total += 2 * B * H * d * torch_dtype_size * (layer.n - layer._first_visible(layer.n))
        return total
