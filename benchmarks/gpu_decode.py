"""GPU decode benchmark of the Triton kernels (issue #33): one layer's decode attention, and one model decode step.

    python benchmarks/gpu_decode.py --out out/gpu_check [--contexts 1024,4096,32768,131072] [--batches 1,16,64]
        [--peak-tbps 4.8] [--e2e-contexts 4096,32768] [--e2e-batches 1,16]
    python benchmarks/gpu_decode.py --dry-run --out /tmp/gpu_decode   # CPU, Triton's interpreter, tiny shapes

0. *Sweep* (``--sweep``, default 32768x16 then 1024x16): the decode kernel's launch parameters
   (:class:`wushkv.triton_kernels.DecodeTuning`: tokens per tile, warps, pipeline stages, programs per multiprocessor,
   and for a few a cap on a thread's registers: more resident warps for some spills) timed at each shape within
   ``--sweep-budget`` seconds, and at each shape its fastest once more with each pair's last program merging the
   splits (``last_split_merges``: no merge launch; its output checked against the two launches'); the fastest at the
   first shape is the tuning every row below runs under (through ``decode_tuning``, the cache's decode steps too),
   and each kernel row also times the library's defaults (``triton_default``).
1. *Kernel*: for each context and batch, one attention layer (``--q-heads`` query heads over ``--kv-heads`` KV heads of
   ``--head-dim``) decodes one token: the Triton K2V2 kernel over a cache of a full-precision sink (``--sink``, 64), a
   packed middle written by the store kernel, and a full-precision recent buffer (``--recent``, 256), against bfloat16 ``scaled_dot_product_attention`` over the same
   context (the backend torch picks, and FlashAttention forced, each where it runs). Median of ``--iters`` timings
   after ``--warmup`` (:class:`Timer`): ``ms`` the device's time between CUDA events around the call with the L2
   flushed and the host's launches queued ahead (what the kernels cost), ``latency_ms`` each call timed alone (the
   host's Python and Triton's launcher included, as session 46 timed), ``host_ms`` the host's time to issue it;
   the bytes each reads (codes, metadata, windows; bfloat16 K and V) and the
   achieved bandwidth as a fraction of the device's peak (``PEAK_TBPS`` by device name, or ``--peak-tbps``); and the
   same kernel over the bfloat16 context (``triton_bf16``: what the packing saves, apart from how good the kernel is),
   and over the same codes read as KVarN key tiles (``triton_ktiles``: ``auto``'s ``+ktiles`` keys), as KVarN tiles of keys
   and values (``triton_kvarn``: the ``kvarn`` method's layout, session 70; at the first --sweep shape) and as keys
   centered on their rotating mean (``triton_rmean``: ``auto``'s ``+rmean``; these, ``triton_bf16`` and ``triton_tiles``
   without the sweep's register cap: UNCAPPED); with batch > 1, a left-padded batch's rows (``triton_ragged``, each
   row over its own columns, against ``triton_ragged_widest``, as wide as the widest); ``triton_ceil_splits``, where
   it differs, the same call with the split count before session 59 (each pair's share of the slots rounded up,
   against :func:`wushkv.triton_kernels.wave_splits`' whole waves); ``triton_last_merges``, where a pair has several
   splits and the tuning launches the merge, the same call with the splits merged in the decode kernel (one launch;
   ``triton_over_triton_last_merges`` above 1 where that wins); ``triton_compiled`` (and each
   sweep tuning's ``compiled``): the decode kernel's registers, local and shared memory as the device's compiler
   built it.
   Combinations whose tensors would not fit in ``--memory-fraction`` of the free memory are skipped (listed).
   With ``--plugin`` (default 32768x16), after every other row: the vLLM plugin's decode at that kernel row's shape
   (``plugin``: one layer, its host time the batch's plan too; ``plugin_step``: a layer of a step whose plan an
   earlier layer made; ``plugin_gathered``: the windows gathered first, checked against the in-place read,
   ``plugin_vs_gathered``; ``plugin_page_tiles``: tiles of 16 tokens, each block read once), per-token K2V2 cells in
   vLLM's 16-token blocks, the windows read from the pool of copies.
2. *End to end*: a random-weight Llama-shaped model (``--e2e-layers`` layers of the same heads, bfloat16) decodes
   one token per step over a filled cache: ``DynamicCache`` (SDPA), the wushkv K2V2 cache through the Triton kernels,
   the same cache on the PyTorch path, and the kind of cache ``auto`` picks (SmolLM2's K2V2 recipe's: KVarN key tiles
   of KEY_TILE tokens centered on a rotating mean, affine values) through the kernels (``wushkv_auto``); ms per token
   (median), the kernel launches per step (a Triton row whose
   decode launches are not one per layer and step gets an ``error``) and the allocator's peak above the cache during a
   step (a full-precision copy of the middle would show here).

3. *Acceptance*: issue #33's bars read off those rows (:func:`acceptance`), met, missed or not measured, in the JSON
   (``acceptance``) and as the output's last lines; ``--plot-from gpu_decode.json`` says them again for a saved run
   (one cut short too).

Ratios mean something only within one run. The JSON is rewritten after every row, so a run cut short keeps what it
measured. ``--dry-run`` runs every code path on CPU tensors under Triton's interpreter with tiny shapes (timings
meaningless; a few seconds), so the script does not crash on its first GPU run; size flags given with it still apply.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import sys
import time

# Tiny CPU mode: the interpreter must be chosen before triton is first imported (torch may import it).
if "--dry-run" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from wushkv import decode as decode_mod  # noqa: E402
from wushkv import triton_kernels as tk  # noqa: E402
from wushkv.io import write_json  # noqa: E402
from wushkv.quantizers import QuestQuantizer  # noqa: E402

# Peak DRAM bandwidth (TB/s) by a substring of torch.cuda.get_device_name(); the longest match wins.
PEAK_TBPS = {
    "H200": 4.8, "H100 SXM": 3.35, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100": 3.35, "H800": 3.35, "GH200": 4.0,
    "B200": 8.0, "A100-SXM4-80GB": 2.039, "A100-PCIE-80GB": 1.935, "A100": 1.555, "A10G": 0.6, "L40S": 0.864,
    "L4": 0.3, "RTX 4090": 1.008, "RTX 3090": 0.936, "V100": 0.9, "T4": 0.32,
}
# --dry-run: every code path (a packed middle, the recent buffer, a flush during the timed steps) at the smallest sizes
DRY_RUN = dict(contexts=[48], batches=[1, 2], q_heads=4, kv_heads=2, head_dim=32, sink=4, recent=8, flush=4, warmup=0,
               iters=1, e2e_contexts=[48], e2e_batches=[1], e2e_layers=1, e2e_steps=4, sweep="48x2", feedback_batches=[1],
               feedback_tokens=16, plugin="48x2")
# The decode kernel's launch parameters the sweep tries, most promising first (it stops at --sweep-budget): tiles of
# block_n tokens, warps, software-pipeline stages, and where the tuple has a fourth field, more DecodeTuning fields:
# a cap on a thread's registers (8 one-warp programs a multiprocessor hold at 255 registers, 16 at 128, for a few
# spills; kernel_sass.py) with the windows' loop unpipelined (fp_stages=1: 12 KB of shared memory a program at d 128,
# without which 20 KB allows 10); each compiled once, then timed at each programs_per_sm.
CAP = lambda registers: dict(max_registers=registers, fp_stages=1)  # noqa: E731
SWEEP_TILES = [(32, 1, 2), (32, 1, 2, CAP(128)), (64, 1, 2), (32, 1, 2, CAP(168)), (16, 1, 2), (32, 1, 3),
               (32, 1, 3, CAP(128)), (64, 1, 3), (32, 1, 1), (64, 1, 1), (32, 1, 2, dict(fp_stages=1)), (32, 2, 2),
               (64, 4, 3), (128, 8, 3), (64, 8, 3), (128, 4, 3), (32, 4, 3), (64, 4, 2), (128, 8, 2), (32, 4, 2),
               (64, 4, 4), (128, 8, 4), (256, 8, 3), (32, 8, 3), (64, 4, 1), (128, 8, 1), (16, 4, 3), (256, 8, 2),
               (32, 4, 1), (64, 8, 2), (128, 4, 2), (16, 4, 1)]
# programs a multiprocessor holds, which the splits fill in whole waves (tk.wave_splits): 8 the default kernel's, 16 a
# cap of 128 registers', 12 a cap of 168's, 3 the 4-warp tiles' at d 128 (kernel_sass.py); 2 and 4 fewer, longer programs
SWEEP_PER_SM = (4, 8, 16, 2, 12, 3)
TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(tk.DecodeTuning))
DRY_SWEEP_TILES, DRY_SWEEP_PER_SM = [(16, 4, 1), (32, 1, 3, CAP(128))], (1, 4)
# session 46's path and tuning: codes unpacked to (tokens, d) tiles, 64 tokens, 4 warps, 2 stages ("triton_tiles")
TILES = dict(class_split=False, block_n=64, num_warps=4, num_stages=2, fp_stages=None, max_registers=None,
             last_split_merges=False)  # the merge kernel's own launch: the reference the in-kernel merge is held to
# the rows whose kernels a register cap makes spill (key tiles, +rmean; kernel_sass.py: 1.2-1.5x the instructions a
# token at 128-168 registers) or that stand for an earlier kernel (the bf16 context's, as session 46 ran it) run
# without the sweep's cap
UNCAPPED = dict(max_registers=None, fp_stages=None)
KEY_TILE = 128  # tokens per KVarN key tile in the key-tiles row (auto's +ktiles at the generation presets' flush)


def peak_tbps(name: str, override: float | None) -> float | None:
    if override:
        return override
    hits = [k for k in PEAK_TBPS if k.lower() in name.lower()]
    return PEAK_TBPS[max(hits, key=len)] if hits else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--out", default=os.environ.get("OUT", "out/gpu_check"), help="folder of gpu_decode.json")
    p.add_argument("--contexts", type=ints, default=[1024, 4096, 32768, 131072])
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sink", type=int, default=64, help="full-precision sink tokens (the generation presets' 64)")
    p.add_argument("--recent", type=int, default=256, help="full-precision recent tokens (the generation presets' 256)")
    p.add_argument("--flush", type=int, default=8, help="the end-to-end cache's S_flush")
    p.add_argument("--k-bits", type=int, default=2)
    p.add_argument("--v-bits", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-tbps", type=float, default=None, help="the device's peak bandwidth (default: PEAK_TBPS)")
    p.add_argument("--memory-fraction", type=float, default=0.8)
    p.add_argument("--e2e-contexts", type=ints, default=[4096, 32768])
    p.add_argument("--e2e-batches", type=ints, default=[1, 16])
    p.add_argument("--e2e-layers", type=int, default=4)
    p.add_argument("--e2e-steps", type=int, default=None, help="timed decode steps end to end (default: --iters)")
    p.add_argument("--sweep", default="32768x16,1024x16",
                   help="context x batch shapes at which the decode kernel's launch parameters (DecodeTuning) are swept "
                        "before the rows; the first picks the tuning every row then uses ('' : no sweep, the defaults)")
    p.add_argument("--sweep-budget", type=float, default=100.0,
                   help="seconds the sweep may spend at its first shape (compiles included); later shapes time the tunings it reached")
    p.add_argument("--tuning", default="", help="DecodeTuning fields for the rows when there is no sweep, e.g. "
                   "block_n=64,num_warps=4,num_stages=2,programs_per_sm=8")
    p.add_argument("--widths", type=ints, default=[],
                   help="also time the kernel at the first --contexts/--batches shape with K and V at each of these widths "
                        "(where the time goes: unpacking grows with the codes per byte, bytes with the width)")
    p.add_argument("--feedback-batches", type=ints, default=[16],
                   help="time one flush with +ldlq error feedback at these batches: the store kernel against the PyTorch loop")
    p.add_argument("--feedback-tokens", type=int, default=128,
                   help="tokens of that flush, and of its key tile (auto's +ktiles flush 128 at a time)")
    p.add_argument("--plugin", default="32768x16",
                   help="context x batch shapes of kernel rows at which the vLLM plugin's decode is timed too, after "
                        "every other row (plugin_case; '' : none)")
    p.add_argument("--plot", default="", help="also write a PNG of the kernel rows here")
    p.add_argument("--plot-from", default="", help="a saved gpu_decode.json: print its acceptance (and with --plot draw "
                   "its figure), run nothing")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes: checks the code paths")
    if p.parse_known_args(argv)[0].dry_run:  # tiny defaults; flags given explicitly still win
        p.set_defaults(**DRY_RUN)
    args = p.parse_args(argv)
    if args.e2e_steps is None:
        args.e2e_steps = args.iters
    for name in ("sink", "recent", "flush", "warmup"):
        if getattr(args, name) < (1 if name == "flush" else 0):
            raise SystemExit(f"--{name} must be >= {1 if name == 'flush' else 0}, got {getattr(args, name)}")
    return args


class Timer:
    """Median milliseconds of a callable.

    On a GPU, ``gpu=True`` (the kernel rows, the sweep) times what the device spends. Before each call the L2 cache
    is flushed, as ``triton.testing.do_bench`` does (a buffer of max(256 MB, twice the L2) written: a K2V2 cache of a
    few MB would otherwise be read from L2 on every repetition, bfloat16 K and V of the same context would not); then,
    beyond do_bench, the GPU is kept busy (``torch.cuda._sleep``) for twice the time the host took to issue one call,
    so that the call's launches are queued before its start event runs; nothing waits for the device between calls:
    ``ms`` is the time between two CUDA events around the call's kernels alone. ``latency_ms`` is each call timed alone (start event, call,
    end event, wait): the host's Python and Triton's launcher included, and the L2 warm from the call before, as
    session 46 timed. ``host_ms`` is the host's time to issue one call. ``gpu=False`` (the end-to-end rows, where the
    host's part of a step is part of what is measured): ``ms`` is that latency. On CPU, wall clock."""

    FLUSH_BYTES = 256 << 20  # at least; do_bench's size

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._flush = None
        if self.cuda:  # held for the whole run, allocated before any row measures the free memory
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
            self._flush = torch.empty(max(self.FLUSH_BYTES, 2 * l2), dtype=torch.int8, device=device)

    def __call__(self, fn, warmup: int, iters: int, gpu: bool = False) -> dict:
        for _ in range(warmup):
            fn()
        times, host = self._latency(fn, iters)
        out = {"ms": statistics.median(times), "ms_all": times}
        if not (self.cuda and gpu):
            return out
        out = {"latency_ms": out["ms"], "latency_ms_all": times}
        return out | self._gpu_time(fn, iters, statistics.median(host))

    def _latency(self, fn, iters: int) -> tuple[list[float], list[float]]:
        """Each call timed alone (ms), and the host's seconds in it."""
        times, host = [], []
        for _ in range(max(1, iters)):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return times, host

    def _flush_l2(self) -> None:
        self._flush.zero_()

    def _gpu_time(self, fn, iters: int, host_s: float) -> dict:
        # cycles for twice the host's time per call at 2 GHz (H100/H200 clocks: 1.6-2 GHz; at least 1x up to 4 GHz)
        cycles = int(2 * host_s * 2e9)
        n = max(1, iters)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        issue = []
        torch.cuda.synchronize(self.device)
        for start, end in events:
            self._flush_l2()
            torch.cuda._sleep(cycles)
            start.record()
            t = time.perf_counter()
            fn()
            issue.append(time.perf_counter() - t)
            end.record()
        torch.cuda.synchronize(self.device)
        times = [s.elapsed_time(e) for s, e in events]
        return {"ms": statistics.median(times), "ms_all": times, "host_ms": 1e3 * statistics.median(issue),
                "sleep_ms": 1e3 * cycles / 2e9}


