"""Sweeps: a tiny grid on a tiny model, in-process and on a local Ray instance."""

from __future__ import annotations

import math
import json
import shutil

import pytest

from conftest import hf_char_tokenizer, tiny_model
from wushkv.sweep import FULL_PRECISION, SweepConfig, SweepError, run_sweep

WORDS = "the cat sat on a mat while one dog ran past two red birds and three green frogs sang".split()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import random

    d = tmp_path_factory.mktemp("sweep")
    model = tiny_model("llama", vocab_size=128, max_position_embeddings=1024)
    model.save_pretrained(d / "tiny-llama")
    hf_char_tokenizer().save_pretrained(d / "tiny-llama")
    rng = random.Random(0)
    for name in ("eval.txt", "calib.txt"):
        (d / name).write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)) + "\n")
    return d


def write_config(d, out: str, **over) -> SweepConfig:
    grid = {"models": ["tiny-llama"], "transforms": ["hadamard", "wush"], "bits": [2, "K4V2"], "evaluations": ["ppl", "recon"]} | over
    text = f'''out = "{out}"
[grid]
models = {json.dumps(grid["models"])}
transforms = {json.dumps(grid["transforms"])}
bits = {json.dumps(grid["bits"])}
quantizers = ["quest"]
evaluations = {json.dumps(grid["evaluations"])}
[eval]
chunks = 2
seq_len = 96
text_file = "eval.txt"
sink = 4
keep = 16
flush = 4
[calibration]
samples = 2
seq_len = 96
text_file = "calib.txt"
[resources]
num_cpus = 1
'''
    (d / f"{out}.toml").write_text(text)
    return SweepConfig.load(d / f"{out}.toml")


def values(out):
    return {(r["transform"], r["k_bits"], r["v_bits"], r["evaluation"]): r["value"] for r in out["results"]}


def test_grid_and_resume(workdir):
    cfg = write_config(workdir, "inproc")
    jobs = cfg.jobs()
    # full precision once per ppl, every (transform, bits) per evaluation
    assert len(jobs) == 1 + 2 * 2 * 2
    assert sum(j.transform == FULL_PRECISION for j in jobs) == 1
    first = run_sweep(cfg, max_jobs=3, show_progress=False, log=lambda m: None)  # "interrupted" after 3 jobs
    assert len(first["ran"]) == 3 and first["finished"] == 3
    rest = run_sweep(cfg, show_progress=False, log=lambda m: None)
    assert len(rest["ran"]) == len(jobs) - 3 and rest["finished"] == len(jobs)
    again = run_sweep(cfg, show_progress=False, log=lambda m: None)
    assert again["ran"] == []
    v = values(again)
    fp = v[(FULL_PRECISION, None, None, "ppl")]
    for t in ("hadamard", "wush"):
        assert v[(t, 2, 2, "ppl")] != fp and v[(t, 4, 2, "ppl")] != fp  # the cache's quantization is seen
        assert 0 < v[(t, 4, 2, "recon")] < v[(t, 2, 2, "recon")]  # more key bits, less error
    # agreement with a direct evaluation, outside the sweep machinery
    import torch

    from wushkv.calibration import calibrate
    from wushkv.data import tokenize_chunks
    from wushkv.eval.compare import quantized_perplexity
    from wushkv.models import load

    model, tok = load(str(workdir / "tiny-llama"))
    torch.set_num_threads(1)
    cal = calibrate(model, tok, samples=2, seq_len=96, text_file=str(workdir / "calib.txt"), show_progress=False)
    chunks = tokenize_chunks(tok, (workdir / "eval.txt").read_text(), 96, 2)
    direct = quantized_perplexity(model, chunks, cal, "wush", cfg.quant_config("wush", "quest", 4, 2), show_progress=False)
    assert direct["ppl"] == pytest.approx(v[("wush", 4, 2, "ppl")], rel=1e-6)
    assert (cfg.out / "results.md").is_file() and (cfg.out / "results_tiny-llama_ppl.png").is_file()
    assert len(list((cfg.out / "calibrations").glob("*.safetensors"))) == 1  # calibrated once

    # a deleted result (a job that never finished) is the only one run again
    victim = next((cfg.out / "jobs").glob("*.json"))
    victim.unlink()
    assert len(run_sweep(cfg, show_progress=False, log=lambda m: None)["ran"]) == 1

    # a changed setting never reuses results computed under the old one
    cfg2 = write_config(workdir, "inproc", bits=[3])
    assert {cfg2.job_id(j) for j in cfg2.jobs()}.isdisjoint({cfg.job_id(j) for j in jobs if j.transform != FULL_PRECISION})


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_ray_matches_in_process(workdir):
    pytest.importorskip("ray")
    ref = write_config(workdir, "ref", evaluations=["ppl"], bits=[2])
    on_ray = write_config(workdir, "onray", evaluations=["ppl"], bits=[2])
    a = run_sweep(ref, show_progress=False, log=lambda m: None)
    b = run_sweep(on_ray, ray_address="local", show_progress=False, log=lambda m: None)
    assert len(b["ran"]) == 3 and b["finished"] == 3
    assert values(a) == values(b)  # bit-identical
    shutil.rmtree(on_ray.out / "jobs")
    (on_ray.out / "jobs").mkdir()
    c = run_sweep(on_ray, ray_address="local", max_jobs=1, show_progress=False, log=lambda m: None)
    assert len(c["ran"]) == 1


