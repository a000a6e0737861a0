"""Run in vLLM's environment (``PYTHONPATH=src:tests .venv-vllm/bin/python tests/vllm_fake_cuda_check.py FOLDER...``):
:class:`wushkv_vllm.cuda.WushKVTritonImpl` on fake CUDA tensors (:mod:`fake_cuda`: CPU data that says cuda:0), so that
the plugin takes its CUDA paths on a machine without a GPU, against :class:`wushkv_vllm.backend.WushKVCPUImpl` on CPU
tensors, over the same steps of a served folder (exported by tests/test_vllm_plugin.py's ``_export``).

Each step is laid out as vLLM lays it out on a GPU: the kv cache, queries, keys, values, output, block table, sequence
lengths, query start locations and slot mapping on the device (the slot mapping padded with -1 past the step's
tokens, the batch's tensors with a row past its requests), their host copies as real CPU tensors
(``CommonAttentionMetadata``'s ``*_cpu``), the metadata made by the backend's builder
(:func:`wushkv_vllm.cuda.served_metadata`), whose declarations for a served folder are checked first. Triton's
kernels run under its interpreter on the CPU data, after :func:`fake_cuda.launch` has checked that their tensors are
on the device.

Prints one JSON line per folder: the errors a GPU would raise (``errors``: "file:line <- caller: what"), the worst
relative difference of the outputs (``worst``), host-device syncs (``syncs_per_step_metadata``: once a step for all
layers; ``syncs_per_layer_decode_step``: one layer's update and forward in a step of decodes alone;
``syncs_per_layer_max``: the most of any step; ``syncs``: all of them by place and kind), the kernels launched and the
seconds taken. Exits non-zero (an AssertionError with the list) on any error, on outputs further apart than
``TOLERANCE`` or on cells whose bytes differ.
"""

import json
import os
import sys
import time
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
# The CPU side takes wushkv's PyTorch code, as the device side does, not its compiled C++ kernels: those sum in other
# orders, and KVarN's balance may then keep another of two rounds of near-equal imbalance (wushkv.quantizers.kvarn
# .balance): other key tiles, equally good, but outputs 0.1 apart (relative) on a wush+ktiles+ldlq folder. With the
# same code on both sides the outputs agree to float32 rounding (below 1e-6 on the folders tried) and the cells to
# the byte.
os.environ.setdefault("WUSHKV_NO_EXT", "1")
# For the same reason the CPU side stores KVarN key tiles through the same tile kernel as the device side (under the
# interpreter, triton_enabled(True) for its forward where the folder has key tiles): the kernel follows the PyTorch
# balance step for step, but its float32 sums run in numpy's order, and on a near tie it keeps the other round. That
# the kernel writes the bytes of the PyTorch path is held elsewhere, on data without such ties
# (tests/test_vllm_plugin.py::test_key_tiles_through_the_triton_kernel_write_the_bytes_of_the_codec).

import torch  # noqa: E402
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

import fake_cuda  # noqa: E402
from wushkv import _ext  # noqa: E402
from wushkv import triton_kernels as tk  # noqa: E402
from wushkv.decode import triton_enabled  # noqa: E402
from wushkv_vllm.backend import WushKVCPUImpl  # noqa: E402
from wushkv_vllm.cuda import WushKVFlashAttnBackend, WushKVMetadata, WushKVTritonBackend, WushKVTritonImpl  # noqa: E402
from wushkv_vllm.served import load_served  # noqa: E402

TOLERANCE = 1e-5  # relative to the largest output: the Triton decode sums in another order than torch's attention

BLOCK = 128
BLOCKS_PER_REQUEST = 3  # 384 positions: the longest request reaches 272
PAD = 3  # slot mapping entries of -1 past the step's tokens (vLLM pads the step to a CUDA graph's size)
# three requests, {request: new tokens}: chunked prefills beside decodes, then decodes alone. With windows
# (128, 64, 16) (tiles of 128 after a sink of 128): request 0's decode at position 255 completes a key tile, request
# 2's chunk of 230 another; with (4, 8, 4) most of every context is read from codes
STEPS = [{0: 254, 1: 60}, {0: 1, 1: 140, 2: 40}, {0: 1, 1: 1, 2: 230}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]

