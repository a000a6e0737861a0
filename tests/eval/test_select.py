"""``wushkv select``: recipes, bytes, rules, gates, resuming, the choice in the calibration file, and that ``auto``
after a selection on a model no recipe was chosen for is no worse than the paper recipe on other text."""

import json
import math
import re
from dataclasses import replace

import pytest
import torch
from conftest import CharTokenizer, tiny_model

from wushkv.config import QuantConfig, WindowConfig
from wushkv.eval.compare import paired_difference, run_compare
from wushkv.eval.select import apply_rule, bits_per_element, run_selection, selection_record, selection_report
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
    over the kept per-chunk NLLs, with the paired difference against the paper recipe; a budget and a gate remove
    candidates and say why; a rerun resumes without evaluating anything again, and a new candidate is the only new
    evaluation; the record the calibration stores carries the setting and survives save and load."""
    from wushkv.calibration import Calibration

    model = tiny_model("llama")
    cal = tiny_cal(model)
    chunks = _chunks(HELD_OUT, 4)
    runs = tmp_path / "runs.json"
    cands = ["wush", "wush+ldlq", "wush+ktiles+ldlq@tc=1.7"]
    out = run_selection(model, chunks, cal, cands, [2, 3], BASE, json_path=runs, meta={"model": "tiny"}, **QUIET)
    saved = json.loads(runs.read_text())
    assert saved["fp"]["chunk_nll"] == out["fp"]["chunk_nll"] and len(out["fp"]["chunk_nll"]) == 4
    for b in (2, 3):
        evals = {n: out["results"][n][str(b)] for n in cands}
        assert all(len(e["chunk_nll"]) == 4 and math.isclose(e["nll"], sum(e["chunk_nll"]) / 4) for e in evals.values())
        pick = min(cands, key=lambda n: evals[n]["nll"])
        choice = out["choices"][str(b)]
        assert choice["recipe"] == pick and choice["why"].startswith("lowest mean held-out NLL of 3 candidates")
        if pick != "wush":
            assert choice["versus_paper"] == pytest.approx(list(paired_difference(evals[pick]["chunk_nll"], evals["wush"]["chunk_nll"])))
    report = selection_report(out, cands, [2, 3], "tiny", "held-out")
    assert "CHOSEN" in report and "bits/elem" in report
    # resuming: nothing is evaluated again (the stored numbers come back as they were)
    log = []
    again = run_selection(model, chunks, cal, cands, [2, 3], BASE, json_path=runs, meta={"model": "tiny"}, show_progress=False, log=log.append)
    assert again["results"] == out["results"] and not any("held-out PPL" in m for m in log) and any("resuming" in m for m in log)
    # a budget under the key tiles' bytes excludes them (and says so), a gate that fails the pick makes the rule pick again
    gate = FailFirst()
    kt = out["results"]["wush+ktiles+ldlq@tc=1.7"]["2"]["bits_per_element"]
    new = cands + ["wush+ldlq-v"]
    log = []
    third = run_selection(model, chunks, cal, new, [2], BASE, json_path=runs, budget=kt - 0.01, gates=[gate], meta={"model": "tiny"},
                          show_progress=False, log=log.append)
    assert [m for m in log if "held-out PPL" in m] and all("wush+ldlq-v " in m for m in log if "held-out PPL" in m)  # only the new one
    assert third["excluded"]["wush+ktiles+ldlq@tc=1.7"]["2"]["why"].startswith("over the budget")
    first, second = gate.calls  # the rule's pick among the rest, which failed, then its pick without it
    ranked = sorted((n for n in new if n != "wush+ktiles+ldlq@tc=1.7"), key=lambda n: third["results"][n]["2"]["nll"])
    assert [first, second] == ranked[:2] and third["choices"]["2"]["recipe"] == second
    assert f"removed by a gate: {first} (fake: {first} told to fail)" in third["choices"]["2"]["why"]
    assert third["gates"][f"fake/{first}/2"]["passed"] is False
    assert "excluded: over the budget" in selection_report(third, new, [2], "tiny", "held-out")
    # other settings are refused, not overwritten
    with pytest.raises(ValueError, match="other settings"):
        run_selection(model, _chunks(EVALUATION, 4), cal, cands, [2], BASE, json_path=runs, meta={"model": "tiny"}, **QUIET)
    # the record in the calibration: what auto reads
    cal.set_selection(selection_record(out, "held-out"))
    cal = Calibration.load(cal.save(tmp_path / "c.safetensors"), model)
    for b in (2, 3):
        got = resolve_auto("tiny", cal, QuantConfig(b, b, windows=WindowConfig(4, 16, 4)))
        assert got.record()["recipe"] == out["choices"][str(b)]["recipe"] and got.source == "calibration"


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
    argv = ["select", "--model", str(tmp_path / "m"), "--calibration", str(path), "--text-file", str(held), "--serve-len", "120",
            "--chunks", "2", "--bits", "2", "--candidates", "wush+ldlq-v,wush@va=1.3", "--sink", "4", "--keep", "16", "--flush", "4",
            "--plot", str(tmp_path / "s.png")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 bits:" in printed and "CHOSEN" in printed and "wrote the selection for 1 width(s)" in printed
    assert (tmp_path / "s.png").stat().st_size > 0 and len(list(tmp_path.glob("c.safetensors.select-*.json"))) == 1
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
        (["--gates", "needle"], "--gates 'needle': known gates are passkey"),
        (["--budget", "-1"], "--budget -1: bits per element"),
    ]:
        assert main(["select", "--calibration", str(tmp_path / "missing.safetensors"), *argv]) == 2
        assert message in capsys.readouterr().err
    assert main(["select", "--calibration", str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist; make one with `wushkv calibrate" in capsys.readouterr().err


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
    out = run_selection(model, _chunks(HELD_OUT, 4), cal, ["wush", "wush+ldlq"], [2], BASE, refine=True, **QUIET)
    names = list(out["results"])
    assert len(names) > 2 and all("@" in n for n in names[2:])  # the walk's recipes, named by their clips
    lowest = min(names, key=lambda n: out["results"][n]["2"]["nll"])
    assert out["choices"]["2"]["recipe"] == lowest
    assert set(names[2:]) <= set(_listed_names(out))


def _listed_names(out):
    from wushkv.eval.select import _listed

    return _listed(out, ["wush", "wush+ldlq"])
