"""What the plugin serves from an exported folder: the side file read and checked, the features the paged cache
implements (anything else refused by name), the windows, and each layer's transforms for this rank's KV heads.

No vLLM import: the checks run (and are tested) in wushkv's own environment too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wushkv.config import QuantConfig
from wushkv.served_format import SIDE_FILE, read_side_file, served_config, served_windows, tile_sink_problem

from .paged import SlotCodec

# The features of docs/reference/formats.md's side file the paged cache implements, and what the others would need.
SUPPORTED = {
    "value_transform_folded": {True},
    "key_centering": {"none", "constant", "rope-mean"},
    "key_layout": {"token", "tiles"},
    "value_layout": {"token", "tiles"},
    "feedback": {"", "K", "V", "KV"},
}
UNSUPPORTED_WHY: dict[str, str] = {}
_LAYER = re.compile(r"layers\.(\d+)\.")


class UnsupportedFolder(ValueError):
    """The folder's side file asks for something this plugin does not implement (named in the message)."""


@dataclass
class Served:
    """An exported folder as the plugin serves it.

    ``sink``/``recent``/``flush``: the full-precision windows, :func:`wushkv.served_format.served_windows`: per-token
    keys ``(S_sink, S_keep, 1)`` (the paged cache writes a token's codes when it is stored, so the side file's
    ``S_flush`` becomes 1 and exactly ``S_keep`` recent tokens are read in full precision); key tiles ``(S_sink,
    S_keep, tile)`` as exported (a tile's codes are written when it is complete)."""

    folder: Path
    meta: dict
    tensors: dict[str, torch.Tensor]
    cfg: QuantConfig
    said: set[str] = field(default_factory=set, repr=False, compare=False)  # log lines said once per engine (one Served each)

    @property
    def sink(self) -> int:
        return self.cfg.windows.S_sink

    @property
    def recent(self) -> int:
        return self.cfg.windows.S_keep

    @property
    def flush(self) -> int:
        return served_windows(self.cfg).S_flush

    @property
    def num_kv_heads(self) -> int:
        return int(self.meta["num_kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.meta["head_dim"])

    def slot_bytes(self, align: int = 2) -> int:
        """Bytes of one (token, KV head) cell, a multiple of ``align`` (the served dtype's size): the same for every
        layer (feedback changes the codes, not their size)."""
        return SlotCodec(self.cfg, self.head_dim, align=align).slot_bytes

    def attention_layer(self, layer_name: str) -> int:
        """The side file's attention-layer index of vLLM's layer ``model.layers.{i}.self_attn.attn``."""
        m = _LAYER.search(layer_name)
        if m is None:
            raise UnsupportedFolder(f"cannot tell the decoder layer of vLLM's attention layer {layer_name!r}")
        i = int(m.group(1))
        layers = list(self.meta.get("attention_layers") or range(int(self.meta["num_layers"])))
        if i not in layers:
            raise UnsupportedFolder(f"decoder layer {i} ({layer_name!r}) has no attention layer in {self.folder}'s side file "
                                    f"(attention layers {layers})")
        return layers.index(i)

    def heads(self, local_kv_heads: int, tp_rank: int, tp_size: int) -> slice:
        """This rank's KV heads among the side file's: vLLM shards KV heads over tensor parallelism, and replicates
        them (one per rank) when there are fewer heads than ranks."""
        H = self.num_kv_heads
        if tp_size <= H:
            if H % tp_size or local_kv_heads != H // tp_size:
                raise UnsupportedFolder(f"{H} KV heads cannot be split into {tp_size} ranks of {local_kv_heads}")
            return slice(tp_rank * local_kv_heads, (tp_rank + 1) * local_kv_heads)
        h = tp_rank * H // tp_size
        return slice(h, h + 1)

    def layer(self, l: int, heads: slice) -> dict:
        """Layer ``l``'s transforms for KV heads ``heads``: ``key`` (H, d, d), ``query`` (H, d, d), and where the
        method has them ``key_mean`` (H, d), ``key_feedback``/``value_feedback`` (H, d, d), and for ``+rmean``
        ``key_mean_pre_rope`` (H, d) with the layer's RoPE ``rope_inv_freq`` (d/2,) and ``rope_scaling``."""
        out = {}
        for k in ("key", "query", "key_mean", "key_feedback", "value_feedback", "key_mean_pre_rope"):
            t = self.tensors.get(f"layers.{l}.{k}")
            out[k] = None if t is None else t[heads].contiguous()
        out["rope_inv_freq"] = self.tensors.get(f"layers.{l}.rope_inv_freq")
        scaling = self.meta.get("rope_scaling")
        out["rope_scaling"] = float(scaling[l]) if scaling else 1.0
        if (out["key_mean_pre_rope"] is None) != (out["rope_inv_freq"] is None):
            raise UnsupportedFolder(f"{self.folder}: layer {l} has a rotating key mean without its RoPE frequencies (or the "
                                    "reverse); export the folder again")
        return out


def has_side_file(folder) -> bool:
    return folder is not None and (Path(str(folder)) / SIDE_FILE).is_file()


def load_served(folder, *, num_layers: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None) -> Served:
    """Read and check ``folder``'s side file against the model vLLM loaded from it (its layer count, KV heads and
    head_dim from the model config, where given); refuses features :data:`SUPPORTED` lacks, naming them."""
    folder = Path(str(folder))
    meta, tensors = read_side_file(folder)
    features = meta.get("features") or {}
    bad = [f"{k}={features.get(k)!r} ({UNSUPPORTED_WHY.get(k, 'not implemented')})"
           for k, ok in SUPPORTED.items() if features.get(k) not in ok]
    if bad:
        raise UnsupportedFolder(f"{folder}: the wushkv vLLM plugin does not implement method {meta.get('method')!r}: "
                                + "; ".join(bad) + f". Supported: {_supported_words()}; export the folder with such a method "
                                "(e.g. `wushkv export-model --method wush+ldlq`)")
    cfg = served_config(meta)
    for side in ("key", "value"):
        q = cfg.side_quantizer(side)
        if q not in ("quest", "affine", "kivi", "kvarn"):
            raise UnsupportedFolder(f"{folder}: the {side}s use quantizer {q!r}; the plugin stores per-token codes (quest, affine, "
                                    "kivi's values) or KVarN's tiles" + (" or KIVI's" if side == "key" else ""))
        bits = cfg.k_bits if side == "key" else cfg.v_bits
        if bits is None:
            raise UnsupportedFolder(f"{folder}: the {side}s are not quantized; the plugin needs {side} bits in 2, 3, 4, 8")
    if cfg.side_quantizer("key") == "kivi" and cfg.metadata_dtype != "float16":
        raise UnsupportedFolder(f"{folder}: KIVI's keys with metadata dtype {cfg.metadata_dtype!r}: the plugin keeps a key tile's "
                                "scale and zero in float16 (export with --metadata-dtype float16)")
    if (why := tile_sink_problem(cfg)) is not None:
        raise UnsupportedFolder(f"{folder}: {why}")
    mine = {"num_layers": len(meta.get("attention_layers") or range(int(meta["num_layers"]))), "num_kv_heads": int(meta["num_kv_heads"]),
            "head_dim": int(meta["head_dim"])}
    for name, want in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if want is not None and int(want) != mine[name]:
            raise UnsupportedFolder(f"{folder}: the side file was written for {name} = {mine[name]}, the model vLLM loaded "
                                    f"from the folder has {want}: the side file does not belong to these weights; export again")
    return Served(folder, meta, tensors, cfg)


def _supported_words() -> str:
    return ("per-token quest or affine codes on both sides, or keys in tiles (KVarN's, +ktiles; KIVI's, --quantizer kivi) "
            "or both sides in KVarN's tiles (+tiles, kvarn), with a sink of whole tiles; any key "
            "transform, with or without a constant or rotating (+rmean) key mean; error feedback (+ldlq) on either side")
