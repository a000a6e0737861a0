"""Run in vLLM's environment by tests/test_vllm_plugin.py (``python vllm_cuda_backend_check.py FOLDER``): the CUDA
backends of :mod:`wushkv_vllm.cuda` on CPU tensors, their Triton kernels under Triton's interpreter, against the CPU
backend on the same steps of a served folder. Exits non-zero (an assertion) where they differ; prints a JSON summary."""

import json
import os
import sys
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from wushkv import triton_kernels as tk  # noqa: E402
from wushkv.decode import triton_enabled  # noqa: E402
from wushkv_vllm.backend import WushKVCPUImpl  # noqa: E402
from wushkv_vllm.cuda import (WushKVFlashAttnBackend, WushKVMetadata, WushKVTritonBackend, WushKVTritonBuilder,  # noqa: E402
                              WushKVTritonImpl)


class _Md:  # CPU_ATTN's metadata, the fields the plugin reads
    def __init__(self, **kw):
        self.__dict__.update(kw)


def main(folder: str) -> dict:
    hf = json.loads(open(os.path.join(folder, "config.json")).read())
    Hq, H = hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or hf["hidden_size"] // Hq
    cfg = VllmConfig(model_config=ModelConfig(model=folder, dtype="float32", max_model_len=256))
    bs, blocks = 16, 24
    g = torch.Generator().manual_seed(0)
    out = {}
    # one rank, without starting vLLM's process groups (an engine's work)
    with set_current_vllm_config(cfg), mock.patch("vllm.distributed.get_tensor_model_parallel_rank", return_value=0), \
            mock.patch("vllm.distributed.get_tensor_model_parallel_world_size", return_value=1):
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=d, dtype=torch.float32)
        for backend in (WushKVTritonBackend, WushKVFlashAttnBackend):
            served_spec = backend.customize_spec(spec)
            assert served_spec.state_content_bytes is not None, backend
            assert backend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,), backend
            assert backend.get_builder_cls().get_cudagraph_support(cfg, served_spec) == AttentionCGSupport.NEVER, backend
        C = served_spec.state_content_bytes
        args = dict(num_heads=Hq, head_size=d, scale=d ** -0.5, num_kv_heads=H, alibi_slopes=None, sliding_window=None,
                    kv_cache_dtype="auto")
        cpu, gpu = WushKVCPUImpl(**args), WushKVTritonImpl(**args)
        builder = WushKVTritonBuilder(served_spec, ["model.layers.1.self_attn.attn"], cfg, torch.device("cpu"))
        assert not gpu.fused_rope_kvcache_supported()
        layer = _Md(layer_name="model.layers.1.self_attn.attn")
        caches = {"cpu": torch.zeros(blocks, H, bs, C, dtype=torch.uint8), "gpu": torch.zeros(blocks, H, bs, C, dtype=torch.uint8)}
        # three requests: chunked prefills beside decodes, then decodes; each request's blocks scattered over the cache
        table = torch.tensor([[3, 7, 1, 12, 20], [5, 2, 9, 15, 21], [8, 4, 11, 13, 22]], dtype=torch.int32)
        steps = [{0: 20, 1: 9}, {0: 1, 1: 15, 2: 5}, {0: 1, 1: 1, 2: 1}, {0: 1, 2: 30}, {0: 1, 1: 1, 2: 1}]
        done = [0, 0, 0]
        worst, decode_rows = 0.0, 0
        tk.reset_calls()
        for step in steps:
            reqs = sorted(step)
            q_lens = [step[r] for r in reqs]
            starts = [0]
            for n in q_lens:
                starts.append(starts[-1] + n)
            lens = [done[r] + step[r] for r in reqs]
            pos = torch.cat([torch.arange(done[r], done[r] + step[r]) for r in reqs])
            rows = torch.repeat_interleave(torch.tensor(reqs), torch.tensor(q_lens))
            slots = (table[rows, pos // bs].long() * bs + pos % bs)
            T = starts[-1]
            q = torch.randn(T, Hq, d, generator=g)
            k = torch.randn(T, H, d, generator=g)
            v = torch.randn(T, H, d, generator=g)
            qsl, sl, bt = torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), table[reqs]
            md_cpu = _Md(num_actual_tokens=T, query_start_loc=qsl, seq_lens=sl, block_table=bt, slot_mapping=slots)
            cam = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=sl, num_reqs=len(reqs),
                                          num_actual_tokens=T, max_query_len=max(q_lens), max_seq_len=max(lens),
                                          block_table_tensor=bt, slot_mapping=slots, seq_lens_cpu_upper_bound=sl.clone())
            md_gpu = builder.build(0, cam)
            assert isinstance(md_gpu, WushKVMetadata) and md_gpu.host[0] == starts and md_gpu.host[1] == lens
            outs = {}
            for name, impl, md in (("cpu", cpu, md_cpu), ("gpu", gpu, md_gpu)):
                o = torch.zeros(T, Hq, d)
                with triton_enabled(name == "gpu"):
                    impl.do_kv_cache_update(layer, k, v, caches[name], slots)
                    impl.forward(layer, q, k, v, caches[name], md, o)
                outs[name] = o
            err = float((outs["gpu"] - outs["cpu"]).abs().max() / outs["cpu"].abs().max())
            worst = max(worst, err)
            decode_rows += sum(1 for n in q_lens if n == 1)
            for r in reqs:
                done[r] += step[r]
        calls = tk.calls()
        assert calls.get("decode", 0) > 0 and calls.get("store", 0) > 0, calls
        assert torch.equal(caches["gpu"], caches["cpu"]), "the Triton store wrote other bytes than the CPU store"
        assert worst < 1e-5, worst
        out.update(worst=worst, decode_rows=decode_rows, calls=dict(calls), steps=len(steps))
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
