"""Clip tables: the downhill grid walk, the per-(method, width) search, the file and its use in compare."""

import json
import math
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model

from wushkv.config import CLIP_GRID, QuantConfig, WindowConfig
from wushkv.eval.clips import ClipTable, check_tunable, line_search, tune_clips
from wushkv.eval.compare import quantized_perplexity, run_compare


def _counted(f):
    calls = []

    def g(x):
        calls.append(x)
        return f(x)

    return g, calls


@pytest.mark.parametrize("target", [0.7, 0.85, 1.0, 1.15, 1.3, 1.6, 0.2, 5.0])
def test_line_search_reaches_the_minimum_of_a_unimodal_function_walking_from_one(target):
    f, calls = _counted(lambda a: (a - target) ** 2)
    best = line_search(f, CLIP_GRID)
    assert best == min(CLIP_GRID, key=lambda a: (a - target) ** 2)
    assert calls[0] == 1.0
    # it walks: only the points between 1 and the minimum, plus one step past it on each side tried
    lo, hi = min(best, 1.0), max(best, 1.0)
    inside = [a for a in CLIP_GRID if lo <= a <= hi]
    assert set(inside) <= set(calls) and len(calls) <= len(inside) + 2


def test_line_search_stops_at_the_first_local_minimum_and_checks_its_grid():
    values = {0.7: 0.0, 0.85: 3.0, 1.0: 2.0, 1.15: 1.0, 1.3: 1.5, 1.45: 5.0, 1.6: 6.0}
    assert line_search(values.__getitem__, CLIP_GRID) == 1.15  # uphill from 1 first; 0.7 is never reached
    with pytest.raises(ValueError, match="must contain the starting multiplier 1.0"):
        line_search(lambda a: a, [0.8, 1.2])
    with pytest.raises(ValueError, match="repeated"):
        line_search(lambda a: a, [1.0, 1.0, 1.2])


def _base():
    return QuantConfig(k_bits=2, v_bits=2, quantizer="quest", windows=WindowConfig(4, 16, 4))


def test_search_per_method_and_width_against_a_brute_force_minimum(tmp_path):
    """With a separable bowl as the 'perplexity', the coordinate search finds each (method, width)'s own
    minimum, α_b's value is recorded beside it, and the chosen value is never above α_b's."""
    targets = {("hadamard", 2): (1.0, 1.0), ("hadamard", 3): (0.85, 1.0), ("wush", 2): (1.3, 1.15), ("wush", 3): (1.0, 1.45)}
    seen = []

    def evaluate(method, cfg):
        seen.append((method, cfg.k_bits, cfg.v_bits, cfg.k_alpha, cfg.v_alpha))
        tk, tv = targets[method, cfg.k_bits]
        return {"ppl": 10 + (cfg.k_alpha - tk) ** 2 + 0.5 * (cfg.v_alpha - tv) ** 2}

    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "clips.json"
    table = tune_clips(model, chunks, None, ["hadamard", "wush"], [2, 3], _base(), path=path, show_progress=False,
                       log=lambda m: None, evaluate=evaluate)
    for (m, b), (tk, tv) in targets.items():
        assert table.alphas(m, b) == (tk, tv)
        e = table.clips[m][str(b)]
        assert e["ppl"] == pytest.approx(10.0) and e["ppl"] <= e["ppl_alpha_b"]
        trials = table.data["trials"][m][str(b)]
        assert len({(t["k_alpha"], t["v_alpha"]) for t in trials}) == len(trials)  # no point run twice
    assert all(k == v for _, k, v, _, _ in seen)  # K = V width
    # the file is the table; a second run over the same settings runs nothing
    again = tune_clips(model, chunks, None, ["hadamard", "wush"], [2, 3], _base(), path=path, show_progress=False,
                       log=lambda m: None, evaluate=lambda *a: pytest.fail("resumed search evaluated again"))
    assert again.clips == table.clips
    assert ClipTable.load(path, model).clips == table.clips
    # other settings are refused, the file left as it was
    before = path.read_text()
    with pytest.raises(ValueError, match="other settings \\(differing: grid\\)"):
        tune_clips(model, chunks, None, ["wush"], [2], _base(), grid=(0.5, 1.0, 2.0), path=path, show_progress=False,
                   log=lambda m: None, evaluate=evaluate)
    assert path.read_text() == before


