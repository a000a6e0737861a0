"""``wushkv select``: recipes, bytes, rules, gates, resuming, the choice in the calibration file, and that ``auto``
after a selection on a model no recipe was chosen for is no worse than the paper recipe on other text."""

import hashlib
import json
import math
import re
from dataclasses import replace

import pytest
import torch
from conftest import CharTokenizer, hf_char_tokenizer, tiny_model

from wushkv.config import QuantConfig, WindowConfig
from wushkv.eval.compare import paired_difference, run_compare
from wushkv.eval.select import (AgreementGate, agreement_prompts, apply_rule, bits_per_element, run_selection, selection_record,
                                selection_report)
from wushkv.methods.auto import parse_recipe, resolve_auto

QUIET = {"show_progress": False, "log": lambda m: None}
BASE = QuantConfig(windows=WindowConfig(4, 16, 4))
HELD_OUT = "a lazy dog sleeps while the brown fox runs far away. " * 60
EVALUATION = "the quick brown fox jumps over the lazy dog, then rests. " * 60


def _chunks(text: str, n: int, length: int = 160) -> torch.Tensor:
    ids = CharTokenizer()(text, return_tensors="pt").input_ids[0]
    return ids[: n * length].view(n, length)


@pytest.mark.parametrize("text, name", [
    ("wush", "wush"), ("wush+ktiles+ldlq@tc=1.7", "wush+ktiles+ldlq@tc=1.7"), ("wush+ldlq@va=1.45@ka=1.15", "wush+ldlq@ka=1.15@va=1.45"),
    ("wush+ktiles+ldlq@tc=0", "wush+ktiles+ldlq"), (" wush+ldlq-v@ka=1.2 ", "wush+ldlq-v@ka=1.2"),
])
def test_recipe_names_round_trip(text, name):
    r = parse_recipe(text)
    assert r.name == name and parse_recipe(r.name) == r


@pytest.mark.parametrize("text, message", [
    ("auto", "not a transform method"), ("wush@kb=2", "unknown option 'kb=2'"), ("wush@ka", "unknown option 'ka'"),
    ("wush@ka=0", "ka='0' must be a finite number > 0"), ("wush@va=nan", "must be a finite number"),
    ("wush+ktiles@tc=-1", "tc='-1' must be a finite number >= 0"), ("wush+ldlq@tc=1.7", "wush+ldlq has none"),
    ("wush@ka=1.1@ka=1.2", "ka given twice"), ("wushh", "unknown method 'wushh'"),
])
def test_bad_recipes_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_recipe(text)


def test_bits_per_element_counts_codes_and_metadata():
    """QuEST stores one float16 step per token (b + 16/d bits), the affine quantizer a step and an offset (b + 32/d);
    key tiles store per-channel factors per tile of 128 tokens on top of the codes: more than b, less than b + 1."""
    d = 32
    for b in (2, 3, 4, 8):
        q = QuantConfig(b, b, windows=WindowConfig(4, 16, 4))
        assert bits_per_element(parse_recipe("wush"), q, d) == pytest.approx(b + 16 / d)
        assert bits_per_element(parse_recipe("wush+ldlq@ka=1.2"), q, d) == pytest.approx(b + 16 / d)  # same bytes
        a = QuantConfig(b, b, quantizer="affine", windows=WindowConfig(4, 16, 4))
        assert bits_per_element(parse_recipe("wush"), a, d) == pytest.approx(b + 32 / d)
        kt = bits_per_element(parse_recipe("wush+ktiles+ldlq@tc=1.7"), q, d)
        assert b + 16 / d / 2 < kt < b + 1  # values b + 16/d, keys b + their tile metadata
    assert bits_per_element(parse_recipe("wush"), QuantConfig(2, 2, group_size=8), d) == pytest.approx(2 + 16 / 8)


