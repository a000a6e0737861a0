"""Passkey prompts: deterministic, exact length, needle at the asked depth; answers parsed; scoring."""

import re

import pytest
import torch

from wushkv.config import QuantConfig, WindowConfig
from wushkv.eval.passkey import answer_key, passkey_prompt, run_passkey, trial_seed

from conftest import CharTokenizer, tiny_model


def test_prompt_is_deterministic_and_exact():
    tok = CharTokenizer()
    a, ka = passkey_prompt(tok, 600, 0.5, trial_seed(0, 600, 0.5, 0))
    b, kb = passkey_prompt(tok, 600, 0.5, trial_seed(0, 600, 0.5, 0))
    c, kc = passkey_prompt(tok, 600, 0.5, trial_seed(0, 600, 0.5, 1))
    assert torch.equal(a, b) and ka == kb and a.shape == (1, 600)
    assert not torch.equal(a, c) and 10000 <= kc <= 99999
    assert a[0, 0] == tok.bos_token_id


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_depth(depth):
    from wushkv.eval.passkey import INTRO, NEEDLE, QUESTION, _encode

    tok = CharTokenizer()
    ids, key = passkey_prompt(tok, 1000, depth, 7)
    ids = ids[0].tolist()
    needle = _encode(tok, NEEDLE.format(key=key))
    starts = [i for i in range(len(ids) - len(needle) + 1) if ids[i : i + len(needle)] == needle]
    assert len(starts) == 1
    head = 1 + len(_encode(tok, INTRO))
    n_fill = 1000 - head - len(needle) - len(_encode(tok, QUESTION))
    assert (starts[0] - head) == round(depth * n_fill)
    assert ids[-len(_encode(tok, QUESTION)) :] == _encode(tok, QUESTION)


def test_answers_and_errors():
    assert answer_key(" 71432. Remember") == 71432 and answer_key(" unknown") is None
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(CharTokenizer(), 100, 0.5, 0)
    with pytest.raises(ValueError, match="depth must be in"):
        passkey_prompt(CharTokenizer(), 600, 1.5, 0)


def test_scoring_counts_every_case():
    model = tiny_model("llama")
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(4, 16, 4))
    res = run_passkey(model, CharTokenizer(), ["full-precision", "hadamard"], None, cfg, [300], [0.2, 0.8], 2,
                      new_tokens=3, show_progress=False, log=lambda m: None)
    for r in res.values():
        assert set(r["accuracy"]) == {"300/0.2", "300/0.8"}
        assert all(v in (0.0, 0.5, 1.0) for v in r["accuracy"].values())  # 2 trials per cell


class _Answering(CharTokenizer):
    """A tokenizer whose ``decode`` answers with the key of the prompt it last encoded (the needle and the scored answer
    both spell it), when ``answers(key)`` says so, else with another number: hits forced where the test wants them,
    through run_passkey's own tokenizer argument."""

    def __init__(self, answers):
        super().__init__()
        self.answers, self.key = answers, None

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        if m := re.search(r"\d{5}", text):
            self.key = int(m.group())
        return super().__call__(text, return_tensors, add_special_tokens)

    def decode(self, ids, skip_special_tokens=False) -> str:
        return f" {self.key if self.answers(self.key) else self.key + 1} is the key"


def test_scoring_counts_forced_hits_per_cell():
    """A hit is scored as a hit, and a cell's accuracy is the share of its trials that hit: every key answered gives
    1.0, none gives 0.0, and answering only odd keys gives, in each cell, the share of odd keys its prompts hold."""
    model = tiny_model("llama")
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(4, 16, 4))
    quiet = dict(new_tokens=2, show_progress=False, log=lambda m: None)
    contexts, depths, trials = [300], [0.2, 0.8], 3
    for answers, want in ((lambda k: True, 1.0), (lambda k: False, 0.0)):
        res = run_passkey(model, _Answering(answers), ["full-precision"], None, cfg, contexts, depths, trials, **quiet)
        assert set(res["full-precision"]["accuracy"].values()) == {want} and res["full-precision"]["mean"] == want
    odd = run_passkey(model, _Answering(lambda k: k % 2 == 1), ["full-precision"], None, cfg, contexts, depths, trials, **quiet)
    for d in depths:
        keys = [passkey_prompt(CharTokenizer(), 300, d, trial_seed(0, 300, d, t))[1] for t in range(trials)]
        assert odd["full-precision"]["accuracy"][f"300/{d}"] == pytest.approx(sum(k % 2 for k in keys) / trials)


def test_a_resolved_name_runs_its_method_at_its_own_settings():
    """``auto`` in passkey: the listed name runs the method it stands for at that method's settings."""
    model = tiny_model("llama")
    w = WindowConfig(4, 16, 4)
    c2, c8 = QuantConfig(2, 2, "affine", windows=w), QuantConfig(8, 8, "affine", windows=w)
    quiet = dict(new_tokens=3, show_progress=False, log=lambda m: None)
    res = run_passkey(model, CharTokenizer(), ["hadamard", "auto"], None, c2, [300], [0.5], 2, resolved={"auto": ("hadamard", c8)}, **quiet)
    alone = run_passkey(model, CharTokenizer(), ["hadamard"], None, c8, [300], [0.5], 2, **quiet)["hadamard"]
    assert res["auto"]["method"] == "hadamard" and res["auto"]["logprob"] == alone["logprob"]
    assert res["auto"]["logprob"] != res["hadamard"]["logprob"]


