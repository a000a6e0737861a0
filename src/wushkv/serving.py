"""A model folder a serving engine loads as an ordinary Hugging Face checkpoint, with the method in a side file.

:func:`export_model` writes, for one method and quantizer setting (docs/reference/formats.md, "Served model folder")::

    DIR/config.json, generation_config.json, model.safetensors, tokenizer files    the model, T_V folded into v_proj/o_proj
    DIR/wushkv/kv_cache.safetensors                                               per layer: the key transforms, ...
    DIR/wushkv/kv_cache.json                                                      its metadata, readable (checksummed)

The value transform costs an engine nothing: ``v_proj ← T_V·v_proj`` and ``o_proj ← o_proj·T_V⁻¹`` per KV head, so the
values the engine caches are already T_V v and attention outputs come back untransformed. What cannot be folded is in
the side file, in the row-vector convention engines use (keys, queries, values as rows; per attention layer ``l`` and
KV head ``h``, after RoPE)::

    K' = (K − key_mean) · key          key   = T_Kᵀ   (Hkv, d, d);  key_mean (Hkv, d) only for centered keys (wush-c)
    Q' = Q · query                     query = T_K⁻¹  (every query head of the group), so Q'K'ᵀ = QKᵀ − Q·key_meanᵀ

and, where the method has them: ``key_mean_pre_rope`` (Hkv, d) with ``rope_inv_freq`` (d/2,) (``+rmean``: the cache
quantizes K' − (R_t μ)·key and adds (R_t μ)·key back on read), ``key_feedback`` / ``value_feedback`` (Hkv, d, d)
(``+ldlq``: the unit upper-triangular feedback F the codes of K' / V' are rounded with,
:mod:`wushkv.quantizers.feedback`). The quantizer, bits and windows are in the metadata.

The side file lives in a subfolder because engines load every ``*.safetensors`` at the top of a checkpoint folder as
weights. The folder is written into a temporary folder beside ``DIR`` and renamed onto it once checked: reloaded with
plain ``transformers`` (no wushkv code), its logits equal those of the folded model in memory, and those of the
original model up to float rounding (the value transform and its inverse cancel).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from . import __version__
from .config import QuantConfig
from .export import DEFAULT_TOLERANCE
from .folding import apply_transforms
from .hf import restore_attention
from .io import usual_permissions, write_checked_safetensors, write_json
from .methods.auto import resolve_auto
from .methods.install import transforms_for
from .methods.spec import AUTO, CENTERED_TRANSFORMS, MethodSpec, parse, spec_of
from .models import describe, fingerprint, model_name, rope_parameters
from .served_format import (CONVENTION, SERVED_FORMAT, SERVED_VERSION, SIDE_DIR, SIDE_DTYPE, SIDE_FILE, SIDE_JSON,  # noqa: F401 (re-exported)
                            key_inverse_error, read_side_file, served_config, served_windows)
from .transforms import LayerTransforms

# The logits checks, relative to max(1, the largest |logit| of the original model on the probe). The reloaded folder
# must reproduce the folded model in memory (same weights, same attention, same arithmetic: 0 is expected and measured
# in every test); the original model up to the rounding of the folded weights to their dtype (T_V·W_v and W_o·T_V⁻¹
# are computed in float64, then rounded: 1.8e-6 on SmolLM2 in float32, up to 6e-2 on tiny random models in bfloat16).
RELOAD_TOLERANCE = {"float32": 1e-6, "bfloat16": 1e-3, "float16": 1e-3}
ORIGINAL_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-1, "float16": 2e-2}
PROBE_SHAPE = (2, 64)  # token ids the logits checks run on: a few forward passes, cheap next to loading the model


class ExportCheckError(ValueError):
    """The exported folder does not reproduce the model (a logits check failed); nothing was written under ``DIR``."""


# -- the method ----------------------------------------------------------------------------------------
def resolve_method(method: str, calibration, cfg: QuantConfig, model_key: str | None) -> tuple[MethodSpec, QuantConfig, dict]:
    """(method, the quantization it runs at, what to record of the choice). ``auto`` is resolved by
    :func:`~wushkv.methods.auto.resolve_auto` for ``model_key`` (recording what it chose and why); any other name must
    be a wushkv method (full precision and the stock caches install nothing to export)."""
    m = parse(method)
    if m is AUTO:
        r = resolve_auto(model_key, calibration, cfg)
        return r.method, r.config, {"requested": "auto"} | r.record()
    m = spec_of(m, "export-model")
    return m, m.quant_config(cfg), {"requested": str(method), "method": m.name, "why": "named on the command line"}


def method_features(m: MethodSpec) -> dict:
    """What an engine must implement to reproduce ``m`` from the folder (recorded; a plugin refuses what it lacks)."""
    return {
        "key_transform": m.key_transform, "value_transform": m.value_transform, "value_transform_folded": True,
        "key_centering": "constant" if m.key_transform in CENTERED_TRANSFORMS else m.key_centering,
        "key_layout": m.key_layout, "value_layout": m.value_layout, "feedback": m.feedback,
    }


# -- the side file -------------------------------------------------------------------------------------
def side_tensors(model, transforms: list[LayerTransforms]) -> dict[str, torch.Tensor]:
    """The side file's tensors (float32) of per-layer transforms: ``layers.{l}.key``/``query`` and, where the method has
    them, ``key_mean``, ``key_mean_pre_rope`` + ``rope_inv_freq``, ``key_feedback``, ``value_feedback``."""
    spec = describe(model)
    out = {}
    for l, tr in enumerate(transforms):
        t = tr.tensors()
        layer = {"key": t["T_K"].mT, "query": t["T_K_inv"], "key_mean": t.get("mu_K"), "key_mean_pre_rope": t.get("mu_K_rope"),
                 "key_feedback": t.get("F_K"), "value_feedback": t.get("F_V")}
        if "mu_K_rope" in t:
            layer["rope_inv_freq"] = rope_parameters(model, l, spec)[0]
        for k, v in layer.items():
            if v is not None:
                out[f"layers.{l}.{k}"] = v.detach().to("cpu", SIDE_DTYPE).contiguous()
    return out


def served_transforms(meta: dict, tensors: dict[str, torch.Tensor]) -> list[LayerTransforms]:
    """The per-layer transforms a side file stands for, for :func:`wushkv.folding.apply_transforms` on the exported
    model: its key side and error feedback, and the identity value transform (T_V is already in the weights)."""
    out = []
    for l in range(meta["num_layers"]):
        get = lambda k: tensors.get(f"layers.{l}.{k}")  # noqa: E731
        key, query = get("key"), get("query")
        eye = torch.eye(key.shape[-1], dtype=key.dtype).expand_as(key).contiguous()
        out.append(LayerTransforms(T_K=key.mT.contiguous(), T_K_inv=query, T_V=eye, T_V_inv=eye.clone(), mu_K=get("key_mean"),
                                   mu_K_rope=get("key_mean_pre_rope"), F_K=get("key_feedback"), F_V=get("value_feedback")))
    return out


def served_logprobs(folder, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Teacher-forced log-probabilities (n, vocab) float64 of the token ids through wushkv's cache on an exported
    folder, reloaded with plain transformers, at the windows a paged engine serves
    (:func:`~wushkv.served_format.served_windows`: ``(S_sink, S_keep, 1)`` for per-token keys, whose codes the vLLM
    plugin writes when a token is stored; key tiles as exported). Row i predicts token i + 1: the reference the
    plugin's tests and ``benchmarks/vllm_serving.py`` hold vLLM to."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    meta, tensors = read_side_file(folder)
    cfg = served_config(meta)
    cfg = replace(cfg, windows=served_windows(cfg))
    with apply_transforms(model, served_transforms(meta, tensors), meta["method"]) as installed, torch.no_grad():
        cache = installed.cache(cfg)
        logits = model(torch.tensor([list(ids)]), cache=cache, use_cache=True).logits[0]
    if cache.get_seq_length() != len(ids):  # a transformers that ignores the cache= keyword would not quantize
        raise RuntimeError(f"the quantized cache holds {cache.get_seq_length()} tokens after {len(ids)}: it was not used")
    return logits.double().log_softmax(-1)


# -- saving --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _dense_checkpoint(model):
    """Let ``save_pretrained`` write a model whose weights are dense floats although a loader quantizer is attached
    (transformers' GGUF loader, which dequantized every weight, refuses to save): the quantizer and its config are
    taken off for the body and put back after. Packed weights (not floating point) are refused."""
    packed = sorted({n.rsplit(".", 1)[0] for n, p in model.named_parameters() if not p.is_floating_point()})
    if packed:
        raise ValueError(f"{model_name(model)!r} holds packed (quantized) weights in {packed[:3]}; export-model folds T_V into dense "
                         "weights: load the model dequantized (wushkv.models.load does)")
    q = getattr(model, "hf_quantizer", None)
    if q is None:
        yield
        return
    saved = {k: getattr(model, k) for k in ("hf_quantizer", "quantization_method", "_weight_conversions", "is_quantized") if hasattr(model, k)}
    qc = getattr(model.config, "quantization_config", None)
    q.remove_quantization_config(model)  # transformers' own way to drop a quantizer (what dequantize() ends with)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(model, k, v)
        if qc is not None:
            model.config.quantization_config = qc


def _probe(model, shape=PROBE_SHAPE) -> torch.Tensor:
    """Fixed token ids for the logits checks (seeded, so two runs check the same thing)."""
    vocab = model.get_input_embeddings().num_embeddings
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    dev = next(model.parameters()).device
    return model(ids.to(dev), use_cache=False).logits.double().cpu()


def _temporary_folder(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))


def _check_destination(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists and is not an empty folder; remove it or give another --out "
                         "(export-model never writes into an existing checkpoint)")


def _reload_checks(model, folder: Path, ids: torch.Tensor, folded: torch.Tensor, original: torch.Tensor,
                   attention: str) -> dict:
    """Load ``folder`` with plain transformers (what an engine reads), under the attention ``folded`` was computed with,
    and compare its logits on ``ids`` with the folded and the original model's; raises :class:`ExportCheckError` past
    the tolerances. Returns the measurements (relative to max(1, max |original logit|))."""
    from transformers import AutoModelForCausalLM

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    reloaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention)
    got_dtype = str(next(reloaded.parameters()).dtype).removeprefix("torch.")
    if got_dtype != dtype:
        raise ExportCheckError(f"the exported folder reloads in {got_dtype}, the model was {dtype}")
    if getattr(model, "hf_device_map", None) is None:  # on one device: check there (a split model is checked on CPU)
        reloaded.to(next(model.parameters()).device)
    again = _logits(reloaded, ids)
    scale = max(1.0, float(original.abs().max()))
    checks = {"probe_tokens": list(ids.shape), "max_abs_logit": scale,
              "reload_vs_folded": float((again - folded).abs().max()) / scale,
              "reload_vs_original": float((again - original).abs().max()) / scale,
              "reload_tolerance": RELOAD_TOLERANCE.get(dtype, 1e-2), "original_tolerance": ORIGINAL_TOLERANCE.get(dtype, 1e-1)}
    for what, tol_key in (("folded", "reload_tolerance"), ("original", "original_tolerance")):
        got, tol = checks[f"reload_vs_{what}"], checks[tol_key]
        if not got <= tol:
            hint = ("; a model cast with .to(dtype) has its RoPE frequencies cast too, which a reload computes in float32: "
                    "load it in that dtype instead") if what == "folded" else ""
            raise ExportCheckError(f"the exported folder, reloaded with transformers, gives logits {got:.3g} (relative to max "
                                   f"|logit| {scale:.3g}) from the {what} model's, over the tolerance {tol:g}; nothing was "
                                   f"written{hint}")
    return checks


def export_model(model, tokenizer, out, method: str = "auto", cfg: QuantConfig | None = None, calibration=None,
                 model_key: str | None = None, log=None) -> dict:
    """Write ``model`` with ``method`` (``auto`` or a wushkv method name) at ``cfg`` as a served-model folder ``out``;
    returns the side file's metadata.

    ``calibration``: the model's :class:`~wushkv.calibration.Calibration` (refused when made for another model; needed
    by calibrated methods and ``auto``). ``model_key``: the name ``auto``'s recorded selections are keyed by (default:
    the name the model was loaded under). The model is left as it was (transforms restored). Raises ``ValueError`` for
    a method the folder cannot carry (centered values on a model without v_proj and o_proj biases) and
    :class:`ExportCheckError` when the reloaded folder does not reproduce the model; then nothing exists under ``out``.
    """
    log = log or (lambda s: None)
    out = Path(out)
    _check_destination(out)
    cfg = cfg or QuantConfig()
    if calibration is not None:
        calibration.check_model(model)  # a calibration of another model is refused, naming what differs
    m, qcfg, choice = resolve_method(method, calibration, cfg, model_key or model_name(model))
    transforms = transforms_for(model, calibration, m)  # refuses what the calibration cannot give (e.g. +rmean on an old file)
    spec = describe(model)
    source = fingerprint(model)
    tensors = side_tensors(model, transforms)
    errors = [key_inverse_error(tensors[f"layers.{l}.key"], tensors[f"layers.{l}.query"]) for l in range(spec.num_layers)]
    tol = DEFAULT_TOLERANCE["float32"]
    if not max(errors) <= tol:
        raise ExportCheckError(f"layer {errors.index(max(errors))}'s key transform and its inverse are {max(errors):.3g} from "
                               f"inverse in float32 (tolerance {tol:g}); the transform is ill-conditioned")
    ids = _probe(model)
    original = _logits(model, ids)
    keys_before = set(model.state_dict())
    tmp = _temporary_folder(out)
    try:
        with _dense_checkpoint(model), apply_transforms(model, transforms, m.name) as installed:
            added = sorted(set(model.state_dict()) - keys_before)
            if added:  # value centering gives v_proj/o_proj a bias the checkpoint's config has no switch for
                raise ValueError(f"method {m.name!r} centers values, which adds {added[:2]}{' ...' if len(added) > 2 else ''} "
                                 f"to {spec.family}'s weights; its config has no bias there, so an engine would drop them. Export "
                                 "an uncentered value side, e.g. wush-c:wush (centered keys, plain WUSH values)")
            restore_attention(model, installed.previous_attention)  # the folded weights under the model's own attention
            folded = _logits(model, ids)
            exported = fingerprint(model)
            model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        checks = _reload_checks(model, tmp, ids, folded, original, installed.previous_attention)
        cal_meta = calibration.meta if calibration is not None else {}
        meta = {
            "format": SERVED_FORMAT, "format_version": SERVED_VERSION, "wushkv_version": __version__,
            "method": m.name, "choice": choice, "features": method_features(m), "quantization": qcfg.to_dict(),
            "convention": CONVENTION, "dtype": "float32",
            "model": model_name(model), "family": spec.family, "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "attention_layers": list(spec.attention_layers), "layer_types": list(spec.layer_types),
            "rope_scaling": [rope_parameters(model, l, spec)[1] for l in range(spec.num_layers)] if m.rope_mean else None,
            "source_fingerprint": source, "fingerprint": exported,
            "calibration": ({k: cal_meta.get(k) for k in ("model", "samples", "seq_len", "damping", "calibration_source", "date")}
                            | {"fingerprint": cal_meta.get("fingerprint")}) if calibration is not None else None,
            "inverse_tolerance": tol, "max_inverse_error": max(errors), "checks": checks,
        }
        header = {"format": SERVED_FORMAT, "format_version": str(SERVED_VERSION), "meta": json.dumps(meta)}
        write_checked_safetensors(tmp / SIDE_FILE, tensors, header)
        write_json(tmp / SIDE_JSON, meta)
        read_side_file(tmp)  # what was written reads back, checked
        usual_permissions(tmp)  # mkdtemp makes it 0700: an engine running as another user reads it
        try:
            if out.exists():
                out.rmdir()  # an empty folder (checked above): rename cannot replace one that holds files
            os.rename(tmp, out)
        except OSError as e:  # another run wrote --out meanwhile
            raise ValueError(f"--out {str(out)!r} could not be put in place ({e}); nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"exported {model_name(model)} with {m.name} ({qcfg.label()}) -> {out}")
    return meta


def check_exported_model(meta: dict, model) -> None:
    """Refuse ``model`` (loaded from an exported folder) when its weights are not those the side file was written with
    (wushkv's fingerprint of the folded key, value and output projections)."""
    have = fingerprint(model)
    diff = [k for k in have if meta["fingerprint"].get(k) != have[k]]
    if diff:
        raise ValueError(f"the side file was written for other weights than this model's ({', '.join(diff)} differ): "
                         "export the folder again with `wushkv export-model`")


__all__ = ["SERVED_FORMAT", "SERVED_VERSION", "SIDE_FILE", "SIDE_JSON", "ExportCheckError", "check_exported_model", "export_model", "read_side_file", "served_config", "served_transforms"]
