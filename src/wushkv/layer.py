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
:mod:`wushkv.views`); with quantizers of token blocks (KVarN's tiles, KIVI), whose blocks start at a
different column in each row, the rows are ragged: each row's tokens from its own column of batched storage, as the row
alone stores them (a one-token step batched, :class:`RaggedView`; anything else through the rows as unpadded
layers, :class:`RowsView`).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from .codecs import make_codec, storage_nbytes
from .config import QuantConfig
from .decode import encode_block
from .transforms.rope import rope_bias_terms, rope_rotate
from .triton_kernels import rope_table, to_device
from .views import KVView, RaggedView, RowsView


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


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it is a view of a much larger tensor: what a layer keeps of a chunk (take_back's
    copies; the recent buffer, :meth:`_Window.keep`) must not hold the whole chunk's full precision until the next
    update. A prompt of N tokens in one update would otherwise leave every layer holding N tokens of keys and values
    at once after the prefill: a full-precision cache's memory."""
    return t.clone() if t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size() else t


@functools.lru_cache(maxsize=16)
def _rows(B: int, device: torch.device) -> torch.Tensor:
    """arange(B) int64 on ``device``, made once: a ragged batch's step indexes every row with it (never written)."""
    return to_device(torch.arange(B), device)


class _Window:
    """The recent buffer's keys and values (B, Hkv, n, d) as views of storages with spare columns after them, so that
    a decode step appends its token in place: ``torch.cat`` of the buffer and the token copied the whole buffer at
    every step and layer (2.4 MB a side a layer at batch 8 of SmolLM2 in float32). A fresh storage keeps half the
    buffer's length spare (at least 16 columns): it is copied about once in n/2 steps, two columns a step, and holds
    at most half as much again as the buffer. A view handed out is never written: a step writes past the kept
    buffer's end, and a buffer that is not the one kept here (a crop, take_back or a batch reorder replaced it), a
    full storage or another dtype or shape starts fresh storages."""

    def __init__(self):
        self.k = self.v = None  # the storages, (B, Hkv, cap, d)
        self.kept = (None, None)  # the recent buffer as last kept: views of k and v ending at column ``end``
        self.end = 0

    def extend(self, rk: torch.Tensor, rv: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(rk ++ k, rv ++ v) along dim 2, views of the storages: in place where (rk, rv) is the buffer kept last and
        the storage has room, else copied into fresh storages with max(16, n/2) columns to spare (none for a chunk
        longer than that, a prompt: :meth:`keep` lets its storage go)."""
        n, T, e = rk.shape[2], k.shape[2], self.end
        if (rk is self.kept[0] and rv is self.kept[1] and e + T <= self.k.shape[2] and k.dtype == self.k.dtype
                and v.dtype == self.v.dtype and k.shape[:2] == self.k.shape[:2] and v.shape[:2] == self.v.shape[:2]
                and k.shape[3] == self.k.shape[3] and v.shape[3] == self.v.shape[3]):
            self.k[:, :, e : e + T] = k
            self.v[:, :, e : e + T] = v
            return self.k[:, :, e - n : e + T], self.v[:, :, e - n : e + T]
        self.kept = (None, None)
        room = max(16, n // 2)
        size = n + T + (room if T <= room else 0)
        self.k = _concat_into(rk, k, size)
        self.v = _concat_into(rv, v, size)
        self.end = 0
        return self.k[:, :, : n + T], self.v[:, :, : n + T]

    def keep(self, wk: torch.Tensor, wv: torch.Tensor, start: int = 0):
        """The recent buffer: columns ``start`` on of (wk, wv), what :meth:`extend` returned (sliced only where
        ``start`` > 0: a decode step that moves nothing makes no views). A storage over twice the buffer's length
        (and 32 columns; a prompt's, or a buffer a flush shortened) is let go of: the buffer is copied into storages
        of its own length (else every layer would hold a whole prompt's keys and values in full precision until its
        next step)."""
        rk, rv = (wk[:, :, start:], wv[:, :, start:]) if start else (wk, wv)
        n = rk.shape[2]
        end = (rk.storage_offset() - self.k.storage_offset()) // self.k.stride(2) + n
        if self.k.shape[2] > 2 * n + 32:
            self.k = rk.clone(memory_format=torch.contiguous_format)
            self.v = rv.clone(memory_format=torch.contiguous_format)
            rk, rv, end = self.k, self.v, n
        self.kept, self.end = (rk, rv), end
        return rk, rv


def _concat_into(a: torch.Tensor, b: torch.Tensor, size: int) -> torch.Tensor:
    """A fresh (B, H, size, d) storage whose first columns are a ++ b along dim 2 (in their promoted dtype, as
    torch.cat gives them)."""
    n, T = a.shape[2], b.shape[2]
    if a.shape[:2] != b.shape[:2] or a.shape[3] != b.shape[3]:
        return torch.cat([a, b], dim=2)  # (torch.cat's error, naming the sizes)
    out = a.new_empty(*a.shape[:2], size, a.shape[3], dtype=torch.promote_types(a.dtype, b.dtype))
    out[:, :, :n] = a
    out[:, :, n : n + T] = b
    return out


class _Growable:
    """A dict of tensors that grow along dim 2 with amortized doubling (no O(n²) concatenation)."""

    def __init__(self):
        self.buf: dict[str, torch.Tensor] = {}
        self.start: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self._views: dict[str, torch.Tensor] | None = None  # view()'s, until the next change (asked at every step)

    def append(self, items: dict[str, torch.Tensor]) -> None:
        self._views = None
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
        """The live columns of each tensor (views; a new dict, the views made once per change)."""
        if self._views is None:
            self._views = {k: b[:, :, self.start[k] : self.end[k]] for k, b in self.buf.items()}
        return dict(self._views)

    def hold(self, buf: dict[str, torch.Tensor], start: dict[str, int], end: dict[str, int]) -> None:
        """Hold columns [start, end) of the tensors ``buf`` (a ragged batch's row: views of its storage)."""
        self.buf, self.start, self.end, self._views = buf, start, end, None

    def drop_front(self, counts: dict[str, int]) -> None:
        self._views = None
        for k, c in counts.items():
            self.start[k] = min(self.start[k] + c, self.end[k])

    def truncate(self, lengths: dict[str, int]) -> None:
        self._views = None
        for k, n in lengths.items():
            self.end[k] = self.start[k] + n

    def apply(self, fn) -> None:
        """Replace every live tensor by ``fn(tensor)`` (batch reorder / select)."""
        self._views = None
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
        self.store.append(encode_block(self.codec, x))  # the Triton store kernel on CUDA where it applies


class RotatingKeyMean:
    """Keys centered on their rotating mean (methods ``+rmean``): the keys' pre-RoPE mean μ (Hkv, d), which RoPE
    turns into a different vector c_t = R_t μ at every position t. The cache quantizes the middle's keys as
    T (k_t − c_t) and adds T c_t back when it reads them: exact (the same c_t both ways, a function of the
    position alone), and the quantizer no longer spends its range on the mean.

    ``mu`` (Hkv, d); ``T`` (Hkv, d, d) the layer's key transform; ``rope`` = (inv_freq (d/2,), scaling) of the layer.
    """

    def __init__(self, mu: torch.Tensor, T: torch.Tensor, rope: tuple[torch.Tensor, float]):
        H, d = T.shape[0], T.shape[-1]
        if tuple(mu.shape) != (H, d) or tuple(rope[0].shape) != (d // 2,):
            raise ValueError(f"the rotating key mean must be (KV heads, head_dim) = {(H, d)} with inv_freq ({d // 2},), "
                             f"got {tuple(mu.shape)} and {tuple(rope[0].shape)}")
        if not torch.isfinite(mu).all():
            raise ValueError("the rotating key mean contains NaN or inf")
        self.T_t = T.detach().double().transpose(-1, -2).contiguous()  # rows: c @ Tᵀ; everything on T's device
        self.mu = mu.detach().to(self.T_t.device, torch.float64, copy=True)
        self.inv_freq = rope[0].detach().float().to(self.T_t.device)
        self.theta = rope[0].detach().float().cpu()  # the host's copy: angles are computed there (no wait per step)
        self.scaling = float(rope[1])
        self._TM32 = None  # T times rope_bias_terms' matrix, float32 where the queries are (score_terms)

    def center(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """T c_t with c_t = R_t μ, in the transformed space. positions: (B', N) integer (B' = 1 or the batch).
        Returns (B', Hkv, N, d) in ``dtype``.

        Exactness needs the same value for a position whichever block of positions it is computed in: float64
        throughout, then rounded to float32, so the last bits a matmul's blocking may change are rounded away."""
        pos = positions.to(self.T_t.device)[:, None, :]  # (B', 1, N)
        c = rope_rotate(self.mu[None, :, None, :], pos, self.inv_freq, self.scaling)  # (B', Hkv, N, d)
        return torch.matmul(c, self.T_t).float().to(dtype)

    def score_terms(self, qg: torch.Tensor) -> torch.Tensor:
        """[A | B] (B, Hkv, G, d) float32 of grouped queries qg (B, Hkv, G, d) in the transformed space:
        q·T c_t = (Tᵀq)·R_t μ = Σ_i A_i cos tθ_i + B_i sin tθ_i (:func:`wushkv.transforms.rope.rope_bias_terms`), so
        the centers' share of the scores is a function of the position that never forms T c_t (:meth:`scores`)."""
        if self._TM32 is None or self._TM32.device != qg.device:
            # [A | B] is linear in u = q T (Tᵀq as a row): u M, M's row k the terms of the unit vector e_k. So one
            # product with T M (formed once, in float64) per step, not a product and the six operations of the terms
            H, d = self.mu.shape
            M = rope_bias_terms(torch.eye(d, dtype=torch.float64, device=self.mu.device).expand(H, d, d),
                                self.mu[:, None, :], self.scaling)  # (Hkv, d, d)
            self._TM32 = torch.matmul(self.T_t.transpose(-1, -2), M).float().to(qg.device)
        return torch.matmul(qg.float(), self._TM32)

    def table(self, n: int, device) -> torch.Tensor:
        """:func:`wushkv.triton_kernels.rope_table` of this layer's frequencies for ``n`` positions on ``device``."""
        return rope_table(self.theta, n, device)

    def scores(self, terms: torch.Tensor, first: torch.Tensor, n: int) -> torch.Tensor:
        """q·T c_t (B, Hkv, G, n) float32 at positions first + r, r < n, of the :meth:`score_terms` [A | B];
        ``first`` (B',) int64, each row's first position (B' = 1 or the batch). The terms are turned by each row's
        first angle (float64, as :meth:`center`), then read against a table of the offsets' cos rθ, sin rθ
        (:func:`wushkv.triton_kernels.rope_table`, shared by the layers): Σ_i cos rθ_i A'_i + sin rθ_i B'_i with
        A' = A cos t₀θ + B sin t₀θ, B' = B cos t₀θ − A sin t₀θ. Equal to q·:meth:`center` up to float32 rounding."""
        h = terms.shape[-1] // 2
        A, B = terms[..., :h], terms[..., h:]
        ang = first.to(torch.float64).cpu()[:, None] * self.theta.double()  # (B', d/2)
        c0, s0 = (to_device(f(ang).float(), A.device)[:, None, None, :] for f in (torch.cos, torch.sin))
        return torch.matmul(torch.cat([A * c0 + B * s0, B * c0 - A * s0], -1), self.table(n, A.device)[:n].T)


class KeyCenters:
    """The centers of a run of the middle's keys (``+rmean``) as :func:`wushkv.decode.decode_attention` reads them:
    its token r sits at column ``start + r`` (minus its row's left padding ``pads`` (B,), as transformers numbers
    positions). ``dense(a, b)`` gives T c_t of tokens [a, b) (B', Hkv, b − a, d) float32, what the codes are read
    back with; ``scores(qg, a, b)`` gives q·T c_t (B, Hkv, G, b − a) float32 without forming them."""

    def __init__(self, mean: RotatingKeyMean, start: int, pads: torch.Tensor | None):
        self.mean, self.start, self.pads = mean, start, pads
        self._terms = None

    def row(self, b: int, a: int) -> KeyCenters:
        """The centers of row ``b``'s tokens from ``a`` on (a run cut to one row)."""
        return KeyCenters(self.mean, self.start + a, None if self.pads is None else self.pads[b : b + 1])

    def _first(self, a: int) -> torch.Tensor:
        first = torch.tensor([self.start + a], dtype=torch.int64)
        return first if self.pads is None else first - self.pads.cpu().long()

    def dense(self, a: int, b: int) -> torch.Tensor:
        pos = self._first(a)[:, None] + torch.arange(b - a)  # a row's padding at negative positions (never visible)
        return self.mean.center(pos, torch.float32)

    def kernel_inputs(self, qg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the Triton decode reads (:class:`wushkv.triton_kernels.KeyBias`): the terms [A | B] (B, Hkv, G, d)
        float32 of grouped queries qg (B, Hkv, G, d), each row's position of token 0 (B,) int64 on the host, and the
        RoPE frequencies (d/2,)."""
        return self.mean.score_terms(qg), self._first(0).expand(qg.shape[0]), self.mean.theta

    def scores(self, qg: torch.Tensor, a: int, b: int) -> torch.Tensor:
        if self._terms is None or self._terms[0] is not qg:  # the terms once per query, not per block
            self._terms = (qg, self.mean.score_terms(qg))
        return self.mean.scores(self._terms[1], self._first(a), b - a)


@dataclass(frozen=True)
class CacheInputs:
    """What a layer of the cache needs of a method besides its quantizer settings, given explicitly (never read off
    the model): ``feedback_K`` / ``feedback_V`` (Hkv, d, d), the error-feedback matrices the codecs round the
    transformed keys / values with (``+ldlq``; :mod:`wushkv.quantizers.feedback`), and ``key_mean``, the
    :class:`RotatingKeyMean` the middle's keys are centered on (``+rmean``). All None: plain rounding."""

    feedback_K: torch.Tensor | None = None
    feedback_V: torch.Tensor | None = None
    key_mean: RotatingKeyMean | None = None


NO_INPUTS = CacheInputs()


class WushKVLayer(CacheLayerMixin):
    """One layer of the quantized cache. See the module docstring for the layout."""

    is_compileable = False
    # how many of the last tokens of the cache's first update (a prompt, with assisted decoding's first drafts) can be
    # taken back with no trace (:meth:`take_back`): full-precision copies of the columns an update codes are held
    # until the next update, of a prompt only as far back as this reaches (about a recent buffer's worth per layer
    # after a prefill, not the prompt's full precision); a later update (a verification of drafts, transformers' first
    # 20 by default, prompt lookup's 10, growing by 2 a round under the "heuristic" schedule) holds all it codes, so
    # any of its tokens can be taken back (at most its own length of copies, until the next update)
    UNDO_TOKENS = 128

    def __init__(self, cfg: QuantConfig, head_dim: int, key_transform=None, sliding_window: int | None = None,
                 inputs: CacheInputs = NO_INPUTS):
        super().__init__()
        self.cfg = cfg
        self.head_dim = head_dim
        self.key_transform = key_transform  # the attention module's KeyTransform (T_K online), or None
        self.inputs = inputs
        self.sliding_window = sliding_window
        self._window = _Window()  # the recent buffer's storages (not a ragged batch's): a step appends in place
        self._undo = None  # (c, keys, values): the last update's full-precision copies of columns [c, ...) it coded
        self.is_sliding = sliding_window is not None
        # transformers' past recording (``activate_past_recording``, which its assisted decoding calls before the
        # first draft): a sliding-window layer then lets go of what its window leaves behind at a crop, not at an
        # update, so the crop of rejected drafts can take their update back (transformers' sliding layers do as much)
        self.record_past = False
        k_codec, v_codec = make_codec(cfg, "key", head_dim, inputs.feedback_K), make_codec(cfg, "value", head_dim, inputs.feedback_V)
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
        self._declared_pads: torch.Tensor | None = None  # as set_padding was given them (pads follow beams' rows)
        self.row_mode = False  # a padded batch under block quantizers: ragged rows (_update_ragged)
        self.row_sinks = False  # a padded batch of per-token quantizers: each row's own sink (_update_padded)

    def __deepcopy__(self, memo):
        """A copy that continues independently (e.g. scoring one answer while generating another) and
        shares the key transform, which belongs to the model's attention module, not to the cache."""
        memo.setdefault(id(self.key_transform), self.key_transform)
        memo.setdefault(id(self.inputs), self.inputs)  # read-only: shared like the transform
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    @property
    def is_croppable(self) -> bool:
        """Whether the cache's crop puts this layer back as it was, leaving no trace (transformers' meaning: its
        assisted decoding refuses a cache where not, at once). An unpadded full-attention layer takes back any of its
        last update's tokens (of a first update, a prompt, up to :data:`UNDO_TOKENS`; :meth:`take_back`), and so does
        a sliding-window one that records its past (:meth:`activate_past_recording`); one that does not lets go of
        positions as its window moves. A padded batch's rows keep no copies (transformers' assisted decoding runs one
        sequence anyway); :meth:`crop` still removes their full-precision tail where it can."""
        return (not self.is_sliding or self.record_past) and not self.padded

    def activate_past_recording(self, **kwargs) -> None:
        """transformers' past recording, which its assisted decoding turns on before the first draft (and 5.24 leaves
        on): a sliding-window layer keeps what its window leaves behind until the next :meth:`crop` (or
        :meth:`take_back`), which takes the last update back where asked and then lets go of what the next step
        cannot see. So drafts rejected across the window's edge are taken back with no trace, as on a full-attention
        layer. (Keyword arguments, e.g. ``recurrent_states_to_keep``, are for linear-attention layers.)"""
        self.record_past = True

    @property
    def padded(self) -> bool:
        return self.pads is not None and bool((self.pads > 0).any())

    def set_padding(self, pads: torch.Tensor | None) -> None:
        """Declare ``pads[b]`` left-padding tokens in row ``b``: that row's windows start after them."""
        if self.is_initialized and self.n > 0:
            raise RuntimeError("set the padding before the first tokens enter the cache")
        if pads is not None:
            given = torch.as_tensor(pads).flatten().cpu()
            if given.is_floating_point() and not torch.equal(given, given.round()):
                raise ValueError(f"pad lengths must be whole numbers of tokens, got {given.tolist()}")
            pads = given.to(torch.long)
            if (pads < 0).any():
                raise ValueError(f"pad lengths must be >= 0, got {pads.tolist()}")
        # Blocks of tokens (tiles) start at a different column in each row: give each row its own layer.
        self.row_mode = pads is not None and bool((pads > 0).any()) and self.block > 1
        self.pads = self._declared_pads = pads

    def _row_ends(self, n: int) -> list[int]:
        """Per row: the column after its quantized middle when the cache holds ``n`` columns."""
        w = self.cfg.windows
        return [p + w.S_sink + w.quantized_count(max(n - p, 0)) for p in self._pad_list()]

    def _pad_list(self) -> list[int]:
        return self.pads.tolist() if self.pads is not None else [0]

    def _code_end(self, n: int, ends: list[int] | None = None) -> int:
        """Codes exist for columns [S_sink + min pad, this): every column some row reads quantized (up to ``ends``,
        default the rows' ends at ``n`` columns)."""
        w, pads = self.cfg.windows, self._pad_list()
        ends = [e for e, p in zip(self._row_ends(n) if ends is None else ends, pads) if e > p + w.S_sink]
        return max(ends) if ends else w.S_sink + min(pads)

    def _check_padding(self, attention_mask: torch.Tensor | None) -> None:
        """At the first prefill, the padding the mask shows must be the padding the cache was told of (no mask: none;
        transformers gives none to a single query over full attention without padding)."""
        # the last prompt position's row of the mask: what it may attend to. A sliding window hides more than the
        # padding there, so a sliding layer reads the last position whose window still reaches back to column 0
        i = self.n - 1 if not self.is_sliding else min(self.n, self.sliding_window) - 1
        if attention_mask is None:
            seen = torch.zeros_like(self.pads) if self.pads is not None else torch.zeros(1, dtype=torch.long)
        else:
            m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            seen = (m[:, 0, i, : i + 1].int().cumsum(-1) == 0).sum(-1).cpu()
        declared = self.pads if self.pads is not None else torch.zeros_like(seen)
        # a first chunk shorter than a row's padding shows only padding there
        if declared.shape != seen.shape or not torch.equal(seen, declared.clamp(max=i + 1)):
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
        S_sink = self.cfg.windows.S_sink
        # A padded batch keeps each row's own sink (row_sinks): its S_sink first real tokens, (B, Hkv, S_sink, d),
        # filled as the recent buffer lets go of them (see _update_padded); an unpadded one the columns [0, S_sink).
        self.row_sinks = self.padded and not self.row_mode
        if self.row_sinks:
            self.sink_k = key_states.new_zeros(B, key_states.shape[1], S_sink, key_states.shape[-1])
            self.sink_v = value_states.new_zeros(B, value_states.shape[1], S_sink, value_states.shape[-1])
            # each row's end (the column after what it reads quantized); never decreases, as the middle never
            # shrinks: after a crop the rows keep reading quantized what was coded and let go of
            self.ends = torch.tensor(self._row_ends(0))
        self.mid_start = S_sink + min(pads)
        self._mid_len = 0  # tokens in the quantized middle (after eviction)
        self._evicted_to = 0  # positions below this may have been dropped (sliding-window layers)
        self._mid_fp_store = {"k": empty.clone(), "v": value_states[:, :, :0].clone()}  # middle of a full-precision side
        if self.row_mode:
            self._init_ragged(key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._undo = None
        if self.row_mode:
            return self._update_ragged(key_states, value_states)
        if self.key_transform is not None:
            key_states = self.key_transform.keys(key_states)
        if self.row_sinks:
            return self._update_padded(key_states, value_states)
        self._let_go()  # (recording past, uncropped: what no step from here on sees, as a crop would have)
        n0, T = self.n, key_states.shape[2]
        n1 = n0 + T
        # 1. the first S_sink positions go to the full-precision sink
        take = min(T, max(0, self.cfg.windows.S_sink - n0))
        if take:  # (else no slices: a decode step's slices of nothing cost a few µs of host time each, per layer)
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :take]], dim=2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :take]], dim=2)
            key_states, value_states = key_states[:, :, take:], value_states[:, :, take:]
        win_k, win_v = self._window.extend(self.recent_k, self.recent_v, key_states, value_states)
        w0 = n1 - win_k.shape[2]
        view = KVView(self, n0, n1, self.sink_k, self.sink_v, self.sink_start, self._mid_len, self.mid_start, win_k, win_v, w0, 0)
        # 2. flush whole blocks of S_flush into the quantized middle (appended, never re-quantized)
        c_old, c_new = self.mid_start + self._mid_len, self._code_end(n1)
        held = (c_new, None, None)  # the full-precision columns [c, c_new) this flush coded, for take_back: none
        if c_new > c_old:
            k_new, v_new = self._columns(c_old, c_new, win_k, win_v, w0)
            self._append_mid(k_new, v_new, c_old)
            # until the next update: all of them, or of a first update (a prompt) as far back as UNDO_TOKENS reach
            c = c_old if n0 else max(c_old, self._code_end(max(n1 - self.UNDO_TOKENS, 0)))
            held = (c, _compact(k_new[:, :, c - c_old:]), _compact(v_new[:, :, c - c_old:]))
        # 3. the recent buffer keeps what some row still reads in full precision
        moved = max(0, min(max(self.cfg.windows.S_sink, min(self._row_ends(n1))), n1) - w0)
        view.moved = moved
        view.mid, view.mid_len = self._snapshot_mid(), self._mid_len
        self.recent_k, self.recent_v = self._window.keep(win_k, win_v, moved)
        self.n = n1
        if self.is_sliding and not self.record_past:  # the view keeps what this step reads; the layer what later steps see
            self._evict(n1 - self.sliding_window + 1)
        else:  # (recording: a crop lets go of what the window left behind, after taking back what it is asked to)
            self._undo = held
        return view, view

    def _update_padded(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A left-padded batch of per-token quantizers in one store, whose middle is column-aligned across rows.

        Every column enters the recent buffer. Codes hold every column some row reads quantized (row ``b`` reads
        ``[p_b + S_sink, end_b)`` so, ``end_b`` in :attr:`ends`), coded from the buffer. The buffer lets go of
        a column once no row reads it there (below the smallest ``end_b``); a column it lets go of that is one of
        row ``b``'s ``S_sink`` first real tokens is copied to that row's sink, whose column ``j`` is position
        ``p_b + sink_start + j``. So the full precision held is the rows' sinks and the buffer, as for the rows
        alone, however far apart their paddings are. Attention masks each row to its version of each column
        (:meth:`KVView._decode_padded`)."""
        n0, T = self.n, key_states.shape[2]
        n1 = n0 + T
        win_k, win_v = self._window.extend(self.recent_k, self.recent_v, key_states, value_states)
        w0 = n1 - win_k.shape[2]
        view = KVView(self, n0, n1, self.sink_k, self.sink_v, self.sink_start, self._mid_len, self.mid_start, win_k, win_v, w0, 0)
        # (on the host's lists: the (B,) tensor operations were a fifth of this update's host time)
        before = self.ends.tolist()
        ends = [max(e, r) for e, r in zip(before, self._row_ends(n1))]
        if ends != before:  # a fresh tensor (nothing writes to one: views share it until it changes)
            self.ends = torch.tensor(ends, dtype=torch.long)
        c_old, c_new = self.mid_start + self._mid_len, self._code_end(n1, ends)
        if c_new > c_old:  # the buffer holds them: it lets go of no column some row still needs coded
            if c_old < w0:
                raise RuntimeError(f"columns [{c_old}, {w0}) are needed for the codes but no longer held")
            self._append_mid(win_k[:, :, c_old - w0 : c_new - w0], win_v[:, :, c_old - w0 : c_new - w0], c_old)
        w1 = max(w0, min(min(ends), n1))  # the buffer's new start
        first, ns = [self.sink_start + p for p in self._pad_list()], self.sink_k.shape[2]
        rows = [(b, max(f, w0), min(f + ns, w1)) for b, f in enumerate(first) if min(f + ns, w1) > max(f, w0)]
        if rows:  # the sinks the view holds stay as they were: copy before writing
            self.sink_k, self.sink_v = self.sink_k.clone(), self.sink_v.clone()
            for b, a, e in rows:
                j = a - first[b]
                self.sink_k[b, :, j : j + e - a] = win_k[b, :, a - w0 : e - w0]
                self.sink_v[b, :, j : j + e - a] = win_v[b, :, a - w0 : e - w0]
        view.moved, view.ends = w1 - w0, self.ends
        view.mid, view.mid_len = self._snapshot_mid(), self._mid_len
        self.recent_k, self.recent_v = self._window.keep(win_k, win_v, w1 - w0)
        self.n = n1
        if self.is_sliding:
            self._evict(n1 - self.sliding_window + 1)
        return view, view

    # -- a left-padded batch of block quantizers: ragged rows ------------------------------------
    # Row b's real tokens are stored as the row alone stores them (its blocks start at its own first real token), in
    # batched tensors: the sink (B, Hkv, S_sink, d), column = position; the middle's storage per key (B, Hkv, cap, ·)
    # and the recent buffer (B, Hkv, R, d), row b's tokens from its column mid_lo / rec_lo on. What differs between
    # rows is a host table, self.rs (B, 9) int64, one column per name of _RAGGED. A view handed out never sees a
    # write to what it reads: a step writes past each row's held columns and moves the row's lo; a storage that fills
    # up is rebuilt, each row from column 0, in fresh tensors.
    _RAGGED = ("n", "sink_start", "sink_n", "mid_start", "mid_n", "rec_n", "evicted_to", "mid_lo", "rec_lo")
    N, SINK_START, SINK_N, MID_START, MID_N, REC_N, EVICTED, MID_LO, REC_LO = range(9)

    def _init_ragged(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H = key_states.shape[:2]
        self.rs = torch.zeros(B, len(self._RAGGED), dtype=torch.long)
        self.rs[:, self.MID_START] = self.cfg.windows.S_sink
        self.sink_k = key_states.new_zeros(B, H, self.cfg.windows.S_sink, key_states.shape[-1])
        self.sink_v = value_states.new_zeros(B, H, self.cfg.windows.S_sink, value_states.shape[-1])
        self.recent_k = key_states.new_zeros(B, H, self._recent_cap(0), key_states.shape[-1])
        self.recent_v = value_states.new_zeros(B, H, self._recent_cap(0), value_states.shape[-1])
        self.rmid: dict[str, dict[str, torch.Tensor] | None] = {"k": None, "v": None}  # per key (B, Hkv, cap, ·)
        self.rcols: dict[str, dict[str, int]] = {}  # columns of each key per block of S_flush tokens

    def _recent_cap(self, longest: int) -> int:
        """Columns of a fresh recent buffer whose longest row holds ``longest``: S_flush more than a row ever holds
        after an update (S_keep + S_flush − 1), so it is rebuilt about once in S_flush steps."""
        w = self.cfg.windows
        return max(w.S_keep + 2 * w.S_flush, longest + w.S_flush)

    def centers_from(self, firsts: torch.Tensor) -> KeyCenters:
        """The :class:`KeyCenters` of a ragged middle whose storage column 0 is row ``b``'s position ``firsts[b]``."""
        return KeyCenters(self.inputs.key_mean, 0, -firsts)  # first = start + a − pads

    def row_layers(self) -> list[WushKVLayer]:
        """Each row of a padded batch of block quantizers as the unpadded layer it equals (views of the batch's
        storage: read them, or update them and hand them back to ``_set_rows``)."""
        return [self._row_layer(b) for b in range(self.rs.shape[0])]

    def _row_layer(self, b: int) -> WushKVLayer:
        n, sink_start, sink_n, mid_start, mid_n, rec_n, evicted, mid_lo, rec_lo = self.rs[b].tolist()
        row = WushKVLayer(self.cfg, self.head_dim, self.key_transform, self.sliding_window, self.inputs)
        row.lazy_initialization(self.sink_k[b : b + 1, :, :0], self.sink_v[b : b + 1, :, :0])
        row.n, row.sink_start, row.mid_start, row._mid_len, row._evicted_to = n, sink_start, mid_start, mid_n, evicted
        row.sink_k = self.sink_k[b : b + 1, :, sink_start : sink_start + sink_n]
        row.sink_v = self.sink_v[b : b + 1, :, sink_start : sink_start + sink_n]
        row.recent_k = self.recent_k[b : b + 1, :, rec_lo : rec_lo + rec_n]
        row.recent_v = self.recent_v[b : b + 1, :, rec_lo : rec_lo + rec_n]
        for name, side in (("k", self.k_side), ("v", self.v_side)):
            mid = self.rmid[name]
            if mid is None:
                continue
            cols = lambda t, c: t // self.block * c  # noqa: E731
            if side is None:
                c = self.rcols[name]["fp"]
                row._mid_fp_store[name] = mid["fp"][b : b + 1, :, cols(mid_lo, c) : cols(mid_lo + mid_n, c)]
            else:  # a view of the row's storage: its appends write there, past what anything live reads
                store = getattr(row, f"{name}_side").store
                store.hold({key: t[b : b + 1] for key, t in mid.items()},
                           {key: cols(mid_lo, c) for key, c in self.rcols[name].items()},
                           {key: cols(mid_lo + mid_n, c) for key, c in self.rcols[name].items()})
        return row

    def _set_rows(self, rows: list[WushKVLayer]) -> None:
        """The batch's storage rebuilt from its rows (unpadded layers), each row from column 0: fresh tensors, so that
        the views handed out by the rows' updates keep what they read."""
        blk = self.block
        self.rs = torch.tensor([[r.n, r.sink_start, r.sink_k.shape[2], r.mid_start, r._mid_len, r.recent_k.shape[2],
                                 r._evicted_to, 0, 0] for r in rows], dtype=torch.long)
        B = len(rows)
        rec = self._recent_cap(int(self.rs[:, self.REC_N].max()))
        sink_k, sink_v = torch.zeros_like(self.sink_k), torch.zeros_like(self.sink_v)
        recent_k = self.recent_k.new_zeros(B, self.recent_k.shape[1], rec, self.recent_k.shape[-1])
        recent_v = self.recent_v.new_zeros(B, self.recent_v.shape[1], rec, self.recent_v.shape[-1])
        for b, r in enumerate(rows):
            a, e = r.sink_start, r.sink_start + r.sink_k.shape[2]
            sink_k[b, :, a:e], sink_v[b, :, a:e] = r.sink_k[0], r.sink_v[0]
            recent_k[b, :, : r.recent_k.shape[2]], recent_v[b, :, : r.recent_v.shape[2]] = r.recent_k[0], r.recent_v[0]
        self.sink_k, self.sink_v, self.recent_k, self.recent_v = sink_k, sink_v, recent_k, recent_v
        longest = max(r._mid_len for r in rows)
        for name, side in (("k", self.k_side), ("v", self.v_side)):
            stores = [{"fp": r._mid_fp_store[name]} if side is None else r._snapshot_mid()[name] for r in rows]
            if longest == 0 and self.rmid[name] is None:
                continue
            for r, st in zip(rows, stores):
                if r._mid_len and name not in self.rcols:
                    self.rcols[name] = {key: t.shape[2] * blk // r._mid_len for key, t in st.items()}
            like = self.rmid[name] or next(st for r, st in zip(rows, stores) if r._mid_len)
            cap = max(2 * longest, blk) // blk  # blocks
            mid = {key: t.new_zeros(B, t.shape[1], cap * self.rcols[name][key], *t.shape[3:]) for key, t in like.items()}
            for b, st in enumerate(stores):
                for key, t in st.items():
                    mid[key][b, :, : t.shape[2]] = t[0]
            self.rmid[name] = mid

    def _update_ragged(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A padded batch of block quantizers: each row's real tokens of this update go to its rows' storage, as its
        own unpadded layer would store them (padding never enters). A step of one token for every row is done for the
        whole batch at once and attended from the codes in one call (:class:`RaggedView`); anything else (a prompt, a
        chunk, a step where a row still sees padding) goes row by row through the rows as unpadded layers
        (:class:`RowsView`)."""
        n0, T = self.n, key_states.shape[2]
        n1 = n0 + T
        pads = self._pad_list()
        if T == 1 and n0 > 0 and all(p <= n0 for p in pads):  # every row gets a token: one batched step
            return self._step_ragged(key_states, value_states)
        rows, views = self.row_layers(), []
        for b, (row, p) in enumerate(zip(rows, pads)):
            skip = min(T, max(0, p - n0))  # padding columns of this update in row b
            views.append(row.update(key_states[b : b + 1, :, skip:], value_states[b : b + 1, :, skip:])[0] if skip < T else None)
        self._set_rows(rows)
        self.n = n1
        view = RowsView(self, n0, n1, views, key_states[:, :, :0])
        return view, view

    def _step_ragged(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One token for every row of a ragged batch: written past each row's end of the recent buffer (or, while a
        row's sink is not full, into its sink); a row whose buffer is full flushes its oldest S_flush tokens into its
        middle (those rows' blocks coded in one call); sliding layers let go of what falls behind each row's window.
        The view keeps what this step reads (the rows' extents before the eviction)."""
        if self.key_transform is not None:
            key_states = self.key_transform.keys(key_states)
        w, B, dev = self.cfg.windows, key_states.shape[0], key_states.device
        N, SINK_N, REC_N, REC_LO, MID_N = self.N, self.SINK_N, self.REC_N, self.REC_LO, self.MID_N
        # The table's bookkeeping on the host's lists, back to a tensor once: as ~40 torch operations on (B,) tensors
        # it was most of the step's host time at batch 8 (a few µs each, per layer and step).
        table = self.rs.tolist()
        sinking = [r[N] < w.S_sink for r in table]  # rows whose token is one of their first S_sink
        if max(r[REC_LO] + r[REC_N] for r in table) >= self.recent_k.shape[2]:
            self._compact_recent()
            table = self.rs.tolist()
        if not any(sinking):  # each row's token at its buffer's end: one pinned copy of B ints, one write a side
            at = to_device(torch.tensor([r[REC_LO] + r[REC_N] for r in table], dtype=torch.long), dev)
            self.recent_k[_rows(B, dev), :, at] = key_states[:, :, 0]
            self.recent_v[_rows(B, dev), :, at] = value_states[:, :, 0]
        else:  # the first steps after a prompt shorter than S_sink: that row's token into its sink (column = position)
            for into_sink, dst in ((False, ("recent_k", "recent_v")), (True, ("sink_k", "sink_v"))):
                idx = [b for b in range(B) if sinking[b] == into_sink]
                if idx:
                    cols = [table[b][N] if into_sink else table[b][REC_LO] + table[b][REC_N] for b in idx]
                    at = to_device(torch.tensor([idx, cols], dtype=torch.long), dev)
                    getattr(self, dst[0])[at[0], :, at[1]] = key_states[at[0], :, 0]
                    getattr(self, dst[1])[at[0], :, at[1]] = value_states[at[0], :, 0]
        for r, into_sink in zip(table, sinking):
            r[N] += 1
            r[SINK_N if into_sink else REC_N] += 1
        n_new = [r[N] for r in table]
        self.rs = torch.tensor(table, dtype=torch.long)  # (a fresh table: a view handed out holds its own clone)
        # a row codes a block once its end S_sink + Qc(n) passes its middle's (after a crop it may not yet)
        flush = [b for b, r in enumerate(table) if w.S_sink + w.quantized_count(r[N]) > r[self.MID_START] + r[MID_N]]
        if flush:
            self._flush_ragged(flush)
            table = self.rs.tolist()
        n0 = self.n
        self.n = n0 + 1
        R = max(r[REC_LO] + r[REC_N] for r in table)
        view = RaggedView(self, n0, self.n, self.rs.clone(), self.sink_k, self.sink_v, dict(self.rmid),
                          max(r[self.MID_LO] + r[MID_N] for r in table), self.recent_k[:, :, :R], self.recent_v[:, :, :R])
        if self.is_sliding:  # the view keeps what this step reads; the layer keeps what later steps can see
            self._evict_ragged([n - self.sliding_window + 1 for n in n_new])
        return view, view

    def _gather_rows(self, t: torch.Tensor, lo: torch.Tensor, n: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(B', Hkv, n, ·) of ``t`` (B, Hkv, *, ·)'s rows ``rows`` (int64 (B',) on the host; None: all): row b's columns
        [lo[b], lo[b] + n) (past its end: any columns, never read), in one indexed read of just those columns (a view
        of it, dims 1 and 2 swapped); ``lo`` (B',) int64 on the host."""
        cols = (lo[:, None] + torch.arange(n)).clamp(max=max(t.shape[2] - 1, 0))
        rows = torch.arange(t.shape[0]) if rows is None else rows
        return t[to_device(rows, t.device)[:, None], :, to_device(cols, t.device)].transpose(1, 2)

    def _compact_recent(self) -> None:
        """A fresh recent buffer, each row's tokens from column 0 (its rec_lo back to 0)."""
        rs = self.rs
        longest = int(rs[:, self.REC_N].max())
        cap = self._recent_cap(longest)
        for name in ("recent_k", "recent_v"):
            t = getattr(self, name)
            new = t.new_zeros(*t.shape[:2], cap, t.shape[-1])
            new[:, :, :longest] = self._gather_rows(t, rs[:, self.REC_LO], longest)
            setattr(self, name, new)
        rs[:, self.REC_LO] = 0

    def _compact_mid(self, blocks: int) -> None:
        """Fresh middle storage of ``blocks`` blocks a row, each row's tokens from column 0 (its mid_lo back to 0)."""
        rs, blk = self.rs, self.block
        longest = int(rs[:, self.MID_N].max()) // blk
        for name, mid in self.rmid.items():
            if mid is None:
                continue
            new = {}
            for key, t in mid.items():
                c = self.rcols[name][key]
                new[key] = t.new_zeros(*t.shape[:2], blocks * c, *t.shape[3:])
                if longest:
                    new[key][:, :, : longest * c] = self._gather_rows(t, rs[:, self.MID_LO] // blk * c, longest * c)
            self.rmid[name] = new
        rs[:, self.MID_LO] = 0

    def _flush_ragged(self, rows: list[int]) -> None:
        """Rows ``rows`` move the oldest S_flush tokens of their recent buffers to the ends of their middles, coded in
        one call; written past what any view reads (a full storage rebuilt in fresh tensors first)."""
        blk, rs = self.block, self.rs
        idx = torch.tensor(rows)
        lo = rs[idx, self.REC_LO]
        k = self._gather_rows(self.recent_k, lo, blk, idx).contiguous()  # (F, Hkv, S_flush, d)
        v = self._gather_rows(self.recent_v, lo, blk, idx).contiguous()
        first = rs[idx, self.MID_START] + rs[idx, self.MID_N]  # each row's first position of its block
        km = self.inputs.key_mean
        if self.k_side is not None and km is not None:
            k = self._minus_center(k, km.center(first[:, None] + torch.arange(blk), torch.float32))
        stores = {}
        for name, side, x in (("k", self.k_side, k), ("v", self.v_side, v)):
            stores[name] = {"fp": x} if side is None else encode_block(side.codec, x)
            if name not in self.rcols:
                self.rcols[name] = {key: t.shape[2] for key, t in stores[name].items()}
            if self.rmid[name] is None:  # room for the rows' first blocks
                self.rmid[name] = {key: t.new_zeros(rs.shape[0], t.shape[1], 0, *t.shape[3:]) for key, t in stores[name].items()}
        held = next(iter(self.rmid["k"].values()))
        cap = held.shape[2] // next(iter(self.rcols["k"].values()))  # blocks
        need = int((rs[idx, self.MID_LO] + rs[idx, self.MID_N]).max()) // blk + 1
        if need > cap:  # fresh storage, doubled past what the rows hold
            self._compact_mid(max(cap, 2 * (int(rs[:, self.MID_N].max()) // blk + 1)))
        for name, store in stores.items():
            mid = self.rmid[name]
            for i, b in enumerate(rows):
                m = int(rs[b, self.MID_LO] + rs[b, self.MID_N]) // blk
                for key, t in store.items():
                    c = self.rcols[name][key]
                    mid[key][b, :, m * c : (m + 1) * c] = t[i]
        rs[idx, self.REC_LO] += blk
        rs[idx, self.REC_N] -= blk
        rs[idx, self.MID_N] += blk

    def _evict_ragged(self, firsts: list[int]) -> None:
        """Each row lets go of its positions below ``firsts[b]`` (sliding-window layers), as ``_evict``: sink columns
        one by one, the middle by whole blocks. Only the extents move (the storage is compacted when it fills)."""
        rs, blk = self.rs, self.block
        first = torch.tensor(firsts)
        on = first > 0
        rs[:, self.EVICTED] = torch.where(on, torch.maximum(rs[:, self.EVICTED], first), rs[:, self.EVICTED])
        drop = torch.minimum((first - rs[:, self.SINK_START]).clamp(min=0), rs[:, self.SINK_N]) * on
        rs[:, self.SINK_START] += drop
        rs[:, self.SINK_N] -= drop
        drop = torch.minimum((first - rs[:, self.MID_START]).clamp(min=0), rs[:, self.MID_N]) // blk * blk * on
        rs[:, self.MID_START] += drop
        rs[:, self.MID_N] -= drop
        rs[:, self.MID_LO] += drop

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = self._first_visible(self.n)
        return self.n + query_length - kv_offset, kv_offset

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        """Empty, as made: the padding as declared (not as beams, ``num_return_sequences`` or a selection of rows
        left it), no tokens."""
        self._undo = None
        self.is_initialized = False
        self.row_sinks = False
        self.n = 0
        for side in (self.k_side, self.v_side):
            if side is not None:
                side.store = type(side.store)()
        self.set_padding(self._declared_pads)

    def can_take_back(self, tokens_to_remove: int) -> bool:
        """Whether :meth:`take_back` can remove these tokens (transformers' ``crop`` argument: negative, how many;
        positive, the length to keep): from an unpadded full-attention layer, or a sliding-window one recording its
        past whose next step would see nothing it let go of, where every column to be held in full precision after it
        still is, or was coded by the last update (of a first update, the copies of what its last
        :data:`UNDO_TOKENS` tokens coded; of a later one, all)."""
        n = tokens_to_remove if tokens_to_remove > 0 else self.n + tokens_to_remove
        if self._undo is None or not 0 <= n < self.n or self._first_visible(n) < self._evicted_to:
            return False
        return self._code_end(n) >= self._undo[0]

    def take_back(self, tokens_to_remove: int) -> None:
        """Remove the last tokens with no trace: the layer then holds what appending only the tokens before them
        would have made, which columns are coded and their codes, as decoding them token by token makes it. The
        middle is cut back to the columns coded at that length (codes are a token's, or a whole block's, whenever
        they are made), and the columns the cut brings back into the recent buffer come from the last update's
        full-precision copies of what it coded (held until the next update). A crop of the drafts a model got wrong
        thus leaves the cache as if they had never been there: assisted decoding gives what decoding alone gives.
        :meth:`crop` removes the full-precision tail only, and what an update coded stays coded."""
        if not self.can_take_back(tokens_to_remove):
            raise ValueError(f"cannot take back {tokens_to_remove} tokens of {self.n}: only from an unpadded full-attention layer, "
                             f"back to what its last update coded (of a first update, up to its last {self.UNDO_TOKENS} tokens)")
        n1, n = self.n, (tokens_to_remove if tokens_to_remove > 0 else self.n + tokens_to_remove)
        lo, held_k, held_v = self._undo
        c = self._code_end(n)  # the columns coded at length n end here (>= S_sink); [min(c, n), n) in the buffer
        m = c - self.mid_start
        if m < self._mid_len:
            for name, side in (("k", self.k_side), ("v", self.v_side)):
                if side is not None:
                    side.store.truncate({key: t.shape[2] * m // self._mid_len for key, t in side.store.view().items()})
                else:
                    self._mid_fp_store[name] = self._mid_fp_store[name][:, :, :m]
            self._mid_len = m
        # full precision from column f on: the held columns [lo, c_new) the last update coded, then the buffer
        f = n1 - self.recent_k.shape[2]
        span_k, span_v = self.recent_k, self.recent_v
        if held_k is not None:
            f -= held_k.shape[2]
            span_k, span_v = torch.cat([held_k, span_k], dim=2), torch.cat([held_v, span_v], dim=2)
        a, e = max(min(c, n) - f, 0), max(n - f, 0)  # (a sink not yet full holds all: the buffer empty)
        self.recent_k, self.recent_v = span_k[:, :, a:e], span_v[:, :, a:e]
        keep = max(n - self.sink_start, 0)  # the sink's columns below n (a sliding window may have let its first go)
        self.sink_k, self.sink_v = self.sink_k[:, :, :keep], self.sink_v[:, :, :keep]
        self.n = n
        self._undo = (c, None, None)  # what a later take_back can still reach: the buffer alone
        self._let_go()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last tokens; only tokens still in the full-precision recent buffer can be removed, and on a
        sliding-window layer only while the next step's window holds nothing the layer has let go of. What an update
        coded stays coded: the cache's crop takes the last update back exactly where it can (:meth:`take_back`)."""
        plan = self._crop_plan(tokens_to_remove)
        if plan is not None:
            self._undo = None
            n, layers, counts = plan
            for layer, k in zip(layers, counts):
                if k:
                    layer.recent_k, layer.recent_v = layer.recent_k[:, :, :-k], layer.recent_v[:, :, :-k]
                    layer.n -= k
            if self.row_mode:
                self._set_rows(layers)
                self.n -= n
        self._let_go()  # (transformers' crop(0) after drafts all accepted: the window moves on)

    def _let_go(self) -> None:
        """A sliding-window layer recording its past lets go of what the next step cannot see: at a crop, and at an
        update not cropped after the one before (transformers leaves recording on after assisted decoding: the layer
        then holds a window and an update's tokens, not all it was given)."""
        if self.is_sliding and self.record_past and self.is_initialized and not self.row_mode and not self.row_sinks:
            self._evict(self.n - self.sliding_window + 1)

    def _crop_plan(self, tokens_to_remove: int):
        """(tokens, layers, tokens each) that ``crop(tokens_to_remove)`` removes (the layer, or each row's layer), or
        None for nothing; a ValueError, before anything changes, where it cannot."""
        if tokens_to_remove > 0:  # the length to keep: at or past the layer's, nothing to remove
            tokens_to_remove = max(self.n - tokens_to_remove, 0)
        n = abs(tokens_to_remove)
        if n == 0 or not self.is_initialized:
            return None
        if n > self.n:
            raise ValueError(f"cannot crop {n} tokens: the layer holds {self.n}")
        layers = self.row_layers() if self.row_mode else [self]
        counts = [min(n, layer.n) for layer in layers]  # a row's real tokens among the last n
        for layer, k in zip(layers, counts):
            if k > layer._croppable():
                # (an unpadded full-attention layer got here only past what take_back reaches: a prompt's copies)
                reach = ("" if layer.is_sliding or self.padded else
                         f"; a crop takes back any of the last update's tokens, but of the cache's first update (a prompt, "
                         f"verified with assisted decoding's first drafts) only its last {self.UNDO_TOKENS}: draft at most "
                         f"{self.UNDO_TOKENS} tokens in the first round")
                raise ValueError(
                    f"cannot crop {n} tokens: only the {layer._croppable()} most recent tokens are in full precision and "
                    f"not yet coded (quantized tokens are never re-quantized or un-appended){reach}"
                )
            if k and layer.is_sliding and layer._first_visible(layer.n - k) < layer._evicted_to:
                # (the next step after the crop sees positions from _first_visible(n - k))
                raise ValueError(
                    f"cannot crop {n} tokens of a sliding-window layer (window {layer.sliding_window}) holding {layer.n}: "
                    f"it keeps only the positions its next step reads (from {layer._evicted_to}), and after the crop that "
                    f"step would read from {layer._first_visible(layer.n - k)}; crop before its window fills"
                )
        return n, layers, counts

    def _croppable(self) -> int:
        if self.row_mode and self.is_initialized:  # the most tokens every row can give up (a row holds no more than n)
            each = [(r._croppable(), r.n) for r in self.row_layers()]
            return min([c for c, n in each if c < n], default=self.n)
        return max(0, self.n - max(self.mid_start + self._mid_len, self.n - self.recent_k.shape[2])) if self.is_initialized else 0

    def _apply_batch(self, fn) -> None:
        self._undo = None  # (the rows change: the last update is not taken back)
        if self.pads is not None:  # also before the first tokens: generate() expands rows for beams first
            self.pads = fn(self.pads)
        if self.row_sinks:
            self.ends = fn(self.ends)
        if not self.is_initialized:
            return
        if self.row_mode:  # a row taken twice (beams) continues as two independent copies
            self.rs = fn(self.rs)
            self.rmid = {name: None if mid is None else {key: fn(t) for key, t in mid.items()} for name, mid in self.rmid.items()}
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
        km = self.inputs.key_mean
        if self.k_side is None or km is None or n == 0:
            return None
        pos = torch.arange(start, start + n).view(1, n)
        if self.pads is not None:
            pos = (pos - self.pads.view(-1, 1)).clamp_min(0)  # pad columns are never read
        return km.center(pos, dtype)

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

        Keys centered on their RoPE mean are a run with its :class:`KeyCenters` (read by the decode in the
        code domain, the centers' share of the scores a function of the position)."""
        out = []
        for name, side in (("k", self.k_side), ("v", self.v_side)):
            out.append(snap[name][:, :, :n] if side is None else (side.codec, snap[name], n))
        if n and self.k_side is not None and self.inputs.key_mean is not None:
            out[0] += (KeyCenters(self.inputs.key_mean, start, self.pads),)
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
        self._evicted_to = max(self._evicted_to, first)  # positions below may be gone (crop checks it)
        last_pad = max(self._pad_list()) if self.row_sinks else 0  # a sink column goes once it is behind for every row
        drop = min(max(0, first - self.sink_start - last_pad), self.sink_k.shape[2])
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
        if self.row_mode:  # what each row holds (the storage's spare columns are not counted, as _Growable's)
            parts = [row.nbytes() for row in self.row_layers()]
            return {k: sum(p[k] for p in parts) for k in ("codes", "metadata", "full_precision")}
        codes = meta = 0
        for side in (self.k_side, self.v_side):
            if side is not None:
                c, m = side.store.nbytes()
                codes, meta = codes + c, meta + m
        fp = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.recent_k, self.recent_v, *self._mid_fp_store.values()))
        return {"codes": codes, "metadata": meta, "full_precision": fp}
