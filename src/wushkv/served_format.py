"""The served-model side file (``DIR/wushkv/kv_cache.{safetensors,json}``, docs/reference/formats.md): its names and its
checked reader, apart from :mod:`wushkv.serving` (which writes it) so that a serving engine's plugin reads it without
importing ``transformers`` (this module imports only :mod:`wushkv.io` and :mod:`wushkv.config`): vLLM pins another
``transformers`` than wushkv's integration needs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import QuantConfig, WindowConfig
from .io import CorruptFileError, expect_format, read_checked_safetensors, read_json

SERVED_FORMAT = "wushkv-served-model"
SERVED_VERSION = 1
SIDE_DIR = "wushkv"
SIDE_FILE = f"{SIDE_DIR}/kv_cache.safetensors"
SIDE_JSON = f"{SIDE_DIR}/kv_cache.json"
CONVENTION = ("row-vector, after RoPE: K'=(K-key_mean)@key, Q'=Q@query (key=T_K^T, query=T_K^-1, per layer (Hkv, d, d)); "
              "values: T_V folded into v_proj/o_proj")
SIDE_DTYPE = torch.float32


def key_inverse_error(key: torch.Tensor, query: torch.Tensor) -> float:
    """max |query·keyᵀ − I| over heads and entries, in float64: how far the stored pair is from T_K⁻¹·T_K."""
    eye = torch.eye(key.shape[-1], dtype=torch.float64)
    return float((query.double() @ key.double().mT - eye).abs().max())


def read_side_file(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, {name: tensor}) of an exported folder's side file, checked: format and version, its checksum, that the
    readable JSON copy says the same, every layer's ``key``/``query`` of shape (Hkv, d, d) and inverse to the recorded
    tolerance. Raises :class:`~wushkv.io.CorruptFileError` (a ``ValueError``) naming the file, ``FileNotFoundError`` for
    a folder without one."""
    folder = Path(folder)
    path = folder / SIDE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} holds no wushkv side file ({SIDE_FILE}); make the folder with `wushkv export-model`")

    check_format = expect_format(path, SERVED_FORMAT, SERVED_VERSION, "a wushkv served-model side file")
    header, tensors = read_checked_safetensors(path, "side file", check_format)
    try:
        meta = json.loads(header["meta"])
        n, H, d = meta["num_layers"], meta["num_kv_heads"], meta["head_dim"]
        tol = float(meta["inverse_tolerance"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptFileError(f"side file {str(path)!r} has damaged metadata: {type(e).__name__}: {e}") from None
    if read_json(folder / SIDE_JSON, "side file metadata") != meta:
        raise CorruptFileError(f"{str(folder / SIDE_JSON)!r} does not say what {str(path)!r} holds (one of them was replaced); "
                               "export the folder again")
    for l in range(n):
        for k in ("key", "query"):
            t = tensors.get(f"layers.{l}.{k}")
            if t is None or tuple(t.shape) != (H, d, d):
                raise CorruptFileError(f"side file {str(path)!r}: layers.{l}.{k} is "
                                       f"{'missing' if t is None else tuple(t.shape)}, expected {(H, d, d)}")
        err = key_inverse_error(tensors[f"layers.{l}.key"], tensors[f"layers.{l}.query"])
        if not err <= tol:
            raise CorruptFileError(f"side file {str(path)!r}: layer {l}'s query·keyᵀ is {err:.3g} from the identity (tolerance {tol:g})")
    return meta, tensors


def served_config(meta: dict) -> QuantConfig:
    """The quantization a side file records (what the method runs at: its layouts and windows applied)."""
    return QuantConfig.from_dict(meta["quantization"])


def served_windows(cfg: QuantConfig) -> WindowConfig:
    """The windows a paged engine serves a side file's quantization at: per-token keys ``(S_sink, S_keep, 1)`` (a
    token's codes are written when it is stored: exactly the last ``S_keep`` tokens are in full precision), key
    tiles (KVarN's, KIVI's: :attr:`~wushkv.config.QuantConfig.key_tiles`) the recorded ``(S_sink, S_keep, S_flush)`` (a
    tile of ``S_flush`` tokens is written when it is complete)."""
    w = cfg.windows
    return w if cfg.key_tiles else WindowConfig(w.S_sink, w.S_keep, 1)


def tile_sink_problem(cfg: QuantConfig) -> str | None:
    """Why a paged engine cannot serve ``cfg``'s key tiles (None: it can, or the keys are per token): tiles of
    ``S_flush`` tokens start after the sink, so they fall on a paged cache's blocks only after a sink of whole tiles."""
    w = cfg.windows
    if not cfg.key_tiles or w.S_sink % w.S_flush == 0:
        return None
    fix = max(w.S_flush, w.S_flush * round(w.S_sink / w.S_flush))
    return (f"key tiles of {w.S_flush} tokens start after the sink of {w.S_sink} tokens, across a paged cache's blocks (a "
            f"block would be complete, and shared, before its tile): the vLLM plugin serves key tiles with a sink of whole "
            f"tiles; export with --sink {fix} (docs/reference/serving.md)")
