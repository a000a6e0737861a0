"""wushkv: WUSH-KV transforms and a bit-packed low-bit KV cache for Hugging Face transformers."""

__version__ = "0.1.0"
