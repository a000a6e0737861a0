"""QuEST INT quantizer: symmetric, RMS-scaled, midrise (docs/reference/math.md#4-the-quest-int-quantizer).

Per group x ∈ R^G: r = ‖x‖₂/√G, Δ = max(2·α_b·r/(2^b − 1), tiny), q = clamp(⌊x/Δ⌋, −2^{b−1},
2^{b−1} − 1), x̂ = (q + ½)·Δ. There is no zero level; the outermost levels are ±α_b·r, so larger
|x| saturate. α_b is the MSE-optimal clip for a Gaussian, in RMS units.

From :data:`UNCLIPPED_FROM` bits on, the grid is not clipped: Δ = 2·m·max|x|/(2^b − 1) (m = ``alpha_scale``), so
the outermost levels are the group's own ±max|x|. There the rounding error is so small that clipping a
heavy-tailed group costs more than it saves (docs/lab/clip-by-width.md measures where: an 8-bit cache clipped at
α_8·r = 3.88 RMS was off by 2e-2 in logits on outlier channels). ``clip=True``/``False`` overrides the rule.

With ``search = n > 0`` each group picks its own clip: Δ·m for the m of ``search_multipliers(n)``
(1 first, then n values in [0.5, 1.5]) with the smallest ‖x − x̂‖² of that group, ties to the earliest.
Same storage (one Δ per group) and the same decoder; a group never gets a larger error than with m = 1.
Real groups are not Gaussian (a whole token is one group of 64–256 values, and its tails vary), so the
per-group optimum moves: at 4 bits on heavy-tailed rows it halves the error.

Stored in the unified affine form: code c = q + 2^{b−1} ∈ [0, 2^b − 1], scale = Δ,
offset = (½ − 2^{b−1})·Δ, so x̂ = scale·c + offset.

Arithmetic is float32 (this runs on the cache's hot path; codes have ≤ 8 bits, so float32 is
exact enough). Inputs must be finite: NaN/inf are not checked here (it would force a device sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import QTensor, check_bits, check_group_size
from .base import dequantize as _dequantize

__all__ = ["QUEST_ALPHA", "QUEST_MSE", "QuestQuantizer", "UNCLIPPED_FROM", "search_multipliers"]

# Widths from which the default grid spans each group's max |x| instead of clipping (QuEST and the affine
# quantizer's percentile clip): measured on SmolLM2-135M's keys and values, docs/lab/clip-by-width.md.
UNCLIPPED_FROM = 5

# α_b: MSE-optimal Gaussian clipping level in RMS units, b = 1..8.
QUEST_ALPHA: dict[int, float] = {
    1: 0.7978845587,
    2: 1.4935346200,
    3: 2.0510683541,
    4: 2.5139305786,
    5: 2.9160938835,
    6: 3.2765972826,
    7: 3.6010497188,
    8: 3.8849386788,
}

# Per-unit-variance MSE of a Gaussian at the optimum (docs/reference/math.md#4-the-quest-int-quantizer), b = 1..4.
QUEST_MSE: dict[int, float] = {1: 0.3634, 2: 0.1188, 3: 0.0374, 4: 0.0115}


def search_multipliers(n: int, lo: float = 0.5, hi: float = 1.5) -> list[float]:
    """Candidate clip multipliers of a per-group search: 1.0 first (ties keep the plain rule), then n
    evenly spaced values in [lo, hi]: n + 1 candidates (a repeat of 1.0 is harmless, ties go to the first)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"search must be an integer >= 0 (candidate clips per group; 0 = off), got {n!r}")
    if n == 0:
        return [1.0]
    grid = [lo + (hi - lo) * i / (n - 1) for i in range(n)] if n > 1 else [lo]
    return [1.0] + grid


