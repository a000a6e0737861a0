"""Export solved transforms for serving engines, in the row-vector convention they use.

Engines hold keys, queries and values as rows (``K`` is tokens × d), so the column-vector transforms
of the method (``k' = T_K k``, ``q' = T_K^{-T} q``, ``v' = T_V v``, ``o = T_V^{-1} o'``) become right
multiplications, per layer ``l`` and KV head ``h``::

    K' = K · key        key    = T_Kᵀ      (after RoPE)
    Q' = Q · query      query  = T_K⁻¹     (every query head of the group; Q'K'ᵀ = QKᵀ)
    V' = V · value      value  = T_Vᵀ      (or fold it into v_proj)
    O  = O' · output    output = T_V^{-T}  (per head, before o_proj; or fold it into o_proj)

Centered transforms (``wush-c``, ``hadamard-c``) also carry ``layers.{l}.key_shift`` (Hkv, 1, d) = (T_K μ_K)ᵀ:
``K' = K · key − key_shift`` for every cached key (a shift common to all keys leaves the softmax unchanged),
and ``layers.{l}.value_shift`` = (T_V μ_V)ᵀ, ``layers.{l}.output_shift`` = μ_Vᵀ: ``V' = V · value − value_shift``,
``O = O' · output + output_shift`` (attention weights sum to 1, so outputs shift by exactly μ_V).

The file is safetensors with tensors ``layers.{l}.{key,query,value,output}`` of shape (Hkv, d, d) in
the requested dtype, and JSON metadata in its header (format, version, model fingerprint, method,
convention, dtype and the measured inverse error). After the cast, ``query·keyᵀ`` and ``value·output``
are checked against the identity in float64; an export whose error exceeds ``tolerance`` is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .io import CorruptFileError, expect_format, read_checked_safetensors, write_checked_safetensors
from .transforms import LayerTransforms

EXPORT_FORMAT = "wushkv-transforms"
EXPORT_VERSION = 1
CONVENTION = ("row-vector: K'=K@key[-key_shift], Q'=Q@query, V'=V@value[-value_shift], O=O'@output[+output_shift]; "
              "per layer (Hkv, d, d), shifts (Hkv, 1, d)")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


def row_vector_transforms(transforms: list[LayerTransforms]) -> list[dict[str, torch.Tensor]]:
    """Per layer {key, query, value, output} (float64) from the method's :class:`~wushkv.transforms.LayerTransforms`."""
    out = []
    for tr in transforms:
        t = {k: v.double() for k, v in tr.tensors().items()}
        layer = {
            "key": t["T_K"].transpose(-1, -2),
            "query": t["T_K_inv"],
            "value": t["T_V"].transpose(-1, -2),
            "output": t["T_V_inv"].transpose(-1, -2),
        }
        if "mu_K" in t:
            layer["key_shift"] = t["mu_K"].unsqueeze(1) @ layer["key"]  # (Hkv, 1, d): μᵀ T_Kᵀ
        if "mu_V" in t:
            layer["value_shift"] = t["mu_V"].unsqueeze(1) @ layer["value"]  # (Hkv, 1, d): μ_Vᵀ T_Vᵀ
            layer["output_shift"] = t["mu_V"].unsqueeze(1)  # (Hkv, 1, d): added back after the output map
        out.append(layer)
    return out


def inverse_error(layer: dict[str, torch.Tensor]) -> float:
    """max |query·keyᵀ − I| and |value·output − I| over heads and entries, computed in float64."""
    eye = torch.eye(layer["key"].shape[-1], dtype=torch.float64)
    e1 = (layer["query"].double() @ layer["key"].double().transpose(-1, -2) - eye).abs().max()
    e2 = (layer["value"].double() @ layer["output"].double() - eye).abs().max()
    return float(max(e1, e2))


def export_transforms(calibration, method: str, path, dtype: str = "float32", tolerance: float | None = None) -> dict:
    """Write the row-vector transforms of ``method`` to ``path`` (atomically); returns the metadata."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    tol = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    layers = row_vector_transforms(calibration.transforms(method))
    tensors, errors = {}, []
    for l, layer in enumerate(layers):
        cast = {k: v.to(DTYPES[dtype]).contiguous() for k, v in layer.items()}
        errors.append(inverse_error(cast))
        for k, v in cast.items():
            tensors[f"layers.{l}.{k}"] = v
    worst = max(errors)
    if not worst <= tol:
        bad = max(range(len(errors)), key=errors.__getitem__)
        raise ValueError(f"after the cast to {dtype}, layer {bad} gives |T·T⁻¹ − I| = {worst:.3g} > tolerance {tol:g}; "
                         "export in a wider dtype or raise --tolerance")
    meta = {
        "format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "method": method, "dtype": dtype,
        "convention": CONVENTION, "model": calibration.meta.get("model"), "fingerprint": calibration.meta.get("fingerprint"),
        "calibration": {k: calibration.meta.get(k) for k in ("samples", "seq_len", "damping", "calibration_source", "date")},
        "num_layers": len(layers), "max_inverse_error": worst, "inverse_error_per_layer": errors,
    }
    header = {"format": EXPORT_FORMAT, "format_version": str(EXPORT_VERSION), "meta": json.dumps(meta)}
    write_checked_safetensors(Path(path), tensors, header)  # its checksum lets a reader refuse a damaged file (read_export)
    return meta


def read_export(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, {name: tensor}) of an export file, checked: its format and version, its checksum (files that carry
    one), the four maps of every layer. Raises :class:`~wushkv.io.CorruptFileError` (a ``ValueError``) naming the file
    for anything else; ``FileNotFoundError`` for a missing file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"export file {str(path)!r} does not exist")

    header, tensors = read_checked_safetensors(path, "export file", expect_format(path, EXPORT_FORMAT, EXPORT_VERSION, "a wushkv export"))
    try:
        meta = json.loads(header["meta"])
        n = meta["num_layers"]
        missing = [f"layers.{l}.{k}" for l in range(n) for k in ("key", "query", "value", "output") if f"layers.{l}.{k}" not in tensors]
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptFileError(f"export file {str(path)!r} has damaged metadata: {type(e).__name__}: {e}") from None
    if missing:
        raise CorruptFileError(f"export file {str(path)!r} lacks {missing[:4]}")
    return meta, tensors
