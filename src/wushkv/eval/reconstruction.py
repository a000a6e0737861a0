"""The controlled layer experiment (the paper's layer test, docs/reference/math.md#9-reference-numbers): module-output error when K and V are quantized.

For every attention module and every transform: Y = o_proj(attention(q, k, v)) of the original model
and Ŷ with keys ``T_K⁻¹ Q(T_K k)`` (scores through ``q' = T_K^{-T} q``) and values
``T_V⁻¹ Q(T_V v)``; relative squared error ``‖Ŷ−Y‖²/‖Y‖²`` summed over the evaluation tokens, then the
geometric mean over modules. Every token is quantized (no full-precision windows), except the first
``sink`` positions when asked (the cache keeps them in full precision, and they carry the attention
sinks whose keys and values dwarf the rest). The model itself runs unperturbed: each layer sees the
original inputs.
"""

from __future__ import annotations

import math

import torch

from ..attention import fast_attention
from ..codecs import make_codec
from ..config import QuantConfig
from ..folding import KeyTransform, check_centering
from ..hf import observe_sequences
from ..models import ArchSpec, describe, projections
from ..transforms import LayerTransforms


class ReconObserver:
    """Accumulates ‖Ŷ−Y‖² per (config, transform, layer) and ‖Y‖² per layer, for several configs in one pass."""

    def __init__(self, transforms: dict[str, list[LayerTransforms]], cfgs: list[QuantConfig], spec: ArchSpec, sink: int = 0):
        head_dim, num_layers = spec.head_dim, spec.num_layers
        self.spec = spec
        self.transforms = transforms
        self.sink = sink
        self.codecs = [(make_codec(c, "key", head_dim), make_codec(c, "value", head_dim)) for c in cfgs]
        self.num = [{name: torch.zeros(num_layers, dtype=torch.float64) for name in transforms} for _ in cfgs]
        self.den = torch.zeros(num_layers, dtype=torch.float64)

    @torch.no_grad()
    def observe(self, module, q, k, v, allowed, scaling, softcap=None, sinks=None) -> None:
        l = self.spec.attention_index(module.layer_idx)
        B, Hq, T, d = q.shape
        Hkv = k.shape[1]
        o_proj = projections(module, self.spec).o
        Y = o_proj(fast_attention(q, k, v, allowed, scaling, softcap, sinks).reshape(B, T, Hq * d))
        self.den[l] += float(Y.double().pow(2).sum())
        for name, layers in self.transforms.items():
            tr = layers[l]
            key_tr = KeyTransform(tr.T_K.to(q), tr.T_K_inv.to(q), tr.mu_K.to(q) if tr.mu_K is not None else None)
            mu_V = tr.mu_V.to(q) if tr.mu_V is not None else None
            val_tr = KeyTransform(tr.T_V.to(q), tr.T_V_inv.to(q), mu_V)  # same per-head map (and centering), on values
            kt, vt, qt = key_tr.keys(k), val_tr.keys(v), key_tr.queries(q)
            T_V_inv = val_tr.T_inv
            for (k_codec, v_codec), num in zip(self.codecs, self.num):
                k_hat = k_codec.fake(kt).to(q.dtype) if k_codec else kt
                v_hat = v_codec.fake(vt).to(q.dtype) if v_codec else vt
                if self.sink:
                    k_hat = torch.cat([kt[:, :, : self.sink], k_hat[:, :, self.sink :]], 2)
                    v_hat = torch.cat([vt[:, :, : self.sink], v_hat[:, :, self.sink :]], 2)
                out = fast_attention(qt, k_hat, v_hat, allowed, scaling, softcap, sinks)  # (B, T, Hq, d), T_V space
                out = torch.matmul(out.view(B, T, Hkv, Hq // Hkv, d), T_V_inv.mT[None, None])
                if mu_V is not None:  # attention weights sum to 1: the output shifted by exactly −μ_V
                    out = out + mu_V[:, None, :]
                out = out.reshape(B, T, Hq * d)
                num[name][l] += float((o_proj(out) - Y).double().pow(2).sum())

    def results(self) -> list[dict]:
        res = []
        for nums in self.num:
            out = {}
            for name, num in nums.items():
                per_layer = (num / self.den).tolist()
                geo = math.exp(sum(math.log(max(e, 1e-30)) for e in per_layer) / len(per_layer))
                out[name] = {"geomean": geo, "per_layer": per_layer}
            res.append(out)
        return res


@torch.no_grad()
def layer_reconstruction(model, sequences: torch.Tensor, transforms: dict[str, list[LayerTransforms]], cfg: QuantConfig | list[QuantConfig],
                         show_progress: bool = True, sink: int = 0):
    """Run the experiment over ``sequences`` (N, L); returns {transform: {"geomean", "per_layer"}}
    (a list of those, one per config, when ``cfg`` is a list). ``sink``: first positions kept in full precision."""
    single = not isinstance(cfg, list)
    cfgs = [cfg] if single else cfg
    spec = describe(model)
    for name, layers in transforms.items():  # centering that is not exact on this architecture: refused, as when folding
        for l, tr in enumerate(layers):
            check_centering(spec, tr.tensors(), l, name)
    obs = ReconObserver(transforms, cfgs, spec, sink=sink)
    observe_sequences(model, sequences, obs, "recon", show_progress)
    res = obs.results()
    return res[0] if single else res
