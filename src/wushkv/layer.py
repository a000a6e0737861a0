"""One layer of the wushkv quantized KV cache (a transformers ``CacheLayerMixin``) and its views.

Per layer and KV head (docs/reference/math.md#32-full-precision-windows-and-the-batched-flush)::

    positions  [0, S_sink)          full-precision sink, kept forever
               [S_sink, S_sink+Qc)  quantized middle: packed uint8 codes + fp16 metadata, appended
                                    in blocks of S_flush, never re-quantized
               [S_sink+Qc, n)       full-precision recent buffer, S_keep .. S_keep+S_flush-1 tokens

Keys are stored in transformed space (``k' = T_K k`` after RoPE); values arrive transformed through
the weights (``T_V`` folded into v_proj). ``update`` returns a :class:`KVView` (for both keys and
values) that the registered ``"wushkv"`` attention (:mod:`wushkv.hf`) reads: in decode, attention over
[sink; packed middle; recent] straight from the codes (:mod:`wushkv.decode`, no full-precision copy);
for a multi-token chunk (prefill, perplexity), the exact
single-pass emulation in which query ``i`` sees token ``t`` quantized iff
``S_sink <= t < S_sink + Qc(i+1)`` — what it would see if the chunk had been decoded token by token.

Sliding-window layers keep only the last ``W-1`` positions (as ``DynamicSlidingWindowLayer``), and
quantize them the same way. Left-padded batches (``attention_mask=`` at creation) count each row's
windows from its first real token: with per-token quantizers in one shared store (see
``KVView._attend_padded``); with quantizers of token blocks (KVarN's tiles, KIVI), whose blocks start at a
different column in each row, each row keeps its own unpadded layer (:class:`RowsView`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from .attention import as_allowed, fast_attention, fused_selective_attention, selective_attention
from .codecs import make_codec, storage_nbytes
from .config import QuantConfig
from .decode import decode_attention


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Pad tokens per row of a left-padded 2-D attention mask (1 = token, 0 = padding)."""
    m = torch.as_tensor(attention_mask)
    if m.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (batch, length), got shape {tuple(m.shape)}")
    m = m.cpu().bool()
    lead = (m.int().cumsum(-1) == 0).sum(-1)
    if not torch.equal(lead, (~m).sum(-1)):
        bad = torch.nonzero(lead != (~m).sum(-1)).flatten().tolist()
        raise ValueError(f"rows {bad} of attention_mask have padding that is not on the left; only left padding is supported")
    return lead


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


class LayerView:
    """What the modeling code may touch on the object ``update`` returns (it only passes it on to attention):
    shape, device, dtype and kv_offset, from ``layer``, ``n0``/``n1`` and a (B, Hkv, *, d) tensor ``_like``.

    The registered attention (:func:`wushkv.hf.wushkv_attention`) hands every ``LayerView`` it is given
    as ``key`` to the view's ``attend(module, query, attention_mask, scaling, softcap)``."""

    @property
    def shape(self):
        return (*self._like.shape[:2], self.n1 - self.kv_offset, self._like.shape[-1])

    @property
    def device(self):
        return self._like.device

    @property
    def dtype(self):
        return self._like.dtype

    @property
    def kv_offset(self) -> int:
        return self.layer._first_visible(self.n0)


