"""Agreement metrics: KL/top-1 against hand computations, prefixes, teacher forcing, full precision as a fixed point."""

import math

import pytest
import torch

from wushkv.config import QuantConfig, WindowConfig
from wushkv.eval.agreement import common_prefix, common_prefixes, greedy, kl_and_top1, next_token_logits, run_agreement, summarize
from wushkv.methods import MethodSpec, StockCache, parse
from wushkv.methods.install import method_cache

from conftest import tiny_model


def test_kl_and_top1_by_hand():
    ref = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    q = torch.tensor([[2.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
    kl, top1 = kl_and_top1(ref, q)
    p = torch.softmax(ref[1].double(), -1)
    r = torch.softmax(q[1].double(), -1)
    assert kl[0] == 0 and abs(float(kl[1]) - float((p * (p / r).log()).sum())) < 1e-12
    assert top1.tolist() == [True, True]  # argmax of a uniform row is index 0, as is q's
    assert kl_and_top1(ref, -ref)[1].tolist() == [False, True]


def test_kl_and_top1_in_row_blocks_equals_all_at_once():
    g = torch.Generator().manual_seed(0)
    ref, q = torch.randn(37, 50, generator=g), torch.randn(37, 50, generator=g)
    kl, top1 = kl_and_top1(ref, q, rows=37)
    for rows in (1, 5, 36):
        k, t = kl_and_top1(ref, q, rows=rows)
        assert torch.equal(t, top1) and torch.allclose(k, kl, rtol=0, atol=1e-15)
    k1, t1 = kl_and_top1(ref[3], q[3])  # one position
    assert k1.shape == () and float(k1) == pytest.approx(float(kl[3]), abs=1e-15) and bool(t1) == bool(top1[3])
    with pytest.raises(ValueError, match="do not match"):
        kl_and_top1(ref, q[:5])


def test_common_prefix_and_summary():
    a = torch.tensor([[1, 2, 3, 4]])
    assert common_prefix(a, a) == 4
    assert common_prefix(a, torch.tensor([[1, 2, 9, 4]])) == 2
    assert common_prefix(a, torch.tensor([[7, 2, 3, 4]])) == 0
    s = summarize([[0.1, 0.1, 0.3, 0.3], [0.1, 0.1, 0.1, 0.1]], [[True, True, False, True]] * 2, [4, 2])
    assert s["mean_kl"] == pytest.approx(0.15) and s["top1"] == pytest.approx(0.75)
    assert s["kl_growth"] == pytest.approx(2.0) and s["median_first_divergence"] == 3
    assert math.isnan(s["kl_late_growth"])  # 4 positions: quarters of one position say nothing
    s = summarize([[0.1, 0.1, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3]], [[True] * 8], [8])
    assert s["kl_late_growth"] == pytest.approx(0.3 / 0.1)  # 4th quarter (0.3, 0.3) over the 2nd (0.1, 0.1)
    assert math.isnan(summarize([[0.0] * 8], [[True] * 8], [8])["kl_late_growth"])  # no error at all


def test_late_growth_by_hand_and_against_a_reference():
    """The 4th / 2nd-quarter ratio of prompt-mean KLs; against a reference, paired over prompts: a method equal to
    the reference up to a constant factor grows exactly alike (interval [1, 1]); one whose late KL doubles, twice."""
    from wushkv.eval.agreement import late_growth

    g = torch.Generator().manual_seed(0)
    ref = (torch.rand(6, 16, generator=g) + 0.1).tolist()
    q2 = sum(sum(r[4:8]) / 4 for r in ref) / 6
    q4 = sum(sum(r[12:16]) / 4 for r in ref) / 6
    out = late_growth(ref, ref)
    assert out["ratio"] == pytest.approx(q4 / q2) and out["ci"][0] <= out["ratio"] <= out["ci"][1]
    assert out["vs_reference"] == pytest.approx(1.0) and out["vs_reference_ci"] == pytest.approx([1.0, 1.0])
    scaled = late_growth([[3 * x for x in r] for r in ref], ref)
    assert scaled["vs_reference"] == pytest.approx(1.0) and scaled["vs_reference_ci"] == pytest.approx([1.0, 1.0])
    doubled = late_growth([r[:12] + [2 * x for x in r[12:]] for r in ref], ref)
    assert doubled["vs_reference"] == pytest.approx(2.0) and doubled["vs_reference_ci"] == pytest.approx([2.0, 2.0])
    assert "vs_reference" not in late_growth(ref)
    with pytest.raises(ValueError, match="same prompts"):
        late_growth(ref, ref[:5])
    with pytest.raises(ValueError, match="at least 8 generated positions"):
        late_growth([r[:6] for r in ref])
    with pytest.raises(ValueError, match="reference's KL is zero"):
        late_growth(ref, [[0.0] * 16 for _ in ref])


@torch.no_grad()
def test_teacher_forcing_is_self_consistent():
    """The greedy continuation is the argmax of the teacher-forced logits; streaming = single pass."""
    from transformers import DynamicCache

    model = tiny_model("llama").double()
    p = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    y = greedy(model, p, 24, DynamicCache(config=model.config))
    ref = next_token_logits(model, p, y)
    assert torch.equal(ref.argmax(-1), y[0])
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(4, 8, 4))
    with method_cache(model, None, "hadamard", cfg) as make:
        one = next_token_logits(model, p, y, make(), single_pass=True)
        steps = next_token_logits(model, p, y, make(), single_pass=False)
    assert (one - steps).abs().max() < 1e-6 and (one - ref).abs().max() > 1e-3


def test_full_precision_agrees_perfectly_and_bits_order():
    model = tiny_model("qwen3")
    prompts = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(2, 4, 2))
    res = run_agreement(model, prompts, ["full-precision", "hadamard"], None, cfg, 20, show_progress=False, log=lambda m: None)
    fp = res["full-precision"]
    assert fp["mean_kl"] < 1e-6 and fp["top1"] == 1.0 and fp["first_divergence"] == [20, 20]
    h2 = res["hadamard"]
    h8 = run_agreement(model, prompts, ["hadamard"], None, QuantConfig(8, 8, "affine", windows=cfg.windows), 20,
                       show_progress=False, log=lambda m: None)["hadamard"]
    assert h8["mean_kl"] < h2["mean_kl"] and len(h2["kl_by_position"]) == 20


def test_method_names():
    assert parse("stock-hqq-2") == StockCache("hqq", 2) and isinstance(parse("wush"), MethodSpec)
    with pytest.raises(ValueError, match="stock-<backend>-<bits>"):
        parse("stock-hqq-3")
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        parse("nope")


@torch.no_grad()
def test_free_running_stops_at_first_divergence():
    """With a reference, greedy decoding stops at the first differing token, and the measured prefix
    is the one the full free-running generation has."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    p = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(4))
    y = greedy(model, p, 20, DynamicCache(config=model.config))
    assert torch.equal(greedy(model, p, 20, DynamicCache(config=model.config), reference=y), y)
    other = y.clone()
    other[0, 5] = (other[0, 5] + 1) % 96
    short = greedy(model, p, 20, DynamicCache(config=model.config), reference=other)
    assert short.shape == (1, 6) and torch.equal(short, y[:, :6])
    assert common_prefix(short, other) == common_prefix(y, other) == 5


class _Interrupt(Exception):
    pass


def test_interrupted_run_resumes_to_the_same_result():
    model = tiny_model("qwen3")
    prompts = torch.randint(3, 96, (3, 24), generator=torch.Generator().manual_seed(2))
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(2, 4, 2))
    quiet = dict(show_progress=False, log=lambda m: None)
    whole = run_agreement(model, prompts, ["hadamard", "identity"], None, cfg, 12, **quiet)
    calls = []

    def save(state):
        calls.append(1)
        if len(calls) == 5:  # 3 continuations, then prompt 0 for both methods: stop there
            raise _Interrupt

    state = {}
    with pytest.raises(_Interrupt):
        run_agreement(model, prompts, ["hadamard", "identity"], None, cfg, 12, state=state, save=save, **quiet)
    assert len(state["continuations"]) == 3 and len(state["rows"]["hadamard"]) == len(state["rows"]["identity"]) == 1
    resumed = run_agreement(model, prompts, ["hadamard", "identity"], None, cfg, 12, state=state, **quiet)
    for m in whole:
        for k in ("mean_kl", "top1", "first_divergence", "kl_by_position"):
            assert resumed[m][k] == pytest.approx(whole[m][k], rel=1e-6, abs=1e-12)


def test_batches_give_the_per_prompt_results():
    """Decoding prompts together (continuations, streaming, free-running) changes nothing per prompt;
    on resume, with another batch size, only the missing work is done."""
    model = tiny_model("llama").double()
    prompts = torch.randint(3, 96, (3, 20), generator=torch.Generator().manual_seed(5))
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(2, 4, 2))
    quiet = dict(show_progress=False, log=lambda m: None)
    one = run_agreement(model, prompts, ["hadamard", "identity"], None, cfg, 10, **quiet)
    assert len(set(one["hadamard"]["first_divergence"])) > 1  # the prompts really differ in where they diverge
    state = {}
    two = run_agreement(model, prompts, ["hadamard"], None, cfg, 10, batch=2, state=state, **quiet)
    again = run_agreement(model, prompts, ["hadamard", "identity"], None, cfg, 10, batch=3, state=state, **quiet)
    assert again["hadamard"]["seconds"] == 0 and again["identity"]["seconds"] > 0
    for m in one:
        got = (two | {"identity": again["identity"]})[m]
        assert got["first_divergence"] == one[m]["first_divergence"]
        assert got["kl_by_position"] == pytest.approx(one[m]["kl_by_position"], rel=1e-6, abs=1e-12)
    # a state holding one prompt, resumed in batches of 2: prompts 1..2 are computed, nothing is lost
    part = {"continuations": state["continuations"], "rows": {"hadamard": state["rows"]["hadamard"][:1]}}
    res = run_agreement(model, prompts, ["hadamard"], None, cfg, 10, batch=2, state=part, **quiet)
    assert res["hadamard"]["first_divergence"] == one["hadamard"]["first_divergence"]
    with pytest.raises(ValueError, match="batch must be at least 1"):
        run_agreement(model, prompts, ["hadamard"], None, cfg, 10, batch=0, **quiet)


@torch.no_grad()
def test_batched_free_running_stops_when_every_row_diverged():
    from transformers import DynamicCache

    model = tiny_model("llama")
    p = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(6))
    y = greedy(model, p, 12, DynamicCache(config=model.config))
    ref = y.clone()
    ref[0, 2] = (ref[0, 2] + 1) % 96
    ref[1, 7] = (ref[1, 7] + 1) % 96
    got = greedy(model, p, 12, DynamicCache(config=model.config), reference=ref)
    assert got.shape == (2, 8) and torch.equal(got, y[:, :8])
    assert common_prefixes(got, ref) == [2, 7]
    with pytest.raises(ValueError, match="at least 12 tokens"):
        greedy(model, p, 12, DynamicCache(config=model.config), reference=ref[:, :5])


def test_a_resolved_name_runs_its_method_at_its_own_settings():
    """``auto`` in agree: the listed name runs the method it stands for at that method's settings (here Hadamard
    at 8 bits in a 2-bit run): its rows equal that method's own run at those settings, not the run's."""
    model = tiny_model("llama")
    prompts = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    w = WindowConfig(2, 4, 2)
    c2, c8 = QuantConfig(2, 2, "affine", windows=w), QuantConfig(8, 8, "affine", windows=w)
    quiet = dict(show_progress=False, log=lambda m: None, single_pass=True)
    state = {}
    res = run_agreement(model, prompts, ["hadamard", "auto"], None, c2, 12, state=state, resolved={"auto": ("hadamard", c8)}, **quiet)
    alone = run_agreement(model, prompts, ["hadamard"], None, c8, 12, **quiet)["hadamard"]
    assert res["auto"]["method"] == "hadamard" and "method" not in res["hadamard"]
    assert res["auto"]["kl_by_position"] == alone["kl_by_position"] and res["auto"]["mean_kl"] < res["hadamard"]["mean_kl"]
    assert set(state["rows"]) == {"hadamard", "auto"}  # rows kept under the listed name
