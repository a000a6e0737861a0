"""lm-evaluation-harness adapter: evaluate a model whose KV cache is wushkv's (optional extra ``wushkv[lm-eval]``).

:class:`WushLM` is a thin subclass of lm-eval's ``HFLM`` (registered as model ``"wushkv"``). It
installs the chosen transform on the model once (values folded into v_proj/o_proj, keys
transformed online) and then changes exactly two calls:

* ``_model_call`` (loglikelihood, loglikelihood_rolling, multiple choice): the forward pass gets a
  fresh :class:`~wushkv.cache.WushKVCache`, whose prefill attention is the exact single-pass
  emulation of streaming decoding (docs/reference/math.md#32-full-precision-windows-and-the-batched-flush): every scored token sees the keys and values
  quantized exactly as a decode through the cache would have them, never full-precision K/V;
* ``_model_generate`` (generate_until): ``generate`` decodes through a real packed cache, with
  the batch's left padding declared to it (each row's sink and windows count from its first real
  token).

``method="full-precision"`` changes nothing: results equal plain ``HFLM``'s exactly.

    import lm_eval
    from wushkv.lm_eval import WushLM

    lm = WushLM("smollm2-135m", method="wush", calibration="smollm2.safetensors", k_bits=2, v_bits=2)
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

or from the shell: ``wushkv lm-eval --model smollm2-135m --transform wush --calibration C --tasks hellaswag``.

Note that the full-precision windows apply here as everywhere: tokens among the first ``sink`` or
the last ``keep`` of a context stay full precision, so short prompts (most multiple-choice tasks)
see few quantized tokens unless the windows are made smaller.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import fields, replace

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"wushkv.lm_eval needs lm-evaluation-harness: pip install 'wushkv[lm-eval]' ({e})") from None

from .config import PERPLEXITY_WINDOWS, QuantConfig, WindowConfig
from .methods.install import transforms_for
from .methods.spec import FULL_PRECISION, MethodSpec, StockCache, parse, refuse_unread, spec_of

__all__ = ["WushLM"]

_DEFAULT = QuantConfig()  # the quantizer defaults live in QuantConfig only


def _given(base: QuantConfig) -> dict[str, str]:
    """{setting: ``name=value``} of ``base``'s settings that differ from :class:`WushLM`'s defaults (lm-eval's
    ``--model_args`` cannot tell a default given explicitly from one left alone, so neither does this)."""
    default = replace(_DEFAULT, windows=PERPLEXITY_WINDOWS)
    out = {}
    for f in fields(QuantConfig):
        if f.name not in ("windows", "version") and getattr(base, f.name) != getattr(default, f.name):
            value = getattr(base, f.name)
            out[f.name] = f"{f.name}={16 if value is None and f.name in ('k_bits', 'v_bits') else value}"
    for name, param in (("S_sink", "sink"), ("S_keep", "keep"), ("S_flush", "flush")):
        if getattr(base.windows, name) != getattr(default.windows, name):
            out[name] = f"{param}={getattr(base.windows, name)}"
    return out


@register_model("wushkv")
class WushLM(HFLM):
    """``HFLM`` whose forward passes and generation go through the wushkv quantized KV cache.

    Args:
        pretrained: ``smollm2-135m`` | ``gemma3-270m`` | a folder, ``.gguf`` file or hub id (loaded with
            :func:`wushkv.models.load`), or an already loaded ``PreTrainedModel`` (then pass ``tokenizer``).
        method: a wushkv transform (``wush``, ``hadamard``, ...) or ``full-precision``.
        calibration: calibration file (needed by calibrated transforms).
        k_bits, v_bits, quantizer, key_quantizer, k_clip, v_clip, k_alpha, v_alpha, clip_search, tile_clip, group_size,
            metadata_dtype: see
            :class:`~wushkv.config.QuantConfig` (its defaults); ``16`` = that side stays full precision.
        sink, keep, flush: full-precision windows (default: the perplexity windows 16/128/16).
        dtype, device, device_map: for loading by name.
        **kwargs: passed to ``HFLM`` (``batch_size``, ``max_length``, ...).
    """

    def __init__(
        self,
        pretrained="smollm2-135m",
        method: str = "wush",
        calibration: str | None = None,
        k_bits: int | str = _DEFAULT.k_bits,
        v_bits: int | str = _DEFAULT.v_bits,
        quantizer: str = _DEFAULT.quantizer,
        k_clip: float = _DEFAULT.k_clip,
        v_clip: float = _DEFAULT.v_clip,
        k_alpha: float = _DEFAULT.k_alpha,
        v_alpha: float = _DEFAULT.v_alpha,
        clip_search: int = _DEFAULT.clip_search,
        group_size: int | None = _DEFAULT.group_size,
        tile_clip: float = _DEFAULT.tile_clip,
        key_quantizer: str | None = _DEFAULT.key_quantizer,
        metadata_dtype: str = _DEFAULT.metadata_dtype,
        sink: int = PERPLEXITY_WINDOWS.S_sink,
        keep: int = PERPLEXITY_WINDOWS.S_keep,
        flush: int = PERPLEXITY_WINDOWS.S_flush,
        tokenizer=None,
        dtype: str = "float32",
        device: str = "cpu",
        device_map: str | None = None,
        **kwargs,
    ) -> None:
        from .calibration import Calibration
        from .folding import apply_transforms
        from .models import load

        m = parse(method)
        if not isinstance(m, (MethodSpec, StockCache)) and m is not FULL_PRECISION:
            spec_of(m)  # auto: says which commands resolve it
        if isinstance(m, StockCache):
            raise ValueError(
                f"method {method!r}: the stock QuantizedCache attends to full-precision keys and values in prefill, so "
                "loglikelihood tasks would not see its quantization; WushLM accepts wushkv transforms and 'full-precision'"
            )
        # the settings, checked before the model loads: one the method does not read is refused, not ignored
        bits = [None if str(b).lower() in ("16", "fp", "none") else int(b) for b in (k_bits, v_bits)]
        base = QuantConfig(
            k_bits=bits[0], v_bits=bits[1], quantizer=quantizer, k_clip=float(k_clip), v_clip=float(v_clip),
            k_alpha=float(k_alpha), v_alpha=float(v_alpha), clip_search=int(clip_search), group_size=None if group_size in (None, "") else int(group_size),
            tile_clip=float(tile_clip), key_quantizer=key_quantizer or None, metadata_dtype=str(metadata_dtype),
            windows=WindowConfig(int(sink), int(keep), int(flush)),
        )
        refuse_unread([(m, base)], _given(base), none_read=f"method={method!r} quantizes nothing; drop the setting")
        if isinstance(pretrained, str):
            model, tok = load(pretrained, dtype=dtype, device=device, device_map=device_map)
            tokenizer = tokenizer if tokenizer is not None else tok
        else:
            model = pretrained
            if tokenizer is None:
                raise ValueError("pass `tokenizer` together with a loaded model as `pretrained`")
        kwargs.pop("backend", None)
        super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", **kwargs)

        self.method = method
        self.quant_config = None
        self._stack = ExitStack()
        if m is not FULL_PRECISION:
            self.quant_config = m.quant_config(base)
            cal = Calibration.load(calibration, self.model) if calibration else None
            self._installed = self._stack.enter_context(apply_transforms(self.model, transforms_for(self.model, cal, m), m.name))

    def close(self) -> None:
        """Restore the model's original weights (undo the folding)."""
        self._stack.close()

    def new_cache(self, attention_mask: torch.Tensor | None = None):
        """A fresh quantized cache (None at full precision); ``attention_mask`` declares left padding."""
        if self.quant_config is None:
            return None
        if attention_mask is not None and bool((attention_mask == 0).any()):
            return self._installed.cache(self.quant_config, attention_mask=attention_mask)
        return self._installed.cache(self.quant_config)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        cache = self.new_cache()
        if cache is None:
            return super()._model_call(inps, attn_mask, labels)
        # Right padding (lm-eval pads loglikelihood batches on the right) never reaches a real token:
        # each query sees only earlier positions, quantized as streaming would have them.
        with torch.no_grad():
            return self.model(inps, cache=cache, use_cache=True).logits

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        cache = self.new_cache(generation_kwargs.get("attention_mask"))
        if cache is not None:
            generation_kwargs["cache"] = cache
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["wushkv"] = {"method": self.method, "quantization": self.quant_config.to_dict() if self.quant_config else None}
        return info
