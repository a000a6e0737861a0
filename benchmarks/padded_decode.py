"""Decode of a left-padded batch (prompts of different lengths, as ``generate`` batches them) in wushkv's
transformers cache, one layer's attention of one new token per row: read from the codes with one mask per row
(``KVView._decode_padded``) against the emulation it replaced (every column of every row built in full precision
and quantized, ``KVView._attend_padded``) and against the same batch without padding read from the codes, in the same
run.

    python benchmarks/padded_decode.py [--contexts 4096,16384] [--batches 4,8] [--shapes smollm2,llama8b]
                                        [--threads 2] [--steps 24] [--pad-spread 0.25] [--no-per-token] [--no-tiles]
                                        [--json out.json]

Shapes: ``smollm2`` (3 KV heads, GQA 3, head_dim 64), ``llama8b`` (8 KV heads, GQA 4, head_dim 128); keys and values
K2V2 affine, float32; sink 64 and recent 256 tokens in full precision (the generation windows). Row ``b`` of a batch
of B holds ``context − pad_b`` real tokens, the pads spread evenly over ``[0, context · pad_spread]``. The cache is filled
through the layer's own ``update`` with random keys and values (no model: the attention is what is timed). Time per
call is the best of ``--repeats`` means of 3 calls; ``largest_mb`` is the largest single allocation of one call
(torch's profiler), where the emulation holds the whole middle in full precision; ``fp_mb_padded`` / ``_unpadded``
what the layer holds in full precision (the rows' sinks and the recent buffer) with and without the padding.

Key tiles (``--tiles``, on by default; ``auto``'s cells on SmolLM2: KVarN tiles of 16 tokens for the keys, QuEST
values, windows 64/256/16): a padded batch keeps each row's tokens from column 0 (ragged rows). One decode step, update
and attention, of the whole batch at once against the replaced path, one unpadded layer per row stepped and attended
in turn, in the same run: ``tiles_rows_ms`` / ``tiles_ragged_ms`` on the PyTorch path (the median of ``--steps``
steps), and ``host_rows_ms`` / ``host_ragged_ms`` on the Triton path with its launches skipped (what a GPU's host
issues; ``launches_rows`` / ``launches_ragged`` per step: one per decode call here, one split a sequence; a GPU's
splits add a merge's).

Both sections also count what the GPU's decode kernel reads of a step, per KV head: ``kernel_columns_own``, each row's
own columns (the kernel's ``starts``: no padding, no other row's columns), against ``kernel_columns_widest``, every
row as wide as the parts (what it read before). A count, not a timing: the kernel's tests hold it to reading no more.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import timeit
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the host path skips its launches anyway

import torch  # noqa: E402

SHAPES = {"smollm2": (3, 3, 64), "llama8b": (8, 4, 128)}  # KV heads, GQA group, head_dim


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--per-token", action=argparse.BooleanOptionalAction, default=True, help="the affine rows")
    ap.add_argument("--tiles", action=argparse.BooleanOptionalAction, default=True, help="the key tiles' rows")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--pad-spread", type=float, default=0.25, help="the last row's padding, a fraction of the context")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _best_ms(fn, repeats: int) -> float:
    """The best of ``repeats`` means of 3 calls, after one call (the tables built, the allocator warm)."""
    fn()
    return min(timeit.repeat(fn, repeat=repeats, number=3)) / 3 * 1e3


def _largest_mb(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events()), default=0) / 2**20


def _view(H: int, d: int, B: int, n: int, pads: list[int] | None):
    """One layer (K2V2 affine, generation windows) filled with n random columns per row (``pads[b]`` of them padding,
    or none), then given one more: the view of that decode step."""
    from wushkv.config import GENERATION_WINDOWS, QuantConfig
    from wushkv.layer import WushKVLayer

    g = torch.Generator().manual_seed(0)
    layer = WushKVLayer(QuantConfig(2, 2, "affine", windows=GENERATION_WINDOWS), d)
    layer.set_padding(pads)
    for a in range(0, n, 4096):  # a chunked prefill: what a long prompt's forward hands the cache
        m = min(4096, n - a)
        layer.update(torch.randn(B, H, m, d, generator=g), torch.randn(B, H, m, d, generator=g))
    view, _ = layer.update(torch.randn(B, H, 1, d, generator=g), torch.randn(B, H, 1, d, generator=g))
    return view


def _cases(shapes: list[str], contexts: list[int], batches: list[int], spread: float):
    """(shape, (KV heads, GQA group, head_dim), context n, batch B, pads): row b padded by b·n·spread/(B − 1)."""
    if not 0 <= spread < 1:
        raise ValueError(f"--pad-spread must be in [0, 1), got {spread}")
    for shape in shapes:
        for n in contexts:
            for B in batches:
                yield shape, SHAPES[shape], n, B, [round(b * n * spread / max(B - 1, 1)) for b in range(B)]


def _kernel_columns(view) -> tuple[int, int]:
    """Columns per KV head the decode kernel reads in this step's view: each row's own (``view._held()``, what
    decode_attention hands the kernel as its starts), and every row as wide as the parts [sink, middle, recent]."""
    held = view._held()
    recent, middle = (view.win_k, view.mid_len) if hasattr(view, "win_k") else (view.rec_k, view.mid_n)
    return int((held[:, :, 1] - held[:, :, 0]).sum()), held.shape[0] * (view.sink_k.shape[2] + middle + recent.shape[2])


def run(contexts: list[int], batches: list[int], shapes: list[str], repeats: int = 3, spread: float = 0.25) -> list[dict]:
    from wushkv.attention import as_allowed

    module = SimpleNamespace(wushkv_key=None)  # the layers hold no key transform
    rows = []
    print(f"{'shape':8s} {'context':>7s} {'batch':>5s} {'unpadded ms':>11s} {'codes':>9s} {'emulation':>10s} "
          f"{'emul/codes':>10s} {'codes/unpad':>11s} {'largest MB codes/emul':>22s} {'full-precision MB pad/unpad':>28s} "
          f"{'kernel cols own/widest':>22s}")
    for shape, (H, G, d), n, B, pads in _cases(shapes, contexts, batches, spread):
        padded, plain = _view(H, d, B, n, pads), _view(H, d, B, n, None)
        q = torch.randn(B, H * G, 1, d, generator=torch.Generator().manual_seed(1))
        mask = (torch.arange(n + 1).view(1, -1) >= torch.tensor(pads).view(-1, 1)).view(B, 1, 1, n + 1)
        allowed = as_allowed(mask, n + 1)

        def codes():
            return padded.attend(module, q, mask, d**-0.5, None)

        def emulation():  # the replaced path: both versions of every column in full precision
            return padded._attend_padded(q, allowed, d**-0.5, None)

        def unpadded():
            return plain.attend(module, q, None, d**-0.5, None)

        ref = emulation()
        err = float((codes() - ref).abs().max() / ref.abs().max())
        row = {"shape": shape, "context": n, "batch": B, "pads": pads, "unpadded_ms": _best_ms(unpadded, repeats),
               "codes_ms": _best_ms(codes, repeats), "emulation_ms": _best_ms(emulation, repeats),
               "largest_mb_codes": _largest_mb(codes), "largest_mb_emulation": _largest_mb(emulation),
               "codes_vs_emulation": err,
               # what the layers hold in full precision (sinks, recent buffers): the padding costs none of it
               "fp_mb_padded": padded.layer.nbytes()["full_precision"] / 2**20,
               "fp_mb_unpadded": plain.layer.nbytes()["full_precision"] / 2**20}
        row["kernel_columns_own"], row["kernel_columns_widest"] = _kernel_columns(padded)
        row["kernel_own_over_widest"] = row["kernel_columns_own"] / row["kernel_columns_widest"]
        row["emulation_over_codes"] = row["emulation_ms"] / row["codes_ms"]
        row["codes_over_unpadded"] = row["codes_ms"] / row["unpadded_ms"]
        rows.append(row)
        print(f"{shape:8s} {n:7d} {B:5d} {row['unpadded_ms']:11.2f} {row['codes_ms']:9.2f} {row['emulation_ms']:10.2f} "
              f"{row['emulation_over_codes']:9.1f}x {row['codes_over_unpadded']:10.2f}x "
              f"{row['largest_mb_codes']:11.1f}/{row['largest_mb_emulation']:<10.1f} "
              f"{row['fp_mb_padded']:13.2f}/{row['fp_mb_unpadded']:<14.2f} {row['kernel_own_over_widest']:21.2f}x"
              + ("" if err < 1e-4 else f"  MISMATCH {err:.1e}"), flush=True)
    return rows


def _tiles_layer(H: int, d: int, B: int, n: int, pads: list[int]):
    """One layer of key tiles (auto's cells) holding a padded batch of n columns per row (``pads[b]`` padding)."""
    from wushkv.config import GENERATION_WINDOWS, QuantConfig, WindowConfig
    from wushkv.layer import WushKVLayer

    w = GENERATION_WINDOWS
    cfg = QuantConfig(2, 2, "quest", key_quantizer="kvarn", windows=WindowConfig(w.S_sink, w.S_keep, 16))
    g = torch.Generator().manual_seed(0)
    layer = WushKVLayer(cfg, d)
    layer.set_padding(pads)
    for a in range(0, n, 4096):
        m = min(4096, n - a)
        layer.update(torch.randn(B, H, m, d, generator=g), torch.randn(B, H, m, d, generator=g))
    return layer


def run_tiles(contexts: list[int], batches: list[int], shapes: list[str], steps: int = 24, spread: float = 0.25) -> list[dict]:
    """Decode steps of a padded batch of key tiles: ragged rows (one batched update, one decode call) against one
    unpadded layer per row (the replaced path), alternated step by step on copies of one filled layer."""
    import contextlib

    from wushkv import decode, triton_kernels
    from wushkv.views import RowsView

    module = SimpleNamespace(wushkv_key=None)
    out = []
    print(f"{'shape':8s} {'context':>7s} {'batch':>5s} {'rows ms':>8s} {'ragged ms':>9s} {'rows/ragged':>11s} "
          f"{'host rows/ragged ms':>20s} {'launches rows/ragged':>21s} {'kernel cols own/widest':>22s}")
    for shape, (H, G, d), n, B, pads in _cases(shapes, contexts, batches, spread):
        filled = _tiles_layer(H, d, B, n, pads)
        g = torch.Generator().manual_seed(1)
        inputs = [tuple(torch.randn(B, h, 1, d, generator=g) for h in (H, H, H * G)) for _ in range(steps)]

        def ragged_step(layer, k, v, q):
            view, _ = layer.update(k, v)
            return view.attend(module, q, None, d**-0.5, None)

        def rows_step(state, k, v, q):  # the replaced path: each row's own layer, stepped and attended
            parent, rows = state
            views = [row.update(k[b : b + 1], v[b : b + 1])[0] for b, row in enumerate(rows)]
            parent.n += 1
            return RowsView(parent, parent.n - 1, parent.n, views, k[:, :, :0]).attend(module, q, None, d**-0.5, None)

        times = {}
        for path in ("torch", "host") if triton_kernels.available() else ("torch",):
            layer = copy.deepcopy(filled)
            state = (copy.deepcopy(filled), filled.row_layers())
            launches = {"ragged": 0, "rows": 0}
            ts = {"ragged": [], "rows": []}
            for i, (k, v, q) in enumerate(inputs):
                outs = {}
                for name, fn, st in (("ragged", ragged_step, layer), ("rows", rows_step, state)):
                    with contextlib.ExitStack() as stack:
                        if path == "host":  # the Triton path, its launches counted and skipped
                            stack.enter_context(decode.triton_enabled(True))
                            stack.enter_context(triton_kernels.launches_through(
                                lambda nm, grid, args, meta, run, name=name: launches.__setitem__(name, launches[name] + 1)))
                        t0 = time.perf_counter()
                        outs[name] = fn(st, k, v, q)
                        ts[name].append(time.perf_counter() - t0)
                if path == "torch":  # (the host path's outputs are never computed)
                    err = float((outs["ragged"] - outs["rows"]).abs().max())
                    assert err < 1e-4, f"ragged and row-by-row decode differ by {err} at step {i}"
            times[path] = {name: statistics.median(t) * 1e3 for name, t in ts.items()}
            times[path + "_launches"] = {name: c / steps for name, c in launches.items()}
        times.setdefault("host", {"rows": float("nan"), "ragged": float("nan")})  # no triton: no host path
        times.setdefault("host_launches", {"rows": float("nan"), "ragged": float("nan")})
        row = {"shape": shape, "context": n, "batch": B, "pads": pads,
               "tiles_rows_ms": times["torch"]["rows"], "tiles_ragged_ms": times["torch"]["ragged"],
               "host_rows_ms": times["host"]["rows"], "host_ragged_ms": times["host"]["ragged"],
               "launches_rows": times["host_launches"]["rows"], "launches_ragged": times["host_launches"]["ragged"]}
        row["kernel_columns_own"], row["kernel_columns_widest"] = _kernel_columns(copy.deepcopy(filled).update(*inputs[0][:2])[0])
        row["kernel_own_over_widest"] = row["kernel_columns_own"] / row["kernel_columns_widest"]
        row["tiles_rows_over_ragged"] = row["tiles_rows_ms"] / row["tiles_ragged_ms"]
        row["host_rows_over_ragged"] = row["host_rows_ms"] / row["host_ragged_ms"]
        out.append(row)
        print(f"{shape:8s} {n:7d} {B:5d} {row['tiles_rows_ms']:8.2f} {row['tiles_ragged_ms']:9.2f} "
              f"{row['tiles_rows_over_ragged']:10.2f}x {row['host_rows_ms']:9.2f}/{row['host_ragged_ms']:<9.2f} "
              f"{row['launches_rows']:10.0f}/{row['launches_ragged']:<9.0f} {row['kernel_own_over_widest']:21.2f}x", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts, batches = [int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")]
    rows = run(contexts, batches, args.shapes.split(","), args.repeats, args.pad_spread) if args.per_token else []
    tiles = run_tiles(contexts, batches, args.shapes.split(","), args.steps, args.pad_spread) if args.tiles else []
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, {"threads": args.threads, "pad_spread": args.pad_spread, "rows": rows, "tiles": tiles})
    return {"rows": rows, "tiles": tiles}


if __name__ == "__main__":
    main()