def test_rules():
    """``lowest`` takes the lowest mean; ``simplest`` keeps the first listed candidate unless another is lower on every
    chunk: a lower mean won on one chunk alone does not displace it."""
    ev = lambda *c: {"nll": sum(c) / len(c), "chunk_nll": list(c)}  # noqa: E731
    evals = {"wush": ev(1.0, 1.0, 1.0), "a": ev(0.7, 1.05, 1.01), "b": ev(0.99, 0.99, 0.99), "c": ev(0.98, 0.98, 1.2)}
    order = list(evals)
    assert apply_rule("lowest", order, evals) == "a"
    assert apply_rule("simplest", order, evals) == "b"  # a is not lower than wush everywhere, b is; c is not lower than b everywhere
    assert apply_rule("simplest", ["wush", "a", "c"], evals) == "wush"
    with pytest.raises(ValueError, match="unknown rule 'best'"):
        apply_rule("best", order, evals)
    # by the KL: the same rules over each evaluation's mean and per-chunk KL
    kl = {n: {"kl": e["nll"], "chunk_kl": e["chunk_nll"], "nll": -e["nll"], "chunk_nll": [-x for x in e["chunk_nll"]]}
          for n, e in evals.items()}
    assert apply_rule("lowest", order, kl, "kl") == "a" and apply_rule("simplest", order, kl, "kl") == "b"
    assert apply_rule("lowest", order, kl) == "c"  # the NLL, which these fake evaluations rank the other way
    with pytest.raises(ValueError, match="unknown metric 'ppl'"):
        apply_rule("lowest", order, kl, "ppl")


class FailFirst:
    """A gate that fails the first recipe it is shown, so that the rule must pick again."""

    name = "fake"

    def __init__(self):
        self.calls = []

    def __call__(self, recipe, cfg):
        self.calls.append(recipe.name)
        return {"passed": len(self.calls) > 1, "detail": f"{recipe.name} told to fail"}


def test_selection_chooses_keeps_every_evaluation_and_resumes(tiny_cal, tmp_path):
    """On a tiny model: full precision once and every (candidate, width) evaluated and kept; the choice is the rule's
    over the kept per-chunk KLs (the default metric), with the paired difference against the paper recipe; a budget and a gate remove
    candidates and say why; a rerun resumes without evaluating anything again, and a new candidate is the only new
    evaluation; the record the calibration stores carries the setting and survives save and load. (The file's own
    statistics only, ``cover="no"``: covered candidates have their own test.)"""
    from wushkv.calibration import Calibration

    model = tiny_model("llama")
    cal = tiny_cal(model)
    chunks = _chunks(HELD_OUT, 4)
    runs = tmp_path / "runs.json"
    cands = ["wush", "wush+ldlq", "wush+ktiles+ldlq@tc=1.7"]
    out = run_selection(model, chunks, cal, cands, [2, 3], BASE, cover="no", json_path=runs, meta={"model": "tiny"}, **QUIET)
    saved = json.loads(runs.read_text())
    assert saved["fp"]["chunk_nll"] == out["fp"]["chunk_nll"] and len(out["fp"]["chunk_nll"]) == 4
    for b in (2, 3):
        evals = {n: out["results"][n][str(b)] for n in cands}
        assert all(len(e["chunk_nll"]) == 4 and math.isclose(e["nll"], sum(e["chunk_nll"]) / 4) for e in evals.values())
        pick = min(cands, key=lambda n: evals[n]["kl"])  # the default metric
        choice = out["choices"][str(b)]
        assert choice["recipe"] == pick and choice["why"].startswith("lowest mean held-out KL to full precision of 3 candidates")
        if pick != "wush":
            assert choice["versus_paper"] == pytest.approx(list(paired_difference(evals[pick]["chunk_nll"], evals["wush"]["chunk_nll"])))
    report = selection_report(out, cands, [2, 3], "tiny", "held-out")
    assert "CHOSEN" in report and "bits/elem" in report
    # resuming: nothing is evaluated again (the stored numbers come back as they were)
    log = []
    again = run_selection(model, chunks, cal, cands, [2, 3], BASE, cover="no", json_path=runs, meta={"model": "tiny"}, show_progress=False, log=log.append)
    assert again["results"] == out["results"] and not any("held-out PPL" in m for m in log) and any("resuming" in m for m in log)
    # a budget under the key tiles' bytes excludes them (and says so), a gate that fails the pick makes the rule pick again
    gate = FailFirst()
    kt = out["results"]["wush+ktiles+ldlq@tc=1.7"]["2"]["bits_per_element"]
    new = cands + ["wush+ldlq-v"]
    log = []
    third = run_selection(model, chunks, cal, new, [2], BASE, cover="no", json_path=runs, budget=kt - 0.01, gates=[gate], meta={"model": "tiny"},
                          show_progress=False, log=log.append)
    assert [m for m in log if "held-out PPL" in m] and all("wush+ldlq-v " in m for m in log if "held-out PPL" in m)  # only the new one
    assert third["excluded"]["wush+ktiles+ldlq@tc=1.7"]["2"]["why"].startswith("over the budget")
    first, second = gate.calls  # the rule's pick among the rest, which failed, then its pick without it
    ranked = sorted((n for n in new if n != "wush+ktiles+ldlq@tc=1.7"), key=lambda n: third["results"][n]["2"]["kl"])
    assert [first, second] == ranked[:2] and third["choices"]["2"]["recipe"] == second
    assert f"removed by a gate: {first} (fake: {first} told to fail)" in third["choices"]["2"]["why"]
    assert third["gates"][f"fake/{first}/2"]["passed"] is False
    assert "excluded: over the budget" in selection_report(third, new, [2], "tiny", "held-out")
    # other settings are refused, not overwritten
    with pytest.raises(ValueError, match="other settings"):
        run_selection(model, _chunks(EVALUATION, 4), cal, cands, [2], BASE, cover="no", json_path=runs, meta={"model": "tiny"}, **QUIET)
    # the record in the calibration: what auto reads
    cal.set_selection(selection_record(out, "held-out"))
    cal = Calibration.load(cal.save(tmp_path / "c.safetensors"), model)
    for b in (2, 3):
        got = resolve_auto("tiny", cal, QuantConfig(b, b, windows=WindowConfig(4, 16, 4)))
        assert got.record()["recipe"] == out["choices"][str(b)]["recipe"] and got.source == "calibration"


