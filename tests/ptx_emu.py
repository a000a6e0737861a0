"""A warp of a straight-line PTX kernel, run on the CPU: what checks the decode kernel's inline PTX without a GPU.

The decode kernel builds its tensor-core operands from packed code words with inline PTX (``shr``, ``prmt``,
``lop3``: ``wushkv.triton_kernels._word_codes``), which Triton's interpreter never runs: it takes a plain-Triton branch
that builds the same bits. ``tests/test_triton_kernels.py`` compiles the kernel that does only that
(``word_codes_kernel``) for sm_90 and runs its PTX here, lane by lane, against the interpreter's branch.

Only the instructions those probes compile to are modelled, after the PTX ISA; anything else raises
``NotImplementedError``, so a compiler that emits something new fails loudly rather than being misread:

* ``shr.b32`` (a bit-size type: a logical shift), ``shl``/``and``/``or``/``xor.b32``, ``bfe.u32 d, a, pos, len``;
* ``prmt.b32 d, a, b, c`` (default mode): the bytes {b, a} are b7..b4 a3..a0, byte i of d is the byte nibble i of c
  selects (its low 3 bits), or that byte's sign replicated where the nibble's bit 3 is set;
* ``lop3.b32 d, a, b, c, LUT``: bit = (LUT >> (4a + 2b + c)) & 1 (PTX's ta = 0xF0, tb = 0xCC, tc = 0xAA);
* ``shfl.sync.idx.b32`` over the full warp, ``selp``, ``setp.eq/ne``, ``mov`` (``%tid.x``; ``%ctaid`` is 0: the
  grid's first program), ``cvt.u64.u32``/``cvt.s64.s32``, ``mul.wide``/``mad.wide`` (``.u32``, ``.s32``), ``add``,
  ``shl``/``or.b64``, ``ld.param.b64``, and ``ld``/``st.global[.vN].bW`` (little-endian).

Each of T trials is one launch of one warp over its own row of every buffer: registers are (T, 32) uint64 arrays.
"""

from __future__ import annotations

import re

import numpy as np

M32 = np.uint64(0xFFFFFFFF)


def lop3(a, b, c, lut: int):
    out = np.zeros_like(a)
    for bit in range(32):
        sh = np.uint64(bit)
        one = np.uint64(1)
        idx = (((a >> sh) & one) << np.uint64(2)) | (((b >> sh) & one) << one) | ((c >> sh) & one)
        out |= ((np.uint64(lut) >> idx) & np.uint64(1)) << sh
    return out


