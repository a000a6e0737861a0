"""Triton kernels of the packed cache: *store* (transform, quantize, pack, write) and split-KV *decode*.

Which codecs: per-token groups, i.e. :class:`~wushkv.codecs.TokenCodec` over QuEST and the affine quantizer
(every ``quest``/``affine`` cache, and the values of ``kivi`` and of the ``+ktiles`` methods), and for decode the
keys of KVarN tiles (:class:`TileFormat`: the key tiles ``auto`` picks), whose per-channel scale is folded into the
query tile by tile, so their codes enter the dots as per-token codes do; KIVI's per-channel keys are read as such
tiles whose per-token s_tok is 1 (a stride-0 view); KVarN's value tiles (the ``kvarn`` method's, ``+tiles``) as
per-token codes whose sums take each tile's channel scales. Store covers error-feedback rounding of per-token codes
(``+ldlq``: a pass over the channels, one program's rows at a time), not the per-token clip search
(``clip_search``); decode reads what that stores, so it covers it. KVarN's key tiles (``+ktiles``, every recipe
``auto`` records) have a kernel of their own (:func:`kvarn_key_tiles`: a tile a program, balance, rows, with
``+ldlq`` along the channels), which quantizes KVarN's value tiles too (:func:`kvarn_value_tiles`).

Layouts (``nb`` = ⌈d·b/8⌉ packed bytes, ``ng`` = d/G groups, codes as :func:`wushkv.quantizers.pack` lays them out):

* contiguous, the transformers cache (:mod:`wushkv.layer`): codes (B, Hkv, cap, nb), scale/offset (B, Hkv, cap, ng);
* paged, vLLM's: codes (num_blocks, block_size, Hkv, nb), scale/offset (num_blocks, block_size, Hkv, ng); a token's
  slot is ``block · block_size + row``, and decode finds sequence ``b``'s token ``t`` in block
  ``block_table[b, t // block_size]``.

A left-padded batch of the transformers cache holds its rows side by side in contiguous parts, each row's tokens in
columns of its own (:func:`decode`'s ``starts``): decode reads each row's columns alone, none of its padding nor of
the other rows'.

*Store* runs one program per (BR tokens, KV head) (BR = 8 on a GPU, 1 where a row's work is d², 64 under the
interpreter): it loads each token's d values of the head, applies the head's transform
``k' = T k`` when given, computes each group's grid exactly as :mod:`wushkv.quantizers` does (IEEE division and
square root, the same float32 constants), packs 8 codes into ``b`` bytes and writes them with the metadata;
``slot < 0`` (vLLM's padding) writes nothing. With error feedback (``+ldlq``) the codes are rounded channel by channel
on the grid as stored, each code's error pushed onto the later channels (``F`` row by row, shared by the program's
rows), in the float32 steps of :func:`wushkv.quantizers.feedback.feedback_round` (compiled without fused
multiply-adds).

*Decode* runs one program per (sequence, KV head, split): the program reads its split's columns of the packed
middle, then of the full-precision sink and recent buffer (one online softmax over all three), once for all the
query heads of the GQA group. With one group per token, 1- to 4-bit codes are read as words (16 bits, or one or
three bytes) split into classes, one tensor-core dot per class (:func:`code_classes`); other codes are loaded as
bytes and unpacked in registers; with one group per token the scores are ``s ⊙ (C q) + z·Σq`` and the output
``Cᵀ(p ⊙ s) + (Σ p z)·1``
(:mod:`wushkv.decode`), with smaller groups a tile is dequantized in registers. KVarN key tiles fold their scale
into the query (:class:`TileFormat`); keys stored centered on their rotating mean add a function of the position to
their scores (:class:`KeyBias`). Nothing is dequantized to global memory. Each split keeps an online softmax
(running max, sum, weighted values) and writes them; a second kernel
merges the splits (adding the learned sink logits, gpt-oss, to the denominator) and writes the output.

Triton is imported on first use, so ``import wushkv`` never needs it. On CUDA tensors the kernels compile; on CPU
tensors they run under Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before triton
is first imported (the interpreter replaces triton's own library functions at import).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import numbers
import types
import weakref
from dataclasses import dataclass

import torch

from .quantizers import AffineQuantizer, QuestQuantizer
from .quantizers.packing import PACK_BITS
from .quantizers.quest import UNCLIPPED_FROM

_TINY = float(torch.finfo(torch.float32).tiny)  # QuEST's floor on Δ
_MIN_RANGE = 1e-8  # the affine quantizer's floor on hi − lo (wushkv.quantizers.affine)
_CALLS: collections.Counter = collections.Counter()  # kernel name -> launches since reset_calls()


def available() -> bool:
    """Whether triton can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def interpreting() -> bool:
    """Whether triton was imported under its interpreter (``TRITON_INTERPRET=1``): the kernels then run on CPU
    tensors. Decided once, when triton is first imported (so kept: it is asked at every decode call)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


def calls() -> dict[str, int]:
    """Kernel launches by name since :func:`reset_calls` (``{"decode": 3, "merge": 3}``): which path actually ran."""
    return dict(_CALLS)


def reset_calls() -> None:
    _CALLS.clear()


@dataclass(frozen=True)
class TokenFormat:
    """What the kernels need of a per-token codec: ``bits`` (1, 2, 3, 4, 8), head dim ``d`` and group size ``G``
    (powers of two, 8 ≤ G ≤ d, 16 ≤ d), ``quest`` (symmetric: only the step is stored, offset = (½ − 2^{b−1})·Δ)
    or affine (scale and offset stored), and for *store* the grid: QuEST's step coefficient ``coef``
    (Δ = coef·RMS when ``clipped``, else coef·max|x|), the affine percentile index ``kth`` (−1: no clip).
    ``step_byte``: QuEST's steps are one E5M3 byte each (:func:`wushkv.codecs.e5m3_decode`: float16's bits 14..7);
    decode reads them; store rounds each step to its byte and the codes on the rounded step (since session 74)."""

    bits: int
    d: int
    G: int
    quest: bool
    coef: float = 0.0
    clipped: bool = False
    kth: int = -1
    step_byte: bool = False

    def __post_init__(self):
        if self.bits not in PACK_BITS:
            raise ValueError(f"the Triton kernels take bits in {list(PACK_BITS)}, got {self.bits!r}")
        for name, v, lo in (("head_dim", self.d, 16), ("group size", self.G, 8)):
            if v < lo or v & (v - 1):
                raise ValueError(f"the Triton kernels need a {name} that is a power of two >= {lo}, got {v}")
        if self.d % self.G:
            raise ValueError(f"group size {self.G} must divide head_dim {self.d}")
        if self.step_byte and not self.quest:
            raise ValueError("one-byte (e5m3) steps are QuEST's only; an affine format stores scale and offset")

    @property
    def nbytes(self) -> int:
        return self.d * self.bits // 8

    @property
    def ngroups(self) -> int:
        return self.d // self.G

    @property
    def half(self) -> float:
        """QuEST's offset per unit step: ½ − 2^{b−1}."""
        return 0.5 - 2 ** (self.bits - 1)

    @classmethod
    def of(cls, quantizer, head_dim: int) -> TokenFormat:
        """The format of a per-token :class:`QuestQuantizer` or :class:`AffineQuantizer` (axis −1, no clip search);
        ValueError for anything the kernels do not cover, naming it."""
        G = head_dim if quantizer.group_size is None else quantizer.group_size
        if getattr(quantizer, "search", 0):
            raise ValueError(f"the Triton store does not run the per-token clip search (search={quantizer.search})")
        if isinstance(quantizer, QuestQuantizer):
            # the same float64 constants as QuestQuantizer._step, rounded to float32 where torch multiplies
            coef = 2.0 * (quantizer.alpha if quantizer.clipped else quantizer.alpha_scale) / (2**quantizer.bits - 1)
            return cls(quantizer.bits, head_dim, G, True, coef=coef, clipped=quantizer.clipped)
        if isinstance(quantizer, AffineQuantizer) and quantizer.axis == -1:
            kappa = quantizer.kappa
            kth = min(math.floor(kappa * head_dim), head_dim - 1) if kappa > 0 else -1
            return cls(quantizer.bits, head_dim, G, False, kth=kth)
        raise ValueError(f"the Triton kernels cover per-token QuEST and affine quantizers, got {quantizer!r}")


@dataclass(frozen=True)
class TileFormat:
    """Key tiles as decode reads them, KVarN's (:class:`wushkv.codecs.KVarNCodec`, keys) and KIVI's per-channel keys
    (:class:`wushkv.codecs.ChannelCodec`, s_tok 1): ``tile`` consecutive tokens share a scale and zero per channel,
    each token has its fold ``s_tok`` and ``bits``-bit codes packed like a per-token codec's, and
    k̂[t, c] = s_tok[t]·(scale[c]·code[t, c] + zero[c]) (:func:`wushkv.quantizers.kvarn.kvarn_dequantize`).
    On the values' side, KVarN's value tiles: each token has a scale and zero, each tile a scale per channel, and
    v̂[t, c] = s_chan[c]·(scale[t]·code[t, c] + zero[t]) (:class:`Packed`).

    ``spread`` (halves): 0, a tile's scale and zero are rows of their own, (·, tiles, d) each (wushkv's cache);
    else they are the 2d halves [scale | zero] spread over the tile's tokens, ``spread`` halves in each token's row
    (the vLLM plugin's cells, :class:`wushkv_vllm.paged.SlotCodec`); ``values``: value tiles, whose d halves of
    channel scales are spread so."""

    bits: int
    d: int
    tile: int
    spread: int = 0
    values: bool = False
    step_byte = False  # read alike from a TokenFormat: a float16 s_tok per token, no stored offset

    def __post_init__(self):
        if self.bits not in PACK_BITS:
            raise ValueError(f"the Triton kernels take bits in {list(PACK_BITS)}, got {self.bits!r}")
        for name, v, lo in (("head_dim", self.d, 16), ("tile", self.tile, 1)):
            if v < lo or v & (v - 1):
                raise ValueError(f"the Triton kernels need a {name} that is a power of two >= {lo}, got {v}")
        halves = self.d if self.values else 2 * self.d  # a value tile's channel scales; a key tile's scale and zero
        if self.spread and (self.spread & (self.spread - 1) or halves % self.spread or self.spread * self.tile < halves):
            raise ValueError(f"a tile's {halves} halves spread over its {self.tile} tokens need a power of two "
                             f"dividing {halves} and at least {-(-halves // self.tile)} halves per token, got {self.spread}")

    @property
    def G(self) -> int:  # one s_tok per token
        return self.d

    @property
    def nbytes(self) -> int:
        return self.d * self.bits // 8

    @property
    def half(self) -> float:
        return 0.0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class _InterpretedHelper:
    """A helper as the kernels defined here call it under Triton's interpreter: its rewritten body, run as it is.
    ``InterpretedFunction.__call__`` patches ``triton.language`` again at every call of a device function (twenty
    thousand attributes set a decode test, a third of its time), where the launch of the calling kernel has patched
    the same module already (every kernel and helper here shares one globals, ``tl`` among them) and restores it when
    the grid is done. Errors come out as the interpreter's ``InterpreterError`` from the launch either way. (For the
    same reason the kernels write ``tl.full(shape, 0, dtype)``, not ``tl.zeros``: triton's ``zeros`` is a device
    function that does just that, compiled alike, re-patched for at every call under the interpreter.)"""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn.rewrite()(*args, **kwargs)  # rewritten once, then taken from the interpreter's cache