def test_selection_by_kl_measures_both_chooses_again_for_free_and_upgrades_old_evaluations(tiny_cal, tmp_path):
    """Every evaluation holds the NLL and the KL to full precision per chunk; ``metric="kl"`` picks the lowest mean KL
    and says so; a resumed run by the NLL evaluates nothing and picks the lowest NLL; an evaluation stored before the KL
    was measured runs again when the KL is asked for (and only then); the record carries the metric."""
    model = tiny_model("llama")
    cal = tiny_cal(model)
    chunks = _chunks(HELD_OUT, 4)
    runs = tmp_path / "runs.json"
    cands = ["wush", "wush+ldlq", "wush+ktiles+ldlq@tc=1.7"]
    out = run_selection(model, chunks, cal, cands, [2], BASE, cover="no", json_path=runs, metric="kl", **QUIET)
    evals = {n: out["results"][n]["2"] for n in cands}
    assert all(len(e["chunk_kl"]) == 4 and e["kl"] > 0 and math.isclose(e["kl"], sum(e["chunk_kl"]) / 4) for e in evals.values())
    choice = out["choices"]["2"]
    assert choice["recipe"] == min(cands, key=lambda n: evals[n]["kl"]) and choice["kl"] == evals[choice["recipe"]]["kl"]
    assert choice["why"].startswith("lowest mean held-out KL to full precision of 3 candidates")
    assert selection_record(out, "held-out")["metric"] == "kl" and "KL to FP" in selection_report(out, cands, [2], "tiny", "held-out")
    log = []
    by_nll = run_selection(model, chunks, cal, cands, [2], BASE, cover="no", json_path=runs, metric="nll", show_progress=False, log=log.append)
    assert not any("held-out PPL" in m for m in log) and by_nll["results"] == out["results"]
    assert by_nll["choices"]["2"]["recipe"] == min(cands, key=lambda n: evals[n]["nll"])
    # a file from before the KL: its evaluations serve the NLL as they are, and run again for the KL
    saved = json.loads(runs.read_text())
    for e in saved["results"].values():
        for v in e.values():
            del v["kl"], v["chunk_kl"], v["kl_top"]
    del saved["sha256"]  # a hand edit, accepted as the message says
    runs.write_text(json.dumps(saved))
    log = []
    run_selection(model, chunks, cal, cands, [2], BASE, cover="no", json_path=runs, metric="nll", show_progress=False, log=log.append)
    assert not any("held-out PPL" in m for m in log)
    again = run_selection(model, chunks, cal, cands, [2], BASE, cover="no", json_path=runs, metric="kl", show_progress=False, log=log.append)
    assert sum("held-out PPL" in m for m in log) == 3 and again["choices"]["2"]["recipe"] == choice["recipe"]
    assert all(again["results"][n]["2"]["chunk_kl"] == pytest.approx(evals[n]["chunk_kl"]) for n in cands)  # deterministic
    # a KL against a reference of another size does not compare: it runs again too
    saved = json.loads(runs.read_text())
    saved["results"]["wush"]["2"]["kl_top"] = 16
    del saved["sha256"]
    runs.write_text(json.dumps(saved))
    log = []
    run_selection(model, chunks, cal, cands, [2], BASE, cover="no", json_path=runs, metric="kl", show_progress=False, log=log.append)
    assert [m.split()[0] for m in log if "held-out PPL" in m] == ["wush"]
    with pytest.raises(ValueError, match="--metric 'ppl': known metrics are nll, kl"):
        run_selection(model, chunks, cal, cands, [2], BASE, cover="no", metric="ppl", **QUIET)


