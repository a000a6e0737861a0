"""The tool subcommands (``wushkv calibration upgrade``, ``wushkv data heldout``, ``wushkv merge ...``) on tiny inputs."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from wushkv.calibration import Calibration, calibration_documents, calibration_sequences, pre_rope_key_mean
from wushkv.cli.tools import register

from conftest import TINY_CALIBRATION_TEXT, CharTokenizer, tiny_model


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="wushkv")
    register(p.add_subparsers(dest="command"))
    return p.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse(argv)
    return args.func(args)


# -- calibration upgrade --------------------------------------------------------------------------------------------
def test_upgrade_adds_rope_mean_and_keeps_transforms(tmp_path):
    """An old file (no mu_K_pre) gains the pre-RoPE key mean of its own first sequences; every stored statistic and
    solved transform stays bit for bit, and the meta records where the mean came from."""
    from wushkv.calibration import calibrate
    from wushkv.tools.upgrade import upgrade_file

    model = tiny_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TINY_CALIBRATION_TEXT)
    cal = calibrate(model, CharTokenizer(), samples=3, seq_len=64, text_file=str(text), methods=("wush", "oscar"), show_progress=False)
    for st in cal.stats:  # as a file written before mu_K_pre was collected
        del st["mu_K_pre"]
    old = cal.save(tmp_path / "old.safetensors")
    out = upgrade_file(old, tmp_path / "new.safetensors", seqs=2, text_file=str(text), model=model,
                       tokenizer=CharTokenizer(), show_progress=False)

    before, after = Calibration.load(old, model), Calibration.load(out, model)
    assert "mu_K_pre" not in before.stats[0]
    for a, b in zip(before.stats, after.stats):
        assert set(b) == set(a) | {"mu_K_pre"}
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert set(after.solved) == set(before.solved) and after.solved
    for m in before.solved:
        for a, b in zip(before.solved[m], after.solved[m]):
            ta, tb = a.tensors(), b.tensors()
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    seqs = calibration_sequences(CharTokenizer(), 2, int(before.meta["seq_len"]), text_file=str(text))
    with torch.no_grad():
        ref = pre_rope_key_mean(model, seqs, show_progress=False)
    spec_shape = before.stats[0]["mu_K"].shape
    for st, mu in zip(after.stats, ref):
        assert st["mu_K_pre"].shape == spec_shape and st["mu_K_pre"].dtype == torch.float64
        assert torch.equal(st["mu_K_pre"], mu)
    assert after.meta["mu_K_pre"] == {"sequences": 2, "seq_len": 64, "text_file": str(text)}
    assert {k: v for k, v in after.meta.items() if k != "mu_K_pre"} == before.meta
    assert calibration_documents(after.meta) is None  # read a text file, not C4


def test_upgrade_refuses_to_overwrite_its_input(tmp_path):
    path = str(tmp_path / "c.safetensors")
    args = parse(["calibration", "upgrade", "--calibration", path, "--out", str(tmp_path / "." / "c.safetensors")])
    assert (args.seqs, args.text_file) == (4, None)
    with pytest.raises(ValueError, match="--out must differ from --calibration"):
        args.func(args)


# -- calibration cover ----------------------------------------------------------------------------------------------
def test_cover_writes_the_statistics_of_the_served_positions(tmp_path):
    """The covered file holds what ``cover_positions`` gives (statistics averaged over the offsets, ``positions``
    recorded, transforms solved again, so WUSH's keys change), the original is kept; a length the calibration already
    covers, and writing over the input, are refused."""
    from wushkv.calibration import calibrate, cover_positions
    from wushkv.models import describe, rope_parameters
    from wushkv.tools.cover import cover_file

    model = tiny_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TINY_CALIBRATION_TEXT)
    cal = calibrate(model, CharTokenizer(), samples=3, seq_len=64, text_file=str(text), show_progress=False)
    src = cal.save(tmp_path / "c.safetensors")
    out = cover_file(src, tmp_path / "c-256.safetensors", 256, model=model)
    got, before = Calibration.load(out, model), Calibration.load(src, model)
    spec = describe(model)
    want = cover_positions(before, [rope_parameters(model, l, spec) for l in range(spec.num_layers)], 256)
    assert got.meta["positions"] == 256 and {k: v for k, v in got.meta.items() if k != "positions"} == before.meta
    for a, b in zip(want.stats, got.stats):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(got.stats[0]["M_K"], before.stats[0]["M_K"])
    tk_before = before.transforms("wush")[0].T_K
    assert not torch.allclose(got.transforms("wush")[0].T_K.abs(), tk_before.abs())  # solved from the new statistics
    assert torch.equal(Calibration.load(src, model).stats[0]["M_K"], before.stats[0]["M_K"])  # the original is kept
    with pytest.raises(ValueError, match=r"--serve-len 64: .*longer than the calibration's sequences \(64 tokens\)"):
        cover_file(src, tmp_path / "x.safetensors", 64, model=model)
    args = parse(["calibration", "cover", "--calibration", str(src), "--serve-len", "256", "--out", str(src)])
    with pytest.raises(ValueError, match="--out must differ from --calibration"):
        args.func(args)


def _saved_and_covered(model, tmp_path, serve_len: int = 256):
    """A 3 x 64-token calibration of ``model`` saved as ``c.safetensors``, and that file covered to ``serve_len``
    (``wushkv calibration cover``), loaded."""
    from wushkv.calibration import calibrate
    from wushkv.tools.cover import cover_file

    text = tmp_path / "calib.txt"
    text.write_text(TINY_CALIBRATION_TEXT)
    cal = calibrate(model, CharTokenizer(), samples=3, seq_len=64, text_file=str(text), show_progress=False)
    src = cal.save(tmp_path / "c.safetensors")
    return src, Calibration.load(cover_file(src, tmp_path / f"c-{serve_len}.safetensors", serve_len, model=model), model)


def test_a_methods_cover_suffix_is_the_covered_file(tmp_path):
    """``+coverN`` covers in memory what ``calibration cover`` writes: the transforms of ``wush+cover256+ldlq`` on the
    file as calibrated equal ``wush+ldlq``'s on the file covered to 256 (matrices and feedback, bit for bit), and on that
    covered file ``+cover256`` changes nothing; one copy is covered per length; a length the sequences already hold, or
    another length on a covered file, is refused with what to do, and ``auto`` skips such a recorded choice, saying why."""
    from wushkv.calibration import calibrate
    from wushkv.config import QuantConfig
    from wushkv.methods.auto import resolve_auto, selection_setting
    from wushkv.methods.install import covered_calibration, transforms_for

    model = tiny_model("llama")
    src, covered = _saved_and_covered(model, tmp_path)
    cal = Calibration.load(src, model)
    want = transforms_for(model, covered, "wush+ldlq")
    for got in (transforms_for(model, cal, "wush+cover256+ldlq"), transforms_for(model, covered, "wush+cover256+ldlq")):
        for a, b in zip(got, want, strict=True):
            assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("T_K", "T_K_inv", "T_V", "T_V_inv", "F_K", "F_V"))
    plain = transforms_for(model, cal, "wush+ldlq")
    assert not torch.allclose(plain[0].T_K.abs(), want[0].T_K.abs())  # covering changed the key transform
    assert torch.equal(plain[0].T_V, want[0].T_V)  # and not the value side: value statistics do not turn with RoPE
    assert covered_calibration(model, cal, 256) is covered_calibration(model, cal, 256)
    with pytest.raises(ValueError, match=r"\+cover64: the calibration's sequences already hold 64 positions"):
        transforms_for(model, cal, "wush+cover64")
    with pytest.raises(ValueError, match=r"\+cover512: this calibration's statistics are already covered to 256 positions"):
        transforms_for(model, covered, "wush+cover512")
    # a selection made on the file as calibrated travels with `calibration cover`; its covered choice cannot run there
    covered.set_selection({"setting": selection_setting(QuantConfig()),
                           "choices": {"2": {"recipe": "wush+cover128+ldlq"}}})
    r = resolve_auto(None, covered, QuantConfig(2, 2))
    assert r.method.name == "wush" and "calibration selection wush+cover128+ldlq not run: +cover128: this calibration's statistics are " \
        "already covered to 256 positions" in r.why


def test_selection_on_a_covered_file_chooses_for_it_alone(tmp_path):
    """The documented remedy for serving past the calibration's length: cover the file, then select on it at the
    served length. The selection runs on the covered statistics (its evaluations differ from the original file's),
    its evaluations file is refused for the original (another calibration recipe), the choice and the ``positions``
    are both kept in the covered file, and ``auto`` there resolves to the choice, the original's ``auto`` staying the
    paper recipe; the centered (``+rmean``) candidates run on a covered file too (it keeps the pre-RoPE mean)."""
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.eval.select import run_selection, selection_record
    from wushkv.methods.auto import resolve_auto

    model = tiny_model("llama")
    src, covered = _saved_and_covered(model, tmp_path)
    assert all("mu_K_pre" in st for st in covered.stats)
    ids = CharTokenizer()("a lazy dog sleeps while the brown fox runs far away. " * 30, return_tensors="pt").input_ids[0]
    chunks = ids[: 2 * 256].view(2, 256)  # served length 256, four times the calibration's
    base = QuantConfig(windows=WindowConfig(4, 16, 4))
    cands = ["wush", "wush+ldlq", "wush+rmean"]
    quiet = {"show_progress": False, "log": lambda m: None}
    runs = tmp_path / "runs.json"
    got = run_selection(model, chunks, covered, cands, [2], base, json_path=runs, meta={"model": "tiny"}, **quiet)
    assert set(got["results"]) == set(cands) and not got["excluded"]
    assert got["settings"]["calibration"]["positions"] == 256 and got["settings"]["serve_len"] == 256
    plain = run_selection(model, chunks, Calibration.load(src, model), cands, [2], base, meta={"model": "tiny"}, **quiet)
    assert got["results"]["wush"]["2"]["chunk_nll"] != plain["results"]["wush"]["2"]["chunk_nll"]  # other statistics
    with pytest.raises(ValueError, match="other settings"):  # the covered file's evaluations are not the original's
        run_selection(model, chunks, Calibration.load(src, model), cands, [2], base, json_path=runs, meta={"model": "tiny"}, **quiet)
    covered.set_selection(selection_record(got, "held-out"))
    again = Calibration.load(covered.save(tmp_path / "c-256-sel.safetensors"), model)
    assert again.meta["positions"] == 256
    res = resolve_auto("tiny", again, QuantConfig(2, 2, windows=WindowConfig(4, 16, 4)))
    assert res.source == "calibration" and res.record()["recipe"] == got["choices"]["2"]["recipe"]
    assert resolve_auto("tiny", Calibration.load(src, model), QuantConfig(2, 2, windows=WindowConfig(4, 16, 4))).source == "paper"


def test_group_without_subcommand_prints_help(capsys):
    assert run(["merge"]) == 2
    assert "compare" in capsys.readouterr().err


# -- data heldout ---------------------------------------------------------------------------------------------------
def test_heldout_c4_writes_the_requested_documents(tmp_path, capsys):
    from wushkv.data import c4_documents

    out = tmp_path / "sub" / "c4_heldout.txt"
    assert run(["data", "heldout", "--out", str(out), "--first", "1200", "--documents", "3"]) == 0
    docs = c4_documents(limit=1203)[1200:]
    assert out.read_text(encoding="utf-8") == "\n\n".join(docs)
    assert "3 C4 documents (1200..1202)" in capsys.readouterr().out
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temporary left behind
    args = parse(["data", "heldout", "--out", "x"])
    assert (args.source, args.first, args.documents) == ("c4", 1200, 800)


def test_heldout_c4_refuses_past_the_sample(tmp_path):
    with pytest.raises(ValueError, match="the C4 sample has"):
        run(["data", "heldout", "--out", str(tmp_path / "x.txt"), "--first", "1999", "--documents", "5"])
    assert not (tmp_path / "x.txt").exists()


def test_heldout_python_is_the_standard_library_source(tmp_path):
    import inspect
    import textwrap

    from wushkv.tools.heldout import PYTHON_MODULES

    out = tmp_path / "py.txt"
    assert run(["data", "heldout", "--source", "python", "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# ---- argparse.py ----\n")
    assert re.findall(r"^# ---- (\w+)\.py ----$", text, flags=re.M) == list(PYTHON_MODULES)
    assert inspect.getsource(textwrap) in text


# -- merge ----------------------------------------------------------------------------------------------------------
def compare_file(path, transforms: dict, fp=20.5, **settings):
    s = {"model": "tiny", "text_sha256": "abc", "chunks": 2, "seq_len": 64} | settings
    path.write_text(json.dumps({"settings": s, "fp": {"ppl": fp}, "results": transforms}))
    return str(path)


def result(ppl, fp=20.5, nll=(1.0, 2.0)):
    return {"ppl": ppl, "delta_pct": 100 * (ppl / fp - 1), "chunk_nll": list(nll)}


def test_merge_compare_combines_files_first_wins(tmp_path, capsys):
    a = compare_file(tmp_path / "a.json", {"wush": {"2": result(25.0), "4": result(21.0)}})
    b = compare_file(tmp_path / "b.json", {"hadamard": {"2": result(30.0, nll=(1.2, 2.1))}, "wush": {"2": result(99.0)}})
    plot = tmp_path / "p.png"
    assert run(["merge", "compare", a, b, "--versus", "wush", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.replace(str(tmp_path), "TMP")  # (pytest's numbered temp folder may hold a 99)
    assert "tiny: 2 x 64 tokens, full precision PPL 20.500" in out
    assert "99" not in out  # wush taken from the first file
    assert "30" in out and "25" in out
    assert "paired difference from wush" in out and "hadamard" in out.split("paired difference")[1]
    assert plot.stat().st_size > 0

    from wushkv.tools.merge import merge_compare, read_runs

    first, rows = merge_compare(read_runs([a, b]))
    assert first["settings"]["model"] == "tiny"
    assert rows == {"wush": {"2": result(25.0), "4": result(21.0)}, "hadamard": {"2": result(30.0, nll=(1.2, 2.1))}}


@pytest.mark.parametrize("change, message", [
    ({"model": "other"}, "model 'other' differs"),
    ({"text_sha256": "def"}, "text_sha256 'def' differs"),
    ({"chunks": 4}, "chunks 4 differs"),
    ({"fp": 20.6}, "full-precision PPL 20.6 differs"),
])
def test_merge_compare_refuses_other_runs(tmp_path, change, message):
    a = compare_file(tmp_path / "a.json", {"wush": {"2": result(25.0)}})
    fp = change.pop("fp", 20.5)
    b = compare_file(tmp_path / "b.json", {"hadamard": {"2": result(30.0)}}, fp=fp, **change)
    with pytest.raises(ValueError, match=message):
        run(["merge", "compare", a, b])


def test_merge_compare_versus_must_be_a_row(tmp_path):
    a = compare_file(tmp_path / "a.json", {"wush": {"2": result(25.0)}})
    with pytest.raises(ValueError, match="--versus 'oscar' is not a row"):
        run(["merge", "compare", a, "--versus", "oscar"])


def agree_file(path, rows: dict, conts=([1, 2], [3, 4]), calibration="recipe", **settings):
    s = {"model": "tiny", "prompts": 2, "tokens": 2, "calibration": calibration} | settings
    path.write_text(json.dumps({"settings": s, "state": {"continuations": list(conts), "rows": rows}}))
    return str(path)


def test_merge_agree_combines_and_resumes(tmp_path, capsys):
    a = agree_file(tmp_path / "a.json", {"wush": [{"kl": 0.1}]}, calibration=None)
    b = agree_file(tmp_path / "b.json", {"wush": [{"kl": 0.1}, {"kl": 0.2}], "hadamard": [{"kl": 0.3}]})
    out = tmp_path / "all.json"
    assert run(["merge", "agree", a, b, "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["state"]["rows"] == {"wush": [{"kl": 0.1}, {"kl": 0.2}], "hadamard": [{"kl": 0.3}]}
    assert merged["state"]["continuations"] == [[1, 2], [3, 4]]
    assert merged["settings"]["calibration"] == "recipe"  # None (uncalibrated run) takes the other's
    assert "wush: 2 prompts" in capsys.readouterr().out

    from wushkv.runs import resumable

    state, _, _ = resumable(str(out), merged["settings"])
    assert state == merged["state"]


@pytest.mark.parametrize("kind, message", [
    ("settings", "other settings than the files before it \\(differing: tokens\\)"),
    ("continuations", "full-precision continuations differ"),
    ("rows", "wush's results differ"),
    ("format", "not a file `wushkv agree --json` wrote"),
])
def test_merge_agree_refuses_mismatches(tmp_path, kind, message):
    a = agree_file(tmp_path / "a.json", {"wush": [{"kl": 0.1}]})
    path = tmp_path / "b.json"
    b = {"settings": lambda: agree_file(path, {"hadamard": []}, tokens=3),
         "continuations": lambda: agree_file(path, {}, conts=([1, 2], [3, 5])),
         "rows": lambda: agree_file(path, {"wush": [{"kl": 0.5}]}),
         "format": lambda: compare_file(path, {})}[kind]()
    with pytest.raises(ValueError, match=message):
        run(["merge", "agree", a, b, "--out", str(tmp_path / "all.json")])
    assert not (tmp_path / "all.json").exists()


def passkey_file(path, state: dict, **settings):
    s = {"model": "tiny", "trials": 2, "seed": 0} | settings
    path.write_text(json.dumps({"settings": s, "state": state}))
    return str(path)


def test_merge_passkey_combines_cases(tmp_path, capsys):
    a = passkey_file(tmp_path / "a.json", {"wush": {"1024/0.1/0": True}})
    b = passkey_file(tmp_path / "b.json", {"wush": {"1024/0.1/0": True, "1024/0.1/1": False}, "hadamard": {"1024/0.1/0": False}})
    out = tmp_path / "all.json"
    assert run(["merge", "passkey", a, b, "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["state"] == {"wush": {"1024/0.1/0": True, "1024/0.1/1": False}, "hadamard": {"1024/0.1/0": False}}
    assert merged["settings"] == {"model": "tiny", "trials": 2, "seed": 0, "calibration": None}  # as reconcile_settings writes it
    assert "wush: 2 cases" in capsys.readouterr().out


def test_merge_passkey_refuses_mismatches(tmp_path):
    a = passkey_file(tmp_path / "a.json", {"wush": {"1024/0.1/0": True}})
    b = passkey_file(tmp_path / "b.json", {"wush": {"1024/0.1/0": False}})
    with pytest.raises(ValueError, match="wush case 1024/0.1/0 differs from an earlier file"):
        run(["merge", "passkey", a, b, "--out", str(tmp_path / "all.json")])
    c = passkey_file(tmp_path / "c.json", {}, seed=1)
    with pytest.raises(ValueError, match="differing: seed"):
        run(["merge", "passkey", a, c, "--out", str(tmp_path / "all.json")])
    assert not (tmp_path / "all.json").exists()
