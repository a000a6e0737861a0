"""What a cache reads of its settings (``wushkv.codecs.settings_read``, ``wushkv.methods.spec.settings_read``), held to
what the codecs and the methods actually do: a setting said to be read changes the codes, one said not to be read
changes nothing. The CLI refuses a flag no method reads on this word (tests/test_bad_inputs.py), so a wrong "not read"
would refuse a flag that works, and a wrong "read" would let a silently ignored one through."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from wushkv.codecs import make_codec, settings_read
from wushkv.config import QuantConfig, WindowConfig
from wushkv.methods.spec import parse
from wushkv.methods.spec import settings_read as method_reads

D, FLUSH = 16, 8
# one other valid value of each codec-level setting (windows are the layer's: tested by the methods below)
OTHER = {"k_clip": 0.5, "v_clip": 0.5, "k_alpha": 0.6, "v_alpha": 0.6, "clip_search": 32, "tile_clip": 0.3, "group_size": 8,
         "metadata_dtype": "bfloat16"}


def _x() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 4 * FLUSH, D, generator=g)
    return x * (1 + 8 * (torch.rand(x.shape, generator=g) > 0.9))  # outliers, so that every clip clips


def _stored(cfg: QuantConfig) -> list:
    """What the cache of ``cfg`` stores of one block of keys and of values."""
    out = []
    for side in ("key", "value"):
        codec = make_codec(cfg, side, D)
        out.append(None if codec is None else {k: (v.dtype, v.clone()) for k, v in codec.encode(_x()).items()})
    return out


def _same(a: list, b: list) -> bool:
    for sa, sb in zip(a, b):
        if (sa is None) != (sb is None):
            return False
        if sa is None:
            continue
        if sa.keys() != sb.keys() or any(sa[k][0] != sb[k][0] or not torch.equal(sa[k][1], sb[k][1]) for k in sa):
            return False
    return True


CONFIGS = [
    QuantConfig(quantizer=q, k_bits=kb, v_bits=vb, key_quantizer=kq, windows=WindowConfig(4, 8, FLUSH))
    for q, kq, (kb, vb) in itertools.product(("quest", "affine", "kivi", "kvarn"), (None, "kvarn"), ((2, 2), (8, 4), (None, 3), (3, None)))
    if not (kq == "kvarn" and (q == "kvarn" or kb is None))
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.label() for c in CONFIGS])
def test_a_setting_said_read_changes_the_codes_and_no_other_does(cfg):
    base, read = _stored(cfg), settings_read(cfg)
    for name, value in OTHER.items():
        try:
            other = replace(cfg, **{name: value})
        except ValueError:  # a setting this quantizer refuses (clip search under kvarn): refused, never ignored
            continue
        assert (name in read) == (not _same(base, _stored(other))), (name, sorted(read))


def test_what_each_quantizer_reads():
    assert {"k_alpha", "v_alpha"} <= settings_read(QuantConfig(quantizer="quest")) and "k_clip" not in settings_read(QuantConfig())
    affine = settings_read(QuantConfig(quantizer="affine", k_bits=2, v_bits=8))
    assert "k_clip" in affine and "v_clip" not in affine and "k_alpha" not in affine  # 8 bits: plain min-max
    assert settings_read(QuantConfig(quantizer="kvarn")) >= {"tile_clip", "S_flush"}
    assert settings_read(QuantConfig(k_bits=None, v_bits=None)) == {"k_bits", "v_bits"}  # full precision on both sides


def test_methods_read_less_what_they_set_themselves():
    base = QuantConfig(windows=WindowConfig(16, 128, 16))
    tiles = method_reads("wush+tiles", base)
    assert not tiles & {"S_sink", "S_keep", "S_flush", "quantizer", "clip_search"} and "tile_clip" in tiles
    ktiles = method_reads("wush+ktiles", base)
    assert {"S_sink", "S_keep", "S_flush", "quantizer", "tile_clip", "v_alpha"} <= ktiles and "k_alpha" not in ktiles
    assert method_reads("full-precision", base) == method_reads("stock-quanto-2", base) == frozenset()
    assert method_reads("auto", base) >= method_reads("wush", base) | ktiles | tiles  # whichever recipe it stands for
    assert method_reads("wush+ktiles", replace(base, quantizer="kivi")) == frozenset()  # refused by its own check


@pytest.mark.parametrize("name", ["wush+tiles", "kvarn", "wush+ktiles", "hadamard"])
def test_what_a_method_overrides_is_what_its_config_ignores(name):
    """Each setting in MethodSpec.overrides leaves the method's config as it was; each other one it keeps changes it."""
    m = parse(name)
    base = QuantConfig(quantizer="affine", windows=WindowConfig(16, 128, 16))
    others = {"quantizer": "quest", "key_quantizer": "affine", "clip_search": 3, "S_sink": 8, "S_keep": 64, "S_flush": 32}
    for field, value in others.items():
        changed = (replace(base, windows=replace(base.windows, **{field: value})) if field.startswith("S_")
                   else replace(base, **{field: value}))
        assert (field in m.overrides) == (m.quant_config(changed) == m.quant_config(base)), field