def test_auto_after_selection_is_no_worse_than_the_paper_recipe_on_other_text(tiny_cal):
    """A tiny random model no recipe was chosen for: chosen on held-out text, evaluated on another text, ``auto`` is
    never worse than the paper recipe by more than the paired interval, and better at 2 bits."""
    model = tiny_model("llama")
    cal = tiny_cal(model)
    sel = run_selection(model, _chunks(HELD_OUT, 4), cal, ["wush", "wush+ldlq", "wush+ktiles+ldlq@tc=1.7"], [2, 3], BASE, **QUIET)
    cal.set_selection(selection_record(sel, "held-out"))
    ev = run_compare(model, None, _chunks(EVALUATION, 6), cal, ["auto", "wush"], [2, 3], BASE, meta={"model": "tiny"}, **QUIET)
    for b in (2, 3):
        d, lo, hi = paired_difference(ev["results"]["auto"][str(b)]["chunk_nll"], ev["results"]["wush"][str(b)]["chunk_nll"])
        assert lo <= 0, f"{b} bits: auto ({ev['results']['auto'][str(b)]['method']}) worse than wush beyond the interval: {d:+.3f}% ({lo:+.3f} … {hi:+.3f})"
    assert sel["choices"]["2"]["recipe"] != "wush"
    assert ev["results"]["auto"]["2"]["ppl"] < ev["results"]["wush"]["2"]["ppl"]


