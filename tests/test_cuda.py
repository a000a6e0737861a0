"""The CUDA path equals the CPU path (tiny models). Skipped where no GPU is present, so CI never runs it.

Every evaluation wushkv runs on a GPU goes through the same code as on the CPU; what can differ is
where a tensor lives. Each method is calibrated, installed and evaluated on both devices, and the
perplexity of the exact single-pass emulation and the teacher-forced log-probability of a streamed
answer must agree to float rounding.
"""

from pathlib import Path

import pytest
import torch

from wushkv.calibration import calibrate
from wushkv.config import QuantConfig, WindowConfig
from wushkv.methods.install import method_cache
from wushkv.eval.passkey import answer_and_logprob
from wushkv.eval.perplexity import perplexity

from conftest import CharTokenizer, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

README = str(Path(__file__).resolve().parents[1] / "README.md")
METHODS = ["full-precision", "hadamard", "random", "oscar", "wush", "wush+ldlq", "hadamard:wush", "wush-a", "kvarn"]


def _scores(family: str, device: str) -> dict:
    model = tiny_model(family).to(device)
    tok = CharTokenizer(model.config.vocab_size)
    seqs = torch.randint(3, model.config.vocab_size, (3, 160), generator=torch.Generator().manual_seed(0))
    cal = calibrate(model, tok, samples=2, seq_len=128, text_file=README, wush_a=True, show_progress=False)
    out = {}
    for name in METHODS:
        for quantizer in ("quest", "affine"):
            if name == "kvarn" and (quantizer == "affine" or family == "gemma3"):  # tiles outgrow the tiny sliding window
                continue
            cfg = QuantConfig(k_bits=2, v_bits=2, quantizer=quantizer, windows=WindowConfig(4, 8, 4))
            with method_cache(model, cal, name, cfg) as make:
                ppl = perplexity(model, seqs, None if name == "full-precision" else make, show_progress=False)["ppl"]
                _, lp = answer_and_logprob(model, seqs[:1, :100].to(device), [5, 6, 7], 4, make)
            out[name, quantizer] = (ppl, lp)
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_matches_cpu(family):
    cpu, gpu = _scores(family, "cpu"), _scores(family, "cuda")
    assert cpu.keys() == gpu.keys()
    for key, (ppl, lp) in cpu.items():
        assert gpu[key][0] == pytest.approx(ppl, rel=1e-3), key
        assert gpu[key][1] == pytest.approx(lp, abs=1e-2), key
