"""Install per-(layer, KV head) transforms into a model (docs/reference/math.md#3-wush-kv-statistics-placement-folding).

* Values, folded offline (zero run-time cost): ``v_proj[h] ← T_V(h)·v_proj[h]`` (weight and bias) and
  ``o_proj[:, g] ← o_proj[:, g]·T_V(h)⁻¹`` for every query head ``g`` of group ``h``.
* Keys, online after RoPE: a :class:`KeyTransform` submodule named ``wushkv_key`` on each attention
  module; the registered ``"wushkv"`` attention (or the wushkv cache) applies ``k' = T_K k`` and
  ``q' = T_K^{-T} q``, so ``q'ᵀk' = qᵀk``.

:func:`apply_transforms` returns a :class:`Installed` handle whose ``restore()`` puts back the original
weights, removes the key transforms and the attention implementation; it is also a context manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .hf import restore_attention, use_wushkv_attention
from .cache import WushKVCache
from .config import QuantConfig
from .layer import CacheInputs, RotatingKeyMean
from .models import ArchSpec, attention_modules, describe, projections, rope_parameters
from .transforms import LayerTransforms

KEY_TRANSFORM_NAME = "wushkv_key"


class KeyTransform(nn.Module):
    """Online key transform of one attention layer: buffers ``T`` and ``T_inv`` (Hkv, d, d).

    With ``mu`` (Hkv, d), keys are centered first: k' = T (k − μ). Every key of the layer (sink,
    middle, recent) is shifted by the same μ, so each query's scores all move by the same −qᵀμ and
    the softmax is unchanged: exact, and free but for one subtraction (``shift`` = T μ is precomputed).
    Invalid under a logit softcap or learned sink logits; :func:`apply_transforms` refuses it (:func:`check_centering`).

    What the cache does besides (error feedback, keys centered on their rotating mean) is not here: it reaches
    the cache explicitly, as :class:`wushkv.layer.CacheInputs` (:attr:`Installed.cache_inputs`).
    """

    def __init__(self, T: torch.Tensor, T_inv: torch.Tensor, mu: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("T", T.detach().clone(), persistent=False)
        self.register_buffer("T_inv", T_inv.detach().clone(), persistent=False)
        self.register_buffer("T_t", T.detach().transpose(-1, -2).contiguous(), persistent=False)  # rows: k @ Tᵀ
        shift = None
        if mu is not None:
            if tuple(mu.shape) != (T.shape[0], T.shape[-1]):
                raise ValueError(f"mu must have shape {(T.shape[0], T.shape[-1])} (KV heads, head_dim), got {tuple(mu.shape)}")
            shift = torch.matmul(mu.detach().to(T.dtype).unsqueeze(1), self.T_t)  # (Hkv, 1, d): (T μ) as a row
        self.register_buffer("shift", shift, persistent=False)

    def _as(self, name: str, x: torch.Tensor) -> torch.Tensor:
        t = getattr(self, name)
        return t if t.dtype == x.dtype else t.to(x.dtype)

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """k (B, Hkv, S, d) -> T k per head (rows: k @ Tᵀ): one batched matmul for the whole layer."""
        out = _per_head(k, self._as("T_t", k))
        return out if self.shift is None else out - self._as("shift", k)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, Hq, T, d) -> T^{-T} q for every query head of the group (rows: q @ T⁻¹): one batched matmul."""
        B, Hq, T, d = q.shape
        H = self.T.shape[0]
        return _per_head(q.reshape(B, H, (Hq // H) * T, d), self._as("T_inv", q)).reshape(B, Hq, T, d)

    def extra_repr(self) -> str:
        return f"heads={self.T.shape[0]}, head_dim={self.T.shape[-1]}, centered={self.shift is not None}"


def _per_head(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x (B, H, R, d) times m (H, d, e) per head: (B, H, R, e). Over a batch, one ``bmm`` with the heads as its batch:
    ``torch.matmul`` broadcasts m over the rows by copying it B times (at batch 8 of SmolLM2 a decode step's query
    transform took 2.4x the time), twice a layer and step. One row: ``matmul`` (a few µs less than a bmm's
    reshapes)."""
    B, H, R, d = x.shape
    if B == 1:
        return torch.matmul(x, m)
    return torch.bmm(x.transpose(0, 1).reshape(H, B * R, d), m).view(H, B, R, -1).transpose(0, 1)


@dataclass
class Installed:
    """Handle to transforms installed in a model; ``restore()`` undoes everything.

    ``cache_inputs``: per layer, what the cache needs of the method besides its quantizer settings (error-feedback
    matrices, the rotating key mean); :meth:`cache` builds a :class:`~wushkv.cache.WushKVCache` with them."""

    model: nn.Module
    method: str
    previous_attention: str
    saved: list[dict[str, torch.Tensor]] = field(repr=False)
    cache_inputs: list[CacheInputs] = field(repr=False, default_factory=list)
    active: bool = True

    def cache(self, config: QuantConfig | list[QuantConfig] | None = None, **kwargs) -> WushKVCache:
        """A fresh quantized cache for the installed method (``kwargs``: ``attention_mask``, ``pad_lengths``)."""
        if not self.active:
            raise RuntimeError(f"the transforms of {self.method!r} were restored; install them again for a cache")
        return WushKVCache(self.model, config, inputs=self.cache_inputs, **kwargs)

    def restore(self) -> None:
        if not self.active:
            return
        spec = describe(self.model)
        with torch.no_grad():
            for attn, orig in zip(attention_modules(self.model, spec), self.saved):
                p = projections(attn, spec)
                p.v.weight.copy_(orig["v.weight"])
                p.o.weight.copy_(orig["o.weight"])
                for lin, key in ((p.v.linear, "v.bias"), (p.o, "o.bias")):
                    if key in orig:
                        lin.bias.copy_(orig[key])
                    elif lin.bias is not None:  # added by value centering
                        lin.bias = None
                if hasattr(attn, KEY_TRANSFORM_NAME):
                    delattr(attn, KEY_TRANSFORM_NAME)
        restore_attention(self.model, self.previous_attention)
        self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()


def check_centering(spec: ArchSpec, tr: dict[str, torch.Tensor], layer: int, method: str = "this method") -> None:
    """Refuse centering that is not exact on ``spec``'s attention. A constant key shift ``mu_K`` moves every score
    of a query by the same −qᵀμ, which the softmax ignores, unless a logit softcap (tanh is not shift-invariant) or
    learned sink logits (a column that does not move) are in the softmax; a value shift ``mu_V`` comes back
    exactly only where the attention weights sum to 1, which sink logits break. The rotating key mean
    (``mu_K_rope``) is added back when read, so it is exact everywhere."""
    if "mu_K" in tr and spec.attn_logit_softcap:
        raise ValueError(f"{method}: layer {layer}: centered keys (mu_K) change attention under a logit softcap "
                         f"({spec.attn_logit_softcap}); use an uncentered transform or the rotating key mean (+rmean)")
    for name, what in (("mu_K", "centered keys"), ("mu_V", "centered values")):
        if name in tr and spec.attention_sinks:
            raise ValueError(f"{method}: layer {layer}: {what} ({name}) change attention with learned sink logits "
                             f"({spec.family}); use an uncentered transform or the rotating key mean (+rmean)")


def _check(name: str, t: torch.Tensor, spec: ArchSpec, layer: int) -> None:
    want = (spec.num_kv_heads, spec.head_dim, spec.head_dim)
    if tuple(t.shape) != want:
        raise ValueError(f"layer {layer} {name} has shape {tuple(t.shape)}, expected {want} (KV heads, head_dim, head_dim)")
    if not torch.isfinite(t).all():
        raise ValueError(f"layer {layer} {name} contains NaN or inf")


@torch.no_grad()
def apply_transforms(model: nn.Module, transforms: list[LayerTransforms], method: str = "custom") -> Installed:
    """Fold ``T_V`` into the weights and install ``T_K`` online, for every layer.

    ``transforms[l]``: layer ``l``'s :class:`~wushkv.transforms.LayerTransforms` (see
    :func:`wushkv.methods.install.transforms_for`). Its error-feedback matrices and rotating key mean are not
    installed in the model: they become the handle's :attr:`Installed.cache_inputs`. Folding runs in float64.
    """
    transforms = list(transforms)  # (a generator would be spent by the check below)
    bad = next((i for i, tr in enumerate(transforms) if not isinstance(tr, LayerTransforms)), None)
    if bad is not None:
        raise TypeError(f"transforms[{bad}] is a {type(transforms[bad]).__name__}; apply_transforms takes LayerTransforms "
                        "(LayerTransforms.from_tensors builds one from tensors named T_K, T_K_inv, T_V, T_V_inv, ...)")
    transforms = [tr.tensors() for tr in transforms]  # by field name: the checks below name what is wrong
    spec = describe(model)
    mods = attention_modules(model, spec)
    if len(transforms) != len(mods):
        raise ValueError(f"got transforms for {len(transforms)} layers, the model has {len(mods)}")
    if any(hasattr(a, KEY_TRANSFORM_NAME) for a in mods):
        raise RuntimeError("transforms are already installed in this model; call restore() on the previous handle first")
    d, G = spec.head_dim, spec.group_size
    method = str(method)
    for i, attn in enumerate(mods):
        offloaded = [n for n, t in attn.named_parameters() if t.device.type == "meta"]
        if offloaded:
            raise ValueError(
                f"layer {i} attention weights {offloaded} are offloaded (on the meta device): folding T_V needs every layer's "
                "weights resident; use a device map that places each layer on one device (e.g. device_map='auto' with "
                "enough accelerator memory, or max_memory), not cpu/disk offload"
            )
    # validate every layer before touching any weight: a bad layer must not leave others folded
    ropes = {}
    for i, (attn, tr) in enumerate(zip(mods, transforms)):
        for name in ("T_K", "T_K_inv", "T_V", "T_V_inv"):
            _check(name, tr[name], spec, i)
        for name in ("F_K", "F_V"):
            if name in tr:
                _check(name, tr[name], spec, i)
        check_centering(spec, tr, i, method)
        if "mu_K" in tr:
            if not torch.isfinite(tr["mu_K"]).all():
                raise ValueError(f"layer {i} mu_K contains NaN or inf")
        if "mu_K_rope" in tr:
            if tuple(tr["mu_K_rope"].shape) != (spec.num_kv_heads, d) or not torch.isfinite(tr["mu_K_rope"]).all():
                raise ValueError(f"layer {i} mu_K_rope must be finite with shape {(spec.num_kv_heads, d)}, got {tuple(tr['mu_K_rope'].shape)}")
            if "mu_K" in tr:
                raise ValueError(f"layer {i}: mu_K (a constant key shift) and mu_K_rope (the rotating mean) are exclusive")
            ropes[i] = rope_parameters(model, i, spec)  # raises for an unsupported RoPE, before any folding
        if "mu_V" in tr and (tuple(tr["mu_V"].shape) != (spec.num_kv_heads, d) or not torch.isfinite(tr["mu_V"]).all()):
            raise ValueError(f"layer {i} mu_V must be finite with shape {(spec.num_kv_heads, d)}, got {tuple(tr['mu_V'].shape)}")
        if "mu_K" in tr and tuple(tr["mu_K"].shape) != (spec.num_kv_heads, d):
            raise ValueError(f"layer {i} mu_K must have shape {(spec.num_kv_heads, d)}, got {tuple(tr['mu_K'].shape)}")
    saved, inputs = [], []
    for li, (attn, tr) in enumerate(zip(mods, transforms)):
        p = projections(attn, spec)
        v, o = p.v, p.o  # v: the value rows (of the fused QKV projection, where fused); o: the output linear
        # the whole linear's bias is saved: it is the one value centering may add (over the fused q and k rows too)
        saved.append({"v.weight": v.weight.detach().clone(), "o.weight": o.weight.detach().clone()}
                     | ({"v.bias": v.linear.bias.detach().clone()} if v.linear.bias is not None else {})
                     | ({"o.bias": o.bias.detach().clone()} if o.bias is not None else {}))
        T_V, T_V_inv = tr["T_V"].double(), tr["T_V_inv"].double()
        if "mu_V" in tr:
            # v' = T_V (v − μ_V): the softmax weights sum to 1, so attention outputs shift by exactly −μ_V,
            # given back through the o_proj bias (W_o μ per query head). Biases are added where missing.
            mu_V = tr["mu_V"].double().to(v.weight.device)  # (Hkv, d)
            for lin in (v.linear, o):
                if lin.bias is None:
                    lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device),
                                            requires_grad=False)
            v.bias.sub_(mu_V.reshape(-1).to(v.bias.dtype))
            mu_full = mu_V.repeat_interleave(G, dim=0).reshape(-1)  # per query head, in o_proj's input order
            o.bias.add_((o.weight.double() @ mu_full.to(o.weight.device)).to(o.bias.dtype))
        Wv = v.weight.double().view(spec.num_kv_heads, d, -1)  # (Hkv, d, hidden)
        v.weight.copy_(torch.matmul(T_V.to(Wv.device), Wv).view_as(v.weight))
        if v.bias is not None:
            bv = v.bias.double().view(spec.num_kv_heads, d, 1)
            v.bias.copy_(torch.matmul(T_V.to(bv.device), bv).view_as(v.bias))
        Wo = o.weight.double().view(-1, spec.num_kv_heads, G, d)  # (hidden, Hkv, G, d)
        Wo = torch.einsum("ohgd,hde->ohge", Wo, T_V_inv.to(Wo.device))
        o.weight.copy_(Wo.reshape_as(o.weight))
        dev = v.weight.device
        # float32 key transforms (cast to the activations' dtype when applied), float64 for a float64 model: there
        # T_K and T_K⁻¹ rounded to float32 would be inverses only to ~1e-7, and float64 runs check exactness
        kdt = torch.float64 if v.weight.dtype == torch.float64 else torch.float32
        mu = tr["mu_K"].to(dev, kdt) if "mu_K" in tr else None
        T_K = tr["T_K"].to(dev, kdt)
        attn.add_module(KEY_TRANSFORM_NAME, KeyTransform(T_K, tr["T_K_inv"].to(dev, kdt), mu))
        key_mean = RotatingKeyMean(tr["mu_K_rope"].float(), T_K.float(), ropes[li]) if "mu_K_rope" in tr else None
        inputs.append(CacheInputs(*(tr[f"F_{s}"].float().to(dev) if f"F_{s}" in tr else None for s in "KV"), key_mean))
    previous = use_wushkv_attention(model)
    return Installed(model, method, previous, saved, inputs)
