"""The wushkv quantized KV cache: a ``transformers`` ``Cache`` of per-layer ``CacheLayerMixin`` layers.

Per layer and KV head (METHOD §3.2)::

    positions  [0, S_sink)          full-precision sink, kept forever
               [S_sink, S_sink+Qc)  quantized middle: packed uint8 codes + fp16 metadata, appended
                                    in blocks of S_flush, never re-quantized
               [S_sink+Qc, n)       full-precision recent buffer, S_keep .. S_keep+S_flush-1 tokens

Keys are stored in transformed space (``k' = T_K k`` after RoPE); values arrive transformed through
the weights (``T_V`` folded into v_proj). ``update`` returns a :class:`KVView` (for both keys and
values) that the registered ``"wushkv"`` attention reads: in decode, attention over
[sink; dequantized middle; recent]; for a multi-token chunk (prefill, perplexity), the exact
single-pass emulation in which query ``i`` sees token ``t`` quantized iff
``S_sink <= t < S_sink + Qc(i+1)`` — what it would see if the chunk had been decoded token by token.

Sliding-window layers keep only the last ``W-1`` positions (as ``DynamicSlidingWindowLayer``), and
quantize them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import _as_allowed, fast_attention, fused_selective_attention, selective_attention
from .codecs import make_codec, storage_nbytes
from .config import QuantConfig


class _Growable:
    """A dict of tensors that grow along dim 2 with amortized doubling (no O(n²) concatenation)."""

    def __init__(self):
        self.buf: dict[str, torch.Tensor] = {}
        self.start: dict[str, int] = {}
        self.end: dict[str, int] = {}

    def append(self, items: dict[str, torch.Tensor]) -> None:
        for k, x in items.items():
            if k not in self.buf:
                cap = max(16, 2 * x.shape[2])
                self.buf[k] = x.new_empty(*x.shape[:2], cap, *x.shape[3:])
                self.start[k] = self.end[k] = 0
            buf, e = self.buf[k], self.end[k]
            if e + x.shape[2] > buf.shape[2]:
                live = buf[:, :, self.start[k] : e]
                cap = max(2 * live.shape[2] + x.shape[2], 16)
                new = buf.new_empty(*buf.shape[:2], cap, *buf.shape[3:])
                new[:, :, : live.shape[2]] = live
                self.buf[k], self.end[k], self.start[k] = new, live.shape[2], 0
                buf, e = new, live.shape[2]
            buf[:, :, e : e + x.shape[2]] = x
            self.end[k] = e + x.shape[2]

    def view(self) -> dict[str, torch.Tensor]:
        return {k: b[:, :, self.start[k] : self.end[k]] for k, b in self.buf.items()}

    def drop_front(self, counts: dict[str, int]) -> None:
        for k, c in counts.items():
            self.start[k] = min(self.start[k] + c, self.end[k])

    def truncate(self, lengths: dict[str, int]) -> None:
        for k, n in lengths.items():
            self.end[k] = self.start[k] + n

    def apply(self, fn) -> None:
        """Replace every live tensor by ``fn(tensor)`` (batch reorder / select)."""
        for k in list(self.buf):
            self.buf[k] = fn(self.buf[k][:, :, self.start[k] : self.end[k]]).contiguous()
            self.start[k], self.end[k] = 0, self.buf[k].shape[2]

    def nbytes(self) -> tuple[int, int]:
        return storage_nbytes(self.view()) if self.buf else (0, 0)


class _Side:
    """The quantized middle of one side (keys or values) of a layer."""

    def __init__(self, codec):
        self.codec = codec
        self.store = _Growable()

    def append(self, x: torch.Tensor) -> None:
        self.store.append(self.codec.encode(x))


@dataclass
class KVView:
    """What one ``update`` hands to attention: the layer state at this step (transformed space).

    Attributes (B, Hkv, *, d; positions absolute):
        sink_k/sink_v: full-precision sink, positions ``[sink_start, sink_start + len)``.
        mid_k/mid_v: dequantized middle stored *before* this update, ``[mid_start, mid_start + mid_len)``
            (None when empty), decoded lazily.
        win_k/win_v: full precision of every later position ``[w0, n1)`` (old recent buffer + new tokens).
        n0/n1: tokens in the cache before/after this update.
    """

    layer: WushKVLayer
    n0: int
    n1: int
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_start: int
    mid_len_before: int
    mid_start: int
    win_k: torch.Tensor
    win_v: torch.Tensor
    w0: int
    moved: int = 0  # tokens of the window flushed into the middle by this update
    mid: dict | None = None  # snapshot of the middle after this update's flush: {"k": storage, "v": storage}
    mid_len: int = 0  # tokens in that snapshot

    # The modeling code only passes these objects on; give them the attributes it may touch.
    @property
    def shape(self):
        return (*self.win_k.shape[:2], self.n1 - self.kv_offset, self.win_k.shape[-1])

    @property
    def device(self):
        return self.win_k.device

    @property
    def dtype(self):
        return self.win_k.dtype

    @property
    def kv_offset(self) -> int:
        return self.layer._first_visible(self.n0)

    def attend(self, module, query, attention_mask, scaling: float, softcap: float | None) -> torch.Tensor:
        """Attention of ``query`` (B, Hq, T, d) over this layer; returns (B, T, Hq, d) in transformed V space."""
        layer = self.layer
        kt = getattr(module, "wushkv_key", None)
        if kt is not layer.key_transform:
            raise RuntimeError(
                "the key transform of this attention module changed after the WushKVCache was created; "
                "create the cache after apply_transforms()/restore()"
            )
        if kt is not None:
            query = kt.queries(query)
        query = query.to(self.win_k.dtype)
        if attention_mask is not None and query.shape[0] > 1 and self.kv_offset == 0 and self.n1 > 0:
            m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            if not bool(m[:, :, -1, 0].all()):
                raise NotImplementedError(
                    "left-padded batches are not supported by WushKVCache yet: the windows are counted in absolute "
                    "positions, so a padded row would lose sink tokens to padding; run such rows one at a time "
                    "(batches of equal-length sequences work)"
                )
        T = query.shape[2]
        dt = self.win_k.dtype
        # Middle: full dequantization here (the packed-code kernel of the performance path reads codes directly).
        if T == 1:
            mid_k, mid_v = layer._decode_mid(self.mid, self.mid_len, dt)
            rk, rv = self.win_k[:, :, self.moved :], self.win_v[:, :, self.moved :]
            K = torch.cat([self.sink_k, mid_k, rk], dim=2)
            V = torch.cat([self.sink_v, mid_v, rv], dim=2)
            S = self.n1 - self.kv_offset
            K, V = K[:, :, -S:], V[:, :, -S:]
            allowed = _as_allowed(attention_mask, S)
            return fast_attention(query, K, V, allowed, scaling, softcap)

        mid_len = self.mid_len_before  # what this update flushed is still in the window, in full precision
        mk, mv = layer._decode_mid(self.mid, self.mid_len, dt, first=mid_len)
        kh = layer._fake("key", self.win_k)
        vh = layer._fake("value", self.win_v)
        K = torch.cat([self.sink_k, mk, self.win_k], dim=2)
        V = torch.cat([self.sink_v, mv, self.win_v], dim=2)
        K_hat = torch.cat([self.sink_k, mk, kh], dim=2)
        V_hat = torch.cat([self.sink_v, mv, vh], dim=2)
        # Absolute position of every column, and which (query, column) pairs see the quantized version.
        pos = torch.cat(
            [
                torch.arange(self.sink_start, self.sink_start + self.sink_k.shape[2]),
                torch.arange(self.mid_start, self.mid_start + mid_len),
                torch.arange(self.w0, self.n1),
            ]
        )
        w = layer.cfg.windows
        qc = torch.tensor([w.quantized_count(self.n0 + i + 1) for i in range(T)])  # (T,)
        quantized = (pos[None, :] >= w.S_sink) & (pos[None, :] < w.S_sink + qc[:, None])
        S = self.n1 - self.kv_offset
        sl = slice(K.shape[2] - S, None)
        quantized = quantized[:, sl].to(query.device)
        allowed = _as_allowed(attention_mask, S)
        args = (query, K[:, :, sl], V[:, :, sl], K_hat[:, :, sl], V_hat[:, :, sl], quantized, allowed, scaling)
        if softcap is not None or query.dtype == torch.float64:  # the explicit two-matmul reference
            return selective_attention(*args, softcap)
        return fused_selective_attention(*args)


class WushKVLayer(CacheLayerMixin):
    """One layer of the quantized cache. See the module docstring for the layout."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cfg: QuantConfig, head_dim: int, key_transform=None, sliding_window: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.head_dim = head_dim
        self.key_transform = key_transform  # the attention module's KeyTransform (T_K online), or None
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        k_codec, v_codec = make_codec(cfg, "key", head_dim), make_codec(cfg, "value", head_dim)
        self.k_side = _Side(k_codec) if k_codec else None
        self.v_side = _Side(v_codec) if v_codec else None
        self.block = max([c.block for c in (k_codec, v_codec) if c is not None] or [1])
        if self.block > 1 and self.block != cfg.windows.S_flush:
            raise ValueError(f"quantizer {cfg.quantizer!r} needs blocks of S_flush tokens; got block {self.block} != S_flush {cfg.windows.S_flush}")
        if self.is_sliding and cfg.windows.S_keep + cfg.windows.S_flush > sliding_window:
            raise ValueError(
                f"S_keep + S_flush = {cfg.windows.S_keep + cfg.windows.S_flush} exceeds the sliding window {sliding_window}; "
                "use smaller windows for models with sliding-window layers"
            )
        self.n = 0

    # -- transformers' layer API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        empty = key_states[:, :, :0]
        self.sink_k, self.sink_v = empty.clone(), value_states[:, :, :0].clone()
        self.recent_k, self.recent_v = empty.clone(), value_states[:, :, :0].clone()
        self.sink_start = 0
        self.mid_start = self.cfg.windows.S_sink
        self._mid_len = 0  # tokens in the quantized middle (after eviction)
        self._q_count = 0  # tokens ever quantized = Qc(n)
        self._mid_fp_store = {"k": empty.clone(), "v": value_states[:, :, :0].clone()}  # middle of a full-precision side
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        w = self.cfg.windows
        if self.key_transform is not None:
            key_states = self.key_transform.keys(key_states)
        n0, T = self.n, key_states.shape[2]
        n1 = n0 + T
        # 1. the first S_sink positions go to the full-precision sink
        take = min(T, max(0, w.S_sink - n0))
        if take:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :take]], dim=2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :take]], dim=2)
        win_k = torch.cat([self.recent_k, key_states[:, :, take:]], dim=2)
        win_v = torch.cat([self.recent_v, value_states[:, :, take:]], dim=2)
        w0 = n1 - win_k.shape[2]
        view = KVView(self, n0, n1, self.sink_k, self.sink_v, self.sink_start, self._mid_len, self.mid_start, win_k, win_v, w0, 0)
        # 2. flush whole blocks of S_flush into the quantized middle (appended, never re-quantized)
        moved = w.quantized_count(n1) - self._q_count
        if moved:
            self._append_mid(win_k[:, :, :moved], win_v[:, :, :moved])
            self._q_count += moved
        view.moved = moved
        view.mid, view.mid_len = self._snapshot_mid(), self._mid_len
        self.recent_k, self.recent_v = win_k[:, :, moved:], win_v[:, :, moved:]
        self.n = n1
        if self.is_sliding:  # the view keeps what this step reads; the layer keeps what later steps can see
            self._evict(n1 - self.sliding_window + 1)
        return view, view

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = self._first_visible(self.n)
        return self.n + query_length - kv_offset, kv_offset

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self.is_initialized = False
        self.n = 0
        for side in (self.k_side, self.v_side):
            if side is not None:
                side.store = type(side.store)()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last tokens; only tokens still in the full-precision recent buffer can be removed."""
        if tokens_to_remove > 0:
            tokens_to_remove = self.n - tokens_to_remove
        n = abs(tokens_to_remove)
        if n == 0 or not self.is_initialized:
            return
        if n > self.recent_k.shape[2]:
            raise ValueError(
                f"cannot crop {n} tokens: only the {self.recent_k.shape[2]} most recent tokens are in full precision "
                "(quantized tokens are never re-quantized or un-appended)"
            )
        self.recent_k, self.recent_v = self.recent_k[:, :, :-n], self.recent_v[:, :, :-n]
        self.n -= n

    def _apply_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        self.recent_k, self.recent_v = fn(self.recent_k), fn(self.recent_v)
        self._mid_fp_store = {k: fn(v) for k, v in self._mid_fp_store.items()}
        for side in (self.k_side, self.v_side):
            if side is not None:
                side.store.apply(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_batch(lambda x: x[indices])

    def offload(self):  # the packed store stays where it is
        pass

    def prefetch(self):
        pass

    # -- internals ---------------------------------------------------------------------------
    def _first_visible(self, n: int) -> int:
        return max(n - self.sliding_window + 1, 0) if self.is_sliding else 0

    def _append_mid(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, side, x in (("k", self.k_side, k), ("v", self.v_side, v)):
            if side is not None:
                side.append(x)
            else:
                self._mid_fp_store[name] = torch.cat([self._mid_fp_store[name], x], dim=2)
        self._mid_len += k.shape[2]

    def _snapshot_mid(self) -> dict:
        return {
            name: (side.store.view() if side is not None else self._mid_fp_store[name])
            for name, side in (("k", self.k_side), ("v", self.v_side))
        }

    def _decode_mid(self, snap: dict, n: int, dtype, first: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize the first ``first`` (default: all ``n``) tokens of a middle snapshot holding ``n``:
        (B, Hkv, first, d) keys and values. ``first`` is a multiple of the codec block."""
        m = n if first is None else first
        out = []
        for name, side in (("k", self.k_side), ("v", self.v_side)):
            if m == 0:
                out.append(self.sink_k[:, :, :0].to(dtype))
            elif side is None:
                out.append(snap[name][:, :, :m].to(dtype))
            else:
                part = {key: t[:, :, : t.shape[2] * m // n] for key, t in snap[name].items()}
                out.append(side.codec.decode(part, m).to(dtype))
        return out[0], out[1]

    def _fake(self, side: str, x: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize the whole blocks of a window that starts on the flush grid; the rest stays as is."""
        s = self.k_side if side == "key" else self.v_side
        if s is None or x.shape[2] == 0:
            return x
        n = (x.shape[2] // self.block) * self.block
        if n == 0:
            return x
        return torch.cat([s.codec.fake(x[:, :, :n]).to(x.dtype), x[:, :, n:]], dim=2)

    def _evict(self, first: int) -> None:
        """Drop positions < ``first`` (sliding-window layers)."""
        if first <= 0:
            return
        drop = min(max(0, first - self.sink_start), self.sink_k.shape[2])
        if drop:
            self.sink_k, self.sink_v = self.sink_k[:, :, drop:], self.sink_v[:, :, drop:]
            self.sink_start += drop
        drop = max(0, first - self.mid_start)
        drop = min(drop, self._mid_len) // self.block * self.block  # whole blocks only
        if drop:
            for name, side in (("k", self.k_side), ("v", self.v_side)):
                if side is not None:
                    view = side.store.view()
                    side.store.drop_front({key: t.shape[2] * drop // self._mid_len for key, t in view.items()})
                else:
                    self._mid_fp_store[name] = self._mid_fp_store[name][:, :, drop:]
            self.mid_start += drop
            self._mid_len -= drop

    def nbytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"codes": 0, "metadata": 0, "full_precision": 0}
        codes = meta = 0
        for side in (self.k_side, self.v_side):
            if side is not None:
                c, m = side.store.nbytes()
                codes, meta = codes + c, meta + m
        fp = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.recent_k, self.recent_v, *self._mid_fp_store.values()))
        return {"codes": codes, "metadata": meta, "full_precision": fp}


class WushKVCache(Cache):
    """Quantized KV cache for ``model`` (any family :mod:`wushkv.models` supports).

    ``config``: one :class:`QuantConfig` for every layer, or a list with one per layer (bit allocation).
    Creating the cache switches the model to the ``"wushkv"`` attention, which is what reads it, and
    takes each layer's key transform from :func:`wushkv.folding.apply_transforms` (if installed).
    """

    def __init__(self, model, config: QuantConfig | list[QuantConfig] | None = None):
        from .attention import use_wushkv_attention
        from .models import attention_modules, describe

        spec = describe(model)
        configs = config if isinstance(config, list) else [config or QuantConfig()] * spec.num_layers
        if len(configs) != spec.num_layers:
            raise ValueError(f"got {len(configs)} per-layer configs for a model with {spec.num_layers} layers")
        use_wushkv_attention(model)
        layers = []
        for i, attn in enumerate(attention_modules(model, spec)):
            kt = getattr(attn, "wushkv_key", None)
            sliding = spec.sliding_window if spec.layer_types[i] == "sliding_attention" else None
            layers.append(WushKVLayer(configs[i], spec.head_dim, kt, sliding))
        super().__init__(layers=layers)
        self.configs = configs

    def nbytes(self) -> dict[str, int]:
        """Bytes actually held: packed codes, metadata (scales/offsets), full-precision windows, total."""
        tot = {"codes": 0, "metadata": 0, "full_precision": 0}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                tot[k] += v
        tot["total"] = sum(tot.values())
        return tot

    def full_precision_nbytes(self, torch_dtype_size: int = 2) -> int:
        """Bytes a ``DynamicCache`` (sliding layers: ``DynamicSlidingWindowLayer``) would hold for the same tokens."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, _, d = layer.sink_k.shape
                total += 2 * B * H * d * torch_dtype_size * (layer.n - layer._first_visible(layer.n))
        return total