def prmt(a, b, c):
    x = (a & M32) | ((b & M32) << np.uint64(32))
    out = np.zeros_like(a)
    for i in range(4):
        n = (c >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (x >> ((n & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        sign = np.where((byte >> np.uint64(7)) & np.uint64(1) == 1, np.uint64(0xFF), np.uint64(0))
        out |= np.where(n & np.uint64(8) != 0, sign, byte) << np.uint64(8 * i)
    return out


def _signed(x):
    """The low 32 bits of ``x`` as a signed int64."""
    return ((x & M32).astype(np.int64) ^ 0x80000000) - 0x80000000


class Warp:
    """One warp of the first ``.entry`` of ``ptx``, for T trials at once. ``params``: the kernel's pointer parameters
    (byte addresses, in order); ``mem``: {base address: (T, nbytes) uint8}, row t the buffer of trial t."""

    def __init__(self, ptx: str, params: list[int], mem: dict[int, np.ndarray]):
        body = ptx[ptx.index(".entry"):]
        self.body = body[body.index("{"):]
        self.params, self.mem = params, mem
        self.T = next(iter(mem.values())).shape[0]
        self.regs: dict[str, np.ndarray] = {}
        self.lane = np.broadcast_to(np.arange(32, dtype=np.uint64), (self.T, 32)).copy()

    def statements(self) -> list[str]:
        out = []
        for line in self.body.splitlines():
            line = line.split("//")[0].strip()
            if line.startswith(".section"):
                break
            if not line or line == "{" or (line.startswith((".reg", ".loc", ".file", "$L", "}"))):
                continue
            if line.startswith("{"):  # an inline-asm block: {.reg .b32 t, u; a; b; ...}
                line = line.strip("{}")
            out += [s.strip() for s in line.split(";") if s.strip() and not s.strip().startswith(".reg")]
        return out

    def run(self) -> set[str]:
        """Executes the kernel; returns the opcodes it ran."""
        ops = set()
        for s in self.statements():
            self.step(s)
            ops.add(s.split()[0])
        return ops

    def val(self, tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok.startswith("%tid.x"):
            return self.lane
        if tok.startswith("%ctaid."):  # program 0 of its grid
            return np.zeros_like(self.lane)
        if tok.startswith("%") or re.match(r"^[a-z]\w*$", tok):
            return self.regs[tok]
        return np.full((self.T, 32), np.uint64(int(tok, 0) & 0xFFFFFFFFFFFFFFFF), dtype=np.uint64)

    def _region(self, addr):
        for base, arr in self.mem.items():
            if np.all((addr >= base) & (addr < base + arr.shape[1])):
                return base, arr
        raise RuntimeError("an address outside the buffers")

    def step(self, s: str) -> None:
        if s.startswith("@"):
            raise NotImplementedError(f"predicated instruction: {s}")
        op, _, rest = s.partition(" ")
        a = [x.strip() for x in re.split(r",(?![^{]*})", rest)] if rest else []
        R, v = self.regs, self.val
        if op == "ret":
            return
        if op == "ld.param.b64":
            R[a[0]] = np.full((self.T, 32), np.uint64(self.params[int(re.search(r"param_(\d+)", a[1]).group(1))]),
                              dtype=np.uint64)
        elif op in ("mov.u32", "mov.b32", "cvt.u64.u32"):
            R[a[0]] = v(a[1]) & M32
        elif op == "shl.b32":
            R[a[0]] = (v(a[1]) << (v(a[2]) & np.uint64(31))) & M32
        elif op in ("shr.b32", "shr.u32"):
            R[a[0]] = (v(a[1]) & M32) >> v(a[2])
        elif op == "and.b32":
            R[a[0]] = v(a[1]) & v(a[2]) & M32
        elif op == "or.b32":
            R[a[0]] = (v(a[1]) | v(a[2])) & M32
        elif op == "xor.b32":
            R[a[0]] = (v(a[1]) ^ v(a[2])) & M32
        elif op == "bfe.u32":
            R[a[0]] = (v(a[1]) >> v(a[2])) & ((np.uint64(1) << v(a[3])) - np.uint64(1))
        elif op == "mul.wide.u32":
            R[a[0]] = (v(a[1]) & M32) * (v(a[2]) & M32)
        elif op == "mad.wide.u32":
            R[a[0]] = (v(a[1]) & M32) * (v(a[2]) & M32) + v(a[3])
        elif op in ("mul.wide.s32", "mad.wide.s32"):  # 32-bit signed operands, a 64-bit product (two's complement)
            p = (_signed(v(a[1])) * _signed(v(a[2]))).astype(np.uint64)
            R[a[0]] = p + v(a[3]) if op.startswith("mad") else p
        elif op == "cvt.s64.s32":
            R[a[0]] = _signed(v(a[1])).astype(np.uint64)
        elif op == "shl.b64":
            R[a[0]] = v(a[1]) << (v(a[2]) & np.uint64(63))
        elif op == "or.b64":
            R[a[0]] = v(a[1]) | v(a[2])
        elif op == "add.s64":
            R[a[0]] = v(a[1]) + v(a[2])
        elif op == "add.s32":
            R[a[0]] = (v(a[1]) + v(a[2])) & M32
        elif op in ("setp.eq.b32", "setp.eq.s32"):
            R[a[0]] = (v(a[1]) & M32) == (v(a[2]) & M32)
        elif op in ("setp.ne.b32", "setp.ne.s32"):
            R[a[0]] = (v(a[1]) & M32) != (v(a[2]) & M32)
        elif op == "selp.b32":
            R[a[0]] = np.where(R[a[3]], v(a[1]), v(a[2]))
        elif op == "shfl.sync.idx.b32":
            if int(a[3], 0) != 31 or int(a[4], 0) != -1:
                raise NotImplementedError(f"a shuffle within part of a warp: {s}")
            R[a[0]] = np.take_along_axis(v(a[1]), (v(a[2]) & np.uint64(31)).astype(np.int64), axis=1)
        elif op == "prmt.b32":
            R[a[0]] = prmt(v(a[1]), v(a[2]), v(a[3]))
        elif op == "lop3.b32":
            R[a[0]] = lop3(v(a[1]), v(a[2]), v(a[3]), int(a[4], 0))
        elif op.startswith(("ld.global", "st.global")):
            m = re.match(r"(ld|st)\.global(?:\.v(\d))?\.b(\d+)$", op)
            if not m:
                raise NotImplementedError(s)
            load, width = m.group(1) == "ld", int(m.group(3)) // 8
            regs, addr = (a[0], a[1]) if load else (a[1], a[0])
            am = re.match(r"\[\s*(%\w+)\s*(?:\+\s*(-?\d+))?\s*\]", addr)
            at = R[am.group(1)] + np.uint64(int(am.group(2) or 0))
            base, arr = self._region(at)
            off = (at - np.uint64(base)).astype(np.int64)
            t = np.arange(self.T)[:, None]
            for i, r in enumerate(x.strip() for x in regs.strip("{} ").split(",")):
                if load:
                    R[r] = sum(arr[t, off + i * width + k].astype(np.uint64) << np.uint64(8 * k) for k in range(width))
                else:
                    for k in range(width):
                        arr[t, off + i * width + k] = ((v(r) >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8)
        else:
            raise NotImplementedError(s)
