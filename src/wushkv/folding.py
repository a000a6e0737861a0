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
from .models import ArchSpec, attention_modules, describe, projections, rope_parameters, rope_rotate

KEY_TRANSFORM_NAME = "wushkv_key"


class KeyTransform(nn.Module):
    """Online key transform of one attention layer: buffers ``T`` and ``T_inv`` (Hkv, d, d).

    With ``mu`` (Hkv, d), keys are centered first: k' = T (k − μ). Every key of the layer (sink,
    middle, recent) is shifted by the same μ, so each query's scores all move by the same −qᵀμ and
    the softmax is unchanged: exact, and free but for one subtraction (``shift`` = T μ is precomputed).
    Invalid under a logit softcap (tanh is not shift-invariant); :func:`apply_transforms` refuses it.

    With ``mu_rope`` (Hkv, d) and ``rope`` = (inv_freq (d/2,), scaling): the keys' pre-RoPE mean, which
    RoPE turns into a different vector c_t = R_t μ at every position t. The cache quantizes the middle's
    keys as T (k_t − c_t) and adds T c_t back when it reads them (:meth:`center`): exact (the same c_t
    both ways, a function of the position alone), and the quantizer no longer spends its range on the
    mean, which holds most of a key's energy in the models we measured.

    ``feedback_K``/``feedback_V`` (Hkv, d, d), optional: the error-feedback matrices with which the cache
    rounds this layer's transformed keys / values (methods ``<transform>+ldlq``; :mod:`wushkv.quantizers.feedback`).
    """

    def __init__(self, T: torch.Tensor, T_inv: torch.Tensor, mu: torch.Tensor | None = None,
                 feedback_K: torch.Tensor | None = None, feedback_V: torch.Tensor | None = None,
                 mu_rope: torch.Tensor | None = None, rope: tuple[torch.Tensor, float] | None = None):
        super().__init__()
        if mu_rope is not None:
            if rope is None:
                raise ValueError("mu_rope needs rope = (inv_freq, scaling), the rotary embedding of this layer")
            if tuple(mu_rope.shape) != (T.shape[0], T.shape[-1]) or tuple(rope[0].shape) != (T.shape[-1] // 2,):
                raise ValueError(f"mu_rope must be (KV heads, head_dim) = {(T.shape[0], T.shape[-1])} and inv_freq "
                                 f"({T.shape[-1] // 2},), got {tuple(mu_rope.shape)} and {tuple(rope[0].shape)}")
            if mu is not None:
                raise ValueError("mu (a constant key shift) and mu_rope (the rotating mean) are exclusive")
        self.register_buffer("mu_rope", None if mu_rope is None else mu_rope.detach().to(T.dtype).clone(), persistent=False)
        self.register_buffer("inv_freq", None if mu_rope is None else rope[0].detach().float().to(T.device).clone(), persistent=False)
        self.rope_scaling = None if mu_rope is None else float(rope[1])
        for name, F in (("feedback_K", feedback_K), ("feedback_V", feedback_V)):
            if F is not None and tuple(F.shape) != tuple(T.shape):
                raise ValueError(f"{name} must have shape {tuple(T.shape)} (KV heads, head_dim, head_dim), got {tuple(F.shape)}")
            self.register_buffer(name, None if F is None else F.detach().to(T.dtype).clone(), persistent=False)
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
        out = torch.matmul(k, self._as("T_t", k))
        return out if self.shift is None else out - self._as("shift", k)

    @property
    def centered_on_rope_mean(self) -> bool:
        return self.mu_rope is not None

    def center(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """T c_t with c_t = R_t μ (RoPE of the pre-RoPE key mean at position t), in the transformed space.

        positions: (B', N) integer (B' = 1 or the batch). Returns (B', Hkv, N, d) in ``dtype``.

        Exactness needs the same value for a position whichever block of positions it is computed in:
        float64 throughout, then rounded to float32, so the last bits a matmul's blocking may change are
        rounded away (a float64 difference of 1e-16 crosses a float32 rounding boundary only by chance
        of order 1e-9 per value)."""
        pos = positions.to(self.inv_freq.device)[:, None, :]  # (B', 1, N)
        c = rope_rotate(self.mu_rope.double()[None, :, None, :], pos, self.inv_freq, self.rope_scaling)  # (B', Hkv, N, d)
        return torch.matmul(c, self.T_t.double()).float().to(dtype)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, Hq, T, d) -> T^{-T} q for every query head of the group (rows: q @ T⁻¹): one batched matmul."""
        B, Hq, T, d = q.shape
        H = self.T.shape[0]
        qg = q.reshape(B, H, (Hq // H) * T, d)
        return torch.matmul(qg, self._as("T_inv", q)).view(B, Hq, T, d)

    def extra_repr(self) -> str:
        fb = self.feedback_K is not None or self.feedback_V is not None
        return (f"heads={self.T.shape[0]}, head_dim={self.T.shape[-1]}, centered={self.shift is not None}, "
                f"rope_mean={self.mu_rope is not None}, feedback={fb}")


@dataclass
class Installed:
    """Handle to transforms installed in a model; ``restore()`` undoes everything."""

    model: nn.Module
    method: str
    previous_attention: str
    saved: list[dict[str, torch.Tensor]] = field(repr=False)
    active: bool = True

    def restore(self) -> None:
        if not self.active:
            return
        spec = describe(self.model)
        with torch.no_grad():
            for attn, orig in zip(attention_modules(self.model, spec), self.saved):
                _, _, v, o = projections(attn, spec)
                v.weight.copy_(orig["v.weight"])
                o.weight.copy_(orig["o.weight"])
                for lin, key in ((v, "v.bias"), (o, "o.bias")):
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


def _check(name: str, t: torch.Tensor, spec: ArchSpec, layer: int) -> None:
    want = (spec.num_kv_heads, spec.head_dim, spec.head_dim)
    if tuple(t.shape) != want:
        raise ValueError(f"layer {layer} {name} has shape {tuple(t.shape)}, expected {want} (KV heads, head_dim, head_dim)")
    if not torch.isfinite(t).all():
        raise ValueError(f"layer {layer} {name} contains NaN or inf")


@torch.no_grad()
def apply_transforms(model: nn.Module, transforms: list[dict[str, torch.Tensor]], method: str = "custom") -> Installed:
    """Fold ``T_V`` into the weights and install ``T_K`` online, for every layer.

    ``transforms[l]`` holds ``T_K``, ``T_K_inv``, ``T_V``, ``T_V_inv`` (Hkv, d, d) for layer ``l``
    (see :meth:`wushkv.calibration.Calibration.transforms`), optionally ``F_K``/``F_V`` (Hkv, d, d), the
    error-feedback matrices the cache rounds with. Folding runs in float64.
    """
    spec = describe(model)
    mods = attention_modules(model, spec)
    if len(transforms) != len(mods):
        raise ValueError(f"got transforms for {len(transforms)} layers, the model has {len(mods)}")
    if any(hasattr(a, KEY_TRANSFORM_NAME) for a in mods):
        raise RuntimeError("transforms are already installed in this model; call restore() on the previous handle first")
    d, G = spec.head_dim, spec.group_size
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
        if "mu_K" in tr:
            cap = getattr(attn, "attn_logit_softcapping", None) or getattr(getattr(attn, "config", None), "attn_logit_softcapping", None)
            if cap:
                raise ValueError(f"layer {i}: centered keys (mu_K) change attention under a logit softcap ({cap}); use an uncentered transform")
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
    saved = []
    for li, (attn, tr) in enumerate(zip(mods, transforms)):
        _, _, v, o = projections(attn, spec)
        saved.append({"v.weight": v.weight.detach().clone(), "o.weight": o.weight.detach().clone()}
                     | ({"v.bias": v.bias.detach().clone()} if v.bias is not None else {})
                     | ({"o.bias": o.bias.detach().clone()} if o.bias is not None else {}))
        T_V, T_V_inv = tr["T_V"].double(), tr["T_V_inv"].double()
        if "mu_V" in tr:
            # v' = T_V (v − μ_V): the softmax weights sum to 1, so attention outputs shift by exactly −μ_V,
            # given back through the o_proj bias (W_o μ per query head). Biases are added where missing.
            mu_V = tr["mu_V"].double().to(v.weight.device)  # (Hkv, d)
            for lin, n in ((v, v.out_features), (o, o.out_features)):
                if lin.bias is None:
                    lin.bias = nn.Parameter(torch.zeros(n, dtype=lin.weight.dtype, device=lin.weight.device), requires_grad=False)
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
        mu = tr["mu_K"].float().to(dev) if "mu_K" in tr else None
        fb = {f"feedback_{s}": tr[f"F_{s}"].float().to(dev) for s in "KV" if f"F_{s}" in tr}
        rc = {}
        if "mu_K_rope" in tr:
            rc = {"mu_rope": tr["mu_K_rope"].float().to(dev), "rope": ropes[li]}
        attn.add_module(KEY_TRANSFORM_NAME, KeyTransform(tr["T_K"].float().to(dev), tr["T_K_inv"].float().to(dev), mu, **fb, **rc))
    previous = use_wushkv_attention(model)
    return Installed(model, method, previous, saved)
