"""The command line fails fast and clearly on bad input (before any model is loaded)."""

import pytest

from wushkv.cli import main


def _tiny_model_dir(tmp_path, repeats: int = 40, max_position_embeddings: int | None = 1024):
    """A tiny llama with a character tokenizer saved under tmp_path/m, a text file, and a calibration from it:
    (model dir, text path, calibration)."""
    from conftest import CharTokenizer, hf_char_tokenizer, tiny_model

    from wushkv.calibration import calibrate

    kw = {} if max_position_embeddings is None else {"max_position_embeddings": max_position_embeddings}
    model = tiny_model("llama", vocab_size=128, **kw)
    model.save_pretrained(tmp_path / "m")
    hf_char_tokenizer().save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * repeats)
    return tmp_path / "m", text, calibrate(model, CharTokenizer(), samples=2, seq_len=64, text_file=str(text), show_progress=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ppl", "--transform", "hadamard", "--k-bits", "9"], "k_bits=9 is not supported"),
        (["ppl", "--transform", "hadamard", "--v-bits", "0"], "v_bits=0 is not supported"),
        (["ppl", "--transform", "foo"], "unknown transform 'foo'"),
        (["ppl", "--transform", "hadamard", "--quantizer", "nf4"], "unknown quantizer 'nf4'"),
        (["ppl", "--text-file", "/nonexistent/x.txt"], "does not exist"),
        (["compare", "--transforms", "identity,bogus"], "unknown transform 'bogus'"),
        (["compare", "--bits", "2,5"], "k_bits=5 is not supported"),
        (["recon", "--calibration", "x.safetensors", "--transforms", "nope"], "unknown transform 'nope'"),
        (["recon", "--calibration", "x.safetensors", "--transforms", "wush+tiles"], "tile methods"),
        (["recon", "--calibration", "x.safetensors", "--transforms", "kvarn:wush"], "kvarn cannot be one side"),
        (["compare", "--transforms", "wush+tile"], "+tiles (both sides in KVarN's tiles"),
        (["recon", "--calibration", "x.safetensors", "--transforms", "wush+ldlq"], "error-feedback methods"),
        (["compare", "--transforms", "wush+ldlq+tiles"], "cannot be combined"),
        (["ppl", "--transform", "hadamard+ldlq", "--quantizer", "kivi"], "per-token quantizer"),
        (["compare", "--transforms", "wush,wush+ldlq", "--quantizer", "kivi"], "per-token quantizer"),
        (["tune-clip", "--out", "c.json", "--quantizer", "affine"], "clip multipliers are QuEST's"),
        (["tune-clip", "--out", "c.json", "--transforms", "wush,kvarn"], "'kvarn' quantizes with KVarN's tiles"),
        (["tune-clip", "--out", "c.json", "--k-alpha", "1.2"], "starts from α_b"),
        (["tune-clip", "--out", "c.json", "--grid", "0.9,1.1"], "including 1"),
        (["tune-clip", "--out", "c.json", "--grid", "1,x"], "comma-separated multipliers"),
        (["compare", "--clips", "c.json", "--quantizer", "affine"], "QuEST clip multipliers; got --quantizer 'affine'"),
        (["compare", "--clips", "c.json", "--k-alpha", "1.3"], "either --clips or --k-alpha"),
        (["compare", "--clips", "/nonexistent/c.json"], "does not exist"),
        (["ppl", "--clips", "c.json"], "needs a quantized run"),
        (["compare", "--tile-clip", "-1"], "tile_clip=-1.0"),
        (["tune-clip", "--out", "c.json", "--transforms", "wush+ktiles"], "keep their keys in KVarN's tiles"),
        (["ppl", "--transform", "hadamard", "--key-quantizer", "nf4"], "unknown key quantizer 'nf4'"),
        (["recon", "--calibration", "x.safetensors", "--transforms", "wush+ktiles"], "tile methods"),
        (["compare", "--transforms", "wush+tiles+ktiles"], "puts the keys in KVarN's tiles"),
        (["compare", "--transforms", "wush+ktiles", "--quantizer", "kivi"], "needs --quantizer quest or affine, got 'kivi'"),
        (["tune-clip", "--out", "c.json", "--transforms", "auto"], "resolved per model and width by `compare`, `generate`, `agree` and `passkey` only"),
        (["ppl", "--transform", "auto"], "resolved per model and width"),
        (["agree", "--transforms", "wush,auto", "--growth-reference", "random"], "--growth-reference 'random' is not among"),
        (["agree", "--transforms", "wush,random", "--growth-reference", "random", "--new-tokens", "4"], "needs --new-tokens >= 8"),
    ],
)
def test_bad_arguments(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the lock of an output named relative (c.json) goes there, not into the checkout
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bits_parsing_error(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--bits", "two"])
    assert "comma-separated bit widths" in capsys.readouterr().err


def test_passkey_and_agree_resume_from_their_json(tmp_path, capsys):
    """A second run with the same settings reads everything from the JSON (no prompt is run again);
    the table and results are the same; other settings are refused, not overwritten."""
    import json

    from conftest import hf_char_tokenizer, tiny_model

    tiny_model("llama", vocab_size=128, max_position_embeddings=1024).save_pretrained(tmp_path / "m")
    hf_char_tokenizer().save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    win = ["--sink", "4", "--keep", "8", "--flush", "4"]
    runs = {
        "passkey": ["passkey", "--model", str(tmp_path / "m"), "--transforms", "full-precision,hadamard", "--contexts", "300",
                    "--depths", "0.5", "--trials", "2", *win],
        "agree": ["agree", "--model", str(tmp_path / "m"), "--transforms", "hadamard", "--prompts", "2", "--prompt-len", "40",
                  "--new-tokens", "6", "--stride", "1", "--text-file", str(text), *win],
    }
    for name, argv in runs.items():
        out = tmp_path / f"{name}.json"
        assert main([*argv, "--json", str(out)]) == 0
        first = json.loads(out.read_text())
        capsys.readouterr()
        assert main([*argv, "--json", str(out)]) == 0
        assert "resuming from" in capsys.readouterr().err
        again = json.loads(out.read_text())
        assert again["state"] == first["state"]
        for m in first["results"]:
            assert again["results"][m]["seconds"] == 0  # nothing ran again
            assert {k: v for k, v in again["results"][m].items() if k != "seconds"} == {
                k: v for k, v in first["results"][m].items() if k != "seconds"}
        # a run with other settings is refused, and the file is left as it was
        assert main([*argv[:-6], "--sink", "2", "--keep", "8", "--flush", "4", "--json", str(out)]) == 2
        assert "other settings (differing: quantization)" in capsys.readouterr().err
        assert json.loads(out.read_text()) == again


def test_agree_report_only_compares_over_common_prompts(tmp_path, capsys):
    """--report-only runs nothing (no model is loaded: the model path does not exist) and reports a
    partial run over the prompts every listed method has."""
    import json

    rows = {"hadamard": [{"kl": [0.1, 0.3], "top1": [True, False], "prefix": 1}, {"kl": [0.5, 0.5], "top1": [True, True], "prefix": 2}],
            "wush": [{"kl": [0.2, 0.2], "top1": [True, True], "prefix": 0}]}
    settings = {"model": "m", "prompt_len": 8, "text": "t", "new_tokens": 2, "single_pass": True,
                "quantization": {"k_bits": 2, "v_bits": 2, "quantizer": "affine"}}
    out = tmp_path / "agree.json"
    out.write_text(json.dumps({"settings": settings, "state": {"continuations": [[1, 2], [3, 4]], "rows": rows}}))
    base = ["agree", "--model", str(tmp_path / "missing"), "--report-only", "--json", str(out)]
    assert main([*base, "--transforms", "hadamard,wush", "--plot", str(tmp_path / "a.png")]) == 0
    table = capsys.readouterr().out
    assert (tmp_path / "a.png").stat().st_size > 0
    fields = lambda text: next(x for x in text.splitlines() if x.startswith("hadamard")).split()  # noqa: E731
    assert fields(table)[:4] == ["hadamard", "1", "0.2", "50"]  # prompt 0 only: the one wush has
    assert main([*base, "--transforms", "hadamard"]) == 0  # alone, over both of its prompts
    assert fields(capsys.readouterr().out)[:4] == ["hadamard", "2", "0.35", "75"]
    assert main([*base, "--transforms", "hadamard,oscar"]) == 2
    assert "no results for ['oscar']" in capsys.readouterr().err
    assert main([*base, "--transforms", "hadamard,wush", "--growth-reference", "hadamard"]) == 2
    assert "at least 8 generated positions" in capsys.readouterr().err  # 2 positions: no quarters to compare
    assert main([*base, "--transforms", "hadamard,wush", "--growth-reference", "oscar"]) == 2
    assert "--growth-reference 'oscar' is not among" in capsys.readouterr().err


def test_agree_report_only_growth_against_a_reference(tmp_path, capsys):
    """--growth-reference: each method's 4th / 2nd-quarter KL ratio and against the reference's; without --transforms,
    --report-only reports every method the file holds."""
    import json

    rows = {"hadamard": [{"kl": [0.4, 0.4, 0.1, 0.1, 0.2, 0.2, 0.2, 0.2], "top1": [True] * 8, "prefix": 8}] * 2,
            "wush": [{"kl": [0.4, 0.4, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3], "top1": [True] * 8, "prefix": 8}] * 2}
    settings = {"model": "m", "prompt_len": 8, "text": "t", "new_tokens": 8, "single_pass": True,
                "quantization": {"k_bits": 2, "v_bits": 2, "quantizer": "affine"}}
    out = tmp_path / "agree.json"
    out.write_text(json.dumps({"settings": settings, "state": {"continuations": [[1] * 8] * 2, "rows": rows}}))
    assert main(["agree", "--model", str(tmp_path / "missing"), "--report-only", "--json", str(out), "--growth-reference", "hadamard"]) == 0
    text = capsys.readouterr().out
    assert "hadamard: x2.00 [2.00, 2.00]  vs hadamard: x1.00 [1.00, 1.00]" in text
    assert "wush: x3.00 [3.00, 3.00]  vs hadamard: x1.50 [1.50, 1.50]" in text


def test_reconcile_settings_reads_older_quantization():
    """A run saved before a QuantConfig field existed resumes: the missing field takes its default."""
    from wushkv.runs import reconcile_settings
    from wushkv.config import QuantConfig

    new = {"model": "m", "quantization": QuantConfig().to_dict()}
    old = {"model": "m", "quantization": {k: v for k, v in QuantConfig().to_dict().items() if k != "clip_search"}}
    assert reconcile_settings(old, new)[1] == []
    assert reconcile_settings(old, {"model": "m", "quantization": QuantConfig(clip_search=4).to_dict()})[1] == ["quantization"]


def test_auto_resolution_in_resumed_settings():
    """agree/passkey record what ``auto`` resolved to: a run without ``auto`` is compatible with any resolution (and
    keeps it), two different resolutions are not; the tables label the row with the method."""
    from wushkv.eval.report import method_label as _method_label
    from wushkv.runs import reconcile_settings

    base = {"model": "m", "quantization": {"k_bits": 2}}
    a = base | {"auto": {"method": "wush+ktiles+ldlq", "quantization": {"tile_clip": 1.7}}}
    b = base | {"auto": {"method": "wush+rmean", "quantization": {"tile_clip": 0.0}}}
    for old, new in ((a, base), (base, a)):
        merged, differ = reconcile_settings(old, new)
        assert differ == [] and merged["auto"]["method"] == "wush+ktiles+ldlq" and merged["auto"]["quantization"]["tile_clip"] == 1.7
    assert reconcile_settings(a, b)[1] == ["auto"]
    assert _method_label("auto", a) == "auto (wush+ktiles+ldlq)" and _method_label("auto", base) == "auto"
    assert _method_label("wush", a) == "wush"


def test_tune_clip_then_compare_with_the_table(tmp_path, capsys):
    """tune-clip writes a table that compare --clips applies: each method's result runs at its table clips."""
    import json

    from conftest import hf_char_tokenizer, tiny_model

    tiny_model("llama", vocab_size=128).save_pretrained(tmp_path / "m")
    hf_char_tokenizer().save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    common = ["--model", str(tmp_path / "m"), "--transforms", "identity,hadamard", "--bits", "2", "--text-file", str(text),
              "--seq-len", "120", "--chunks", "2", "--sink", "4", "--keep", "16", "--flush", "4"]
    table = tmp_path / "clips.json"
    assert main(["tune-clip", *common, "--grid", "0.85,1,1.15", "--out", str(table), "--plot", str(tmp_path / "k.png")]) == 0
    assert (tmp_path / "k.png").stat().st_size > 1000
    assert "QuEST clip multipliers on α_b chosen on" in capsys.readouterr().out
    clips = json.loads(table.read_text())["clips"]
    out = tmp_path / "cmp.json"
    assert main(["compare", *common, "--clips", str(table), "--json", str(out)]) == 0
    cap = capsys.readouterr()
    assert "chosen on this very text" in cap.err  # the honest-use guard speaks
    assert f"hadamard 2-bit αK×{clips['hadamard']['2']['k_alpha']:g}" in cap.out
    res = json.loads(out.read_text())["results"]
    for t in ("identity", "hadamard"):
        cfg = res[t]["2"]["config"]
        assert (cfg["k_alpha"], cfg["v_alpha"]) == (clips[t]["2"]["k_alpha"], clips[t]["2"]["v_alpha"])
        assert res[t]["2"]["ppl"] == clips[t]["2"]["ppl"]  # the same text and clips: the same perplexity


def test_compare_runs_auto_and_says_what_it_ran(tmp_path, capsys):
    """compare --transforms auto,...: auto resolves per width from the calibration's selection (here one written for
    the test, with its clip multipliers), the table row and JSON record it and why, the perplexity is that method's."""
    import json

    from wushkv.calibration import Calibration
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.methods.auto import selection_setting

    _, text, cal = _tiny_model_dir(tmp_path, repeats=20, max_position_embeddings=None)
    setting = selection_setting(QuantConfig(windows=WindowConfig(4, 16, 4)))
    cal.set_selection({"setting": setting, "text": "h.txt", "chunks": 4, "serve_len": 120, "rule": "lowest",
                       "choices": {"2": {"recipe": "wush+ldlq-v@ka=1.2", "why": "lowest mean held-out NLL of 3 candidates"}}})
    path = cal.save(tmp_path / "c.safetensors")
    out = tmp_path / "r.json"
    argv = ["compare", "--model", str(tmp_path / "m"), "--calibration", str(path), "--transforms", "auto,wush+ldlq-v", "--bits", "2,3",
            "--text-file", str(text), "--seq-len", "120", "--chunks", "2", "--sink", "4", "--keep", "16", "--flush", "4", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "auto: 2-bit wush+ldlq-v (αK×1.2 αV×1), 3-bit wush\n" in printed
    assert "  2-bit: selected by `wushkv select` on h.txt (4 x 120 tokens, rule lowest): lowest mean held-out NLL" in printed
    assert "  3-bit: no selection for" in printed and "wushkv select --calibration FILE" in printed
    res = json.loads(out.read_text())["results"]
    assert res["auto"]["2"]["method"] == "wush+ldlq-v" and res["auto"]["2"]["config"]["k_alpha"] == 1.2
    assert res["auto"]["2"]["why"].startswith("selected by `wushkv select`")
    assert res["auto"]["3"]["method"] == "wush" and res["auto"]["2"]["ppl"] != res["wush+ldlq-v"]["2"]["ppl"]  # its own clip
    # a new selection written into the file: resuming runs auto again where it now stands for another method
    cal = Calibration.load(path)
    cal.set_selection({"setting": setting, "text": "h.txt", "chunks": 4, "serve_len": 120, "rule": "lowest",
                       "choices": {"2": {"recipe": "wush+ldlq-v@ka=1.2"}, "3": {"recipe": "wush+ldlq-v"}}})
    cal.save(path)
    assert main(argv) == 0
    assert "auto at 3 bits now stands for wush+ldlq-v" in capsys.readouterr().err
    again = json.loads(out.read_text())["results"]
    assert again["auto"]["2"] == res["auto"]["2"] and again["auto"]["3"]["method"] == "wush+ldlq-v"


def test_generate_auto_picks_centered_wush_keys(tmp_path, capsys):
    """`generate` defaults to --transform auto: wush+rmean under its default affine quantizer with a calibration
    holding the pre-RoPE key mean, plain wush with QuEST; it streams text and reports the cache's bytes."""
    _, _, cal = _tiny_model_dir(tmp_path)
    assert all("mu_K_pre" in st for st in cal.stats)
    path = cal.save(tmp_path / "c.safetensors")
    argv = ["generate", "--model", str(tmp_path / "m"), "--calibration", str(path), "--prompt", "the quick brown fox " * 3,
            "--max-new-tokens", "20", "--sink", "4", "--keep", "8", "--flush", "4"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "--transform auto: wush+rmean" in err and "[wush+rmean K2V2 affine" in err and "tokens cached" in err
    assert main([*argv, "--quantizer", "quest"]) == 0
    err = capsys.readouterr().err
    assert "--transform auto: wush (" in err and "[wush K2V2 quest" in err


def test_generate_batch_of_prompts_equals_each_alone(tmp_path, capsys):
    """Repeated --prompt runs one left-padded batch; with key tiles (blocks per row) each completion equals the
    prompt's completion alone."""
    _, _, cal = _tiny_model_dir(tmp_path)
    path = cal.save(tmp_path / "c.safetensors")
    base = ["generate", "--model", str(tmp_path / "m"), "--calibration", str(path), "--transform", "wush+ktiles+ldlq",
            "--quantizer", "quest", "--max-new-tokens", "24", "--sink", "4", "--keep", "4", "--flush", "8"]
    prompts = ["the quick brown fox jumps over ", "a lazy dog "]
    assert main([*base, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    out, err = capsys.readouterr()
    rows = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("--- [")]
    assert len(rows) == 2 and "2 rows x" in err
    for p, row in zip(prompts, rows):
        assert main([*base, "--prompt", p]) == 0
        alone = capsys.readouterr().out.strip("\n")
        assert row == alone and len(alone) > len(p)


def test_agree_and_passkey_take_auto(tmp_path, capsys):
    """agree and passkey resolve ``auto`` for the model and width (a model without recipes: centered WUSH keys under
    the affine quantizer), keep its rows under ``auto``, record the resolution and label the tables with it."""
    import json

    _, text, cal = _tiny_model_dir(tmp_path)
    path = cal.save(tmp_path / "c.safetensors")
    common = ["--model", str(tmp_path / "m"), "--calibration", str(path), "--transforms", "wush+rmean,auto", "--sink", "4", "--keep", "8", "--flush", "4"]
    runs = {"agree": ["agree", *common, "--prompts", "2", "--prompt-len", "40", "--new-tokens", "6", "--stride", "1", "--text-file", str(text)],
            "passkey": ["passkey", *common, "--contexts", "300", "--depths", "0.5", "--trials", "2"]}
    for name, argv in runs.items():
        out = tmp_path / f"{name}.json"
        assert main([*argv, "--json", str(out)]) == 0
        cap = capsys.readouterr()
        assert "auto: wush+rmean at K2V2 affine 4/8/4 (no selection for" in cap.err and "auto (wush+rmean)" in cap.out
        saved = json.loads(out.read_text())
        assert saved["settings"]["auto"]["method"] == "wush+rmean" and saved["results"]["auto"]["method"] == "wush+rmean"
        assert "wushkv select" in saved["settings"]["auto"]["why"]
        a, b = saved["results"]["auto"], saved["results"]["wush+rmean"]
        key = "kl_by_position" if name == "agree" else "logprob"
        assert a[key] == b[key]  # the same method at the same settings
    # a selection written into the calibration makes auto another method here: resuming refuses the old auto rows, and
    # says why
    from wushkv.calibration import Calibration
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.methods.auto import selection_setting

    cal = Calibration.load(path)
    cal.set_selection({"setting": selection_setting(QuantConfig(quantizer="affine", windows=WindowConfig(4, 8, 4))),
                       "choices": {"2": {"recipe": "wush"}}})
    cal.save(path)
    for name, argv in runs.items():
        assert main([*argv, "--json", str(tmp_path / f"{name}.json")]) == 2
        assert "holds `auto` rows run as wush+rmean" in capsys.readouterr().err


def test_every_quant_field_has_a_flag():
    """Each QuantConfig field is a quantizer flag of every command that quantizes (or is listed as flagless, with why), and
    the flags give back the dataclass's defaults: adding a field without a flag fails here."""
    import dataclasses

    from wushkv.cli import build_parser
    from wushkv.cli.common import NO_FLAG, QUANT_HELP, WINDOW_HELP, quant_config
    from wushkv.config import GENERATION_WINDOWS, PERPLEXITY_WINDOWS, QuantConfig, WindowConfig

    fields = {f.name for f in dataclasses.fields(QuantConfig)}
    assert fields == set(QUANT_HELP) | set(NO_FLAG), "give the new QuantConfig field a row in wushkv.cli.common.QUANT_HELP"
    assert {f.name for f in dataclasses.fields(WindowConfig)} == set(WINDOW_HELP)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for cmd, windows, quantizer in [("ppl", PERPLEXITY_WINDOWS, "quest"), ("compare", PERPLEXITY_WINDOWS, "quest"),
                                    ("tune-clip", PERPLEXITY_WINDOWS, "quest"), ("lm-eval", PERPLEXITY_WINDOWS, "quest"),
                                    ("generate", GENERATION_WINDOWS, "affine"), ("agree", GENERATION_WINDOWS, "affine"),
                                    ("passkey", GENERATION_WINDOWS, "affine")]:
        p = sub.choices[cmd]
        flags = {s for a in p._actions for s in a.option_strings}
        assert {f"--{n.replace('_', '-')}" for n in QUANT_HELP} <= flags and {"--sink", "--keep", "--flush"} <= flags, cmd
        required = ["--out", "x"] if cmd == "tune-clip" else ["--tasks", "t"] if cmd == "lm-eval" else []
        assert quant_config(p.parse_args(required)) == QuantConfig(quantizer=quantizer, windows=windows), cmd
    args = sub.choices["ppl"].parse_args(["--k-bits", "16", "--v-bits", "3", "--key-quantizer", "kvarn", "--tile-clip", "1.5",
                                          "--clip-search", "4", "--group-size", "16", "--sink", "2", "--keep", "8", "--flush", "4"])
    assert quant_config(args) == QuantConfig(k_bits=None, v_bits=3, key_quantizer="kvarn", tile_clip=1.5, clip_search=4,
                                             group_size=16, windows=WindowConfig(2, 8, 4))
    assert quant_config(args, k_bits=2).k_bits == 2


def test_help_of_every_command(capsys):
    """``wushkv --help`` lists every command, in the documented order, and each command's --help runs."""
    from wushkv.cli import HELP_ORDER, build_parser

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    usage = capsys.readouterr().out
    assert "{" + ",".join(HELP_ORDER) + "}" in usage
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == list(HELP_ORDER)
    for cmd in HELP_ORDER:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0 and f"usage: wushkv {cmd}" in capsys.readouterr().out


def test_context_list():
    import argparse

    from wushkv.cli import context_list

    assert context_list("1k, 2k,4096,1.5k") == [1024, 2048, 4096, 1536]
    with pytest.raises(argparse.ArgumentTypeError, match="contexts such as"):
        context_list("1k,x")


def test_a_device_this_machine_lacks_is_refused_before_anything_loads(capsys):
    """--device cuda on a torch that sees no CUDA device (a CPU build), cuda:N past the devices there are: the flag's
    error, naming the device, not torch's AssertionError after the model has loaded."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bad = "cuda" if n == 0 else f"cuda:{n}"
    with pytest.raises(SystemExit) as e:
        main(["ppl", "--device", bad, "--text-file", "missing.txt"])
    assert e.value.code == 2
    said = capsys.readouterr().err
    assert f"argument --device: {bad!r}" in said and ("sees no CUDA device" if n == 0 else f"has {n} CUDA device") in said


def test_every_option_says_its_default_in_help():
    """Every option of every command with a default to say (not None, not a switch's False) says it in --help."""
    import argparse

    from wushkv.cli import build_parser

    missing, seen = [], 0

    def walk(parser, name):
        nonlocal seen
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub_name, sub in a.choices.items():
                    walk(sub, f"{name} {sub_name}")
            elif a.option_strings and not a.required and a.default not in (None, False, argparse.SUPPRESS):
                seen += 1
                if "default" not in (a.help or "").lower():
                    missing.append(f"{name} {a.option_strings[-1]}")
        parser.format_help()  # and every help renders (a stray % would raise here)

    walk(build_parser(), "wushkv")
    assert seen > 100 and not missing, missing


def test_method_lists_without_a_wush_method_need_no_calibration():
    """Full precision alone, or auto alone, lists no method of wushkv's own: nothing to check, no calibration asked
    for (a regression of session 60 refused the empty list left once those are set aside)."""
    from wushkv.eval.prepare import calibration_for

    assert calibration_for(None, None, ["full-precision"]) is None
    with pytest.raises(ValueError, match="unknown method 'bogus'"):
        calibration_for(None, None, ["full-precision", "bogus"])