def test_selection_chooses_the_statistics_too_when_serving_past_the_calibration(tiny_cal, tmp_path):
    """Held-out chunks longer than the calibration's sequences: every candidate is also evaluated on statistics
    covered to the served length (``+cover{serve_len}`` right after it), the rule chooses among all of them, and
    ``auto`` then runs exactly what was evaluated (the same per-chunk NLLs on the same chunks). ``cover="no"``, or
    chunks no longer than the calibration's sequences, evaluate the file's statistics only; a run with ``cover="no"``
    resumes from the same file without evaluating anything again."""
    model = tiny_model("llama")
    cal = tiny_cal(model)  # 3 x 64 tokens
    long = _chunks(HELD_OUT, 3, 192)
    runs = tmp_path / "runs.json"
    cands = ["wush", "wush+ldlq"]
    said = []
    out = run_selection(model, long, cal, cands, [2], BASE, json_path=runs, show_progress=False, log=said.append)
    assert any(m.startswith("plus 2 candidates: the same on statistics covered to 192 positions") for m in said)
    assert out["order"] == ["wush", "wush+cover192", "wush+ldlq", "wush+cover192+ldlq"]
    evals = {n: out["results"][n]["2"] for n in out["order"]}
    assert out["choices"]["2"]["recipe"] == min(out["order"], key=lambda n: evals[n]["kl"])
    assert evals["wush+cover192"]["chunk_nll"] != evals["wush"]["chunk_nll"]  # other statistics, other transforms
    report = selection_report(out, cands, [2], "tiny", "held-out")
    assert [line.split()[0] for line in report.splitlines() if line.startswith("wush")] == out["order"]  # covered after its own
    log = []
    none = run_selection(model, long, cal, cands, [2], BASE, json_path=runs, cover="no", show_progress=False, log=log.append)
    assert none["order"] == ["wush", "wush+ldlq"] and not any("held-out PPL" in m for m in log)
    short = run_selection(model, _chunks(HELD_OUT, 3, 64), cal, cands, [2], BASE, **QUIET)
    assert short["order"] == ["wush", "wush+ldlq"]
    with pytest.raises(ValueError, match="--cover 'yes': known: auto, no"):
        run_selection(model, long, cal, cands, [2], BASE, cover="yes", **QUIET)
    # the choice travels in the calibration, and `auto` runs it, covering included
    cal.set_selection(selection_record(out, "held-out"))
    cfg = replace(BASE, k_bits=2, v_bits=2)
    r = resolve_auto("tiny", cal, cfg)
    assert r.record()["recipe"] == out["choices"]["2"]["recipe"]
    for pick in ("wush+cover192+ldlq", "wush+cover192"):  # whichever the rule picked, each covered one runs as evaluated
        cal.set_selection(selection_record(out, "held-out") | {"choices": {"2": {"recipe": pick}}})
        ev = run_compare(model, None, long, cal, ["auto"], [2], BASE, meta={"model": "tiny"}, **QUIET)
        assert ev["results"]["auto"]["2"]["method"] == pick and ev["results"]["auto"]["2"]["chunk_nll"] == evals[pick]["chunk_nll"]


