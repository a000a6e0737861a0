"""WUSH closed form (docs/reference/math.md#2-the-wush-transform-closed-form): inverse, constant-diagonal invariants, geometric mean, the
trace bound it attains, damping, errors, batching and the ‖TX‖_F normalization."""

import pytest
import torch

from wushkv.transforms import hadamard_matrix, random_orthogonal_transform, wush_transform

f64 = torch.float64


def _anisotropic(d, n, gen, spread=1.0):
    """Correlated, anisotropic samples X [d, n] (float64)."""
    scale = torch.exp(spread * torch.randn(d, generator=gen, dtype=f64))
    mix = torch.eye(d, dtype=f64) + 0.3 * torch.randn(d, d, generator=gen, dtype=f64) / d**0.5
    return (scale[:, None] * mix) @ torch.randn(d, n, generator=gen, dtype=f64)


def _stats(d=32, n=400, seed=0, batch=()):
    gen = torch.Generator().manual_seed(seed)
    Xs, Ms, Hs = [], [], []
    for _ in range(int(torch.tensor(batch).prod()) if batch else 1):
        X = _anisotropic(d, n, gen)
        Q = _anisotropic(d, n, gen)
        Xs.append(X)
        Ms.append(X @ X.mT)
        Hs.append(2 * Q @ Q.mT / n)
    stack = lambda L: torch.stack(L).reshape(*batch, *L[0].shape)  # noqa: E731
    return stack(Xs), stack(Ms), stack(Hs)


def _diag(A):
    return torch.diagonal(A, dim1=-2, dim2=-1)


def _tr(A):
    return _diag(A).sum(-1)


def test_inverse_float32_and_float64():
    _, M, H = _stats()
    T, T_inv = wush_transform(M, H)
    assert T.dtype == T_inv.dtype == torch.float32 and T.shape == (32, 32)
    I = torch.eye(32)
    assert (T @ T_inv - I).abs().max() < 1e-4
    assert (T_inv @ T - I).abs().max() < 1e-4
    T64, Ti64 = wush_transform(M, H, dtype=f64)
    assert (T64 @ Ti64 - torch.eye(32, dtype=f64)).abs().max() < 1e-10
    torch.testing.assert_close(T64.float(), T)


def test_undamped_invariants():
    _, M, H = _stats(d=32)
    T, T_inv = wush_transform(M, H, damping=0.0, dtype=f64)
    A = T @ M @ T.mT  # c²·𝓗Λ^{1/2}𝓗ᵀ
    B = T_inv.mT @ H @ T_inv  # T^{-T} H T^{-1} = c^{-2}·𝓗Λ^{1/2}𝓗ᵀ
    dA, dB = _diag(A), _diag(B)
    torch.testing.assert_close(dA, dA.mean().expand(32), rtol=1e-9, atol=0)
    torch.testing.assert_close(dB, dB.mean().expand(32), rtol=1e-9, atol=0)
    ratio = A[0, 0] / B[0, 0]
    torch.testing.assert_close(A, ratio * B, rtol=1e-8, atol=1e-8 * A.abs().max().item())
    # TᵀT is proportional to the geometric mean M⁻¹ # H: (TᵀT) M (TᵀT) ∝ H.
    G = T.mT @ T
    GMG = G @ M @ G
    torch.testing.assert_close(GMG, (GMG[0, 0] / H[0, 0]) * H, rtol=1e-8, atol=1e-8 * GMG.abs().max().item())