def test_bad_configs(workdir):
    with pytest.raises(SweepError, match="unknown transform 'nope'"):
        write_config(workdir, "bad", transforms=["nope"])
    with pytest.raises(SweepError, match="bits must be in"):
        write_config(workdir, "bad", bits=[5])
    with pytest.raises(SweepError, match="K<bits>V<bits>"):
        write_config(workdir, "bad", bits=["Kx"+"V2"])
    with pytest.raises(SweepError, match="evaluations entry 'bleu'"):
        write_config(workdir, "bad", evaluations=["bleu"])
    (workdir / "typo.toml").write_text('[grid]\nmodels=["a"]\ntransforms=["wush"]\nbits=[2]\n[eval]\nchunk = 3\n')
    with pytest.raises(SweepError, match=r"unknown keys \['chunk'\] in \[eval\]"):
        SweepConfig.load(workdir / "typo.toml")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SweepConfig.load(workdir / "missing.toml")


def test_wush_a_in_a_sweep(workdir):
    """A grid with wush-a (or a wush-a side) calibrates with the attention-aware statistics by itself;
    sweeps without it keep their calibration and job keys."""
    plain = write_config(workdir, "plain")
    assert "wush_a" not in plain.calibration  # keys of older sweeps unchanged
    cfg = write_config(workdir, "wa", transforms=["wush-a", "wush-a:hadamard"], bits=[2], evaluations=["ppl"])
    assert cfg.calibration["wush_a"] is True
    assert cfg.calibration_key("tiny-llama") != plain.calibration_key("tiny-llama")
    out = run_sweep(cfg, show_progress=False, log=lambda m: None)
    v = values(out)
    fp = v[(FULL_PRECISION, None, None, "ppl")]
    for t in ("wush-a", "wush-a:hadamard"):
        assert math.isfinite(v[(t, 2, 2, "ppl")]) and v[(t, 2, 2, "ppl")] >= fp * 0.99
    # the kept calibration really holds H_K_A
    from safetensors import safe_open

    [cal_file] = (cfg.out / "calibrations").glob("*.safetensors")
    with safe_open(str(cal_file), framework="pt") as f:
        assert any("H_K_A" in k for k in f.keys())


def test_wush_a_config_errors(workdir):
    base = '[grid]\nmodels=["a"]\ntransforms=["wush-a"]\nbits=[2]\n'
    (workdir / "waoff.toml").write_text(base + "[calibration]\nwush_a = false\n")
    with pytest.raises(SweepError, match="need the attention-aware statistics"):
        SweepConfig.load(workdir / "waoff.toml")
    (workdir / "skip.toml").write_text(base + "[calibration]\nskip_first = -1\n")
    with pytest.raises(SweepError, match=r"skip_first = -1: expected an integer >= 0"):
        SweepConfig.load(workdir / "skip.toml")
    (workdir / "skipq.toml").write_text(base + "[calibration]\nskip_first_queries = true\n")
    with pytest.raises(SweepError, match=r"skip_first_queries = True: expected an integer >= 0"):
        SweepConfig.load(workdir / "skipq.toml")


def test_quantizers_of_each_method_kind():
    from wushkv.sweep import quantizers_of

    qs = ["quest", "affine", "kivi"]
    assert quantizers_of("wush+tiles", qs) == ["kvarn"] and quantizers_of("kvarn", qs) == ["kvarn"]
    assert quantizers_of("wush+ktiles", qs) == ["quest", "affine"]  # values per token: no kivi/kvarn values
    assert quantizers_of("wush", qs) == qs