def test_search_refuses_what_it_cannot_tune():
    with pytest.raises(ValueError, match="clip multipliers are QuEST's"):
        check_tunable(["wush"], replace(_base(), quantizer="affine"))
    with pytest.raises(ValueError, match="kvarn.*KVarN's tiles"):
        check_tunable(["hadamard", "kvarn"], _base())
    with pytest.raises(ValueError, match="starts from α_b"):
        check_tunable(["wush"], replace(_base(), k_alpha=1.15))
    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="NaN or inf"):
        tune_clips(model, chunks, None, ["hadamard"], [2], _base(), show_progress=False, log=lambda m: None,
                   evaluate=lambda m, c: {"ppl": float("nan")})


def test_table_file_is_validated(tmp_path):
    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "clips.json"
    tune_clips(model, chunks, None, ["hadamard"], [2], _base(), grid=(1.0, 1.15), sides=("keys",), path=path,
               show_progress=False, log=lambda m: None, evaluate=lambda m, c: {"ppl": 5 - c.k_alpha, "chunk_nll": [1.0, c.k_alpha]})
    assert ClipTable.load(path).alphas("hadamard", 2) == (1.15, 1.0)  # values left at α_b: sides=keys
    assert [t["chunk_nll"] for t in json.loads(path.read_text())["trials"]["hadamard"]["2"]] == [[1.0, 1.0], [1.0, 1.15]]
    with pytest.raises(FileNotFoundError, match="does not exist.*tune-clip"):
        ClipTable.load(tmp_path / "none.json")
    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="tuned on model 'llama'.*not on this one"):
        ClipTable.load(path, other)
    data = json.loads(path.read_text())
    data.pop("sha256")  # hand edits: a file without its checksum is read as it is
    for mutate, message in [(lambda d: d.update(format="x"), "not a wushkv clip table"),
                            (lambda d: d.update(version=9), "version 9"),
                            (lambda d: d.pop("settings"), "no 'clips' and 'settings' mappings"),
                            (lambda d: d["clips"]["hadamard"]["2"].update(k_alpha=float("nan")), "finite number > 0"),
                            (lambda d: d["clips"]["hadamard"].update({"5": {"k_alpha": 1, "v_alpha": 1}}), "widths are 2, 3, 4, 8")]:
        d = json.loads(json.dumps(data))
        mutate(d)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(d))
        with pytest.raises(ValueError, match=message):
            ClipTable.load(bad)


def test_apply_takes_each_sides_width_and_leaves_other_quantizers():
    t = ClipTable({"clips": {"wush": {"2": {"k_alpha": 1.3, "v_alpha": 1.15}, "4": {"k_alpha": 0.85, "v_alpha": 1.0}}}})
    c = t.apply("wush", replace(_base(), k_bits=4, v_bits=2))
    assert (c.k_alpha, c.v_alpha) == (0.85, 1.15)
    c = t.apply("wush", replace(_base(), k_bits=3, v_bits=2))
    assert (c.k_alpha, c.v_alpha) == (1.0, 1.15)  # no 3-bit entry: the base clip
    assert t.apply("hadamard", _base()) == _base()
    aff = replace(_base(), quantizer="affine")
    assert t.apply("wush", aff) == aff


def test_a_table_entry_is_found_under_any_spelling_of_its_method():
    """compare looks methods up by their canonical name; a table written before names were canonical holds them as
    typed: the entry is found under either spelling, and not under another method's."""
    t = ClipTable({"clips": {"wush+ldlq+rmean": {"2": {"k_alpha": 1.3, "v_alpha": 1.15}}, "bogus+name": {"2": {}}}})
    assert t.alphas("wush+rmean+ldlq", 2) == t.alphas("wush+ldlq+rmean", 2) == (1.3, 1.15)
    assert t.covers("wush+rmean+ldlq", 2) and not t.covers("wush+ldlq", 2) and not t.covers("wush+rmean+ldlq", 3)


