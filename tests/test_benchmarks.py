"""Smoke tests of the performance benchmarks in ``benchmarks/`` on tiny random models: each runs with tiny sizes in
a few seconds, and its output must hold what the benchmark claims (ratios to the baseline of the same run finite and
positive, byte counts equal to what the cache reports)."""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from wushkv.cache import WushKVCache

from conftest import TINY_CALIBRATION_TEXT, CharTokenizer, tiny_model

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """Import ``benchmarks/NAME.py`` by path (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_decode(capsys):
    decode = load_benchmark("decode")
    args = decode.parse_args(["--model", "tiny", "--contexts", "40", "--batches", "1,2", "--dtypes", "float32",
                              "--caches",
                              "dynamic,identity-K2V2,wush-K2V2,wush-K4V2,identity-K2V2g16,identity-K2V2g16/pytorch,"
                              "identity-K2V2-kivi",
                              "--windows", "4,16,4", "--warmup", "0", "--steps", "1"])
    model = tiny_model("llama")
    text = torch.randint(3, 96, (1, decode.text_tokens(args)))
    assert text.shape[1] == 40 + 0 + 1 + 1  # the longest context, the timed step, the profiled step
    res = decode.run(args, model, text)
    rows = {(r["context"], r["batch"], r["cache"]): r for r in res["results"]}
    kinds = ("dynamic", "identity-K2V2", "wush-K2V2", "wush-K4V2", "identity-K2V2g16", "identity-K2V2g16/pytorch",
             "identity-K2V2-kivi")
    assert set(rows) == {(c, b, k) for c in (40,) for b in (1, 2) for k in kinds}
    spec_kv = 2 * 2 * 32 * 4  # keys and values, 2 KV heads x 32, float32, per layer and token
    for (ctx, B, kind), r in rows.items():
        assert len(r["ms_all"]) == 1 and positive(r["ms"]) and positive(r["ratio"])
        assert positive(r["bytes_per_token"])
        if kind == "dynamic":
            assert r["ratio"] == 1.0
            assert r["bytes"]["total"] == 3 * spec_kv * B * (ctx + 2)  # every layer keeps every token (context + 2 steps)
        else:  # packed: far below the float32 cache; K4 above K2; the transform does not change the bytes
            assert r["bytes"]["total"] < rows[(ctx, B, "dynamic")]["bytes"]["total"]
            assert r["bytes"]["windows_elem"] == 4
    for ctx in (40,):
        for B in (1, 2):
            assert rows[(ctx, B, "wush-K2V2")]["bytes"] == rows[(ctx, B, "identity-K2V2")]["bytes"]
            assert rows[(ctx, B, "wush-K4V2")]["bytes"]["total"] > rows[(ctx, B, "wush-K2V2")]["bytes"]["total"]
            # groups of 16 of head_dim 32: the same windows, a scale per group more; /pytorch decodes the same cache
            g16, one = rows[(ctx, B, "identity-K2V2g16")]["bytes"], rows[(ctx, B, "identity-K2V2")]["bytes"]
            assert g16["windows"] == one["windows"] and g16["total"] > one["total"]
            assert rows[(ctx, B, "identity-K2V2g16/pytorch")]["bytes"] == g16
    assert set(res["key_transform_share"]) == {1, 2}
    assert all(positive(v["share"]) and v["context"] == 40 for v in res["key_transform_share"].values())
    assert "x dynamic" in capsys.readouterr().out


def test_decode_times_calibrated_methods_as_the_cli_installs_them(tiny_cal, tmp_path, capsys):
    """``METHOD@KxVy`` kinds: a calibrated method (``auto``, key tiles with error feedback and centered keys) on a model
    copy of its own, its cache from :func:`wushkv.methods.install.method_cache`; decode reads the key tiles in the fused
    decode where the kernels build (``/parts``: part by part, through the tile kernel), and a malformed kind or a missing
    calibration is refused by name."""
    from wushkv import _ext

    decode = load_benchmark("decode")
    model = tiny_model("llama")
    cal = tmp_path / "cal.safetensors"
    tiny_cal(model).save(cal)
    kinds = ["dynamic", "auto@K2V2", "wush+ktiles+ldlq@K2V2", "wush+rmean+ktiles+ldlq@K2V2", "wush+rmean+ktiles+ldlq@K2V2/parts"]
    args = decode.parse_args(["--model", "tiny", "--contexts", "300", "--batches", "1", "--dtypes", "float32",
                              "--caches", ",".join(kinds), "--windows", "4,16,4", "--warmup", "0", "--steps", "1",
                              "--calibration", str(cal)])
    _ext.reset_calls()
    res = decode.run(args, model, torch.randint(3, 96, (1, decode.text_tokens(args))))
    rows = {r["cache"]: r for r in res["results"]}
    assert set(rows) == set(kinds)
    dyn = rows["dynamic"]["bytes"]["total"]
    for kind in kinds[1:]:
        assert positive(rows[kind]["ms"]) and 0 < rows[kind]["bytes"]["total"] < dyn / 2, kind
    # centering the keys (+rmean) changes no byte: the same tiles, codes and windows
    assert rows["wush+ktiles+ldlq@K2V2"]["bytes"]["total"] == rows["wush+rmean+ktiles+ldlq@K2V2"]["bytes"]["total"]
    assert "auto@K2V2: auto = wush" in capsys.readouterr().out  # no selection recorded for a tiny model: the paper recipe
    # KIND/parts: the same cache (same bytes), decoded part by part
    assert rows["wush+rmean+ktiles+ldlq@K2V2/parts"]["bytes"] == rows["wush+rmean+ktiles+ldlq@K2V2"]["bytes"]
    if _ext.kernels() is not None:  # the key tiles read in the fused decode, and part by part by the tile kernel
        assert _ext.calls().get("parts_decode", 0) > 0 and _ext.calls().get("code_dot_tiles", 0) > 0, _ext.calls()
    for bad, why in (("wush@K2", "METHOD@K<bits>V<bits>"), ("wush+ldlq@K2V2", "give --calibration")):
        a = decode.parse_args(["--model", "tiny", "--caches", bad] + (["--calibration", str(cal)] if "K2V2" not in bad else []))
        with pytest.raises(SystemExit, match=why):
            decode.run(a, model, torch.randint(3, 96, (1, decode.text_tokens(a))))


def test_decode_bytes_match_the_cache(tmp_path):
    """The byte count of a wushkv cache is its ``nbytes()`` after the same fill, and that fill is the state a
    prefill through the cache leaves (same codes and windows, so the same bytes)."""
    from wushkv.config import QuantConfig, WindowConfig

    decode = load_benchmark("decode")
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 50))
    kv = decode.prefill_kv(model, ids)
    assert len(kv) == 3 and kv[0][0].shape == (1, 2, 50, 32)
    windows = WindowConfig(4, 16, 4)
    filled = decode.make_cache("identity-K2V2", model, windows)
    decode.fill(filled, kv, 50, 1, torch.float32)
    nb = decode.cache_bytes(filled, 4)
    prefilled = WushKVCache(model, QuantConfig(2, 2, "quest", windows=windows))
    with torch.no_grad():
        model(ids, cache=prefilled, use_cache=True)
    assert nb == {"total": filled.nbytes()["total"], "windows": filled.nbytes()["full_precision"], "windows_elem": 4}
    assert filled.nbytes() == prefilled.nbytes()


def test_eval_cost(capsys):
    from wushkv.config import WindowConfig

    eval_cost = load_benchmark("eval_cost")
    args = eval_cost.parse_args(["--model", "tiny", "--chunks", "2", "--seq-len", "48"])
    assert (args.transform, args.bits) == ("hadamard", 2)
    res = eval_cost.run(args, tiny_model("llama"), torch.randint(3, 96, (2, 48)), windows=WindowConfig(4, 8, 4))
    assert positive(res["ratio"]) and all(positive(t) for t in res["fp_seconds"]) and positive(res["emulation_seconds"])
    assert res["ratio"] == res["emulation_seconds"] / min(res["fp_seconds"])
    assert positive(res["fp_ppl"]) and positive(res["quantized_ppl"]) and res["quantized_ppl"] != res["fp_ppl"]
    assert positive(res["one_call_seconds"]) and abs(res["one_call_ppl"] - res["quantized_ppl"]) <= 1e-4 * res["quantized_ppl"]  # same math
    out = capsys.readouterr().out
    assert "query blocks" in out and "one SDPA call" in out


def test_calibration_cost():
    calibration_cost = load_benchmark("calibration_cost")
    args = calibration_cost.parse_args(["--model", "tiny", "--samples", "2", "--seq-len", "64"])
    res = calibration_cost.run(args, tiny_model("llama"), torch.randint(3, 96, (2, 64)))
    assert positive(res["forward_seconds"]) and positive(res["calibration_seconds"])
    assert res["time_ratio"] == res["calibration_seconds"] / res["forward_seconds"]
    assert positive(float(res["memory_ratio"]))
    assert res["peak_rss_mib_after_calibration"] >= res["peak_rss_mib_after_forward"] > 0  # a peak only grows


def test_wush_a_cost():
    wush_a_cost = load_benchmark("wush_a_cost")
    args = wush_a_cost.parse_args(["--model", "tiny", "--samples", "2", "--seq-len", "32,64"])
    asked = []

    def sequences(n, L):
        asked.append((n, L))
        return torch.randint(3, 96, (n, L))

    res = wush_a_cost.run(args, tiny_model("llama"), sequences)
    assert asked == [(2, 32), (2, 64)]
    assert [r["seq_len"] for r in res["rows"]] == [32, 64]
    for r in res["rows"]:
        assert positive(r["plain_s_per_seq"]) and positive(r["wush_a_s_per_seq"])
        assert r["ratio"] == r["wush_a_s_per_seq"] / r["plain_s_per_seq"]


def test_cache_bytes(capsys):
    from wushkv.layer import WushKVLayer

    cache_bytes = load_benchmark("cache_bytes")
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 160))
    layouts = ["quest g32 4/16/4", "quest g16 4/16/4", "kvarn tiles", "ktiles 4/16/4"]
    rows = cache_bytes.measure(model, ids, [2, 4], layouts)
    assert [(r[0], r[1]) for r in rows] == [(b, name) for b in (2, 4) for name in layouts]
    by = {(r[0], r[1]): dict(zip(cache_bytes.HEADERS, r)) for r in rows}
    for (b, name), r in by.items():
        # the row is the cache's own count after the same prefill (full precision at 2 bytes, not float32's 4)
        cache = WushKVCache(model, cache_bytes.layout_config(name, b))
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        n = cache.nbytes()
        assert (r["codes"], r["metadata"], r["full precision (bf16)"]) == (n["codes"], n["metadata"], n["full_precision"] // 2)
        assert r["total"] == r["codes"] + r["metadata"] + r["full precision (bf16)"] > 0
        assert r["bytes/token"] == round(r["total"] / 160, 1)
        assert r["× first layout"] == round(r["total"] / by[(b, layouts[0])]["total"], 3)
        # what the layers keep alive: their windows, and at most UNDO_TOKENS plus a flush of copies a layer, not the
        # prompt (before session 60 each layer's buffer held the whole 160-token window)
        copies = 3 * 2 * 2 * 32 * 2 * (WushKVLayer.UNDO_TOKENS + 16)  # layers, K and V, heads, d, bf16
        assert r["full precision (bf16)"] <= r["full precision held (bf16)"] <= r["full precision (bf16)"] + copies
    for b in (2, 4):
        assert by[(b, layouts[0])]["× first layout"] == 1.0
        assert by[(b, "quest g16 4/16/4")]["metadata"] == 2 * by[(b, "quest g32 4/16/4")]["metadata"]  # a step per group
    assert by[(4, "quest g32 4/16/4")]["codes"] == 2 * by[(2, "quest g32 4/16/4")]["codes"]
    with pytest.raises(ValueError, match="layout 'quest 4/16/4'"):
        cache_bytes.layout_config("quest 4/16/4", 2)


def test_feedback_speed(capsys):
    from wushkv._ext import kernels

    feedback_speed = load_benchmark("feedback_speed")
    assert feedback_speed.parse_args([]).threads == 1
    res = feedback_speed.run(3, flush_shapes=((1, 2, 8, 32),), tile_shapes=((1, 2, 128, 32),))
    assert res["fused_kernel"] == (kernels() is not None)
    (flush,), (tiles,) = res["flush"], res["tiles"]
    assert positive(flush["plain_ms"]) and positive(flush["loop_ms"])
    if res["fused_kernel"]:
        assert positive(flush["fused_over_plain"]) and positive(flush["loop_over_fused"])
    assert positive(tiles["feedback_over_plain"]) and positive(tiles["loop_over_feedback"]) and tiles["shape"] == (1, 2, 128, 32)
    assert "key tiles" in capsys.readouterr().out


def test_paged_decode(capsys):
    from conftest import require_kernels

    require_kernels()
    paged_decode = load_benchmark("paged_decode")
    assert paged_decode.parse_args([]).threads == 1
    (row,) = paged_decode.run([256], 2, 1)
    assert row["context"] == 256 and positive(row["dense_ms"]) and row["simd"] in ("avx512", "avx2", "scalar")
    for layout in ("per_token", "ktiles", "kivi", "kvarn"):
        assert positive(row[f"{layout}_over_dense"]) and positive(row[f"{layout}_ns_per_token_head"])
    assert "ktiles/float32" in capsys.readouterr().out


def test_paged_triton_host(capsys):
    pytest.importorskip("triton")
    bench = load_benchmark("paged_triton_host")
    assert bench.parse_args([]).requests == "1,16,64"
    rows = bench.run([300], [2], 1, layers=2)  # (it asserts which path each call took: in place, then gathered)
    assert [r["layout"] for r in rows] == ["per_token", "key_tiles"]
    for row in rows:
        assert row["context"] == 300 and positive(row["in_place_ms"]) and positive(row["gathered_ms"])
        assert positive(row["in_place_step_ms_per_layer"]) and positive(row["in_place_over_step"])
        assert row["window_bytes_gathered"] > 3 * row["window_bytes_in_place"] > 0
        assert positive(row["layer_ms"]) and positive(row["layer_over_decode"]) and 0 < row["layer_torch_ops"] <= 45
    # the whole layer's kernels: one store a per-token side (key tiles: the values'), one decode
    assert rows[0]["layer_launches"] == ["decode", "store", "store"] and rows[1]["layer_launches"] == ["decode", "store"]
    assert "gathered/in place" in capsys.readouterr().out


def test_code_kernels(capsys):
    from conftest import require_kernels

    require_kernels()
    code_kernels = load_benchmark("code_kernels")
    assert code_kernels.parse_args([]).threads == 1
    rows = code_kernels.run(["smollm2"], [300], [2], [2, 4], repeats=1)
    assert [(r["context"], r["batch"], r["bits"]) for r in rows] == [(300, 2, 2), (300, 2, 4)]
    for r in rows:
        for name in ("code_dot", "code_dot_tiles", "code_weighted_sum"):  # timed, and equal to the float products
            assert positive(r[f"{name}_ns_per_token_head"]) and positive(r[f"{name}_over_dense"]), (name, r)
            assert r[f"{name}_max_rel_diff"] < 1e-5, (name, r)
    assert "code_dot_tiles" in capsys.readouterr().out


def test_paged_prefill(capsys):
    paged_prefill = load_benchmark("paged_prefill")
    assert paged_prefill.parse_args([]).threads == 1
    for chunk in (0, 100):  # a whole prompt (its early blocks over their own span) and a chunk after context
        (row,) = paged_prefill.run([300], chunk, [64, 512], 1)
        assert row["queries"] == (chunk or 300) and positive(row["sdpa_f32_ms"]) and positive(row["sdpa_bf16_ms"])
        for b in (64, 512):  # copies equal to the codes' values: the plugin's attention is plain causal attention
            assert row[f"attend_{b}_max_diff"] < 1e-5 and positive(row[f"attend_{b}_over_f32"]), row
    assert "attend block 64" in capsys.readouterr().out


def test_centered_decode(capsys):
    centered = load_benchmark("centered_decode")
    assert centered.parse_args([]).shapes == "smollm2,llama8b"
    (row,) = centered.run([512], [2], ["smollm2"], repeats=1)
    assert row["context"] == 512 and row["code_vs_dequantized"] < 1e-4  # the same attention either way
    assert all(positive(row[k]) for k in ("plain_ms", "code_ms", "dequantized_ms", "dequantized_over_code", "code_over_plain"))
    # the replaced path holds the middle's keys (2·3·512·64 float32 = 0.75 MB); the code domain a block of codes
    assert row["largest_mb_dequantized"] >= 0.75 > row["largest_mb_code"]
    assert "MISMATCH" not in capsys.readouterr().out


def test_padded_decode(capsys):
    padded = load_benchmark("padded_decode")
    assert padded.parse_args([]).batches == "4,8"
    (row,) = padded.run([700], [3], ["smollm2"], repeats=1)
    assert row["pads"] == [0, 88, 175] and row["codes_vs_emulation"] < 1e-4  # the same attention either way
    assert all(positive(row[k]) for k in ("unpadded_ms", "codes_ms", "emulation_ms", "emulation_over_codes", "codes_over_unpadded"))
    # the emulation holds the keys of every column in float32 (3·3·701·64·4 bytes = 1.5 MB); the codes path far less
    assert row["largest_mb_emulation"] >= 1.5 > 4 * row["largest_mb_codes"]
    # the rows' own sinks and one recent buffer, at most S_keep + S_flush − 1 columns: as much as without padding
    assert 0 < row["fp_mb_padded"] <= 3 * 3 * 64 * 2 * 4 * (64 + 256 + 7) / 2**20 and row["fp_mb_unpadded"] > 0
    # the decode kernel reads each row's real columns once, of 701 a row before
    real = sum(701 - p for p in row["pads"])
    assert row["kernel_columns_own"] == real and row["kernel_columns_widest"] >= 3 * 701, row
    assert "MISMATCH" not in capsys.readouterr().out
    # key tiles: ragged rows decode a step in one call (one launch here, one split a sequence, and a store's on the
    # steps a row flushes), row by row took one per row; the two paths' outputs are compared at every step inside
    # run_tiles
    (tiles,) = padded.run_tiles([700], [3], ["smollm2"], steps=4)  # middles of 368, 288 and 192 tokens
    assert all(positive(tiles[k]) for k in ("tiles_rows_ms", "tiles_ragged_ms", "tiles_rows_over_ragged"))
    assert tiles["kernel_columns_own"] == real < tiles["kernel_columns_widest"], tiles
    if tiles["launches_ragged"] == tiles["launches_ragged"]:  # (NaN where triton is not installed)
        assert tiles["launches_rows"] >= 3 > tiles["launches_ragged"] >= 1 and positive(tiles["host_rows_over_ragged"])


def test_padded_generation(capsys):
    gen = load_benchmark("padded_generation")
    assert gen.parse_args([]).lengths == "512,112,300,450,200,512,380,260"
    ids, mask = gen.padded_batch(torch.arange(100), [5, 2])
    assert mask.tolist() == [[1] * 5, [0, 0, 0, 1, 1]] and ids[1, 3:].tolist() == [5, 6]
    caches = {"dynamic": None, "quest-K2V2": dict(k_bits=2, v_bits=2, quantizer="quest", windows=(2, 4, 4)),
              "ktiles-K2V2": dict(k_bits=2, v_bits=2, quantizer="quest", key_quantizer="kvarn", windows=(2, 4, 4))}
    text = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(0))
    out = gen.run(tiny_model("llama"), text, [30, 12, 21], steps=3, caches=caches)  # middles of 24, 0-8 and 12 tokens
    assert [r["cache"] for r in out["rows"]] == list(caches)
    assert all(positive(r["ms"]) and positive(r["ratio"]) for r in out["rows"])
    assert "x DynamicCache" in capsys.readouterr().out


def test_host_overhead(capsys):
    host = load_benchmark("host_overhead")
    assert host.parse_args([]).layers == 8
    row = host.run(layers=2, steps=8)
    assert all(positive(row[k]) for k in ("dynamic_ms", "torch_ms", "torch_over_dynamic"))
    from wushkv import triton_kernels

    assert ("triton_ms" in row) == triton_kernels.available()  # the Triton path wherever triton imports, launches skipped
    assert "DynamicCache" in capsys.readouterr().out
    row = host.run(layers=1, steps=7, keys="ktiles+rmean")  # auto's keys: KVarN tiles centered on a rotating mean
    assert row["keys"] == "ktiles+rmean" and positive(row["torch_ms"])


def test_long_generation():
    """The long-generation benchmark on a tiny model: every checkpoint finite, the cache's bytes equal to the byte
    accounting (QuEST and affine), the report printed."""
    long_generation = load_benchmark("long_generation")
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(0))
    for q in ("quest", "affine"):
        args = long_generation.parse_args(["--model", "tiny", "--method", "hadamard", "--tokens", "208", "--new-tokens", "8",
                                           "--chunk", "64", "--windows", "4,16,4", "--quantizer", q])
        out = long_generation.run(args, model, ids)
        assert [r["tokens"] for r in out["rows"]] == [64, 128, 192, 200, 202, 204, 206, 208]
        assert out["all_finite"] and out["bytes_as_accounted"], q
        assert out["rows"][-1]["nbytes"]["codes"] == 3 * 2 * 2 * 8 * 188  # layers, KV heads, sides, 32 dims at 2 bits; Qc(208) = 188
        assert "bytes as accounted: True" in long_generation.report(out)


def test_selection_cost(tiny_cal, capsys):
    cost = load_benchmark("selection_cost")
    args = cost.parse_args(["--calibration", "unused", "--bits", "2", "--candidates", "wush,wush+ldlq", "--chunks", "4"])
    model = tiny_model("llama")
    from wushkv.config import WindowConfig

    res = cost.run(args, model, tiny_cal(model), torch.randint(3, 96, (1, 160)), windows=WindowConfig(4, 16, 4))
    assert [(r["recipe"], r["bits"]) for r in res["rows"]] == [("wush", 2), ("wush+ldlq", 2)]
    assert all(positive(r["seconds"]) and positive(r["ratio"]) for r in res["rows"])
    assert all(positive(r["warm_up_seconds"]) for r in res["rows"])
    assert res["estimated_selection_seconds"] == pytest.approx(4 * res["seconds_per_chunk"] + res["warm_up_seconds"])
    assert res["seconds_per_chunk"] == pytest.approx(min(res["fp_seconds"]) + sum(r["seconds"] for r in res["rows"]))
    assert "default selection over 4 chunks" in capsys.readouterr().out


def test_gpu_decode_timer_times_the_device_alone(monkeypatch):
    """The GPU timing's protocol, with CUDA's events, sleep and synchronization played by a log (no GPU here): each
    call is preceded by an L2 flush (a write of the flush buffer) and a sleep of twice the host's time to issue
    it, is bracketed by its own events, and nothing waits for the device until every call is queued; its host time
    and its latency alone (synchronized after each call) come with it. A synchronization between the calls would let
    the host's Python into the GPU time."""
    import time

    gpu_decode = load_benchmark("gpu_decode")
    log, clock = [], [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            log.append("record")
            self.t = clock[0]

        def synchronize(self):
            log.append("sync")

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    flush = gpu_decode.Timer._flush_l2
    monkeypatch.setattr(gpu_decode.Timer, "_flush_l2", lambda self: (log.append("flush"), flush(self)))
    timer = gpu_decode.Timer(torch.device("cpu"))
    timer.cuda, timer._flush = True, torch.ones(1 << 10, dtype=torch.int8)  # the CUDA branch on CPU tensors

    def fn():
        log.append("fn")
        time.sleep(0.002)  # the host's part: at least 2 ms to issue
        clock[0] += 1.5  # the call's "device time" between its events

    out = timer(fn, warmup=2, iters=3, gpu=True)
    assert not timer._flush.any()  # written
    assert out["ms"] == out["latency_ms"] == 1.5 and len(out["ms_all"]) == len(out["latency_ms_all"]) == 3
    assert out["host_ms"] >= 2 and out["sleep_ms"] >= 4  # the device kept busy for twice the host's time
    # warm-up, then three calls timed alone (each waits), then three queued calls and one wait at the end
    assert log[:2] == ["fn", "fn"] and log[2:14] == ["record", "fn", "record", "sync"] * 3
    gpu = log[14:]
    assert gpu[0] == "sync" and gpu[-1] == "sync" and gpu.count("sync") == 2
    for i in range(3):
        flushed, sleep, start, call, end = gpu[1 + 5 * i: 6 + 5 * i]
        assert flushed == "flush" and sleep[0] == "sleep" and sleep[1] >= 2 * 0.002 * 2e9 and (start, call, end) == ("record", "fn", "record")
    # the end-to-end rows (gpu=False) keep the latency as their time
    log.clear()
    assert set(timer(fn, warmup=0, iters=2)) == {"ms", "ms_all"} and "sleep" not in str(log)


def test_gpu_decode_dry_run(tmp_path):
    """The GPU benchmark's every code path on CPU (Triton's interpreter, its tiny --dry-run sizes): the JSON it
    writes holds what docs/reference/performance.md promises, per context and batch the kernel's and SDPA's times,
    the bytes each reads and the bandwidth they imply, the store's throughput, and end to end the ms per token of
    DynamicCache, the packed cache through the kernels (one decode launch per layer and step, stores at the flush)
    and on the PyTorch path (no launch)."""
    import json

    pytest.importorskip("triton")
    gpu_decode = load_benchmark("gpu_decode")
    assert gpu_decode.peak_tbps("NVIDIA H200", None) == 4.8 and gpu_decode.peak_tbps("NVIDIA H100 80GB HBM3", None) == 3.35
    assert gpu_decode.peak_tbps("NVIDIA H200", 5.0) == 5.0 and gpu_decode.peak_tbps("cpu", None) is None
    res = gpu_decode.main(["--dry-run", "--out", str(tmp_path), "--batches", "2"])
    saved = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert {k: v for k, v in saved.items() if k != "sha256"} == res
    a = res["args"]
    assert res["device"].startswith("cpu") and res["peak_tbps"] is None
    assert all(isinstance(res[k], str) for k in ("torch", "triton", "transformers"))
    assert (a["contexts"], a["batches"], a["sink"], a["recent"], a["head_dim"]) == ([48], [2], 4, 8, 32)  # flags win

    (row,) = res["kernel"]
    B, ctx, Hq, Hkv, d = 2, 48, a["q_heads"], a["kv_heads"], a["head_dim"]
    n_mid = ctx - a["sink"] - a["recent"]
    packed = 2 * B * Hkv * n_mid * (d * 2 // 8 + 2)  # K2V2 codes and float16 steps
    windows, q = 2 * B * Hkv * (a["sink"] + a["recent"]) * d * 2, 2 * B * Hq * d * 2  # bfloat16; the query in, the output out
    assert (row["context"], row["batch"]) == (ctx, B) and row["splits"] >= 1 and positive(row["store_tokens_per_s"])
    assert row["triton"]["bytes"] == packed + windows + q and row["sdpa"]["bytes"] == 2 * B * Hkv * ctx * d * 2 + q
    for name in ("triton", "sdpa"):
        r = row[name]
        assert positive(r["ms"]) and len(r["ms_all"]) == a["iters"] and r["peak_fraction"] is None
        assert "latency_ms" not in r  # on CPU: wall clock, one time per call
        assert r["tb_per_s"] == r["bytes"] / (r["ms"] * 1e-3) / 1e12
    assert row["triton_over_sdpa"] == row["triton"]["ms"] / row["sdpa"]["ms"]
    # the split count before the wave rule, in the same run (1 split either way off a GPU: the dry run takes the path)
    assert row["triton_ceil_splits"]["splits"] == 1 and positive(row["triton_over_triton_ceil_splits"])
    # the splits merged by each pair's last program, one launch (2 splits in the dry run), as the tiles' path computes
    assert (row["triton_last_merges"]["splits"], row["triton_last_merges"]["bytes"]) == (2, row["triton"]["bytes"])
    assert positive(row["triton_over_triton_last_merges"]) and 0 <= row["triton_last_merges_vs_tiles"] < gpu_decode.AGREE
    assert "ms" in row["flash"] or "error" in row["flash"]  # FlashAttention where torch has it for this device
    # the same kernel over the bfloat16 context, and the sweep whose fastest tuning the rows ran under
    assert row["triton_bf16"]["bytes"] == row["sdpa"]["bytes"] and positive(row["triton_bf16"]["ms"])
    # the keys as KVarN tiles over the same codes (scale 1, zero ½ − 2^(b−1)): the same keys, so the same output (its
    # dequantized keys rounded to bfloat16 for the dot, the per-token path's codes exact: about 5e-3 apart)
    tiles = -(-n_mid // gpu_decode.KEY_TILE)
    assert row["triton_ktiles"]["bytes"] == row["triton"]["bytes"] + 2 * B * Hkv * tiles * d * 2
    assert row["triton_ktiles_vs_tiles"] < gpu_decode.AGREE and positive(row["triton_ktiles_over_sdpa"])  # bfloat16 keys
    # keys and values as KVarN tiles (the kvarn method's layout) over the same codes: the same output again
    assert row["triton_kvarn"]["bytes"] == row["triton_ktiles"]["bytes"] + 2 * B * Hkv * (n_mid + tiles * d)
    assert row["triton_kvarn_vs_tiles"] < gpu_decode.AGREE and positive(row["triton_kvarn_over_sdpa"])
    # keys centered on their rotating mean: the same codes plus a bias of the position, against the tiles' path
    assert row["triton_rmean"]["bytes"] == row["triton"]["bytes"] and positive(row["triton_rmean_over_sdpa"])
    assert 0 <= row["triton_rmean_vs_tiles"] < gpu_decode.AGREE
    # a left-padded batch (pads 0 and 27 of the 36-token middle): each row over its own columns, as the widest computes
    assert row["ragged_own_columns"] == (2 * ctx - 27) / (2 * ctx) and positive(row["triton_ragged_over_widest"])
    assert 0 <= row["triton_ragged_vs_widest"] < gpu_decode.AGREE
    # the vLLM plugin's decode at the --plugin shape (the dry run's 48x2), after every other row: its cells in place,
    # the windows from the pool; the same requests through the gathered windows give the same bits, and through
    # tiles of one block's tokens as near as the kernel's agreement
    assert (ctx, B) == (48, 2) and row["plugin_vs_gathered"] == 0.0
    assert 0 <= row["plugin_page_tiles_vs_in_place"] < gpu_decode.AGREE  # each tile of tokens' block read once
    for name in ("plugin", "plugin_step", "plugin_page_tiles", "plugin_gathered"):
        assert positive(row[name]["ms"]) and positive(row[f"{name}_over_sdpa"]), name
    # each row checks what it timed: the kernel against the tiles' path, the bf16 run against SDPA
    assert 0 <= row["triton_vs_tiles"] < gpu_decode.AGREE and 0 <= row["triton_bf16_vs_sdpa"] < gpu_decode.AGREE
    assert gpu_decode.max_rel(torch.ones(3), torch.full((3,), 2.0)) == 0.5
    assert not gpu_decode.agrees(gpu_decode.max_rel(torch.tensor([1.0, float("nan")]), torch.ones(2)))  # NaN: MISMATCH
    # what the device's compiler built: nothing under the interpreter (its launches return no compiled kernel)
    assert "triton_compiled" in row and row["triton_compiled"] is None
    sw = res["sweep"]
    assert sw["shapes"] == [[48, 2]] and res["tuning"] == row["tuning"] == sw["best"]
    capped = [(r["max_registers"], r["fp_stages"]) for r in sw["rows"] if "compiled" in r and not r["last_split_merges"]]
    assert capped == [(t[3]["max_registers"], 1) if len(t) > 3 else (None, None) for t in gpu_decode.DRY_SWEEP_TILES]
    timed = [r for r in sw["rows"] if "ms" in r]
    # each tuning, then the shape's fastest once more with each pair's last program merging its splits (2 of them
    # in the dry run), as the two launches compute it
    *tunings, last = timed
    assert len(tunings) == len(gpu_decode.DRY_SWEEP_TILES) * len(gpu_decode.DRY_SWEEP_PER_SM)
    assert not any(r["last_split_merges"] for r in tunings) and last["last_split_merges"] and last["splits"] == 2
    before = min(tunings, key=lambda r: r["ms"])
    assert {k: last[k] for k in gpu_decode.TUNING_FIELDS if k != "last_split_merges"} == {
        k: before[k] for k in gpu_decode.TUNING_FIELDS if k != "last_split_merges"}
    assert 0 <= last["vs_two_launches"] < 1e-5 and "error" not in last
    fastest = min(timed, key=lambda r: r["ms"])
    assert sw["best"] == {k: fastest[k] for k in gpu_decode.TUNING_FIELDS}
    assert ("triton_default" in row) == (res["tuning"] != sw["default"])

    # a flush with error feedback (+ldlq, auto's values): the store kernel against the PyTorch path, the same codes
    (fb,) = res["feedback_store"]
    assert (fb["batch"], fb["tokens"], fb["head_dim"]) == (1, a["feedback_tokens"], d)
    assert positive(fb["triton"]["ms"]) and positive(fb["pytorch"]["ms"]) and fb["codes_apart"] < 2e-2
    assert fb["pytorch_over_triton"] == fb["pytorch"]["ms"] / fb["triton"]["ms"]
    assert positive(fb["ktiles_triton"]["ms"]) and positive(fb["ktiles_pytorch"]["ms"]) and fb["ktiles_codes_apart"] < 2e-2
    assert fb["compiled"] is None and fb["ktiles_compiled"] is None  # (the interpreter compiles nothing to read)

    (e2e,) = res["e2e"]
    steps = a["warmup"] + a["e2e_steps"]
    assert (e2e["context"], e2e["batch"]) == (48, 1)
    for name in ("dynamic", "wushkv_triton", "wushkv_pytorch", "wushkv_auto"):
        assert positive(e2e[name]["ms"]) and "error" not in e2e[name], e2e[name]
    # the per-token cache and auto's kind of pick (KVarN keys centered on a rotating mean) through the decode kernel,
    # one launch per layer and step
    assert e2e["wushkv_triton"]["triton_launches"] == e2e["wushkv_auto"]["triton_launches"] == a["e2e_layers"] * steps
    assert e2e["wushkv_triton"]["triton_store_launches"] >= 2  # a flush during the steps wrote keys and values
    assert e2e["wushkv_pytorch"]["triton_launches"] == e2e["wushkv_pytorch"]["triton_store_launches"] == 0
    assert e2e["wushkv_triton_over_dynamic"] == e2e["wushkv_triton"]["ms"] / e2e["dynamic"]["ms"]
    # the issue's bars at the end: the dry run's tiny shapes measure none but the outputs' agreement
    acc = res["acceptance"]
    assert acc == gpu_decode.acceptance(res) and acc["all"] is False and acc["outputs_agree"]["pass"] is True
    assert all(v["value"] is None and v["pass"] is None for k, v in acc.items() if k not in ("all", "outputs_agree"))
    assert gpu_decode.main(["--plot-from", str(tmp_path / "gpu_decode.json")]) == saved


def test_gpu_decode_reads_what_the_compiler_built():
    """compile_readout: a compiled kernel's registers, local memory (Triton counts 4-byte words), shared memory and
    warps, and the programs an sm_90 multiprocessor holds of it (8 of the default one-warp program, 16 under a cap of
    128 registers); nothing made up where the kernel does not say."""
    from types import SimpleNamespace

    gpu_decode = load_benchmark("gpu_decode")
    k = SimpleNamespace(n_regs=255, n_spills=26, metadata=SimpleNamespace(shared=20480, num_warps=1))
    assert gpu_decode.compile_readout(k, {}) == dict(registers=255, local_bytes=104, shared=20480, num_warps=1,
                                                     max_registers=None, resident_programs=8)
    k = SimpleNamespace(n_regs=128, n_spills=0, metadata=SimpleNamespace(shared=12288, num_warps=1))
    assert gpu_decode.compile_readout(k, {"maxnreg": 128})["resident_programs"] == 16
    k = SimpleNamespace(n_regs=167, n_spills=0, metadata=SimpleNamespace(shared=0, num_warps=4))
    assert gpu_decode.compile_readout(k, {})["resident_programs"] == 3  # session 46's tiles: 12 warps
    assert "resident_programs" not in gpu_decode.compile_readout(SimpleNamespace(), {})


def test_gpu_decode_acceptance_reads_the_issues_bars():
    """acceptance(): each of issue #33's bars off a run's rows, met, missed, or not measured (None), and ``all`` only
    when every one was measured and met."""
    gpu_decode = load_benchmark("gpu_decode")
    args = {"kv_heads": 8, "sink": 64, "recent": 256, "head_dim": 128}
    keys = 16 * 8 * (32768 - 64 - 256) * 128 * 2  # one layer's middle keys in bfloat16 (1.06 GB)
    good = {"args": args,
            "kernel": [{"context": 32768, "batch": 16, "triton_over_sdpa": 0.4, "triton": {"peak_fraction": 0.6},
                        "triton_vs_tiles": 1e-3},
                       {"context": 1024, "batch": 1, "triton_over_sdpa": 1.1}, {"context": 1024, "batch": 16, "triton_over_sdpa": 0.9},
                       {"context": 131072, "batch": 64, "skipped": "needs ~90 GiB"}],
            "e2e": [{"context": 32768, "batch": 16, "wushkv_triton_over_dynamic": 0.2,
                     "wushkv_triton": {"step_peak_bytes_above_cache": 16_500_000}}]}
    acc = gpu_decode.acceptance(good)
    assert acc["all"] is True and all(v["pass"] for k, v in acc.items() if k != "all")
    assert acc["kernel_1k_over_sdpa"]["value"] == 1.1  # the worst batch
    assert acc["e2e_step_peak_over_middle_keys"]["value"] == 16_500_000 / keys
    for path, value, name in ((("kernel", 0, "triton_over_sdpa"), 0.6, "kernel_32k_b16_over_sdpa"),
                              (("kernel", 0, "triton", "peak_fraction"), 0.3, "kernel_32k_b16_peak_fraction"),
                              (("kernel", 1, "triton_over_sdpa"), 1.3, "kernel_1k_over_sdpa"),
                              (("e2e", 0, "wushkv_triton_over_dynamic"), 0.9, "e2e_32k_b16_over_dynamic"),
                              (("e2e", 0, "wushkv_triton", "step_peak_bytes_above_cache"), 2 * keys, "e2e_step_peak_over_middle_keys"),
                              (("kernel", 0, "triton_vs_tiles"), float("nan"), "outputs_agree")):
        bad = copy.deepcopy(good)
        node = bad
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        acc = gpu_decode.acceptance(bad)
        assert acc[name]["pass"] is False and acc["all"] is False, name
        assert sum(v["pass"] is False for k, v in acc.items() if k != "all") == 1, name
        assert ("FAIL " + acc[name]["what"]) in gpu_decode.verdict(acc, "H100")
    acc = gpu_decode.acceptance(good | {"e2e": []})  # not measured: not met
    assert acc["e2e_32k_b16_over_dynamic"]["pass"] is None and acc["all"] is False
    assert "not measured" in gpu_decode.verdict(acc, "H100")


def test_kernel_sass_stores_hold_their_rows_in_registers(tmp_path):
    """The store kernels compiled for sm_90 as a GPU launches them (``kernel_sass.py --stores``, head_dim 128): the
    per-token store with error feedback (float16 steps and one-byte ones) keeps its row (one row, one warp) in
    registers: no spills, no stack, and its
    loop over the channels stays short (97 instructions a channel on triton 3.9; bound 200) and has no barrier (one
    warp). Before its codes went straight into packed words, the codes' tile took a layout holding all 128 in every
    thread: 1,134 instructions a channel, 255 registers and spills. The KVarN key tiles (8 warps, 128 × 128 float32 a program) do not
    spill either. Cannot run where triton ships no CUDA toolchain."""
    import json
    import os

    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
        pytest.skip("this triton install has no CUDA toolchain (nvdisasm) to compile and disassemble with")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (compiled, not interpreted)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"
    proc = subprocess.run([sys.executable, str(script), "--stores", "--widths", "2", "--head-dims", "128", "--json",
                           str(tmp_path / "s.json")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads((tmp_path / "s.json").read_text())["stores"]}
    assert set(rows) == {"token", "token +ldlq", "token e5m3", "token e5m3 +ldlq", "key tiles", "key tiles +ldlq"}
    for fb in (rows["token +ldlq"], rows["token e5m3 +ldlq"]):  # (one-byte steps: since session 74)
        assert fb["rows_per_program"] == 1 and rows["token"]["rows_per_program"] == 8  # a GPU's rows, not the interpreter's
        assert fb["stack"] == 0 and fb["spill_loads"] == 0 and fb["registers"] <= 128 and fb["num_warps"] == 1, fb
        assert len(fb["loop_instructions"]) == 1 and fb["loop_instructions"][0] < 200 and fb["loop_barriers"] == [0], fb
    assert rows["token e5m3"]["stack"] == 0 and rows["token e5m3"]["spill_loads"] == 0, rows["token e5m3"]
    for name in ("key tiles", "key tiles +ldlq"):
        assert rows[name]["stack"] == 0 and rows[name]["spill_loads"] == 0 and rows[name]["num_warps"] == 8, rows[name]
    assert len(rows["key tiles +ldlq"]["loop_instructions"]) == 2  # the balance's rounds, then the rows in order


def test_compile_launches_records_and_compiles_a_test_runs_launches(tmp_path):
    """``benchmarks/compile_launches.py`` runs a test selection with its launches recorded (the bit-exact packing
    test: a store kernel at each of 1, 2, 3, 4 and 8 bits; the hook test: float32 decodes and a merge, under the
    interpreter's emulated dots) and compiles each as a GPU would launch it (8 rows a store program where the
    interpreter took 64, no emulation) for sm_90: none fails, no store spills. Cannot run where triton ships no CUDA
    toolchain."""
    import json
    import os

    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
        pytest.skip("this triton install has no CUDA toolchain (nvdisasm) to compile and disassemble with")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_launches.py"
    proc = subprocess.run([sys.executable, str(script), "--tests",
                           "tests/test_triton_kernels.py -k 'test_pack_bit_exact or test_launches_go_through_a_hook'",
                           "--record", str(tmp_path / "l.json"), "--json", str(tmp_path / "c.json")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    recorded = json.loads((tmp_path / "l.json").read_text())["launches"]
    stores = [r for r in recorded if r["name"] == "store"]
    assert sorted(r["meta"]["BITS"] for r in stores) == [1, 2, 3, 4, 8] and {r["meta"]["BR"] for r in stores} == {64}
    decodes = [r for r in recorded if r["name"] == "decode"]  # the hook test's: one split, then two and a merge
    assert decodes and all(r["meta"]["EMU"] and r["meta"]["DT"] == {"tl": "float32"} for r in decodes)
    assert {r["name"] for r in recorded} == {"store", "decode", "merge"}
    res = json.loads((tmp_path / "c.json").read_text())
    n = len(res["rows"])
    assert n >= 7 and res["failed"] == 0 and f"compiled {n} of {n}" in proc.stdout
    assert all(r["instructions"] > 0 and r["registers"] > 0 for r in res["rows"]), res["rows"]
    assert all(r["meta"]["BR"] == 8 and r["stack"] == 0 for r in res["rows"] if r["name"] == "store")
    assert all(not r["meta"]["EMU"] for r in res["rows"] if r["name"] == "decode")  # as a GPU launches them


def test_kernel_sass_compiles_both_paths(tmp_path):
    """The compile-only profile of the decode kernel for sm_90 (no GPU): the launch it records is the one decode
    makes (K2V2 and K3V3 bfloat16 head_dim 128 read their codes in classes of 8 under the default tuning, session
    46's tiles otherwise), and the class path's loop over the middle issues fewer instructions per token than the
    tiles' on its steady path (without the blocks it runs now and then: 0.22× at 2 bits, 0.35× at 3 on triton 3.9;
    bounds 0.45× and 0.5×) with at most a handful of spilled registers reloaded there; its guarded blocks (the
    rescaling of the value accumulators, a partial tile's mask) are found; the ``kvarn`` method's tiles of keys and
    values at head_dim 128 compile without spills. Cannot run where triton ships no CUDA toolchain."""
    import json
    import os

    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
        pytest.skip("this triton install has no CUDA toolchain (nvdisasm) to compile and disassemble with")
    import subprocess
    import sys

    # its own process: this one imported triton under the interpreter (conftest), which cannot compile
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"
    proc = subprocess.run([sys.executable, str(script), "--widths", "2,3", "--configs", "tiles,classes 32", "--json",
                           str(tmp_path / "k.json"), "--max-registers", "none,128", "--fp-stages", "1"], env=env,
                          capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "k.json").read_text())
    for bits, bound in ((2, 0.45), (3, 0.5)):  # 0.22x and 0.35x on triton 3.9
        tiles, _, classes, capped = (r for r in res["rows"] if r["bits"] == bits)
        # the register cap reaches ptxas: 128 registers hold 16 one-warp programs a multiprocessor where ptxas's own
        # choice (~255) holds 8; the class path's shared memory (12 KB, its windows' loop unpipelined) allows 17
        assert capped["max_registers"] == 128 and capped["registers"] <= 128 and classes["max_registers"] is None
        assert classes["shared"] <= 12288 and capped["resident_warps"] == 16 > classes["resident_warps"] >= 8, capped
        assert (tiles["classes"], tiles["block_n"], tiles["num_warps"]) == (False, 64, 4)
        assert (classes["classes"], classes["block_n"], classes["num_warps"]) == (True, 32, 1)
        assert tiles["mma"] > 0 and classes["mma"] > 0 and tiles["over_baseline"] == 1.0
        assert classes["steady_over_baseline"] < bound and classes["steady_spill_loads"] <= 8, classes
        assert classes["guarded_blocks"] and classes["warp_instr_per_token"] > classes["steady_warp_instr_per_token"]
    assert "warp-instr/token" in proc.stdout and res["target"] == "sm_90"
    # the kvarn method's layout (key and value tiles of 128) at head_dim 128: launched with two warps, it spills nothing
    # (one warp spilled ~70 registers a tile of tokens)
    proc = subprocess.run([sys.executable, str(script), "--widths", "2", "--configs", "classes 32", "--key-tiles", "128",
                           "--value-tiles", "128", "--json", str(tmp_path / "v.json")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "v.json").read_text())["rows"]
    assert (row["value_tiles"], row["num_warps"], row["spill_loads"], row["spill_stores"]) == (128, 2, 0, 0), row
    # the vLLM plugin's launches (paged cells through the block table, the windows read in place from the pool of
    # copies) at SmolLM2's served shape: per-token codes and auto's key tiles spill nothing (21.6 and 35.9
    # warp-instructions a token on triton 3.9, against 16-19 and 28-37 contiguous: the block table's address math)
    proc = subprocess.run([sys.executable, str(script), "--widths", "2", "--configs", "classes 32", "--head-dims", "64",
                           "--q-heads", "9", "--kv-heads", "3", "--paged", "per_token,ktiles", "--json", str(tmp_path / "p.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [(r["paged"], r["key_tiles"]) for r in rows] == [("per_token", 0), ("ktiles", 128)], rows
    for r in rows:
        assert r["spill_loads"] == r["spill_stores"] == 0 and r["classes"] and 0 < r["warp_instr_per_token"] < 60, r
