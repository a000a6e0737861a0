"""The lm-evaluation-harness adapter on local tasks built here (the hub is unreachable)."""

from __future__ import annotations

import json
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from wushkv.cache import WushKVCache  # noqa: E402
from wushkv.config import QuantConfig, WindowConfig  # noqa: E402
from wushkv.folding import apply_transforms  # noqa: E402
from wushkv.lm_eval import WushLM  # noqa: E402
from wushkv.transforms import build_transforms  # noqa: E402

from conftest import hf_char_tokenizer, tiny_model  # noqa: E402

@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_model("llama", vocab_size=128, max_position_embeddings=1024), hf_char_tokenizer()


WINDOWS = dict(sink=4, keep=8, flush=4)  # small, so short task prompts really get quantized tokens


def write_tasks(tmp_path):
    """A multiple-choice task and a generate_until task over a local JSON-lines file."""
    rows = [
        {"context": "the cat sat on the " * 4, "choices": ["mat", "hat", "bat"], "label": 0, "answer": "mat"},
        {"context": "one two three four " * 5, "choices": ["five", "six"], "label": 0, "answer": "five"},
        {"context": "abc abc abc abc abc ", "choices": ["abc", "xyz", "abd"], "label": 0, "answer": "abc"},
        {"context": "red green blue " * 6, "choices": ["red", "blue"], "label": 0, "answer": "red"},
    ]
    data = tmp_path / "toy.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{context}}}}"
"""
    (tmp_path / "mc.yaml").write_text(
        "task: wushkv_toy_mc\n" + common
        + 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        + "metric_list:\n  - metric: acc\n"
    )
    (tmp_path / "gen.yaml").write_text(
        "task: wushkv_toy_gen\n" + common
        + 'output_type: generate_until\ndoc_to_target: "{{answer}}"\n'
        + "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        + "metric_list:\n  - metric: exact_match\n"
    )
    return TaskManager(include_path=str(tmp_path))


def run(lm, tm, task):
    res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, log_samples=True, bootstrap_iters=0,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return res["samples"][task]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_full_precision_equals_hflm(model_and_tok, tmp_path):
    model, tok = model_and_tok
    tm = write_tasks(tmp_path)
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=2)
    ours = WushLM(model, method="full-precision", tokenizer=tok, batch_size=2)
    for task in ("wushkv_toy_mc", "wushkv_toy_gen"):
        a, b = run(ref, tm, task), run(ours, tm, task)
        assert [s["resps"] for s in a] == [s["resps"] for s in b]  # bit-identical log-likelihoods and generations


def reference_logprob(model, tok, context: str, cont: str, cfg) -> float:
    """Slow reference: one forward through a fresh WushKVCache, sum of the continuation's log-probs.

    Split as lm-eval splits a request: trailing spaces of the context belong to the continuation."""
    n = len(context) - len(context.rstrip())
    if n:
        context, cont = context[:-n], context[-n:] + cont
    ctx = tok(context, add_special_tokens=False).input_ids
    whole = tok(context + cont, add_special_tokens=False).input_ids
    ids = torch.tensor([whole])
    with torch.no_grad():
        logits = model(ids, cache=WushKVCache(model, cfg), use_cache=True).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[t - 1, whole[t]] for t in range(len(ctx), len(whole))))


def test_loglikelihood_sees_the_quantized_cache(model_and_tok):
    model, tok = model_and_tok
    cfg = QuantConfig(2, 2, "quest", windows=WindowConfig(4, 8, 4))
    reqs = [("the cat sat on the " * 4, " mat"), ("red green blue " * 6, " red"), ("abc abc abc ", "abc")]
    instances = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)]
    lm = WushLM(model, method="hadamard", tokenizer=tok, batch_size=3, k_bits=2, v_bits=2, **WINDOWS)
    try:
        got = [ll for ll, _ in lm.loglikelihood(instances)]
        fp = [ll for ll, _ in HFLM(pretrained=model, tokenizer=tok, batch_size=3).loglikelihood(instances)]
        # the reference runs on the same (transformed) model, one request at a time, unpadded
        want = [reference_logprob(model, tok, c, x, cfg) for c, x in reqs]
    finally:
        lm.close()
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-4, abs_tol=1e-4)
    assert max(abs(g - f) for g, f in zip(got, fp)) > 1e-3  # quantization is really seen


def test_generation_decodes_through_the_cache(model_and_tok, tmp_path):
    model, tok = model_and_tok
    tm = write_tasks(tmp_path)
    cfg = QuantConfig(2, 2, "quest", windows=WindowConfig(4, 8, 4))
    lm = WushLM(model, method="hadamard", tokenizer=tok, batch_size=4, **WINDOWS)
    try:
        samples = run(lm, tm, "wushkv_toy_gen")
        assert isinstance(lm.new_cache(), WushKVCache)
    finally:
        lm.close()
    # reference: greedy, one prompt at a time, through the cache on the transformed model
    trs = [build_transforms("hadamard", 2, 32) for _ in range(3)]
    with apply_transforms(model, trs, "hadamard"):
        for s in samples:
            ids = tok(s["doc"]["context"], return_tensors="pt").input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 cache=WushKVCache(model, cfg), pad_token_id=0)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
            assert s["resps"][0][0] == text


def test_close_restores_the_model(model_and_tok):
    model, tok = model_and_tok
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lm = WushLM(model, method="hadamard", tokenizer=tok)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # values folded
    lm.close()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tile_settings_reach_the_cache(model_and_tok):
    """``tile_clip`` and the key-tile windows reach the cache's config (they used to be dropped: tile clip 0)."""
    model, tok = model_and_tok
    lm = WushLM(model, method="hadamard+ktiles", tokenizer=tok, tile_clip=1.5, **WINDOWS)
    try:
        c = lm.quant_config
        assert (c.side_quantizer("key"), c.side_quantizer("value"), c.tile_clip, c.windows.S_flush) == ("kvarn", "quest", 1.5, 128)
    finally:
        lm.close()
    lm = WushLM(model, method="hadamard", tokenizer=tok, key_quantizer="kvarn", **WINDOWS)  # by hand: keys in tiles of --flush
    try:
        assert (lm.quant_config.side_quantizer("key"), lm.quant_config.side_quantizer("value")) == ("kvarn", "quest")
    finally:
        lm.close()