def test_attains_trace_bound_and_orthogonal_do_not():
    _, M, H = _stats(d=32, seed=1)
    T, T_inv = wush_transform(M, H, damping=0.0, dtype=f64)
    L = torch.linalg.cholesky(H)
    lam = torch.linalg.eigvalsh(L.mT @ M @ L)
    lam_MH = torch.linalg.eigvals(M @ H).real  # same spectrum
    torch.testing.assert_close(lam_MH.sort().values, lam, rtol=1e-7, atol=0)
    bound = lam.sqrt().sum() ** 2
    got = _tr(T @ M @ T.mT) * _tr(T_inv.mT @ H @ T_inv)
    torch.testing.assert_close(got, bound, rtol=1e-9, atol=0)
    # Every orthogonal T gives tr(M)·tr(H), above the bound for anisotropic M, H.
    R, _ = random_orthogonal_transform(3, 32, seed=0)
    for Q in [torch.eye(32, dtype=f64), hadamard_matrix(32), *R.double()]:
        Q, _ = torch.linalg.qr(Q)  # re-orthogonalize the float32 rotations
        val = _tr(Q @ M @ Q.mT) * _tr(Q @ H @ Q.mT)
        torch.testing.assert_close(val, _tr(M) * _tr(H), rtol=1e-9, atol=0)
        assert val > 1.5 * bound
    # ... and so does any other invertible T.
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        S = torch.randn(32, 32, generator=gen, dtype=f64) + 3 * torch.eye(32, dtype=f64)
        S_inv = torch.linalg.inv(S)
        assert _tr(S @ M @ S.mT) * _tr(S_inv.mT @ H @ S_inv) >= bound * (1 - 1e-12)


def test_frobenius_normalization():
    X, M, H = _stats(d=32, seed=2)
    T, _ = wush_transform(M, H, damping=0.0, dtype=f64)
    torch.testing.assert_close(torch.linalg.norm(T @ X), torch.linalg.norm(X), rtol=1e-10, atol=0)
    # Damped: tr(T M̃ Tᵀ) = tr(M̃) exactly, and ‖TX‖_F stays close to ‖X‖_F.
    gamma = 0.01
    T, _ = wush_transform(M, H, damping=gamma, dtype=f64)
    M_t = M + gamma * _tr(M) / 32 * torch.eye(32, dtype=f64)
    torch.testing.assert_close(_tr(T @ M_t @ T.mT), _tr(M_t), rtol=1e-10, atol=0)
    assert abs(torch.linalg.norm(T @ X) / torch.linalg.norm(X) - 1) < 0.02


def test_damping_M_separate():
    _, M, H = _stats(d=16, seed=3)
    T_a, _ = wush_transform(M, H, 0.01, dtype=f64)
    T_b, _ = wush_transform(M, H, 0.01, damping_M=0.01, dtype=f64)
    T_c, _ = wush_transform(M, H, 0.01, damping_M=0.0, dtype=f64)
    assert torch.equal(T_a, T_b)
    assert not torch.allclose(T_a, T_c)
    # T M̃ Tᵀ has a constant diagonal for any H damping: with damping_M = 0 that is M itself …
    A = T_c @ M @ T_c.mT
    assert _diag(A).std() / _diag(A).mean() < 1e-9
    # … while with damping_M > 0 only the damped M̃ is equalized, not M.
    A = T_a @ M @ T_a.mT
    assert _diag(A).std() / _diag(A).mean() > 1e-6
    M_t = M + 0.01 * _tr(M) / 16 * torch.eye(16, dtype=f64)
    A = T_a @ M_t @ T_a.mT
    assert _diag(A).std() / _diag(A).mean() < 1e-9


def test_rank_deficient_with_default_damping():
    gen = torch.Generator().manual_seed(4)
    d = 32
    X = torch.randn(d, 8, generator=gen, dtype=f64)  # 8 tokens < d: M has rank 8
    Q = torch.randn(d, 5, generator=gen, dtype=f64)  # H has rank 5
    M, H = X @ X.mT, Q @ Q.mT
    T, T_inv = wush_transform(M, H)
    assert bool(torch.isfinite(T).all() and torch.isfinite(T_inv).all())
    assert (T @ T_inv - torch.eye(d)).abs().max() < 1e-4
    with pytest.raises(ValueError, match="larger damping"):
        wush_transform(M, H, damping=0.0)  # Cholesky of singular H
    with pytest.raises(ValueError, match="larger damping_M"):
        wush_transform(M, H, damping=0.01, damping_M=0.0)  # singular M


