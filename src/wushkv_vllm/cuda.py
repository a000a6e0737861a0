"""vLLM's CUDA attention backends (``FLASH_ATTN``, ``TRITON_ATTN``), serving WUSH-KV when the model folder holds a
wushkv side file (vLLM 0.32.0). Written for vLLM's CUDA build and tested here, on CPU: vLLM's own classes on fake
CUDA tensors (tests/fake_cuda.py: PyTorch's device rules enforced, the host's waits for the device counted), the
kernels under Triton's interpreter. Not yet run on a GPU (docs/reference/serving.md, "Not done yet").

:func:`wushkv_vllm.register` puts :class:`WushKVFlashAttnBackend` and :class:`WushKVTritonBackend` in place of
``FLASH_ATTN`` and ``TRITON_ATTN`` on a CUDA platform (vLLM's ``register_backend``). For a folder without a side file
every method is vLLM's own backend's. With one, the cells, the key update and the attention are those of the CPU
backend (:class:`wushkv_vllm.backend.ServedImpl`), on the cache's device:

* ``customize_spec`` gives vLLM the cell size and ``supported_kv_cache_layouts`` the (block, head, token, byte)
  layout the plugin's stores, gathers and field views are written for;
* decode rows go through wushkv's Triton decode kernel over the cells in place (key tiles too), the new tokens
  through its store kernel where it covers the codec (:func:`wushkv_vllm.paged.decode_batch_triton`,
  ``SlotCodec.store``, called by the forward, which knows the step's padding on the host); prefill chunks, the key
  tiles' quantizer and the rotating key mean through the plugin's torch paths;
* the windows' copies live on the device; their bookkeeping runs on the host, from copies of the step's slot mapping,
  sequence lengths and block table that :class:`WushKVBuilderMixin` makes once a step for every layer
  (:class:`WushKVMetadata`). The forward is host-driven Python, so it declares no CUDA graph support
  (``AttentionCGSupport.NEVER``: vLLM captures the layers between attention piecewise) and turns down vLLM's fusions
  of RoPE with the cache update and of the output's quantization.

Other CUDA backends are not replaced (FlashInfer, which vLLM prefers on Blackwell GPUs, is not installed here to
test against): under one of them a served folder runs without the plugin, in full precision. On such a GPU, serve with
``--attention-backend FLASH_ATTN`` (or ``TRITON_ATTN``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)
from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                    TritonAttentionMetadataBuilder)
from vllm.v1.kv_cache_layout import KVCacheLayout

from .backend import ServedImpl, served_model
from .served import UnsupportedFolder


@dataclass
class WushKVMetadata:
    """A step's batch for a served folder's layers: vLLM's tensors on the device, and ``host`` = (query start
    locations (R + 1) and sequence lengths (R) as ints, slot mapping (T,), block table (R, ·)) copied to the host once
    for every layer (:func:`wushkv_vllm.backend.host_batch`)."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # (R + 1,)
    seq_lens: torch.Tensor  # (R,)
    block_table: torch.Tensor  # (R, max blocks)
    slot_mapping: torch.Tensor  # (T,)
    host: tuple[list[int], list[int], torch.Tensor, torch.Tensor]


def served_metadata(cam, speculative: bool = False) -> WushKVMetadata:
    """:class:`WushKVMetadata` of vLLM's ``CommonAttentionMetadata``: the host's query start locations are vLLM's own
    copy, and so are the sequence lengths unless ``speculative`` (vLLM's host copy is then an upper bound: the
    device's are copied over); the slot mapping and block table are copied over (one wait for the device a step)."""
    R, T = cam.num_reqs, cam.num_actual_tokens
    seq_lens = None if speculative else cam.seq_lens_cpu_upper_bound  # exact without speculative decoding
    host = (cam.query_start_loc_cpu[:R + 1].tolist(),
            (seq_lens if seq_lens is not None else cam.seq_lens)[:R].tolist(),
            cam.slot_mapping[:T].cpu(), cam.block_table_tensor[:R].cpu())
    return WushKVMetadata(T, cam.query_start_loc[:R + 1], cam.seq_lens[:R], cam.block_table_tensor[:R],
                          cam.slot_mapping[:T], host)


class WushKVBuilderMixin:
    """Precedes a vLLM metadata builder in the bases: its own metadata for a folder without a side file,
    :class:`WushKVMetadata` and no CUDA graphs for a served one."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if served_model(vllm_config) is not None:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        # at every step, where no vLLM config is current: this builder's engine's, not the process's last
        if served_model(self.vllm_config) is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        return served_metadata(common_attn_metadata, self.vllm_config.speculative_config is not None)

    def update_block_table(self, metadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor):
        if not isinstance(metadata, WushKVMetadata):
            return super().update_block_table(metadata, blk_table, slot_mapping)
        starts, lens, _, _ = metadata.host
        R, T = len(lens), metadata.num_actual_tokens
        return replace(metadata, block_table=blk_table[:R], slot_mapping=slot_mapping[:T],
                       host=(starts, lens, slot_mapping[:T].cpu(), blk_table[:R].cpu()))


class WushKVBackendMixin:
    """Precedes a vLLM CUDA backend in the bases (module docstring)."""

    @classmethod
    def customize_spec(cls, spec):
        served = served_model()
        if served is None:
            return super().customize_spec(spec)
        if spec.state_content_bytes is not None:  # another packing asked for (a quantized kv_cache_dtype)
            raise UnsupportedFolder(f"the wushkv plugin stores its own cells; serve its folders with kv_cache_dtype "
                                    f"'auto', not {spec.kv_quant_mode.name.lower()}")
        return replace(spec, state_content_bytes=served.slot_bytes(spec.dtype.itemsize))

    @classmethod
    def supported_kv_cache_layouts(cls):
        if served_model() is not None:
            return (KVCacheLayout.LBHNC,)
        return super().supported_kv_cache_layouts()


class _NoFusions:
    """vLLM's compile passes fuse RoPE into the cache update and quantize the output in the kernel: neither applies to
    a served folder's cells (its keys are transformed after RoPE, by the update)."""

    def fused_rope_kvcache_supported(self):
        return False if self.served is not None else super().fused_rope_kvcache_supported()

    def fused_output_quant_supported(self, quant_key):
        return False if self.served is not None else super().fused_output_quant_supported(quant_key)


class WushKVTritonImpl(_NoFusions, ServedImpl, TritonAttentionImpl):
    """``TRITON_ATTN``'s impl, with WUSH-KV's cells for a served folder."""


class WushKVFlashAttnImpl(_NoFusions, ServedImpl, FlashAttentionImpl):
    """``FLASH_ATTN``'s impl, with WUSH-KV's cells for a served folder."""


class WushKVTritonBuilder(WushKVBuilderMixin, TritonAttentionMetadataBuilder):
    pass


class WushKVFlashAttnBuilder(WushKVBuilderMixin, FlashAttentionMetadataBuilder):
    pass


class WushKVTritonBackend(WushKVBackendMixin, TritonAttentionBackend):
    """``TRITON_ATTN``, with WUSH-KV's cells for a served folder."""

    @staticmethod
    def get_impl_cls():
        return WushKVTritonImpl

    @staticmethod
    def get_builder_cls():
        return WushKVTritonBuilder


class WushKVFlashAttnBackend(WushKVBackendMixin, FlashAttentionBackend):
    """``FLASH_ATTN``, with WUSH-KV's cells for a served folder."""

    @staticmethod
    def get_impl_cls():
        return WushKVFlashAttnImpl

    @staticmethod
    def get_builder_cls():
        return WushKVFlashAttnBuilder