def _groups(x: Tensor, group_size: int | None) -> tuple[Tensor, int]:
    """x [..., n] → float32 view [..., n/G, G] and G; ValueError if G does not divide n."""
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim < 1:
        raise ValueError(f"x must be a floating tensor [..., n], got {type(x).__name__} {getattr(x, 'shape', '')}")
    n = x.shape[-1]
    G = n if group_size is None else group_size
    if n == 0 or n % G:
        raise ValueError(f"group_size {group_size} must divide the last dim, got last dim {n}")
    return x.to(torch.float32).reshape(*x.shape[:-1], n // G, G), G


@dataclass(frozen=True)
class QuestQuantizer:
    """QuEST symmetric RMS-scaled INT quantizer.

    Args:
        bits: 1..8.
        group_size: elements per group along the last dim; None = the whole last dim
            (per token: G = head_dim).
        alpha_scale: multiplier on α_b (1.0: the Gaussian MSE optimum; < 1 clips harder).
        search: 0 = the fixed clip α_b·alpha_scale; n > 0 = each group picks the MSE-best of
            ``search_multipliers(n)`` times that clip (same storage; quantizing costs n + 1 passes).
        clip: None = clip below :data:`UNCLIPPED_FROM` bits only; True = clip at α_b·RMS at every width; False =
            never (levels up to ``alpha_scale``·max|x| of each group).
    """

    bits: int
    group_size: int | None = None
    alpha_scale: float = 1.0
    search: int = 0
    clip: bool | None = None

    def __post_init__(self) -> None:
        check_bits(self.bits)
        check_group_size(self.group_size)
        a = self.alpha_scale
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (0.0 < a < float("inf")):
            raise ValueError(f"QuEST alpha_scale must be a finite float > 0 (1.0 = the Gaussian optimum α_b), got {a!r}")
        search_multipliers(self.search)
        if self.clip is not None and not isinstance(self.clip, bool):
            raise ValueError(f"QuEST clip must be None (by width), True or False, got {self.clip!r}")

    @property
    def clipped(self) -> bool:
        """Whether the grid clips at α_b·RMS (else it spans each group's max |x|)."""
        return self.bits < UNCLIPPED_FROM if self.clip is None else self.clip

    @property
    def alpha(self) -> float:
        """Clip level in RMS units: α_b (MSE-optimal for a Gaussian) times ``alpha_scale`` (for a clipped grid)."""
        return QUEST_ALPHA[self.bits] * self.alpha_scale

    def _step(self, xg: Tensor, G: int) -> Tensor:
        if self.clipped:
            r = torch.linalg.vector_norm(xg, dim=-1) / math.sqrt(G)  # [..., g] RMS
            delta = (2.0 * self.alpha / (2**self.bits - 1)) * r
        else:  # outermost levels (2^{b-1} − ½)·Δ = alpha_scale·max|x|
            delta = (2.0 * self.alpha_scale / (2**self.bits - 1)) * xg.abs().amax(-1)
        tiny = torch.finfo(torch.float32).tiny
        if not self.search:
            return delta.clamp_min(tiny)
        half = 2 ** (self.bits - 1)
        best_err = best = None
        for m in search_multipliers(self.search):
            d = (delta * m).clamp_min(tiny)
            q = torch.floor(xg / d[..., None]).clamp_(-half, half - 1)
            err = ((q + 0.5) * d[..., None] - xg).square_().sum(-1)
            if best is None:
                best_err, best = err, d
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best = torch.where(better, d, best)
        return best

    def grid(self, x: Tensor) -> tuple[Tensor, Tensor, int]:
        """The per-group grid alone, levels scale·c + offset: (scale, offset) float32 [..., n/G] and G."""
        xg, G = _groups(x, self.group_size)
        delta = self._step(xg, G)
        return delta, (0.5 - 2 ** (self.bits - 1)) * delta, G

    def quantize(self, x: Tensor) -> QTensor:
        """x [..., n] floating → QTensor with codes uint8 [..., n], scale/offset float32 [..., n/G]."""
        xg, G = _groups(x, self.group_size)  # [..., g, G]
        b = self.bits
        half = 2 ** (b - 1)
        delta = self._step(xg, G)
        q = torch.floor(xg / delta[..., None]).clamp_(-half, half - 1)
        codes = (q + half).to(torch.uint8).reshape(x.shape)
        offset = (0.5 - half) * delta
        return QTensor(codes=codes, scale=delta, offset=offset, bits=b, group_size=G)

    def dequantize(self, q: QTensor) -> Tensor:
        """x̂ = scale·code + offset = (q + ½)·Δ. Returns float32 [..., n]."""
        return _dequantize(q)

    def fake(self, x: Tensor) -> Tensor:
        """Quantize-dequantize; bit-identical to ``dequantize(quantize(x))``. float32 [..., n]."""
        return _dequantize(self.quantize(x))
