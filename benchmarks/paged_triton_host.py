"""The vLLM plugin's GPU decode path (``wushkv_vllm.paged.decode_batch`` through the Triton kernel) on the host, with
the kernel's launch skipped: what a decode step of one layer costs before the GPU runs the kernel, and what it makes
the GPU move besides the kernel's reads of the codes.

    python benchmarks/paged_triton_host.py [--contexts 1024,4096] [--requests 1,16,64] [--layouts per_token,key_tiles]
        [--repeats 30] [--json out.json]

Two ways to hand the kernel the full-precision windows (the sink and recent tokens whose copies the plugin keeps in a
pool of pages, ``wushkv_vllm.paged.Windows``), both in the same run:

* ``in_place`` (the path whenever every window position a query reads has its copy): the kernel reads the copies
  from the pool through a small table of pool rows (``wushkv.triton_kernels.PoolWindows``);
* ``in_place_step``: the same for a whole step of ``--layers`` layers, per layer: the layers of a step share what
  the first works out from the batch and the windows' bookkeeping (``plan``, as the plugin's forward passes it:
  ``wushkv_vllm.backend.step_plan``), so the others only launch;
* ``gathered`` (the path before session 72, now only where a copy was dropped past the pool's capacity: forced here
  by dropping one copy of the batch's first request): the windows of every request are gathered into new tensors
  first: the pool indexed into float32, zeros written over the dropped positions, the copy converted to the model's
  dtype, which the kernel then reads. On a GPU those are device operations; here, on CPU tensors, their arithmetic
  runs on this machine, so ``gathered_ms`` counts it too (its host time alone is less).

Also a step's **whole later layer** on the GPU path (``layer``: the new tokens' store into their cells, their window
copies' write, the key tiles they complete, the decode through the step's plan, as the plugin's forward makes them):
its host time, its torch operations (on a GPU most are launches; counted under a ``TorchDispatchMode``, the Triton
kernels' launches recorded apart) and ``layer/decode``, its time over the decode's alone.

Shapes: SmolLM2-135M served by the plugin (3 KV heads of 64, GQA 3, 128-token blocks, bfloat16 copies), 2-bit codes
(``--layouts``: ``per_token``, QuEST both sides; ``key_tiles``, ``auto``'s: KVarN key tiles of 128 tokens and QuEST
values, ``+ldlq`` on both), ``auto``'s windows for it (sink 128, recent 72, flushed 128 at a time). ``window_bytes_*`` are the bytes
of window copies a step of one layer moves on the device: in place, the kernel's reads (the copies once, in the
model's dtype); gathered, the gather's reads and writes too (the pool read, float32 written, the mask's read and
write, the conversion's read and write, the kernel's read). The middle's codes are read alike on both paths.
Time per call: the median of ``--repeats`` calls after 3 more.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the launches are skipped anyway
if __name__ == "__main__":  # a GPU's path has none of wushkv's C++ kernels: where the Triton store declines a codec,
    os.environ.setdefault("WUSHKV_NO_EXT", "1")  # torch encodes it there, not paged_store (set before they load)

import torch  # noqa: E402

H, G, D, BLOCK = 3, 3, 64, 128
SINK, RECENT, FLUSH = 128, 72, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--requests", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30, help="layers a step (SmolLM2-135M: 30)")
    ap.add_argument("--layouts", default="per_token,key_tiles",
                    help="cells: per_token (QuEST both sides), key_tiles (auto's: KVarN key tiles, +ldlq values)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _codec(layout: str):
    """The cells' SlotCodec: per-token QuEST codes on both sides, or ``auto``'s layout for SmolLM2 (KVarN key tiles
    of 128 tokens, per-token QuEST values; ``+ldlq`` error feedback on both, a random unit upper-triangular F)."""
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv_vllm.paged import SlotCodec

    windows = WindowConfig(SINK, RECENT, FLUSH)
    if layout == "per_token":
        return SlotCodec(QuantConfig(k_bits=2, v_bits=2, quantizer="quest", windows=windows), D)
    if layout == "key_tiles":
        F = torch.eye(D).expand(H, D, D) + torch.triu(torch.randn(H, D, D, generator=torch.Generator().manual_seed(0)) * 0.1, 1)
        return SlotCodec(QuantConfig(k_bits=2, v_bits=2, quantizer="quest", key_quantizer="kvarn", windows=windows), D, F, F)
    raise ValueError(f"--layouts takes per_token and key_tiles, got {layout!r}")


def _windows(R: int, n: int, tables: torch.Tensor):
    """Windows holding the copies of every window position of R requests of n tokens, written as the plugin writes
    them (the open key tile's too: a tile of 128 tokens opened by position n − 1)."""
    from wushkv_vllm.paged import Windows

    w = Windows(BLOCK, H, D, SINK, RECENT, capacity=10**6, dtype=torch.bfloat16, flush=FLUSH)
    g = torch.Generator().manual_seed(R * n)
    for r in range(R):
        pos = torch.tensor(w.positions(n))
        slots = tables[r][pos // BLOCK].long() * BLOCK + pos % BLOCK
        w.write(torch.randn(len(pos), H, D, generator=g), torch.randn(len(pos), H, D, generator=g), slots, pos)
    return w


def _batch(R: int, n: int, layout: str = "per_token"):
    """(SlotCodec, cells, block tables, Windows) of R requests of n tokens: zero cells (the kernel is not run), the
    windows' copies of every request written as the plugin writes them."""
    sc = _codec(layout)
    per = -(-(n + 1) // BLOCK)
    cache = torch.zeros(R * per, H, BLOCK, sc.slot_bytes, dtype=torch.uint8)
    tables = torch.arange(R * per, dtype=torch.int32).view(R, per)
    return sc, cache, tables, _windows(R, n, tables)


def _layer(sc, cache, tables, w, n: int, plan: dict, new) -> None:
    """A decode step's layer on the plugin's GPU path, as its forward makes it (``wushkv_vllm.backend``): the step's
    new tokens (one a request, at position n) stored into their cells, their copies written, the key tiles they
    complete written, then the decode through the step's ``plan``."""
    from wushkv_vllm.paged import decode_batch, store_tiles

    k, v, q, slots, lens = new
    sc.store(cache, k, v, slots, slots)
    w.write(k, v, slots)
    if sc.tile:
        store_tiles(sc, cache, w, slots)
    decode_batch(sc, cache, tables, lens, q, w, 0.125, host_table=tables, plan=plan)


def _later_layer(R: int, n: int, layout: str, repeats: int) -> tuple[float, int, list]:
    """A step's later layer (its windows in the state the first layer's were in, the step's plan made by that one):
    (median ms, torch operations, the kernel launches it asks for). On a GPU each torch operation is a launch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from wushkv import triton_kernels as tk

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    sc, cache, tables, w0 = _batch(R, n, layout)
    w1 = _windows(R, n, tables)
    g = torch.Generator().manual_seed(1)
    slots = tables[:, n // BLOCK].long() * BLOCK + n % BLOCK
    new = (torch.randn(R, H, D, generator=g), torch.randn(R, H, D, generator=g), torch.randn(R, H * G, D, generator=g),
           slots, torch.full((R,), n + 1))
    times, launches, count = [], [], Count()

    def once(i: int) -> None:
        plan = {}  # a step: both layers write the same slots (their windows' versions stay equal)
        _layer(sc, cache, tables, w0, n, plan, new)
        launches.clear()
        with count if i < 0 else contextlib.nullcontext():  # the operations counted apart from the timed runs
            t0 = time.perf_counter()
            _layer(sc, cache, tables, w1, n, plan, new)
            t = time.perf_counter() - t0
        if i >= 3:
            times.append(t)

    with tk.launches_through(lambda name, grid, args, meta, run: launches.append(name)):  # recorded, not run
        for i in range(-1, 3 + repeats):
            once(i)
    return statistics.median(times) * 1e3, count.n, sorted(launches)


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(contexts: list[int], requests: list[int], repeats: int, layers: int = 30,
        layouts: tuple[str, ...] = ("per_token", "key_tiles")) -> list[dict]:
    from wushkv import triton_kernels as tk
    from wushkv.decode import triton_enabled
    from wushkv_vllm.paged import decode_batch

    seen = []

    def skip(name, grid, args, meta, run):  # every launch skipped; the decode's FP_UNIT says which path made it
        if name == "decode":
            seen.append(meta["FP_UNIT"])

    rows = []
    print(f"{'layout':>9s} {'context':>8s} {'requests':>9s} {'in place ms':>12s} {'a step, per layer':>18s} "
          f"{'gathered ms':>12s} {'gathered/in place':>18s} {'in place/step':>14s} {'window MB in place':>19s} "
          f"{'gathered':>9s} {'layer ms':>9s} {'layer/decode':>13s} {'torch ops':>10s}  launches")
    for layout, n, R in ((lay, n, R) for lay in layouts for n in contexts for R in requests):
        sc, cache, tables, w = _batch(R, n, layout)
        q = torch.randn(R, H * G, D)
        lens = torch.full((R,), n)
        call = lambda: decode_batch(sc, cache, tables, lens, q, w, 0.125, host_table=tables)  # noqa: E731
        row = {"layout": layout, "context": n, "requests": R}
        with triton_enabled(True), tk.launches_through(skip):
            row["in_place_ms"] = _median_ms(call, repeats)
            assert seen[-1] == w.unit, "the windows were not read in place"

            def step():  # every layer of a step, one plan (each layer's windows in the same state)
                plan = {}
                for _ in range(layers):
                    decode_batch(sc, cache, tables, lens, q, w, 0.125, host_table=tables, plan=plan)

            row["in_place_step_ms_per_layer"] = _median_ms(step, max(3, repeats // 5)) / layers
            page = int(tables[0, 0]) * (BLOCK // w.unit)
            w.index[page], kept = -1, int(w.index[page])  # one copy of request 0 dropped: the batch gathers
            row["gathered_ms"] = _median_ms(call, repeats)
            assert seen[-1] == 0, "a dropped copy did not make the batch gather its windows"
            w.index[page] = kept
            # the whole layer: its store, window write, key tiles and decode (a later layer of the step)
            row["layer_ms"], row["layer_torch_ops"], row["layer_launches"] = _later_layer(R, n, layout, max(3, repeats // 3))
        e = w.pool.element_size()
        P = len(w.positions(n))  # window positions a request reads
        elems = R * P * H * 2 * D
        row["window_bytes_in_place"] = elems * e
        row["window_bytes_gathered"] = elems * (e + 4 + 4 + 4 + 4 + e + e)
        row["gathered_over_in_place"] = row["gathered_ms"] / row["in_place_ms"]
        row["in_place_over_step"] = row["in_place_ms"] / row["in_place_step_ms_per_layer"]
        row["layer_over_decode"] = row["layer_ms"] / row["in_place_step_ms_per_layer"]
        rows.append(row)
        print(f"{layout:>9s} {n:8d} {R:9d} {row['in_place_ms']:12.2f} {row['in_place_step_ms_per_layer']:18.3f} "
              f"{row['gathered_ms']:12.2f} {row['gathered_over_in_place']:17.2f}x {row['in_place_over_step']:13.2f}x "
              f"{row['window_bytes_in_place'] / 1e6:19.2f} {row['window_bytes_gathered'] / 1e6:9.2f} "
              f"{row['layer_ms']:9.3f} {row['layer_over_decode']:12.2f}x {row['layer_torch_ops']:10d}  "
              f"{','.join(row['layer_launches'])}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run([int(c) for c in args.contexts.split(",")], [int(r) for r in args.requests.split(",")], args.repeats,
               args.layers, tuple(x for x in args.layouts.split(",") if x))
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, {"settings": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
