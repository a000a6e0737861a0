"""Transform registry: names, specs, stats validation, and the inverse of every transform."""

import pytest
import torch

import wushkv.transforms as tr
from wushkv.transforms import TRANSFORMS, TransformSpec, build_transforms, get_transform_spec, hadamard_matrix

Hkv, d = 2, 16


def _stats(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def gram(n=64):
        X = torch.randn(Hkv, d, n, generator=gen, dtype=torch.float64)
        X = X * torch.exp(torch.randn(Hkv, d, 1, generator=gen, dtype=torch.float64))
        return X @ X.mT / n

    st = {k: gram() for k in ("M_K", "H_K", "M_V", "H_V", "H_K_A", "H_V_A", "C_Q", "Sigma_V", "M_K_W", "M_V_W")}
    # M_K here is a mean (n = 1 "token"); a small mean key keeps M_K − μμᵀ positive definite
    return st | {"mu_K": 0.01 * torch.randn(Hkv, d, generator=gen, dtype=torch.float64),
                 "mu_V": 0.01 * torch.randn(Hkv, d, generator=gen, dtype=torch.float64), "n_K": torch.ones(1, dtype=torch.float64)}


def test_names_and_specs():
    assert set(TRANSFORMS) == {"identity", "hadamard", "hadamard-c", "random", "wush", "wush-c", "wush-a", "wush-w", "oscar", "kvarn"}
    for name, spec in TRANSFORMS.items():
        assert isinstance(spec, TransformSpec) and spec.name == name and spec.description
        assert spec.needs_calibration == bool(spec.stats_keys)
        assert get_transform_spec(name) is spec
    assert not get_transform_spec("kvarn").needs_calibration
    with pytest.raises(Exception):
        spec.name = "x"  # frozen


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="unknown transform 'nope'") as e:
        build_transforms("nope", Hkv, d)
    for name in TRANSFORMS:
        assert repr(name) in str(e.value)
    with pytest.raises(ValueError, match="known transforms"):
        get_transform_spec("WUSH")


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_round_trips(name):
    out = build_transforms(name, Hkv, d, _stats(), seed=3)
    assert set(out.tensors()) == {"T_K", "T_K_inv", "T_V", "T_V_inv"} | ({"mu_K", "mu_V"} if name.endswith("-c") else set())
    x = torch.randn(Hkv, 50, d, generator=torch.Generator().manual_seed(1))
    for kind in "KV":
        T, T_inv = getattr(out, f"T_{kind}"), getattr(out, f"T_{kind}_inv")
        assert T.shape == T_inv.shape == (Hkv, d, d) and T.dtype == T_inv.dtype == torch.float32
        y = x @ T.mT @ T_inv.mT
        assert (y - x).norm() / x.norm() < 1e-5, (name, kind)


def test_specific_contents():
    s = _stats()
    H = hadamard_matrix(d, dtype=torch.float32)
    for name in ("hadamard", "kvarn"):
        out = build_transforms(name, Hkv, d)
        assert torch.equal(out.T_K[0], H) and torch.equal(out.T_V[1], H)
    r = build_transforms("random", Hkv, d, seed=5)
    assert not torch.allclose(r.T_K, r.T_V)  # keys seed, values seed + 1
    torch.testing.assert_close(r.T_V, tr.random_orthogonal_transform(Hkv, d, seed=6)[0])
    w = build_transforms("wush", Hkv, d, s, damping=0.05)
    torch.testing.assert_close(w.T_K, tr.wush_transform(s["M_K"], s["H_K"], 0.05)[0])
    torch.testing.assert_close(w.T_V_inv, tr.wush_transform(s["M_V"], s["H_V"], 0.05)[1])
    wa = build_transforms("wush-a", Hkv, d, s)
    torch.testing.assert_close(wa.T_K, tr.wush_transform(s["M_K"], s["H_K_A"])[0])
    torch.testing.assert_close(wa.T_V, tr.wush_transform(s["M_V"], s["H_V_A"])[0])
    ww = build_transforms("wush-w", Hkv, d, s)
    torch.testing.assert_close(ww.T_K, tr.wush_transform(s["M_K_W"], s["H_K"])[0])
    torch.testing.assert_close(ww.T_V, tr.wush_transform(s["M_V_W"], s["H_V"])[0])
    o = build_transforms("oscar", Hkv, d, s)
    torch.testing.assert_close(o.T_K, tr.oscar_transform(s["C_Q"], s["Sigma_V"]).T_K)


