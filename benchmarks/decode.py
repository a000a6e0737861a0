"""Decode speed and memory: wushkv's packed cache against DynamicCache and the stock QuantizedCache.

    python benchmarks/decode.py --model smollm2-135m --contexts 1024,4096,8192 --batches 1,8 \
        [--calibration out/smollm2-c32.safetensors] [--dtypes float32,bfloat16] [--device cuda] [--json out/decode.json]

For each model dtype, context length and batch size, every cache is filled with the same context and
then decodes ``--steps`` real tokens through the real model; the table gives the median time per
decode step, its ratio to ``DynamicCache`` of the same dtype measured in the same run, the transient
memory of a decode step (peak resident memory during the steps minus the resident memory before
them: a cache that dequantizes itself shows its full-precision copy here), and the bytes the cache
holds per context token. With ``--device cuda`` every step is timed between two synchronizations and
the transient memory is the allocator's peak during the step minus what it held before it
(``torch.cuda.max_memory_allocated``).

How the caches are filled: one full-precision prefill of the longest context per transform (identity
and WUSH, whose values come out of the folded ``v_proj``) yields every layer's keys (after RoPE) and
values; each cache receives them through its own ``update`` (shorter contexts take prefixes, batch
rows are copies). This is exactly the state a prefill through that cache would leave (wushkv
transforms, flushes and packs them; the stock cache quantizes them), without running a long prefill
once per cache. The stock ``QuantizedCache`` needs the optional extra ``pip install 'wushkv[stock]'``
(optimum-quanto, hqq); missing backends are skipped with a note.

A kind ``METHOD@K<k>V<v>`` (``auto@K2V2``, ``wush+rmean+ktiles+ldlq@K2V2``) is a calibrated method installed as the
CLI installs it, on a model copy of its own with its own prefill: ``auto`` resolves as ``wushkv generate`` resolves it
for ``--model``, and methods with key tiles take their windows from ``--windows`` as the CLI does. Any wushkv kind with
the suffix ``/parts`` (``auto@K2V2/parts``) is the same cache decoded on the CPU part by part, the code-domain kernels
with PyTorch between them (:func:`wushkv.decode.fused_enabled` off), against which the fused decode (one
``parts_decode`` call a layer) is set in the same run; with ``/pytorch`` it is decoded without the C++ kernels
(:func:`wushkv.decode.kernels_enabled` off). ``identity-K2V2g32``: groups of 32 channels a token (``group_size``);
``identity-K2V2-kivi``: another quantizer than QuEST (KIVI: keys per channel over blocks of S_flush tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import threading
import time

import torch

from wushkv import decode
from wushkv.cache import WushKVCache
from wushkv.config import QuantConfig, WindowConfig
from wushkv.data import tokenize_chunks, wikitext2_test
from wushkv.folding import apply_transforms
from wushkv.io import write_json
from wushkv.models import describe, load
from wushkv.report import format_table

PAGE = 4096


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Resident-memory peak seen by a polling thread (torch ops release the GIL, so it keeps polling)."""

    def __enter__(self):
        self.peak, self.stop = rss(), False
        self.t = threading.Thread(target=self._poll, daemon=True)
        self.t.start()
        return self

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()


