"""Calibration statistics, solving, files and their errors."""

import json

import pytest
import torch

from wushkv.calibration import Calibration, CalibrationError, calibrate, collect_statistics
from wushkv.folding import apply_transforms
from wushkv.models import describe

from conftest import CharTokenizer, tiny_model

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "calib.txt"
    p.write_text(TEXT)
    return str(p)


def capture_qkv(model, ids):
    """Slow reference: capture post-RoPE q/k and v with a plain observer (no accumulation)."""
    from wushkv.hf import restore_attention, use_wushkv_attention

    seen = {}

    class Obs:
        def observe(self, module, q, k, v, allowed, scaling, softcap=None, sinks=None):
            seen[module.layer_idx] = (q.double(), k.double(), v.double())

    prev = use_wushkv_attention(model)
    try:
        with torch.no_grad():
            model(ids, wushkv_observer=Obs())
    finally:
        restore_attention(model, prev)
    return seen


def test_statistics_match_slow_reference(family):
    model = tiny_model(family)
    spec = describe(model)
    seqs = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    stats = collect_statistics(model, seqs, show_progress=False)
    G, d = spec.group_size, spec.head_dim
    ref = {l: {"M_K": 0, "H_K": 0, "M_V": 0, "S_K": 0, "S_V": 0} for l in range(spec.num_layers)}
    for s in seqs:
        for l, (q, k, v) in capture_qkv(model, s[None]).items():
            for h in range(spec.num_kv_heads):
                K, V = k[0, h], v[0, h]  # (S, d)
                Qs = torch.cat([q[0, g] for g in spec.query_heads_of(h)])  # (G*T, d)
                ref[l]["M_K"] = ref[l]["M_K"] + torch.zeros(spec.num_kv_heads, d, d, dtype=torch.float64).index_put_((torch.tensor(h),), K.T @ K)
                ref[l]["H_K"] = ref[l]["H_K"] + torch.zeros(spec.num_kv_heads, d, d, dtype=torch.float64).index_put_((torch.tensor(h),), 2 * Qs.T @ Qs)
                ref[l]["M_V"] = ref[l]["M_V"] + torch.zeros(spec.num_kv_heads, d, d, dtype=torch.float64).index_put_((torch.tensor(h),), V.T @ V)
                ref[l]["S_K"] = ref[l]["S_K"] + torch.zeros(spec.num_kv_heads, d, dtype=torch.float64).index_put_((torch.tensor(h),), K.sum(0))
                ref[l]["S_V"] = ref[l]["S_V"] + torch.zeros(spec.num_kv_heads, d, dtype=torch.float64).index_put_((torch.tensor(h),), V.sum(0))
    n = seqs.numel()
    for l in range(spec.num_layers):
        assert float(stats[l]["n_K"]) == n
        torch.testing.assert_close(stats[l]["mu_K"], ref[l]["S_K"] / n, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(stats[l]["mu_V"], ref[l]["S_V"] / n, rtol=1e-6, atol=1e-8)
        for name in ("M_K", "H_K", "M_V"):
            torch.testing.assert_close(stats[l][name], ref[l][name], rtol=1e-6, atol=1e-8)
        # H_V from o_proj columns of the group's query heads
        W = model.model.layers[l].self_attn.o_proj.weight.double()
        for h in range(spec.num_kv_heads):
            Hv = sum(2 * W[:, g * d : (g + 1) * d].T @ W[:, g * d : (g + 1) * d] for g in spec.query_heads_of(h))
            torch.testing.assert_close(stats[l]["H_V"][h], Hv)
        # OSCAR C_Q is the mean query outer product
        torch.testing.assert_close(stats[l]["C_Q"], stats[l]["H_K"] / (2 * G * seqs.numel()))


def test_calibrate_save_load_apply(tmp_path, text_file, family):
    model = tiny_model(family)
    cal = calibrate(model, CharTokenizer(), samples=3, seq_len=48, text_file=text_file, show_progress=False)
    assert {"wush", "oscar"} <= set(cal.solved)
    path = cal.save(tmp_path / "c.safetensors")
    meta = json.loads((tmp_path / "c.safetensors.json").read_text())
    for k in ("model", "fingerprint", "calibration_source", "tokens", "samples", "seq_len", "damping", "wushkv_version", "date"):
        assert k in meta
    assert meta["tokens"] == 3 * 48
    loaded = Calibration.load(path, model)
    for m in ("wush", "oscar"):
        for a, b in zip(cal.transforms(m), loaded.transforms(m)):
            ta, tb = a.tensors(), b.tensors()
            assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    ids = torch.randint(3, 96, (1, 30))
    with torch.no_grad():
        ref = model(ids).logits
        for m in ("wush", "oscar"):
            with apply_transforms(model, loaded.transforms(m), m):
                assert (model(ids).logits - ref).abs().max() < 1e-3


def test_deterministic(text_file):
    a = calibrate(tiny_model("llama"), CharTokenizer(), samples=2, seq_len=32, text_file=text_file, show_progress=False)
    b = calibrate(tiny_model("llama"), CharTokenizer(), samples=2, seq_len=32, text_file=text_file, show_progress=False)
    for x, y in zip(a.transforms("wush"), b.transforms("wush")):
        assert torch.equal(x.T_K, y.T_K) and torch.equal(x.T_V, y.T_V)


def test_wrong_model_corrupted_and_missing(tmp_path, text_file):
    model = tiny_model("llama", seed=0)
    path = calibrate(model, CharTokenizer(), samples=2, seq_len=32, text_file=text_file, show_progress=False).save(tmp_path / "c.safetensors")
    with pytest.raises(CalibrationError, match="weights_sha256"):
        Calibration.load(path, tiny_model("llama", seed=1))
    with pytest.raises(CalibrationError, match="family: file 'llama' vs model 'qwen3'"):
        Calibration.load(path, tiny_model("qwen3"))
    bad = tmp_path / "bad.safetensors"
    data = path.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CalibrationError, match="corrupted"):
        Calibration.load(bad)
    with pytest.raises(FileNotFoundError, match="wushkv calibrate"):
        Calibration.load(tmp_path / "missing.safetensors")
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(CalibrationError, match="not a wushkv calibration"):
        Calibration.load(other)


