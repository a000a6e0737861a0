"""The decode kernel compiled for a GPU this machine does not have: a static profile of its machine code.

Without a GPU, what can be measured of a kernel is what it compiles to. This compiles ``wushkv.triton_kernels``'
decode kernel for sm_90 (Hopper: the H200 it was timed on) as the launcher would, with the specializations the
launcher derives from the arguments (16-divisible pointers and integers, integers equal to 1), disassembles it with
the ``nvdisasm`` that triton ships, and counts per configuration:

* the instructions of the loop over the packed middle, per token of the middle and warp (``warp_instr_per_token``:
  instructions a thread runs per tile × warps / tokens per tile): what the issue slots of the device pay;
* register spills in that loop (``LDL``/``STL``), registers and stack per thread, and the warps an sm_90
  multiprocessor holds of the kernel at once (``resident_warps``, from its registers and shared memory): the warps
  its four schedulers can switch between to hide each other's latency;
* the same for the loop's steady path (``steady_warp_instr_per_token``, ``steady_spill_loads``): the loop without
  the blocks it guards by a branch, which run only now and then. Those are, where the kernel has them, the rescaling
  of the value accumulators when a row's max rises (a few times a split), the mask of a split's first or last,
  partial, tile of tokens, and with key tiles the block that takes up a new key tile (scaling the query), once
  per key tile: the largest guarded block that loads from memory (the tile's scale), counted in the steady path at
  BN/key-tile tokens' share. The static count pays for every block at every tile.

Baseline in the same run: the path session 46 timed (codes unpacked to (tokens, d) tiles, 64 tokens per tile,
4 warps), whose loop the H200 ran at 0.88 ms for 32k tokens × batch 16 (bf16 SDPA: 0.49 ms). A ratio of issued
instructions is not a ratio of times (latency, occupancy and memory are not in it), so these figures choose what to
time on a GPU; ``benchmarks/gpu_decode.py`` times it.

    python benchmarks/kernel_sass.py [--widths 2,4,3,8] [--head-dims 128] [--key-tiles 128] [--value-tiles 128] [--rmean]
        [--json out.json]

``--key-tiles N``: the keys as KVarN tiles of N tokens (``auto``'s ``+ktiles``), the values per-token codes as before.
``--value-tiles N``: the values as KVarN tiles of N tokens (with ``--key-tiles N``: the ``kvarn`` method's layout).
``--rmean``: the keys centered on their rotating mean (``+rmean``, :class:`wushkv.triton_kernels.KeyBias`).
``--stores``: instead of the decode kernel, the store kernels ``auto``'s cache writes with (per-token codes, with and
without ``+ldlq``'s error feedback, and KVarN key tiles with and without it), compiled as a GPU launches them: their
registers, stack and spilled loads and stores, and the instructions of their loops (the balance's rounds, the
channels of error feedback).

``--paged per_token,ktiles,kivi,kvarn``: instead of the contiguous launch, the decode as the vLLM plugin launches it on a
GPU (``wushkv_vllm.paged.decode_batch_triton``): the codes read in place from paged cells (``--block-size`` 128
tokens a block, the tiles' halves spread over their cells) through a block table that maps every position, and the
windows read in place from the pool of copies (``PoolWindows``), for the plugin's layouts: per-token codes
(``wush+ldlq`` served), ``auto``'s key tiles, KIVI's keys, KVarN's tiles on both sides (the ``kvarn`` method);
``--widths`` gives K = V. The ``paged ...`` configurations: each tile of tokens' block read once (``one block``) or
each token's looked up (``lookups``; ``DecodeTuning.page_tiles``).

``--max-registers none,168,128``: each configuration also compiled under each cap on a thread's registers
(``DecodeTuning.max_registers``): fewer registers, more resident warps, and the spills that costs. ``--fp-stages 2``:
the loop over the full-precision windows' software pipeline (``DecodeTuning.fp_stages``; 1: unpipelined, less shared
memory, which is what a register cap needs to hold more programs).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

# the compiled path, not the interpreter (which would otherwise be picked up from the environment of a test run)
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from wushkv import triton_kernels as tk  # noqa: E402
from wushkv.io import write_json  # noqa: E402
from wushkv.quantizers import QuestQuantizer  # noqa: E402

# (label, DecodeTuning fields): the baseline first
CONFIGS = [
    ("tiles 64/4 (session 46)", dict(class_split=False, block_n=64, num_warps=4)),
    ("classes 32/1 (default)", dict(class_split=True)),
    ("classes 64/1", dict(class_split=True, block_n=64, num_warps=1)),
    ("classes 64/2", dict(class_split=True, block_n=64, num_warps=2)),
    ("classes 64/4", dict(class_split=True, block_n=64, num_warps=4)),
    # paged (--paged): each tile of tokens' block read once, or each token's looked up (DecodeTuning.page_tiles)
    ("paged one block 32/1", dict(class_split=True, page_tiles=True)),
    ("paged one block 16/1", dict(class_split=True, page_tiles=True, block_n=16, num_warps=1)),
    ("paged lookups 32/1", dict(class_split=True, page_tiles=False)),
]


PAGED_LAYOUTS = ("per_token", "ktiles", "kivi", "kvarn")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="2,4,3,8", help="K = V code widths to compile (per-token QuEST)")
    p.add_argument("--head-dims", default="128")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--configs", default="", help="labels of CONFIGS to run (comma-separated prefixes); default all")
    p.add_argument("--key-tiles", type=int, default=0, help="keys as KVarN tiles of this many tokens (0: per-token codes)")
    p.add_argument("--value-tiles", type=int, default=0, help="values as KVarN tiles of this many tokens (0: per-token codes)")
    p.add_argument("--rmean", action="store_true", help="keys centered on their rotating mean (+rmean)")
    p.add_argument("--max-registers", default="none",
                   help="caps on a thread's registers to compile each configuration under (comma-separated; none: the "
                        "compiler's choice)")
    p.add_argument("--fp-stages", type=int, default=None,
                   help="DecodeTuning.fp_stages for every configuration (the windows' loop pipeline; default: each's)")
    p.add_argument("--stores", action="store_true", help="profile the store kernels instead of the decode kernel")
    p.add_argument("--paged", default="", help="the vLLM plugin's paged launches of these layouts instead "
                   f"(comma-separated: {', '.join(PAGED_LAYOUTS)})")
    p.add_argument("--block-size", type=int, default=128, help="--paged: tokens a block (vLLM's block_size)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        args.max_registers = [None if v.strip().lower() == "none" else int(v) for v in args.max_registers.split(",")]
    except ValueError:
        p.error(f"--max-registers takes 'none' or ints, comma-separated, got {args.max_registers!r}")
    if any(r is not None and not 24 <= r <= 255 for r in args.max_registers):
        p.error(f"--max-registers takes registers a thread in [24, 255], got {args.max_registers}")
    return args


def _tools():
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tools = {t: os.path.join(bin_dir, t) for t in ("nvdisasm", "cuobjdump", "ptxas")}
    missing = [t for t, path in tools.items() if not os.path.exists(path)]
    if missing:
        raise SystemExit(f"kernel_sass.py needs triton's CUDA tools, missing here: {missing} (in {bin_dir})")
    return tools


def recorded_decode(bits: int, d: int, q_heads: int, kv_heads: int, n_mid: int = 1024, key_tile: int = 0,
                    rmean: bool = False, value_tile: int = 0):
    """The decode launch of one bfloat16 layer over a K{bits}V{bits} middle (sink 64, recent 256; CPU tensors standing
    in for the GPU's: only their dtypes, strides and alignment reach the compiler); ``key_tile`` > 0: the keys in
    KVarN tiles of that many tokens; ``rmean``: centered on their rotating mean; ``value_tile`` > 0: the values in
    KVarN tiles of that many tokens."""
    bf = dict(dtype=torch.bfloat16)
    q = torch.zeros(1, q_heads, d, **bf)
    sink, recent = torch.zeros(1, kv_heads, 64, d, **bf), torch.zeros(1, kv_heads, 256, d, **bf)

    def side():
        fmt = tk.TokenFormat.of(QuestQuantizer(bits), d)
        return tk.Packed(fmt, torch.zeros(1, kv_heads, n_mid, fmt.nbytes, dtype=torch.uint8),
                         torch.ones(1, kv_heads, n_mid, 1, dtype=torch.float16))

    keys = side()
    if key_tile:
        meta = torch.ones(1, kv_heads, n_mid // key_tile, d, dtype=torch.float16)
        keys = tk.Packed(tk.TileFormat(bits, d, key_tile), keys.codes, keys.scale, tile_scale=meta, tile_zero=meta.clone())
    values = side()
    if value_tile:  # each token's scale and zero, each tile's channel scales
        per_token = torch.ones(1, kv_heads, n_mid, 1, dtype=torch.float16)
        values = tk.Packed(tk.TileFormat(bits, d, value_tile), values.codes, per_token, per_token.clone(),
                           tile_scale=torch.ones(1, kv_heads, n_mid // value_tile, d, dtype=torch.float16))
    lengths = torch.tensor([[64, n_mid, 256]], dtype=torch.int32)
    bias = tk.KeyBias(torch.zeros(1, q_heads, d), torch.tensor([64]), torch.ones(d // 2)) if rmean else None
    with tk.recorded_launches() as launches:
        tk.decode(q, lengths, sink, sink, keys, values, recent, recent, d**-0.5, splits=4, key_bias=bias)
    return next(rec for rec in launches if rec[0] == "decode")


def recorded_paged_decode(layout: str, bits: int, d: int, q_heads: int, kv_heads: int, n: int = 1024, bs: int = 128):
    """The decode launch the vLLM plugin makes on a GPU for one bfloat16 layer of 2 requests of ``n`` tokens in
    ``bs``-token blocks (``wushkv_vllm.paged.decode_batch_triton``): ``layout`` one of PAGED_LAYOUTS at K{bits}V{bits},
    windows 128/72/128 (per-token codes: 128/128/1), every window copy held (so read in place from the pool)."""
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv_vllm.paged import SlotCodec, Windows, decode_batch_triton

    win = WindowConfig(128, 128, 1) if layout == "per_token" else WindowConfig(128, 72, 128)
    quantizers = {"per_token": dict(quantizer="quest"), "ktiles": dict(quantizer="quest", key_quantizer="kvarn"),
                  "kivi": dict(quantizer="kivi"), "kvarn": dict(quantizer="kvarn")}[layout]
    cfg = QuantConfig(k_bits=bits, v_bits=bits, windows=win, **quantizers)
    sc = SlotCodec(cfg, d)
    R, per = 2, -(-n // bs)
    cache = torch.zeros(R * per, kv_heads, bs, sc.slot_bytes, dtype=torch.uint8)
    tables = torch.arange(R * per, dtype=torch.int32).view(R, per)
    w = Windows(bs, kv_heads, d, win.S_sink, win.S_keep, capacity=1 << 20, dtype=torch.bfloat16, flush=win.S_flush)
    for r in range(R):
        pos = torch.tensor(w.positions(n))
        w.write(torch.zeros(len(pos), kv_heads, d), torch.zeros(len(pos), kv_heads, d),
                tables[r][pos // bs].long() * bs + pos % bs, pos)
    q = torch.zeros(R, q_heads, d, dtype=torch.bfloat16)
    with tk.recorded_launches() as launches:
        out = decode_batch_triton(tk, sc, cache, tables, torch.full((R,), n), q, w, d**-0.5, host_table=tables)
    if out is None:
        raise SystemExit(f"the plugin's Triton decode does not take {layout} at {bits} bits, head_dim {d}")
    rec = next(rec for rec in launches if rec[0] == "decode")
    assert rec[3]["FP_UNIT"] == w.unit and rec[3]["PAGE_ABS"], "not the plugin's launch (pool windows, absolute pages)"
    return rec


def recorded_stores(bits: int, d: int, kv_heads: int, key_tile: int = 128) -> list:
    """The store launches of one layer as a GPU makes them (CPU tensors standing in for its): (label, launch) of
    per-token QuEST codes from bfloat16 rows, plain and with error feedback, their steps in one E5M3 byte too, and of
    the keys' KVarN tiles of ``key_tile`` tokens, plain and with error feedback."""
    x = torch.zeros(1, kv_heads, key_tile, d, dtype=torch.bfloat16)
    F = torch.eye(d).expand(kv_heads, d, d).contiguous()
    fmt = tk.TokenFormat.of(QuestQuantizer(bits), d)
    codes = torch.zeros(1, kv_heads, key_tile, fmt.nbytes, dtype=torch.uint8)
    scale = torch.zeros(1, kv_heads, key_tile, fmt.ngroups, dtype=torch.bfloat16)
    out = []
    byte_steps = torch.zeros(1, kv_heads, key_tile, fmt.ngroups, dtype=torch.uint8)
    for label, fb, e5m3 in (("token", None, False), ("token +ldlq", F, False), ("token e5m3", None, True),
                            ("token e5m3 +ldlq", F, True)):
        with tk.recorded_launches() as launches:
            tk.store_contiguous(x, codes, byte_steps if e5m3 else scale, None, 0,
                                dataclasses.replace(fmt, step_byte=e5m3), feedback=fb)
        out.append((label, launches[0]))
    for label, fb in (("key tiles", None), ("key tiles +ldlq", F)):
        with tk.recorded_launches() as launches:
            tk.kvarn_key_tiles(x.float(), bits, key_tile, feedback=fb)
        out.append((label, launches[0]))
    return out


def run_stores(args, tools) -> dict:
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for bits in (int(x) for x in args.widths.split(",")):
            for label, record in recorded_stores(bits, d, args.kv_heads, args.key_tiles or 128):
                prof = profile(compile_for_sm90(record), tools)
                every = prof["ops"]  # the whole kernel's, loops or not
                meta = record[3]
                row = {"kernel": label, "bits": bits, "head_dim": d, "rows_per_program": meta.get("BR"),
                       "num_warps": meta.get("num_warps", 4), "registers": prof["usage"].get("reg"),
                       "stack": prof["usage"].get("stack"), "spill_loads": every["LDL"], "spill_stores": every["STL"],
                       "instructions": prof["instructions"], "loop_instructions": [sum(c.values()) for c in prof["loops"]],
                       "loop_spill_loads": [c["LDL"] for c in prof["loops"]],
                       "loop_barriers": [c["BAR"] for c in prof["loops"]]}
                rows.append(row)
                print(f"d {d} {bits}-bit {label:16s} {row['registers']} regs, stack {row['stack']}, spills "
                      f"{row['spill_loads']}/{row['spill_stores']}, {row['instructions']} instructions, loops "
                      f"{row['loop_instructions']} with {row['loop_spill_loads']} spilled loads", flush=True)
    return {"target": "sm_90", "stores": rows}


def compile_for_sm90(record):
    """triton.compile of a recorded launch with the launcher's specializations."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    name, _grid, args, meta = record
    meta = dict(meta)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion") if k in meta}
    kernel = tk._kernels()[name]
    names = kernel.arg_names
    free = [n for n in names if n not in meta]
    sig, consts, attrs = {}, dict(meta), {}
    for n, a in zip(free, args, strict=True):
        ty, attr = native_specialize_impl(BaseBackend, a, False, True, True)
        if ty == "constexpr" or kernel.params[names.index(n)].is_constexpr:  # an integer equal to 1, or declared so
            consts[n] = a
            continue
        sig[n] = ty
        if attr:
            attrs[(names.index(n),)] = BaseBackend.parse_attr(attr)
    sig = {n: sig.get(n, "constexpr") for n in names}
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def profile(compiled, tools) -> dict:
    """Registers, stack, and the loops of the SASS (backward branches) with their instruction counts."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([tools["nvdisasm"], "-c", cubin], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tools["cuobjdump"], "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    usage = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    ops, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*\.L_x_(\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, addr))
            pending = []
            ops.append((addr, m.group(2).split(".")[0], line))
    branches = []  # (from, to) of every branch to a label
    for addr, op, line in ops:
        m = re.search(r"\.L_x_(\d+)", line) if op == "BRA" else None
        if m and m.group(1) in labels:
            branches.append((addr, labels[m.group(1)]))
    # outermost loops only (backward branches), in address order (a loop nested in another, e.g. over the key tiles
    # a tile of tokens touches, is counted in its enclosing loop's body)
    outer = sorted(_outermost([(to, fr) for fr, to in branches if to < fr]))
    loops = [collections.Counter(o for a, o, _ in ops if lo <= a <= hi) for lo, hi in outer]
    # the blocks a loop guards: a forward branch inside it, over what it skips (outermost blocks only)
    guarded = [[collections.Counter(o for a, o, _ in ops if j0 < a < j1)
                for j0, j1 in _outermost([(fr, to) for fr, to in branches if lo <= fr < to <= hi])] for lo, hi in outer]
    return {"usage": usage, "shared": compiled.metadata.shared, "instructions": len(ops), "loops": loops,
            "guarded": guarded, "ops": collections.Counter(o for _a, o, _ in ops)}