@pytest.mark.parametrize("name", ["wush", "wush-a", "wush-w", "oscar"])
def test_missing_stats(name):
    s = _stats()
    key = TRANSFORMS[name].stats_keys[-1]
    del s[key]
    with pytest.raises(ValueError, match=f"{name!r}.*{key!r}"):
        build_transforms(name, Hkv, d, s)
    with pytest.raises(ValueError, match="missing"):
        build_transforms(name, Hkv, d, None)


def test_wrong_stats_shape():
    s = _stats()
    s["H_K"] = s["H_K"][:1]
    with pytest.raises(ValueError, match=r"stats\['H_K'\].*\(2, 16, 16\)"):
        build_transforms("wush", Hkv, d, s)


def test_kvarn_module_is_lazy():
    import subprocess
    import sys

    code = (
        "import sys, wushkv.transforms as t; "
        "assert 'wushkv.transforms.kvarn' not in sys.modules; "
        "assert 'transformers' not in sys.modules"
    )
    import os
    from pathlib import Path

    src = str(Path(tr.__file__).resolve().parents[2])  # the dir holding the wushkv package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    if (Path(tr.__file__).parent / "kvarn.py").exists():  # written separately; exposed on access
        assert tr.kvarn.__name__ == "wushkv.transforms.kvarn"
    with pytest.raises(AttributeError, match="no_such_attr"):
        tr.no_such_attr  # noqa: B018


def test_centered_transforms():
    """wush-c: WUSH on the centered Gram Σ(k − μ)(k − μ)ᵀ = M_K − n μμᵀ, plus μ; hadamard-c: 𝓗 plus μ."""
    import torch

    from wushkv.transforms import build_transforms
    from wushkv.transforms.wush import wush_transform

    g = torch.Generator().manual_seed(0)
    H, d, n = 2, 16, 500
    K = torch.randn(H, n, d, generator=g, dtype=torch.float64) + 3.0  # keys with a large common offset
    Q = torch.randn(H, n, d, generator=g, dtype=torch.float64)
    V = torch.randn(H, n, d, generator=g, dtype=torch.float64) - 1.0
    stats = {"M_K": K.mT @ K, "H_K": 2 * Q.mT @ Q, "M_V": V.mT @ V, "H_V": torch.eye(d, dtype=torch.float64).expand(H, d, d).clone(),
             "mu_K": K.mean(1), "mu_V": V.mean(1), "n_K": torch.tensor([float(n)], dtype=torch.float64)}
    tr = build_transforms("wush-c", H, d, stats)
    Kc = K - K.mean(1, keepdim=True)
    T, T_inv = wush_transform(Kc.mT @ Kc, stats["H_K"])
    torch.testing.assert_close(tr.T_K, T)
    torch.testing.assert_close(tr.mu_K, K.mean(1).float())
    Vc = V - V.mean(1, keepdim=True)
    torch.testing.assert_close(tr.T_V, wush_transform(Vc.mT @ Vc, stats["H_V"])[0])
    torch.testing.assert_close(tr.mu_V, V.mean(1).float())
    had = build_transforms("hadamard-c", H, d, stats)
    torch.testing.assert_close(had.T_K, build_transforms("hadamard", H, d).T_K)
    assert torch.equal(had.mu_K, K.mean(1).float())
    with pytest.raises(ValueError, match="mu_K"):
        build_transforms("wush-c", H, d, {k: v for k, v in stats.items() if k != "mu_K"})