def tensor_bytes(obj, depth: int = 0, seen=None) -> int:
    """Bytes of every tensor reachable from ``obj`` through attributes, lists and dicts (stock caches)."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or depth > 4:
        return 0
    seen.add(id(obj))
    if torch.is_tensor(obj):
        inner = [getattr(obj, a) for a in ("_data", "_scale", "_shift") if torch.is_tensor(getattr(obj, a, None))]
        if inner:  # quanto's QTensor subclasses: count their storage, not the wrapper
            return sum(tensor_bytes(t, depth + 1, seen) for t in inner)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, depth + 1, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, depth + 1, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        return sum(tensor_bytes(v, depth + 1, seen) for k, v in vars(obj).items() if k not in ("config",))
    return 0


@torch.no_grad()
def prefill_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (keys after RoPE, values) of one full-precision prefill; sliding layers too (full length)."""
    from transformers import DynamicCache

    cache = DynamicCache()  # no config: every layer keeps all positions
    model(ids, cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def fill(cache, kv, ctx: int, batch: int, dtype) -> None:
    for i, (k, v) in enumerate(kv):
        k = k[:, :, :ctx].to(dtype).repeat(batch, 1, 1, 1)
        v = v[:, :, :ctx].to(dtype).repeat(batch, 1, 1, 1)
        if isinstance(cache, WushKVCache):
            cache.layers[i].update(k, v)
        else:
            cache.update(k, v, i)


def make_cache(kind: str, model, windows: WindowConfig):
    from transformers import DynamicCache, QuantizedCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind.startswith(("quanto", "hqq")):
        backend, bits = kind.split("-")
        return QuantizedCache(backend=backend, config=model.config, nbits=int(bits))
    # wushkv: "<transform>-K<k>V<v>", optionally "g<G>" (groups of G channels a token: group_size) and "-<quantizer>"
    # (default quest; identity-K2V2-kivi: KIVI's per-channel keys and per-token values)
    _, kv, *quantizer = kind.split("-")
    kb, vb = int(kv[1]), int(kv[3])
    group = int(kv[5:]) if kv[4:5] == "g" else None
    return WushKVCache(model, QuantConfig(kb, vb, quantizer[0] if quantizer else "quest", windows=windows, group_size=group))


PARTS = "/parts"  # a kind's suffix: the same wushkv cache decoded part by part (decode.fused_enabled(False))
PYTORCH = "/pytorch"  # the same cache decoded without the C++ kernels (decode.kernels_enabled(False))


def base_kind(kind: str) -> str:
    """The cache a kind builds: ``KIND/parts`` is ``KIND``'s cache, decoded on the CPU part by part (the code-domain
    kernels and PyTorch between them, the path before session 66) instead of in one ``parts_decode`` call;
    ``KIND/pytorch`` the same cache decoded in PyTorch alone (float codes a block at a time)."""
    return kind.removesuffix(PARTS).removesuffix(PYTORCH)


def step_path(kind: str):
    """The context a decode step of ``kind`` runs in: the per-part path for ``KIND/parts``, PyTorch alone for
    ``KIND/pytorch``, else the default."""
    if kind.endswith(PARTS):
        return decode.fused_enabled(False)
    return decode.kernels_enabled(False) if kind.endswith(PYTORCH) else contextlib.nullcontext()


def is_method(kind: str) -> bool:
    """A cache kind named ``METHOD@K<k>V<v>``: a wushkv method (``auto``, ``wush+ktiles+ldlq``, ...) installed as the
    CLI installs it (:func:`wushkv.methods.install.method_cache`)."""
    return "@" in kind


def method_factory(stack: contextlib.ExitStack, kind: str, model, args, windows: WindowConfig):
    """(a factory of fresh caches, what ran) for a ``METHOD@K<k>V<v>`` kind on ``model`` (a copy of its own: the
    method stays installed until ``stack`` closes). ``auto`` resolves as ``wushkv generate`` resolves it for
    ``args.model``; methods whose keys go into tiles take their windows from ``windows`` as the CLI does."""
    from wushkv.calibration import Calibration
    from wushkv.methods.auto import resolve_auto
    from wushkv.methods.install import method_cache

    name, widths = kind.split("@")
    if len(widths) != 4 or widths[0] != "K" or widths[2] != "V" or not (widths[1] + widths[3]).isdigit():
        raise SystemExit(f"--caches: {kind!r} must be METHOD@K<bits>V<bits>, e.g. auto@K2V2 or wush+ktiles+ldlq@K2V2")
    if not args.calibration:
        raise SystemExit(f"--caches: {kind!r} is a calibrated method; give --calibration FILE")
    cal = Calibration.load(args.calibration, model)
    cfg = QuantConfig(int(widths[1]), int(widths[3]), "quest", windows=windows)
    method, chosen = name, name
    if name == "auto":
        r = resolve_auto(args.model, cal, cfg)
        method, cfg, chosen = r.method, r.base, f"auto = {r.method.name} ({r.why})"
    return stack.enter_context(method_cache(model, cal, method, cfg)), chosen


def cache_bytes(cache, dtype_size: int) -> dict:
    if isinstance(cache, WushKVCache):
        nb = cache.nbytes()
        return {"total": nb["total"], "windows": nb["full_precision"], "windows_elem": dtype_size}
    if type(cache).__name__ == "DynamicCache":
        return {"total": sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers if l.is_initialized), "windows": 0}
    return {"total": tensor_bytes(cache.layers), "windows": None}


