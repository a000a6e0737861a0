"""The method-name grammar is a spelling of MethodSpec: parse and canonical_name are inverse, suffix order is free."""

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wushkv.config import QuantConfig, WindowConfig
from wushkv.methods import AUTO, FULL_PRECISION, MethodSpec, StockCache, canonical_name, grammar_help, parse, spec_of
from wushkv.methods.spec import SUFFIX_ORDER, key_tile_windows
from wushkv.transforms import TRANSFORMS

SIDES = sorted(TRANSFORMS)
SUFFIXES = ["+rmean", "+tiles", "+ktiles", "+ldlq", "+ldlq-k", "+ldlq-v", "+signs1", "+signs2", "+signs13", "+cover4096", "+cover2"]


@st.composite
def names(draw):
    k = draw(st.sampled_from(SIDES))
    base = k if draw(st.booleans()) else f"{k}:{draw(st.sampled_from(SIDES))}"
    sufs = draw(st.lists(st.sampled_from(SUFFIXES), max_size=4))
    return base + "".join(sufs)


@settings(max_examples=400, deadline=None)
@given(names())
def test_parse_canonical_roundtrip(name):
    """For every name the grammar accepts, parse(canonical_name(parse(n))) == parse(n), and every ordering of its
    suffixes parses to the same spec and canonical name; a refused name is refused in every order, with a message."""
    base, *sufs = name.split("+")
    spellings = {base + "".join("+" + s for s in p) for p in itertools.permutations(sufs)}
    try:
        m = parse(name)
    except ValueError as e:
        assert str(e)
        for other in spellings:
            with pytest.raises(ValueError):
                parse(other)
        return
    c = canonical_name(m)
    assert parse(c) == m and canonical_name(c) == c and m.name == c
    for other in spellings:
        assert parse(other) == m and canonical_name(other) == c


def test_canonical_order_and_known_names():
    """The names used across the docs and results keep their meaning, and canonical names put suffixes in SUFFIX_ORDER."""
    assert SUFFIX_ORDER[0] == "+signsN" and SUFFIX_ORDER[-1] == "+ldlq-v"
    cases = {
        "wush": MethodSpec("wush"),
        "kvarn": MethodSpec("kvarn", key_layout="tiles", value_layout="tiles"),
        "wush+tiles": MethodSpec("wush", key_layout="tiles", value_layout="tiles"),
        "wush+ktiles+ldlq": MethodSpec("wush", key_layout="tiles", feedback="KV"),
        "wush+rmean+ktiles+ldlq": MethodSpec("wush", key_layout="tiles", feedback="KV", key_centering="rope-mean"),
        "wush:hadamard": MethodSpec("wush", "hadamard"),
        "wush+tiles+ldlq-k": MethodSpec("wush", key_layout="tiles", value_layout="tiles", feedback="K"),
        "kvarn+ldlq-k": MethodSpec("kvarn", key_layout="tiles", value_layout="tiles", feedback="K"),
        "wush-a+signs3+ldlq": MethodSpec("wush-a", feedback="KV", signs=3),
        "wush+cover4096+ktiles+ldlq": MethodSpec("wush", key_layout="tiles", feedback="KV", cover=4096),
        "hadamard+cover8192+ldlq-k": MethodSpec("hadamard", feedback="K", cover=8192),
    }
    for name, spec in cases.items():
        assert parse(name) == spec and canonical_name(spec) == name
    assert canonical_name("wush+ldlq+rmean") == canonical_name("wush+rmean+ldlq") == "wush+rmean+ldlq"
    assert canonical_name("kvarn+tiles") == "kvarn" and canonical_name("wush+signs01") == "wush+signs1"
    assert canonical_name("wush+ldlq+cover4096+signs2") == "wush+signs2+cover4096+ldlq"
    assert parse("full-precision") is FULL_PRECISION and parse("auto") is AUTO
    assert parse("stock-hqq-2") == StockCache("hqq", 2) and canonical_name(StockCache("quanto", 4)) == "stock-quanto-4"
    assert parse(MethodSpec("wush")) == MethodSpec("wush")  # a spec passes through