def test_bad_inputs(model_and_tok):
    model, tok = model_and_tok
    with pytest.raises(ValueError, match="unknown method"):
        WushLM(model, method="nope", tokenizer=tok)
    with pytest.raises(ValueError, match="stock QuantizedCache"):
        WushLM(model, method="stock-hqq-2", tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        WushLM(model, method="hadamard")
    with pytest.raises(ValueError, match="needs a calibration"):
        WushLM(model, method="wush", tokenizer=tok)
    with pytest.raises(ValueError, match="k_bits=5"):
        WushLM(model, method="hadamard", tokenizer=tok, k_bits=5)
    # a setting the method does not read is refused, before anything loads (the CLI checks its flags too; lm-eval's
    # own `--model_args method=hadamard,k_clip=0.9` reaches WushLM alone)
    with pytest.raises(ValueError, match=r"k_clip=0.9 changes nothing here: .*affine.*\(hadamard at K2V2 quest 16/128/16\)"):
        WushLM(object(), method="hadamard", k_clip=0.9)
    with pytest.raises(ValueError, match=r"flush=32 changes nothing here: .*kvarn at K2V2 kvarn 128/0/128"):
        WushLM(object(), method="kvarn", flush=32)
    with pytest.raises(ValueError, match=r"k_bits=4: method='full-precision' quantizes nothing"):
        WushLM(object(), method="full-precision", k_bits=4)


def test_cli(model_and_tok, tmp_path, capsys):
    from wushkv.cli import main

    model, tok = model_and_tok
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    write_tasks(tmp_path)
    out = tmp_path / "res.json"
    rc = main(["lm-eval", "--model", str(tmp_path / "m"), "--tasks", "wushkv_toy_mc", "--include-path", str(tmp_path),
               "--transform", "hadamard", "--sink", "4", "--keep", "8", "--flush", "4", "--batch-size", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["method"] == "hadamard" and res["quantization"]["windows"] == {"S_sink": 4, "S_keep": 8, "S_flush": 4}
    assert 0.0 <= res["results"]["wushkv_toy_mc"]["acc,none"] <= 1.0
    assert "wushkv_toy_mc" in capsys.readouterr().out
    assert main(["lm-eval", "--model", str(tmp_path / "m"), "--tasks", "x", "--transform", "nope"]) == 2


def test_wushlm_takes_every_quantizer_setting_the_cli_has():
    """`wushkv lm-eval` hands each quantizer flag to WushLM by name: a setting WushLM lacks would be dropped (as
    --metadata-dtype was before session 61), and the CLI refuses only settings no method reads."""
    import inspect

    from wushkv.cli.common import quant_fields
    from wushkv.lm_eval import WushLM

    params = inspect.signature(WushLM.__init__).parameters
    assert {f.name for f in quant_fields()} <= set(params), sorted({f.name for f in quant_fields()} - set(params))
    assert {"sink", "keep", "flush"} <= set(params)
