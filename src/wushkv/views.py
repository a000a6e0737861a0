"""The views a :class:`~wushkv.layer.WushKVLayer` hands to attention: what the registered ``"wushkv"`` attention
(:mod:`wushkv.hf`) reads instead of key and value tensors.

* :class:`KVView`: one layer's snapshot (sink, packed middle, recent buffer) for a batch; in decode it attends
  straight from the codes (:mod:`wushkv.decode`), for a multi-token chunk it runs the exact single-pass emulation
  (query ``i`` sees token ``t`` quantized iff ``S_sink <= t < S_sink + Qc(i+1)``); left-padded rows are masked.
* :class:`RaggedView`: a one-token step of a padded batch under quantizers of token blocks (ragged rows, each row's
  tokens from its own column of batched storage), attended from the codes in one call with a mask per row.
* :class:`RowsView`: any other update of such a batch, each row an unpadded layer, attended row by row.

The layer's storage and its quantization live in :mod:`wushkv.layer`; this module only reads them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .attention import as_allowed, fast_attention, fused_selective_attention, needs_reference, selective_attention
from .decode import decode_attention
from .triton_kernels import to_device


def _queries(layer, module, query: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``query`` in the layer's transformed key space, as ``dtype``; refuses a module whose key transform changed."""
    kt = getattr(module, "wushkv_key", None)
    if kt is not layer.key_transform:
        raise RuntimeError(
            "the key transform of this attention module changed after the WushKVCache was created; "
            "create the cache after apply_transforms()/restore() (a cache saved and loaded again holds copies of the "
            "transforms, not the model's: such a cache cannot be continued)"
        )
    return (kt.queries(query) if kt is not None else query).to(dtype)