def free_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return 8 << 30  # dry run: a few GiB


def packed_cache(B, Hkv, n, d, bits, device, chunk=4096):
    """A packed middle of n tokens written by the Triton store kernel, chunks of ``chunk`` random bfloat16 tokens (one
    chunk stored at every offset: no full-size float copy exists, and the timing is the kernel's alone):
    (Packed, bytes, seconds the stores took)."""
    fmt = tk.TokenFormat.of(QuestQuantizer(bits), d)
    codes = torch.empty(B, Hkv, n, fmt.nbytes, dtype=torch.uint8, device=device)
    scale = torch.empty(B, Hkv, n, fmt.ngroups, dtype=torch.float16, device=device)
    x = torch.randn(B, Hkv, min(chunk, n), d, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    sync(device)
    t0 = time.perf_counter()
    for a in range(0, n, chunk):
        tk.store_contiguous(x[:, :, : min(chunk, n - a)], codes, scale, None, a, fmt)
    sync(device)
    return tk.Packed(fmt, codes, scale), codes.numel() + scale.numel() * 2, time.perf_counter() - t0


def _shape_fits(args, ctx, B, device) -> tuple[bool, float]:
    d, Hkv, n_mid = args.head_dim, args.kv_heads, ctx - args.sink - args.recent
    bf16_kv = 2 * B * Hkv * ctx * d * 2
    # the packed cache, its windows and one store chunk, then (after they are freed) bfloat16 K and V
    need = max(2 * B * Hkv * n_mid * (d * max(args.k_bits, args.v_bits) // 8 + 2) + bf16_kv * (args.sink + args.recent) // ctx
               + 2 * B * Hkv * 4096 * d * 2, bf16_kv)
    return need <= args.memory_fraction * free_bytes(device), need


def kernel_inputs(args, ctx, B, device):
    """Query, windows and the packed K2V2 middle of one layer at (ctx, B): (inputs for tk.decode, bytes it reads,
    seconds the stores took)."""
    Hq, Hkv, d, SINK, RECENT = args.q_heads, args.kv_heads, args.head_dim, args.sink, args.recent
    n_mid = ctx - SINK - RECENT
    bf = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(B, Hq, d, **bf)
    sk, sv = torch.randn(B, Hkv, SINK, d, **bf), torch.randn(B, Hkv, SINK, d, **bf)
    rk, rv = torch.randn(B, Hkv, RECENT, d, **bf), torch.randn(B, Hkv, RECENT, d, **bf)
    packed_cache(B, Hkv, min(n_mid, 64), d, args.k_bits, device)  # compiles the store kernel outside the timing
    mk, kbytes, k_s = packed_cache(B, Hkv, n_mid, d, args.k_bits, device)
    mv, vbytes, v_s = packed_cache(B, Hkv, n_mid, d, args.v_bits, device)
    lengths = torch.tensor([[SINK, n_mid, RECENT]] * B, dtype=torch.int32, device=device)
    fp_bytes = 2 * B * Hkv * (SINK + RECENT) * d * 2
    return (q, lengths, sk, sv, mk, mv, rk, rv, d**-0.5), kbytes + vbytes + fp_bytes + 2 * q.numel() * 2, k_s + v_s


def _sweep_shapes(args) -> list[list[int]]:
    """--sweep's [context, batch] shapes, in order."""
    return [[int(v) for v in s.split("x")] for s in args.sweep.split(",") if s]


def sweep(args, device, timer) -> dict:
    """Time the decode kernel at each --sweep shape under each DecodeTuning of SWEEP_TILES x SWEEP_PER_SM (within
    --sweep-budget seconds), then at each shape its fastest once more with ``last_split_merges`` (:func:`last_merges_row`):
    {"rows": [...], "best": the fastest tuning at the first shape, "default": ...}."""
    shapes = _sweep_shapes(args)
    tiles, per_sm = (DRY_SWEEP_TILES, DRY_SWEEP_PER_SM) if args.dry_run else (SWEEP_TILES, SWEEP_PER_SM)
    out = {"shapes": shapes, "rows": [], "default": vars(tk.DecodeTuning()) | {}}
    t0 = time.perf_counter()
    for si, (ctx, B) in enumerate(shapes):
        if not _shape_fits(args, ctx, B, device)[0]:
            out["rows"].append({"context": ctx, "batch": B, "skipped": "does not fit"})
            continue
        inputs, nbytes, _ = kernel_inputs(args, ctx, B, device)
        for ti, (bn, w, st, *more) in enumerate(tiles):
            # the budget bounds the first shape's compiles; later shapes time the tunings the first one reached
            if (si == 0 and time.perf_counter() - t0 > args.sweep_budget) or (si > 0 and ti >= out["reached"]):
                out["cut_short"] = out.get("cut_short", False) or si == 0
                break
            if si == 0:
                out["reached"] = ti + 1
            for ppsm in per_sm:
                tune = dict(block_n=bn, num_warps=w, num_stages=st, programs_per_sm=ppsm, class_split=True,
                            max_registers=None, fp_stages=None, merge_always=False,
                            last_split_merges=False, page_tiles=None) | (more[0] if more else {})
                row = {"context": ctx, "batch": B, **tune}
                try:
                    with tk.decode_tuning(**tune):
                        row["splits"] = tk.default_splits(B, args.kv_heads, ctx, bn, device)
                        row |= timer(lambda: tk.decode(*inputs), min(args.warmup, 3), max(1, args.iters // 2), gpu=True)
                    row["tb_per_s"] = nbytes / (row["ms"] * 1e-3) / 1e12
                except Exception as e:  # a tuning this device cannot compile (shared memory, registers)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    out["rows"].append(row)
                    break  # the other programs_per_sm compile the same kernel
                if ppsm == per_sm[0]:  # the same kernel at every programs_per_sm
                    with tk.decode_tuning(**tune):
                        row["compiled"] = compiled_decode(lambda: tk.decode(*inputs))
                row.pop("ms_all", None), row.pop("latency_ms_all", None)
                out["rows"].append(row)
        timed = [r for r in out["rows"] if "ms" in r and (r["context"], r["batch"]) == (ctx, B)]
        fastest = min(timed, key=lambda r: r["ms"]) if timed else None
        if fastest and (fastest["splits"] > 1 or args.dry_run):  # one more timing a shape: the fastest tuning, its
            # splits merged by each pair's last program (one split has nothing to merge: the same kernel)
            out["rows"].append(last_merges_row(args, fastest, inputs, nbytes, timer))
            timed += [out["rows"][-1]] if "ms" in out["rows"][-1] else []
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            out.setdefault("best_by_shape", {})[f"{ctx}x{B}"] = {k: best[k] for k in (*TUNING_FIELDS, "ms")}
            if si == 0:
                out["best"] = {k: best[k] for k in TUNING_FIELDS}
        print(f"sweep {ctx}x{B}: {len(timed)} tunings timed" + (f", best {out['best_by_shape'][f'{ctx}x{B}']}" if timed else ""), flush=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def last_merges_row(args, fastest: dict, inputs: tuple, nbytes: int, timer) -> dict:
    """The sweep's ``fastest`` row's tuning with ``last_split_merges`` (session 61: each (sequence, KV head) pair's
    last program merges its splits, no merge launch), timed at its shape: whether sparing the launch wins, and
    whether the result stands (``vs_two_launches``: its output against the same tuning's two launches; a fault in
    the counting or the memory ordering lands far apart). A row that disagrees keeps its time as ``ms_unchecked``
    and an ``error``, so it is never the best. The dry run has one split a pair, which merges nothing: 2 there."""
    tune = {k: fastest[k] for k in TUNING_FIELDS} | dict(last_split_merges=True, merge_always=False)
    row = {"context": fastest["context"], "batch": fastest["batch"], **tune}
    kw = {"splits": 2} if args.dry_run else {}
    try:
        with tk.decode_tuning(**tune):
            row["splits"] = kw.get("splits") or fastest["splits"]
            row |= timer(lambda: tk.decode(*inputs, **kw), min(args.warmup, 3), max(1, args.iters // 2), gpu=True)
            row["compiled"] = compiled_decode(lambda: tk.decode(*inputs, **kw))
            out = tk.decode(*inputs, **kw)
        with tk.decode_tuning(**(tune | dict(last_split_merges=False))):
            row["vs_two_launches"] = max_rel(out, tk.decode(*inputs, **kw))
    except Exception as e:  # a kernel this device cannot compile
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return row
    row["tb_per_s"] = nbytes / (row["ms"] * 1e-3) / 1e12
    row.pop("ms_all", None), row.pop("latency_ms_all", None)
    if not agrees(row["vs_two_launches"]):
        row["ms_unchecked"] = row.pop("ms")
        row["error"] = f"output differs from the two launches' by {row['vs_two_launches']:.1e}"
    return row


def kernel_case(args, ctx, B, device, timer) -> dict:
    """One layer's decode at (ctx, B): the K2V2 kernel under the current tuning (``triton``) and under the library's
    defaults (``triton_default``), bfloat16 SDPA and FlashAttention, the same kernel over a bfloat16 context
    (``triton_bf16``: the whole context as its full-precision sink, no packed middle), and the keys read as KVarN
    tiles of KEY_TILE tokens (``triton_ktiles``, auto's ``+ktiles``; the same keys, so the same output)."""
    Hkv, d, SINK, RECENT = args.kv_heads, args.head_dim, args.sink, args.recent
    if ctx < SINK + RECENT:
        raise SystemExit(f"context {ctx} is shorter than --sink + --recent = {SINK + RECENT}")
    n_mid = ctx - SINK - RECENT
    bf16_kv = 2 * B * Hkv * ctx * d * 2
    fits, need = _shape_fits(args, ctx, B, device)
    if not fits:
        return {"context": ctx, "batch": B, "skipped": f"needs ~{need / 2**30:.1f} GiB"}
    bf = dict(device=device, dtype=torch.bfloat16)
    inputs, nbytes, store_s = kernel_inputs(args, ctx, B, device)
    q, scaling = inputs[0], inputs[-1]
    tuning = tk.current_tuning()
    k_p, v_p, block_n, _ = tuning.launch(q.dtype, inputs[4], inputs[5])
    row = {"context": ctx, "batch": B, "store_tokens_per_s": B * n_mid / store_s if store_s else None,
           "tuning": vars(tuning) | {}, "classes": [k_p, v_p], "splits": tk.default_splits(B, Hkv, ctx, block_n, device)}
    row["triton"] = timer(lambda: tk.decode(*inputs), args.warmup, args.iters, gpu=True) | {"bytes": nbytes}
    row["triton_compiled"] = compiled_decode(lambda: tk.decode(*inputs))
    held = (row["triton_compiled"] or {}).get("resident_programs")
    if held and device.type == "cuda":  # the waves the split count makes of what the device holds, not what it assumed
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        row["waves"] = B * Hkv * row["splits"] / (sms * held)
    # the split count before session 59's wave rule (tk.wave_splits): each pair's share of the device's slots rounded
    # up, ⌈slots / pairs⌉, which at 32k x 16 made 9 splits and a second wave of 96 programs (the rule: 8, one wave)
    ceil_splits = ceil_share_splits(B, Hkv, ctx, block_n, device)
    if ceil_splits != row["splits"] or args.dry_run:  # the dry run takes the path (both are 1 there)
        row["triton_ceil_splits"] = timer(lambda: tk.decode(*inputs, splits=ceil_splits), args.warmup, args.iters,
                                          gpu=True) | {"bytes": nbytes, "splits": ceil_splits}
    if tuning != tk.DecodeTuning():
        with tk.decode_tuning(**vars(tk.DecodeTuning())):
            row["triton_default"] = timer(lambda: tk.decode(*inputs), args.warmup, args.iters, gpu=True) | {"bytes": nbytes}
            default_out = tk.decode(*inputs)
    with tk.decode_tuning(**TILES):  # in the same run: the path session 46 timed
        row["triton_tiles"] = timer(lambda: tk.decode(*inputs), args.warmup, args.iters, gpu=True) | {"bytes": nbytes}
        tiles_out = tk.decode(*inputs)
    # a fast kernel counts only if it computes the same: the timed path's output against the tiles' (another way to
    # read the same codes; bfloat16 dots, so about 1e-3 apart)
    row["triton_vs_tiles"] = max_rel(tk.decode(*inputs), tiles_out)
    # the splits merged by each pair's last program (session 61), where the tuning launches the merge: what the
    # launch spared is worth (most at 1k tokens), and its output against the tiles' path, which merges in a launch
    # of its own (a fault in the counting or the memory ordering shows as a MISMATCH). One split a pair has nothing
    # to merge; the dry run has one: 2 there
    if (row["splits"] > 1 or args.dry_run) and not tuning.last_split_merges:
        kw = {"splits": 2} if args.dry_run else {}
        with tk.decode_tuning(last_split_merges=True, merge_always=False):
            row["triton_last_merges"] = timer(lambda: tk.decode(*inputs, **kw), args.warmup, args.iters, gpu=True) | {
                "bytes": nbytes, "splits": kw.get("splits", row["splits"])}
            row["triton_last_merges_vs_tiles"] = max_rel(tk.decode(*inputs, **kw), tiles_out)
    if "triton_default" in row:
        row["triton_default_vs_tiles"] = max_rel(default_out, tiles_out)
    # the keys as KVarN tiles of KEY_TILE tokens (auto's +ktiles) over the same codes: s_tok the per-token step, scale
    # 1 and zero ½ − 2^(b−1) on every channel give the same keys, so the output must agree with the paths above
    mk = inputs[4]
    ones = torch.ones(B, Hkv, -(-n_mid // KEY_TILE), d, device=device, dtype=torch.float16)
    kt = tk.Packed(tk.TileFormat(args.k_bits, d, KEY_TILE), mk.codes, mk.scale, tile_scale=ones, tile_zero=ones * mk.fmt.half)
    kt_inputs = (*inputs[:4], kt, *inputs[5:])
    with tk.decode_tuning(**UNCAPPED):  # the sweep's register cap would make these spill
        row["triton_ktiles"] = timer(lambda: tk.decode(*kt_inputs), args.warmup, args.iters, gpu=True) | {
            "bytes": nbytes + 2 * ones.numel() * 2}
        row["triton_ktiles_vs_tiles"] = max_rel(tk.decode(*kt_inputs), tiles_out)
    # keys and values as KVarN tiles (the kvarn method's layout) over the same codes: the values' scale the per-token
    # step, their zero ½ − 2^(b−1) times it, their channel scales 1, so again the same output. At the sweep's first
    # shape only (the issue's 32k x 16): its compiles must not push the end-to-end rows past gpu_check.sh's time
    if args.dry_run or [ctx, B] in _sweep_shapes(args)[:1]:
        mv = inputs[5]
        vt = tk.Packed(tk.TileFormat(args.v_bits, d, KEY_TILE), mv.codes, mv.scale, (mv.scale.float() * mv.fmt.half).half(),
                       tile_scale=torch.ones(B, Hkv, -(-n_mid // KEY_TILE), d, device=device, dtype=torch.float16))
        kv_inputs = (*inputs[:4], kt, vt, *inputs[6:])
        with tk.decode_tuning(**UNCAPPED):
            row["triton_kvarn"] = timer(lambda: tk.decode(*kv_inputs), args.warmup, args.iters, gpu=True) | {
                "bytes": nbytes + 2 * ones.numel() * 2 + vt.offset.numel() * 2 + vt.tile_scale.numel() * 2}
            row["triton_kvarn_vs_tiles"] = max_rel(tk.decode(*kv_inputs), tiles_out)
        del kv_inputs, vt, mv
    # keys centered on their rotating mean (auto's +rmean): the same codes, each tile's scores gaining Σ A cos pθ +
    # B sin pθ; checked against the tiles' path with the same bias (the bias itself against a reference: the CUDA tests)
    theta = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float32) / (d // 2))
    terms = torch.randn(B, args.q_heads, d, device=device, generator=torch.Generator(device).manual_seed(0)) * 0.05
    bias = tk.KeyBias(terms, torch.full((B,), SINK), theta)
    with tk.decode_tuning(**TILES):
        rmean_tiles = tk.decode(*inputs, key_bias=bias)
    with tk.decode_tuning(**UNCAPPED):
        row["triton_rmean"] = timer(lambda: tk.decode(*inputs, key_bias=bias), args.warmup, args.iters, gpu=True) | {"bytes": nbytes}
        row["triton_rmean_vs_tiles"] = max_rel(tk.decode(*inputs, key_bias=bias), rmean_tiles)
    if B > 1:
        ragged_case(args, row, inputs, timer)
    del inputs, tiles_out, kt_inputs, kt, ones, rmean_tiles
    # bfloat16 SDPA over the same context (K, V built after the packed cache is freed)
    K, V = torch.randn(B, Hkv, ctx, d, **bf), torch.randn(B, Hkv, ctx, d, **bf)
    q4 = q.unsqueeze(2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, K, V, scale=scaling, enable_gqa=True)  # noqa: E731
    for name, backends in (("sdpa", None), ("flash", [SDPBackend.FLASH_ATTENTION])):
        try:
            if backends is None:
                row[name] = timer(sdpa, args.warmup, args.iters, gpu=True)
            else:
                with sdpa_kernel(backends):
                    row[name] = timer(sdpa, args.warmup, args.iters, gpu=True)
            row[name]["bytes"] = bf16_kv + 2 * q.numel() * 2
        except RuntimeError as e:  # a backend that does not take this shape or device
            row[name] = {"error": str(e).splitlines()[0][:200]}
    # the same kernel over the bfloat16 context: what packing saves, apart from how good the kernel is
    fmt = tk.TokenFormat.of(QuestQuantizer(args.k_bits), d)
    empty = tk.Packed(fmt, torch.empty(B, Hkv, 0, fmt.nbytes, dtype=torch.uint8, device=device),
                      torch.empty(B, Hkv, 0, 1, dtype=torch.float16, device=device))
    lengths = torch.tensor([[ctx, 0, 0]] * B, dtype=torch.int32, device=device)
    none = K[:, :, :0]
    bf16_call = lambda: tk.decode(q, lengths, K, V, empty, empty, none, none, scaling)  # noqa: E731
    with tk.decode_tuning(**UNCAPPED):  # the whole context in that loop: pipelined and uncapped, as session 46 ran it
        row["triton_bf16"] = timer(bf16_call, args.warmup, args.iters, gpu=True) | {"bytes": bf16_kv + 2 * q.numel() * 2}
    row["triton_bf16_vs_sdpa"] = max_rel(bf16_call(), sdpa()[:, :, 0])
    del K, V
    return row


PLUGIN_BLOCK = 16  # vLLM's block size on a GPU


def plugin_case(args, row: dict, ctx: int, B: int, device, timer) -> None:
    """The vLLM plugin's decode of B requests of ``ctx`` tokens (``wushkv_vllm.paged.decode_batch`` on the GPU: the
    Triton kernel over K{k}V{v} per-token QuEST cells in vLLM's paged layout, PLUGIN_BLOCK-token blocks, the windows
    read in place from the pool of bfloat16 copies): ``plugin``, one layer alone (its host time the batch's plan too);
    ``plugin_step``, a layer of a step whose plan an earlier layer made (``host_ms``: what each further layer costs the
    host); ``plugin_gathered``, the windows gathered first (the path before session 72, now where a copy was dropped:
    here request 0's first sink copy), whose other requests must agree with the in-place read (``plugin_vs_gathered``);
    ``plugin_page_tiles``: tiles of one block's tokens, each block read once (``DecodeTuning.page_tiles``; the default
    tiles are of 32 tokens, over two blocks, each token's block looked up), as near the default's result
    (``plugin_page_tiles_vs_in_place``)."""
    from wushkv import triton_kernels as tk
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.decode import triton_enabled
    from wushkv_vllm.paged import SlotCodec, Windows, decode_batch

    Hq, Hkv, d, bs = args.q_heads, args.kv_heads, args.head_dim, PLUGIN_BLOCK
    sc = SlotCodec(QuantConfig(k_bits=args.k_bits, v_bits=args.v_bits, quantizer="quest",
                               windows=WindowConfig(args.sink, args.recent, 1)), d)
    per = -(-ctx // bs)
    cache = torch.zeros(B * per, Hkv, bs, sc.slot_bytes, dtype=torch.uint8, device=device)
    host_tables = torch.arange(B * per, dtype=torch.int32).view(B, per)
    tables = host_tables.to(device)
    w = Windows(bs, Hkv, d, args.sink, args.recent, capacity=1 << 30, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device).manual_seed(1)
    chunk = min(ctx, 4096)
    with triton_enabled(None if device.type == "cuda" else True):
        for r in range(B):  # the cells through the plugin's store (the Triton store kernel), the windows' copies
            for a in range(0, ctx, chunk):
                pos = torch.arange(a, min(ctx, a + chunk))
                slots = host_tables[r][pos // bs].long() * bs + pos % bs
                k = torch.randn(len(pos), Hkv, d, device=device, generator=g)
                v = torch.randn(len(pos), Hkv, d, device=device, generator=g)
                sc.store(cache, k, v, slots.to(device), slots)
                keep = (pos < args.sink) | (pos >= ctx - args.recent)
                if keep.any():
                    at = keep.nonzero().flatten()
                    w.write(k[at.to(device)], v[at.to(device)], slots[at], pos[at])
        q = torch.randn(B, Hq, d, device=device, dtype=torch.bfloat16)
        lens = torch.full((B,), ctx)
        nbytes = cache.numel() + 2 * B * Hkv * (args.sink + args.recent) * d * 2 + 2 * q.numel() * 2
        call = lambda plan=None: decode_batch(sc, cache, tables, lens, q, w, d**-0.5, host_table=host_tables, plan=plan)  # noqa: E731
        in_place = call()
        if in_place is None:
            row["plugin"] = {"error": "the plugin's Triton decode did not take these cells"}
            return
        row["plugin"] = timer(call, args.warmup, args.iters, gpu=True) | {"bytes": nbytes}
        plan = {}
        call(plan)
        row["plugin_step"] = timer(lambda: call(plan), args.warmup, args.iters, gpu=True) | {"bytes": nbytes}
        with tk.decode_tuning(page_tiles=True, block_n=bs):  # each tile of tokens' block read once (tiles of a block)
            row["plugin_page_tiles"] = timer(call, args.warmup, args.iters, gpu=True) | {"bytes": nbytes}
            row["plugin_page_tiles_vs_in_place"] = max_rel(call(), in_place)
        w.index[int(host_tables[0, 0]) * (bs // w.unit)] = -1  # request 0's first sink copy dropped: the batch gathers
        row["plugin_gathered"] = timer(call, args.warmup, args.iters, gpu=True) | {"bytes": nbytes}
        row["plugin_vs_gathered"] = max_rel(in_place[1:], call()[1:]) if B > 1 else 0.0
    del cache, w


def ceil_share_splits(B: int, Hkv: int, ctx: int, block_n: int, device) -> int:
    """default_splits as it was until session 59: ⌈multiprocessors × programs_per_sm / (B·Hkv)⌉, at most the tiles
    and 256 (1 off a GPU)."""
    if device.type != "cuda":
        return 1
    slots = torch.cuda.get_device_properties(device).multi_processor_count * tk.current_tuning().programs_per_sm
    return max(1, min(-(-slots // max(1, B * Hkv)), -(-max(ctx, 1) // block_n), 256))


def compiled_decode(fn, kernel: str = "decode") -> dict | None:
    """What the device's compiler built of the decode kernel (or ``kernel``) ``fn`` launches (one more call): registers
    and local memory (spills and stack; Triton's ``n_spills`` counts its 4-byte words) a thread, shared memory and
    warps a program, and the programs a multiprocessor holds of it by sm_90's rule (``resident_programs``,
    :func:`wushkv.triton_kernels.resident_warps`: what ``programs_per_sm`` should be; the compiler here may differ
    from the one kernel_sass.py ran). None under the interpreter, or with the reason where reading it failed (the
    timings around it stand)."""
    seen = {}

    def hook(name, grid, args, meta, run):
        k = run(name, grid, args, meta)
        if name == kernel and k is not None:
            seen.update(compile_readout(k, meta))
        return k

    try:
        with tk.launches_through(hook):
            fn()
    except Exception as e:  # noqa: BLE001  a diagnostic: never the reason a row's timings are lost
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    return seen or None


def compile_readout(k, meta: dict) -> dict:
    """:func:`compiled_decode`'s readout of a compiled kernel ``k`` (Triton's: ``n_regs``, ``n_spills`` in 4-byte
    words, ``metadata.shared`` and ``.num_warps``) launched with constexprs ``meta``."""
    md, words = getattr(k, "metadata", None), getattr(k, "n_spills", None)
    out = dict(registers=getattr(k, "n_regs", None), local_bytes=None if words is None else 4 * words,
               shared=getattr(md, "shared", None), num_warps=getattr(md, "num_warps", None), max_registers=meta.get("maxnreg"))
    if None not in (out["registers"], out["shared"], out["num_warps"]):
        out["resident_programs"] = tk.resident_warps(out["registers"], out["shared"], out["num_warps"]) // out["num_warps"]
    return out


def ragged_case(args, row: dict, inputs: tuple, timer) -> None:
    """A left-padded batch's rows (the transformers cache): row b's middle holds n_mid − pad_b tokens, the pads spread
    evenly over [0, 3/4 n_mid]. ``triton_ragged``: each row read over its own columns (``starts``); against
    ``triton_ragged_widest``, every row read as wide as the widest, its pad columns masked (before session 57)."""
    q, lengths, sk, sv, mk, mv, rk, rv, scaling = inputs
    B, n_mid, dev = q.shape[0], mk.codes.shape[2], q.device
    pads = torch.tensor([round(b * 3 * n_mid / 4 / (B - 1)) for b in range(B)])
    own = torch.tensor([[args.sink, 0, args.recent]] * B) + torch.stack([0 * pads, n_mid - pads, 0 * pads], 1)
    starts = torch.stack([0 * pads, pads, 0 * pads], 1).to(dev, torch.int32)
    own = own.to(dev, torch.int32)
    ctx = args.sink + n_mid + args.recent
    col = torch.arange(ctx, device=dev)
    allowed = (col < args.sink) | (col >= args.sink + pads.to(dev)[:, None])  # (B, ctx): the pad columns hidden
    ragged = lambda: tk.decode(q, own, sk, sv, mk, mv, rk, rv, scaling, starts=starts)  # noqa: E731
    widest = lambda: tk.decode(q, lengths, sk, sv, mk, mv, rk, rv, scaling, allowed=allowed)  # noqa: E731
    row["ragged_own_columns"] = float(own.sum() / lengths.sum())
    row["triton_ragged"] = timer(ragged, args.warmup, args.iters, gpu=True)
    row["triton_ragged_widest"] = timer(widest, args.warmup, args.iters, gpu=True)
    row["triton_ragged_vs_widest"] = max_rel(ragged(), widest())
    if "ms" in row["triton_ragged"] and "ms" in row["triton_ragged_widest"]:
        row["triton_ragged_over_widest"] = row["triton_ragged"]["ms"] / row["triton_ragged_widest"]["ms"]


# Outputs further apart than this (largest difference over the largest magnitude) mark a row MISMATCH: bfloat16
# dots over a long context land about 1e-3 apart; a kernel that reads the codes wrong lands at O(1)
AGREE = 2e-2


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out − ref| / max |ref| in float32 (NaN where either holds NaN)."""
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def agrees(v: float) -> bool:
    return v <= AGREE  # False for NaN too

def add_bandwidth(row: dict, peak: float | None) -> None:
    for name in ("triton", "triton_default", "triton_tiles", "triton_ktiles", "triton_kvarn", "triton_rmean", "sdpa", "flash",
                 "triton_bf16", "triton_ceil_splits", "triton_last_merges", "plugin", "plugin_step", "plugin_page_tiles",
                 "plugin_gathered"):
        r = row.get(name)
        if isinstance(r, dict) and "ms" in r:
            r["tb_per_s"] = r["bytes"] / (r["ms"] * 1e-3) / 1e12
            r["peak_fraction"] = r["tb_per_s"] / peak if peak else None
    if "ms" in row.get("triton", {}):
        for name in ("sdpa", "flash", "triton_bf16", "triton_tiles", "triton_ceil_splits", "triton_last_merges"):
            if "ms" in row.get(name, {}):
                row[f"triton_over_{name}"] = row["triton"]["ms"] / row[name]["ms"]
    for name in ("triton_ktiles", "triton_kvarn", "triton_rmean", "plugin", "plugin_step", "plugin_page_tiles", "plugin_gathered"):
        if "ms" in row.get(name, {}) and "ms" in row.get("sdpa", {}):
            row[f"{name}_over_sdpa"] = row[name]["ms"] / row["sdpa"]["ms"]


def tiny_llama(args, device, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    d, Hq, Hkv = args.head_dim, args.q_heads, args.kv_heads
    cfg = LlamaConfig(vocab_size=1024, hidden_size=Hq * d, intermediate_size=2 * Hq * d, num_hidden_layers=args.e2e_layers,
                      num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=d, max_position_embeddings=1 << 18)
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: seconds on the GPU instead of a minute on the host
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def e2e_case(args, model, ctx, B, device, timer) -> dict:
    from transformers import DynamicCache

    from wushkv.cache import WushKVCache
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.layer import CacheInputs, RotatingKeyMean

    Hkv, d, L = args.kv_heads, args.head_dim, args.e2e_layers
    need = 2 * L * B * Hkv * ctx * d * 2 * 2  # a bfloat16 cache, and room for the packed one's fill
    if need > args.memory_fraction * free_bytes(device):
        return {"context": ctx, "batch": B, "skipped": f"needs ~{need / 2**30:.1f} GiB"}
    windows = WindowConfig(args.sink, args.recent, args.flush)
    wmodel = copy.deepcopy(model)  # the packed cache switches its model to the wushkv attention
    row = {"context": ctx, "batch": B}
    ids = torch.randint(3, 1000, (B, 1), device=device)
    configs = {"wushkv_triton": QuantConfig(args.k_bits, args.v_bits, "quest", windows=windows),
               "wushkv_pytorch": QuantConfig(args.k_bits, args.v_bits, "quest", windows=windows),
               # auto's kind of pick (SmolLM2's +rmean+ktiles): KVarN key tiles of KEY_TILE tokens (flushed a tile
               # at a time) centered on a rotating mean, affine values per token
               "wushkv_auto": QuantConfig(args.k_bits, args.v_bits, "affine", key_quantizer="kvarn",
                                          windows=WindowConfig(args.sink, args.recent, KEY_TILE))}
    rope = wmodel.model.rotary_emb
    g = torch.Generator().manual_seed(0)
    centered = [CacheInputs(key_mean=RotatingKeyMean(torch.randn(Hkv, d, generator=g) * 2,
                                                     torch.eye(d, device=device).expand(Hkv, d, d),
                                                     (rope.inv_freq.float().cpu(), float(rope.attention_scaling))))
                for _ in range(L)]
    for name, enabled in (("dynamic", None), ("wushkv_triton", True), ("wushkv_pytorch", False), ("wushkv_auto", True)):
        m = model if name == "dynamic" else wmodel
        cache = (DynamicCache(config=m.config) if name == "dynamic" else
                 WushKVCache(m, configs[name], inputs=centered if name == "wushkv_auto" else None))
        for i in range(L):  # fill each layer with random keys and values (chunks: no second full copy)
            for a in range(0, ctx, 8192):
                n = min(8192, ctx - a)
                k = torch.randn(B, Hkv, n, d, device=device, dtype=model.dtype)
                v = torch.randn_like(k)
                cache.layers[i].update(k, v) if name != "dynamic" else cache.update(k, v, i)
        # auto's key tiles and +rmean without the sweep's register cap, as their kernel row (they spill under one)
        uncapped = UNCAPPED if name == "wushkv_auto" else {}
        with torch.no_grad(), decode_mod.triton_enabled(enabled if name != "dynamic" else None), tk.decode_tuning(**uncapped):
            step = lambda: m(ids, cache=cache, use_cache=True)  # noqa: E731
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                held = torch.cuda.memory_allocated(device)
            tk.reset_calls()
            row[name] = timer(step, args.warmup, args.e2e_steps)
            calls = tk.calls()
            row[name]["triton_launches"] = calls.get("decode", 0)
            row[name]["triton_store_launches"] = calls.get("store", 0)
            steps = args.warmup + max(1, args.e2e_steps)
            if name in ("wushkv_triton", "wushkv_auto") and calls.get("decode", 0) != L * steps:
                row[name]["error"] = (f"{calls.get('decode', 0)} Triton decode launches in {steps} steps of {L} layers: "
                                      "the step did not run the kernels (is transformers the version wushkv requires?)")
            if device.type == "cuda":
                row[name]["step_peak_bytes_above_cache"] = torch.cuda.max_memory_allocated(device) - held
        del cache
    for name in ("wushkv_triton", "wushkv_pytorch", "wushkv_auto"):
        row[f"{name}_over_dynamic"] = row[name]["ms"] / row["dynamic"]["ms"]
    return row


def feedback_store_row(args, B, device, timer) -> dict:
    """One flush of --feedback-tokens bfloat16 tokens of B sequences with ``+ldlq`` error feedback (a QuEST
    :class:`~wushkv.codecs.TokenCodec` at --v-bits with a random unit upper-triangular F, what ``auto``'s values store)
    through :func:`wushkv.decode.encode_block`: the Triton store kernel (one launch) against the PyTorch path
    (``feedback_round``'s loop over the d channels, a few launches each), and the share of codes the two write apart
    (QuEST's step sums ‖x‖ in another order: a last bit, and a code with it, now and then). Then the same tokens as
    KVarN key tiles at --k-bits (``ktiles_*``: auto's keys, tile clip 1.7, the same F along the channels): the tile
    kernel against KVarN's balance and rows in PyTorch. ``compiled`` / ``ktiles_compiled``: what the device's compiler
    built of each kernel (registers, spills; ``kernel_sass.py --stores`` counts them for sm_90 without a GPU)."""
    from wushkv.codecs import KVarNCodec, TokenCodec
    from wushkv.decode import encode_block, triton_enabled

    d, H = args.head_dim, args.kv_heads
    g = torch.Generator().manual_seed(0)
    F = ((torch.randn(H, d, d, generator=g) * 0.1).triu(1) + torch.eye(d)).to(device)
    x = torch.randn(B, H, args.feedback_tokens, d, device=device, dtype=torch.bfloat16)
    row = {"batch": B, "tokens": args.feedback_tokens, "head_dim": d, "kv_heads": H, "bits": args.v_bits}
    # the values' per-token codes, then the same tokens as the keys' KVarN tile (+ktiles, tile clip 1.7, F along
    # the channels): each through its kernel and through PyTorch
    codecs = {"": TokenCodec(QuestQuantizer(args.v_bits), d, torch.float16, feedback=F),
              "ktiles_": KVarNCodec(args.k_bits, d, args.feedback_tokens, "key", clip=1.7, feedback=F)}
    for prefix, codec in codecs.items():
        stored = {}
        for name, on in (("triton", True), ("pytorch", False)):
            with triton_enabled(on):
                stored[name] = encode_block(codec, x)
                row[prefix + name] = timer(lambda: encode_block(codec, x), args.warmup, args.iters, gpu=True)
                if on:
                    row[prefix + "compiled"] = compiled_decode(lambda: encode_block(codec, x),
                                                               "kvarn_keys" if prefix else "store")
        row[prefix + "pytorch_over_triton"] = row[prefix + "pytorch"]["ms"] / row[prefix + "triton"]["ms"]
        row[prefix + "codes_apart"] = (stored["triton"]["codes"] != stored["pytorch"]["codes"]).float().mean().item()
    return row


def _tuning_value(v: str):
    """A --tuning value: True/False (class_split), None (by the path) or an int."""
    named = {"True": True, "False": False, "None": None}
    return named[v] if v in named else int(v)


def run(args, save=None) -> dict:
    """Every kernel and end-to-end row; ``save(result)`` after each (a run cut short keeps what it measured)."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_decode.py needs a CUDA device (or --dry-run)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter, dry run)"
    peak = peak_tbps(name, args.peak_tbps)
    timer = Timer(device)
    try:
        import transformers
        import triton
    except ImportError as e:
        raise SystemExit(f"gpu_decode.py needs triton and transformers: {e}")
    out = {"device": name, "peak_tbps": peak, "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "args": vars(args), "kernel": [], "e2e": []}
    save = save or (lambda result: None)
    tuning = {k: _tuning_value(v) for k, v in (kv.split("=") for kv in args.tuning.split(",") if kv)}
    if args.sweep:
        out["sweep"] = sweep(args, device, timer)
        tuning = out["sweep"].get("best", {})
        save(out)
    with tk.decode_tuning(**tuning):
        out["tuning"] = vars(tk.current_tuning()) | {}
        print(f"rows under {out['tuning']}", flush=True)
        _rows(args, out, device, timer, peak, save)
    out["acceptance"] = acceptance(out)
    save(out)
    print(verdict(out["acceptance"], out["device"]), flush=True)
    return out


def verdict(acc: dict, device: str) -> str:
    """The acceptance bars as lines to read at the end of a run."""
    lines = [f"issue #33 acceptance on {device}: {'ALL MET' if acc['all'] else 'not all met'}"]
    for k, v in acc.items():
        if k != "all":
            val = "not measured" if v["value"] is None else f"{v['value']:.3g}"  # nan prints as nan
            state = "-" if v["pass"] is None else "PASS" if v["pass"] else "FAIL"
            lines.append(f"  {state:4} {v['what']}: {val} (bar {v['bar']})")
    return "\n".join(lines)


def _rows(args, out, device, timer, peak, save) -> None:
    if args.widths:
        ctx, B = args.contexts[0], args.batches[0]
        out["widths"] = []
        for bits in args.widths:
            a = copy.copy(args)
            a.k_bits = a.v_bits = bits
            inputs, nbytes, _ = kernel_inputs(a, ctx, B, device)
            row = {"context": ctx, "batch": B, "bits": bits, "triton": timer(lambda: tk.decode(*inputs), args.warmup, args.iters, gpu=True) | {"bytes": nbytes}}
            with tk.decode_tuning(**TILES):
                tiles_out = tk.decode(*inputs)
            row["triton_vs_tiles"] = max_rel(tk.decode(*inputs), tiles_out)
            add_bandwidth(row, peak)
            out["widths"].append(row)
            save(out)
            print(f"K{bits}V{bits} ctx {ctx} batch {B}: {row['triton']['ms']:.3f} ms, {row['triton']['tb_per_s']:.2f} TB/s, "
                  f"vs tiles {row['triton_vs_tiles']:.1e}" + (" MISMATCH" if not agrees(row["triton_vs_tiles"]) else ""), flush=True)
            del inputs, tiles_out
    for ctx in args.contexts:
        for B in args.batches:
            row = kernel_case(args, ctx, B, device, timer)
            add_bandwidth(row, peak)
            out["kernel"].append(row)
            save(out)
            print(summary(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out["feedback_store"] = []
    for B in args.feedback_batches:
        row = feedback_store_row(args, B, device, timer)
        out["feedback_store"].append(row)
        save(out)
        print(f"flush of {row['tokens']} tokens x {B} with error feedback: Triton {row['triton']['ms']:.3f} ms, PyTorch "
              f"{row['pytorch']['ms']:.3f} ms ({row['pytorch_over_triton']:.1f}x), codes apart {row['codes_apart']:.1e}; "
              f"key tiles: Triton {row['ktiles_triton']['ms']:.3f} ms, PyTorch {row['ktiles_pytorch']['ms']:.3f} ms "
              f"({row['ktiles_pytorch_over_triton']:.1f}x), codes apart {row['ktiles_codes_apart']:.1e}", flush=True)
    model = tiny_llama(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    for ctx in args.e2e_contexts:
        for B in args.e2e_batches:
            row = e2e_case(args, model, ctx, B, device, timer)
            out["e2e"].append(row)
            save(out)
            print(summary(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del model
    # last, so that a run cut short by gpu_check.sh's timeout loses only these: the vLLM plugin's decode, added to
    # the kernel row of its shape (beside that row's SDPA)
    rows = {(r["context"], r["batch"]): r for r in out["kernel"] if "skipped" not in r}
    for ctx, B in ([int(v) for v in shape.split("x")] for shape in args.plugin.split(",") if shape):
        if (ctx, B) in rows:
            row = rows[ctx, B]
            plugin_case(args, row, ctx, B, device, timer)
            add_bandwidth(row, peak)
            save(out)
            print(f"ctx {ctx:>7} batch {B:>3}: vLLM plugin " + ", ".join(
                f"{k} {v['ms']:.3f} ms" + (f" (host {v['host_ms']:.3f} ms)" if "host_ms" in v else "")
                for k, v in row.items() if k.startswith("plugin") and isinstance(v, dict) and "ms" in v)
                  + "".join(f", {k} {row[k]:.2f}x" for k in row if k.startswith("plugin") and k.endswith("_over_sdpa"))
                  + f", plugin_vs_gathered {row.get('plugin_vs_gathered', float('nan')):.1e}"
                  + f", plugin_page_tiles_vs_in_place {row.get('plugin_page_tiles_vs_in_place', float('nan')):.1e}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _bar(value, op: str, bar: float, what: str) -> dict:
    """One bar: ``pass`` None where not measured (``value`` None), False for NaN (a kernel that wrote NaN)."""
    met = None if value is None else (value <= bar if op == "<=" else value >= bar)  # NaN compares False
    return {"what": what, "bar": f"{op} {bar}", "value": value, "pass": met}


def acceptance(result: dict) -> dict:
    """Issue #33's bars read off a run's rows (None where its shape was not measured): decode attention over the K2V2
    cache at 32k tokens x 16 sequences at most 0.5x bfloat16 SDPA's device time and at least 50% of the device's peak
    bandwidth; at 1k tokens at most 1.2x SDPA at every batch timed; end to end at 32k x 16 at most 0.8x
    DynamicCache's time a token; no full-precision copy of the middle in a step (the allocator's peak above the
    cache below one layer's middle keys in bfloat16); and every row's output agreeing with the tiles' path (or
    SDPA), since a fast kernel counts only if it computes the same. ``all``: True only when every bar was measured
    and met."""
    kern = {(r["context"], r["batch"]): r for r in result.get("kernel", []) if "skipped" not in r}
    e2e = {(r["context"], r["batch"]): r for r in result.get("e2e", []) if "skipped" not in r}
    r = kern.get((32768, 16), {})
    ones = [k.get("triton_over_sdpa") for (c, _), k in kern.items() if c == 1024]
    e = e2e.get((32768, 16), {})
    args = result.get("args", {})
    middle_keys = 16 * args.get("kv_heads", 8) * (32768 - args.get("sink", 64) - args.get("recent", 256)) * args.get("head_dim", 128) * 2
    peak = e.get("wushkv_triton", {}).get("step_peak_bytes_above_cache")
    checks = [v for row in (*result.get("kernel", []), *result.get("widths", [])) for k, v in row.items()
              if k.endswith(("_vs_tiles", "_vs_sdpa", "_vs_widest", "_vs_gathered"))]
    out = {
        "kernel_32k_b16_over_sdpa": _bar(r.get("triton_over_sdpa"), "<=", 0.5, "decode attention / bf16 SDPA, 32k x 16"),
        "kernel_32k_b16_peak_fraction": _bar(r.get("triton", {}).get("peak_fraction"), ">=", 0.5,
                                             "achieved bandwidth / peak, 32k x 16"),
        "kernel_1k_over_sdpa": _bar(max(ones) if ones and None not in ones else None, "<=", 1.2,
                                    "decode attention / bf16 SDPA at 1k, worst batch"),
        "e2e_32k_b16_over_dynamic": _bar(e.get("wushkv_triton_over_dynamic"), "<=", 0.8,
                                         "time a token / DynamicCache's, 32k x 16"),
        "e2e_step_peak_over_middle_keys": _bar(None if peak is None else peak / middle_keys, "<=", 1.0,
                                               "a step's allocator peak above the cache / one layer's middle keys in bf16"),
        "outputs_agree": _bar(max(checks, key=lambda v: math.inf if math.isnan(v) else v) if checks else None, "<=", AGREE,
                              "largest disagreement of a timed kernel's output"),
    }
    out["all"] = all(v["pass"] for v in out.values())
    return out


def summary(row: dict) -> str:
    head = f"ctx {row['context']:>7} batch {row['batch']:>3}"
    if "skipped" in row:
        return f"{head}: skipped ({row['skipped']})"
    parts = []
    for k, v in row.items():
        if isinstance(v, dict) and "ms" in v:
            frac = v.get("peak_fraction")
            lat = f", {v['latency_ms']:.3f} ms alone" if "latency_ms" in v else ""
            parts.append(f"{k} {v['ms']:.3f} ms" + (f" ({100 * frac:.0f}% of peak{lat})" if frac else f" ({lat[2:]})" if lat else ""))
        if isinstance(v, dict) and "error" in v:
            parts.append(f"{k} ERROR {v['error']}")
        elif k.endswith(("_over_sdpa", "_over_flash", "_over_triton_bf16", "_over_triton_tiles", "_over_dynamic",
                         "_over_widest", "_over_triton_ceil_splits", "_over_triton_last_merges")):
            parts.append(f"{k} {v:.2f}x")
        elif k.endswith(("_vs_tiles", "_vs_sdpa", "_vs_widest", "_vs_gathered")):
            parts.append(f"{k} {v:.1e}" + (" MISMATCH" if not agrees(v) else ""))
    c = row.get("triton_compiled")
    if c and "error" not in c:
        parts.append(f"decode kernel: {c['registers']} registers, {c['local_bytes']} B local, {c['shared']} B shared, "
                     f"{c['num_warps']} warps" + (f", {c['resident_programs']} programs a multiprocessor" if
                                                  "resident_programs" in c else ""))
    if "waves" in row:
        parts.append(f"{row['splits']} splits: {row['waves']:.2f} waves")
    return f"{head}: " + ", ".join(parts)


def plot(result: dict, path) -> str:
    """PNG of the kernel rows: the K2V2 kernel's time over bfloat16 SDPA's by context, one line per batch, and the
    same kernel over the bfloat16 context (dashed line: the issue's 0.5 target)."""
    from wushkv.report import plot_lines

    rows = [r for r in result["kernel"] if "triton_over_sdpa" in r]
    contexts = sorted({r["context"] for r in rows})
    series = {}
    for B in sorted({r["batch"] for r in rows}):
        by_ctx = {r["context"]: r for r in rows if r["batch"] == B}
        series[f"K2V2 kernel / SDPA, batch {B}"] = [by_ctx[c]["triton_over_sdpa"] if c in by_ctx else float("nan") for c in contexts]
        series[f"same kernel over bf16 / SDPA, batch {B}"] = [
            by_ctx[c]["triton_bf16"]["ms"] / by_ctx[c]["sdpa"]["ms"] if c in by_ctx and "ms" in by_ctx[c].get("triton_bf16", {})
            else float("nan") for c in contexts]
    return str(plot_lines([math.log2(c) for c in contexts], series, path, "log2(context tokens)",
                          "decode attention time / bf16 SDPA", f"Triton decode, one layer, {result['device']}",
                          logy=True, hline=0.5, hlabel="target 0.5"))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.plot_from:  # redraw a saved run's figure, and say its acceptance
        with open(args.plot_from) as f:
            res = json.load(f)
        print(verdict(acceptance(res), res.get("device", "?")))
        if args.plot:
            print(f"wrote {plot(res, args.plot)}")
        return res
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_decode.json")
    res = run(args, save=lambda result: write_json(path, result))
    print(f"wrote {write_json(path, res)}")
    if args.plot:
        print(f"wrote {plot(res, args.plot)}")
    return res


if __name__ == "__main__":
    main()