def test_select_command_writes_the_choice_into_the_calibration(tmp_path, capsys):
    """`wushkv select` on a saved tiny model: the report, the plot, the evaluations file beside the calibration, the
    choice in the calibration file (format version 2), which `compare --transforms auto` then runs and names; a
    version-1 file still loads (no selection) and `calibration upgrade` writes it in version 2 with its statistics."""
    import safetensors
    from test_cli import _tiny_model_dir

    from wushkv.calibration import FORMAT_VERSION, Calibration
    from wushkv.cli import main
    from wushkv.io import write_checked_safetensors

    _, text, cal = _tiny_model_dir(tmp_path, repeats=20, max_position_embeddings=None)
    path = cal.save(tmp_path / "c.safetensors")
    held = tmp_path / "held.txt"
    held.write_text(HELD_OUT)
    argv = ["select", "--model", str(tmp_path / "m"), "--calibration", str(path), "--text-file", str(held), "--serve-len", "120", "--cover", "no",
            "--chunks", "2", "--bits", "2", "--candidates", "wush+ldlq-v,wush@va=1.3", "--sink", "4", "--keep", "16", "--flush", "4",
            "--plot", str(tmp_path / "s.png"), "--gates", "agreement", "--agreement-prompts", "2", "--agreement-prompt-len", "32",
            "--agreement-new-tokens", "24"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 bits:" in printed and "CHOSEN" in printed and "wrote the selection for 1 width(s)" in printed
    assert (tmp_path / "s.png").stat().st_size > 0 and len(list(tmp_path.glob("c.safetensors.select-*.json"))) == 1
    # the agreement gate ran with the flags' settings on the held-out tokens right after the two scored chunks
    (runs,) = tmp_path.glob("c.safetensors.select-*.json")
    saved = json.loads(runs.read_text())
    got = saved["settings"]["gate_settings"]["agreement"]
    assert {k: got[k] for k in ("prompts", "prompt_len", "new_tokens", "margin")} == {"prompts": 2, "prompt_len": 32, "new_tokens": 24,
                                                                                      "margin": 1.0}
    prompt_ids = hf_char_tokenizer()(HELD_OUT, return_tensors="pt").input_ids[0][240 : 240 + 64]  # the model dir's tokenizer
    assert got["prompt_sha256"] == hashlib.sha256(prompt_ids.view(2, 32).numpy().tobytes()).hexdigest()
    picked = saved["choices"]["2"]["recipe"]
    assert saved["gates"][f"agreement/{picked}/2"]["passed"]
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata()["format_version"] == str(FORMAT_VERSION) == "2"
    cal2 = Calibration.load(path)
    (rec,) = cal2.selections
    assert rec["serve_len"] == 120 and rec["chunks"] == 2 and rec["text"] == str(held) and set(rec["choices"]) == {"2"}
    assert all(torch.equal(a[k], b[k]) for a, b in zip(cal.stats, cal2.stats) for k in a)  # the statistics are untouched
    chosen = rec["choices"]["2"]["recipe"]
    assert chosen in ("wush", "wush+ldlq-v", "wush@va=1.3")
    assert main(["compare", "--model", str(tmp_path / "m"), "--calibration", str(path), "--transforms", "auto", "--bits", "2",
                 "--text-file", str(text), "--seq-len", "120", "--chunks", "1", "--sink", "4", "--keep", "16", "--flush", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"auto: 2-bit {parse_recipe(chosen).method.name}" in printed and f"selected by `wushkv select` on {held}" in printed
    # a version-1 file (no selections in its header) loads; upgrade writes the current version, statistics kept
    with safetensors.safe_open(path, "pt") as f:
        header = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    header = {k: v for k, v in header.items() if k not in ("selections", "sha256")} | {"format_version": "1"}
    old = tmp_path / "old.safetensors"
    write_checked_safetensors(old, tensors, header)
    assert Calibration.load(old).selections == []
    assert main(["calibration", "upgrade", "--calibration", str(old), "--out", str(tmp_path / "new.safetensors")]) == 0
    with safetensors.safe_open(tmp_path / "new.safetensors", "pt") as f:
        assert f.metadata()["format_version"] == "2"
    new = Calibration.load(tmp_path / "new.safetensors")
    assert all(torch.equal(a[k], b[k]) for a, b in zip(cal.stats, new.stats) for k in a)


def test_select_refuses_bad_settings(tmp_path, capsys):
    from wushkv.cli import main

    for argv, message in [
        (["--candidates", "wush,bogus"], "unknown method 'bogus'"),
        (["--candidates", " , "], "--candidates is empty"),
        (["--candidates", "wush@tc=2"], "wush has none"),
        (["--gates", "needle"], "--gates 'needle': known gates are passkey, agreement"),
        (["--gates", "agreement", "--agreement-margin", "-1"], "--agreement-margin -1: percentage points"),
        (["--gates", "agreement,passkey,agreement"], "--gates 'agreement,passkey,agreement' lists a gate twice"),
        (["--agreement-margin", "nan"], "--agreement-margin nan: percentage points of top-1 agreement"),
        (["--agreement-margin", "101"], "a number from 0 to 100 (default 1)"),
        (["--agreement-new-tokens", "0"], "--agreement-new-tokens 0: give a whole number >= 1 (default 512)"),
        (["--agreement-prompts", "0"], "--agreement-prompts 0: give a whole number >= 1 (default 4)"),
        (["--agreement-prompt-len", "1"], "--agreement-prompt-len 1: give a whole number >= 2 (default 512)"),
        (["--budget", "-1"], "--budget -1: bits per element"),
    ]:
        assert main(["select", "--calibration", str(tmp_path / "missing.safetensors"), *argv]) == 2
        assert message in capsys.readouterr().err
    assert main(["select", "--calibration", str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist; make one with `wushkv calibrate" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's own refusal of a choice it does not offer
        main(["select", "--calibration", str(tmp_path / "missing.safetensors"), "--cover", "yes"])
    assert "argument --cover: invalid choice: 'yes'" in capsys.readouterr().err


def test_refine_walks_the_clips_of_the_pick(tiny_cal):
    """``refine``: the pick's clip options are walked downhill (tile clip for key tiles, else the QuEST key clip; then
    the value clip), every visited recipe is evaluated and kept, and ``lowest`` chooses among them too."""
    from wushkv.eval.select import refine_options

    q = QuantConfig(2, 2, windows=WindowConfig(4, 16, 4))
    assert refine_options(parse_recipe("wush+ldlq"), q) == ["ka", "va"]
    assert refine_options(parse_recipe("wush+ktiles+ldlq@tc=1.7"), q) == ["tc", "va"]
    assert refine_options(parse_recipe("wush"), replace(q, quantizer="affine")) == []
    assert refine_options(parse_recipe("wush+ktiles"), replace(q, quantizer="affine")) == ["tc"]
    model = tiny_model("llama")
    cal = tiny_cal(model)
    out = run_selection(model, _chunks(HELD_OUT, 4), cal, ["wush", "wush+ldlq"], [2], BASE, refine=True, cover="no", **QUIET)
    names = list(out["results"])
    assert len(names) > 2 and all("@" in n for n in names[2:])  # the walk's recipes, named by their clips
    lowest = min(names, key=lambda n: out["results"][n]["2"]["kl"])
    assert out["choices"]["2"]["recipe"] == lowest
    assert set(names[2:]) <= set(_listed_names(out))


def _listed_names(out):
    from wushkv.eval.select import _listed

    return _listed(out, ["wush", "wush+ldlq"])


# A clip far inside every key and value's range: almost every entry saturates, the cache no longer holds what the
# model wrote, and greedy generation through it leaves full precision's text at once. The same bytes as `wush`.
BROKEN = "wush@ka=0.1@va=0.1"


def _gate(model, cal, new_tokens=32, margin=1.0, prompt_len=48):
    """An agreement gate on 2 prompts from the held-out text past 4 scored chunks of 160 tokens."""
    return AgreementGate(model, cal, agreement_prompts(CharTokenizer(), HELD_OUT, 4 * 160, 2, prompt_len), new_tokens=new_tokens,
                         margin=margin)


def test_agreement_gate_measures_what_agree_measures_and_removes_a_broken_cache(tiny_cal):
    """The agreement gate's prompts are the held-out tokens right after the scored chunks; its numbers are
    ``run_agreement``'s for the recipe at its own clips and width, on full precision's continuations computed once;
    the paper recipe passes its own gate, a cache whose clips saturate it fails with its numbers in the detail, and the
    margin is the rule: points of top-1 below the paper recipe's."""
    from wushkv.eval.agreement import run_agreement

    ids = CharTokenizer()(HELD_OUT, return_tensors="pt").input_ids[0]
    prompts = agreement_prompts(CharTokenizer(), HELD_OUT, 640, 2, 48)
    assert torch.equal(prompts.flatten(), ids[640 : 640 + 96]) and torch.equal(_chunks(HELD_OUT, 4).flatten(), ids[:640])
    with pytest.raises(ValueError, match="tokens past the 640 the selection scores, fewer than the agreement gate's 200 prompts"):
        agreement_prompts(CharTokenizer(), HELD_OUT, 640, 200, 48)
    model = tiny_model("llama")
    cal = tiny_cal(model)
    gate = _gate(model, cal)
    cfg = replace(BASE, k_bits=2, v_bits=2)
    ok = gate(parse_recipe("wush"), cfg)
    conts = [list(c) for c in gate.continuations]
    bad = gate(parse_recipe(BROKEN), cfg)
    assert gate.continuations == conts and len(conts) == 2 and all(len(c) == 32 for c in conts)  # computed once, reused
    # the same numbers from `agree`'s function, run independently: the recipe at its clip, not the method's default
    state = {}
    ref = run_agreement(model, gate.prompts, ["wush", "broken"], cal, cfg, 32, single_pass=True, batch=2, state=state,
                        resolved={"broken": ("wush", replace(cfg, k_alpha=0.1 * cfg.k_alpha, v_alpha=0.1 * cfg.v_alpha))}, **QUIET)
    assert state["continuations"] == conts
    assert ok["top1"] == ok["reference_top1"] == ref["wush"]["top1"] and ok["passed"]
    assert bad["top1"] == ref["broken"]["top1"] and bad["mean_kl"] == ref["broken"]["mean_kl"]
    assert bad["reference_top1"] == ok["top1"] and 100 * bad["top1"] < 100 * ok["top1"] - 20 and not bad["passed"]
    assert bad["detail"].startswith(f"top-1 agreement with full precision {100 * bad['top1']:.2f}% against wush's {100 * ok['top1']:.2f}% "
                                    "(allowed 1 points below) over 2 x 32 generated tokens after 48-token prompts")
    # the margin decides: one wide enough to hold the broken cache's loss passes it
    wide = _gate(model, cal, margin=100 * (ok["top1"] - bad["top1"]) + 0.01)(parse_recipe(BROKEN), cfg)
    assert wide["passed"] and wide["top1"] == bad["top1"]
    with pytest.raises(ValueError, match="--agreement-margin -1: percentage points of top-1 agreement a candidate may lose"):
        _gate(model, cal, margin=-1.0)


def test_selection_agreement_gate_removes_the_pick_reports_it_and_resumes_only_with_its_settings(tiny_cal, tmp_path):
    """In a selection: the 2-bit picks of this tiny model (error feedback, key tiles) agree with full precision over 128
    generated tokens more than the default 1 point less often than the paper recipe does; the gate removes each, the report and the choice name the gate and
    its numbers, the choice is the first the rule reaches that passes; a rerun with the same gate settings reruns
    nothing, one with another margin is refused, and a gate added to a resumed file runs. (By the NLL, under which this
    tiny model ranks the gated recipes first.)"""
    long = {"new_tokens": 128, "prompt_len": 64}
    model = tiny_model("llama")
    cal = tiny_cal(model)
    chunks = _chunks(HELD_OUT, 4)
    runs = tmp_path / "runs.json"
    cands = ["wush", "wush+ldlq", "wush+ktiles+ldlq@tc=1.7"]
    log = []
    out = run_selection(model, chunks, cal, cands, [2], BASE, gates=[_gate(model, cal, **long)], json_path=runs, metric="nll",
                        meta={"model": "tiny"}, show_progress=False, log=log.append)
    gates = out["gates"]
    removed = [n for n in cands if f"agreement/{n}/2" in gates and not gates[f"agreement/{n}/2"]["passed"]]
    assert removed and "wush" not in removed  # the paper recipe passes its own gate
    choice = out["choices"]["2"]
    assert gates[f"agreement/{choice['recipe']}/2"]["passed"]
    ranked = sorted(cands, key=lambda n: out["results"][n]["2"]["nll"])
    assert ranked[: ranked.index(choice["recipe"])] == removed  # every candidate the rule preferred was removed, in order
    for n in removed:
        g = gates[f"agreement/{n}/2"]
        assert 100 * g["top1"] < 100 * g["reference_top1"] and g["reference"] == "wush"
        assert f"{n} (agreement: {g['detail']})" in choice["why"]
        assert any(m.startswith(f"2-bit {n}: agreement gate FAILED: top-1 agreement") for m in log)
    report = selection_report(out, cands, [2], "tiny", "held-out")
    assert all(f"removed by gate agreement: {gates[f'agreement/{n}/2']['detail']}" in report for n in removed)
    saved = json.loads(runs.read_text())
    assert saved["settings"]["gate_settings"]["agreement"]["margin"] == 1.0 and saved["gates"] == gates
    assert selection_record(out, "held-out")["gate_settings"]["agreement"]["new_tokens"] == 128
    # the same settings: nothing runs again, the same choice
    log = []
    again = run_selection(model, chunks, cal, cands, [2], BASE, gates=[_gate(model, cal, **long)], json_path=runs, metric="nll",
                          meta={"model": "tiny"}, show_progress=False, log=log.append)
    assert again["choices"] == out["choices"] and not any(": agreement gate" in m for m in log)
    # another margin: the stored gate results do not hold for it
    with pytest.raises(ValueError, match=r"holds agreement gate results of other settings \(differing: margin\)"):
        run_selection(model, chunks, cal, cands, [2], BASE, gates=[_gate(model, cal, **long, margin=2.0)], json_path=runs,
                      meta={"model": "tiny"}, **QUIET)
    # dropping the gate keeps its settings with its results; adding another gate is free
    fake = FailFirst()
    run_selection(model, chunks, cal, cands, [2], BASE, gates=[fake], json_path=runs, meta={"model": "tiny"}, **QUIET)
    assert fake.calls and json.loads(runs.read_text())["settings"]["gate_settings"]["agreement"]["margin"] == 1.0
