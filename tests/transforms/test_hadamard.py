"""Hadamard matrices: orthogonality, equal-magnitude entries, constructions, transform shapes."""

import math

import pytest
import torch

from wushkv.transforms import hadamard_matrix, hadamard_transform, is_full_hadamard


@pytest.mark.parametrize("d", [1, 2, 4, 12, 20, 24, 44, 64, 80, 96, 128, 192, 256])
def test_full_hadamard_orthogonal_equal_entries(d):
    H = hadamard_matrix(d)
    assert H.shape == (d, d) and H.dtype == torch.float64
    assert is_full_hadamard(d)
    torch.testing.assert_close(H @ H.mT, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(H.abs(), torch.full((d, d), 1 / math.sqrt(d), dtype=torch.float64))


@pytest.mark.parametrize("d", [2, 8, 64, 128])
def test_sylvester_symmetric(d):
    H = hadamard_matrix(d)
    assert torch.equal(H, H.mT)
    # First row/column of a normalized Sylvester matrix is all +1/√d.
    assert bool((H[0] > 0).all()) and bool((H[:, 0] > 0).all())


@pytest.mark.parametrize("m", [12, 20])
def test_paley_orders_generated(m):
    # Unnormalized ±1 matrix with H Hᵀ = m·I: a genuine Hadamard of a non-power-of-two order.
    H = hadamard_matrix(m) * math.sqrt(m)
    assert torch.equal(H.abs(), torch.ones(m, m, dtype=torch.float64))
    torch.testing.assert_close(H @ H.mT, m * torch.eye(m, dtype=torch.float64))


@pytest.mark.parametrize("d, blocks", [(36, [32, 4]), (10, [8, 2]), (7, [4, 2, 1])])
def test_block_diagonal_fallback(d, blocks):
    assert not is_full_hadamard(d)
    H = hadamard_matrix(d)
    torch.testing.assert_close(H @ H.mT, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    start = 0
    for b in blocks:  # largest power-of-two blocks first, on the diagonal
        blk = H[start : start + b, start : start + b]
        torch.testing.assert_close(blk.abs(), torch.full((b, b), 1 / math.sqrt(b), dtype=torch.float64))
        assert H[start : start + b].abs().sum() == pytest.approx(blk.abs().sum())
        start += b


def test_dtype_device_and_errors():
    assert hadamard_matrix(16, dtype=torch.float32).dtype == torch.float32
    for bad in (0, -4):
        with pytest.raises(ValueError, match="d="):
            hadamard_matrix(bad)


def test_hadamard_transform_round_trip():
    T, T_inv = hadamard_transform(3, 64)
    assert T.shape == T_inv.shape == (3, 64, 64) and T.dtype == torch.float32
    x = torch.randn(3, 50, 64)
    y = x @ T.mT @ T_inv.mT
    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(T[1], hadamard_matrix(64, dtype=torch.float32))
    with pytest.raises(ValueError, match="num_heads"):
        hadamard_transform(0, 64)
