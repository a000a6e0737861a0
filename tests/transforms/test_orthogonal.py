"""Identity, seeded random rotations and OSCAR: orthogonality, determinism, eigen-structure."""

import pytest
import torch

from wushkv.transforms import (
    hadamard_matrix,
    identity_transform,
    oscar_rotation,
    oscar_transform,
    random_orthogonal_transform,
)


def _round_trip(T, T_inv, Hkv, d):
    x = torch.randn(Hkv, 40, d)
    torch.testing.assert_close(x @ T.mT @ T_inv.mT, x, rtol=1e-5, atol=1e-5)


def _spd(d, n, gen, scale=None):
    X = torch.randn(d, n, generator=gen, dtype=torch.float64)
    if scale is not None:
        X = X * scale[:, None]
    return X @ X.mT / n


def test_identity():
    T, T_inv = identity_transform(2, 16)
    assert T.shape == (2, 16, 16) and T.dtype == torch.float32
    assert torch.equal(T, torch.eye(16).expand(2, 16, 16)) and torch.equal(T_inv, T)
    T[0, 0, 0] = 5.0  # separate storage: caller may edit one without touching the other
    assert T_inv[0, 0, 0] == 1.0


def test_random_orthogonal_deterministic_and_distinct():
    T, T_inv = random_orthogonal_transform(4, 32, seed=7)
    T2, _ = random_orthogonal_transform(4, 32, seed=7)
    T3, _ = random_orthogonal_transform(4, 32, seed=8)
    assert T.shape == (4, 32, 32) and T.dtype == torch.float32
    assert torch.equal(T, T2)
    assert not torch.allclose(T, T3)
    for h in range(3):  # heads differ
        assert not torch.allclose(T[h], T[h + 1])
    torch.testing.assert_close(T @ T.mT, torch.eye(32).expand(4, 32, 32), atol=1e-5, rtol=0)
    torch.testing.assert_close(T_inv, T.mT)
    _round_trip(T, T_inv, 4, 32)


def test_random_orthogonal_sign_convention():
    # Q R = G with diag(R) > 0 makes Q unique: rebuild from the same seeded Gaussian.
    gen = torch.Generator().manual_seed(3)
    G = torch.randn(2, 8, 8, generator=gen, dtype=torch.float64)
    T, _ = random_orthogonal_transform(2, 8, seed=3)
    R = T.double().mT @ G
    torch.testing.assert_close(R, R.triu(), atol=1e-5, rtol=0)
    assert bool((torch.diagonal(R, dim1=-2, dim2=-1) > 0).all())


def test_oscar_rotation_diagonalizes_descending():
    gen = torch.Generator().manual_seed(0)
    d = 32
    Sigma = _spd(d, 200, gen, torch.logspace(-1, 1, d, dtype=torch.float64))
    R = oscar_rotation(Sigma)
    assert R.dtype == torch.float64
    torch.testing.assert_close(R @ R.mT, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    U = R @ hadamard_matrix(d).mT  # undo 𝓗
    D = U.mT @ Sigma @ U
    off = D - torch.diag_embed(torch.diagonal(D))
    assert off.abs().max() < 1e-10 * D.abs().max()
    ev = torch.diagonal(D)
    assert bool((ev[:-1] >= ev[1:]).all())
    torch.testing.assert_close(ev, torch.linalg.eigvalsh(Sigma).flip(0))


def test_oscar_rotation_independent_of_eigh_signs(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    d = 16
    Sigma = _spd(d, 200, gen, torch.logspace(-1, 1, d, dtype=torch.float64))
    R0 = oscar_rotation(Sigma)
    real = torch.linalg.eigh

    def flipped(A, *a, **k):  # another BLAS or device may return any sign per eigenvector
        lam, U = real(A, *a, **k)
        return lam, U * torch.tensor([(-1.0) ** j for j in range(U.shape[-1])], dtype=U.dtype)

    monkeypatch.setattr(torch.linalg, "eigh", flipped)
    torch.testing.assert_close(oscar_rotation(Sigma), R0, atol=1e-12, rtol=0)


def test_oscar_transform_shared_per_layer():
    gen = torch.Generator().manual_seed(1)
    Hkv, d = 3, 16
    C_Q = torch.stack([_spd(d, 100, gen) for _ in range(Hkv)])
    S_V = torch.stack([_spd(d, 100, gen) for _ in range(Hkv)])
    out = oscar_transform(C_Q, S_V)
    assert set(out.tensors()) == {"T_K", "T_K_inv", "T_V", "T_V_inv"}
    for v in out.tensors().values():
        assert v.shape == (Hkv, d, d) and v.dtype == torch.float32
    R_K = oscar_rotation(C_Q.mean(0)).float()
    R_V = oscar_rotation(S_V.mean(0)).float()
    for h in range(Hkv):  # one rotation broadcast to every head
        torch.testing.assert_close(out.T_K[h], R_K.mT)
        torch.testing.assert_close(out.T_K_inv[h], R_K)
        torch.testing.assert_close(out.T_V[h], R_V.mT)
        torch.testing.assert_close(out.T_V_inv[h], R_V)
    _round_trip(out.T_K, out.T_K_inv, Hkv, d)
    _round_trip(out.T_V, out.T_V_inv, Hkv, d)
    assert oscar_transform(C_Q, S_V, num_heads=5).T_K.shape == (5, d, d)


def test_oscar_errors():
    good = torch.eye(8).expand(2, 8, 8)
    with pytest.raises(ValueError, match="NaN or inf"):
        oscar_transform(torch.full((2, 8, 8), float("nan")), good)
    with pytest.raises(ValueError, match="same head dim"):
        oscar_transform(good, torch.eye(4).expand(2, 4, 4))
    with pytest.raises(ValueError, match=r"\[\.\.\., d, d\]"):
        oscar_rotation(torch.ones(3, 4))