@pytest.mark.parametrize("name, value, match", [
    ("stats.1.H_V", float("nan"), r"statistic H_V of layer 1 contains NaN or inf"),
    ("stats.0.M_K", float("inf"), r"statistic M_K of layer 0 contains NaN or inf"),
    ("stats.0.M_K", None, r"lacks statistic M_K of layer 0"),
    ("transforms.wush.0.T_K", None, r"incomplete stored transforms: .*missing \['T_K'\]"),
])
def test_a_file_with_bad_statistics_is_refused_at_load(tmp_path, text_file, name, value, match):
    """A calibration file whose statistics hold NaN/inf, or that lacks one, is refused when it is read, naming the
    file, the statistic and the layer; a stored transform with a missing matrix likewise (nothing is solved from it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model("llama")
    cal = calibrate(model, CharTokenizer(), samples=1, seq_len=32, text_file=text_file, show_progress=False)
    cal.transforms("wush")
    path = cal.save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert name in tensors
    header.pop("sha256")  # a file without the checksum (older versions): the checks of the values themselves refuse it
    if value is None:
        del tensors[name]
    else:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = value
    save_file(tensors, str(path), metadata=header)
    with pytest.raises(CalibrationError, match=match) as e:
        Calibration.load(path)
    assert str(path) in str(e.value)


def test_version_mismatch(tmp_path, text_file):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model("llama")
    path = calibrate(model, CharTokenizer(), samples=1, seq_len=32, text_file=text_file, show_progress=False).save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    header["format_version"] = "99"
    save_file(tensors, str(path), metadata=header)
    with pytest.raises(CalibrationError, match="version 99"):
        Calibration.load(path)


def test_no_partial_file_on_interrupt(tmp_path, monkeypatch, text_file):
    import os

    cal = calibrate(tiny_model("llama"), CharTokenizer(), samples=1, seq_len=32, text_file=text_file, show_progress=False)

    def boom(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # interrupted after the temporary file is written, before it takes the name
        m.setattr(os, "replace", boom)
        with pytest.raises(KeyboardInterrupt):
            cal.save(tmp_path / "c.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt"]  # no partial or temporary file


def test_rank_deficient_statistics_still_invertible(text_file):
    # fewer calibration tokens than head_dim: M is rank-deficient, damping keeps T invertible
    model = tiny_model("llama")
    cal = calibrate(model, CharTokenizer(), samples=1, seq_len=8, text_file=text_file, show_progress=False)
    for tr in cal.transforms("wush"):
        I = torch.eye(32).expand_as(tr.T_K)
        assert torch.isfinite(tr.T_K).all()
        torch.testing.assert_close(tr.T_K @ tr.T_K_inv, I, atol=1e-3, rtol=0)
        torch.testing.assert_close(tr.T_V @ tr.T_V_inv, I, atol=1e-3, rtol=0)


@pytest.mark.parametrize("block,window", [(256, None), (3, None), (4, 5)])
def test_attention_weighted_grams_match_brute_force(block, window):
    """WUSH-W's M_K_W and M_V_W: every key and value weighted by Σ_{g,i} p_{g,i,t}² over the queries that read it
    quantized (t >= S_sink, i - t >= S_keep), by explicit loops on one layer of a tiny model; query rows in one
    block or several, causal or sliding-window masks."""
    from wushkv.calibration import StatsCollector

    model = tiny_model("llama")
    spec = describe(model)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    q, k, v = capture_qkv(model, ids)[1]
    attn = model.model.layers[1].self_attn
    s, T, sink, keep = attn.scaling, ids.shape[1], 2, 3
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if window is not None:
        allowed &= torch.ones(T, T, dtype=torch.bool).triu(-(window - 1))
    allowed = allowed[None, None]
    coll = StatsCollector(spec, [None, attn.o_proj.weight.detach(), None], attention_weights=(sink, keep))
    coll.block = block
    coll.observe(attn, q.float(), k.float(), v.float(), allowed, s)
    for h in range(spec.num_kv_heads):
        P = {g: torch.softmax((q[0, g] @ k[0, h].T * s).masked_fill(~allowed[0, 0], float("-inf")), -1) for g in spec.query_heads_of(h)}
        MK = torch.zeros(spec.head_dim, spec.head_dim, dtype=torch.float64)
        MV = torch.zeros_like(MK)
        for t in range(sink, T):
            w = sum(float(P[g][i, t]) ** 2 for g in P for i in range(t + keep, T))
            MK += w * torch.outer(k[0, h, t], k[0, h, t])
            MV += w * torch.outer(v[0, h, t], v[0, h, t])
        torch.testing.assert_close(coll.layers[1]["M_K_W"][h], MK, rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(coll.layers[1]["M_V_W"][h], MV, rtol=1e-4, atol=1e-8)


def test_wush_w_calibration_and_errors(text_file):
    """`calibrate(attention_weights=...)` records the windows and solves wush-w (invertible, the plain H's);
    a calibration without the weighted Grams names the flag that makes them; windows the sequences never reach
    are refused before any forward pass."""
    model = tiny_model("llama")
    cal = calibrate(model, CharTokenizer(), samples=2, seq_len=32, text_file=text_file, show_progress=False, attention_weights=(4, 8))
    assert cal.meta["attention_weights"] == [4, 8] and "wush-w" in cal.solved
    for tr, plain in zip(cal.transforms("wush-w"), cal.transforms("wush")):
        I = torch.eye(32).expand_as(tr.T_K)
        torch.testing.assert_close(tr.T_K @ tr.T_K_inv, I, atol=1e-3, rtol=0)
        assert not torch.allclose(tr.T_K, plain.T_K, atol=1e-3)
    plain = calibrate(model, CharTokenizer(), samples=1, seq_len=32, text_file=text_file, show_progress=False)
    assert "attention_weights" not in plain.meta  # a default calibration keeps the recipe earlier versions wrote
    with pytest.raises(CalibrationError, match="--attention-weights"):
        plain.transforms("wush-w")
    with pytest.raises(ValueError, match="longer than S_sink \\+ S_keep = 40"):
        calibrate(model, CharTokenizer(), samples=1, seq_len=32, text_file=text_file, show_progress=False, attention_weights=(8, 32))


@pytest.mark.parametrize("block,window,skip", [(256, None, 0), (3, None, 0), (4, 3, 0), (3, None, 4)])
def test_wush_a_matches_brute_force(block, window, skip):
    """H^A of docs/reference/math.md#31-wush-a-the-attention-aware-hessian by explicit per-(i, t) Jacobian sums on one layer of a tiny model; query rows in
    one block or several (each over only the key columns it reaches), causal or sliding-window masks, and
    the first ``skip`` query rows left out of the key Hessian (one block cut in two)."""
    from wushkv.calibration import StatsCollector

    model = tiny_model("llama")
    spec = describe(model)
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    q, k, v = capture_qkv(model, ids)[1]
    attn = model.model.layers[1].self_attn
    W = attn.o_proj.weight.double()
    d, s = spec.head_dim, attn.scaling
    T = ids.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if window is not None:
        allowed &= torch.ones(T, T, dtype=torch.bool).triu(-(window - 1))
    allowed = allowed[None, None]
    coll = StatsCollector(spec, [None, attn.o_proj.weight.detach(), None], wush_a=True, skip_first_queries=skip)
    coll.block = block
    coll.observe(attn, q.float(), k.float(), v.float(), allowed, s)
    got_K, got_V = coll.layers[1]["H_K_A"], coll.layers[1]["H_V_A"]
    for h in range(spec.num_kv_heads):
        gs = list(spec.query_heads_of(h))
        Bg = {g: W[:, g * d : (g + 1) * d] for g in gs}  # (hidden, d)
        P = {g: torch.softmax((q[0, g] @ k[0, h].T * s).masked_fill(~allowed[0, 0], float("-inf")), -1) for g in gs}
        O = {g: P[g] @ v[0, h] for g in gs}
        HV = torch.zeros(d, d, dtype=torch.float64)
        HK = torch.zeros(d, d, dtype=torch.float64)
        for t in range(T):
            for i in range(T):
                Bit = sum(P[g][i, t] * Bg[g].T for g in gs)  # (d, hidden)
                HV += 2 * Bit @ Bit.T
                J = sum(s * P[g][i, t] * torch.outer(Bg[g] @ (v[0, h, t] - O[g][i]), q[0, g, i]) for g in gs)  # (hidden, d)
                HK += 2 * J.T @ J * (i >= skip)
        torch.testing.assert_close(got_V[h], HV, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got_K[h], HK, rtol=1e-3, atol=1e-5)


def test_skip_first_queries_leaves_early_queries_out_of_the_key_hessian():
    """H_K and C_Q from the queries at positions >= n only; M_K, M_V (and their means) from every position."""
    model = tiny_model("llama")
    spec = describe(model)
    seqs = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    full = collect_statistics(model, seqs, show_progress=False)
    n = 7
    cut = collect_statistics(model, seqs, show_progress=False, skip_first_queries=n)
    ref = [torch.zeros(spec.num_kv_heads, spec.head_dim, spec.head_dim, dtype=torch.float64) for _ in range(spec.num_layers)]
    for s in seqs:
        for l, (q, k, v) in capture_qkv(model, s[None]).items():
            for h in range(spec.num_kv_heads):
                Qs = torch.cat([q[0, g, n:] for g in spec.query_heads_of(h)])
                ref[l][h] += 2 * Qs.T @ Qs
    for l in range(spec.num_layers):
        torch.testing.assert_close(cut[l]["H_K"], ref[l], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(cut[l]["C_Q"], ref[l] / (2 * spec.group_size * seqs.shape[0] * (seqs.shape[1] - n)))
        for name in ("M_K", "M_V", "mu_K", "H_V"):
            torch.testing.assert_close(cut[l][name], full[l][name])
        assert not torch.allclose(cut[l]["H_K"], full[l]["H_K"])
    with pytest.raises(ValueError, match=r"skip_first_queries = 24: expected an integer in \[0, 23\]"):
        collect_statistics(model, seqs, show_progress=False, skip_first_queries=24)


# -- models split over devices (accelerate device_map) --------------------------------------------
def test_device_map_paths(tmp_path):
    """``--device-map``: the accelerate loading path, per-layer statistics and evaluation on a dispatched
    model. On this CPU-only machine every "device" is the CPU: the numbers must equal a plain load's."""
    from conftest import hf_char_tokenizer, tiny_model

    from wushkv.calibration import collect_statistics
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.eval.compare import quantized_perplexity
    from wushkv.models import load

    model = tiny_model("llama", vocab_size=128)
    model.save_pretrained(tmp_path / "m")
    hf_char_tokenizer().save_pretrained(tmp_path / "m")
    plain, _ = load(str(tmp_path / "m"))
    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "model.rotary_emb", "lm_head"]
    for device_map in ("auto", {n: "cpu" for n in names}):
        split, _ = load(str(tmp_path / "m"), device_map=device_map)
        seqs = torch.randint(4, 100, (2, 48), generator=torch.Generator().manual_seed(0))
        a, b = collect_statistics(plain, seqs, show_progress=False), collect_statistics(split, seqs, show_progress=False)
        for la, lb in zip(a, b):
            for k in la:
                assert torch.equal(la[k], lb[k]), k
        cfg = QuantConfig(2, 2, "quest", windows=WindowConfig(4, 8, 4))
        pa = quantized_perplexity(plain, seqs, None, "hadamard", cfg, show_progress=False)["ppl"]
        pb = quantized_perplexity(split, seqs, None, "hadamard", cfg, show_progress=False)["ppl"]
        assert pa == pb