class LayerView:
    """What the modeling code may touch on the object ``update`` returns (it only passes it on to attention):
    shape, device, dtype and kv_offset, from ``layer``, ``n0``/``n1`` and a (B, Hkv, *, d) tensor ``_like``.

    The registered attention (:func:`wushkv.hf.wushkv_attention`) hands every ``LayerView`` it is given
    as ``key`` to the view's ``attend(module, query, attention_mask, scaling, softcap, sinks)``."""

    _FOREIGN = ("a WushKVCache's layer view reached another attention implementation than wushkv's: the model's "
                "attention was switched back after the cache was created (the `with apply_transforms(...)` block or "
                "`Installed` context it was made in has exited, or set_attn_implementation was called); create the "
                "cache, and run the model with it, inside the block")

    def __getitem__(self, index):  # what eager/SDPA attention does first with its keys (repeat_kv)
        raise RuntimeError(self._FOREIGN)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # a torch function handed a view (SDPA's kernel)
        raise RuntimeError(cls._FOREIGN)

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
    ends: torch.Tensor | None = None  # a padded batch's (B,) row ends after this update (WushKVLayer.ends)

    @property
    def _like(self) -> torch.Tensor:
        return self.win_k

    def attend(self, module, query, attention_mask, scaling: float, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query`` (B, Hq, T, d) over this layer; returns (B, T, Hq, d) in transformed V space.
        ``softcap``: the logit softcap or None; ``sinks``: learned sink logits (Hq,) or None."""
        layer = self.layer
        query = _queries(layer, module, query, self.win_k.dtype)
        if self.n0 == 0:
            layer._check_padding(attention_mask)
        T = query.shape[2]
        if layer.row_sinks:
            if T == 1:
                return self._decode_padded(query, attention_mask, scaling, softcap, sinks)
            return self._attend_padded(query, attention_mask, scaling, softcap, sinks)
        dt = self.win_k.dtype
        if T == 1:  # decode: read the packed codes directly, block by block (wushkv.decode)
            S = self.n1 - self.kv_offset
            allowed = as_allowed(attention_mask, S)
            if allowed is None and S < self.n1 - self.sink_start:
                allowed = torch.ones(query.shape[0], 1, 1, S, dtype=torch.bool, device=query.device)
            mid_k, mid_v = layer._mid_parts(self.mid, self.mid_len, self.mid_start, dt)
            rk, rv = (self.win_k[:, :, self.moved :], self.win_v[:, :, self.moved :]) if self.moved else (self.win_k, self.win_v)
            return decode_attention(query, [self.sink_k, mid_k, rk], [self.sink_v, mid_v, rv], allowed, scaling, softcap, sinks=sinks)

        mid_len = self.mid_len_before  # what this update flushed is still in the window, in full precision
        flushed = self.mid_len - mid_len
        if layer.k_side is None and layer.v_side is None:  # a full-precision layer (bit allocation): plain attention
            mk, mv = layer._decode_mid(self.mid, self.mid_len, dt, first=mid_len, start=self.mid_start)
            S = self.n1 - self.kv_offset
            K = torch.cat([self.sink_k, mk, self.win_k], dim=2)[:, :, -S:]
            V = torch.cat([self.sink_v, mv, self.win_v], dim=2)[:, :, -S:]
            return fast_attention(query, K, V, as_allowed(attention_mask, S), scaling, softcap, sinks)
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
        if needs_reference(query, softcap, sinks):  # the explicit two-matmul reference
            return selective_attention(*args, softcap, sinks)
        return fused_selective_attention(*args)

    def _decode_padded(self, query, attention_mask, scaling: float, softcap: float | None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode of a left-padded batch straight from the codes: the parts [rows' sinks, packed middle, recent
        buffer], with a mask per row over all their columns.

        Row ``b`` (``p_b`` pad tokens) reads column ``c`` quantized iff ``p_b + S_sink <= c < end_b`` (as
        :meth:`_attend_padded`; ``end_b`` the row's end, :attr:`ends`), in full precision otherwise. The middle is
        column-aligned across rows and holds every column some row reads quantized; the buffer every column from the
        smallest ``end_b`` on; row ``b``'s sink its first real tokens that the buffer has let go of
        (``wushkv.layer.WushKVLayer._update_padded``). So a column may sit in two parts, and each row sees it in the
        one it reads: the same attention as the emulation, no full-precision copy of the middle.
        """
        layer, dt = self.layer, self.win_k.dtype
        mid_k, mid_v = layer._mid_parts(self.mid, self.mid_len, self.mid_start, dt)
        visible, held = self._padded_reads(attention_mask, query.shape[0], query.device)
        return decode_attention(query, [self.sink_k, mid_k, self.win_k], [self.sink_v, mid_v, self.win_v],
                                visible.view(query.shape[0], 1, 1, -1), scaling, softcap, sinks=sinks, held=held)

    def _padded_reads(self, attention_mask, B: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """(:meth:`_padded_visible`, :meth:`_held`), made once a step: every full-attention layer of a step asks for
        the same (the same paddings, row ends, part widths and mask tensor), and making them is ~40 small operations,
        about what the kernel's read of a 512-token batch of 8 costs (:func:`_per_step`). Nothing writes to them."""
        layer, m = self.layer, attention_mask
        if m is not None and not torch.is_tensor(m):
            return self._padded_visible(m, B, dev), self._held()
        key = ("padded", B, self.kv_offset, layer.cfg.windows.S_sink, self.sink_start, self.sink_k.shape[2],
               self.mid_start, self.mid_len, self.w0, self.win_k.shape[2], self.n1, layer.pads.numpy().tobytes(),
               self.ends.numpy().tobytes(), *_mask_key(m, dev))
        return _per_step(key, m, lambda: (self._padded_visible(m, B, dev), self._held()))

    def _padded_visible(self, attention_mask, B: int, dev) -> torch.Tensor:
        """(B, N) bool: which of the parts' columns [sink, middle, buffer] each row of :meth:`_decode_padded` sees."""
        layer = self.layer
        lo, w = self.kv_offset, layer.cfg.windows
        # built where the query is: one copy of 2·B ints that does not make the host wait for a GPU, no (B, N) work
        pads, ends = to_device(torch.stack([layer.pads, self.ends]), dev).unsqueeze(-1)
        ns, nm, nw = self.sink_k.shape[2], self.mid_len, self.win_k.shape[2]
        arange = lambda a, n: torch.arange(a, a + n, device=dev)
        pos = torch.cat([pads + arange(self.sink_start, ns), arange(self.mid_start, nm).expand(B, nm),
                         arange(self.w0, nw).expand(B, nw)], dim=1)  # (B, N): each row's columns, part by part
        part = torch.cat([torch.zeros(ns, device=dev), torch.ones(nm, device=dev), torch.full((nw,), 2, device=dev)])
        quantized = (pos >= pads + w.S_sink) & (pos < ends)
        # a sink column counts once the buffer has let go of it (below the buffer's start)
        visible = torch.where(part == 1, quantized, ~quantized & ((part == 2) | (pos < self.w0)))
        visible &= (pos >= lo) & (pos >= pads)  # inside a sliding window, never a pad
        S = self.n1 - lo
        allowed = as_allowed(attention_mask, S)  # (B | 1, 1, 1, S): columns [lo, n1)
        if allowed is not None:
            visible &= allowed.reshape(-1, S).expand(B, S).gather(1, (pos - lo).clamp(0, S - 1))
        visible |= ~visible.any(-1, keepdim=True)  # a row of padding alone (its output is never read): no NaN
        return visible

    def _held(self) -> torch.Tensor:
        """(B, 3, 2) int64 on the host: for each part [sink, middle, buffer], the columns [a, e) from row ``b``'s first
        to its last visible one (as :meth:`_decode_padded`'s mask sees them, before the mask of transformers, which
        may hide more): the sink's below the buffer's start; the middle's from ``p_b + S_sink`` to ``end_b``; the
        buffer's from the first of the row's sink tokens it still holds, else from ``end_b``. All from ``lo`` on and
        none a pad: a row reads neither its padding nor the other rows' columns."""
        layer, lo = self.layer, self.kv_offset
        p, ends, S_sink = layer.pads, self.ends, layer.cfg.windows.S_sink
        width = torch.tensor([self.sink_k.shape[2], self.mid_len, self.win_k.shape[2]])
        s0 = p + self.sink_start  # each row's sink column 0
        first = p.clamp(min=lo)  # the row's first real column inside the window
        in_buffer = first.clamp(min=self.w0)  # its first sink token the buffer holds, where p + S_sink is past it
        rec = torch.where(p + S_sink > in_buffer, in_buffer, ends.clamp(min=first).clamp(min=self.w0))
        a = torch.stack([first - s0, first.clamp(min=p + S_sink) - self.mid_start, rec - self.w0], 1)
        e = torch.stack([self.w0 - s0, ends - self.mid_start, width[2].expand_as(p)], 1)
        a = torch.minimum(a.clamp(min=0), width)
        return torch.stack([a, torch.maximum(torch.minimum(e, width), a)], 2)

    def _attend_padded(self, query, attention_mask, scaling: float, softcap: float | None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Left-padded batch: the same emulation, with each row's windows counted from its first real token.

        Row ``b`` (``p_b`` pad tokens) sees column ``c`` quantized for query position ``i`` iff
        ``p_b + S_sink <= c < p_b + S_sink + Qc(i + 1 - p_b)``. The layer keeps every column some row still
        needs in full precision (the rows' sinks ∪ recent) and codes for every column some row needs quantized, so
        both versions exist wherever a row can read them. The reference of :meth:`_decode_padded`.
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
            put(dst, mid, self.mid_start)  # columns only the codes still hold: quantized for every row that reads them
            for b, p in enumerate(layer._pad_list()):  # each row's sink (columns it still lacks come from the buffer)
                put(dst[b : b + 1], sink[b : b + 1], p + self.sink_start)
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
        if needs_reference(query, softcap, sinks):
            return selective_attention(*args, softcap, sinks)
        return fused_selective_attention(*args)


@dataclass
class RowsView(LayerView):
    """What ``update`` hands to attention for a left-padded batch whose quantizers code blocks of tokens.

    Each row is an unpadded :class:`WushKVLayer` over the batch's ragged storage (its blocks start at its first
    real token, as they would for the row alone: ``WushKVLayer.row_layers``); ``rows[b]`` is that layer's
    :class:`KVView` for this update, or None while row ``b`` has seen only padding. Attention runs row by row over
    the real columns, so every row gets exactly what it gets alone; outputs at padding positions are zero (never read).
    """

    layer: WushKVLayer
    n0: int
    n1: int
    rows: list
    _like: torch.Tensor  # (B, Hkv, 0, d): shape, device and dtype of the batch

    def attend(self, module, query, attention_mask, scaling: float, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layer
        if self.n0 == 0:
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
            o = view.attend(module, query[b : b + 1, :, T - tq :], mask, scaling, softcap, sinks)
            if out is None:
                out = o.new_zeros(B, T, *o.shape[2:])
            out[b, T - tq :] = o[0]
        return out if out is not None else query.new_zeros(B, T, Hq, self._like.shape[-1])


@dataclass
class RaggedView(LayerView):
    """What a one-token step hands to attention for a left-padded batch whose quantizers code blocks of tokens
    (:meth:`wushkv.layer.WushKVLayer._step_ragged`): every row's real tokens in batched parts, each from the row's own
    column, as the row alone would hold them, attended in one call from the codes with a mask per row.

    Attributes (B, Hkv, *, d): ``rs`` (B, 9) int64 on the host, each row's ``WushKVLayer._RAGGED`` after this step;
    ``sink_k/v`` the sinks (column = position); ``mid`` {"k", "v"}: the middles' storage per key (B, Hkv, cap, ·),
    or None where nothing is coded yet; ``mid_n`` the widest row's middle columns (tokens, ``mid_lo + mid_n``);
    ``rec_k/v`` the recent buffers, as wide as the widest row's ``rec_lo + rec_n``.
    """

    layer: WushKVLayer
    n0: int
    n1: int
    rs: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    mid: dict
    mid_n: int
    rec_k: torch.Tensor
    rec_v: torch.Tensor

    @property
    def _like(self) -> torch.Tensor:
        return self.rec_k

    def attend(self, module, query, attention_mask, scaling: float, softcap: float | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Row ``b`` reads its sink columns ``[sink_start, sink_start + sink_n)``, its middle's ``[mid_lo, mid_lo +
        mid_n)`` and its buffer's ``[rec_lo, rec_lo + rec_n)`` (positions ``n - rec_n`` on), of parts as wide as the
        widest row's (:meth:`_held`: the Triton kernel reads those columns alone), under a mask over all the parts'
        columns: each column's position (plus the row's padding) looked up in transformers' mask and window."""
        layer, dt = self.layer, self.rec_k.dtype
        query = _queries(layer, module, query, dt)
        B, M = query.shape[0], self.mid_n
        visible = self._visible(attention_mask, B, query.device)
        parts = []
        for name in ("k", "v"):
            side = layer.k_side if name == "k" else layer.v_side
            store, cols = self.mid[name], layer.rcols.get(name, {})
            full = self.sink_k if name == "k" else self.sink_v
            if side is None:
                parts.append(full[:, :, :0] if store is None else store["fp"][:, :, : M // layer.block * cols["fp"]])
                continue
            run = (side.codec, {} if store is None else {key: t[:, :, : M // layer.block * cols[key]] for key, t in store.items()}, M)
            if name == "k" and M and layer.inputs.key_mean is not None:  # storage column 0 at mid_start − mid_lo
                run += (layer.centers_from(self.rs[:, layer.MID_START] - self.rs[:, layer.MID_LO]),)
            parts.append(run)
        return decode_attention(query, [self.sink_k, parts[0], self.rec_k], [self.sink_v, parts[1], self.rec_v],
                                visible.view(B, 1, 1, -1), scaling, softcap, sinks=sinks, held=self._held())

    def _held(self) -> torch.Tensor:
        """(B, 3, 2) int64 on the host: each row's columns [a, e) of the parts [sink, middle, buffer]."""
        L = self.layer
        return torch.tensor([[r[L.SINK_START], r[L.SINK_START] + r[L.SINK_N], r[L.MID_LO], r[L.MID_LO] + r[L.MID_N],
                              r[L.REC_LO], r[L.REC_LO] + r[L.REC_N]] for r in self.rs.tolist()], dtype=torch.long).view(-1, 3, 2)

    def _visible(self, attention_mask, B: int, dev) -> torch.Tensor:
        """(B, N) bool, which of the parts' columns each row sees: its own (the rest of each part's width is other
        rows'), inside the sliding window and allowed by transformers' mask, each column at its position plus the
        row's padding. About thirty operations on B × N entries, and every layer of a step with the same rows, parts
        and mask needs the same: a padded batch's layers of one kind (full attention; sliding) hold the same rows
        and transformers hands them one mask tensor. So it is made once and kept (:func:`_per_step`), keyed by the
        rows' table and paddings, the parts' widths, the first visible column, the device's stream, and that very
        mask tensor (held weakly: a mask freed and another made at its address is another key). Nothing writes to
        it."""
        S_sink, M, R = self.sink_k.shape[2], self.mid_n, self.rec_k.shape[2]
        lo = self.kv_offset  # (padded columns)
        S = self.n1 - lo
        make = lambda: self._make_visible(attention_mask, B, dev, S_sink, M, R, lo, S)  # noqa: E731
        if attention_mask is not None and not torch.is_tensor(attention_mask):  # (a tensor can be held weakly)
            return make()
        key = ("ragged", self.layer.pads.numpy().tobytes(), self.rs.numpy().tobytes(), B, S_sink, M, R, lo, S,
               *_mask_key(attention_mask, dev))
        return _per_step(key, attention_mask, make)

    def _make_visible(self, attention_mask, B: int, dev, S_sink: int, M: int, R: int, lo: int, S: int) -> torch.Tensor:
        layer = self.layer
        # one copy of 10·B ints to where the query is, no wait for a GPU
        p, n, sink_start, sink_n, mid_start, mid_n, rec_n, _, mid_lo, rec_lo = to_device(
            torch.cat([layer.pads[:, None], self.rs], 1).T.contiguous(), dev).unsqueeze(-1)
        ar = lambda k: torch.arange(k, device=dev)  # noqa: E731
        j_sink, j_mid, j_rec = ar(S_sink), ar(M), ar(R)
        pos = torch.cat([j_sink.expand(B, S_sink), mid_start - mid_lo + j_mid, n - rec_n - rec_lo + j_rec], dim=1)  # (B, N)
        visible = torch.cat([(j_sink >= sink_start) & (j_sink < sink_start + sink_n),
                             (j_mid >= mid_lo) & (j_mid < mid_lo + mid_n), (j_rec >= rec_lo) & (j_rec < rec_lo + rec_n)], 1)
        visible &= p + pos >= lo  # inside a sliding window
        allowed = as_allowed(attention_mask, S)
        if allowed is not None:
            visible &= allowed.reshape(-1, S).expand(B, S).gather(1, (p + pos - lo).clamp(0, S - 1))
        visible |= ~visible.any(-1, keepdim=True)  # a row whose mask hides all (its output is never read): no NaN
        return visible


def _mask_key(mask, dev) -> tuple:
    """What :func:`_per_step` keys a mask and a device by: the mask's identity, shape and version (a write in place
    is another mask), the device and, on a GPU, the current stream (only work queued after a tensor on its own stream
    reads it)."""
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else None
    return str(dev), stream, None if mask is None else (id(mask), tuple(mask.shape), mask._version)


def _per_step(key: tuple, mask, make):
    """``make()``, kept under ``key`` for the next layers of the step that ask with the same (:data:`_PER_STEP`):
    a padded batch's layers of one kind (full attention; sliding) hold the same rows, and transformers hands them
    one mask tensor, which the entry holds weakly (a mask freed and another made at its address is another key). A
    step's few kinds of layers are kept; older steps' are never asked again."""
    hit = _PER_STEP.get(key)
    if hit is not None and (hit[0] is None or hit[0]() is mask):
        return hit[1]
    value = make()
    if len(_PER_STEP) >= 4:
        _PER_STEP.clear()
    _PER_STEP[key] = (None if mask is None else weakref.ref(mask), value)
    return value


# what the layers of a step share, by what makes it (_per_step): {key: (weakref to the mask tensor or None, value)}
_PER_STEP: dict = {}
