"""Simulated key-quantization loss of each transform on synthetic anisotropic keys.

Keys X [d, n] (column convention) have log-normal channel scales, per-channel means, a few
outlier channels of large magnitude and low-rank channel correlation. A GQA group of query heads
has its own anisotropy, partially aligned with the keys' (scale_q = scale_k^β · log-normal).
Statistics come from a calibration sample:

    M = X_cal X_calᵀ,   H = 2 Σ_g Q_g Q_gᵀ / n        (Hessian of the scores w.r.t. keys)

and the loss is measured on a fresh held-out sample (new keys and new queries):

    ℓ = ½ tr(Eᵀ H_test E) / n_test,   E = T⁻¹ Q(T X_test) − X_test,

with the QuEST quantizer per token (one group = the whole head_dim). The table prints ℓ relative
to the identity transform. OSCAR here uses a simple stand-in for its statistics: C_Q = H/2
(mean query outer product of the group) and Sigma_V = M/n (unweighted); only its key rotation
is exercised.

    python experiments/transform_sim.py [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch import Tensor

from wushkv.quantizers import QuestQuantizer
from wushkv.transforms import build_transforms

TRANSFORM_NAMES = ("identity", "hadamard", "random", "oscar", "wush")
f64 = torch.float64


def _channel_model(d: int, gen: torch.Generator, log_scale: Tensor, rank: int, rho: float) -> dict[str, Tensor]:
    """One anisotropic, correlated Gaussian source: x = s ⊙ (√(1−ρ)·z + √ρ·W u) + μ."""
    s = torch.exp(log_scale)
    W = torch.randn(d, rank, generator=gen, dtype=f64) / math.sqrt(rank)
    mu = 0.5 * s * torch.randn(d, generator=gen, dtype=f64)
    return {"s": s, "W": W, "mu": mu, "rho": torch.tensor(rho, dtype=f64)}


def _sample(model: dict[str, Tensor], n: int, gen: torch.Generator) -> Tensor:
    """n samples as columns, [d, n] float64."""
    d, rank = model["W"].shape
    rho = float(model["rho"])
    z = torch.randn(d, n, generator=gen, dtype=f64)
    u = torch.randn(rank, n, generator=gen, dtype=f64)
    core = math.sqrt(1 - rho) * z + math.sqrt(rho) * (model["W"] @ u)
    return model["s"][:, None] * core + model["mu"][:, None]


def make_problem(d: int, n_query_heads: int, seed: int) -> dict:
    """Key source with outlier channels plus a GQA group of query sources."""
    gen = torch.Generator().manual_seed(seed)
    log_s_k = 0.6 * torch.randn(d, generator=gen, dtype=f64)
    n_out = 1 if d <= 64 else 2
    outliers = torch.randperm(d, generator=gen)[:n_out]
    key = _channel_model(d, gen, log_s_k, rank=4, rho=0.3)
    key["s"][outliers] *= 10.0  # outlier channels: large spread ...
    signs = torch.tensor([1.0, -1.0], dtype=f64)[:n_out]
    key["mu"][outliers] = 0.8 * key["s"][outliers] * signs  # ... and a large mean
    queries = []
    for _ in range(n_query_heads):
        # Partially aligned: half the key log-scale, plus the head's own log-normal anisotropy.
        log_s_q = 0.5 * log_s_k + 0.6 * torch.randn(d, generator=gen, dtype=f64)
        queries.append(_channel_model(d, gen, log_s_q, rank=4, rho=0.3))
    return {"key": key, "queries": queries, "outliers": outliers}


def sample_stats(problem: dict, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(X [d, n], M = X Xᵀ, H = 2 Σ_g Q_g Q_gᵀ / n), float64."""
    X = _sample(problem["key"], n, gen)
    H = sum(2.0 * (Q @ Q.mT) / n for Q in (_sample(q, n, gen) for q in problem["queries"]))
    return X, X @ X.mT, H