def test_offloaded_weights_are_refused():
    from conftest import tiny_model

    from wushkv.folding import apply_transforms
    from wushkv.transforms import build_transforms

    model = tiny_model("llama")
    model.model.layers[1].self_attn.v_proj.weight = torch.nn.Parameter(torch.empty(64, 64, device="meta"))
    with pytest.raises(ValueError, match=r"layer 1 attention weights \['v_proj.weight'\] are offloaded"):
        apply_transforms(model, [build_transforms("hadamard", 2, 32) for _ in range(3)])


def test_pre_rope_key_mean_matches_slow_reference(family):
    """mu_K_pre (post-RoPE keys rotated back by their position, in the collector) equals the mean of the
    keys before RoPE taken at k_proj (through k_norm where the family has one): Gemma-3's two RoPE bases too."""
    from wushkv.calibration import pre_rope_key_mean

    model = tiny_model(family).double()
    seqs = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    stats = collect_statistics(model, seqs, show_progress=False)
    ref = pre_rope_key_mean(model, seqs, show_progress=False)
    for l, st in enumerate(stats):
        torch.testing.assert_close(st["mu_K_pre"], ref[l], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(st["mu_K_pre"], st["mu_K"], atol=1e-3)  # not the post-RoPE mean


def test_centered_key_second_moment_matches_slow_reference():
    """With key means μ, the collector's M_K_res is Σ (k_t − R_t μ)(k_t − R_t μ)ᵀ over the post-RoPE keys; μ = 0 gives M_K."""
    from wushkv.layer import RotatingKeyMean
    from wushkv.models import rope_parameters

    model = tiny_model("gemma3").double()
    spec = describe(model)
    seqs = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    H, d = spec.num_kv_heads, spec.head_dim
    mus = [torch.randn(H, d, generator=torch.Generator().manual_seed(l), dtype=torch.float64) for l in range(spec.num_layers)]
    stats = collect_statistics(model, seqs, show_progress=False, key_means=mus)
    zero = collect_statistics(model, seqs, show_progress=False, key_means=[torch.zeros(H, d, dtype=torch.float64)] * spec.num_layers)
    ref = [0] * spec.num_layers
    for s in seqs:
        for l, (q, k, v) in capture_qkv(model, s[None]).items():
            kt = RotatingKeyMean(mus[l], torch.eye(d, dtype=torch.float64).repeat(H, 1, 1), rope_parameters(model, l, spec))
            r = k[0].double() - kt.center(torch.arange(k.shape[2])[None], torch.float64)[0]  # (H, S, d)
            ref[l] = ref[l] + r.transpose(1, 2) @ r
    for l in range(spec.num_layers):
        torch.testing.assert_close(zero[l]["M_K_res"], zero[l]["M_K"])
        torch.testing.assert_close(stats[l]["M_K_res"], ref[l], rtol=1e-5, atol=1e-5)


def test_cover_positions_averages_the_key_space_over_offsets(tiny_cal):
    """``cover_positions``: each key-space statistic becomes the mean of R_s M R_sᵀ (R_s μ) over offsets s uniform on
    [0, serve_len − seq_len], checked against explicit rotation matrices on a fine grid of offsets; value-side
    statistics and the pre-RoPE mean do not move; traces are kept (a rotation); a serve length within the
    calibration's changes nothing; over whole turns of one pair, that pair's block loses its direction (it commutes
    with the pair's rotation)."""
    from conftest import tiny_model

    from wushkv.calibration import cover_positions
    from wushkv.models import describe, rope_parameters

    model = tiny_model("llama")
    cal = tiny_cal(model)
    spec = describe(model)
    rope = [rope_parameters(model, l, spec) for l in range(spec.num_layers)]
    same = cover_positions(cal, rope, int(cal.meta["seq_len"]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(cal.stats, same.stats) for k in a) and "positions" not in same.meta
    got = cover_positions(cal, rope, 64 + 96)
    assert got.meta["positions"] == 160 and got.solved == {}
    d = spec.head_dim
    h = d // 2
    f = rope[0][0].double()
    offs = torch.linspace(0, 96, 1921, dtype=torch.float64)  # trapezoid rule on a fine grid: the continuous mean
    wts = torch.full((len(offs),), 1.0, dtype=torch.float64)
    wts[0] = wts[-1] = 0.5
    wts /= wts.sum()

    def R(s):  # the rotate-half RoPE rotation by s positions as a (d, d) matrix
        c, sn = torch.cos(s * f), torch.sin(s * f)
        m = torch.zeros(d, d, dtype=torch.float64)
        m[:h, :h], m[h:, h:] = torch.diag(c), torch.diag(c)
        m[:h, h:], m[h:, :h] = -torch.diag(sn), torch.diag(sn)
        return m

    Rs = torch.stack([R(s) for s in offs])  # (S, d, d)
    for k in ("M_K", "H_K", "C_Q"):
        M = cal.stats[0][k].double()
        want = torch.einsum("s,shik,slk->hil", wts, torch.einsum("sij,hjk->shik", Rs, M), Rs)
        assert torch.allclose(got.stats[0][k], want, atol=1e-6 * float(M.abs().max())), k
        assert torch.allclose(got.stats[0][k].diagonal(dim1=-2, dim2=-1).sum(-1), M.diagonal(dim1=-2, dim2=-1).sum(-1))
    mu = torch.einsum("s,sij,hj->hi", wts, Rs, cal.stats[0]["mu_K"].double())
    assert torch.allclose(got.stats[0]["mu_K"], mu, atol=1e-6 * float(mu.abs().max()))
    for k in ("M_V", "H_V", "Sigma_V", "mu_V", "mu_K_pre"):
        assert torch.equal(got.stats[0][k], cal.stats[0][k]), k
    # one pair over whole turns: its 2x2 block of M_K commutes with the pair's rotation
    i = h - 1  # the lowest frequency
    turns = 3 * 2 * torch.pi / float(f[i])
    one = [(torch.zeros(h).index_fill_(0, torch.tensor([i]), float(f[i])), 1.0)] * spec.num_layers
    B = cover_positions(cal, one, 64 + round(turns)).stats[0]["M_K"][0][[i, i + h]][:, [i, i + h]]
    J = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(B @ J, J @ B, atol=2e-3 * float(B.abs().max()))
    assert got.transforms("wush")  # transforms solve from the covered statistics