@dataclass
class KVView(LayerView):
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

    @property
    def _like(self) -> torch.Tensor:
        return self.win_k

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
        if attention_mask is not None and self.n0 == 0 and not layer.is_sliding:
            layer._check_padding(attention_mask)
        if layer.padded:
            return self._attend_padded(query, attention_mask, scaling, softcap)
        T = query.shape[2]
        dt = self.win_k.dtype
        if T == 1:  # decode: read the packed codes directly, block by block (wushkv.decode)
            S = self.n1 - self.kv_offset
            allowed = as_allowed(attention_mask, S)
            if allowed is None and S < self.n1 - self.sink_start:
                allowed = torch.ones(query.shape[0], 1, 1, S, dtype=torch.bool, device=query.device)
            mid_k, mid_v = layer._mid_parts(self.mid, self.mid_len, self.mid_start, dt)
            rk, rv = self.win_k[:, :, self.moved :], self.win_v[:, :, self.moved :]
            return decode_attention(query, [self.sink_k, mid_k, rk], [self.sink_v, mid_v, rv], allowed, scaling, softcap)

        mid_len = self.mid_len_before  # what this update flushed is still in the window, in full precision
        flushed = self.mid_len - mid_len
        if layer.k_side is None and layer.v_side is None:  # a full-precision layer (bit allocation): plain attention
            mk, mv = layer._decode_mid(self.mid, self.mid_len, dt, first=mid_len, start=self.mid_start)
            S = self.n1 - self.kv_offset
            K = torch.cat([self.sink_k, mk, self.win_k], dim=2)[:, :, -S:]
            V = torch.cat([self.sink_v, mv, self.win_v], dim=2)[:, :, -S:]
            return fast_attention(query, K, V, as_allowed(attention_mask, S), scaling, softcap)
        if flushed and self.mid_start + mid_len == self.w0:
            # This update's flush is the window's first `flushed` columns, just encoded into the middle:
            # decode them (fake == decode(encode) bit for bit) instead of quantizing them a second time.
            mk, mv = layer._decode_mid(self.mid, self.mid_len, dt, start=self.mid_start)
            kh = torch.cat([mk[:, :, mid_len:], layer._fake("key", self.win_k[:, :, flushed:], self.w0 + flushed)], dim=2)
            vh = torch.cat([mv[:, :, mid_len:], layer._fake("value", self.win_v[:, :, flushed:])], dim=2)
            mk, mv = mk[:, :, :mid_len], mv[:, :, :mid_len]
        else:
            mk, mv = layer._decode_mid(self.mid, self.mid_len, dt, first=mid_len, start=self.mid_start)
            kh = layer._fake("key", self.win_k, self.w0)
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
        allowed = as_allowed(attention_mask, S)
        args = (query, K[:, :, sl], V[:, :, sl], K_hat[:, :, sl], V_hat[:, :, sl], quantized, allowed, scaling)
        if softcap is not None or query.dtype == torch.float64:  # the explicit two-matmul reference
            return selective_attention(*args, softcap)
        return fused_selective_attention(*args)

    def _attend_padded(self, query, attention_mask, scaling: float, softcap: float | None) -> torch.Tensor:
        """Left-padded batch: the same emulation, with each row's windows counted from its first real token.

        Row ``b`` (``p_b`` pad tokens) sees column ``c`` quantized for query position ``i`` iff
        ``p_b + S_sink <= c < p_b + S_sink + Qc(i + 1 - p_b)``. The layer keeps every column some row still
        needs in full precision (sink ∪ recent) and codes for every column some row needs quantized, so
        both versions exist wherever a row can read them. Also serves decode (T = 1).
        """
        layer, dt = self.layer, self.win_k.dtype
        lo = self.kv_offset
        S, T = self.n1 - lo, query.shape[2]
        B, H, _, d = self.win_k.shape
        K = self.win_k.new_zeros(B, H, S, d)
        V = self.win_v.new_zeros(B, H, S, self.win_v.shape[-1])
        mk, mv = layer._decode_mid(self.mid, self.mid_len, dt, start=self.mid_start)

        def put(dst, src, start):  # write columns [start, start + len) of src into dst (columns from lo)
            a, b = max(start, lo), min(start + src.shape[2], self.n1)
            if b > a:
                dst[:, :, a - lo : b - lo] = src[:, :, a - start : b - start]

        for dst, mid, sink, win in ((K, mk, self.sink_k, self.win_k), (V, mv, self.sink_v, self.win_v)):
            put(dst, mid, self.mid_start)  # columns only the codes still hold: quantized for every row
            put(dst, sink, self.sink_start)
            put(dst, win, self.w0)
        K_hat, V_hat = layer._fake("key", K, lo), layer._fake("value", V)
        put(K_hat, mk, self.mid_start)  # the stored codes, bit for bit
        put(V_hat, mv, self.mid_start)
        w = layer.cfg.windows
        pads = layer.pads.view(B, 1, 1)
        pos = torch.arange(lo, self.n1).view(1, 1, S)
        real = torch.arange(self.n0 + 1, self.n1 + 1).view(1, T, 1) - pads  # real tokens seen by each query
        qc = w.S_flush * ((real - w.S_sink - w.S_keep).clamp(min=0) // w.S_flush)
        start = pads + w.S_sink
        quantized = ((pos >= start) & (pos < start + qc)).unsqueeze(1).to(query.device)  # (B, 1, T, S)
        allowed = as_allowed(attention_mask, S)
        args = (query, K, V, K_hat, V_hat, quantized, allowed, scaling)
        if softcap is not None or query.dtype == torch.float64:
            return selective_attention(*args, softcap)
        return fused_selective_attention(*args)


@dataclass
class RowsView(LayerView):
    """What ``update`` hands to attention for a left-padded batch whose quantizers code blocks of tokens.

    Each row keeps its own unpadded :class:`WushKVLayer` (its blocks start at its first real token, as
    they would for the row alone); ``rows[b]`` is that layer's :class:`KVView` for this update, or None
    while row ``b`` has seen only padding. Attention runs row by row over the real columns, so every
    row gets exactly what it gets alone; outputs at padding positions are zero (never read).
    """

    layer: WushKVLayer
    n0: int
    n1: int
    rows: list
    _like: torch.Tensor  # (B, Hkv, 0, d): shape, device and dtype of the batch

    def attend(self, module, query, attention_mask, scaling: float, softcap: float | None) -> torch.Tensor:
        layer = self.layer
        if attention_mask is not None and self.n0 == 0 and not layer.is_sliding:
            layer._check_padding(attention_mask)
        B, Hq, T, _ = query.shape
        lo = self.kv_offset
        if attention_mask is not None:
            attention_mask = attention_mask[..., -(self.n1 - lo) :]
        out = None
        for b, (view, p) in enumerate(zip(self.rows, layer._pad_list())):
            if view is None:
                continue
            tq = self.n1 - max(self.n0, p)  # the row's real queries: the last tq of this update
            mask = None
            if attention_mask is not None:  # the row's real columns start at max(lo, p)
                m = attention_mask[b : b + 1] if attention_mask.shape[0] > 1 else attention_mask
                mask = m[:, :, T - tq :, max(lo, p) - lo :]
            o = view.attend(module, query[b : b + 1, :, T - tq :], mask, scaling, softcap)
            if out is None:
                out = o.new_zeros(B, T, *o.shape[2:])
            out[b, T - tq :] = o[0]
        return out if out is not None else query.new_zeros(B, T, Hq, self._like.shape[-1])


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
        fk, fv = (getattr(key_transform, f"feedback_{s}", None) for s in "KV")  # error feedback (+ldlq methods)
        k_codec, v_codec = make_codec(cfg, "key", head_dim, fk), make_codec(cfg, "value", head_dim, fv)
        self.k_side = _Side(k_codec) if k_codec else None
        self.v_side = _Side(v_codec) if v_codec else None
        self.block = max([c.block for c in (k_codec, v_codec) if c is not None] or [1])
        if self.block > 1 and self.block != cfg.windows.S_flush:
            raise ValueError(f"quantizer {cfg.side_quantizer('key')}/{cfg.quantizer} needs blocks of S_flush tokens; got block {self.block} "
                             f"!= S_flush {cfg.windows.S_flush}")
        if self.is_sliding and cfg.windows.S_keep + cfg.windows.S_flush > sliding_window:
            raise ValueError(
                f"S_keep + S_flush = {cfg.windows.S_keep + cfg.windows.S_flush} exceeds the sliding window {sliding_window}; "
                "use smaller windows for models with sliding-window layers"
            )
        self.n = 0
        self.pads: torch.Tensor | None = None  # (B,) left-padding tokens per row, or None
        self.row_mode = False  # a padded batch under block quantizers: one unpadded layer per row
        self.rows: list[WushKVLayer] | None = None

    def __deepcopy__(self, memo):
        """A copy that continues independently (e.g. scoring one answer while generating another) and
        shares the key transform, which belongs to the model's attention module, not to the cache."""
        memo.setdefault(id(self.key_transform), self.key_transform)
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    @property
    def padded(self) -> bool:
        return self.pads is not None and bool((self.pads > 0).any())

    def set_padding(self, pads: torch.Tensor | None) -> None:
        """Declare ``pads[b]`` left-padding tokens in row ``b``: that row's windows start after them."""
        if self.is_initialized and self.n > 0:
            raise RuntimeError("set the padding before the first tokens enter the cache")
        if pads is not None:
            pads = torch.as_tensor(pads, dtype=torch.long).flatten().cpu()
            if (pads < 0).any():
                raise ValueError(f"pad lengths must be >= 0, got {pads.tolist()}")
        # Blocks of tokens (tiles) start at a different column in each row: give each row its own layer.
        self.row_mode = pads is not None and bool((pads > 0).any()) and self.block > 1
        self.pads = pads

    def _row_ends(self, n: int) -> list[int]:
        """Per row: the column after its quantized middle when the cache holds ``n`` columns."""
        w = self.cfg.windows
        return [p + w.S_sink + w.quantized_count(max(n - p, 0)) for p in self._pad_list()]

    def _pad_list(self) -> list[int]:
        return self.pads.tolist() if self.pads is not None else [0]

    def _code_end(self, n: int) -> int:
        """Codes exist for columns [S_sink + min pad, this): every column some row reads quantized."""
        w, pads = self.cfg.windows, self._pad_list()
        ends = [e for e, p in zip(self._row_ends(n), pads) if e > p + w.S_sink]
        return max(ends) if ends else w.S_sink + min(pads)

    def _check_padding(self, attention_mask: torch.Tensor) -> None:
        """At the first prefill, the padding the mask shows must be the padding the cache was told of."""
        m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        last = m[:, 0, -1, : self.n]  # what the last prompt position may attend to
        seen = (last.int().cumsum(-1) == 0).sum(-1).cpu()
        declared = self.pads if self.pads is not None else torch.zeros_like(seen)
        if declared.shape != seen.shape or not torch.equal(seen, declared):
            raise ValueError(
                f"the attention mask shows left padding of {seen.tolist()} tokens per row, but the cache was created "
                f"with {declared.tolist()}; create it with WushKVCache(model, config, attention_mask=attention_mask) "
                "so that each row's full-precision windows start at its first real token"
            )

    # -- transformers' layer API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        empty = key_states[:, :, :0]
        self.sink_k, self.sink_v = empty.clone(), value_states[:, :, :0].clone()
        self.recent_k, self.recent_v = empty.clone(), value_states[:, :, :0].clone()
        self.sink_start = 0
        B = key_states.shape[0]
        if self.pads is not None and self.pads.numel() != B:
            if B % self.pads.numel():
                raise ValueError(f"pad lengths for {self.pads.numel()} rows, but the batch has {B}")
            # generate(num_beams=k) repeats each prompt row k times (repeat_interleave) after the cache was
            # made; the attention mask of the prefill is checked against this (_check_padding).
            self.pads = self.pads.repeat_interleave(B // self.pads.numel())
        pads = self._pad_list()
        self.sink_len = self.cfg.windows.S_sink + max(pads)  # columns kept in the full-precision sink
        self.mid_start = self.cfg.windows.S_sink + min(pads)
        self._mid_len = 0  # tokens in the quantized middle (after eviction)
        self._mid_fp_store = {"k": empty.clone(), "v": value_states[:, :, :0].clone()}  # middle of a full-precision side
        if self.row_mode:
            self.rows = [WushKVLayer(self.cfg, self.head_dim, self.key_transform, self.sliding_window) for _ in pads]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.rows is not None:
            return self._update_rows(key_states, value_states)
        if self.key_transform is not None:
            key_states = self.key_transform.keys(key_states)
        n0, T = self.n, key_states.shape[2]
        n1 = n0 + T
        # 1. the first S_sink positions (of the longest padding row) go to the full-precision sink
        take = min(T, max(0, self.sink_len - n0))
        if take:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :take]], dim=2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :take]], dim=2)
        win_k = torch.cat([self.recent_k, key_states[:, :, take:]], dim=2)
        win_v = torch.cat([self.recent_v, value_states[:, :, take:]], dim=2)
        w0 = n1 - win_k.shape[2]
        view = KVView(self, n0, n1, self.sink_k, self.sink_v, self.sink_start, self._mid_len, self.mid_start, win_k, win_v, w0, 0)
        # 2. flush whole blocks of S_flush into the quantized middle (appended, never re-quantized)
        c_old, c_new = self.mid_start + self._mid_len, self._code_end(n1)
        if c_new > c_old:
            k_new, v_new = self._columns(c_old, c_new, win_k, win_v, w0)
            self._append_mid(k_new, v_new, c_old)
        # 3. the recent buffer keeps what some row still reads in full precision
        moved = max(0, min(max(self.sink_len, min(self._row_ends(n1))), n1) - w0)
        view.moved = moved
        view.mid, view.mid_len = self._snapshot_mid(), self._mid_len
        self.recent_k, self.recent_v = win_k[:, :, moved:], win_v[:, :, moved:]
        self.n = n1
        if self.is_sliding:  # the view keeps what this step reads; the layer keeps what later steps can see
            self._evict(n1 - self.sliding_window + 1)
        return view, view

    def _update_rows(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Row mode: each row's real tokens of this update go to its own layer (padding never enters)."""
        n0, T = self.n, key_states.shape[2]
        views = []
        for b, (row, p) in enumerate(zip(self.rows, self._pad_list())):
            skip = min(T, max(0, p - n0))  # padding columns of this update in row b
            views.append(row.update(key_states[b : b + 1, :, skip:], value_states[b : b + 1, :, skip:])[0] if skip < T else None)
        self.n = n0 + T
        view = RowsView(self, n0, self.n, views, key_states[:, :, :0])
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
        self.rows = None
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
        layers = self.rows if self.rows is not None else [self]
        counts = [min(n, layer.n) for layer in layers]  # a row's real tokens among the last n
        for layer, k in zip(layers, counts):
            if k > layer._croppable():
                raise ValueError(
                    f"cannot crop {n} tokens: only the {layer._croppable()} most recent tokens are in full precision and "
                    "not yet coded (quantized tokens are never re-quantized or un-appended)"
                )
        for layer, k in zip(layers, counts):
            if k:
                layer.recent_k, layer.recent_v = layer.recent_k[:, :, :-k], layer.recent_v[:, :, :-k]
                layer.n -= k
        if self.rows is not None:
            self.n -= n

    def _croppable(self) -> int:
        return max(0, self.n - max(self.mid_start + self._mid_len, self.n - self.recent_k.shape[2])) if self.is_initialized else 0

    def _apply_batch(self, fn) -> None:
        if self.pads is not None:  # also before the first tokens: generate() expands rows for beams first
            self.pads = fn(self.pads)
        if not self.is_initialized:
            return
        if self.rows is not None:  # a row taken twice (beams) continues as two independent copies
            taken: set[int] = set()
            rows = []
            for i in fn(torch.arange(len(self.rows))).tolist():
                rows.append(copy.deepcopy(self.rows[i]) if i in taken else self.rows[i])
                taken.add(i)
            self.rows = rows
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
        self._apply_batch(lambda x: x[indices.to(x.device)] if torch.is_tensor(indices) else x[indices])

    def offload(self):  # the packed store stays where it is
        pass

    def prefetch(self):
        pass

    # -- internals ---------------------------------------------------------------------------
    def _first_visible(self, n: int) -> int:
        return max(n - self.sliding_window + 1, 0) if self.is_sliding else 0

    def _columns(self, a: int, b: int, win_k, win_v, w0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision keys and values of columns [a, b), from the sink and the window starting at w0."""
        end = self.sink_start + self.sink_k.shape[2]
        ks, vs = [], []
        if a < end:
            i, j = a - self.sink_start, min(b, end) - self.sink_start
            ks.append(self.sink_k[:, :, i:j])
            vs.append(self.sink_v[:, :, i:j])
        lo = max(a, end)
        if b > lo:
            if lo < w0:
                raise RuntimeError(f"columns [{lo}, {w0}) are needed for the codes but no longer held")
            ks.append(win_k[:, :, lo - w0 : b - w0])
            vs.append(win_v[:, :, lo - w0 : b - w0])
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def _key_center(self, start: int, n: int, dtype) -> torch.Tensor | None:
        """T c_t for columns [start, start + n) (keys centered on their RoPE mean), or None.

        A column's rotary position is its index minus its row's left padding, as transformers numbers
        left-padded rows; the same columns always give the same centers, which is all exactness needs."""
        kt = self.key_transform
        if self.k_side is None or kt is None or not kt.centered_on_rope_mean or n == 0:
            return None
        pos = torch.arange(start, start + n).view(1, n)
        if self.pads is not None:
            pos = (pos - self.pads.view(-1, 1)).clamp_min(0)  # pad columns are never read
        return kt.center(pos, dtype)

    @staticmethod
    def _minus_center(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """x − c in float32 at least (the codec quantizes float32): the one subtraction every path shares."""
        return x.float() - c if x.dtype != torch.float64 else x - c.double()

    def _append_mid(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        c = self._key_center(start, k.shape[2], torch.float32)
        if c is not None:
            k = self._minus_center(k, c)
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

    def _mid_parts(self, snap: dict, n: int, start: int, dtype) -> tuple:
        """The middle of a snapshot as :func:`wushkv.decode.decode_attention` parts (keys, values).

        Keys centered on their RoPE mean are decoded and given their centers back here (a dense part):
        the code-domain kernels read the codes of plain keys only."""
        out = []
        kt = self.key_transform
        if n and self.k_side is not None and kt is not None and kt.centered_on_rope_mean:
            mk, _ = self._decode_mid(snap, n, dtype, start=start)
            return mk, (snap["v"][:, :, :n] if self.v_side is None else (self.v_side.codec, snap["v"], n))
        for name, side in (("k", self.k_side), ("v", self.v_side)):
            out.append(snap[name][:, :, :n] if side is None else (side.codec, snap[name], n))
        return out[0], out[1]

    def _decode_mid(self, snap: dict, n: int, dtype, first: int | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize the first ``first`` (default: all ``n``) tokens of a middle snapshot holding ``n``,
        whose first column is ``start``: (B, Hkv, first, d) keys and values. ``first`` is a multiple of
        the codec block."""
        m = n if first is None else first
        out = []
        for name, side in (("k", self.k_side), ("v", self.v_side)):
            if m == 0:
                out.append(self.sink_k[:, :, :0].to(dtype))
            elif side is None:
                out.append(snap[name][:, :, :m].to(dtype))
            else:
                part = {key: t[:, :, : t.shape[2] * m // n] for key, t in snap[name].items()}
                x = side.codec.decode(part, m)
                c = self._key_center(start, m, torch.float32) if name == "k" else None
                out.append((x if c is None else x + c).to(dtype))
        return out[0], out[1]

    def _fake(self, side: str, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Quantize-dequantize the whole blocks of a window that starts on the flush grid at column ``start``;
        the rest stays as is."""
        s = self.k_side if side == "key" else self.v_side
        if s is None or x.shape[2] == 0:
            return x
        n = (x.shape[2] // self.block) * self.block
        if n == 0:
            return x
        c = self._key_center(start, n, torch.float32) if side == "key" else None  # as _append_mid/_decode_mid use it
        if c is None:
            xq = s.codec.fake(x[:, :, :n])
        else:
            xq = s.codec.fake(self._minus_center(x[:, :, :n], c)) + c
        return torch.cat([xq.to(x.dtype), x[:, :, n:]], dim=2)

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
        if self.rows is not None:
            parts = [row.nbytes() for row in self.rows]
            return {k: sum(p[k] for p in parts) for k in ("codes", "metadata", "full_precision")}
        codes = meta = 0
        for side in (self.k_side, self.v_side):
            if side is not None:
                c, m = side.store.nbytes()
                codes, meta = codes + c, meta + m
        fp = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.recent_k, self.recent_v, *self._mid_fp_store.values()))
        return {"codes": codes, "metadata": meta, "full_precision": fp}