@torch.no_grad()
def test_compare_runs_each_method_at_its_own_clips(tmp_path):
    """run_compare with a table gives each method exactly the perplexity of a run at its table clips."""
    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(2))
    base = _base()
    table = ClipTable({"settings": {"text": "t", "chunks": 1, "grid": [1.0]},
                       "clips": {"hadamard": {"2": {"k_alpha": 1.45, "v_alpha": 0.7}}}})
    out = run_compare(model, None, chunks, None, ["hadamard", "identity"], [2], base, show_progress=False, log=lambda m: None,
                      clips=table)
    want = quantized_perplexity(model, chunks, None, "hadamard", replace(base, k_alpha=1.45, v_alpha=0.7), show_progress=False)
    plain = quantized_perplexity(model, chunks, None, "hadamard", base, show_progress=False)
    r = out["results"]["hadamard"]["2"]
    assert r["ppl"] == pytest.approx(want["ppl"], rel=1e-9) and not math.isclose(r["ppl"], plain["ppl"], rel_tol=1e-6)
    assert (r["config"]["k_alpha"], r["config"]["v_alpha"]) == (1.45, 0.7)
    assert out["results"]["identity"]["2"]["config"]["k_alpha"] == 1.0  # not in the table: α_b
    assert out["settings"]["clips"]["clips_sha256"] == table.sha256()


def test_paired_rule_moves_only_on_a_gain_every_chunk_agrees_on():
    """Two clips that differ in mean NLL but not consistently over chunks: ``lower`` moves, ``paired`` stays
    at α_b; a gain on every chunk moves both."""
    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(0))

    def make(per_chunk):
        def evaluate(method, cfg):
            nll = per_chunk(cfg.k_alpha)
            return {"ppl": math.exp(sum(nll) / len(nll)), "chunk_nll": nll}
        return evaluate

    noisy = make(lambda a: [2.0, 2.0, 2.0, 2.0] if a == 1.0 else [1.5, 2.4, 1.6, 2.3] if a == 1.15 else [3.0] * 4)
    steady = make(lambda a: [2.0, 2.1, 2.2, 2.3] if a == 1.0 else [1.9, 2.0, 2.1, 2.2] if a == 1.15 else [3.0] * 4)
    kw = dict(grid=(0.85, 1.0, 1.15, 1.3), sides=("keys",), show_progress=False, log=lambda m: None)
    assert tune_clips(model, chunks, None, ["hadamard"], [2], _base(), evaluate=noisy, **kw).alphas("hadamard", 2) == (1.15, 1.0)
    t = tune_clips(model, chunks, None, ["hadamard"], [2], _base(), evaluate=noisy, rule="paired", **kw)
    assert t.alphas("hadamard", 2) == (1.0, 1.0) and t.describe()["rule"] == "paired"
    assert tune_clips(model, chunks, None, ["hadamard"], [2], _base(), evaluate=steady, rule="paired", **kw).alphas("hadamard", 2) == (1.15, 1.0)
    with pytest.raises(ValueError, match="rule 'bogus'"):
        tune_clips(model, chunks, None, ["hadamard"], [2], _base(), evaluate=steady, rule="bogus", **kw)
    with pytest.raises(ValueError, match="per-chunk NLLs"):
        tune_clips(model, chunks, None, ["hadamard"], [2], _base(), evaluate=lambda m, c: {"ppl": 2.0}, rule="paired", **kw)


def test_key_tile_methods_tune_their_values_only():
    """A ``+ktiles`` method's keys sit in KVarN's tiles (no α_K): the search refuses to walk them and tunes α_V."""
    model = tiny_model("llama")
    chunks = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(0))
    quiet = dict(show_progress=False, log=lambda m: None, evaluate=lambda m, c: {"ppl": 5 - c.v_alpha})
    with pytest.raises(ValueError, match=r"\['hadamard\+ktiles'\] keep their keys in KVarN's tiles.*--sides values"):
        tune_clips(model, chunks, None, ["hadamard", "hadamard+ktiles"], [2], _base(), grid=(1.0, 1.15), **quiet)
    table = tune_clips(model, chunks, None, ["hadamard+ktiles"], [2], _base(), grid=(1.0, 1.15), sides=("values",), **quiet)
    assert table.alphas("hadamard+ktiles", 2) == (1.0, 1.15)