def test_interrupted_passkey_resumes_to_the_same_result():
    model = tiny_model("llama")
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(4, 16, 4))
    args = (model, CharTokenizer(), ["full-precision", "hadamard"], None, cfg, [340, 300], [0.2, 0.8], 2)
    quiet = dict(new_tokens=3, show_progress=False, log=lambda m: None)
    whole = run_passkey(*args, **quiet)
    seen = []

    def save(state):
        seen.append(sum(len(v) for v in state.values()))
        if len(seen) == 6:
            raise KeyboardInterrupt

    state = {}
    with pytest.raises(KeyboardInterrupt):
        run_passkey(*args, state=state, save=save, **quiet)
    # shortest context first, every method at it before the next: 4 fp + 2 hadamard cases at 300
    assert set(state["full-precision"]) == {f"300/{d:g}/{t}" for d in (0.2, 0.8) for t in (0, 1)}
    assert len(state["hadamard"]) == 2
    resumed = run_passkey(*args, state=state, **quiet)
    assert {m: r["accuracy"] for m, r in resumed.items()} == {m: r["accuracy"] for m, r in whole.items()}
    assert all(r["seconds"] == 0 for r in run_passkey(*args, state=state, **quiet).values())  # nothing left to run


@pytest.mark.parametrize("method", ["full-precision", "hadamard"])
def test_answer_logprob_is_teacher_forced_and_leaves_generation_alone(method):
    """log P(answer) from the copied cache equals a plain teacher-forced pass over prompt + answer
    (for the quantized cache: its exact single-pass emulation); the greedy answer is what
    generation alone gives, so the copy did not disturb the cache."""
    from transformers import DynamicCache

    from wushkv.eval.agreement import greedy
    from wushkv.methods.install import method_cache
    from wushkv.eval.passkey import answer_and_logprob, key_tokens

    model, tok = tiny_model("llama"), CharTokenizer()
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(4, 16, 4))
    ids, key = passkey_prompt(tok, 300, 0.5, trial_seed(0, 300, 0.5, 0))
    answer = key_tokens(tok, key)
    assert tok.decode(answer) == f" {key}"
    with method_cache(model, None, method, cfg) as make, torch.no_grad():
        gen, lp = answer_and_logprob(model, ids, answer, 5, make)
        full = torch.cat([ids, torch.tensor([answer])], 1)
        logits = model(full, cache=make(), use_cache=True).logits[0, ids.shape[1] - 1 : -1]
        ref = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(answer)[:, None]).sum().item()
        assert lp == pytest.approx(ref, abs=1e-3)
        assert lp < 0
        assert torch.equal(gen, greedy(model, ids, 5, make()))

        class Uncopyable(DynamicCache):
            def __deepcopy__(self, memo):
                raise TypeError("no copies")

        if method == "full-precision":  # a cache that cannot be copied: the prompt is prefilled again
            gen2, lp2 = answer_and_logprob(model, ids, answer, 5, lambda: Uncopyable(config=model.config))
            assert torch.equal(gen2, gen) and lp2 == pytest.approx(lp, abs=1e-6)


def test_cases_from_older_files_stay_done():
    """A state written before log-probabilities (bare hits) is not run again: its cells keep their
    accuracy and report no log-probability; new cases get both."""
    model = tiny_model("llama")
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(4, 16, 4))
    args = (model, CharTokenizer(), ["hadamard"], None, cfg, [300], [0.5], 2)
    quiet = dict(new_tokens=3, show_progress=False, log=lambda m: None)
    state = {}
    fresh = run_passkey(*args, state=state, **quiet)
    assert set(fresh["hadamard"]["logprob"]) == {"300/0.5"} and fresh["hadamard"]["logprob_mean"] < 0
    old = {"hadamard": {k: v["hit"] for k, v in state["hadamard"].items()}}
    again = run_passkey(*args, state=old, **quiet)
    assert again["hadamard"]["seconds"] == 0 and again["hadamard"]["accuracy"] == fresh["hadamard"]["accuracy"]
    assert again["hadamard"]["logprob"] == {}
    more = run_passkey(model, CharTokenizer(), ["hadamard"], None, cfg, [300], [0.5, 0.9], 2, state=old, **quiet)
    assert set(more["hadamard"]["logprob"]) == {"300/0.9"} and set(more["hadamard"]["accuracy"]) == {"300/0.5", "300/0.9"}


def test_key_tokens_follow_the_question():
    from wushkv.eval.passkey import QUESTION, _encode, key_tokens

    tok = CharTokenizer()
    assert _encode(tok, QUESTION) + key_tokens(tok, 12345) == _encode(tok, QUESTION + " 12345")
