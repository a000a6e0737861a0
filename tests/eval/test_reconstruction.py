import math

import torch

from wushkv.config import QuantConfig
from wushkv.eval.reconstruction import layer_reconstruction
from wushkv.models import describe
from wushkv.transforms import build_transforms

from conftest import tiny_model


def test_reconstruction_properties():
    model = tiny_model("llama")
    spec = describe(model)
    seqs = torch.randint(3, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    trs = {n: [build_transforms(n, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)] for n in ("identity", "hadamard")}
    res8 = layer_reconstruction(model, seqs, trs, QuantConfig(8, 8, "affine", k_clip=0, v_clip=0), show_progress=False)
    res2 = layer_reconstruction(model, seqs, trs, QuantConfig(2, 2, "quest"), show_progress=False)
    for n in trs:
        assert len(res2[n]["per_layer"]) == spec.num_layers
        # geometric mean of the per-layer errors
        g = math.exp(sum(math.log(e) for e in res2[n]["per_layer"]) / spec.num_layers)
        assert math.isclose(g, res2[n]["geomean"], rel_tol=1e-9)
        # more bits, less error; 8-bit min-max is nearly exact
        assert all(a < b for a, b in zip(res8[n]["per_layer"], res2[n]["per_layer"]))
        assert res8[n]["geomean"] < 1e-3
    # the model ran unperturbed and is unchanged afterwards
    assert model.config._attn_implementation != "wushkv"


def test_reconstruction_matches_manual_layer():
    """Layer 0's error equals a direct computation from captured q, k, v."""
    from wushkv.attention import reference_attention
    from wushkv.codecs import make_codec

    from test_calibration import capture_qkv

    model = tiny_model("qwen3")
    spec = describe(model)
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    cfg = QuantConfig(2, 2, "quest")
    trs = {"random": [build_transforms("random", spec.num_kv_heads, spec.head_dim, seed=0) for _ in range(spec.num_layers)]}
    res = layer_reconstruction(model, ids, trs, cfg, show_progress=False)
    q, k, v = (x.float() for x in capture_qkv(model, ids)[0])
    attn = model.model.layers[0].self_attn
    allowed = torch.ones(24, 24, dtype=torch.bool).tril()[None, None]
    Y = attn.o_proj(reference_attention(q, k, v, allowed, attn.scaling).reshape(1, 24, -1))
    tr = trs["random"][0]
    kc, vc = make_codec(cfg, "key", spec.head_dim), make_codec(cfg, "value", spec.head_dim)
    # dequantized keys/values mapped back to the original space: T⁻¹ Q(T x)
    k_hat = torch.einsum("bhsd,hed->bhse", kc.fake(torch.einsum("bhsd,hed->bhse", k, tr.T_K)), tr.T_K_inv)
    v_hat = torch.einsum("bhsd,hed->bhse", vc.fake(torch.einsum("bhsd,hed->bhse", v, tr.T_V)), tr.T_V_inv)
    Y_hat = attn.o_proj(reference_attention(q, k_hat, v_hat, allowed, attn.scaling).reshape(1, 24, -1))
    want = float(((Y_hat - Y).pow(2).sum() / Y.pow(2).sum()).detach())
    assert math.isclose(res["random"]["per_layer"][0], want, rel_tol=1e-3)


def test_reconstruction_sink_stays_full_precision():
    """``sink``: the first positions are not quantized; sink = L leaves nothing quantized (error 0 up to
    the rounding of the transform round trip)."""
    model = tiny_model("llama")
    spec = describe(model)
    seqs = torch.randint(3, 96, (1, 32), generator=torch.Generator().manual_seed(1))
    trs = {"hadamard": [build_transforms("hadamard", spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]}
    cfg = QuantConfig(2, 2, "quest")
    full = layer_reconstruction(model, seqs, trs, cfg, show_progress=False)["hadamard"]["geomean"]
    some = layer_reconstruction(model, seqs, trs, cfg, show_progress=False, sink=8)["hadamard"]["geomean"]
    none = layer_reconstruction(model, seqs, trs, cfg, show_progress=False, sink=32)["hadamard"]["geomean"]
    assert none < 1e-10 < some < full


def test_reconstruction_centered_is_exact_without_quantization():
    """Centering keys and values is exact: with nothing quantized (sink = L) the error is 0
    even for large means, so any error measured with centering comes from the quantizer alone."""
    model = tiny_model("llama")
    spec = describe(model)
    seqs = torch.randint(3, 96, (1, 32), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    tr = build_transforms("hadamard", spec.num_kv_heads, spec.head_dim)
    tr = tr.replace(mu_K=4 * torch.randn(spec.num_kv_heads, spec.head_dim, generator=g), mu_V=4 * torch.randn(spec.num_kv_heads, spec.head_dim, generator=g))
    res = layer_reconstruction(model, seqs, {"c": [tr] * spec.num_layers}, QuantConfig(2, 2, "quest"), show_progress=False, sink=32)
    assert res["c"]["geomean"] < 1e-10
