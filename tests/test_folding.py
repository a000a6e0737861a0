"""Folding T_V into the weights and the online key transform leave the model's function unchanged."""

import pytest
import torch

from wushkv.folding import apply_transforms
from wushkv.models import describe
from wushkv.transforms import LayerTransforms, build_transforms

from conftest import tiny_model


def random_invertible(H, d, gen):
    A = torch.randn(H, d, d, generator=gen, dtype=torch.float64) / d**0.5 + torch.eye(d, dtype=torch.float64)
    return A.float(), torch.linalg.inv(A).float()


@torch.no_grad()
def test_invariance_general_invertible(family):
    model = tiny_model(family)
    spec = describe(model)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits
    gen = torch.Generator().manual_seed(0)
    trs = []
    for _ in range(spec.num_layers):
        T_K, T_K_inv = random_invertible(spec.num_kv_heads, spec.head_dim, gen)
        T_V, T_V_inv = random_invertible(spec.num_kv_heads, spec.head_dim, gen)
        trs.append(LayerTransforms(T_K, T_K_inv, T_V, T_V_inv))
    with apply_transforms(model, trs) as h:
        out = model(ids).logits
        # something really changed: v_proj weights differ and each layer has a key transform
        assert hasattr(model.model.layers[0].self_attn, "wushkv_key")
    assert (out - ref).abs().max() < 1e-3
    # restore brings the exact weights back
    assert not hasattr(model.model.layers[0].self_attn, "wushkv_key")
    assert torch.equal(model(ids).logits, ref)
    assert model.config._attn_implementation != "wushkv"
    assert not h.active


@pytest.mark.parametrize("name", ["identity", "hadamard", "random", "kvarn"])
@torch.no_grad()
def test_invariance_registry_transforms(name):
    model = tiny_model("qwen3")
    spec = describe(model)
    ids = torch.randint(3, 96, (1, 30))
    ref = model(ids).logits
    trs = [build_transforms(name, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
    with apply_transforms(model, trs, name):
        assert (model(ids).logits - ref).abs().max() < 1e-3


def test_bad_transforms_rejected():
    model = tiny_model("llama")
    spec = describe(model)
    good = build_transforms("identity", spec.num_kv_heads, spec.head_dim)
    with pytest.raises(ValueError, match="the model has 3"):
        apply_transforms(model, [good])
    bad = good.replace(T_K=torch.eye(16).expand(2, 16, 16))
    with pytest.raises(ValueError, match=r"T_K has shape \(2, 16, 16\), expected \(2, 32, 32\)"):
        apply_transforms(model, [bad] * 3)
    nan = good.replace(T_V=torch.full_like(good.T_V, float("nan")))
    with pytest.raises(ValueError, match="NaN"):
        apply_transforms(model, [nan] * 3)
    h = apply_transforms(model, [good] * 3)
    with pytest.raises(RuntimeError, match="already installed"):
        apply_transforms(model, [good] * 3)
    h.restore()


@torch.no_grad()
def test_centered_keys_are_exact(family):
    """k' = T (k − μ) for every key: scores of each query shift by one constant, the softmax is unchanged;
    v' = T_V (v − μ_V): outputs shift by −μ_V, given back by the o_proj bias. Exact in a plain forward and
    through a full-precision WushKVCache (sink, recent window and decode steps); restore removes the biases."""
    from wushkv.cache import WushKVCache
    from wushkv.config import QuantConfig, WindowConfig

    model = tiny_model(family)
    spec = describe(model)
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = model(ids).logits
    gen = torch.Generator().manual_seed(3)
    trs = []
    for _ in range(spec.num_layers):
        T_K, T_K_inv = random_invertible(spec.num_kv_heads, spec.head_dim, gen)
        T_V, T_V_inv = random_invertible(spec.num_kv_heads, spec.head_dim, gen)
        mu = 5.0 * torch.randn(spec.num_kv_heads, spec.head_dim, generator=gen)  # a large offset
        mu_v = 3.0 * torch.randn(spec.num_kv_heads, spec.head_dim, generator=gen)
        trs.append(LayerTransforms(T_K, T_K_inv, T_V, T_V_inv, mu_K=mu, mu_V=mu_v))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with apply_transforms(model, trs):
        assert (model(ids).logits - ref).abs().max() < 1e-3
        cfg = QuantConfig(None, None, windows=WindowConfig(4, 8, 4))  # both sides full precision
        cache = WushKVCache(model, cfg)
        out = [model(ids[:, :20], cache=cache).logits]
        for t in range(20, 40):
            out.append(model(ids[:, t : t + 1], cache=cache).logits)
        assert (torch.cat(out, 1) - ref).abs().max() < 1e-3
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)


def test_centered_keys_refused_under_softcap():
    model = tiny_model("gemma2")  # attn_logit_softcapping in its config
    spec = describe(model)
    tr = build_transforms("hadamard", spec.num_kv_heads, spec.head_dim)
    tr = tr.replace(mu_K=torch.ones(spec.num_kv_heads, spec.head_dim))
    with pytest.raises(ValueError, match="softcap"):
        apply_transforms(model, [tr] * spec.num_layers)


def test_a_bad_layer_leaves_no_layer_folded():
    model = tiny_model("llama")
    spec = describe(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trs = [build_transforms("hadamard", spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
    trs[-1] = trs[-1].replace(mu_V=torch.ones(spec.num_kv_heads + 1, spec.head_dim))
    with pytest.raises(ValueError, match=f"layer {spec.num_layers - 1} mu_V"):
        apply_transforms(model, trs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(hasattr(layer.self_attn, "wushkv_key") for layer in model.model.layers)


@pytest.mark.parametrize("B,S", [(1, 1), (1, 5), (4, 1), (3, 6)])
@pytest.mark.parametrize("centered", [False, True])
def test_key_transform_applies_each_heads_matrix_to_each_row(B, S, centered):
    """KeyTransform.keys/queries (one bmm over the heads at batch > 1, matmul at one row) against each row and head
    done alone in float64: k' = T_K (k − μ), q' = T_K⁻ᵀ q for every query head of the group; inputs laid out as
    transformers' projections leave them (heads and positions transposed)."""
    from wushkv.folding import KeyTransform

    gen = torch.Generator().manual_seed(B * 10 + S)
    H, G, d = 3, 2, 16
    T, T_inv = random_invertible(H, d, gen)
    mu = torch.randn(H, d, generator=gen) if centered else None
    kt = KeyTransform(T, T_inv, mu)
    k = torch.randn(B, S, H, d, generator=gen).transpose(1, 2)
    q = torch.randn(B, S, H * G, d, generator=gen).transpose(1, 2)
    keys, queries = kt.keys(k), kt.queries(q)
    assert keys.shape == (B, H, S, d) and queries.shape == (B, H * G, S, d)
    for b in range(B):
        for h in range(H):
            x = k[b, h].double() - (mu[h].double() if centered else 0)
            torch.testing.assert_close(keys[b, h].double(), x @ T[h].double().T, rtol=1e-5, atol=1e-5)
            for g in range(G):
                torch.testing.assert_close(queries[b, h * G + g].double(), q[b, h * G + g].double() @ T_inv[h].double(),
                                           rtol=1e-5, atol=1e-5)
    # a batch's rows each equal that row transformed alone (float32: a one-row product may round otherwise)
    for b in range(B):
        torch.testing.assert_close(kt.keys(k[b : b + 1]), keys[b : b + 1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kt.queries(q[b : b + 1]), queries[b : b + 1], rtol=1e-5, atol=1e-5)