def _outermost(spans: list) -> list:
    """The (start, end) spans not inside another one."""
    return [sp for sp in spans if not any(o != sp and o[0] <= sp[0] and sp[1] <= o[1] for o in spans)]


def run(args) -> dict:
    tools = _tools()
    if args.stores:
        return run_stores(args, tools)
    wanted = [c for c in CONFIGS if not args.configs or any(c[0].startswith(p) for p in args.configs.split(","))]
    wanted = [c for c in wanted if args.paged or not c[0].startswith("paged")]  # (those change only paged launches)
    layouts = [x for x in args.paged.split(",") if x] or [None]
    rows = []
    for d, bits, layout in ((int(x), int(b), lay) for x in args.head_dims.split(",") for b in args.widths.split(",")
                            for lay in layouts):
        key_tiles = 128 if layout in ("ktiles", "kivi", "kvarn") else (0 if layout else args.key_tiles)
        base = None
        for (label, fields), cap in ((c, r) for c in wanted for r in args.max_registers):
            if cap is not None:
                label, fields = f"{label} maxnreg {cap}", fields | {"max_registers": cap}
            if args.fp_stages is not None:
                fields = fields | {"fp_stages": args.fp_stages}
            with tk.decode_tuning(**fields) as tuning:
                if layout:
                    label = f"{layout} paged, {label}"
                    record = recorded_paged_decode(layout, bits, d, args.q_heads, args.kv_heads, bs=args.block_size)
                else:
                    record = recorded_decode(bits, d, args.q_heads, args.kv_heads, key_tile=args.key_tiles,
                                             rmean=args.rmean, value_tile=args.value_tiles)
                block_n, warps = record[3]["BN"], record[3]["num_warps"]
                classes = record[3]["K_P"] > 0 or record[3]["V_P"] > 0
            prof = profile(compile_for_sm90(record), tools)
            mid = prof["loops"][0]  # the middle runs first (triton_kernels.decode_kernel)
            n = sum(mid.values())
            blocks = sorted(prof["guarded"][0], key=lambda c: -sum(c.values()))
            steady = mid - sum(blocks, collections.Counter())
            # the new key tile's block, once a key tile: the largest that loads from memory (the tile's scale;
            # the rescale and a partial tile's mask load nothing)
            tile_block = next((c for c in blocks if c["LDG"]), None) if key_tiles else None
            if tile_block is not None:
                share = block_n / key_tiles
                steady_n = sum(steady.values()) + share * sum(tile_block.values())
                steady_ldl = steady["LDL"] + share * tile_block["LDL"]
            else:
                steady_n, steady_ldl = sum(steady.values()), steady["LDL"]
            row = {"config": label, "bits": bits, "head_dim": d, "key_tiles": key_tiles, "rmean": args.rmean,
                   "value_tiles": 128 if layout == "kvarn" else (0 if layout else args.value_tiles), "paged": layout,
                   "classes": classes, "block_n": block_n,
                   "num_warps": warps, "num_stages": tuning.num_stages, "loop_instructions": n,
                   "warp_instr_per_token": n * warps / block_n, "spill_loads": mid["LDL"],
                   "steady_warp_instr_per_token": steady_n * warps / block_n, "steady_spill_loads": steady_ldl,
                   "guarded_blocks": [sum(c.values()) for c in blocks],
                   "spill_stores": mid["STL"], "mma": mid["HMMA"], "registers": prof["usage"].get("reg"),
                   "max_registers": cap, "stack": prof["usage"].get("stack"), "shared": prof["shared"],
                   "resident_warps": tk.resident_warps(prof["usage"].get("reg", 255), prof["shared"], warps),
                   "top": dict(mid.most_common(8))}
            base = base or row
            row["over_baseline"] = row["warp_instr_per_token"] / base["warp_instr_per_token"]
            row["steady_over_baseline"] = row["steady_warp_instr_per_token"] / base["steady_warp_instr_per_token"]
            rows.append(row)
            print(f"d {d} K{bits}V{bits} {label:26s} {row['warp_instr_per_token']:6.1f} warp-instr/token "
                  f"({row['over_baseline']:.2f}x), spills {row['spill_loads']}/{row['spill_stores']}, "
                  f"{row['registers']} regs, stack {row['stack']}, {row['resident_warps']} warps/SM; steady {row['steady_warp_instr_per_token']:.1f} "
                  f"({row['steady_over_baseline']:.2f}x), spills {row['steady_spill_loads']:g}; guarded blocks "
                  f"{row['guarded_blocks']}", flush=True)
    return {"target": "sm_90", "rows": rows}


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