@functools.cache
def _kernels() -> dict:
    """The kernels, defined (and decorated) on first use so that importing wushkv never imports triton."""
    import triton
    import triton.language as tl

    from triton.runtime.interpreter import InterpretedFunction

    names = {"tl": tl, "triton": triton, "__name__": __name__}  # the kernels' globals

    def jit(fn):
        """``triton.jit`` of ``fn`` rebound to the globals ``names``, which holds ``tl`` and every kernel and helper
        defined here: the interpreter re-executes a function's source against its globals, and the compiler resolves
        the string annotations (``tl.constexpr``) there too. The annotations are copied over: a function built from
        a code object has none, and the launcher reads them to know which parameters are compile-time constants."""
        rebound = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
        rebound.__annotations__ = dict(fn.__annotations__)
        rebound.__doc__, rebound.__kwdefaults__ = fn.__doc__, fn.__kwdefaults__
        fn = rebound
        names[fn.__name__] = kernel = triton.jit(fn)
        if isinstance(kernel, InterpretedFunction):  # a call from a kernel runs its rewritten body: `tl` is patched
            names[fn.__name__] = _InterpretedHelper(kernel)
        return kernel

    # -- helpers -------------------------------------------------------------------------------------------------
    @jit
    def _rows(t, b, h, bt_ptr, s_bt, PAGE, s0, s1, s2, PAGED: tl.constexpr):
        """Element offsets of the rows of tokens ``t`` of sequence ``b``, head ``h``: contiguous (b, h, t) or
        paged (block_table[b, t // PAGE], t % PAGE, h)."""
        if PAGED:
            blk = tl.load(bt_ptr + b * s_bt + t // PAGE).to(tl.int64)
            return blk * s0 + (t % PAGE).to(tl.int64) * s1 + h * s2
        return b * s0 + t.to(tl.int64) * s1 + h * s2

    @jit
    def _unpack(ptr, rows, valid, D: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr):
        """Codes (BN, D) int32 of packed rows at ``ptr + rows`` (each byte loaded once, unpacked in registers)."""
        if BITS == 8:
            d = tl.arange(0, D)
            return tl.load(ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0).to(tl.int32)
        elif BITS == 3:  # 8 codes in 3 bytes: a 24-bit word, low bits first
            j = tl.arange(0, D // 8)
            word = tl.full([BN, D // 8], 0, dtype=tl.int32)
            for m in tl.static_range(3):
                byte = tl.load(ptr + rows[:, None] + j[None, :] * 3 + m, mask=valid[:, None], other=0).to(tl.int32)
                word = word | (byte << (8 * m))
            i = tl.arange(0, 8)
            c = (word[:, :, None] >> (i[None, None, :] * 3)) & 7
            return tl.reshape(c, [BN, D])
        else:  # 1, 2, 4 bits: 8/BITS codes per byte, low bits first
            PER: tl.constexpr = 8 // BITS
            j = tl.arange(0, D // PER)
            byte = tl.load(ptr + rows[:, None] + j[None, :], mask=valid[:, None], other=0).to(tl.int32)
            i = tl.arange(0, PER)
            c = (byte[:, :, None] >> (i[None, None, :] * BITS)) & ((1 << BITS) - 1)
            return tl.reshape(c, [BN, D])

    @jit
    def _finish_scores(s, valid, mc, sm_scale, softcap, mask_ptr, s_mb, b, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr):
        """Scaled, soft-capped, masked scores (GP, BN); ``valid`` the tile's lanes inside its part's columns [a, e),
        ``mc`` their columns of the mask (HAS_MASK). A part's [a, e) lies inside the split's columns, which lie inside
        the sliding window and the mask's columns (decode_kernel): ``valid`` and the mask are all there is to check."""
        s = s * sm_scale
        if SOFTCAP:  # tanh through exp: exact to float32 rounding, and the same in the interpreter
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (softcap * 1.4426950408889634)  # capped, then in base 2 (see decode_kernel)
        ok = valid
        if HAS_MASK:
            ok = ok & (tl.load(mask_ptr + b * s_mb + tl.where(valid, mc, 0), mask=valid, other=0) != 0)
        return tl.where(ok[None, :], s, float("-inf"))

    @jit
    def _exp2(x, EMU: tl.constexpr):
        """2^x. On a GPU one ``ex2.approx.ftz``: ``tl.exp2`` adds a fix-up for results below 2^-126 (a multiply, a
        compare, a predicated multiply each side of the ex2: four more instructions per score), and softmax weights
        that small are 0 in any dtype the dots read. 2^-inf = 0 either way."""
        if EMU:
            return tl.exp2(x)
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @jit
    def _online(s, m, l, EMU: tl.constexpr):
        """One online-softmax step over scores (GP, BN) in base 2 (the scale carries log2 e): the new max, the
        rescaling of the old state, p (GP, BN)."""
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: keep exp2() finite
        alpha = _exp2(m - m_safe, EMU)
        p = _exp2(s - m_safe[:, None], EMU)
        return m_new, alpha, p, l * alpha + tl.sum(p, 1)

    @jit
    def _rne_bf16(x):
        """float32 rounded to the nearest bfloat16 (ties to even), held in float32: on the bits, because Triton's
        interpreter truncates that conversion (finite values only)."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @jit
    def _mma(a, b, DT: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr):
        """a @ b with operands in DT (the query's dtype) and float32 accumulation. EMU (the interpreter, whose dot
        takes no bfloat16): operands rounded to DT and multiplied in float32, which is the same arithmetic (a product
        of two DT values is exact in float32)."""
        if EMU:
            a = _round_to(a.to(tl.float32), DT, EMU)
            b = _round_to(b.to(tl.float32), DT, EMU)
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)

    @jit
    def _fp_segment(q, m, l, acc, k_ptr, v_ptr, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, b, h, a, e, mbase,
                    sm_scale, softcap, mask_ptr, s_mb, wt_ptr, pg0, pos0,
                    D: tl.constexpr, BN: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                    PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr, STAGES: tl.constexpr,
                    UNIT: tl.constexpr):
        """Columns [a, e) of a full-precision part (B, Hkv, n, D) whose column t is the mask's column mbase + t.
        ``UNIT`` > 0: the part is read in place from a pool of pages of UNIT tokens (rows, UNIT, Hkv, D) instead
        (the vLLM plugin's window copies, :class:`PoolWindows`): column t is position pos0 + t, in the pool row
        that ``wt_ptr`` (this sequence's row of the page table, from its column pg0 on) gives its page,
        (pos0 + t) // UNIT − pos0 // UNIT; the strides are then (pool row, head, slot).
        ``STAGES``: the loop's software pipeline (DecodeTuning.fp_stages). A kernel holds the shared memory of its
        largest loop for its whole run, and this loop's stages of (BN, D) tiles are the kernel's largest (20 KB a
        one-warp program at d 128 with 2 stages, 12 KB with 1): unpipelined, an sm_90 multiprocessor has room for
        more programs through the packed middle, which is most of the columns, where their registers allow it."""
        d = tl.arange(0, D)
        for start in tl.range(a, e, BN, num_stages=STAGES):
            t = start + tl.arange(0, BN)
            valid = t < e
            if UNIT > 0:
                at = pos0 + t
                row = tl.load(wt_ptr + pg0 + at // UNIT - pos0 // UNIT, mask=valid, other=0).to(tl.int64)
                k_at = row * sk_b + (at % UNIT).to(tl.int64) * sk_t + h * sk_h
                v_at = row * sv_b + (at % UNIT).to(tl.int64) * sv_t + h * sv_h
            else:
                k_at = b * sk_b + h * sk_h + t.to(tl.int64) * sk_t
                v_at = b * sv_b + h * sv_h + t.to(tl.int64) * sv_t
            k = tl.load(k_ptr + k_at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = _mma(q, tl.trans(k), DT, EMU, PREC)
            s = _finish_scores(s, valid, mbase + t, sm_scale, softcap, mask_ptr, s_mb, b, HAS_MASK, SOFTCAP)
            m, alpha, p, l = _online(s, m, l, EMU)
            v = tl.load(v_ptr + v_at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + _mma(p, v, DT, EMU, PREC)
        return m, l, acc

    @jit
    def _codes_as(c, OFF: tl.constexpr):
        """Codes (int32, < 2^bits) as the dot's operand, built on the bits instead of converted (int→float
        conversions run at a fraction of the integer units' rate): OFF 128, bfloat16 c + 128 (0x4300 is 128.0, whose
        7 mantissa bits hold c < 128); OFF 1024, float16 c + 1024 (0x6400, 10 mantissa bits); OFF 0, float32 c
        exactly (0x4B000000 is 2^23). The caller takes OFF back out of the dot's result, exactly."""
        if OFF == 128:
            return (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        elif OFF == 1024:
            return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @jit
    def _class_codes(w, S: tl.constexpr, P: tl.constexpr, WC: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr,
                     EMU: tl.constexpr):
        """Class ``S`` of P (channels P·k + S, k < D/P) of code words ``w`` (:func:`_words`), as the dot's operand
        ``c + OFF_S``. A word of WC = P codes gives one of each class (:func:`_word_codes`). Words of WC = 8 codes
        in 4 classes (below head_dim 128, where a class of one code a word would hold d/8 < 16 channels, less than a
        dot takes) give two: codes S and S + 4 of word m are channels 8m + S and 8m + 4 + S, i.e. P·k + S for k = 2m
        and 2m + 1, side by side."""
        out = _word_codes(w, S, WC, BITS, OFF, EMU)
        if WC == 2 * P:  # two codes a word in each class
            c1 = _word_codes(w, S + P, WC, BITS, OFF, EMU)
            out = tl.reshape(tl.join(out, c1), [out.shape[0], 2 * out.shape[1]])
        return out

    @jit
    def _word_codes(w, S: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr, EMU: tl.constexpr):
        """Code ``S`` of each of the code words ``w`` (BN, D/P) of P codes each (:func:`_words`): the code at bits
        [S·BITS, (S+1)·BITS) of word k, i.e. channel P·k + S (little-endian bytes of
        :func:`wushkv.quantizers.pack`), as the dot's operand ``c + OFF_S`` (:func:`_class_offsets`). On a GPU, inline
        PTX builds two codes per ``lop3`` (``& mask | base`` on both halves of a 32-bit register: each half keeps its
        own bits, what a shift carries over from the other is masked off), already the tensor cores' bf16x2 operand.
        16-bit words (``w`` int16, two per register): the code need not sit at the mantissa's bottom. Left at bit
        SHL of the 16, it reads as 2^SHL·c over a base of 2^SHL·OFF_S; the base's exponent taken SHL lower makes
        that c + OFF_S with OFF_S = OFF / 2^SHL, exactly. So a shift is needed only where the code would leave the
        mantissa (7 bits in bfloat16, 10 in float16): 2-bit codes in bfloat16 take shifts of 0, 6 and 12 for their
        8 classes (two shifts a word, shared by the classes, against seven), 4-bit codes in float16 0 and 8.
        3-byte words (``w`` int32) take one ``prmt`` of the two bytes holding the code from each of two words, and a
        shift; bytes (``w`` uint8, four per register) one shift for four and a ``prmt`` per two (OFF_S = OFF). The
        result is elementwise whatever pairs Triton hands the assembly. Under the interpreter, the same bits in plain
        Triton."""
        MASK: tl.constexpr = (1 << BITS) - 1
        MANT: tl.constexpr = 7 if OFF == 128 else 10  # the mantissa's bits (bfloat16, float16)
        EXP1: tl.constexpr = 0x80 if OFF == 128 else 0x400  # one step of the exponent
        SH: tl.constexpr = S * BITS
        SHL: tl.constexpr = SH % ((MANT // BITS) * BITS) if P * BITS == 16 else 0  # where the code stays
        R: tl.constexpr = SH - SHL  # the shift
        BASE: tl.constexpr = (0x4300 if OFF == 128 else 0x6400) - SHL * EXP1  # OFF_S = OFF / 2^SHL
        LO: tl.constexpr = (MASK << SHL) * 0x10001
        HI: tl.constexpr = BASE * 0x10001
        WIDE: tl.constexpr = SH + BITS > 16  # 3-byte words: the code is in bytes 1-2, not 0-1
        if P * BITS == 16:
            ASM: tl.constexpr = f"lop3.b32 $0, $1, {LO}, {HI}, 0xea;"
        elif P * BITS == 24:
            ASM: tl.constexpr = (f"{{.reg .b32 t; prmt.b32 t, $1, $2, {0x6521 if WIDE else 0x5410}; "
                                 f"shr.b32 t, t, {SH - 8 if WIDE else SH}; lop3.b32 $0, t, {LO}, {HI}, 0xea;}}")
        else:
            ASM: tl.constexpr = (f"{{.reg .b32 t, u; shr.b32 t, $2, {SH}; prmt.b32 u, t, t, 0x1100; "
                                 f"lop3.b32 $0, u, {LO}, {HI}, 0xea; prmt.b32 u, t, t, 0x3322; "
                                 f"lop3.b32 $1, u, {LO}, {HI}, 0xea;}}")
        if EMU:  # the interpreter runs no PTX: the same bits, one code at a time
            c = (((w.to(tl.int32) >> R) & (MASK << SHL)) | BASE).to(tl.int16)
            if OFF == 128:
                out = c.to(tl.bfloat16, bitcast=True)
            else:
                out = c.to(tl.float16, bitcast=True)
        elif P * BITS == 16:
            if R > 0:  # one shift a register, the same for the classes it serves (ptxas merges the copies)
                w = tl.inline_asm_elementwise(f"shr.b32 $0, $1, {R};", "=r,r", [w], dtype=tl.int16, is_pure=True,
                                              pack=2)
            if OFF == 128:
                out = tl.inline_asm_elementwise(ASM, "=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)
            else:
                out = tl.inline_asm_elementwise(ASM, "=r,r", [w], dtype=tl.float16, is_pure=True, pack=2)
        elif P * BITS == 24:
            if OFF == 128:
                out = tl.inline_asm_elementwise(ASM, "=r,r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)
            else:
                out = tl.inline_asm_elementwise(ASM, "=r,r,r", [w], dtype=tl.float16, is_pure=True, pack=2)
        elif OFF == 128:
            out = tl.inline_asm_elementwise(ASM, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            out = tl.inline_asm_elementwise(ASM, "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4)
        return out

    @jit
    def _class_offsets(D: tl.constexpr, WC: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr):
        """(D,) float32: the offset OFF_S with which :func:`_class_codes` builds each channel's code (channel c is
        code c mod WC of its word of WC codes), what the dots' results take back out: OFF / 2^SHL on 16-bit words,
        OFF elsewhere."""
        MANT: tl.constexpr = 7 if OFF == 128 else 10
        c = tl.arange(0, D)
        if WC * BITS == 16:
            shl = ((c % WC) * BITS) % ((MANT // BITS) * BITS)
        else:
            shl = c * 0
        return (OFF >> shl).to(tl.float32)

    @jit
    def _class_scores(q_ptr, qrow, qmask, qoff, w, GP: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                      WC: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                      EMU: tl.constexpr):
        """q (GP, D) · (C + OFF_S)ᵀ − qoff (GP,) over code words ``w`` (BN, D/P): one dot per class S with the
        query's channels P·k + S (loaded from ``q_ptr + qrow``, L1-resident), so the codes never change layout; the
        first dot starts at −qoff, which costs nothing (a dot's accumulator)."""
        k = tl.arange(0, D // P)
        s = tl.full([GP, BN], 0, dtype=tl.float32) - qoff[:, None]
        for S in tl.static_range(P):
            qS = tl.load(q_ptr + qrow[:, None] + k[None, :] * P + S, mask=qmask[:, None], other=0.0)
            s += _mma(qS, tl.trans(_class_codes(w, S, P, WC, BITS, OFF, EMU)), DT, EMU, PREC)
        return s

    @jit
    def _class_pv(wt, w, S: tl.constexpr, acc, P: tl.constexpr, WC: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr,
                  PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
        """acc + wt (GP, BN) · (C_S + OFF_S), C_S class S of code words ``w``: channels P·k + S of the values."""
        return _mma_acc(wt, _class_codes(w, S, P, WC, BITS, OFF, EMU), acc, PREC, DT, EMU)

    @jit
    def _weight_sum(wt, acc, BN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
        """acc + wt (GP, BN) · ones (BN, 16): each column Σ_t wt, exact (wt is rounded to DT already, the dot
        accumulates in float32); 16 columns, what a dot's tile holds."""
        if EMU:
            ones = tl.full([BN, 16], 1.0, tl.float32)
        else:
            ones = tl.full([BN, 16], 1.0, DT)
        return _mma_acc(wt, ones, acc, PREC, DT, EMU)

    @jit
    def _mma_acc(wt, c, acc, PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
        """acc + wt · c, wt rounded to DT (the interpreter's dot takes no bfloat16: rounded, multiplied in float32)."""
        if EMU:
            return tl.dot(_round_to(wt.to(tl.float32), DT, EMU), c.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(wt.to(DT), c, acc, input_precision=PREC)

    @jit
    def _join_classes(a0, a1, a2, a3, a4, a5, a6, a7, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
        """Per-class results (GP, D/P) back in channel order (GP, D): class S of word k is channel P·k + S, and
        ``join`` puts its operands side by side on a new last axis (P = 4 or 8; a4..a7 unused at 4)."""
        if P == 8:
            o = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))
        else:
            o = tl.join(tl.join(a0, a2), tl.join(a1, a3))
        return tl.reshape(o, [GP, D])

    @jit
    def _words(ptr, rows, valid, D: tl.constexpr, WC: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr,
               W4: tl.constexpr):
        """The code words (BN, D/WC) of packed rows at byte offsets ``rows``: WC codes of BITS bits, WB = WC·BITS/8
        bytes each. 16-bit words are loaded as int16 (rows at even
        offsets: checked on the host), bytes as uint8, 3-byte words assembled (little-endian) in int32: W4 (rows at
        4-byte offsets, checked on the host) four of them from three int32 loads, else from their bytes (three loads a
        word, each with its own address and mask: on the H100's SASS the loop's largest share at 3 bits)."""
        k = tl.arange(0, D // WC)
        WB: tl.constexpr = WC * BITS // 8
        if WB == 2:
            w = tl.load(ptr.to(tl.pointer_type(tl.int16)) + (rows // 2)[:, None] + k[None, :], mask=valid[:, None],
                        other=0)
        elif WB == 3 and W4:  # bytes 3j..3j+2 of a group of 12: four words from three int32
            g = tl.arange(0, D // 32)
            at = ptr.to(tl.pointer_type(tl.int32)) + (rows // 4)[:, None] + g[None, :] * 3
            i0 = tl.load(at, mask=valid[:, None], other=0)
            i1 = tl.load(at + 1, mask=valid[:, None], other=0)
            i2 = tl.load(at + 2, mask=valid[:, None], other=0)
            w0 = i0 & 0xFFFFFF
            w1 = ((i0 >> 24) & 0xFF) | ((i1 & 0xFFFF) << 8)
            w2 = ((i1 >> 16) & 0xFFFF) | ((i2 & 0xFF) << 16)
            w3 = (i2 >> 8) & 0xFFFFFF
            w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [rows.shape[0], D // 8])
        else:
            at = ptr + rows[:, None] + k[None, :] * WB
            w = tl.load(at, mask=valid[:, None], other=0)
            if WB == 3:
                w = w.to(tl.int32)
                for j in tl.static_range(1, WB):
                    w = w | (tl.load(at + j, mask=valid[:, None], other=0).to(tl.int32) << (8 * j))
        return w

    @jit
    def _round_to(x, DT: tl.constexpr, EMU: tl.constexpr):
        """float32 rounded to DT (nearest even) and held in float32: what :func:`_mma` feeds its dot (the
        interpreter truncates float32 → bfloat16, so there it rounds on the bits)."""
        if DT == tl.bfloat16:
            if EMU:
                return _rne_bf16(x)
            return x.to(tl.bfloat16).to(tl.float32)
        elif DT == tl.float16:
            return x.to(tl.float16).to(tl.float32)
        return x

    @jit
    def _step(x, E5M3: tl.constexpr):
        """Stored steps as float32: E5M3 bytes are float16's bits 14..7 (positive, so no sign bit)."""
        if E5M3:
            return (x.to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32)
        return x.to(tl.float32)

    @jit
    def _dequant_tile(c, s_ptr, z_ptr, srows, valid, G: tl.constexpr, D: tl.constexpr, HALF, HAS_Z: tl.constexpr,
                      E5M3: tl.constexpr):
        """Codes (BN, D) → values in registers, groups of G channels: x̂ = s·c + z."""
        g = tl.arange(0, D) // G
        s = _step(tl.load(s_ptr + srows[:, None] + g[None, :], mask=valid[:, None], other=0), E5M3)
        if HAS_Z:
            z = tl.load(z_ptr + srows[:, None] + g[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        else:
            z = s * HALF
        return _codes_as(c, 0) * s + z

    @jit
    def _token_scale_offset(s_ptr, z_ptr, srows, valid, HALF, HAS_Z: tl.constexpr, E5M3: tl.constexpr):
        """(BN,) step and offset of tokens stored with one group each: x̂ = s·c + z (QuEST stores no offset)."""
        s = _step(tl.load(s_ptr + srows, mask=valid, other=0), E5M3)
        if HAS_Z:
            z = tl.load(z_ptr + srows, mask=valid, other=0.0).to(tl.float32)
        else:
            z = s * HALF
        return s, z

    @jit
    def _tile_row(j, b, h, bt_ptr, s_bt, PAGE, m0, m1, m2, base, TILE: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_ABS: tl.constexpr):
        """Offset of KVarN key tile ``j``'s row of scale and zero halves: the row of its first token, through the
        block table (paged), or the tile's own row."""
        jj = b * 0 + j  # int64, and a tensor where the interpreter's loop gives an int
        if PAGED:
            first = jj * TILE
            if PAGE_ABS:
                first = first + base
            return _rows(first, b, h, bt_ptr, s_bt, PAGE, m0, m1, m2, PAGED)
        return _rows(jj, b, h, bt_ptr, s_bt, PAGE, m0, m1, m2, PAGED)

    @jit
    def _tile_halves(ptr, mrow, ch, m1, MW: tl.constexpr):
        """Halves ``ch`` of a tile's row at ``mrow``: half i is ``i // MW`` rows on (the tile's next tokens, where its
        halves are spread over its cells) and ``i % MW`` in."""
        return tl.load(ptr + mrow + (ch // MW).to(tl.int64) * m1 + ch % MW).to(tl.float32)

    @jit
    def _tile_scores(q, cq, mrow, s_ptr, z_ptr, m1, ZI, D: tl.constexpr, MW: tl.constexpr, OFF: tl.constexpr,
                     PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
        """Scores (GP, BN) of queries ``q`` (GP, D) against codes ``cq`` (BN, D) (the dot's operand, c + OFF:
        :func:`_codes_as`) of the KVarN key tile whose row is ``mrow``, before each token's s_tok:
        Σ_c q[c]·(scale[c]·code[t, c] + zero[c]) = (q ⊙ scale)·code_t + q·zero, so the codes enter the dot as they are
        and the tile's scale goes into the query (rounded to DT, as the dot reads it; OFF taken back out exactly).
        Zero's halves start at ``ZI`` in the row."""
        ch = tl.arange(0, D)
        sc = _tile_halves(s_ptr, mrow, ch, m1, MW)
        zr = _tile_halves(z_ptr, mrow, ch + ZI, m1, MW)
        qf = q.to(tl.float32)
        qs = _round_to(qf * sc[None, :], DT, EMU)
        raw = _mma(qs, tl.trans(cq), DT, EMU, PREC)
        return raw + tl.sum(qf * zr[None, :] - OFF * qs, 1)[:, None]

    @jit
    def _class_tile_query(q_ptr, qrow, qmask, mrow, s_ptr, m1, S: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                          MW: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
        """(GP, D/P) the query's channels P·k + S (from ``q_ptr + qrow``) times the scale of the KVarN key tile at
        ``mrow`` on those channels, rounded to DT as the dot reads it (held in DT; in float32 under the interpreter,
        whose dot takes no bfloat16): class S of the query :func:`_class_tile_dots` reads."""
        ch = tl.arange(0, D // P) * P + S
        qS = tl.load(q_ptr + qrow[:, None] + ch[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
        qs = _round_to(qS * _tile_halves(s_ptr, mrow, ch, m1, MW)[None, :], DT, EMU)
        if not EMU:
            qs = qs.to(DT)
        return qs

    @jit
    def _class_tile_dots(init, q0, q1, q2, q3, q4, q5, q6, q7, w, P: tl.constexpr, WC: tl.constexpr, BITS: tl.constexpr,
                         OFF: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
        """init + (q ⊙ scale)·(C + OFF)ᵀ (GP, BN) of a KVarN key tile over code words ``w`` (BN, D/P) split into
        classes (:func:`_class_scores`), from the query's scaled classes q0..q7 (:func:`_class_tile_query`, q4..q7
        unused at P = 4): neither the codes nor a scaled (GP, D) query change layout, and the query is scaled once a
        key tile, not once a tile of tokens. What :func:`_tile_scores` adds, q·zero − Σ_c OFF_c (q ⊙ scale)_c, is the
        tile's alone (:func:`_class_tile_offset`): the caller passes it as ``init``."""
        s = _mma(q0, tl.trans(_class_codes(w, 0, P, WC, BITS, OFF, EMU)), DT, EMU, PREC) + init
        s += _mma(q1, tl.trans(_class_codes(w, 1, P, WC, BITS, OFF, EMU)), DT, EMU, PREC)
        s += _mma(q2, tl.trans(_class_codes(w, 2, P, WC, BITS, OFF, EMU)), DT, EMU, PREC)
        s += _mma(q3, tl.trans(_class_codes(w, 3, P, WC, BITS, OFF, EMU)), DT, EMU, PREC)
        if P == 8:
            s += _mma(q4, tl.trans(_class_codes(w, 4, P, WC, BITS, OFF, EMU)), DT, EMU, PREC)
            s += _mma(q5, tl.trans(_class_codes(w, 5, P, WC, BITS, OFF, EMU)), DT, EMU, PREC)
            s += _mma(q6, tl.trans(_class_codes(w, 6, P, WC, BITS, OFF, EMU)), DT, EMU, PREC)
            s += _mma(q7, tl.trans(_class_codes(w, 7, P, WC, BITS, OFF, EMU)), DT, EMU, PREC)
        return s

    @jit
    def _class_tile_offset(q_ptr, qrow, qmask, mrow, s_ptr, z_ptr, m1, ZI, GP: tl.constexpr, D: tl.constexpr,
                           WC: tl.constexpr, BITS: tl.constexpr, MW: tl.constexpr, OFF: tl.constexpr, DT: tl.constexpr,
                           EMU: tl.constexpr):
        """(GP,) q·zero − Σ_c OFF_c·(q ⊙ scale)_c of the KVarN key tile at ``mrow`` (OFF_c: channel c's
        :func:`_class_offsets`), the scaled query rounded to DT as :func:`_class_tile_query` rounds it (the same
        values, summed in another order)."""
        ch = tl.arange(0, D)
        q = tl.load(q_ptr + qrow[:, None] + ch[None, :], mask=qmask[:, None], other=0.0).to(tl.float32)
        qs = _round_to(q * _tile_halves(s_ptr, mrow, ch, m1, MW)[None, :], DT, EMU)
        off = _class_offsets(D, WC, BITS, OFF)
        return tl.sum(q * _tile_halves(z_ptr, mrow, ch + ZI, m1, MW)[None, :] - qs * off[None, :], 1)

    @jit
    def _rope_bias(rb_ptr, brow, qmask, rt_ptr, rr_ptr, pos, GP: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                   PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
        """(GP, BN) Σ_i A_i cos((pos + r)θ_i) + B_i sin((pos + r)θ_i), r < BN: what keys stored centered on their
        rotating mean (``+rmean``) add to the scores of tokens at positions pos + r. The terms [A | B] (from
        ``rb_ptr + brow``, (GP, D) float32) are turned by the tile's first angle in float32, cos(p + r) =
        cos p cos r − sin p sin r and sin(p + r) = sin p cos r + cos p sin r, and then read against the offsets'
        cos rθ, sin rθ in DT, as the keys' dots read their operands: two dots with K = D/2. The tables hold
        [cos pθ | sin pθ] (D wide) per position p ≥ 0: ``rt_ptr`` float32 (a row per tile), ``rr_ptr`` in DT (the
        same BN rows every tile, from the cache next to the multiprocessor). A negative pos (a padded row's padding,
        never visible) reads |pos|, sin being odd."""
        H2: tl.constexpr = D // 2
        hh = tl.arange(0, H2)
        row = tl.abs(pos).to(tl.int64) * D
        sgn = tl.where(pos < 0, -1.0, 1.0)
        c0 = tl.load(rt_ptr + row + hh)
        s0 = tl.load(rt_ptr + row + H2 + hh) * sgn
        A = tl.load(rb_ptr + brow[:, None] + hh[None, :], mask=qmask[:, None], other=0.0)
        B = tl.load(rb_ptr + brow[:, None] + H2 + hh[None, :], mask=qmask[:, None], other=0.0)
        A2 = A * c0[None, :] + B * s0[None, :]
        B2 = B * c0[None, :] - A * s0[None, :]
        r = tl.arange(0, BN) * D
        cr = tl.load(rr_ptr + r[None, :] + hh[:, None])  # (D/2, BN)
        sr = tl.load(rr_ptr + r[None, :] + H2 + hh[:, None])
        return _mma(A2, cr, DT, EMU, PREC) + _mma(B2, sr, DT, EMU, PREC)

    @jit
    def _code_segment(q, qsum, qoff, m, l, acc, q_ptr, qrow, qmask,
                      kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kts_ptr, ktz_ptr,
                      kc0, kc1, kc2, ks0, ks1, ks2, vc0, vc1, vc2, vs0, vs1, vs2, kt0, kt1, kt2, KT_ZI,
                      vts_ptr, vt0, vt1, vt2,
                      rb_ptr, brow, rt_ptr, rr_ptr, p0,
                      bt_ptr, s_bt, PAGE: tl.constexpr, b, h, a, e, base, mbase,
                      sm_scale, softcap, mask_ptr, s_mb, K_HALF, V_HALF,
                      D: tl.constexpr, BN: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                      K_G: tl.constexpr, V_G: tl.constexpr, K_Z: tl.constexpr, V_Z: tl.constexpr,
                      K_E5M3: tl.constexpr, V_E5M3: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr,
                      K_P: tl.constexpr, V_P: tl.constexpr, K_WC: tl.constexpr, V_WC: tl.constexpr,
                      K_W4: tl.constexpr, V_W4: tl.constexpr, GP: tl.constexpr,
                      K_TILE: tl.constexpr, KT_MW: tl.constexpr, V_TILE: tl.constexpr, VT_MW: tl.constexpr,
                      RMEAN: tl.constexpr,
                      PAGED: tl.constexpr, PAGE_ABS: tl.constexpr, ONE_PAGE: tl.constexpr, HAS_MASK: tl.constexpr,
                      SOFTCAP: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
        """Tokens [a, e) of the packed middle, token t the sequence's column ``base`` + t (where PAGE_ABS looks it up
        in the block table) and the mask's column ``mbase`` + t. K_TILE > 0: the keys are
        KVarN tiles of K_TILE tokens, their scale folded into the query per tile (:func:`_tile_scores`). With one group per
        token the codes enter the dots as ``c + OFF`` (:func:`_codes_as`), and OFF comes back out: for keys
        ``q·(c + OFF) − OFF·Σq``, for values ``Σ_t w_t (c_t + OFF) − OFF·Σ_t w_t`` with the same rounded weights
        w = p ⊙ s the dot reads. K_P/V_P > 0: that side's codes are read as 16-bit words and split into P classes
        (:func:`_class_codes`), one dot each, instead of unpacked to a (BN, D) tile, whose reshape and re-layout for
        the tensor cores cost more than the bytes (session 46's H200 run). Each class then has its own offset OFF_c
        (:func:`_class_offsets`): the keys' dots start at −``qoff`` (Σ_c OFF_c q_c, and − HALF·Σq without a zero:
        decode_kernel), the values' take OFF_c·Σ w out of each channel after the last tile. The values' classes keep
        one accumulator each (a0..a7, (GP, D/P)) and join ``acc`` after the last tile: joined every tile, the classes'
        results would hold as many registers again as the accumulators. RMEAN: keys stored centered on their
        rotating mean, token i at position p0 + i, each tile's scores gain :func:`_rope_bias` (turned by the tile's
        first position, wherever it starts). V_TILE > 0: the values are KVarN tiles of V_TILE tokens,
        v̂[t, c] = s_chan[c]·(s_t·code + z_t): where the tile of tokens lies in one (BN ≤ V_TILE, aligned) the per-token
        codes' dot times its channel scales, else each token dequantized with its tile's; a tile's d channel scales
        are a row of their own (VT_MW = D) or spread over its cells, VT_MW halves each (as key tiles' KT_MW).
        PAGED: the rows through block table ``bt_ptr`` of PAGE tokens a block; ONE_PAGE (BN divides PAGE): each tile
        of tokens lies in one block (aligned to the table's positions, or under ALIGN to its key or value tile, which
        lies in one block), whose entry is read once and folded into the pointers."""
        ALIGN: tl.constexpr = (K_TILE > 0 and BN <= K_TILE) or (V_TILE > 0 and BN <= V_TILE)
        VK: tl.constexpr = D // V_P if V_P > 0 else 16
        a0 = tl.full([GP, VK], 0, dtype=tl.float32)
        a1 = tl.full([GP, VK], 0, dtype=tl.float32)
        a2 = tl.full([GP, VK], 0, dtype=tl.float32)
        a3 = tl.full([GP, VK], 0, dtype=tl.float32)
        a4 = tl.full([GP, VK], 0, dtype=tl.float32)
        a5 = tl.full([GP, VK], 0, dtype=tl.float32)
        a6 = tl.full([GP, VK], 0, dtype=tl.float32)
        a7 = tl.full([GP, VK], 0, dtype=tl.float32)
        keep = tl.full([GP], 1.0, dtype=tl.float32)  # how much of the incoming acc the online softmax keeps
        # the values' classes read Σ_t w_t (c_t + OFF_c) with w = p ⊙ s rounded for the dot; channel c's OFF_c
        # (_class_offsets) comes back out as OFF_c·Σ w, and Σ w is a dot too, of the same rounded w with ones (16
        # columns: what a dot's tile holds): exact, and a few tensor-core instructions a tile where a sum across the
        # lanes of the weights converted back to float32 took dozens. Without a zero (x̂ = s·(c + HALF)) the weights
        # carry the HALF too: Σ w (c + HALF), nearer the float32 result than Σ w c + HALF·Σ p s (c + HALF is the
        # smaller); with one, Σ p z is summed in float32.
        corr = tl.full([GP], 0, dtype=tl.float32)  # Σ p z (a zero), added to every channel
        wacc = tl.full([GP, 16], 0, dtype=tl.float32)  # Σ w in each column (codes in classes)
        t_tile = b * 0 - 1  # the KVarN key tile whose offset term t_off and scaled query kq0..kq7 are held; int64
        t_off = tl.full([GP], 0, dtype=tl.float32)
        KQ: tl.constexpr = D // K_P if K_P > 0 else 16
        QDT: tl.constexpr = tl.float32 if EMU else DT
        kq0 = tl.full([GP, KQ], 0, dtype=QDT)
        kq1 = tl.full([GP, KQ], 0, dtype=QDT)
        kq2 = tl.full([GP, KQ], 0, dtype=QDT)
        kq3 = tl.full([GP, KQ], 0, dtype=QDT)
        kq4 = tl.full([GP, KQ], 0, dtype=QDT)
        kq5 = tl.full([GP, KQ], 0, dtype=QDT)
        kq6 = tl.full([GP, KQ], 0, dtype=QDT)
        kq7 = tl.full([GP, KQ], 0, dtype=QDT)
        # the scores come out of the class paths scaled (by sm_scale and log2 e): folded into per-token vectors
        SCALED: tl.constexpr = K_P > 0 and (K_TILE == 0 or BN <= K_TILE)
        first_it = a
        pbase = base if PAGE_ABS else base * 0  # token t's position in the block table: t + pbase
        if ALIGN:  # tiles of tokens aligned to BN lie in one key tile each (BN divides K_TILE), so in one block
            first_it = a - a % BN
        elif ONE_PAGE:  # tiles of tokens aligned to BN in the block table's positions lie in one block (BN | PAGE)
            first_it = a - (a + pbase) % BN
        for start in range(first_it, e, BN):
            t = start + tl.arange(0, BN)
            valid = t < e
            if ALIGN or ONE_PAGE:  # (a tile aligned before the split's first token)
                valid = valid & (t >= a)
            tt = tl.where(valid, t, 0)  # masked lanes still compute an address (block table reads stay in range)
            if PAGE_ABS:  # the block table maps absolute positions (vLLM's cells hold every token, the sink's too)
                tt = tt + base
            # keys: scores = s ⊙ (C q) + z·Σq (one group per token), or a tile dequantized in registers
            if ONE_PAGE:  # the tile's block read once, into the pointers; its tokens' rows int32 offsets in it
                blk = tl.load(bt_ptr + b * s_bt + (start + pbase) // PAGE).to(tl.int64)
                tok = (start + pbase) % PAGE + tl.arange(0, BN)
                kcp, vcp = kc_ptr + (blk * kc0 + h * kc2), vc_ptr + (blk * vc0 + h * vc2)
                ksp, kzp = ks_ptr + (blk * ks0 + h * ks2), kz_ptr + (blk * ks0 + h * ks2)
                vsp, vzp = vs_ptr + (blk * vs0 + h * vs2), vz_ptr + (blk * vs0 + h * vs2)
                rows = tok * kc1
                srows = tok * ks1
            else:
                kcp, ksp, kzp, vcp, vsp, vzp = kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr
                rows = _rows(tt, b, h, bt_ptr, s_bt, PAGE, kc0, kc1, kc2, PAGED)
                srows = _rows(tt, b, h, bt_ptr, s_bt, PAGE, ks0, ks1, ks2, PAGED)
            if K_TILE > 0:  # KVarN key tiles: one dot per key tile the tile of tokens lies in
                st = tl.load(ksp + srows, mask=valid, other=0.0).to(tl.float32)  # s_tok
                j0 = b * 0 + start // K_TILE  # int64 (and a tensor where the interpreter's loop gives an int)
                mrow = _tile_row(j0, b, h, bt_ptr, s_bt, PAGE, kt0, kt1, kt2, base, K_TILE, PAGED, PAGE_ABS)
                if K_P > 0 and BN <= K_TILE:  # the codes in classes, the tile's scale into the query's classes
                    if j0 != t_tile:  # a new key tile: its offset term and scaled query, kept for its tiles of tokens
                        t_off = _class_tile_offset(q_ptr, qrow, qmask, mrow, kts_ptr, ktz_ptr, kt1, KT_ZI, GP, D, K_WC,
                                                   K_BITS, KT_MW, K_OFF, DT, EMU)
                        kq0 = _class_tile_query(q_ptr, qrow, qmask, mrow, kts_ptr, kt1, 0, D, K_P, KT_MW, DT, EMU)
                        kq1 = _class_tile_query(q_ptr, qrow, qmask, mrow, kts_ptr, kt1, 1, D, K_P, KT_MW, DT, EMU)
                        kq2 = _class_tile_query(q_ptr, qrow, qmask, mrow, kts_ptr, kt1, 2, D, K_P, KT_MW, DT, EMU)
                        kq3 = _class_tile_query(q_ptr, qrow, qmask, mrow, kts_ptr, kt1, 3, D, K_P, KT_MW, DT, EMU)
                        if K_P == 8:
                            kq4 = _class_tile_query(q_ptr, qrow, qmask, mrow, kts_ptr, kt1, 4, D, K_P, KT_MW, DT, EMU)
                            kq5 = _class_tile_query(q_ptr, qrow, qmask, mrow, kts_ptr, kt1, 5, D, K_P, KT_MW, DT, EMU)
                            kq6 = _class_tile_query(q_ptr, qrow, qmask, mrow, kts_ptr, kt1, 6, D, K_P, KT_MW, DT, EMU)
                            kq7 = _class_tile_query(q_ptr, qrow, qmask, mrow, kts_ptr, kt1, 7, D, K_P, KT_MW, DT, EMU)
                        t_tile = j0
                    s = _class_tile_dots(t_off[:, None], kq0, kq1, kq2, kq3, kq4, kq5, kq6, kq7,
                                         _words(kcp, rows, valid, D, K_WC, K_BITS, BN, K_W4), K_P, K_WC, K_BITS, K_OFF,
                                         PREC, DT, EMU)
                    st = st * sm_scale
                else:
                    cq = _codes_as(_unpack(kcp, rows, valid, D, K_BITS, BN), K_OFF)
                    s = _tile_scores(q, cq, mrow, kts_ptr, ktz_ptr, kt1, KT_ZI, D, KT_MW, K_OFF, PREC, DT, EMU)
                    if BN > K_TILE:  # key tiles shorter than the tile of tokens: the rows past its first key tile
                        for j in range(j0 + 1, (tl.minimum(start + BN, e) - 1) // K_TILE + 1):
                            mj = _tile_row(j, b, h, bt_ptr, s_bt, PAGE, kt0, kt1, kt2, base, K_TILE, PAGED, PAGE_ABS)
                            sj = _tile_scores(q, cq, mj, kts_ptr, ktz_ptr, kt1, KT_ZI, D, KT_MW, K_OFF, PREC, DT, EMU)
                            s = tl.where((t >= j * K_TILE)[None, :], sj, s)
                s = s * st[None, :]
            elif K_P > 0:
                # raw = q·(c + OFF) − qoff, its accumulator started at −qoff (decode_kernel), scaled per token:
                # (raw)·s + Σq·z with a zero; without one (z = HALF·s) qoff holds HALF·Σq too, and it is raw·s
                raw = _class_scores(q_ptr, qrow, qmask, qoff, _words(kcp, rows, valid, D, K_WC, K_BITS, BN, K_W4), GP, BN,
                                    D, K_P, K_WC, K_BITS, K_OFF, PREC, DT, EMU)
                if K_Z:
                    ks, kz = _token_scale_offset(ksp, kzp, srows, valid, K_HALF, K_Z, K_E5M3)
                    s = raw * (ks * sm_scale)[None, :] + qsum[:, None] * (kz * sm_scale)[None, :]
                else:
                    s = raw * (_step(tl.load(ksp + srows, mask=valid, other=0), K_E5M3) * sm_scale)[None, :]
            elif K_G == D:
                c = _unpack(kcp, rows, valid, D, K_BITS, BN)
                ks, kz = _token_scale_offset(ksp, kzp, srows, valid, K_HALF, K_Z, K_E5M3)
                s = (_mma(q, tl.trans(_codes_as(c, K_OFF)), DT, EMU, PREC) - K_OFF * qsum[:, None]) * ks[None, :] \
                    + qsum[:, None] * kz[None, :]
            else:
                c = _unpack(kcp, rows, valid, D, K_BITS, BN)
                k = _dequant_tile(c, ksp, kzp, srows, valid, K_G, D, K_HALF, K_Z, K_E5M3)
                s = _mma(q, tl.trans(k), DT, EMU, PREC)
            if RMEAN:  # the centers' share, a function of the position (scaled where the class path scaled s)
                bias = _rope_bias(rb_ptr, brow, qmask, rt_ptr, rr_ptr, p0 + start, GP, BN, D, PREC, DT, EMU)
                s = s + (bias * sm_scale if SCALED else bias)
            if SCALED and not HAS_MASK and not SOFTCAP:
                if (start < a) | (start + BN > e):
                    s = tl.where(valid[None, :], s, float("-inf"))
            else:
                s = _finish_scores(s, valid, mbase + t, 1.0 if SCALED else sm_scale, softcap, mask_ptr, s_mb, b,
                                   HAS_MASK, SOFTCAP)
            m, alpha, p, l = _online(s, m, l, EMU)
            # values: Cᵀ(p ⊙ s) + (Σ p z)·1, or the dequantized tile
            if ONE_PAGE:
                rows = tok * vc1
                srows = tok * vs1
            else:
                rows = _rows(tt, b, h, bt_ptr, s_bt, PAGE, vc0, vc1, vc2, PAGED)
                srows = _rows(tt, b, h, bt_ptr, s_bt, PAGE, vs0, vs1, vs2, PAGED)
            if V_TILE > 0:  # KVarN value tiles: v̂[t, c] = s_chan[c]·(s_t·code + z_t)
                c = _unpack(vcp, rows, valid, D, V_BITS, BN)
                vs = tl.load(vsp + srows, mask=valid, other=0.0).to(tl.float32)
                vz = tl.load(vzp + srows, mask=valid, other=0.0).to(tl.float32)
                ch = tl.arange(0, D)
                if BN <= V_TILE:  # aligned (ALIGN): the tokens' one value tile, Σ_t p_t v̂_t = s_chan ⊙ (Σ_t w_t c_t +
                    # Σ_t p_t z_t) with w = p ⊙ s: the per-token codes' dot (the codes built on their bits as the
                    # operand), its columns times the tile's row of channel scales after it. (A float32 (BN, D) tile
                    # dequantized first held 128 more registers a thread at d 128 and spilled: kernel_sass.py)
                    w = _round_to(p * vs[None, :], DT, EMU)
                    o = _mma(w, _codes_as(c, V_OFF), DT, EMU, PREC) + tl.sum(p * vz[None, :] - V_OFF * w, 1)[:, None]
                    vrow = _tile_row(start // V_TILE, b, h, bt_ptr, s_bt, PAGE, vt0, vt1, vt2, base, V_TILE, PAGED, PAGE_ABS)
                    o = o * _tile_halves(vts_ptr, vrow, ch, vt1, VT_MW)[None, :]
                else:  # value tiles shorter than the tile of tokens: each token's row dequantized (float32, in
                    # kvarn_dequantize's order) with its tile's channel scales, then one dot
                    vrow = _tile_row(tl.where(valid, t, 0) // V_TILE, b, h, bt_ptr, s_bt, PAGE, vt0, vt1, vt2, base, V_TILE,
                                     PAGED, PAGE_ABS)
                    sch = tl.load(vts_ptr + vrow[:, None] + (ch // VT_MW).to(tl.int64)[None, :] * vt1 + (ch % VT_MW)[None, :],
                                  mask=valid[:, None], other=0.0).to(tl.float32)
                    x = (_codes_as(c, 0) * vs[:, None] + vz[:, None]) * sch
                    o = _mma(p, x, DT, EMU, PREC)
            elif V_P > 0:
                if V_Z:
                    vs, vz = _token_scale_offset(vsp, vzp, srows, valid, V_HALF, V_Z, V_E5M3)
                else:
                    vs = _step(tl.load(vsp + srows, mask=valid, other=0), V_E5M3)
                w = _round_to(p * vs[None, :], DT, EMU)
                words = _words(vcp, rows, valid, D, V_WC, V_BITS, BN, V_W4)
                if tl.min(alpha, 0) < 1.0:  # a row's max rose; else alpha is exactly 1 and rescaling is a no-op
                    a0, a1, a2, a3 = a0 * alpha[:, None], a1 * alpha[:, None], a2 * alpha[:, None], a3 * alpha[:, None]
                    if V_P == 8:
                        a4, a5, a6, a7 = a4 * alpha[:, None], a5 * alpha[:, None], a6 * alpha[:, None], a7 * alpha[:, None]
                    wacc = wacc * alpha[:, None]
                a0 = _class_pv(w, words, 0, a0, V_P, V_WC, V_BITS, V_OFF, PREC, DT, EMU)
                a1 = _class_pv(w, words, 1, a1, V_P, V_WC, V_BITS, V_OFF, PREC, DT, EMU)
                a2 = _class_pv(w, words, 2, a2, V_P, V_WC, V_BITS, V_OFF, PREC, DT, EMU)
                a3 = _class_pv(w, words, 3, a3, V_P, V_WC, V_BITS, V_OFF, PREC, DT, EMU)
                if V_P == 8:
                    a4 = _class_pv(w, words, 4, a4, V_P, V_WC, V_BITS, V_OFF, PREC, DT, EMU)
                    a5 = _class_pv(w, words, 5, a5, V_P, V_WC, V_BITS, V_OFF, PREC, DT, EMU)
                    a6 = _class_pv(w, words, 6, a6, V_P, V_WC, V_BITS, V_OFF, PREC, DT, EMU)
                    a7 = _class_pv(w, words, 7, a7, V_P, V_WC, V_BITS, V_OFF, PREC, DT, EMU)
                wacc = _weight_sum(w, wacc, BN, PREC, DT, EMU)
                if V_Z:
                    corr = corr * alpha + tl.sum(p * vz[None, :], 1)
                keep = keep * alpha
            elif V_G == D:
                c = _unpack(vcp, rows, valid, D, V_BITS, BN)
                vs, vz = _token_scale_offset(vsp, vzp, srows, valid, V_HALF, V_Z, V_E5M3)
                w = _round_to(p * vs[None, :], DT, EMU)
                o = _mma(w, _codes_as(c, V_OFF), DT, EMU, PREC)
                if V_Z:
                    o = o + tl.sum(p * vz[None, :] - V_OFF * w, 1)[:, None]
                else:  # Σ w (c + HALF), as the classes read it (see corr above)
                    o = o + ((V_HALF - V_OFF) * tl.sum(w, 1))[:, None]
            else:
                c = _unpack(vcp, rows, valid, D, V_BITS, BN)
                v = _dequant_tile(c, vsp, vzp, srows, valid, V_G, D, V_HALF, V_Z, V_E5M3)
                o = _mma(p, v, DT, EMU, PREC)
            if V_P == 0:
                acc = acc * alpha[:, None] + o
        if V_P > 0:
            wsum = tl.max(wacc, 1)  # its 16 columns are equal: max, not a sum, keeps it exact
            half = 0.0 if V_Z else V_HALF
            acc = acc * keep[:, None] + _join_classes(a0, a1, a2, a3, a4, a5, a6, a7, GP, D, V_P) + corr[:, None] \
                + wsum[:, None] * (half - _class_offsets(D, V_WC, V_BITS, V_OFF))[None, :]
        return m, l, acc

    @jit
    def _rne_out(x, META_BF16: tl.constexpr):
        """float32 about to be stored as bfloat16 (META_BF16) rounded to nearest even first, as torch rounds it
        (the interpreter would truncate); other dtypes unchanged."""
        if META_BF16:
            x = _rne_bf16(x)
        return x

    @jit
    def _merge_splits(o_ptr, m_ptr, l_ptr, sinks_ptr, out_ptr, s_ob, s_oh, b, hq, qmask, base, SPLITS,
                      D: tl.constexpr, GP: tl.constexpr, HAS_SINKS: tl.constexpr, OUT_BF16: tl.constexpr):
        """merge_kernel's merge of the GP query heads ``hq`` (GP,) (``qmask`` the real ones) of sequence ``b``, whose
        splits' state starts at row ``base`` (GP,) of m, l (rows,) and o (rows, D), written out: by the last
        program of a (sequence, KV head) pair to finish (decode_kernel's LAST_MERGES). One split at a time, so any
        number of them takes the registers of one: two passes, the max first (exact in any order), so each split's
        weight exp2(m - M) is merge_kernel's to the bit; only the sums over the splits run in order 0, 1, ... where
        merge_kernel's tl.sum runs a tree, so the output may differ from the two launches' in float32's last bits.
        The loads bypass L1 (``.cg``): the other programs wrote these rows from other multiprocessors."""
        d = tl.arange(0, D)
        M = tl.full([GP], float("-inf"), dtype=tl.float32)
        for i in range(0, SPLITS):
            M = tl.maximum(M, tl.load(m_ptr + base + i, mask=qmask, other=float("-inf"), cache_modifier=".cg"))
        if HAS_SINKS:  # the learned sink logit: one more softmax column with a zero value
            sink = tl.load(sinks_ptr + hq, mask=qmask, other=0.0).to(tl.float32) * 1.4426950408889634
            M = tl.maximum(M, sink)
        M = tl.where(M == float("-inf"), 0.0, M)
        L = tl.full([GP], 0, dtype=tl.float32)
        acc = tl.full([GP, D], 0, dtype=tl.float32)
        for i in range(0, SPLITS):
            w = tl.exp2(tl.load(m_ptr + base + i, mask=qmask, other=float("-inf"), cache_modifier=".cg") - M)
            L = L + tl.load(l_ptr + base + i, mask=qmask, other=0.0, cache_modifier=".cg") * w
            o = tl.load(o_ptr + (base + i)[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0, cache_modifier=".cg")
            acc = acc + o * w[:, None]
        if HAS_SINKS:
            L = L + tl.exp2(sink - M)
        L = tl.where(qmask, L, 1.0)  # the padding rows (never stored) saw nothing: no 0/0 there
        out = acc / L[:, None]
        tl.store(out_ptr + b * s_ob + hq[:, None] * s_oh + d[None, :],
                 _rne_out(out, OUT_BF16).to(out_ptr.dtype.element_ty), mask=qmask[:, None])

    # -- decode: one program per (sequence, KV head, split) -------------------------------------------------------
    @jit
    def decode_kernel(q_ptr, sq_b, sq_h,
                      lens_ptr,  # int32 (B, 3): sink, middle, recent tokens of each sequence
                      st_ptr, MB_MID, MB_REC,  # STARTS: int32 (B, 3), the parts' first columns; mask columns of parts
                      sk_ptr, sv_ptr, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                      rk_ptr, rv_ptr, rk_b, rk_h, rk_t, rv_b, rv_h, rv_t,
                      wt_ptr, s_wt, WT_TAIL,  # FP_UNIT: int32 (B, ·) pool rows of the sink's pages, the tail's from WT_TAIL
                      kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                      kc0, kc1, kc2, ks0, ks1, ks2, vc0, vc1, vc2, vs0, vs1, vs2,
                      kts_ptr, ktz_ptr, kt0, kt1, kt2, KT_ZI,  # KVarN key tiles' scale and zero (K_TILE > 0)
                      vts_ptr, vt0, vt1, vt2,  # KVarN value tiles' channel scales (V_TILE > 0)
                      rb_ptr, rb_b, rb_h, rp_ptr, rt_ptr, rr_ptr,  # RMEAN: terms (B, Hq, D), token 0's position (B,), tables
                      bt_ptr, s_bt, PAGE: tl.constexpr,
                      mask_ptr, s_mb, S, WINDOW,
                      o_ptr, m_ptr, l_ptr,  # (B, Hq, SPLITS, D), (B, Hq, SPLITS) float32
                      sinks_ptr, out_ptr, s_ob, s_oh,  # FINAL: (Hq,) sink logits (HAS_SINKS), the output (B, Hq, D)
                      cnt_ptr,  # LAST_MERGES: int32 (B, Hkv) splits done of each pair, 0 between calls
                      sm_scale, softcap, K_HALF, V_HALF, SPLITS,
                      D: tl.constexpr, GQA: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr,
                      K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_G: tl.constexpr, V_G: tl.constexpr,
                      K_Z: tl.constexpr, V_Z: tl.constexpr, K_E5M3: tl.constexpr, V_E5M3: tl.constexpr,
                      K_OFF: tl.constexpr, V_OFF: tl.constexpr, K_P: tl.constexpr, V_P: tl.constexpr,
                      K_WC: tl.constexpr, V_WC: tl.constexpr, K_W4: tl.constexpr, V_W4: tl.constexpr,
                      K_TILE: tl.constexpr, KT_MW: tl.constexpr, V_TILE: tl.constexpr, VT_MW: tl.constexpr,
                      RMEAN: tl.constexpr,
                      PAGED: tl.constexpr, PAGE_ABS: tl.constexpr, STARTS: tl.constexpr, HAS_MASK: tl.constexpr,
                      SOFTCAP: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr,
                      FP_STAGES: tl.constexpr, FINAL: tl.constexpr, HAS_SINKS: tl.constexpr, OUT_BF16: tl.constexpr,
                      LAST_MERGES: tl.constexpr, FP_UNIT: tl.constexpr, ONE_PAGE: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        sp = tl.program_id(2)
        n_s = tl.load(lens_ptr + b * 3)
        n_m = tl.load(lens_ptr + b * 3 + 1)
        n_r = tl.load(lens_ptr + b * 3 + 2)
        N = n_s + n_m + n_r
        # the splits share the columns the query can see: a sliding window's (and a mask's) earlier ones are never
        # read, which is O(window) work, and their rows may hold anything (vLLM frees them: 0·NaN would be NaN)
        first = tl.where(WINDOW > 0, tl.maximum(N - WINDOW, 0), 0)
        if STARTS:  # ragged rows in batched parts: row b's tokens of part i from its column starts[b, i]; the mask
            # covers the parts' columns side by side (sink from 0, middle from MB_MID, recent from MB_REC)
            o_s = tl.load(st_ptr + b * 3)
            o_m = tl.load(st_ptr + b * 3 + 1)
            o_r = tl.load(st_ptr + b * 3 + 2)
            mb_s = o_s * 0
            mb_m = mb_s + MB_MID
            mb_r = mb_s + MB_REC
        else:  # each part from its column 0; the mask covers each sequence's last S columns
            o_s = n_s * 0
            o_m = o_s
            o_r = o_s
            if HAS_MASK:
                first = tl.maximum(first, N - S)
            mb_s = S - N
            mb_m = mb_s + n_s
            mb_r = mb_m + n_m
        chunk = (N - first + SPLITS - 1) // SPLITS
        # the softmax runs in base 2: the scale carries log2 e (folded into per-token vectors on the class path, so
        # exp2 needs no multiply); with a softcap the cap needs natural units, and _finish_scores converts after it
        if not SOFTCAP:
            sm_scale = sm_scale * 1.4426950408889634
        lo = first + sp * chunk
        hi = tl.minimum(N, lo + chunk)

        gi = tl.arange(0, GP)
        d = tl.arange(0, D)
        hq = h * GQA + gi  # the query heads of this KV head
        qmask = gi < GQA
        qrow = b * sq_b + hq * sq_h
        q = tl.load(q_ptr + qrow[:, None] + d[None, :], mask=qmask[:, None], other=0.0)
        qsum = tl.sum(q.to(tl.float32), 1)
        qoff = qsum  # Σ_c OFF_c q_c, what the keys' codes in classes add (_class_offsets), − HALF·Σq without a zero
        if K_P > 0:
            qoff = tl.sum(q.to(tl.float32) * _class_offsets(D, K_WC, K_BITS, K_OFF)[None, :], 1)
            if not K_Z:
                qoff = qoff - K_HALF * qsum
        brow = b * rb_b + hq * rb_h
        p0 = tl.load(rp_ptr + b).to(tl.int64) if RMEAN else b * 0
        m = tl.full([GP], float("-inf"), dtype=tl.float32)
        l = tl.full([GP], 0, dtype=tl.float32)
        acc = tl.full([GP, D], 0, dtype=tl.float32)

        # middle [n_s, n_s + n_m), sink [0, n_s), recent [n_s + n_m, N), each intersected with [lo, hi): one online
        # softmax over the three, in any order; the middle first, so that no accumulator is live through its loop
        # but its own (nor q, loaded again after it)
        m, l, acc = _code_segment(q, qsum, qoff, m, l, acc, q_ptr, qrow, qmask, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                                  kts_ptr, ktz_ptr, kc0, kc1, kc2, ks0, ks1, ks2, vc0, vc1, vc2, vs0, vs1, vs2,
                                  kt0, kt1, kt2, KT_ZI, vts_ptr, vt0, vt1, vt2, rb_ptr, brow, rt_ptr, rr_ptr, p0,
                                  bt_ptr, s_bt, PAGE, b, h, tl.maximum(lo - n_s, 0) + o_m, tl.minimum(hi - n_s, n_m) + o_m,
                                  n_s - o_m, mb_m, sm_scale, softcap, mask_ptr, s_mb, K_HALF, V_HALF,
                                  D, BN, K_BITS, V_BITS, K_G, V_G, K_Z, V_Z, K_E5M3, V_E5M3, K_OFF, V_OFF,
                                  K_P, V_P, K_WC, V_WC, K_W4, V_W4, GP, K_TILE, KT_MW, V_TILE, VT_MW, RMEAN, PAGED, PAGE_ABS,
                                  ONE_PAGE, HAS_MASK,
                                  SOFTCAP, PREC,
                                  DT, EMU)
        q = tl.load(q_ptr + qrow[:, None] + d[None, :], mask=qmask[:, None], other=0.0)
        wt_row = wt_ptr + b * s_wt  # FP_UNIT: this sequence's pool rows, the sink's pages then the tail's from WT_TAIL
        m, l, acc = _fp_segment(q, m, l, acc, sk_ptr, sv_ptr, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, b, h,
                                tl.maximum(lo, 0) + o_s, tl.minimum(hi, n_s) + o_s, mb_s, sm_scale, softcap, mask_ptr,
                                s_mb, wt_row, 0, 0, D, BN, HAS_MASK, SOFTCAP, PREC, DT, EMU, FP_STAGES, FP_UNIT)
        w0 = n_s + n_m
        m, l, acc = _fp_segment(q, m, l, acc, rk_ptr, rv_ptr, rk_b, rk_h, rk_t, rv_b, rv_h, rv_t, b, h,
                                tl.maximum(lo - w0, 0) + o_r, tl.minimum(hi - w0, n_r) + o_r, mb_r, sm_scale, softcap,
                                mask_ptr, s_mb, wt_row, WT_TAIL, w0, D, BN, HAS_MASK, SOFTCAP, PREC, DT, EMU, FP_STAGES,
                                FP_UNIT)

        if FINAL:  # one split: merge_kernel's arithmetic on its one split here, in the same order (the same bits),
            # and no second launch nor the splits' state in global memory
            M = m
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + hq, mask=qmask, other=0.0).to(tl.float32) * 1.4426950408889634
                M = tl.maximum(M, sink)
            M = tl.where(M == float("-inf"), 0.0, M)
            w = tl.exp2(m - M)
            L = l * w
            if HAS_SINKS:
                L = L + tl.exp2(sink - M)
            out = acc * w[:, None] / L[:, None]
            tl.store(out_ptr + b * s_ob + hq[:, None] * s_oh + d[None, :],
                     _rne_out(out, OUT_BF16).to(out_ptr.dtype.element_ty), mask=qmask[:, None])
        else:
            Hq = tl.num_programs(1) * GQA
            row = (b * Hq + hq) * SPLITS + sp  # (GP,)
            tl.store(m_ptr + row, m, mask=qmask)
            tl.store(l_ptr + row, l, mask=qmask)
            tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=qmask[:, None])
            if LAST_MERGES:  # the pair's last program to finish merges its splits: no merge launch
                # One thread issues the atomic (Triton's scalar atomics), after every thread's stores above: the
                # barrier orders them before it within the program, and its release at gpu scope (cumulative in
                # PTX's memory model) makes them visible to whichever program's acquire reads the count it leaves.
                # (Triton's lowering puts a bar.sync of its own before this atomic today, for the shared memory its
                # result passes through; the order must not rest on that.)
                tl.debug_barrier()
                cnt_ptr = cnt_ptr + b * tl.num_programs(1) + h
                done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
                if done == SPLITS - 1:  # every other split's state is written, and acquired by the thread that added
                    tl.debug_barrier()  # every thread's loads below after that acquire (not left to how Triton
                    # broadcasts the count: a shuffle, or shared memory, each followed by a barrier today)
                    tl.store(cnt_ptr, 0)  # no other program touches it again this call: 0 for the next call
                    _merge_splits(o_ptr, m_ptr, l_ptr, sinks_ptr, out_ptr, s_ob, s_oh, b, hq, qmask, (b * Hq + hq) * SPLITS,
                                  SPLITS, D, GP, HAS_SINKS, OUT_BF16)

    # -- merge the splits: one program per (sequence, query head) -------------------------------------------------
    @jit
    def merge_kernel(o_ptr, m_ptr, l_ptr, sinks_ptr, out_ptr, s_ob, s_oh, SPLITS, Hq,
                     D: tl.constexpr, SP: tl.constexpr, HAS_SINKS: tl.constexpr, OUT_BF16: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        hq = tl.program_id(1).to(tl.int64)
        i = tl.arange(0, SP)
        d = tl.arange(0, D)
        ok = i < SPLITS
        row = (b * Hq + hq) * SPLITS + i
        m = tl.load(m_ptr + row, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + row, mask=ok, other=0.0)
        M = tl.max(m, 0)
        if HAS_SINKS:  # the learned sink logit: one more softmax column with a zero value
            sink = tl.load(sinks_ptr + hq).to(tl.float32) * 1.4426950408889634
            M = tl.maximum(M, sink)
        M = tl.where(M == float("-inf"), 0.0, M)
        w = tl.exp2(m - M)  # (SP,): empty splits (m = -inf) weigh 0; m and M in base 2 (decode_kernel)
        L = tl.sum(l * w, 0)
        if HAS_SINKS:
            L = L + tl.exp2(sink - M)
        acc = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / L
        tl.store(out_ptr + b * s_ob + hq * s_oh + d, _rne_out(out, OUT_BF16).to(out_ptr.dtype.element_ty))

    # -- store: one program per (BR tokens, KV head) ---------------------------------------------------------------
    @jit
    def _store_packed(c_ptr, base, q, ok, N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
        """Rows of codes ``q`` (N, D) (float, 0..2^BITS−1) packed as :mod:`wushkv.quantizers.packing` lays them out
        (8 codes → BITS bytes, code i at bits [i·BITS, (i+1)·BITS)) and stored from ``c_ptr + base`` (N,), rows
        where ``ok`` (N,)."""
        codes = tl.reshape(q.to(tl.int64), [N, D // 8, 8])
        i = tl.arange(0, 8)
        word = tl.sum(codes << (i[None, None, :] * BITS), 2)  # (N, D/8): disjoint bits, so the sum is an or
        w = tl.arange(0, D // 8)
        for m in tl.static_range(BITS):
            tl.store(c_ptr + base[:, None] + w[None, :] * BITS + m, ((word >> (8 * m)) & 255).to(tl.uint8),
                     mask=ok[:, None])

    @jit
    def store_kernel(x_ptr, sx_r, sx_h, sx_d, t_ptr, st_h, st_i, st_j, f_ptr, sf_h, sf_i, sf_j, slot_ptr, R, PAGE,
                     c_ptr, sc0, sc1, sc2, s_ptr, ss0, ss1, ss2, z_ptr, sz0, sz1, sz2,
                     coef, kth, sqrt_g,
                     D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, QUEST: tl.constexpr,
                     CLIPPED: tl.constexpr, HAS_T: tl.constexpr, HAS_Z: tl.constexpr, TC: tl.constexpr,
                     META_BF16: tl.constexpr, FEEDBACK: tl.constexpr, BR: tl.constexpr, STEP_BYTE: tl.constexpr,
                     STEP_ROUND: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # (BR,) rows
        h = tl.program_id(1).to(tl.int64)
        raw = tl.load(slot_ptr + r, mask=r < R, other=-1).to(tl.int64)  # vLLM pads with slot -1: nothing is written
        ok = raw >= 0
        slot = tl.maximum(raw, 0)
        blk = slot // PAGE
        tok = slot % PAGE
        r = tl.where(r < R, r, 0)  # rows past the end read row 0 and write nothing
        d = tl.arange(0, D)
        if HAS_T:  # x' = T x, per KV head, float32, TC columns of T at a time
            x = tl.full([BR, D], 0, dtype=tl.float32)
            for j0 in tl.static_range(0, D, TC):
                j = j0 + tl.arange(0, TC)
                xj = tl.load(x_ptr + r[:, None] * sx_r + h * sx_h + j[None, :] * sx_d).to(tl.float32)  # (BR, TC)
                T = tl.load(t_ptr + h * st_h + d[:, None] * st_i + j[None, :] * st_j).to(tl.float32)  # (D, TC)
                x += tl.sum(T[None, :, :] * xj[:, None, :], 2)
        else:
            x = tl.load(x_ptr + r[:, None] * sx_r + h * sx_h + d[None, :] * sx_d).to(tl.float32)  # (BR, D)
        NG: tl.constexpr = D // G
        QMAX: tl.constexpr = (1 << BITS) - 1
        if QUEST:  # Δ = coef·‖x_g‖/√G (or coef·max|x_g|), q = clamp(⌊x/Δ⌋, −2^{b−1}, 2^{b−1}−1) + 2^{b−1}
            HALF: tl.constexpr = 1 << (BITS - 1)
            xg = tl.reshape(x, [BR, NG, G])
            if CLIPPED:
                ss = tl.sum(xg * xg, 2)
                step = coef * tl.math.div_rn(tl.math.sqrt_rn(ss), tl.zeros_like(ss) + sqrt_g)
            else:
                step = coef * tl.max(tl.abs(xg), 2)
            step = tl.maximum(step, 1.1754943508222875e-38)
            if STEP_BYTE:  # one E5M3 byte (codecs.e5m3_round): float16's bits 14..7, rounded half up (STEP_ROUND 64)
                # or up (127); the codes are rounded on the step as stored, which may be 0 (then on float32's tiny)
                hb = step.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
                sbyte = tl.minimum(tl.maximum((hb + STEP_ROUND) >> 7, 0), 0xF7)
                step = (sbyte << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                q = tl.floor(tl.math.div_rn(xg, tl.maximum(step, 1.1754943508222875e-38)[:, :, None]))
            else:
                sbyte = tl.full([BR, NG], 0, dtype=tl.int32)  # unused
                q = tl.floor(tl.math.div_rn(xg, step[:, :, None]))
            q = tl.minimum(tl.maximum(q, -HALF), HALF - 1) + HALF
            scale = step
            offset = step  # unused: QuEST stores only the step
        else:  # affine: percentile clip over the row, then per group min–max
            x0 = x  # (error feedback rounds the row itself on the clipped row's grid)
            if CLIPPED:  # τ = the kth smallest |x| of the row (0-based), by counting, no sort
                a = tl.abs(x)
                # each channel's count of the row's smaller (and not larger) ones, a channel j at a time: the
                # (BR, D, D) comparisons at once held 17.8 KB of stack a thread at head_dim 128 and took ptxas
                # 100 s (sm_90, 8 rows a program)
                less = tl.full([BR, D], 0, dtype=tl.int32)
                leq = tl.full([BR, D], 0, dtype=tl.int32)
                for j in range(D):
                    if HAS_T:  # |x'_j|, out of the row (one term: exact)
                        aj = tl.sum(tl.where(d[None, :] == j, a, 0.0), 1)
                    else:  # |x_j|, read again: the same float32
                        aj = tl.abs(tl.load(x_ptr + r * sx_r + h * sx_h + j * sx_d).to(tl.float32))
                    less += (aj[:, None] < a).to(tl.int32)
                    leq += (aj[:, None] <= a).to(tl.int32)
                tau = tl.max(tl.where((less <= kth) & (kth < leq), a, 0.0), 1)
                x = tl.maximum(tl.minimum(x, tau[:, None]), -tau[:, None])
            xg = tl.reshape(x, [BR, NG, G])
            lo = tl.min(xg, 2)
            hi = tl.max(xg, 2)
            s = tl.math.div_rn(tl.maximum(hi - lo, 1e-8), tl.zeros_like(hi) + QMAX)
            z = tl.math.div_rn(-lo, s)
            q = tl.floor(tl.math.div_rn(xg, s[:, :, None]) + z[:, :, None] + 0.5)
            q = tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0)
            scale = s
            offset = -z * s
            x = x0
        if FEEDBACK:  # the codes rounded with error feedback F (H, D, D) on the grid as stored (feedback_round)
            if STEP_BYTE:
                s_st = scale  # the E5M3 step, exact in float32
            else:
                s_st = _rne_out(scale, META_BF16).to(s_ptr.dtype.element_ty).to(tl.float32)  # (BR, NG)
            if QUEST:
                o_st = s_st * (0.5 - (1 << (BITS - 1)))  # (TokenCodec.scale_offset: offset = (½ − 2^{b−1})·Δ)
            else:
                o_st = _rne_out(offset, META_BF16).to(z_ptr.dtype.element_ty).to(tl.float32)
            gi = tl.arange(0, NG)
            # the codes go straight into packed words, each stored once its 8 codes are in: a (BR, D) tile of codes set
            # a channel at a time takes, for _store_packed's reshape, a layout that holds all D in every thread (567
            # LOP3 a channel, 255 registers and spills at head_dim 128, one row, sm_90)
            word = tl.full([BR], 0, dtype=tl.int64)
            cbase = blk * sc0 + tok * sc1 + h * sc2  # (BR,)
            for j in range(D):  # channel by channel: its code, then its error pushed onto the later channels
                at = d[None, :] == j
                wj = tl.sum(tl.where(at, x, 0.0), 1)  # (BR,)
                sj = tl.sum(tl.where(gi[None, :] == j // G, s_st, 0.0), 1)
                oj = tl.sum(tl.where(gi[None, :] == j // G, o_st, 0.0), 1)
                # (a step stored as 0 divides by float32's tiny, as feedback_round does: 0/0 would feed NaN on)
                c = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(wj - oj, tl.maximum(sj, 1.1754943508222875e-38)) + 0.5),
                                          0.0), QMAX * 1.0)
                word = word | (c.to(tl.int64) << ((j % 8) * BITS))
                if j % 8 == 7:
                    for m in tl.static_range(BITS):
                        tl.store(c_ptr + cbase + (j // 8) * BITS + m, ((word >> (8 * m)) & 255).to(tl.uint8), mask=ok)
                    word = tl.full([BR], 0, dtype=tl.int64)
                e = wj - (c * sj + oj)  # (fp fusion off: the float32 steps of feedback_round, one by one)
                f = tl.load(f_ptr + h * sf_h + j * sf_i + d * sf_j, mask=d > j, other=0.0).to(tl.float32)  # (D,)
                x = x - e[:, None] * f[None, :]
        else:
            _store_packed(c_ptr, blk * sc0 + tok * sc1 + h * sc2, q, ok, BR, D, BITS)
        g = tl.arange(0, NG)
        if STEP_BYTE:
            tl.store(s_ptr + (blk * ss0 + tok * ss1 + h * ss2)[:, None] + g[None, :], sbyte.to(tl.uint8), mask=ok[:, None])
        else:
            tl.store(s_ptr + (blk * ss0 + tok * ss1 + h * ss2)[:, None] + g[None, :],
                     _rne_out(scale, META_BF16).to(s_ptr.dtype.element_ty), mask=ok[:, None])
        if HAS_Z:
            tl.store(z_ptr + (blk * sz0 + tok * sz1 + h * sz2)[:, None] + g[None, :],
                     _rne_out(offset, META_BF16).to(z_ptr.dtype.element_ty), mask=ok[:, None])

    # -- KVarN tiles: balance, rows (keys' with error feedback), pack ------------------------------------------------
    @jit
    def _std(B, AXIS: tl.constexpr, N: tl.constexpr, CORRECTION: tl.constexpr):
        """torch's ``B.std(dim=AXIS, correction=CORRECTION)`` of a 2-D tile over its N entries along AXIS: the
        mean, then the squared deviations' sum over N − CORRECTION, IEEE division and square root."""
        total = tl.sum(B, AXIS)
        mean = tl.math.div_rn(total, tl.full(total.shape, N, tl.float32))
        dev = B - tl.expand_dims(mean, AXIS)
        ss = tl.sum(dev * dev, AXIS)
        return tl.math.sqrt_rn(tl.math.div_rn(ss, tl.full(ss.shape, N - CORRECTION, tl.float32)))

    @jit
    def _imbalance(B, R: tl.constexpr, C: tl.constexpr):
        """:func:`wushkv.quantizers.kvarn.imbalance` of one (R, C) tile (a scalar)."""
        sc = _std(B, 0, R, 1)  # (C,) each column's std
        sr = _std(B, 1, C, 1)  # (R,) each row's
        return (tl.math.div_rn(tl.max(sc, 0), tl.maximum(tl.min(sc, 0), 1e-8))
                + tl.math.div_rn(tl.max(sr, 0), tl.maximum(tl.min(sr, 0), 1e-8)))

    @jit
    def _round_even(x):
        """torch.round: to nearest, ties to even (the interpreter has no rint)."""
        fl = tl.floor(x)
        fr = x - fl
        odd = fl - 2.0 * tl.floor(fl * 0.5)
        return tl.where(fr > 0.5, fl + 1.0, tl.where(fr < 0.5, fl, fl + odd))

    @jit
    def _tile_grid(b, N: tl.constexpr, QMAX: tl.constexpr, clip_half, CLIPPED: tl.constexpr, AXIS: tl.constexpr):
        """(lo, step) of balanced rows ``b`` along AXIS (kvarn._row_grid): min-max, or within mean ± clip·α_b·σ."""
        lo = tl.min(b, AXIS)
        hi = tl.max(b, AXIS)
        if CLIPPED:
            mu = tl.math.div_rn(tl.sum(b, AXIS), tl.full(lo.shape, N, tl.float32))
            half = clip_half * _std(b, AXIS, N, 0)
            lo = tl.maximum(lo, mu - half)
            hi = tl.minimum(hi, mu + half)
        return lo, tl.maximum(tl.math.div_rn(hi - lo, tl.full(lo.shape, QMAX, tl.float32)), 1e-10)

    @jit
    def kvarn_tile_kernel(x_ptr, sx_b, sx_h, sx_t, sx_d, f_ptr, sf_h, sf_i, sf_j,
                          c_ptr, sc_b, sc_h, sc_t, s_ptr, z_ptr, sm_b, sm_h, sm_n, o_ptr, so_b, so_h, so_n,
                          clip_half,
                          D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, ITERS: tl.constexpr,
                          CLIPPED: tl.constexpr, FEEDBACK: tl.constexpr, RELOAD: tl.constexpr, VALUES: tl.constexpr):
        """Program (tile j, head h, sequence b): the KVarN tile of tokens [j·G, (j+1)·G) as
        :func:`wushkv.quantizers.kvarn.kvarn_quantize` stores it: A (R × C) = Xᵀ (keys: D channels × G tokens) or X
        (VALUES: G tokens × D channels), balanced in ITERS rounds (the round of least imbalance kept), each row
        quantized over its own grid (keys' channel rows in order, each row's error pushed onto the later rows through
        F with FEEDBACK), the codes packed per token at x's rows, scale and zero (R,) and s_fold (C,) in float16."""
        j = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        R: tl.constexpr = VALUES * G + (1 - VALUES) * D  # (arithmetic: an if-expression is no constexpr when compiled)
        C: tl.constexpr = VALUES * D + (1 - VALUES) * G
        r = tl.arange(0, R)
        c = tl.arange(0, C)
        if VALUES:  # rows are tokens
            a_ptr = x_ptr + b * sx_b + h * sx_h + (j * G + r[:, None]) * sx_t + c[None, :] * sx_d
        else:  # rows are channels
            a_ptr = x_ptr + b * sx_b + h * sx_h + (j * G + c[None, :]) * sx_t + r[:, None] * sx_d
        A = tl.load(a_ptr).to(tl.float32)  # (R, C)  (RELOAD: read again where used; volatile, or it is CSE'd away)
        QMAX: tl.constexpr = (1 << BITS) - 1
        # 2. balance in the log domain: A = B ⊙ (exp ℓ_r · exp ℓ_cᵀ), the round of least imbalance (the start counts)
        log_r = tl.full([R], 0, dtype=tl.float32)
        log_c = tl.full([C], 0, dtype=tl.float32)
        best_r = log_r
        best_c = log_c
        best = _imbalance(A, R, C)
        B = A
        for _ in range(ITERS):
            log_c = tl.minimum(tl.maximum(log_c + tl.log(tl.minimum(tl.maximum(_std(B, 0, R, 1), 1e-3), 1e3)), -0.3), 10.0)
            if RELOAD:
                A = tl.load(a_ptr, volatile=True).to(tl.float32)
            B = A / (tl.exp(log_r)[:, None] * tl.exp(log_c)[None, :])
            log_r = tl.minimum(tl.maximum(log_r + tl.log(tl.minimum(tl.maximum(_std(B, 1, C, 1), 1e-3), 1e3)), -0.3), 10.0)
            if RELOAD:
                A = tl.load(a_ptr, volatile=True).to(tl.float32)
            B = A / (tl.exp(log_r)[:, None] * tl.exp(log_c)[None, :])
            imb = _imbalance(B, R, C)
            better = imb < best  # strictly: a NaN never replaces the incumbent
            best = tl.where(better, imb, best)
            best_r = tl.where(better, log_r, best_r)
            best_c = tl.where(better, log_c, best_c)
        row_exp = tl.exp(best_r)  # (R,)
        fold = tl.exp(best_c)  # (C,)
        # 3. each row over its own grid
        if RELOAD:
            A = tl.load(a_ptr, volatile=True).to(tl.float32)
        if FEEDBACK:  # (keys: R = D, C = G) rows in order; the error as the decoder reads it (float16) feeds the later rows
            fold16 = fold.to(tl.float16).to(tl.float32)
            W = A
            q = tl.full([D, G], 0, dtype=tl.float32)
            lo = tl.full([D], 0, dtype=tl.float32)
            step = tl.full([D], 0, dtype=tl.float32)
            for i in range(D):
                at = r == i
                w = tl.sum(tl.where(at[:, None], W, 0.0), 0)  # (G,) row i as updated so far
                e_r = tl.sum(tl.where(at, row_exp, 0.0), 0)
                bi = w / (e_r * fold)
                lo_i, step_i = _tile_grid(bi[None, :], G, QMAX, clip_half, CLIPPED, 1)  # (1,)
                qi = tl.minimum(tl.maximum(_round_even(tl.math.div_rn(bi[None, :] - lo_i[:, None], step_i[:, None])), 0.0), QMAX * 1.0)
                q = tl.where(at[:, None], qi, q)
                lo = tl.where(at, tl.sum(lo_i, 0), lo)
                step = tl.where(at, tl.sum(step_i, 0), step)
                s16 = (e_r * step_i).to(tl.float16).to(tl.float32)  # (1,)
                z16 = (e_r * lo_i).to(tl.float16).to(tl.float32)
                e = w[None, :] - fold16[None, :] * (s16[:, None] * qi + z16[:, None])  # (1, G)
                f = tl.load(f_ptr + h * sf_h + i * sf_i + r * sf_j, mask=r > i, other=0.0).to(tl.float32)  # (D,)
                W = W - f[:, None] * e
        else:
            B = A / (row_exp[:, None] * fold[None, :])
            lo, step = _tile_grid(B, C, QMAX, clip_half, CLIPPED, 1)
            q = tl.minimum(tl.maximum(_round_even(tl.math.div_rn(B - lo[:, None], step[:, None])), 0.0), QMAX * 1.0)
        # 4. metadata, float16: scale' = exp ℓ_r · step, zero' = exp ℓ_r · lo (per row), s_fold = exp ℓ_c (per column)
        n = b * sm_b + h * sm_h + j * sm_n
        tl.store(s_ptr + n + r, (row_exp * step).to(tl.float16))
        tl.store(z_ptr + n + r, (row_exp * lo).to(tl.float16))
        tl.store(o_ptr + b * so_b + h * so_h + j * so_n + c, fold.to(tl.float16))
        # codes per token (x's rows), packed along the channels
        if VALUES:
            _store_packed(c_ptr, b * sc_b + h * sc_h + (j * G + r) * sc_t, q, r >= 0, G, D, BITS)
        else:
            _store_packed(c_ptr, b * sc_b + h * sc_h + (j * G + c) * sc_t, tl.trans(q), c >= 0, G, D, BITS)

    # -- the code words' operand bits alone: what checks the GPU's inline PTX without a GPU -------------------------
    @jit
    def word_codes_kernel(w_ptr, o_ptr, S: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr,
                          EMU: tl.constexpr, BN: tl.constexpr, K: tl.constexpr):
        """Program i: the (BN, K) code words at ``w_ptr + i·BN·K`` (int16: 16-bit words; int32: three-byte words,
        the top byte ignored; uint8: bytes), each of P codes of BITS → the 16 bits of code S of each as the dots' operand
        (:func:`_word_codes`), int16 at ``o_ptr``. On a GPU (EMU False) they come from inline PTX, which the
        interpreter never runs (EMU True builds the same bits in plain Triton): compiled for sm_90 and run through a
        PTX emulator, the two are checked against each other without a GPU (``tests/test_triton_kernels.py``)."""
        r = tl.program_id(0) * BN * K + tl.arange(0, BN)[:, None] * K + tl.arange(0, K)[None, :]
        out = _word_codes(tl.load(w_ptr + r), S, P, BITS, OFF, EMU)
        tl.store(o_ptr + r, out.to(tl.int16, bitcast=True))

    return {"decode": decode_kernel, "merge": merge_kernel, "store": store_kernel, "word_codes": word_codes_kernel,
            "kvarn_keys": kvarn_tile_kernel, "kvarn_values": kvarn_tile_kernel}


def _check_device(*tensors) -> None:
    if _RECORDING:
        return  # nothing runs: CPU tensors stand in for a GPU's
    cpu = any(t is not None and t.device.type == "cpu" for t in tensors)
    if cpu and not interpreting():
        raise RuntimeError("the Triton kernels run CPU tensors only under Triton's interpreter: set TRITON_INTERPRET=1 "
                           "in the environment before triton is first imported")


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as ``dtype`` (default: its own) on ``device`` without making the host wait for the device. A plain copy from the host's
    pageable memory synchronizes the stream (torch waits for the copy, so for every kernel queued before it): at
    each layer and step the host could not run ahead of the GPU. From pinned memory the copy is asynchronous, and
    torch's pinned-memory cache keeps the buffer until the copy has run. The buffer is a fresh contiguous one in
    ``dtype`` (torch would stage a non-contiguous source, an expanded ``lengths``, in pageable memory again)."""
    dtype = t.dtype if dtype is None else dtype
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device=device, dtype=dtype)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a CUDA graph cannot capture a copy from the host: pass lengths, block tables, slot "
                           "mappings and starts as tensors on the GPU while capturing")
    # always a fresh buffer: a caller's own pinned tensor, read after this returns, could be overwritten meanwhile
    staged = torch.empty(t.shape, dtype=dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device, non_blocking=True)


_KEPT: collections.OrderedDict = collections.OrderedDict()  # kept_on's uploads, by device, dtype, shape and values


def kept_on(t: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`to_device` of a small host tensor asked for again and again with the same values: a decode call's
    ``lengths`` (and ``+rmean``'s first positions), the same at every layer of a step, where each copy is a pinned
    staging buffer and an upload queued on the stream. Kept by device, stream, dtype, shape and values (the last 32):
    only work queued after the upload on its own stream reads it, so no other stream reads it before it lands (nor
    after the allocator hands its memory on); the kernels only read it. Off a GPU, and while a CUDA graph is captured
    (where :func:`to_device` refuses a host tensor), it is :func:`to_device`'s."""
    device = torch.device(device)
    if t.device.type != "cpu" or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return to_device(t, device, dtype).contiguous()
    key = (str(device), torch.cuda.current_stream(device).cuda_stream, dtype, tuple(t.shape),
           t.to(dtype).contiguous().numpy().tobytes())
    hit = _KEPT.get(key)
    if hit is None:
        hit = _KEPT[key] = to_device(t, device, dtype).contiguous()
        if len(_KEPT) > 32:
            _KEPT.popitem(last=False)
    else:
        _KEPT.move_to_end(key)
    return hit


@functools.cache  # asked at every decode call
def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def _code_offset(dtype: torch.dtype, bits: int) -> int:
    """The offset ``_codes_as`` builds codes with for dots in ``dtype``: 128 in bfloat16 (codes < 128, i.e. up to 7
    bits; 8-bit codes go through float32 and convert, exactly), 1024 in float16, 0 in float32."""
    if dtype == torch.bfloat16:
        return 128 if bits < 8 else 0
    return 1024 if dtype == torch.float16 else 0


# Classes by width (bits: P, the first whose d/P ≥ 16): words of 8 codes at 1 bit (a byte), 2 bits (16 bits; a byte of
# 4 in 4 classes where the rows sit at odd offsets) and 3 bits (three bytes), of 4 codes at 4 bits (16 bits); below
# head_dim 128 words of 8 codes go to 4 classes, two codes each (code_words). 8-bit codes are bytes already (the
# tiles read them as such).
_CLASSES = {1: (8, 4), 2: (8, 4), 3: (8, 4), 4: (4,)}


@functools.cache
def _classes(bits: int, d: int, G: int, dtype: torch.dtype) -> int:
    if G != d or bits not in _CLASSES or dtype not in (torch.float16, torch.bfloat16):
        return 0
    return next((P for P in _CLASSES[bits] if d // P >= 16), 0)


def code_classes(fmt: TokenFormat | TileFormat, dtype: torch.dtype, codes: torch.Tensor | None = None) -> int:
    """P, the classes decode splits one side's code words into (:func:`_class_codes`), or 0 where it unpacks to a
    (BN, d) tile instead: one group per token, 1 to 4 bits, float16/bfloat16 dots (codes built on the bits as
    ``c + 128``/``c + 1024``), d/P ≥ 16 (a tensor-core dot needs K ≥ 16): P 8 from head_dim 128, else P 4 (from
    64), one code a word in each class or, below 128, two (:func:`code_words`). ``codes`` given: 16-bit words need
    code rows at even byte offsets (2-bit rows at odd ones are read in bytes of 4 codes, 4-bit ones in tiles), and a
    middle of no tokens
    keeps the tiles (a full-precision context keeps the tiles' launch parameters). KVarN key tiles
    (:class:`TileFormat`) take the same classes, their tile's scale folded into the query's."""
    P = _classes(fmt.bits, fmt.d, fmt.G, dtype)
    if not P or codes is None:
        return P
    if codes.numel() == 0:
        return 0
    if P * fmt.bits == 16 and not _aligned(codes, 2):
        return 4 if fmt.bits == 2 else 0  # 2-bit rows at odd offsets: bytes of 4 codes (d/4 ≥ 32 here)
    return P


def _aligned(codes: torch.Tensor, n: int) -> bool:
    """Every row of ``codes`` (…, nbytes) uint8 at an n-byte boundary."""
    return codes.data_ptr() % n == 0 and all(st % n == 0 for st in codes.stride()[:-1])


def code_words(fmt: TokenFormat | TileFormat, P: int, codes: torch.Tensor | None = None) -> int:
    """WC, the codes a word holds where decode reads a side's codes in P classes (:func:`code_classes`; 0 where P
    is): 8 at 1 bit (a byte) and 3 bits (three bytes), 4 at 4 bits (16 bits); at 2 bits 8 (16 bits) where the code
    rows sit at even byte offsets (assumed without ``codes``), else 4 (a byte). WC = 2P: two codes a word in each
    class (below head_dim 128)."""
    if not P:
        return 0
    if fmt.bits == 2:
        return 8 if codes is None or _aligned(codes, 2) else 4
    if fmt.bits == 1 and P == 8:
        return 16 if codes is None or _aligned(codes, 2) else 8
    return 4 if fmt.bits == 4 else 8


def _int32_words(side: Packed, P: int) -> bool:
    """3-bit codes read in classes from int32 loads (four 3-byte words from three): every code row at a 4-byte
    boundary (the transformers cache's rows are; a vLLM cell's fields may sit at any byte offset, whose rows are read
    a byte at a time)."""
    return P > 0 and side.fmt.bits == 3 and _aligned(side.codes, 4)


_RECORDING: list[list] = []


@contextlib.contextmanager
def recorded_launches():
    """Within the block no kernel runs: each launch the calls would make is appended to the list this yields as
    ``(name, grid, args, constexprs)`` (launch options ``num_warps``/``num_stages``/``maxnreg`` among the constexprs), and CPU
    tensors pass for a GPU's. What a compile-only study (``benchmarks/kernel_sass.py``) compiles for a device it does
    not have; the outputs of the calls are left unwritten."""
    _RECORDING.append([])
    try:
        yield _RECORDING[-1]
    finally:
        _RECORDING.pop()


_THROUGH: list = []


@contextlib.contextmanager
def launches_through(hook):
    """Within the block every kernel launch goes through ``hook(name, grid, args, constexprs, run)``, which may check
    or change them and runs the kernel with ``run(name, grid, args, constexprs)``, which returns what Triton's launch
    does (on a GPU the compiled kernel, with its registers, spills and shared memory; None under the interpreter).
    What a test that runs the kernels on stand-in tensors uses (``tests/vllm_fake_cuda_check.py``: tensors that say
    cuda:0 are checked, then run under the interpreter), ``benchmarks/gpu_decode.py`` to read what the device's
    compiler built, and ``benchmarks/compile_launches.py`` to record every launch of a test run. Blocks nest: the
    innermost hook sees a launch first, and its ``run`` is the next hook out's (the outermost's runs the kernel)."""
    _THROUGH.append(hook)
    try:
        yield
    finally:
        _THROUGH.pop()


def _run(name: str, grid, args, meta):
    _CALLS[name] += 1
    return _kernels()[name][grid](*args, **meta)


def _launch(name: str, grid, *args, **meta) -> None:
    if _RECORDING:
        _RECORDING[-1].append((name, grid, args, meta))
        return
    if _THROUGH:
        return _through(len(_THROUGH) - 1, name, grid, args, meta)
    _run(name, grid, args, meta)


def _through(depth: int, name: str, grid, args, meta):
    """The launch through hook ``depth`` of :func:`launches_through`'s, whose ``run`` is the next one out's."""
    if depth < 0:
        return _run(name, grid, args, meta)
    return _THROUGH[depth](name, grid, args, meta, functools.partial(_through, depth - 1))


# -- store ---------------------------------------------------------------------------------------------------------
def _store(x, slots, page, codes, scale, offset, fmt: TokenFormat, transform, strides, rows_per_program, feedback=None):
    """x (R, Hkv, d) rows, slots (R,) int64: codes/scale/offset at (slot // page, slot % page, head) through
    ``strides`` = ((block, token, head) of codes, of scale, of offset)."""
    R, H, d = x.shape
    if d != fmt.d:
        raise ValueError(f"x has head_dim {d}, the format {fmt.d}")
    if fmt.step_byte != (scale.dtype == torch.uint8):
        raise ValueError(f"a format with step_byte={fmt.step_byte} stores its steps as "
                         f"{'uint8 (one E5M3 byte each)' if fmt.step_byte else 'float16, bfloat16 or float32'}, got {scale.dtype}")
    if fmt.quest != (offset is None):
        raise ValueError("QuEST stores no offset (pass offset=None); the affine quantizer needs one")
    if codes.dtype != torch.uint8 or codes.shape[-1] != fmt.nbytes or codes.stride(-1) != 1:
        raise ValueError(f"codes must be uint8 with a contiguous last dim of {fmt.nbytes} bytes, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if transform is not None and tuple(transform.shape) != (H, d, d):
        raise ValueError(f"transform must be (Hkv, d, d) = {(H, d, d)}, got {tuple(transform.shape)}")
    if feedback is not None and tuple(feedback.shape) != (H, d, d):
        raise ValueError(f"feedback must be (Hkv, d, d) = {(H, d, d)}, got {tuple(feedback.shape)}")
    _check_device(x, codes)
    if R == 0:
        return
    t = transform if transform is not None else x  # a placeholder pointer when there is none
    f = to_device(feedback, x.device, torch.float32) if feedback is not None else x
    z = offset if offset is not None else scale
    (c0, c1, c2), (s0, s1, s2), (z0, z1, z2) = strides
    clipped = fmt.clipped if fmt.quest else fmt.kth >= 0
    # rows per program: a handful on the GPU (the affine percentile compares a row with itself, d² per row, the
    # transform multiplies d² per row, and error feedback updates d² per row: one row there; 8 rows of feedback at
    # head_dim 128 took ptxas 4 minutes to compile, one row 2 s), many under the interpreter, which runs programs one
    # by one (recorded launches stand for a GPU's, on CPU tensors)
    one_row = transform is not None or feedback is not None or (clipped and not fmt.quest)
    BR = rows_per_program or (64 if x.device.type == "cpu" and not _RECORDING else 1 if one_row else 8)
    if BR & (BR - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {BR}")
    # error feedback: each code's error feeds the next channel's value, so the float32 steps are those of
    # feedback_round one by one (no fused multiply-adds, which round once where it rounds twice)
    # one warp a row with feedback: the channel loop is a chain of d dependent steps, each reading one channel of the
    # row; in one warp that read is shuffles alone, in four it also goes through shared memory and two barriers
    fusion = {} if feedback is None else {"enable_fp_fusion": False, "num_warps": 1}
    _launch("store", (-(-R // BR), H), x, *x.stride(), t, *(transform.stride() if transform is not None else (0, 0, 0)),
            f, *(f.stride() if feedback is not None else (0, 0, 0)),
            slots, R, page, codes, c0, c1, c2, scale, s0, s1, s2, z, z0, z1, z2,
            float(fmt.coef), int(fmt.kth), float(math.sqrt(fmt.G)),
            D=d, G=fmt.G, BITS=fmt.bits, QUEST=fmt.quest, CLIPPED=clipped, HAS_T=transform is not None,
            HAS_Z=offset is not None, TC=min(d, 32), META_BF16=scale.dtype == torch.bfloat16, FEEDBACK=feedback is not None,
            BR=BR, STEP_BYTE=fmt.step_byte, STEP_ROUND=127 if fmt.step_byte and fmt.bits >= UNCLIPPED_FROM else 64, **fusion)


def store_paged(x, slot_mapping, codes, scale, offset, fmt: TokenFormat, transform=None, *,
                rows_per_program: int | None = None, feedback: torch.Tensor | None = None) -> None:
    """Quantize and write new tokens into vLLM-style paged blocks.

    Args:
        x: (T, Hkv, d) keys (after RoPE) or values, any float dtype.
        slot_mapping: (T,) integer, ``block · block_size + row``; ``slot < 0`` is skipped.
        codes: uint8 (num_blocks, block_size, Hkv, nb); scale (and offset, affine only; None for QuEST):
            (num_blocks, block_size, Hkv, ng) in the metadata dtype.
        transform: (Hkv, d, d) float or None: each head's rows are stored as ``T k`` (float32 in the kernel).
        rows_per_program: tokens per program, a power of two (default: 8 on a GPU, 1 for the transform, the
            affine percentile clip and error feedback, 64 under the interpreter); the stored bytes do not depend on it.
        feedback: (Hkv, d, d) unit upper-triangular or None: the codes are rounded with error feedback on the grid
            as stored (``+ldlq``; :func:`wushkv.quantizers.feedback.feedback_round`, channel by channel), the
            grid itself the quantizer's as without it.
    """
    if x.dim() != 3 or codes.dim() != 4:
        raise ValueError(f"x must be (T, Hkv, d) and codes (blocks, block_size, Hkv, bytes), got {tuple(x.shape)}, "
                         f"{tuple(codes.shape)}")
    strides = tuple((t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0) for t in (codes, scale, offset))
    slots = to_device(slot_mapping, x.device, torch.int64).contiguous()
    _store(x, slots, codes.shape[1], codes, scale, offset, fmt, transform, strides, rows_per_program, feedback)


def store_contiguous(x, codes, scale, offset, start, fmt: TokenFormat, transform=None, *,
                     rows_per_program: int | None = None, feedback: torch.Tensor | None = None) -> None:
    """Quantize and write new tokens of every sequence into the contiguous layout of the transformers cache.

    Args:
        x: (B, Hkv, T, d), tokens ``start[b] .. start[b] + T`` of each sequence.
        codes: uint8 (B, Hkv, cap, nb); scale/offset (B, Hkv, cap, ng) (offset None for QuEST).
        start: int or (B,) integer tensor: each sequence's first free token (overflow is checked where it is on
            the host).
        transform, rows_per_program, feedback: as :func:`store_paged`.
    """
    if x.dim() != 4 or codes.dim() != 4:
        raise ValueError(f"x must be (B, Hkv, T, d) and codes (B, Hkv, cap, bytes), got {tuple(x.shape)}, {tuple(codes.shape)}")
    B, H, T, d = x.shape
    cap = codes.shape[2]
    # checked where ``start`` is on the host (an int, the usual case): reading a GPU tensor would wait for the device
    if isinstance(start, bool) or not (isinstance(start, numbers.Integral) or torch.is_tensor(start)) or (
            torch.is_tensor(start) and (start.dtype == torch.bool or start.is_floating_point() or start.is_complex())):
        raise ValueError(f"start must be an integer or an integer tensor, got {start!r}")
    if isinstance(start, numbers.Integral):
        start = int(start)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if T and start + T > cap:
            raise ValueError(f"{T} tokens from {start} overflow the capacity {cap}")
        first = start
    else:
        start = torch.as_tensor(start, dtype=torch.int64)
        if start.device.type == "cpu" and start.numel() and int(start.min()) < 0:
            raise ValueError(f"start must be >= 0, got {start.tolist()}")
        if T and start.device.type == "cpu" and int((start + T).max()) > cap:
            raise ValueError(f"{T} tokens from {start.tolist()} overflow the capacity {cap}")
        first = to_device(start, x.device, torch.int64).expand(B)[:, None]
    slots = (torch.arange(B, device=x.device)[:, None] * cap + first + torch.arange(T, device=x.device)).flatten()
    rows = x.transpose(1, 2).reshape(B * T, H, d)
    strides = tuple((t.stride(0), t.stride(2), t.stride(1)) if t is not None else (0, 0, 0) for t in (codes, scale, offset))
    _store(rows, slots, cap, codes, scale, offset, fmt, transform, strides, rows_per_program, feedback)


def kvarn_key_tiles(x: torch.Tensor, bits: int, tile: int, clip: float = 0.0, feedback: torch.Tensor | None = None,
                    iters: int = 16) -> dict[str, torch.Tensor]:
    """Keys x (B, Hkv, T, d) (transformed; T a multiple of ``tile``) quantized in KVarN tiles, one program per
    (tile, head, sequence): the storage :class:`wushkv.codecs.KVarNCodec` (kind "key") encodes, codes uint8
    (B, Hkv, T, ⌈d·b/8⌉) packed per token, scale and zero float16 (B, Hkv, T/tile, d) per channel, s_fold float16
    (B, Hkv, T/tile, tile) per token. ``feedback`` (Hkv, d, d): the ``+ldlq`` rows in order. The same arithmetic as
    :func:`wushkv.quantizers.kvarn.kvarn_quantize` (its balance's ``iters`` rounds, ties and NaNs, its rounding),
    with float32 sums in another order: codes equal but where a value sits on a rounding boundary to that rounding, or
    where two rounds' imbalances tie (the scales then split e^±s between rows and columns, with the same product)."""
    return _kvarn_tiles(x, bits, tile, clip, feedback, iters, values=False)


def kvarn_value_tiles(x: torch.Tensor, bits: int, tile: int, clip: float = 0.0, iters: int = 16) -> dict[str, torch.Tensor]:
    """Values x (B, Hkv, T, d) quantized in KVarN tiles as :func:`kvarn_key_tiles` quantizes keys, by the same kernel
    on the transposed tile (rows are tokens): the storage :class:`wushkv.codecs.KVarNCodec` (kind "value") encodes,
    codes uint8 (B, Hkv, T, ⌈d·b/8⌉), scale and zero float16 (B, Hkv, T/tile, tile) per token, s_fold float16
    (B, Hkv, T/tile, d) per channel. No error feedback (KVarN's is along key channels)."""
    return _kvarn_tiles(x, bits, tile, clip, None, iters, values=True)


def _kvarn_tiles(x, bits: int, tile: int, clip: float, feedback, iters: int, values: bool) -> dict[str, torch.Tensor]:
    from .quantizers.quest import QUEST_ALPHA

    B, H, T, d = x.shape
    if T % tile:
        raise ValueError(f"{T} tokens are not whole tiles of {tile}")
    if d < 8 or d & (d - 1) or tile < 2 or tile & (tile - 1):
        raise ValueError(f"the KVarN tile kernel takes a power-of-two head_dim >= 8 and tile >= 2, got {d} and {tile}")
    if feedback is not None and tuple(feedback.shape) != (H, d, d):
        raise ValueError(f"feedback must be (Hkv, d, d) = {(H, d, d)}, got {tuple(feedback.shape)}")
    _check_device(x)
    n = T // tile
    rows, cols = (tile, d) if values else (d, tile)  # the tile matrix A (R × C): values X, keys Xᵀ
    codes = torch.empty(B, H, T, -(-d * bits // 8), dtype=torch.uint8, device=x.device)
    scale = torch.empty(B, H, n, rows, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    s_fold = torch.empty(B, H, n, cols, dtype=torch.float16, device=x.device)
    if B * H * n == 0:
        return {"codes": codes, "scale": scale, "zero": zero, "s_fold": s_fold}
    f = to_device(feedback, x.device, torch.float32) if feedback is not None else x
    # a (d, tile) float32 tile a program: warps enough to hold it in registers (16 at d 256)
    warps = max(4, min(16, d * tile // 2048))
    # where a thread's registers (65,536 a multiprocessor over the program's threads, at most 255) do not hold the
    # keys' tile and the balanced tile beside it (at d 256 × 128 tokens: 2 × 64 floats in 128 registers), the keys are
    # read again from memory (cached) at each of the balance's rounds instead of spilled: compiled for sm_90, 348 spilled
    # loads a round → 56 (benchmarks/kernel_sass.py --stores)
    reload = 2 * (d * tile // (32 * warps)) + 32 > min(255, 65536 // (32 * warps))
    _launch("kvarn_values" if values else "kvarn_keys", (n, H, B), x, *x.stride(), f,
            *(f.stride() if feedback is not None else (0, 0, 0)),
            codes, codes.stride(0), codes.stride(1), codes.stride(2), scale, zero, scale.stride(0), scale.stride(1),
            scale.stride(2), s_fold, s_fold.stride(0), s_fold.stride(1), s_fold.stride(2), float(clip * QUEST_ALPHA[bits]),
            D=d, G=tile, BITS=bits, ITERS=iters, CLIPPED=clip > 0, FEEDBACK=feedback is not None, num_warps=warps,
            RELOAD=reload, VALUES=values,
            enable_fp_fusion=False)  # (the float32 steps of the PyTorch reference one by one: no fused multiply-adds)
    return {"codes": codes, "scale": scale, "zero": zero, "s_fold": s_fold}


# -- decode --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyBias:
    """Keys stored centered on their rotating mean (``+rmean``): read from its codes, the middle's token i (at position
    ``first[b] + i`` of sequence b) stands for k̂ + T R_p μ, so its score gains q·T R_p μ = Σ_i A_i cos pθ_i +
    B_i sin pθ_i, a function of the position p (rotate-half RoPE, θ its frequencies).

    ``terms`` (B, Hq, d) float32: [A | B] of each query head (its scaling included); ``first`` (B,) integer on the
    host: the position of each sequence's middle token 0 (negative where a row's padding comes first); ``theta``
    (d/2,) the RoPE frequencies (:func:`rope_table` tables them)."""

    terms: torch.Tensor
    first: torch.Tensor
    theta: torch.Tensor


@dataclass(frozen=True)
class PoolWindows:
    """The full-precision windows read in place from a pool of pages of ``unit`` tokens (the vLLM plugin's copies,
    :class:`wushkv_vllm.paged.Windows`) instead of from (B, Hkv, n, d) parts, so that a step gathers no copy of them:
    :func:`decode`'s sink_k/sink_v and recent_k/recent_v are then pools (rows, unit, Hkv, d) (views of one pool may
    serve all four). Sequence b's sink token t is position t, in pool row ``rows[b, t // unit]``, slot t % unit; its
    recent token t is position p = n_s + n_m + t (``lengths``' sink and middle: the middle's token i is position n_s +
    i, as with ``absolute_pages``), in pool row ``rows[b, tail + p // unit − (n_s + n_m) // unit]``, slot p % unit.

    ``rows``: int32 (B, ·), on the host (uploaded once for a step's layers, :func:`kept_on`) or the query's device,
    every page a part reads held (the caller checks that its copies are written; a page no query reads, before a
    sliding window, may be −1); ``tail``: the column of ``rows`` where the tail's pages begin; ``unit``: tokens a
    page. The pools are on the query's device."""

    rows: torch.Tensor
    tail: int
    unit: int


_ROPE_TABLES: dict = {}
# id(theta) -> (a weak reference to it, its version, its float32 bytes): rope_table's key, asked twice a layer and step
# of the same few tensors (a layer's frequencies); read again where the tensor is another (an id reused after the
# first died) or was written in place since. (Not a WeakKeyDictionary: it compares keys with ==, elementwise.)
_THETA_BYTES: dict = {}


def _theta_bytes(theta: torch.Tensor) -> bytes:
    seen = _THETA_BYTES.get(id(theta))
    if seen is None or seen[0]() is not theta or seen[1] != theta._version:
        if len(_THETA_BYTES) > 256:  # (dead entries of discarded caches)
            _THETA_BYTES.clear()
        seen = _THETA_BYTES[id(theta)] = (weakref.ref(theta), theta._version, theta.detach().cpu().float().numpy().tobytes())
    return seen[2]


def rope_table(theta: torch.Tensor, n: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(≥ n, d) [cos pθ | sin pθ] in ``dtype`` for positions p < n: computed in float64 on the host, grown by
    doubling (a fresh table replaces a short one, whose memory the allocator hands only to work queued after the
    launches that read it), kept per frequencies, device and dtype."""
    key = (_theta_bytes(theta), str(device), dtype)
    tab = _ROPE_TABLES.get(key)
    if tab is None or tab.shape[0] < n:
        device = torch.device(device)
        m = max(n, 2 * (0 if tab is None else len(tab)), 1024)
        ang = torch.arange(m, dtype=torch.float64)[:, None] * theta.detach().cpu().float().double()
        tab = torch.cat([ang.cos(), ang.sin()], -1).to(dtype)
        _ROPE_TABLES[key] = tab = to_device(tab, device) if device.type == "cuda" else tab.to(device)
    return tab


@dataclass
class Packed:
    """One side of the packed middle: ``codes`` uint8, ``scale`` (and ``offset``, affine; None for QuEST) as laid out
    contiguously (B, Hkv, cap, ·) or paged (num_blocks, block_size, Hkv, ·), and its :class:`TokenFormat`.

    Key tiles (a :class:`TileFormat`): ``scale`` is each token's ``s_tok`` (·, 1) (KIVI's keys: a stride-0 view of
    1), and ``tile_scale``, ``tile_zero`` the tiles' per-channel scale and zero: contiguous (B, Hkv, tiles, d) each
    (float16, bfloat16 or float32, alike), or with the
    format's ``spread``, one (·, spread) float16 view of the halves spread over the tiles' tokens, laid out as the codes
    (``tile_zero`` unused).

    Value tiles (a :class:`TileFormat` on the values' side, KVarN's): ``scale`` and ``offset`` are each token's scale
    and zero (·, 1), ``tile_scale`` the tiles' channel scales s_chan (B, Hkv, tiles, d), or, paged with the format's
    ``spread`` (``values=True``), one (·, spread) float16 view of them spread over the tiles' tokens."""

    fmt: TokenFormat | TileFormat
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None
    tile_scale: torch.Tensor | None = None
    tile_zero: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters of the decode kernel: ``block_n`` tokens per tile (a power of two ≥ 16), ``num_warps`` and
    ``num_stages`` (Triton's; the interpreter ignores them), ``programs_per_sm``: the programs a streaming
    multiprocessor holds at once (8 one-warp programs of 255 registers on sm_90), whose slots the splits fill in
    whole waves (:func:`default_splits`, :func:`wave_splits`), and ``class_split``: read 1- to
    4-bit codes as words split into classes (:func:`code_classes`) where they allow it, else unpack them to
    (tokens, d) tiles (session 46's kernel); ``max_registers``: a cap on each thread's registers (Triton's
    ``maxnreg``, the PTX ``.maxnreg``; None: ptxas's choice); and ``fp_stages``: the software pipeline of the loop over
    the full-precision sink and recent tokens (None: ``num_stages``, the middle's); ``merge_always``: launch the
    merge kernel even where each sequence has one split, as before session 60 (by default that split's program
    writes the output itself: the same bits, one launch and the splits' state fewer); ``last_split_merges``: with
    several splits, the last program of each (sequence, KV head) pair to finish (counted with an atomic) merges the
    pair's splits and writes the output, and no merge kernel is launched (session 61; off by default until a GPU has
    checked its memory ordering and timed it; not with ``merge_always``, which asks for the merge launch). None of
    them changes what is computed beyond float32 summation order; :func:`decode_tuning` swaps them for a block of code.

    ``max_registers`` trades spills for resident warps: the classes kernel at K2V2 d 128 takes 255 registers, so an
    sm_90 multiprocessor holds 8 of its one-warp programs (2 warps per scheduler to hide each other's latency); at 168
    it holds 12, at 128 16, for a few spilled registers a tile (``benchmarks/kernel_sass.py --max-registers``).
    Which is faster only a GPU can say: ``benchmarks/gpu_decode.py``'s sweep times both. Shared memory bounds them
    too: 20 KB a one-warp program at d 128 holds a multiprocessor to 10 whatever their registers, and ``fp_stages``
    = 1 (the windows' loop unpipelined) takes it to 12 KB, room for 17; a cap pays only with it, which is how the
    sweep pairs them. Uncapped, registers bind first, and the defaults pipeline both loops as timed on the H200.

    ``block_n``/``num_warps`` None: by the path (:meth:`launch`). Unpacking to tiles, 64 tokens and 4 warps, the
    fastest of ``benchmarks/gpu_decode.py``'s sweep on an H200 (K2V2, 32k tokens, batch 16, 32 query / 8 KV heads
    of 128: 0.88 ms against 1.12 ms for 32/4/3/4). Codes in classes, 32 tokens and one warp: a class's value dot
    is (GQA rows, d/P), narrower than 4 warps' tensor-core tiles, which would each compute it again; chosen on the
    compiled code for sm_90 (fewest instructions per token without register spills, ``benchmarks/kernel_sass.py``),
    not yet timed on a GPU.

    ``page_tiles`` (paged middles, blocks a multiple of the tile of tokens): True, each tile of tokens is aligned to
    the block table's positions and its block read once, its rows' offsets 32-bit within the block (:meth:`one_page`);
    False, each token's block looked up (what the compiler makes of the same loads: sm_90, the plugin's launches,
    ``kernel_sass.py --paged``: `kvarn` at d 128 101.8 warp-instructions a token against 141.8, per-token codes
    33.7 against 27.7, key tiles 52.2 against 48.1); None: on only where the values are KVarN tiles at d ≥ 128."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    programs_per_sm: int = 8
    class_split: bool = True
    max_registers: int | None = None
    fp_stages: int | None = None
    merge_always: bool = False
    last_split_merges: bool = False
    page_tiles: bool | None = None

    def __post_init__(self):
        if self.block_n is not None and (not isinstance(self.block_n, int) or self.block_n < 16
                                         or self.block_n & (self.block_n - 1)):
            raise ValueError(f"block_n must be a power of two >= 16 (or None: by the path), got {self.block_n!r}")
        for name in ("num_warps", "num_stages", "programs_per_sm", "fp_stages"):
            v = getattr(self, name)
            optional = name in ("num_warps", "fp_stages")
            if not (v is None and optional) and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int{' (or None)' if optional else ''}, got {v!r}")
        for name in ("class_split", "merge_always", "last_split_merges"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.page_tiles is None or isinstance(self.page_tiles, bool)):
            raise ValueError(f"page_tiles must be True, False or None (by the path), got {self.page_tiles!r}")
        if self.merge_always and self.last_split_merges:
            raise ValueError("merge_always=True (launch the merge kernel) and last_split_merges=True (merge in the decode "
                             "kernel, no merge launch) contradict each other: set at most one")
        if self.max_registers is not None and (not isinstance(self.max_registers, int) or isinstance(self.max_registers, bool)
                                               or not 24 <= self.max_registers <= 255):
            raise ValueError(f"max_registers must be an int in [24, 255] (registers a thread; None: the compiler's "
                             f"choice), got {self.max_registers!r}")

    def launch(self, dtype: torch.dtype, mid_k: Packed, mid_v: Packed) -> tuple[int, int, int, int]:
        """(K_P, V_P, block_n, num_warps) of a decode over this middle with ``dtype`` queries: each side's classes
        (:func:`code_classes`, 0 with ``class_split`` off) and the tile and warps in effect for that path."""
        k_p, v_p = (code_classes(side.fmt, dtype, side.codes) if self.class_split else 0 for side in (mid_k, mid_v))
        v_p = 0 if isinstance(mid_v.fmt, TileFormat) else v_p  # value tiles: unpacked to (tokens, d) codes (one dot)
        auto = (32, 1) if k_p or v_p else (64, 4)
        if k_p and isinstance(mid_v.fmt, TileFormat) and mid_v.fmt.d >= 128:
            # key classes beside value tiles' unpacked (32, 128) codes: one warp spilled ~70 registers a tile of
            # tokens, two spill none (benchmarks/kernel_sass.py --key-tiles 128 --value-tiles 128; not yet timed)
            auto = (32, 2)
        return k_p, v_p, self.block_n or auto[0], self.num_warps or auto[1]

    def one_page(self, page: int, block_n: int, mid_v: Packed) -> bool:
        """Whether a paged decode of ``page``-token blocks reads each tile of ``block_n`` tokens from one block (its
        block looked up once, the tile aligned to it: possible where ``block_n`` divides ``page``) rather than
        looking each token's block up. ``page_tiles`` None: where the values are KVarN tiles at head_dim ≥ 128."""
        if page % block_n:
            return False
        if self.page_tiles is not None:
            return self.page_tiles
        return isinstance(mid_v.fmt, TileFormat) and mid_v.fmt.d >= 128


_TUNING: list[DecodeTuning] = [DecodeTuning()]


def current_tuning() -> DecodeTuning:
    """The decode kernel's launch parameters in effect (:func:`decode_tuning` changes them)."""
    return _TUNING[-1]


@contextlib.contextmanager
def decode_tuning(**changes):
    """Within the block, :func:`decode` launches with ``changes`` (fields of :class:`DecodeTuning`) over the current
    ones: how a benchmark sweeps them through the whole cache, with no monkeypatching."""
    _TUNING.append(dataclasses.replace(current_tuning(), **changes))
    try:
        yield _TUNING[-1]
    finally:
        _TUNING.pop()


def default_splits(batch: int, kv_heads: int, longest: int, block_n: int, device, programs_per_sm: int | None = None) -> int:
    """Splits of each sequence: on a GPU, :func:`wave_splits` of its (sequence, KV head) pairs over the device's
    slots, ``programs_per_sm`` (default: the current :class:`DecodeTuning`'s) programs on each streaming
    multiprocessor, never more than there are tiles; under the interpreter one."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    slots = _multiprocessors(device.index or 0) * (programs_per_sm or current_tuning().programs_per_sm)
    return wave_splits(batch * kv_heads, slots, -(-max(longest, 1) // block_n))


@functools.lru_cache(maxsize=4096)  # asked at every layer's decode; its arguments change every block_n tokens at most
def wave_splits(pairs: int, slots: int, tiles: int, most: int = 256) -> int:
    """Splits s of each of ``pairs`` (sequence, KV head) pairs' ``tiles`` tiles over ``slots`` programs that run at
    once. Programs of like work run in waves, and the last wave, however empty, takes about as long as a full one;
    so the cost of s is its waves times a program's work, ⌈pairs·s / slots⌉ · (⌈tiles / s⌉ + 1), the 1 standing for
    what a program does besides its tiles (its query, its share of the merge). The fewest splits within 2% of the
    least cost win, among 1 ≤ s ≤ min(tiles, most) making at most two waves (or, where the pairs alone fill more,
    twice their programs): past that the model gains a few percent where what it leaves out (the merge's state,
    how many programs a multiprocessor really holds) grows.

    At 16 sequences of 8 KV heads and 1,024 tiles over 132 multiprocessors of 8 programs (1,056 slots): 8 splits,
    one wave of 1,024 programs of 128 tiles, where the rounded-up share ⌈1056 / 128⌉ = 9 made 1,152 programs of 114,
    a full wave and then 96 programs in a second (cost 230 against 129). Within one wave it is the fewest splits
    with the fewest tiles a program: 32 tiles of 8 pairs, 32 splits of one tile each. FlashAttention's
    ``num_splits_heuristic`` weighs the waves' efficiency too, with looser bounds (85%, and no splits where the
    pairs fill 80% of the device)."""
    pairs, slots = max(1, pairs), max(1, slots)
    top = max(1, min(tiles, most, max(2 * slots // pairs, 2)))
    cost = [-(-pairs * s // slots) * (-(-max(1, tiles) // s) + 1) for s in range(1, top + 1)]
    least = min(cost)
    return next(s for s, c in enumerate(cost, 1) if c <= 1.02 * least)


# sm_90's multiprocessor (CUDA C++ Programming Guide, compute capability 9.0): what bounds its resident warps. Its
# registers are four sub-partitions' (one per scheduler), and a warp's live in one (CUDA's cuda_occupancy.h). What
# DecodeTuning.programs_per_sm stands for: 8 of the default one-warp decode programs (benchmarks/kernel_sass.py)
SM90 = dict(registers=65536, partitions=4, warps=64, blocks=32, shared=233472, shared_reserved=1024,
            shared_unit=128, register_unit=256)


def resident_warps(registers: int, shared: int, num_warps: int, sm: dict = SM90) -> int:
    """Warps of a kernel resident at once on one multiprocessor: its blocks (programs) of ``num_warps`` warps, each
    thread holding ``registers`` (allocated per warp in units of ``register_unit``, a warp's in one of the
    ``partitions``) and each block ``shared`` bytes of shared memory (plus the system's reserve, in units of
    ``shared_unit``). At one warp a program: 8 at 255 registers (and at 180: the 16,384 of a partition hold two
    warps of 5,888), 12 at 168, 16 at 128."""
    per_warp = -(-registers * 32 // sm["register_unit"]) * sm["register_unit"]
    by_registers = (sm["registers"] // sm["partitions"] // per_warp) * sm["partitions"]
    unit = sm["shared_unit"]
    per_block = -(-(shared + sm["shared_reserved"]) // unit) * unit
    blocks = min(sm["blocks"], sm["warps"] // num_warps, by_registers // num_warps, sm["shared"] // per_block)
    return blocks * num_warps


@functools.cache
def _multiprocessors(index: int) -> int:
    """The streaming multiprocessors of CUDA device ``index`` (asked at every decode call: kept)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # device -> int32 split counters of LAST_MERGES, all 0 between calls
_OUTGROWN: list[torch.Tensor] = []  # counter buffers replaced by larger ones, kept alive (see _split_counters)


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters on ``device``, all 0: the splits of each (sequence, KV head) pair done so far,
    which decode_kernel's LAST_MERGES counts up and the merging program sets back to 0. One buffer a device, zeroed
    once when made (no memset launch a call), grown when a call needs more.

    Shared by every call on the device, so calls must run one after another, as on one CUDA stream (a model's decode
    steps): two decodes on different streams at once would count each other's programs, and a pair could merge
    before its splits are written. A call that fails before its kernel runs leaves the counts at 0; one that fails
    while it runs has them zeroed again by :func:`decode` (a kernel that faults on a GPU leaves the CUDA context
    unusable anyway). A buffer grown out of is kept, not freed: a CUDA graph captured before holds its address."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096, 2 * (buf.numel() if buf is not None else 0)),
                                              dtype=torch.int32, device=device)
    return buf


def _longest(lengths, sink_k, mid_k: Packed, recent_k, block_table, pool_windows: PoolWindows | None = None) -> int:
    """The longest sequence's columns for :func:`default_splits`, which only caps the splits by it. Read from
    ``lengths`` where it is on the host; on a GPU reading it would make the host wait for the device at every layer
    and step (the launch queue drained, each launch's latency exposed), so there the parts' capacities bound it."""
    if lengths.device.type == "cpu":
        return max(map(sum, lengths.tolist()), default=0)  # a few small rows: cheaper on the host than torch ops
    mid = block_table.shape[1] * mid_k.codes.shape[1] if block_table is not None else mid_k.codes.shape[2]
    if pool_windows is not None:  # the windows' pages
        return mid + pool_windows.rows.shape[1] * pool_windows.unit
    return sink_k.shape[2] + mid + recent_k.shape[2]


def _check_pool_windows(pw: PoolWindows, B: int, lengths, query, *parts, starts=None) -> None:
    """:func:`decode`'s ``pool_windows``: four pools (rows, unit, Hkv, d) alike on the query's device, int32 rows
    (B, ·), no ``starts``; where ``lengths`` is on the host (reading it on a GPU would make the host wait), a table
    wide enough for every sequence's sink pages before its ``tail`` column and its tail's pages after it."""
    shapes = [tuple(t.shape) for t in parts]
    if (starts is not None or pw.unit < 1 or pw.rows.dim() != 2 or pw.rows.shape[0] != B or pw.rows.dtype != torch.int32
            or not 0 <= pw.tail <= pw.rows.shape[1] or any(len(sh) != 4 or sh[1] != pw.unit or sh[1:] != shapes[0][1:]
                                                            for sh in shapes)):
        raise ValueError(f"pool_windows need pools (rows, {pw.unit}, Hkv, d) alike for the four window parts and int32 "
                         f"rows (B, ·) = ({B}, ·) with the tail's from column {pw.tail}, and no starts; got rows "
                         f"{tuple(pw.rows.shape)} {pw.rows.dtype}, parts {shapes}")
    if any(t.device != query.device for t in parts):
        raise ValueError(f"pool_windows' pools must be on the query's device {query.device}, got "
                         f"{sorted({str(t.device) for t in parts})}")
    global _POOL_CHECKED
    if lengths.device.type == "cpu" and not (_POOL_CHECKED[0] is lengths and _POOL_CHECKED[1] is pw
                                             and _POOL_CHECKED[2] == _version(lengths)):
        u = pw.unit
        for b, (n_s, n_m, n_r) in enumerate(lengths.tolist()):
            w0 = n_s + n_m
            if -(-n_s // u) > pw.tail or (n_r and pw.tail + -(-(w0 + n_r) // u) - w0 // u > pw.rows.shape[1]):
                raise ValueError(f"pool_windows' rows {tuple(pw.rows.shape)} (tail from column {pw.tail}, {u} tokens a "
                                 f"page) do not cover sequence {b}'s sink of {n_s} and tail of {n_r} from position {w0}")
        # the layers of a step pass the same two (the plugin's plan): checked once a step (held: no id reused; the
        # version counts writes into lengths)
        _POOL_CHECKED = (lengths, pw, _version(lengths))


_POOL_CHECKED: tuple = (None, None, -1)  # the last lengths and PoolWindows _check_pool_windows read, lengths' version


def _version(t: torch.Tensor) -> int:
    """How many writes ``t`` has seen (``_version``); -2 for an inference tensor, which counts none (vLLM runs its
    forward under ``torch.inference_mode``, where the plugin makes its lengths: a memo keyed on them is by identity)."""
    return -2 if t.is_inference() else t._version


def _check_tile_sinks(lengths: torch.Tensor, tile: int) -> None:
    """Paged tiles of ``tile`` tokens in absolute pages whose place in the blocks matters (:func:`decode`): a tile lies
    in one block only if the middle starts on a tile's boundary, so every sequence with a middle has a sink of whole
    tiles (host ``lengths`` (B, 3); checked once for the layers of a step, which pass the same tensor)."""
    global _TILES_CHECKED
    if _TILES_CHECKED[0] is lengths and _TILES_CHECKED[1:] == (_version(lengths), tile):
        return
    off = ((lengths[:, 1] > 0) & (lengths[:, 0] % tile != 0)).nonzero().flatten().tolist()
    if off:
        raise ValueError(f"paged tiles in absolute pages need the middle to start on a boundary of {tile} tokens: "
                         f"sequence {off[0]}'s sink of {int(lengths[off[0], 0])} tokens is not a multiple of it")
    _TILES_CHECKED = (lengths, _version(lengths), tile)


_TILES_CHECKED: tuple = (None, -1, 0)  # the last lengths _check_tile_sinks passed, their version, the tile


def _check_starts(starts, lengths, allowed, sink_k, mid_k: Packed, recent_k, block_table) -> None:
    """:func:`decode`'s ``starts``: (B, 3), contiguous parts, a mask over the parts side by side; each row's columns
    inside its parts where both are on the host (on a GPU, reading them would make the host wait)."""
    B = lengths.shape[0]
    if block_table is not None:
        raise ValueError("starts describe rows of contiguous parts; a paged middle (block_table) starts at its table")
    if tuple(starts.shape) != (B, 3):
        raise ValueError(f"starts must be (B, 3) = ({B}, 3) like lengths, got {tuple(starts.shape)}")
    widths = (sink_k.shape[2], mid_k.codes.shape[2], recent_k.shape[2])
    # the mask's middle columns: what the rows read of it where the host knows, else none (its sink and recent parts)
    middle = 0
    if starts.device.type == "cpu" and lengths.device.type == "cpu":
        ends = starts.long() + lengths.long()
        bad = (starts < 0).any(1) | (ends > torch.tensor(widths)).any(1)
        if bad.any():
            b = int(bad.nonzero()[0])
            raise ValueError(f"row {b} reads columns {starts[b].tolist()} + {lengths[b].tolist()} of parts {widths} wide")
        middle = int(ends[:, 1].max()) if B else 0
    if allowed is not None and allowed.reshape(B, -1).shape[1] < widths[0] + middle + widths[2]:
        raise ValueError(f"with starts, allowed covers the parts side by side: sink {widths[0]} + the middle's columns "
                         f"read ({middle}) + recent {widths[2]} at least, got {allowed.reshape(B, -1).shape[1]}")


def _key_bias_args(kb: KeyBias, B: int, Hq: int, d: int, mid_k: Packed, page: int, paged: bool, block_table,
                   block_n: int, device, host_ends: torch.Tensor | None):
    """The decode kernel's RMEAN arguments: terms (B, Hq, d) float32 on the device and their strides, the first
    positions (B,) int32 on the device, and a table of [cos pθ | sin pθ] holding every position a tile of tokens can
    start at (the middle's last column read past the largest first position: from ``host_ends``, the parts' end
    columns, where the host has them, else the middle's capacity) and the BN offsets after it."""
    if tuple(kb.terms.shape) != (B, Hq, d) or tuple(kb.theta.shape) != (d // 2,) or kb.first.numel() not in (1, B):
        raise ValueError(f"key_bias needs terms (B, Hq, d) = {(B, Hq, d)}, first (B,) and theta ({d // 2},); got "
                         f"{tuple(kb.terms.shape)}, {tuple(kb.first.shape)}, {tuple(kb.theta.shape)}")
    if kb.first.device.type != "cpu":
        raise ValueError("key_bias.first must be on the host: it sizes the table of angles")
    if d < 32:
        raise ValueError(f"key_bias needs head_dim >= 32 (two dots of K = head_dim/2 >= 16), got {d}")
    # (the host's small tensors read as lists: a torch operation on them costs more than the Python)
    if host_ends is not None:  # vLLM's block tables span max_model_len: the table need not
        cap = max((row[1] for row in host_ends.tolist()), default=0)
    else:
        cap = block_table.shape[1] * page if paged else mid_k.codes.shape[2]
    first = kb.first.reshape(-1)
    n = max(map(abs, first.tolist())) + cap + block_n + 1 if B else block_n
    terms = kb.terms.to(device=device, dtype=torch.float32)
    terms = terms if terms.stride(-1) == 1 else terms.contiguous()
    return terms, kept_on(first.expand(B), device, torch.int32), rope_table(kb.theta, n, device), terms.stride()[:2]


def decode(query, lengths, sink_k, sink_v, mid_k: Packed, mid_v: Packed, recent_k, recent_v, scaling: float, *,
           softcap: float | None = None, sinks=None, allowed=None, window: int | None = None,
           block_table=None, absolute_pages: bool = False, splits: int | None = None,
           block_n: int | None = None, key_bias: KeyBias | None = None, starts=None,
           pool_windows: PoolWindows | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over [sink; packed middle; recent], split-KV.

    Args:
        query: (B, Hq, d) (float16, bfloat16 or float32; the dots run in this dtype with float32 accumulation),
            already in the transformed key space. Hq = G·Hkv: query head ``h·G + i`` reads KV head ``h``.
        lengths: int (B, 3): the sink, middle and recent tokens of each sequence (ragged).
        sink_k, sink_v, recent_k, recent_v: (B, Hkv, ≥ length, d) full precision (any strides, last dim contiguous).
        mid_k, mid_v: the packed middle (:class:`Packed`), contiguous (B, Hkv, cap, ·), or paged with ``block_table``
            (B, max_blocks) int32 giving each sequence's blocks in order: of the middle alone, or, ``absolute_pages``,
            of all its positions (vLLM's cells hold every token, the windows' too: the middle's token i is read at
            position lengths[b, 0] + i; tiles spread over their cells then need a sink of whole tiles where the middle is
            not empty, and so, in tiles of tokens, does ``DecodeTuning.page_tiles`` beside key or value tiles).
        scaling: the softmax scale; ``softcap``: logit softcap (tanh) or None; ``sinks``: (Hq,) learned sink logits
            or None; ``allowed``: bool (B, S), which of each sequence's last S columns are visible (earlier ones are
            not) or None; ``window``: only each sequence's last ``window`` columns are visible (sliding window).
        splits: programs per (sequence, KV head) (default :func:`default_splits`); ``block_n``: tokens per tile
            (default: the current :class:`DecodeTuning`'s for the path, :meth:`DecodeTuning.launch`, which also gives
            the warps and pipeline stages).
        key_bias: the middle's keys stored centered on their rotating mean (:class:`KeyBias`), or None.
        starts: int (B, 3) or None: ragged rows in batched contiguous parts (the transformers cache's left-padded
            batches), sequence b's tokens of each part from its column ``starts[b, i]`` on (its ``lengths[b, i]``
            of them), so each row reads its own columns, not the widest row's. ``allowed`` then covers the parts'
            columns side by side, (B, sink_k's + the middle's + recent_k's columns): the sink's first, the recent
            part's last ``recent_k.shape[2]``; ``key_bias.first`` is the position of the middle's column 0.
        pool_windows: the sink and recent parts read in place from pools of pages (:class:`PoolWindows`; sink_k,
            sink_v, recent_k, recent_v are then (rows, unit, Hkv, d)), or None.

    Returns:
        (B, Hq, d) in the query's dtype.
    """
    B, Hq, d = query.shape
    pw = pool_windows
    if pw is not None:
        _check_pool_windows(pw, B, lengths, query, sink_k, sink_v, recent_k, recent_v, starts=starts)
    Hkv = sink_k.shape[2 if pw is not None else 1]
    if absolute_pages and block_table is None:
        raise ValueError("absolute_pages=True describes a block table: pass block_table")
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {Hkv}")
    G = Hq // Hkv
    if isinstance(mid_v.fmt, TileFormat) and (mid_v.offset is None or mid_v.tile_scale is None or mid_v.fmt.step_byte
                                              or (mid_v.fmt.spread and block_table is None)):
        raise ValueError("value tiles (KVarN's) need each token's scale and zero (Packed.scale, Packed.offset) and each "
                         "tile's channel scales (Packed.tile_scale: (B, Hkv, tiles, d) rows of their own, or, paged, "
                         "spread over the tiles' cells)")
    for side in (mid_k, mid_v):
        if side.fmt.d != d:
            raise ValueError(f"the packed middle has head_dim {side.fmt.d}, the query {d}")
        if side.fmt.step_byte != (side.scale.dtype == torch.uint8):
            raise ValueError(f"a format with step_byte={side.fmt.step_byte} needs {'uint8' if side.fmt.step_byte else 'float'} "
                             f"steps, got {side.scale.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}")
    _check_device(query, mid_k.codes)
    if starts is not None:
        _check_starts(starts, lengths, allowed, sink_k, mid_k, recent_k, block_table)
    longest = _longest(lengths, sink_k, mid_k, recent_k, block_table, pw) if splits is None else 0
    host_ends = lengths if lengths.device.type == "cpu" else None  # each part's end column, where the host has it
    if host_ends is not None and starts is not None:
        host_ends = host_ends + starts if starts.device.type == "cpu" else None
    lengths = kept_on(lengths, query.device, torch.int32)
    tuning = current_tuning()
    k_p, v_p, tile_n, num_warps = tuning.launch(query.dtype, mid_k, mid_v)
    for side in (mid_k, mid_v):
        if isinstance(side.fmt, TileFormat) and side.fmt.tile >= 16:
            tile_n = min(tile_n, side.fmt.tile)  # tiles of tokens aligned to it then lie in one key (value) tile
    block_n = block_n or tile_n
    if splits is None:
        visible = min([longest] + ([window] if window else []) + ([allowed.shape[-1]] if allowed is not None else []))
        splits = default_splits(B, Hkv, visible, block_n, query.device)  # the kernel splits the visible columns
    paged = block_table is not None
    emulate = query.device.type == "cpu" and not _RECORDING  # the interpreter: bfloat16 dots emulated (see _mma)
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise ValueError(f"sinks must be (Hq,) = ({Hq},), got {tuple(sinks.shape)}")
    query = query.contiguous() if query.stride(-1) != 1 else query
    if pw is not None:  # the kernel's (row, head, token) strides of a part are the pool's (row, head, slot)
        sink_k, sink_v, recent_k, recent_v = (t.transpose(1, 2) for t in (sink_k, sink_v, recent_k, recent_v))
    for t in (sink_k, sink_v, recent_k, recent_v):
        if t.stride(-1) != 1:
            raise ValueError("full-precision parts need a contiguous last dim")

    def strides(t):  # (block or sequence, token, head)
        if t is None:
            return (0, 0, 0)
        st = t.stride()
        return st[:3] if paged else (st[0], st[2], st[1])

    out = torch.empty(B, Hq, d, dtype=query.dtype, device=query.device)
    final = splits == 1 and not tuning.merge_always  # the decode kernel writes the output: no merge launched
    last_merges = splits > 1 and tuning.last_split_merges  # each pair's last program merges: no merge launched
    counters = _split_counters(query.device, B * Hkv) if last_merges else lengths  # (lengths: never read)
    if final:
        o = m = l = out  # never read
    else:
        # the splits' state in one allocation (the host's time per call counts where a step is short): o (B, Hq,
        # splits, d), then m and l (B, Hq, splits), float32, each at a 16-byte boundary (the launcher specializes on
        # alignment)
        n, n4 = B * Hq * splits, -(-B * Hq * splits // 4) * 4
        state = torch.empty(n * d + 2 * n4, dtype=torch.float32, device=query.device)
        o = state[: n * d].view(B, Hq, splits, d)
        m, l = (state[n * d + i * n4: n * d + i * n4 + n].view(B, Hq, splits) for i in (0, 1))
    if allowed is not None:
        mask = allowed.reshape(B, -1).to(torch.uint8).contiguous()
        S = mask.shape[1]
    else:
        mask, S = lengths, 0
    bt = to_device(block_table, query.device, torch.int32) if paged else lengths
    page = mid_k.codes.shape[1] if paged else 1
    if paged and mid_v.codes.shape[1] != page:
        raise ValueError("keys and values must use the same block size")
    kz = mid_k.offset if mid_k.offset is not None else mid_k.scale
    vz = mid_v.offset if mid_v.offset is not None else mid_v.scale
    kts, ktz, kt_strides, kt_zi, kt_tile, kt_mw = mid_k.scale, mid_k.scale, (0, 0, 0), 0, 0, d
    if isinstance(mid_k.fmt, TileFormat):
        kt_tile, spread = mid_k.fmt.tile, mid_k.fmt.spread
        kts = mid_k.tile_scale
        ktz = kts if spread else mid_k.tile_zero
        if kts is None or ktz is None:
            raise ValueError("key tiles need their scale (and, not spread, their zero): Packed.tile_scale/tile_zero")
        # (spread, they are float16 halves of the cells' rows; else each row is loaded in its own dtype: KIVI's keys
        # keep the cache's metadata dtype)
        allowed_dt = (torch.float16,) if spread else (torch.float16, torch.bfloat16, torch.float32)
        if kts.dtype not in allowed_dt or ktz.dtype != kts.dtype or kts.stride(-1) != 1 or ktz.stride(-1) != 1:
            raise ValueError(f"key tiles' scale and zero must be {' or '.join(map(str, allowed_dt))} alike with a "
                             f"contiguous last dim, got {kts.dtype}, {ktz.dtype}")
        if not spread and kts.stride() != ktz.stride():
            raise ValueError("key tiles' scale and zero must be laid out alike")
        if paged and page % kt_tile:
            raise ValueError(f"paged key tiles lie within a block: block size {page} is not a multiple of the tile {kt_tile}")
        kt_strides, kt_zi, kt_mw = strides(kts), d if spread else 0, spread or d
    vts, vt_strides, vt_tile, vt_mw = mid_v.scale, (0, 0, 0), 0, d  # (placeholders, never read without value tiles)
    if isinstance(mid_v.fmt, TileFormat):
        vt_tile, vts, vt_spread = mid_v.fmt.tile, mid_v.tile_scale, mid_v.fmt.spread
        if vt_spread:  # paged: the d channel scales (float16) spread over the tile's cells, as key tiles' scale and zero
            if vts.dtype != torch.float16 or vts.stride(-1) != 1 or vts.shape[-1] < vt_spread:
                raise ValueError(f"spread value tiles' channel scales must be float16 with a contiguous last dim of "
                                 f"at least {vt_spread} halves, got {vts.dtype} {tuple(vts.shape)}")
        elif (vts.dim() != 4 or tuple(vts.shape[:2]) != tuple(mid_v.codes.shape[:2]) or vts.shape[3] != d
                or vts.shape[2] * vt_tile < mid_v.codes.shape[2] or vts.stride(-1) != 1
                or vts.dtype not in (torch.float16, torch.bfloat16, torch.float32)):
            raise ValueError(f"value tiles' channel scales must be (B, Hkv, tiles, {d}) covering the middle's "
                             f"{mid_v.codes.shape[2]} tokens in tiles of {vt_tile}, float16/bfloat16/float32 with a "
                             f"contiguous last dim; got {tuple(vts.shape)} {vts.dtype}")
        if paged and page % vt_tile:
            raise ValueError(f"paged value tiles lie within a block: block size {page} is not a multiple of the tile {vt_tile}")
        vt_strides, vt_mw = strides(vts), vt_spread or d
    # a tile of tokens' block read once (DecodeTuning.page_tiles) where its tokens' rows lie within 2³¹ elements of
    # the block's start (the offsets are 32-bit)
    one_page = (paged and tuning.one_page(page, block_n, mid_v)
                and page * max(abs(st[1]) for st in (strides(mid_k.codes), strides(mid_k.scale), strides(mid_v.codes),
                                                    strides(mid_v.scale))) < 2**31)
    if paged and absolute_pages and host_ends is not None:
        # where the middle starts in the blocks matters to: tiles whose halves are spread over their tokens' cells
        # (a tile in one block), and tiles of tokens aligned to key or value tiles read from one block each
        need = math.lcm(*(side.fmt.tile for side in (mid_k, mid_v) if isinstance(side.fmt, TileFormat) and side.fmt.spread))
        if one_page and any(t and block_n <= t for t in (kt_tile, vt_tile)):
            need = math.lcm(need, block_n)
        if need > 1:
            _check_tile_sinks(host_ends, need)
    rb, rb_s, rp, rt, rr = query, (0, 0), lengths, query, query  # placeholders, never read without RMEAN
    if key_bias is not None:
        rb, rp, rt, rb_s = _key_bias_args(key_bias, B, Hq, d, mid_k, page, paged, block_table, block_n, query.device,
                                          host_ends)
        rr = rope_table(key_bias.theta, block_n, query.device, query.dtype)
    if B and Hq:
        st = lengths if starts is None else kept_on(starts, query.device, torch.int32)
        wt = kept_on(pw.rows, query.device, torch.int32) if pw is not None else None
        try:
            _launch("decode", (B, Hkv, splits), query, *query.stride()[:2], lengths,
                    st, sink_k.shape[2], S - recent_k.shape[2],
                    sink_k, sink_v, *sink_k.stride()[:3], *sink_v.stride()[:3],
                    recent_k, recent_v, *recent_k.stride()[:3], *recent_v.stride()[:3],
                    *((wt, wt.stride(0), pw.tail) if pw is not None else (lengths, 0, 0)),
                    mid_k.codes, mid_k.scale, kz, mid_v.codes, mid_v.scale, vz,
                    *strides(mid_k.codes), *strides(mid_k.scale), *strides(mid_v.codes), *strides(mid_v.scale),
                    kts, ktz, *kt_strides, kt_zi, vts, *vt_strides, rb, *rb_s, rp, rt, rr,
                    bt, bt.stride(0), page, mask, mask.stride(0), S, int(window or 0),
                    o, m, l, sinks if sinks is not None else out, out, out.stride(0), out.stride(1), counters,
                    float(scaling), float(softcap or 1.0), mid_k.fmt.half, mid_v.fmt.half, splits,
                    D=d, GQA=G, GP=max(16, _next_pow2(G)), BN=block_n, K_BITS=mid_k.fmt.bits, V_BITS=mid_v.fmt.bits,
                    K_G=mid_k.fmt.G, V_G=mid_v.fmt.G, K_Z=mid_k.offset is not None, V_Z=mid_v.offset is not None,
                    K_E5M3=mid_k.fmt.step_byte, V_E5M3=mid_v.fmt.step_byte,
                    K_OFF=_code_offset(query.dtype, mid_k.fmt.bits), V_OFF=_code_offset(query.dtype, mid_v.fmt.bits),
                    K_P=k_p, V_P=v_p, K_WC=code_words(mid_k.fmt, k_p, mid_k.codes), V_WC=code_words(mid_v.fmt, v_p, mid_v.codes),
                    K_W4=_int32_words(mid_k, k_p), V_W4=_int32_words(mid_v, v_p),
                    K_TILE=kt_tile, KT_MW=kt_mw, V_TILE=vt_tile, VT_MW=vt_mw, RMEAN=key_bias is not None,
                    PAGED=paged, PAGE_ABS=paged and absolute_pages, STARTS=starts is not None, HAS_MASK=allowed is not None, SOFTCAP=softcap is not None,
                    PREC="ieee" if query.dtype == torch.float32 else "tf32", DT=_tl_dtype(query.dtype), EMU=emulate,
                    FP_STAGES=tuning.fp_stages or tuning.num_stages, FINAL=final,
                    HAS_SINKS=(final or last_merges) and sinks is not None, LAST_MERGES=last_merges,
                    FP_UNIT=pw.unit if pw is not None else 0, ONE_PAGE=one_page,
                    OUT_BF16=query.dtype == torch.bfloat16, num_warps=num_warps, num_stages=tuning.num_stages,
                    **({"maxnreg": tuning.max_registers} if tuning.max_registers is not None else {}))
        except BaseException:
            if last_merges:  # programs that ran before the failure left their counts (the interpreter's, a hook's)
                counters.zero_()
            raise
    if B and Hq and not final and not last_merges:
        _launch("merge", (B, Hq), o, m, l, sinks if sinks is not None else m, out, out.stride(0), out.stride(1), splits, Hq,
                D=d, SP=_next_pow2(splits), HAS_SINKS=sinks is not None, OUT_BF16=query.dtype == torch.bfloat16)
    return out


__all__ = ["DecodeTuning", "KeyBias", "Packed", "PoolWindows", "TileFormat", "TokenFormat", "available", "calls", "code_classes", "code_words",
           "current_tuning", "decode", "decode_tuning", "default_splits", "resident_warps", "wave_splits", "interpreting", "launches_through", "to_device", "recorded_launches", "reset_calls", "rope_table",
           "store_contiguous", "store_paged", "kvarn_key_tiles", "kvarn_value_tiles"]