class PeakCUDA:
    """Peak bytes the CUDA allocator held during the block (``peak`` is absolute, like PeakRSS's)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()


@torch.no_grad()
def time_round_robin(models: dict, caches: dict, next_ids: torch.Tensor, warmup: int, steps: int) -> dict:
    """Decode steps in rounds, one step of every cache per round, so that machine noise hits all alike.

    Per cache: median step time, and the transient memory of a step (peak resident memory during the
    step minus the resident memory just before it; the largest over the steps).
    """
    out = {k: {"ms_all": [], "transient_mb": 0.0} for k in caches}
    cuda = next_ids.device.type == "cuda"
    for t in range(warmup + steps):
        for kind, cache in caches.items():
            gc.collect()
            before = torch.cuda.memory_allocated() if cuda else rss()  # the allocator's count needs no sync
            with PeakCUDA() if cuda else PeakRSS() as peak, step_path(kind):
                t0 = time.perf_counter()
                models[kind](next_ids[:, t : t + 1], cache=cache, use_cache=True)
                if cuda:  # the step ends when its kernels do, not when the host has queued them
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            if t >= warmup:
                out[kind]["ms_all"].append(1e3 * dt)
                out[kind]["transient_mb"] = max(out[kind]["transient_mb"], (peak.peak - before) / 2**20)
    for r in out.values():
        r["ms"] = statistics.median(r["ms_all"])
    if cuda:  # the allocator's peak above already is the largest transient; the profiler below reads CPU memory
        return out
    # The largest single allocation of one more step (torch profiler, CPU memory): a cache that
    # dequantizes a layer before attending shows that layer's full-precision copy here, which resident
    # memory hides (the allocator reuses the freed block layer after layer).
    from torch.profiler import ProfilerActivity, profile

    t = warmup + steps
    for kind, cache in caches.items():
        if t < next_ids.shape[1]:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, step_path(kind):
                models[kind](next_ids[:, t : t + 1], cache=cache, use_cache=True)
            out[kind]["largest_alloc_mb"] = max((e.self_cpu_memory_usage for e in prof.events()), default=0) / 2**20
    return out


@torch.no_grad()
def key_transform_share(model, transforms, spec, batches, results, device="cpu") -> dict:
    from wushkv.folding import KeyTransform

    model.to(torch.float32)
    out = {}
    kts = [KeyTransform(t.T_K, t.T_K_inv).to(device) for t in transforms]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for B in batches:
        k = torch.randn(B, spec.num_kv_heads, 1, spec.head_dim, device=device)
        q = torch.randn(B, spec.num_heads, 1, spec.head_dim, device=device)
        for kt in kts:
            kt.keys(k), kt.queries(q)
        reps = 50
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            for kt in kts:
                kt.keys(k), kt.queries(q)
        sync()
        ms = 1e3 * (time.perf_counter() - t0) / reps
        steps = [r for r in results if r["cache"] == "wush-K2V2" and r["batch"] == B and r["dtype"] == "float32"]
        if steps:
            r = max(steps, key=lambda r: r["context"])
            out[B] = {"ms": ms, "share": ms / r["ms"], "context": r["context"]}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", default=None, help="calibration file (WUSH rows); default: random orthogonal key/value transforms, whose run-time cost is the same")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--caches", default="dynamic,quanto-2,quanto-4,hqq-2,hqq-4,identity-K2V2,identity-K4V2,wush-K2V2,wush-K4V2",
                    help="dynamic, quanto-B, hqq-B, identity-KxVy, wush-KxVy (QuEST; + gG: groups of G channels, "
                         "identity-K2V2g32; + -QUANTIZER: another quantizer, identity-K2V2-kivi), or METHOD@KxVy: a calibrated method as "
                         "the CLI installs it, e.g. auto@K2V2, wush+ktiles+ldlq@K2V2 (needs --calibration); any wushkv kind "
                         "+ /parts: decoded part by part (the path before the fused decode), e.g. auto@K2V2/parts; "
                         "+ /pytorch: decoded without the C++ kernels")
    ap.add_argument("--windows", default="64,256,8", help="S_sink,S_keep,S_flush of the wushkv caches")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default: %(default)s)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def text_tokens(args) -> int:
    """Tokens of text a run reads: the longest context, then every timed, warm-up and profiled step."""
    return max(int(x) for x in args.contexts.split(",")) + args.warmup + args.steps + 1  # + 1: the profiled step


def run(args, model, text: torch.Tensor) -> dict:
    """Fill, time and measure every cache of ``args`` on ``model`` (any causal LM :func:`wushkv.models.describe`
    knows); ``text`` (1, >= :func:`text_tokens`) token ids on the model's device. Prints the rows as they come and
    the table; returns what ``--json`` holds (``results``: one dict per dtype, context, batch and cache, with
    ``ms``, ``ratio`` to ``dynamic`` of the same run, ``bytes`` and ``bytes_per_token``)."""
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    kinds = args.caches.split(",")
    windows = WindowConfig(*[int(x) for x in args.windows.split(",")])
    spec = describe(model)
    steps = args.warmup + args.steps + 1  # + 1: the profiled step
    ctx_ids = text[:, : max(contexts)]

    transforms = {}
    if any(k.startswith("wush") for k in kinds):
        if args.calibration:
            from wushkv.calibration import Calibration

            transforms["wush"] = Calibration.load(args.calibration, model).transforms("wush")
        else:
            from wushkv.transforms import build_transforms

            transforms["wush"] = [build_transforms("random", spec.num_kv_heads, spec.head_dim, seed=l) for l in range(spec.num_layers)]

    # One model per role, so no step pays for installing transforms: the untouched model (sdpa) for
    # DynamicCache and the stock cache, one switched to the wushkv attention, one with WUSH installed.
    import copy

    which = lambda kind: base_kind(kind) if is_method(kind) else "wush" if kind.startswith("wush") else "identity"  # noqa: E731
    m_id = copy.deepcopy(model)
    m_wush = copy.deepcopy(model) if transforms else None
    if m_wush is not None:
        apply_transforms(m_wush, transforms["wush"], "wush")
    models = {k: (m_wush if which(k) == "wush" else m_id if k.startswith("identity") else model) for k in kinds}
    stack = contextlib.ExitStack()  # the methods stay installed on their own copies for the whole run
    factories = {}
    for kind in dict.fromkeys(base_kind(k) for k in kinds if is_method(k)):
        models[kind] = copy.deepcopy(model)
        factories[kind], chosen = method_factory(stack, kind, models[kind], args, windows)
        print(f"{kind}: {chosen}", flush=True)
    for kind in kinds:  # KIND/parts, KIND/pytorch: KIND's model and caches
        models[kind] = models[base_kind(kind)]
    rows, results = [], []
    kv32 = {}  # one float32 prefill per transform (and method); every dtype's caches are filled from it (cast)
    for name, m in (("identity", model), ("wush", m_wush), *((k, models[k]) for k in factories)):
        if m is None:
            continue
        t0 = time.perf_counter()
        kv32[name] = prefill_kv(m, ctx_ids)
        print(f"prefill of {ctx_ids.shape[1]} tokens ({name}): {time.perf_counter() - t0:.1f} s", flush=True)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for m in {id(m): m for m in models.values()}.values():
            m.to(dtype)
        kv = kv32
        for ctx in contexts:
            for B in batches:
                next_ids = text[:, ctx : ctx + steps].repeat(B, 1)
                caches = {}
                for kind in kinds:
                    try:
                        base = base_kind(kind)
                        cache = factories[base]() if base in factories else make_cache(base, models[kind], windows)
                        fill(cache, kv[which(kind)], ctx, B, dtype)
                        caches[kind] = cache
                    except (ImportError, ValueError) as e:  # backend missing, or a model the stock cache refuses
                        print(f"skip {kind}: {str(e)[:200]}", flush=True)
                timed = time_round_robin(models, caches, next_ids, args.warmup, args.steps)
                base = timed.get("dynamic")
                for kind, cache in caches.items():
                    r = timed[kind]
                    nb = cache_bytes(cache, torch.tensor([], dtype=dtype).element_size())
                    n_tok = B * (ctx + steps)
                    res = {"dtype": dtype_name, "context": ctx, "batch": B, "cache": kind, **r,
                           "ratio": r["ms"] / base["ms"] if base else None, "bytes": nb,
                           "bytes_per_token": nb["total"] / n_tok}
                    results.append(res)
                    rows.append([dtype_name, ctx, B, kind, f"{r['ms']:.1f}", f"{res['ratio']:.2f}" if base else "-",
                                 f"{r['transient_mb']:.0f}", f"{r.get('largest_alloc_mb', float('nan')):.2f}", f"{res['bytes_per_token']:.0f}"])
                    print(" | ".join(map(str, rows[-1])), flush=True)
                del caches
                gc.collect()
    # bytes per token against a bfloat16 DynamicCache (windows counted at 2 bytes per element)
    full_bf16 = 2 * 2 * spec.head_dim * spec.num_kv_heads * sum(
        1 for t in spec.layer_types if t != "sliding_attention")  # full layers hold every token
    print()
    print(format_table(["dtype", "context", "batch", "cache", "ms/step", "x dynamic", "transient MB", "largest alloc MB", "bytes/token"], rows))
    summary = []
    for r in results:
        b = r["bytes"]
        if (r["cache"].startswith(("identity", "wush")) or is_method(r["cache"])) and r["dtype"] == "float32":
            n_tok = r["batch"] * (r["context"] + steps)
            win16 = b["windows"] // b["windows_elem"] * 2
            q = b["total"] - b["windows"]
            dyn16 = 2 * 2 * spec.head_dim * spec.num_kv_heads * spec.num_layers * n_tok if not spec.sliding_window else None
            if dyn16:
                summary.append({"context": r["context"], "batch": r["batch"], "cache": r["cache"],
                                "vs_bf16_dynamic": (q + win16) / dyn16, "quantized_part": q / dyn16, "windows_part": win16 / dyn16})
    if summary:
        print("\nbytes against a bfloat16 DynamicCache (all layers full attention; windows at 2 bytes):")
        for s in summary:
            print(f"  ctx {s['context']:>6} B {s['batch']} {s['cache']:<14} {s['vs_bf16_dynamic']:.4f} "
                  f"(quantized {s['quantized_part']:.4f} + windows {s['windows_part']:.4f})")
    # the online key transform's share of a decode step: one batched (Hkv, d, d) product per layer for the
    # new key and one for the query group, timed at decode shapes and set against the WUSH step time
    share = {}
    if "wush" in transforms:
        share = key_transform_share(model, transforms["wush"], spec, batches, results, args.device)
        for k, v in share.items():
            print(f"key transform (keys + queries, {spec.num_layers} layers), batch {k}: {v['ms']:.2f} ms per step = "
                  f"{100 * v['share']:.1f}% of the WUSH K2V2 step at context {v['context']}")
    stack.close()
    device = torch.cuda.get_device_name() if text.device.type == "cuda" else "cpu"
    return {"key_transform_share": share, "model": args.model, "device": device,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "windows": args.windows,
            "steps": args.steps, "results": results, "bytes_vs_bf16": summary, "full_bf16_per_token_full_layers": full_bf16}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(args.model, device=args.device)
    text = tokenize_chunks(tok, wikitext2_test(), text_tokens(args), 1).to(args.device)
    res = run(args, model, text)
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