def test_batched_over_heads_matches_per_head():
    _, M, H = _stats(d=16, seed=6, batch=(2, 3))
    T, T_inv = wush_transform(M, H, dtype=f64)
    assert T.shape == (2, 3, 16, 16)
    for i in range(2):
        for j in range(3):
            Tij, Tij_inv = wush_transform(M[i, j], H[i, j], dtype=f64)
            torch.testing.assert_close(T[i, j], Tij, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(T_inv[i, j], Tij_inv, rtol=1e-10, atol=1e-12)


def test_round_trip_rows_float32():
    _, M, H = _stats(d=64, n=600, seed=7, batch=(4,))
    T, T_inv = wush_transform(M, H)
    x = torch.randn(4, 100, 64, generator=torch.Generator().manual_seed(0))
    y = x @ T.mT @ T_inv.mT
    assert (y - x).norm() / x.norm() < 1e-5


@pytest.mark.parametrize(
    "M, H, match",
    [
        (torch.full((4, 4), float("nan")), torch.eye(4), "M contains NaN or inf"),
        (torch.eye(4), torch.eye(4).index_fill(0, torch.tensor([1]), float("inf")), "H contains NaN or inf"),
        (torch.ones(4, 3), torch.ones(4, 3), "square"),
        (torch.eye(4), torch.eye(5), "same shape"),
        (torch.eye(4).expand(2, 4, 4), torch.eye(4), "same shape"),
        (torch.zeros(4, 4), torch.eye(4), "larger damping_M"),
    ],
)
def test_errors(M, H, match):
    with pytest.raises(ValueError, match=match):
        wush_transform(M, H)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_bad_damping(bad):
    with pytest.raises(ValueError, match="damping"):
        wush_transform(torch.eye(4), torch.eye(4), damping=bad)
    with pytest.raises(ValueError, match="damping_M"):
        wush_transform(torch.eye(4), torch.eye(4), damping_M=bad)


def _eigh_with_flipped_signs(monkeypatch, seed):
    """Make torch.linalg.eigh return each eigenvector with a random sign, as another BLAS or device may."""
    real = torch.linalg.eigh
    gen = torch.Generator().manual_seed(seed)

    def flipped(A, *a, **k):
        lam, U = real(A, *a, **k)
        s = torch.randint(0, 2, U.shape[:-2] + U.shape[-1:], generator=gen).to(U.dtype) * 2 - 1
        return lam, U * s[..., None, :]

    monkeypatch.setattr(torch.linalg, "eigh", flipped)


def test_signs_of_eigh_do_not_change_the_transform(monkeypatch):
    """eigh's sign of each eigenvector is arbitrary (it differed between CPU and GPU calibrations); WUSH
    fixes it, so the same statistics solve to the same T everywhere."""
    _, M, H = _stats(d=32, batch=(3,))
    T0, Ti0 = wush_transform(M, H, dtype=f64)
    for seed in range(3):
        with monkeypatch.context() as m:
            _eigh_with_flipped_signs(m, seed)
            T, Ti = wush_transform(M, H, dtype=f64)
        assert torch.allclose(T, T0, atol=1e-12) and torch.allclose(Ti, Ti0, atol=1e-12)


def test_canonical_signs():
    from wushkv.transforms.wush import canonical_signs

    U = torch.linalg.qr(torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0), dtype=f64))[0]
    C = canonical_signs(U)
    big = torch.gather(C, -2, C.abs().argmax(-2, keepdim=True))
    assert (big > 0).all()  # largest entry of every column positive
    assert torch.equal(canonical_signs(-U), C) and torch.equal(canonical_signs(C), C)
    assert torch.allclose(C.mT @ C, torch.eye(8, dtype=f64).expand(2, 8, 8), atol=1e-12)


def test_with_signs_is_the_solution_with_flipped_eigenvectors():
    """with_signs(T, D) equals solving WUSH with eigh's eigenvectors multiplied by D (before the canonical fix)."""
    from wushkv.transforms import wush as W

    _, M, H = _stats(d=16, batch=(2,))
    T0, Ti0 = wush_transform(M, H, dtype=f64)
    D = torch.tensor([(-1.0) ** (j // 3) for j in range(16)], dtype=f64).expand(2, 16)
    T, Ti = W.with_signs(T0, Ti0, D)
    T1, Ti1 = wush_transform(M, H, dtype=f64, signs=D)
    assert torch.allclose(T, T1, atol=1e-10) and torch.allclose(Ti, Ti1, atol=1e-10)
    with pytest.raises(ValueError, match="do not fit"):
        W.with_signs(T0, Ti0, D[:, :8])
    with pytest.raises(ValueError, match=r"\+1 or -1"):
        W.with_signs(T0, Ti0, 0.5 * D)