def _launch_on_device(name, grid, args, meta, run):
    """Every Triton launch (:func:`wushkv.triton_kernels.launches_through`) through :func:`fake_cuda.launch`: its
    tensors must be on the device. The kernels then run under Triton's interpreter,
    with two launch parameters set as for CPU tensors, which they were chosen from the query's device for (a GPU's
    here): ``EMU`` on (the interpreter has no inline PTX), and the store's rows per program ``BR`` at least 64 (the
    stored bytes do not depend on it; the GPU's 1, for a transform or the affine clip, would run one interpreted
    program per row: half a minute a folder). The store masks the rows past its count, so the grid is rounded up."""
    if "EMU" in meta:
        meta["EMU"] = True
    if name == "store" and meta["BR"] < 64:
        grid = (-(-grid[0] * meta["BR"] // 64), *grid[1:])
        meta["BR"] = 64
    return fake_cuda.launch(f"triton {name}", lambda *a, **m: run(name, grid, a, m), *args, **meta)


class _Md:  # CPU_ATTN's metadata and the layer: the fields the plugin reads
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _layer(hf: dict) -> tuple[str, int | None]:
    """The layer driven and its sliding window: the first sliding one where the model has them, else layer 1."""
    types = hf.get("layer_types") or []
    i = next((i for i, t in enumerate(types) if t == "sliding_attention"), None)
    if i is None:
        return "model.layers.1.self_attn.attn", None
    return f"model.layers.{i}.self_attn.attn", hf["sliding_window"]


def _diff(after: dict, before: dict) -> dict:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def check(folder: str) -> dict:
    t0 = time.perf_counter()
    hf = json.loads(open(os.path.join(folder, "config.json")).read())
    hf = hf.get("text_config", hf)
    Hq, H = hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or hf["hidden_size"] // Hq
    layer_name, window = _layer(hf)
    key_tiles = load_served(folder).cfg.side_quantizer("key") == "kvarn"  # (the CPU side's KVarN tiles: the kernels too)
    cfg = VllmConfig(model_config=ModelConfig(model=folder, dtype="float32", max_model_len=BLOCK * BLOCKS_PER_REQUEST))
    g = torch.Generator().manual_seed(0)
    fake_cuda.reset()
    tk.reset_calls()
    # one rank, without starting vLLM's process groups (an engine's work)
    with set_current_vllm_config(cfg), mock.patch("vllm.distributed.get_tensor_model_parallel_rank", return_value=0), \
            mock.patch("vllm.distributed.get_tensor_model_parallel_world_size", return_value=1):
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=d, dtype=torch.float32)
        # what both CUDA backends declare for a served folder: the cell size, the (block, head, token, byte) layout,
        # no CUDA graphs; and the builder's metadata (host copies)
        for backend in (WushKVTritonBackend, WushKVFlashAttnBackend):
            served_spec = backend.customize_spec(spec)
            assert served_spec.state_content_bytes is not None, backend
            assert backend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,), backend
            assert backend.get_builder_cls().get_cudagraph_support(cfg, served_spec) == AttentionCGSupport.NEVER, backend
        C = WushKVTritonBackend.customize_spec(spec).state_content_bytes
        args = dict(num_heads=Hq, head_size=d, scale=d ** -0.5, num_kv_heads=H, alibi_slopes=None,
                    sliding_window=window, kv_cache_dtype="auto", logits_soft_cap=hf.get("attn_logit_softcapping"))
        looked_up = _ext.looked_up()  # before the CPU impl (False in this process's first check)
        cpu, gpu = WushKVCPUImpl(**args), WushKVTritonImpl(**args)
        kernels_at_start = (looked_up, _ext.looked_up())
        assert not gpu.fused_rope_kvcache_supported()
        builder = WushKVTritonBackend.get_builder_cls()(served_spec, [layer_name], cfg, torch.device("cpu"))
        layer = _Md(layer_name=layer_name)
        R = 3
        blocks = R * BLOCKS_PER_REQUEST + 2  # block 0 unused, one spare
        table = (torch.randperm(blocks - 1, generator=g)[:R * BLOCKS_PER_REQUEST] + 1).reshape(R, -1).to(torch.int32)
        cache_cpu = torch.zeros(blocks, H, BLOCK, C, dtype=torch.uint8)
        cache_gpu = fake_cuda.on_device(cache_cpu.clone())
        done = [0] * R
        worst, per_layer, metadata_syncs = 0.0, [], 0
        for step in STEPS:
            reqs = sorted(step)
            q_lens = [step[r] for r in reqs]
            starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
            lens = torch.tensor([done[r] + step[r] for r in reqs], dtype=torch.int32)
            T = int(starts[-1])
            pos = torch.cat([torch.arange(done[r], done[r] + step[r]) for r in reqs])
            rows = torch.repeat_interleave(torch.tensor(reqs), torch.tensor(q_lens))
            slots = table[rows, pos // BLOCK].long() * BLOCK + pos % BLOCK
            padded = torch.cat([slots, torch.full((PAD,), -1, dtype=slots.dtype)])
            q, k, v = (torch.randn(T + PAD, n, d, generator=g) for n in (Hq, H, H))
            # vLLM's persistent buffers hold rows past the batch's requests: a row of each here
            qsl_p, lens_p = torch.cat([starts, starts[-1:]]), torch.cat([lens, torch.zeros(1, dtype=torch.int32)])
            bt_p = torch.cat([table[reqs], torch.zeros(1, BLOCKS_PER_REQUEST, dtype=torch.int32)])
            cam = CommonAttentionMetadata(
                query_start_loc=fake_cuda.on_device(qsl_p.clone()), query_start_loc_cpu=qsl_p.clone(),
                seq_lens=fake_cuda.on_device(lens_p.clone()), seq_lens_cpu_upper_bound=lens_p.clone(),
                num_reqs=len(reqs), num_actual_tokens=T, max_query_len=max(q_lens), max_seq_len=int(lens.max()),
                block_table_tensor=fake_cuda.on_device(bt_p.clone()), slot_mapping=fake_cuda.on_device(padded.clone()))

            md_cpu = _Md(num_actual_tokens=T, query_start_loc=starts, seq_lens=lens, block_table=table[reqs],
                         slot_mapping=slots)
            out_cpu = torch.zeros(T + PAD, Hq, d)
            with triton_enabled(False):
                cpu.do_kv_cache_update(layer, k, v, cache_cpu, padded)
            with triton_enabled(key_tiles):  # (the forward stores the tiles; their decode takes the general path)
                cpu.forward(layer, q, k, v, cache_cpu, md_cpu, out_cpu)

            out_gpu = fake_cuda.on_device(torch.zeros(T + PAD, Hq, d))
            dev = [fake_cuda.on_device(x.clone()) for x in (q, k, v, padded)]
            with triton_enabled(True), tk.launches_through(_launch_on_device), fake_cuda.active():
                s0 = fake_cuda.syncs()
                md_gpu = builder.build(0, cam)
                s1 = fake_cuda.syncs()
                gpu.do_kv_cache_update(layer, dev[1], dev[2], cache_gpu, dev[3])
                gpu.forward(layer, dev[0], dev[1], dev[2], cache_gpu, md_gpu, out_gpu)
                s2 = fake_cuda.syncs()
            assert isinstance(md_gpu, WushKVMetadata) and md_gpu.host[1] == lens.tolist(), md_gpu
            metadata_syncs = sum(_diff(s1, s0).values())
            per_layer.append(sum(_diff(s2, s1).values()))
            got = fake_cuda.host(out_gpu)
            worst = max(worst, float((got - out_cpu).abs().max() / out_cpu.abs().max()))
            for r in reqs:
                done[r] += step[r]
        differing = int((fake_cuda.host(cache_gpu) != cache_cpu).any(-1).sum())
    calls = tk.calls()
    return {"folder": folder, "errors": fake_cuda.errors(), "worst": worst, "syncs_per_step_metadata": metadata_syncs,
            "syncs_per_layer_decode_step": per_layer[-1], "syncs_per_layer_max": max(per_layer),
            "syncs": fake_cuda.syncs(), "calls": calls, "cells_differing": differing,
            "cells": cache_cpu[..., 0].numel(), "seconds": round(time.perf_counter() - t0, 1),
            "kernels_at_start": kernels_at_start}


if __name__ == "__main__":
    bad = []
    for folder in sys.argv[1:]:
        r = check(folder)
        print(json.dumps(r), flush=True)
        bad += [f"{folder}: {e}" for e in r["errors"]]
        if r["worst"] > TOLERANCE:
            bad.append(f"{folder}: outputs differ by {r['worst']:.3g} (> {TOLERANCE:g}) relative")
        if r["cells_differing"]:
            bad.append(f"{folder}: {r['cells_differing']} of {r['cells']} cells differ from the CPU backend's")
    assert not bad, "\n".join(bad)