def key_loss(X: Tensor, H: Tensor, T: Tensor, T_inv: Tensor, quantizer: QuestQuantizer) -> float:
    """½ tr(Eᵀ H E)/n with E = T⁻¹ Q(T X) − X; X [d, n], T/T_inv [d, d] float32."""
    x = X.mT.to(torch.float32)  # rows: tokens [n, d]
    x_hat = quantizer.fake(x @ T.mT) @ T_inv.mT
    E = (x_hat.to(f64) - X.mT).mT  # [d, n]
    return 0.5 * float(torch.einsum("in,ij,jn->", E, H, E)) / X.shape[1]


def run(seed: int, dims: tuple[int, ...], bit_widths: tuple[int, ...], n_cal: int, n_test: int,
        n_query_heads: int) -> dict:
    results: dict = {"seed": seed, "n_cal": n_cal, "n_test": n_test, "n_query_heads": n_query_heads, "rows": {}}
    for d in dims:
        problem = make_problem(d, n_query_heads, seed + d)
        gen = torch.Generator().manual_seed(seed + 1000 + d)
        _, M, H = sample_stats(problem, n_cal, gen)  # calibration
        X_test, _, H_test = sample_stats(problem, n_test, gen)  # held out
        stats = {
            "M_K": M[None], "H_K": H[None], "M_V": M[None], "H_V": H[None],
            "C_Q": (H / 2)[None], "Sigma_V": (M / n_cal)[None],
        }
        # Theory (docs/reference/math.md#2-the-wush-transform-closed-form): WUSH / any rotation ≈ (Σ λᵢ^{1/2})² / (tr M · tr H), λ = eig(Lᵀ M L).
        L = torch.linalg.cholesky(H)
        lam = torch.linalg.eigvalsh(L.mT @ M @ L).clamp_min(0)
        results.setdefault("bound_ratio", {})[f"d{d}"] = float(lam.sqrt().sum() ** 2 / (M.trace() * H.trace()))
        for name in TRANSFORM_NAMES:
            tf = build_transforms(name, 1, d, stats, seed=seed)
            for b in bit_widths:
                loss = key_loss(X_test, H_test, tf.T_K[0], tf.T_K_inv[0], QuestQuantizer(b))
                results["rows"].setdefault(name, {})[f"d{d}_b{b}"] = loss
    for name, row in results["rows"].items():
        results.setdefault("relative", {})[name] = {
            k: v / results["rows"]["identity"][k] for k, v in row.items()
        }
    return results


def format_table(results: dict, dims: tuple[int, ...], bit_widths: tuple[int, ...]) -> str:
    cols = [f"d{d}_b{b}" for d in dims for b in bit_widths]
    head = "| transform | " + " | ".join(f"d={d} {b}-bit" for d in dims for b in bit_widths) + " |"
    sep = "|---|" + "---|" * len(cols)
    lines = [head, sep]
    for name in TRANSFORM_NAMES:
        rel = results["relative"][name]
        best = all(rel[c] <= min(results["relative"][m][c] for m in TRANSFORM_NAMES) for c in cols)
        label = f"**{name}**" if best else name
        lines.append(f"| {label} | " + " | ".join(f"{rel[c]:.3f}" for c in cols) + " |")
    ident = results["rows"]["identity"]
    lines.append("| identity loss (abs.) | " + " | ".join(f"{ident[c]:.3g}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--n-cal", type=int, default=8192, help="calibration tokens")
    p.add_argument("--n-test", type=int, default=8192, help="held-out tokens")
    p.add_argument("--query-heads", type=int, default=4, help="query heads per KV head (GQA group)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    dims, bits = tuple(args.dims), tuple(args.bits)
    results = run(args.seed, dims, bits, args.n_cal, args.n_test, args.query_heads)
    print(f"key loss relative to identity (seed {args.seed}, {args.query_heads} query heads, "
          f"{args.n_cal} calibration / {args.n_test} held-out tokens, QuEST per token)")
    print(format_table(results, dims, bits))
    print("predicted WUSH/rotation ratio (Σλ^½)²/(tr M·tr H): "
          + ", ".join(f"d={d}: {results['bound_ratio'][f'd{d}']:.3f}" for d in dims))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
