"""Calibration: stream second-order statistics, solve for T_K and T_V, save/load (safetensors + JSON).

Shaped like GPTQ: a :class:`StatsCollector` has ``observe`` (add a batch, called by the registered
attention for every layer) and ``finalize`` (per-layer statistics); :func:`calibrate` runs the model
over calibration text and solves every calibrated transform. Statistics per (layer, KV head), float64,
docs/reference/math.md#3-wush-kv-statistics-placement-folding (keys/queries after q/k norm and RoPE, exactly what attention sees):

* ``M_K = Σ k kᵀ``, ``H_K = 2 Σ_{g∈group} q_g q_gᵀ``, ``M_V = Σ v vᵀ`` (v_proj output incl. bias),
  ``H_V = 2 Σ_g B_gᵀ B_g`` with ``B_g`` the o_proj columns of query head g (weights only);
* OSCAR (docs/reference/math.md#6-the-oscar-transform): ``C_Q`` = mean of ``q qᵀ`` over the group's queries, ``Sigma_V`` = score-weighted
  value covariance with weights ``w = kᵀ C_Q k`` normalized to mean 1. ``C_Q`` is not known before the
  pass, so ``w`` uses the running estimate (all queries seen so far, including the current sequence);
* WUSH-A (docs/reference/math.md#31-wush-a-the-attention-aware-hessian, optional): attention-aware Hessians ``H_K_A`` and ``H_V_A`` (Gauss–Newton
  through the softmax), O(S²) per head;
* WUSH-W (optional, ``attention_weights=(S_sink, S_keep)``): ``M_K_W = Σ_t w_t k_t k_tᵀ`` and
  ``M_V_W = Σ_t w_t v_t v_tᵀ``, each token weighted by the squared attention it receives while the cache
  holds it quantized, ``w_t = Σ_{g, i: t quantized at i} p_{g,i,t}²`` (t ≥ S_sink, i − t ≥ S_keep). A
  per-token quantizer's error grows with the transformed token's norm; the plain Grams weigh every token
  alike, so WUSH spends its precision on the average token, while the softmax's Gauss–Newton weight of a
  key or value error is p² (docs/lab/kl-rises-late.md: under plain WUSH the keys that get the attention carry
  errors as large as a random rotation's). O(S²) per head, like the attention itself.

Activations are never stored beyond one layer of one batch.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import __version__
from .attention import attention_probs, grouped
from .hf import observe_sequences
from .io import CorruptFileError, read_checked_safetensors, write_checked_safetensors, write_json
from .progress import progress
from .models import ArchSpec, attention_modules, describe, fingerprint, model_name, projections, require_materialized
from .transforms.rope import rope_rotate
from .transforms import TRANSFORMS, LayerTransforms, build_transforms

FORMAT = "wushkv-calibration"
FORMAT_VERSION = 2  # 2: the header may hold "selections" (what `wushkv select` chose); version 1 files still load
READABLE_VERSIONS = (1, 2)
CALIBRATED = tuple(n for n, s in TRANSFORMS.items() if s.needs_calibration)


class CalibrationError(ValueError):
    """A calibration file that cannot be used (wrong model, corrupted, incompatible version)."""


class StatsCollector:
    """Streaming float64 statistics per (layer, KV head). See the module docstring."""

    #: query rows per block of the attention-aware statistics (memory O(G²·block·S), not O(G²·T·S))
    block: int = 256

    def __init__(self, spec: ArchSpec, o_proj_weights: list[torch.Tensor], wush_a: bool = False, skip_first: int = 0,
                 rope: list[tuple[torch.Tensor, float]] | None = None, key_means: list[torch.Tensor] | None = None,
                 skip_first_queries: int = 0, attention_weights: tuple[int, int] | None = None):
        self.spec = spec
        # (S_sink, S_keep) of the cache whose quantized tokens M_K_W / M_V_W weigh by their attention, or None
        self.attention_weights = attention_weights
        # with key_means (a pre-RoPE mean μ per layer, needs rope): also M_K_res = Σ (k_t − R_t μ)(k_t − R_t μ)ᵀ,
        # the second moment of the keys a +rmean cache quantizes
        self.key_means = key_means
        self.rope = rope  # per layer (inv_freq, scaling): keys are rotated back to their pre-RoPE mean μ (mu_K_pre)
        self.wush_a = wush_a
        self.skip_first = skip_first  # positions excluded from M_K/M_V (e.g. never-quantized sink tokens)
        # query positions excluded from the key Hessians H_K, H_K^A and C_Q: a query at t < S_sink + S_keep
        # reads no quantized key in the cache, so its products never see the key transform's error
        self.skip_first_queries = skip_first_queries
        self.o_weights = o_proj_weights  # per layer, (hidden, Hq·d), original weights
        self.layers: list[dict[str, torch.Tensor] | None] = [None] * spec.num_layers
        self.tokens = 0

    def _acc(self, layer: int, d: int, device) -> dict[str, torch.Tensor]:
        if self.layers[layer] is None:
            H = self.spec.num_kv_heads
            z = lambda: torch.zeros(H, d, d, dtype=torch.float64, device=device)  # noqa: E731
            self.layers[layer] = {
                "M_K": z(), "QQ": z(), "M_V": z(), "SV": z(),
                "S_K": torch.zeros(H, d, dtype=torch.float64, device=device),
                "S_V": torch.zeros(H, d, dtype=torch.float64, device=device),
                "SW": torch.zeros(H, dtype=torch.float64, device=device),
                "n_k": torch.zeros((), dtype=torch.float64, device=device),
                "n_q": torch.zeros((), dtype=torch.float64, device=device),
                "S_K_pre": torch.zeros(H, d, dtype=torch.float64, device=device),
            } | ({"H_K_A": z(), "H_V_A": z()} if self.wush_a else {}) | (
                {"M_K_W": z(), "M_V_W": z()} if self.attention_weights is not None else {})
        return self.layers[layer]

    @torch.no_grad()
    def observe(self, module, q, k, v, allowed, scaling, softcap=None, sinks=None) -> None:
        """q (B, Hq, T, d), k/v (B, Hkv, S, d): raw queries/keys after norm+RoPE and v_proj outputs; ``sinks``:
        learned sink logits (Hq,) or None (they enter the attention probabilities the WUSH-A statistics weigh by)."""
        layer = self.spec.attention_index(module.layer_idx)
        if not (torch.isfinite(q).all() and torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise CalibrationError(f"layer {layer}: NaN or inf in queries/keys/values during calibration")
        B, Hq, T, d = q.shape
        acc = self._acc(layer, d, q.device)
        Hkv = k.shape[1]
        qg = grouped(q.double(), Hkv)  # (B, Hkv, G, T, d)
        k64, v64 = k.double(), v.double()
        ks, vs = k64[:, :, self.skip_first :], v64[:, :, self.skip_first :]
        gram = lambda x: (x.transpose(-1, -2) @ x).sum(0)  # (B, H, n, d) -> (H, d, d)  # noqa: E731
        acc["M_K"] += gram(ks)
        acc["M_V"] += gram(vs)
        qk = qg[..., self.skip_first_queries :, :]  # queries that enter H_K
        acc["QQ"] += gram(qk.reshape(B, Hkv, -1, d))
        acc["n_q"] += B * qk.shape[2] * qk.shape[3]
        acc["n_k"] += B * ks.shape[2]
        acc["S_K"] += ks.sum(dim=(0, 2))
        acc["S_V"] += vs.sum(dim=(0, 2))
        if self.rope is not None:  # unpadded sequences from position 0: column t is rotary position t
            inv_freq, scale = self.rope[layer]
            pos = torch.arange(self.skip_first, k64.shape[2])
            acc["S_K_pre"] += rope_rotate(ks, pos, inv_freq, scale, inverse=True).sum(dim=(0, 2))  # R_t⁻¹ k_t
            if self.key_means is not None:
                mu = self.key_means[layer].to(k64.device, torch.float64)[None, :, None, :]  # (1, H, 1, d)
                res = ks - rope_rotate(mu, pos, inv_freq, scale)  # k_t − R_t μ
                acc["M_K_res"] = acc.get("M_K_res", 0) + gram(res)
        # OSCAR value weights w = kᵀ C_Q k with the running C_Q (mean q qᵀ of the group)
        C_Q = acc["QQ"] / acc["n_q"]
        w = ((k64 @ C_Q) * k64).sum(-1)  # (B, Hkv, S)
        acc["SV"] += ((v64 * w[..., None]).transpose(-1, -2) @ v64).sum(0)
        acc["SW"] += w.sum(dim=(0, 2))
        if self.wush_a:
            self._observe_attention_aware(acc, layer, qg, k, v, allowed, scaling, softcap, sinks)
        if self.attention_weights is not None:
            self._observe_attention_weights(acc, qg, k64, v64, allowed, scaling, softcap, sinks)
        if layer == 0:
            self.tokens += B * T

    def _observe_attention_aware(self, acc, layer, qg, k, v, allowed, scaling, softcap, sinks=None) -> None:
        """WUSH-A Hessians (docs/reference/math.md#31-wush-a-the-attention-aware-hessian), summed over perturbed positions t, in float32 then float64.

        Values: H_V^A = 2 Σ_{g,g'} (Σ_{i,t} p_{g,i,t} p_{g',i,t}) B_gᵀ B_{g'}.
        Keys:   H_K^A = 2 Σ_i Σ_{g,g'} C_{gg'}(i) q_{g,i} q_{g',i}ᵀ with
                C_{gg'}(i) = s² Σ_t p_{g,i,t} p_{g',i,t} (x_{g,t} − y_{g,i})ᵀ(x_{g',t} − y_{g',i}),
                x_{g,t} = B_g v_t, y_{g,i} = B_g o_{g,i} (o = attention output of head g at i).
        """
        Hkv, G, d = qg.shape[1], qg.shape[2], qg.shape[-1]
        qf = qg.float()
        p = attention_probs(qf, k.float(), allowed, scaling, softcap, sinks)  # (B, Hkv, G, T, S)
        o = torch.matmul(p, v.float().unsqueeze(2))  # (B, Hkv, G, T, d)
        W = self.o_weights[layer].float().to(qf.device).view(-1, Hkv, G, d)  # (hidden, Hkv, G, d): B_g = W[:, h, g]
        for h in range(Hkv):
            Bh = W[:, h]  # (hidden, G, d)
            O = torch.einsum("ngd,nhe->ghde", Bh, Bh)  # B_gᵀ B_g' (G, G, d, d)
            ph = p[:, h]  # (B, G, T, S)
            vh, oh, qh = v[:, h].float(), o[:, h], qf[:, h]  # (B, S, d), (B, G, T, d), (B, G, T, d)
            vOv = torch.einsum("bsd,ghde,bse->bghs", vh, O, vh)  # v_tᵀ O_{gg'} v_t: (B, G, G, S)
            PP = torch.zeros(G, G, dtype=torch.float64, device=qf.device)
            HK = torch.zeros(d, d, dtype=torch.float64, device=qf.device)
            # C_{gg'}(i) = s² Σ_t p p' (x_{g,t} − y_{g,i})ᵀ(x_{g',t} − y_{g',i}) with x = B v, y = B o, every
            # inner product through O_{gg'} = B_gᵀB_{g'} (d × d) instead of the hidden size:
            #   Σ_t pp x_gᵀx_g'  = Σ_t pp · v_tᵀ O v_t
            #   Σ_t pp y_gᵀy_g'  = (Σ_t pp) · o_gᵀ O o_g'
            #   Σ_t pp x_gᵀy_g'  = u_{gg'}ᵀ O o_g',  u_{gg'}(i) = Σ_t pp v_t
            #   Σ_t pp y_gᵀx_g'  = o_gᵀ O_{gg'} u_{gg'} = the previous term with g and g' swapped (pp and u are
            #                      symmetric in g, g' and O_{g'g} = O_{gg'}ᵀ)
            # Query rows in blocks, each over only the key columns its probabilities reach (causal and
            # sliding-window zeros skipped exactly: p is 0 there).
            for i0 in range(0, ph.shape[2], self.block):
                pb = ph[:, :, i0 : i0 + self.block]  # (B, G, tb, S)
                cols = pb.ne(0).flatten(0, 2).any(0).nonzero()
                if cols.numel() == 0:
                    continue
                lo, hi = int(cols[0]), int(cols[-1]) + 1
                pb = pb[..., lo:hi]
                pp = pb.unsqueeze(2) * pb.unsqueeze(1)  # p_{g,i,t} p_{g',i,t}: (B, G, G, tb, sb)
                pp_sum = pp.sum(-1)  # (B, G, G, tb)
                PP += pp_sum.sum(dim=(0, 3)).double()
                u = torch.matmul(pp, vh[:, None, None, lo:hi])  # (B, G, G, tb, d)
                ob = oh[:, :, i0 : i0 + self.block]
                Oo = torch.einsum("ghde,bhte->bghtd", O, ob)  # O_{gg'} o_{g',i}: (B, G, G, tb, d)
                xy = (u * Oo).sum(-1)  # Σ_t pp x_gᵀy_g': (B, G, G, tb)
                C = (
                    torch.matmul(pp, vOv[..., lo:hi, None]).squeeze(-1)
                    + pp_sum * (ob.unsqueeze(2) * Oo).sum(-1)
                    - xy
                    - xy.transpose(1, 2)
                )  # (B, G, G, tb)
                qb = qh[:, :, i0 : i0 + self.block]
                if i0 < self.skip_first_queries:  # query rows left out of the key Hessian
                    C = C * (torch.arange(i0, i0 + C.shape[-1], device=C.device) >= self.skip_first_queries)
                HK += torch.einsum("bght,bgtd,bhte->de", C * scaling**2, qb, qb).double()
            acc["H_V_A"][h] += 2 * torch.einsum("gh,ghde->de", PP, O.double())
            acc["H_K_A"][h] += 2 * HK

    def _observe_attention_weights(self, acc, qg, k, v, allowed, scaling, softcap, sinks=None) -> None:
        """M_K_W += Σ_t w_t k_t k_tᵀ and M_V_W += Σ_t w_t v_t v_tᵀ, w_t = Σ_{g,i} p_{g,i,t}² over the queries i
        that read token t quantized (t ≥ S_sink and i − t ≥ S_keep), query rows in blocks."""
        sink, keep = self.attention_weights
        T, S = qg.shape[3], k.shape[2]
        w = torch.zeros(k.shape[:3], dtype=torch.float64, device=k.device)  # (B, Hkv, S)
        cols = torch.arange(S, device=k.device)[None, :]
        for i0 in range(0, T, self.block):
            qb = qg[:, :, :, i0 : i0 + self.block].float()
            rows = torch.arange(i0, i0 + qb.shape[3], device=k.device)[:, None] + (S - T)  # the queries' positions
            p = attention_probs(qb, k.float(), None if allowed is None else allowed[:, :, i0 : i0 + self.block], scaling, softcap, sinks)
            quantized = (cols >= sink) & (rows - cols >= keep)  # (tb, S)
            w += (p.square() * quantized).sum(dim=(2, 3)).double()
        weighted_gram = lambda x: ((x * w[..., None]).transpose(-1, -2) @ x).sum(0)  # noqa: E731
        acc["M_K_W"] += weighted_gram(k)
        acc["M_V_W"] += weighted_gram(v)

    def finalize(self) -> list[dict[str, torch.Tensor]]:
        """Per-layer statistics (float64, CPU): M_K, H_K, M_V, H_V, C_Q, Sigma_V, mu_K, mu_V, n_K [, mu_K_pre]
        [, H_K_A, H_V_A]. ``mu_K_pre`` (Hkv, d): the keys' mean before RoPE (keys rotated back by their position)."""
        spec, out = self.spec, []
        for layer, acc in enumerate(self.layers):
            if acc is None:
                raise CalibrationError(f"layer {layer} saw no calibration tokens")
            W = self.o_weights[layer].double().view(-1, spec.num_kv_heads, spec.group_size, spec.head_dim)
            H_V = 2 * torch.einsum("nhgd,nhge->hde", W, W)
            st = {
                "M_K": acc["M_K"],
                "H_K": 2 * acc["QQ"],
                "M_V": acc["M_V"],
                "H_V": H_V.to(acc["M_K"].device),
                "C_Q": acc["QQ"] / acc["n_q"],
                "Sigma_V": acc["SV"] / acc["SW"].clamp_min(1e-300)[:, None, None],
                "mu_K": acc["S_K"] / acc["n_k"].clamp_min(1),
                "mu_V": acc["S_V"] / acc["n_k"].clamp_min(1),
                "n_K": acc["n_k"].reshape(1),
            }
            if self.rope is not None:
                st["mu_K_pre"] = acc["S_K_pre"] / acc["n_k"].clamp_min(1)
            if "M_K_res" in acc:
                st["M_K_res"] = acc["M_K_res"]
            if self.wush_a:
                st |= {"H_K_A": acc["H_K_A"], "H_V_A": acc["H_V_A"]}
            if self.attention_weights is not None:
                if not (acc["M_K_W"].diagonal(dim1=-2, dim2=-1).sum(-1) > 0).all():
                    raise CalibrationError(f"layer {layer}: no calibration token was read quantized under the windows "
                                           f"{self.attention_weights} (S_sink, S_keep); use sequences longer than S_sink + S_keep")
                st |= {"M_K_W": acc["M_K_W"], "M_V_W": acc["M_V_W"]}
            for name, t in st.items():
                if not torch.isfinite(t).all():
                    raise CalibrationError(f"layer {layer} statistic {name} contains NaN or inf")
            out.append({k: t.detach().cpu().contiguous() for k, t in st.items()})
        return out


@dataclass
class Calibration:
    """Statistics and solved transforms of one model. ``meta`` is the JSON metadata (what the statistics depend on);
    ``selections`` what ``wushkv select`` chose for ``auto`` per quantizer setting (:mod:`wushkv.eval.select`; JSON
    records, read by :func:`wushkv.methods.auto.resolve_auto`), kept apart from ``meta`` so that choosing never
    changes the calibration's recipe."""

    meta: dict
    stats: list[dict[str, torch.Tensor]]
    solved: dict[str, list[LayerTransforms]] = field(default_factory=dict)
    selections: list[dict] = field(default_factory=list)
    # what is derived from the statistics and kept for reuse, never saved (e.g. the copies covered to longer
    # contexts, :func:`wushkv.methods.install.covered_calibration`)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def set_selection(self, record: dict) -> None:
        """Add ``record`` (a selection with its ``setting``), replacing one made under the same quantizer setting."""
        self.selections = [r for r in self.selections if r.get("setting") != record.get("setting")] + [record]

    @property
    def spec_dict(self) -> dict:
        return self.meta["fingerprint"]

    def solve(self, method: str, damping: float | None = None, damping_M: float | None = None) -> list[LayerTransforms]:
        """Solve (or fetch) a calibrated transform for every layer."""
        damping = self.meta["damping"] if damping is None else damping
        fp = self.spec_dict
        return [
            build_transforms(method, fp["num_kv_heads"], fp["head_dim"], st, damping=damping, damping_M=damping_M)
            for st in self.stats
        ]

    def transforms(self, method: str, seed: int = 0) -> list[LayerTransforms]:
        """Per-layer transforms of any registered transform name."""
        spec = TRANSFORMS.get(method)
        if spec is None:
            raise ValueError(f"unknown transform {method!r}; known: {sorted(TRANSFORMS)}")
        fp = self.spec_dict
        if not spec.needs_calibration:
            return [build_transforms(method, fp["num_kv_heads"], fp["head_dim"], seed=seed) for _ in self.stats]
        if method not in self.solved:
            missing = [k for k in spec.stats_keys if k not in self.stats[0]]
            if missing:
                how = {"wush-a": " with --wush-a", "wush-w": " with --attention-weights SINK,KEEP"}.get(method, "")
                raise CalibrationError(f"transform {method!r} needs statistics {missing}, not in this calibration (recalibrate{how})")
            self.solved[method] = self.solve(method)
        return self.solved[method]

    # -- files -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """One safetensors file (statistics float64, transforms float32) with the JSON metadata in its
        header, written atomically, plus a human-readable ``PATH.json`` copy of the metadata."""
        tensors = {}
        for l, st in enumerate(self.stats):
            for k, t in st.items():
                tensors[f"stats.{l}.{k}"] = t.contiguous()
        for m, layers in self.solved.items():
            for l, tr in enumerate(layers):
                for k, t in tr.tensors().items():
                    tensors[f"transforms.{m}.{l}.{k}"] = t.float().contiguous()
        header = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "meta": json.dumps(self.meta),
                  "selections": json.dumps(self.selections)}
        path = Path(path)
        write_checked_safetensors(path, tensors, header)  # its checksum is verified at load: a damaged file is refused
        write_json(str(path) + ".json", self.meta)
        return path

    @classmethod
    def load(cls, path: str | Path, model=None) -> Calibration:
        """Load and validate; with ``model``, check that the file was made for it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"calibration file {str(path)!r} does not exist; create it with `wushkv calibrate --out {path}`")
        def check_format(header: dict[str, str]) -> None:
            if header.get("format") != FORMAT:
                raise CalibrationError(f"{str(path)!r} is not a wushkv calibration file (format {header.get('format')!r})")
            version = header.get("format_version")
            if version not in {str(v) for v in READABLE_VERSIONS}:
                raise CalibrationError(f"{str(path)!r} has calibration format version {version}; this wushkv {__version__} reads "
                                       f"versions {', '.join(map(str, READABLE_VERSIONS))}" + (
                                           " (a newer wushkv wrote it: upgrade wushkv)" if str(version).isdigit() and int(version) > FORMAT_VERSION else ""))

        try:
            header, tensors = read_checked_safetensors(path, "calibration file", check_format)
            meta = json.loads(header["meta"])
            selections = json.loads(header.get("selections", "[]"))  # version 1 files have none
            if not isinstance(selections, list) or not all(isinstance(r, dict) and isinstance(r.get("setting"), dict) for r in selections):
                raise CalibrationError(f"{str(path)!r} has damaged selections: expected a list of records with a 'setting'")
            n = meta["fingerprint"]["num_layers"]
            if not isinstance(n, int) or n < 1:
                raise CalibrationError(f"{str(path)!r} records num_layers={n!r}, not a positive integer")
        except CalibrationError:
            raise
        except CorruptFileError as e:
            raise CalibrationError(str(e)) from None
        except (KeyError, TypeError, ValueError) as e:  # the metadata JSON damaged
            raise CalibrationError(f"{str(path)!r} has damaged metadata: {type(e).__name__}: {e}") from None
        stats: list[dict] = [{} for _ in range(n)]
        solved: dict[str, list] = {}
        try:
            for key, t in tensors.items():
                parts = key.split(".")
                if parts[0] == "stats":
                    stats[int(parts[1])][parts[2]] = t
                elif parts[0] == "transforms":
                    solved.setdefault(parts[1], [{} for _ in range(n)])[int(parts[2])][parts[3]] = t
        except (IndexError, ValueError, KeyError) as e:
            raise CalibrationError(f"{str(path)!r} has an unexpected tensor {key!r}: {e}") from None
        try:
            solved = {m: [LayerTransforms.from_tensors(tr) for tr in layers] for m, layers in solved.items()}
        except (TypeError, ValueError) as e:
            raise CalibrationError(f"{str(path)!r} holds incomplete stored transforms: {e}") from None
        for l, st in enumerate(stats):
            for k in ("M_K", "H_K", "M_V", "H_V"):
                if k not in st:
                    raise CalibrationError(f"{str(path)!r} lacks statistic {k} of layer {l}")
                if not torch.isfinite(st[k]).all():
                    raise CalibrationError(f"{str(path)!r}: statistic {k} of layer {l} contains NaN or inf")
        cal = cls(meta, stats, solved, selections)
        if model is not None:
            cal.check_model(model)
        return cal

    def check_model(self, model) -> None:
        """Raise :class:`CalibrationError` naming every field where ``model`` differs from the calibrated one."""
        want = self.spec_dict
        have = fingerprint(model)
        diff = [f"{k}: file {want.get(k)!r} vs model {have.get(k)!r}" for k in have if want.get(k) != have.get(k)]
        if diff:
            raise CalibrationError(
                f"calibration made for model {self.meta.get('model')!r} does not match {model_name(model)!r}: " + "; ".join(diff)
            )


# statistics of the key space, after RoPE (a rotation R_s of every key and query moves them to R_s M R_sᵀ / R_s μ);
# the value-side ones and the pre-RoPE mean do not move
KEY_SPACE_MATRICES = ("M_K", "H_K", "C_Q", "M_K_res", "H_K_A", "M_K_W")
KEY_SPACE_VECTORS = ("mu_K",)
def _uniform_shift_means(theta: torch.Tensor, span: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(E cos θs, E sin θs) for s uniform on [0, span], elementwise in ``theta``."""
    x = theta * span
    small = x.abs() < 1e-8
    safe = torch.where(small, torch.ones_like(x), x)
    return torch.where(small, 1 - x**2 / 6, torch.sin(safe) / safe), torch.where(small, x / 2, (1 - torch.cos(safe)) / safe)


def why_not_covered(meta: dict, positions: int) -> str | None:
    """Why a calibration of ``meta`` cannot be covered to ``positions`` as a method's ``+coverN`` asks (None: it can,
    or it already is): its sequences already hold that many positions, or the file was covered to another length
    (covering twice would average twice)."""
    L, have = int(meta["seq_len"]), meta.get("positions")
    if have is not None:
        if int(have) == positions:
            return None
        return (f"+cover{positions}: this calibration's statistics are already covered to {have} positions (`wushkv calibration "
                f"cover`); apply +cover{positions} to the file as calibrated, or drop it")
    if positions <= L:
        return f"+cover{positions}: the calibration's sequences already hold {L} positions; +coverN covers a longer context (N > {L}), or drop it"
    return None


def cover_positions(cal: Calibration, rope: list[tuple[torch.Tensor, float]], serve_len: int) -> Calibration:
    """``cal`` with its key-space statistics averaged over the positions of a ``serve_len`` context (a new Calibration;
    the transforms it stored are dropped and solved again from the new statistics).

    A calibration of ``seq_len`` tokens sees its keys and queries at positions 0..seq_len−1 only. RoPE turns the pair
    of channels of frequency ω by ω·t, and a low-frequency pair turns through a fraction of a turn within seq_len, so
    its second moments hold the directions of those first positions, not those of the later positions a longer context
    serves. Attention depends on relative positions alone, so the calibration text read at an offset s (every key and
    query turned by R_s, RoPE at scale 1) is as likely as at 0: this takes the mean of M ↦ R_s M R_sᵀ (and μ ↦ R_s μ)
    over s uniform on [0, serve_len − seq_len], in closed form (per pair of frequencies the mean of cos/sin of
    (ω_i ± ω_j)·s), so that the statistics cover the positions 0..serve_len − 1 a served context holds. ``rope``: per
    layer (inv_freq (d/2,), scaling) from :func:`wushkv.models.rope_parameters`. A ``serve_len`` no longer than the
    calibration's sequences changes nothing.
    """
    L = int(cal.meta["seq_len"])
    if isinstance(serve_len, bool) or not isinstance(serve_len, int) or serve_len < 1:
        raise ValueError(f"serve_len={serve_len!r}: the context length to cover, a positive number of tokens")
    meta = dict(cal.meta)
    if serve_len <= L:
        return Calibration(meta, [dict(st) for st in cal.stats], {}, list(cal.selections))
    if len(rope) != len(cal.stats):
        raise ValueError(f"rope has {len(rope)} layers, the calibration {len(cal.stats)}")
    span = float(serve_len - L)
    out = []
    for st, (inv_freq, _) in zip(cal.stats, rope):
        w = inv_freq.double()
        cm, sm = _uniform_shift_means(w[:, None] - w[None, :], span)  # (h, h): frequencies ω_i − ω_j
        cp, sp = _uniform_shift_means(w[:, None] + w[None, :], span)  # ω_i + ω_j
        Ecc, Ess = (cm + cp) / 2, (cm - cp) / 2  # E c_i c_j, E s_i s_j
        Ecs, Esc = (sp - sm) / 2, (sp + sm) / 2  # E c_i s_j, E s_i c_j
        Ec, Es = _uniform_shift_means(w, span)
        new = dict(st)
        for k in KEY_SPACE_MATRICES:
            if k in st:
                M = st[k].double()  # (Hkv, d, d) in rotate-half layout: R_s = [[c, −s], [s, c]] per half
                h = M.shape[-1] // 2
                A, B, E, D = M[..., :h, :h], M[..., :h, h:], M[..., h:, :h], M[..., h:, h:]
                new[k] = torch.cat([
                    torch.cat([Ecc * A - Ecs * B - Esc * E + Ess * D, Ecs * A + Ecc * B - Ess * E - Esc * D], -1),
                    torch.cat([Esc * A - Ess * B + Ecc * E - Ecs * D, Ess * A + Esc * B + Ecs * E + Ecc * D], -1)], -2)
        for k in KEY_SPACE_VECTORS:
            if k in st:
                mu = st[k].double()  # (Hkv, d)
                h = mu.shape[-1] // 2
                new[k] = torch.cat([Ec * mu[..., :h] - Es * mu[..., h:], Es * mu[..., :h] + Ec * mu[..., h:]], -1)
        out.append(new)
    meta["positions"] = serve_len  # the statistics cover positions 0..positions-1 (absent: 0..seq_len-1)
    return Calibration(meta, out, {}, list(cal.selections))


def calibration_recipe(meta: dict | None) -> dict | None:
    """What results made with a calibration depend on: its metadata less the date, timing, version and file format
    (two calibrations with the same recipe give the same statistics)."""
    if meta is None:
        return None
    return {k: v for k, v in meta.items() if k not in ("date", "seconds", "wushkv_version", "format_version")}


def c4_documents_read(samples: int, seq_len: int) -> int:
    """How many C4 documents :func:`calibration_sequences` reads for ``samples`` x ``seq_len`` tokens."""
    return max(600, math.ceil(samples * seq_len / 400))  # C4 documents average ~500 tokens


def calibration_documents(meta: dict) -> int | None:
    """The C4 documents a calibration read (0..n−1), None if it read another text."""
    if not str(meta.get("calibration_source", "")).startswith("c4-validation"):
        return None
    n = c4_documents_read(int(meta["samples"]), int(meta["seq_len"]))
    extra = meta.get("mu_K_pre")  # the pre-RoPE mean added later by `wushkv calibration upgrade`
    if isinstance(extra, dict) and extra.get("text_file") is None and "sequences" in extra:
        n = max(n, c4_documents_read(int(extra["sequences"]), int(extra["seq_len"])))
    return n


def calibration_sequences(tokenizer, samples: int, seq_len: int, text_file: str | None = None, documents: int | None = None) -> torch.Tensor:
    """The first ``samples`` non-overlapping ``seq_len``-token sequences of the calibration text (C4 by default)."""
    from .data import calibration_text, tokenize_chunks

    docs = documents or c4_documents_read(samples, seq_len)
    seqs = tokenize_chunks(tokenizer, calibration_text(text_file, documents=docs), seq_len)
    if seqs.shape[0] < samples:
        raise ValueError(f"the calibration text gives {seqs.shape[0]} sequences of {seq_len} tokens, fewer than samples={samples}")
    return seqs[:samples]


@torch.no_grad()
def collect_statistics(model, sequences: torch.Tensor, wush_a: bool = False, skip_first: int = 0, show_progress: bool = True,
                       key_means: list[torch.Tensor] | None = None, skip_first_queries: int = 0,
                       attention_weights: tuple[int, int] | None = None) -> list[dict]:
    """Run ``model`` over ``sequences`` (N, L) and return per-layer statistics (float64). With ``key_means``
    (pre-RoPE key means per layer), also ``M_K_res``, the second moment of the keys minus their rotating mean.
    ``skip_first`` positions are left out of M_K/M_V, ``skip_first_queries`` out of H_K (and H_K^A, C_Q).
    ``attention_weights`` (S_sink, S_keep): also WUSH-W's attention-weighted Grams M_K_W, M_V_W."""
    if attention_weights is not None:
        sink, keep = attention_weights
        if not (isinstance(sink, int) and isinstance(keep, int) and sink >= 0 and keep >= 1):
            raise ValueError(f"attention_weights = {attention_weights!r}: expected (S_sink, S_keep) with S_sink >= 0 and S_keep >= 1")
        if sink + keep >= sequences.shape[1]:
            raise ValueError(f"attention_weights = {attention_weights!r}: sequences of {sequences.shape[1]} tokens never read a token "
                             f"quantized under these windows; use sequences longer than S_sink + S_keep = {sink + keep}")
    for name, n in (("skip_first", skip_first), ("skip_first_queries", skip_first_queries)):
        if not 0 <= n < sequences.shape[1]:
            raise ValueError(f"{name} = {n}: expected an integer in [0, {sequences.shape[1] - 1}] (the sequences have {sequences.shape[1]} tokens)")
    spec = describe(model)
    o_weights = [projections(a, spec).o.weight.detach() for a in attention_modules(model, spec)]
    try:
        from .models import UnsupportedModelError, rope_parameters

        rope = [rope_parameters(model, l, spec) for l in range(spec.num_layers)]
    except UnsupportedModelError:  # no rotary module we can read: no pre-RoPE mean (the +rmean methods need it)
        rope = None
    if key_means is not None and rope is None:
        raise ValueError("key_means needs a rotary embedding wushkv can read (models.rope_parameters)")
    collector = StatsCollector(spec, o_weights, wush_a=wush_a, skip_first=skip_first, rope=rope, key_means=key_means,
                               skip_first_queries=skip_first_queries, attention_weights=attention_weights)
    observe_sequences(model, sequences, collector, "calibrate", show_progress)
    return collector.finalize()


@torch.no_grad()
def pre_rope_key_mean(model, sequences: torch.Tensor, show_progress: bool = True) -> list[torch.Tensor]:
    """Per layer, the mean key *before* RoPE, (Hkv, d) float64: μ such that the keys' mean at position t
    is R_t μ (the transform dict entry ``mu_K_rope``; keys centered on their rotating mean, an ablation)."""
    from .models import pre_rope_keys

    spec = describe(model)
    H, d = spec.num_kv_heads, spec.head_dim
    sums = [torch.zeros(H, d, dtype=torch.float64) for _ in range(spec.num_layers)]
    count = [0]

    def hook_for(i, attn, rows):
        def hook(module, args, out):
            keys = pre_rope_keys(attn, spec, rows.rows_of(out.detach()))
            sums[i].add_(keys.double().reshape(-1, H, d).sum(0).cpu())
        return hook

    hooks = []
    for i, a in enumerate(attention_modules(model, spec)):
        k = projections(a, spec).k  # the key rows (of a fused QKV projection, where fused)
        hooks.append(k.linear.register_forward_hook(hook_for(i, a, k)))
    try:
        dev = next(model.parameters()).device
        for row in progress(range(sequences.shape[0]), desc="pre-RoPE key mean", unit="seq", enabled=show_progress):
            model(sequences[row : row + 1].to(dev))
            count[0] += sequences.shape[1]
    finally:
        for h in hooks:
            h.remove()
    return [s_ / count[0] for s_ in sums]


def calibrate(
    model,
    tokenizer,
    samples: int = 32,
    seq_len: int = 2048,
    text_file: str | None = None,
    damping: float = 0.01,
    wush_a: bool = False,
    skip_first: int = 0,
    methods: tuple[str, ...] | None = None,
    show_progress: bool = True,
    skip_first_queries: int = 0,
    attention_weights: tuple[int, int] | None = None,
) -> Calibration:
    """Collect statistics on calibration text and solve every calibrated transform (``methods``: these only, names
    of calibrated transforms)."""
    import time

    for name, v, low in (("samples", samples, 1), ("seq_len", seq_len, 2), ("skip_first", skip_first, 0),
                         ("skip_first_queries", skip_first_queries, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(f"seq_len={seq_len} is past the model's {limit} positions (max_position_embeddings); calibrate on "
                         f"sequences of at most {limit} tokens")
    if methods is not None:
        if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
            raise ValueError(f"methods must be a sequence of calibrated transform names, e.g. ('wush',), got {methods!r}")
        unknown = [m for m in methods if m not in CALIBRATED]
        if unknown:
            raise ValueError(f"methods {unknown} are not calibrated transforms; known: {list(CALIBRATED)}")
    require_materialized(model, "calibration")
    t0 = time.perf_counter()
    seqs = calibration_sequences(tokenizer, samples, seq_len, text_file)
    stats = collect_statistics(model, seqs, wush_a=wush_a, skip_first=skip_first, show_progress=show_progress,
                               skip_first_queries=skip_first_queries, attention_weights=attention_weights)
    meta = {
        "model": model_name(model),
        "fingerprint": fingerprint(model),
        "calibration_source": text_file or "c4-validation-2k (first documents, joined with blank lines)",
        "tokens": int(seqs.numel()),
        "samples": int(seqs.shape[0]),
        "seq_len": int(seqs.shape[1]),
        "damping": damping,
        "wush_a": wush_a,
        "skip_first": skip_first,
        # eigh's free sign per eigenvector is fixed (transforms.wush.canonical_signs); files without this
        # key solved their stored transforms with whatever sign the machine's LAPACK returned
        "eigenvector_signs": "canonical",
        "wushkv_version": __version__,
        "format_version": FORMAT_VERSION,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if skip_first_queries:  # only when used: a default calibration keeps the recipe earlier versions wrote
        meta["skip_first_queries"] = skip_first_queries
    if attention_weights is not None:
        meta["attention_weights"] = list(attention_weights)
    cal = Calibration(meta, stats)
    for m in methods or CALIBRATED:
        if all(k in stats[0] for k in TRANSFORMS[m].stats_keys):
            cal.transforms(m)
    cal.meta["seconds"] = round(time.perf_counter() - t0, 2)
    return cal