@pytest.mark.parametrize("bad, match", [
    ("", "non-empty"), ("nope", "unknown method"), ("wush:nope", "KEYS:VALUES"), ("wush+foo", "unknown method"),
    ("wush:", "unknown method"), ("+ldlq", "unknown method"), ("kvarn:wush", "cannot be one side"),
    ("wush+ldlq-k+ldlq-v", "use one of"), ("wush+tiles+ktiles", "cannot be combined"), ("kvarn+ktiles", "cannot be combined"),
    ("wush+tiles+ldlq", "tile values have no feedback"), ("hadamard+signs1", "has none"), ("wush+signs0", "numbered from 1"),
    ("wush+rmean+rmean", "given twice"), ("wush+", "unknown method"), ("wush-c+rmean", "exclusive"),
    ("hadamard-c:wush+rmean", "exclusive"), ("wush+cover1", "N a whole number >= 2"), ("wush+cover", "unknown method"),
    ("hadamard+cover4096", "this method reads none"), ("wush+cover8+cover16", r"'\+coverN' given twice"), ("stock-hqq-3", "stock-<backend>-<bits>"), ("stock-foo-2", "stock-<backend>-<bits>"),
])
def test_refused_names_say_why(bad, match):
    with pytest.raises(ValueError, match=match):
        parse(bad)


def test_spec_validation_and_spec_of():
    with pytest.raises(ValueError, match="unknown transform"):
        MethodSpec("nope")
    with pytest.raises(ValueError, match="values in KVarN's tiles need keys in tiles"):
        MethodSpec("wush", value_layout="tiles")
    with pytest.raises(ValueError, match="kvarn quantizes both sides in its tiles"):
        MethodSpec("kvarn")
    with pytest.raises(ValueError, match="feedback='X'"):
        MethodSpec("wush", feedback="X")
    with pytest.raises(ValueError, match="installs no wushkv transform"):
        spec_of("full-precision")
    with pytest.raises(ValueError, match="resolved per model"):
        spec_of("auto")
    assert "+ktiles" in grammar_help() and "KEYS:VALUES" in grammar_help()


def test_quant_config_of_a_method():
    """What each layout implies for the quantizer: tiles bring KVarN's quantizer and windows, key tiles keep the
    per-token quantizer for values under windows of the same average full-precision count, feedback needs per token."""
    base = QuantConfig(2, 2, "quest", clip_search=4, windows=WindowConfig(16, 128, 16))
    assert parse("wush").quant_config(base) == base
    t = parse("wush+tiles").quant_config(base)
    assert (t.quantizer, t.key_quantizer, t.clip_search, t.windows) == ("kvarn", None, 0, WindowConfig(128, 0, 128))
    k = parse("wush+ktiles").quant_config(base)
    assert (k.side_quantizer("key"), k.side_quantizer("value"), k.windows) == ("kvarn", "quest", WindowConfig(16, 72, 128))
    assert key_tile_windows(WindowConfig(64, 256, 8)) == WindowConfig(64, 196, 128)
    with pytest.raises(ValueError, match="per-token quantizer"):
        parse("wush+ldlq").quant_config(replace(base, quantizer="kivi", clip_search=0))
    with pytest.raises(ValueError, match="needs --quantizer quest or affine"):
        parse("wush+ktiles").quant_config(replace(base, quantizer="kivi", clip_search=0))


def test_spellings_of_one_method_run_identically(tiny_cal):
    """Every spelling of a method (suffixes in any order, or the MethodSpec itself) gives the same perplexity bit for
    bit on a tiny model: the run depends on the spec alone."""
    import torch
    from conftest import tiny_model

    from wushkv.eval.compare import quantized_perplexity

    model = tiny_model("llama").double()
    cal = tiny_cal(model)
    chunks = torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(0))
    base = QuantConfig(2, 2, "quest", windows=WindowConfig(4, 16, 4))
    spec = MethodSpec("wush", key_layout="tiles", feedback="KV", key_centering="rope-mean")
    ppl = {str(n): quantized_perplexity(model, chunks, cal, n, parse(n).quant_config(base), show_progress=False)["ppl"]
           for n in ("wush+rmean+ktiles+ldlq", "wush+ldlq+ktiles+rmean", spec)}
    assert len(set(ppl.values())) == 1, ppl
    plain = quantized_perplexity(model, chunks, cal, "wush", base, show_progress=False)["ppl"]
    assert plain != next(iter(ppl.values()))  # the suffixes do change the run


def test_names_in_the_docs():
    """docs/reference/methods.md's hand-written table: every name the docs use keeps the spec it is documented as, and
    is canonical (so results filed under it are found again)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "methods.md").read_text(encoding="utf-8")
    table = text[text.index("## Names in the docs"):]
    rows = re.findall(r"^\| `([^`]+)` \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|$", table, flags=re.M)
    assert len(rows) >= 30
    for name, k, v, kl, vl, fb, cen, signs in rows:
        want = MethodSpec(k, v, key_layout=kl, value_layout=vl, feedback="" if fb == "-" else fb, key_centering=cen,
                          signs=None if signs == "-" else int(signs))
        assert parse(name) == want and canonical_name(want) == name, name
