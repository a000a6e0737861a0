"""Exported row-vector transforms reproduce the method's products; the cast is checked; errors are clear."""

import json

import pytest
import torch
from safetensors import safe_open

from wushkv.calibration import calibrate
from wushkv.export import export_transforms, inverse_error, row_vector_transforms

from conftest import CharTokenizer, tiny_model


@pytest.fixture(scope="module")
def cal(tmp_path_factory):
    text = tmp_path_factory.mktemp("t") / "c.txt"
    text.write_text("calibration text for a tiny model. " * 200)
    return calibrate(tiny_model("llama"), CharTokenizer(), samples=2, seq_len=48, text_file=str(text), show_progress=False)


def test_row_vector_convention_matches_the_method(cal):
    tr = cal.transforms("wush")[1]
    rv = row_vector_transforms([tr])[0]
    H, d = tr.T_K.shape[:2]
    K, Q, V = (torch.randn(H, 5, d, dtype=torch.float64) for _ in range(3))
    # K' = K·key equals (T_K kᵀ)ᵀ per head; Q'K'ᵀ = QKᵀ; V' = V·value; O'·output recovers O
    assert torch.allclose(K @ rv["key"], (tr.T_K.double() @ K.transpose(-1, -2)).transpose(-1, -2))
    assert torch.allclose((Q @ rv["query"]) @ (K @ rv["key"]).transpose(-1, -2), Q @ K.transpose(-1, -2), atol=1e-4)  # float32-solved transforms
    assert torch.allclose(((V @ rv["value"]) @ rv["output"]), V, atol=1e-4)
    assert inverse_error(rv) < 1e-5


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_export_file(cal, tmp_path, dtype, tol):
    out = tmp_path / "t.safetensors"
    meta = export_transforms(cal, "wush", out, dtype=dtype)
    assert meta["max_inverse_error"] <= tol
    with safe_open(str(out), "pt") as f:
        header = f.metadata()
        assert header["format"] == "wushkv-transforms" and header["format_version"] == "1"
        assert json.loads(header["meta"])["method"] == "wush"
        t = f.get_tensor("layers.0.key")
        assert t.dtype == getattr(torch, dtype) and t.shape == (2, 32, 32)
        assert len([k for k in f.keys() if k.startswith("layers.")]) == 4 * 3
        # read back from the file's own values, not from memory: each layer's query/key and value/output maps are
        # inverse pairs to the stated tolerance, and the file's per-layer errors are what its values give
        meta_file = json.loads(header["meta"])
        n = meta_file["num_layers"]
        for l in range(n):
            layer = {k: f.get_tensor(f"layers.{l}.{k}") for k in ("key", "query", "value", "output")}
            assert all(v.dtype == getattr(torch, dtype) for v in layer.values())
            err = inverse_error(layer)
            assert err <= tol and err == pytest.approx(meta_file["inverse_error_per_layer"][l], rel=1e-9, abs=0)
            eye = torch.eye(layer["key"].shape[-1], dtype=torch.float64)
            qk = layer["query"].double() @ layer["key"].double().mT  # q' k'ᵀ = q T_K^{-1} (k T_Kᵀ)ᵀ: the identity map
            assert (qk - eye).abs().max() <= tol


def test_export_refuses_a_lossy_cast_and_bad_dtype(cal, tmp_path):
    with pytest.raises(ValueError, match=r"after the cast to bfloat16, layer \d+ gives"):
        export_transforms(cal, "wush", tmp_path / "x.safetensors", dtype="bfloat16", tolerance=1e-9)
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        export_transforms(cal, "wush", tmp_path / "y.safetensors", dtype="int8")


def test_centered_export_shift(cal):
    """wush-c: K·key − key_shift equals (T_K (k − μ))ᵀ, the keys the cache stores."""
    tr = cal.transforms("wush-c")[0]
    rv = row_vector_transforms([tr])[0]
    H, d = tr.T_K.shape[:2]
    K = torch.randn(H, 5, d, dtype=torch.float64)
    want = (tr.T_K.double() @ (K - tr.mu_K.double()[:, None]).transpose(-1, -2)).transpose(-1, -2)
    assert rv["key_shift"].shape == (H, 1, d)
    assert torch.allclose(K @ rv["key"] - rv["key_shift"], want, atol=1e-6)
    V = torch.randn(H, 5, d, dtype=torch.float64)
    Vt = V @ rv["value"] - rv["value_shift"]  # what the cache stores: (T_V (v − μ_V))ᵀ
    assert torch.allclose(Vt, (tr.T_V.double() @ (V - tr.mu_V.double()[:, None]).mT).mT, atol=1e-6)
    assert torch.allclose(Vt @ rv["output"] + rv["output_shift"], V, atol=1e-4)
