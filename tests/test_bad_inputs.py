"""Every bad input in one table: what a user gave, and the message wushkv answers (issue #36).

Each case is run (:func:`test_bad_input`): a command line exits with status 2 and prints the message; a library
call raises a ``ValueError`` (or ``FileNotFoundError``) holding it. ``docs/reference/errors.md`` is generated from
:data:`CASES` and a test fails when it is stale:

    PYTHONPATH=src python tests/test_bad_inputs.py docs/reference/errors.md    # rewrite the table

Placeholders in the commands (upper case) are files the test makes: :data:`FILES`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]


class Case(NamedTuple):
    topic: str
    what: str
    call: list[str] | str  # a command line (wushkv ARGV) or one Python statement (library use)
    message: str  # a fragment of the message


# the files the commands name; MODEL's maximum positions are 256
FILES = {
    "MODEL": "a tiny llama saved with save_pretrained (max_position_embeddings 256)",
    "TEXT": "1,800 characters of UTF-8 text",
    "CUT_MODEL": "MODEL with its model.safetensors cut in half",
    "BIN_MODEL": "MODEL with pickled weights (pytorch_model.bin) instead of model.safetensors",
    "EMPTY": "an empty text file",
    "SHORT": "11 characters of text",
    "LATIN1": "Latin-1 text (not UTF-8)",
    "CAL": "a calibration of MODEL",
    "OTHER_CAL": "a calibration of another model of the same shape",
    "SELECTED_CAL": "CAL holding a selection `wushkv select` made",
    "OLD_CAL": "CAL with `format_version` 0",
    "NEW_CAL": "CAL with `format_version` 99 (from a later wushkv)",
    "NOT_ST": "a text file named `.safetensors`",
    "DAMAGED_CAL": "CAL with one byte of a statistic changed",
    "DAMAGED_JSON": "a `compare --json` file cut in half",
    "EDITED_JSON": "a `compare --json` file with one digit of a result changed",
    "OTHER_JSON": "a JSON file no wushkv run wrote",
    "RUN_JSON": "a whole `compare --json` run file",
    "PASSKEY_JSON": "a `passkey --json` run file (recording its command, as files since session 61 do)",
    "AGREE_JSON": "an `agree --json` run file from before session 61 (no command recorded)",
    "TYPO_TOML": "a sweep configuration with a misspelled key",
    "missing…": "a path that does not exist",
}

M = ["--model", "MODEL"]
TXT = [*M, "--text-file", "TEXT"]
PPL = ["ppl", *TXT, "--seq-len", "200", "--chunks", "1"]
CALIB = ["calibrate", *M, "--calib-text-file", "TEXT", "--out", "OUT.safetensors"]

CASES: list[Case] = [
    # -- text
    Case("text", "empty text file", ["ppl", *M, "--text-file", "EMPTY", "--seq-len", "64"], "the text has 0 tokens, fewer than one chunk of seq_len=64"),
    Case("text", "text shorter than one chunk", ["ppl", *M, "--text-file", "SHORT", "--seq-len", "64"], "the text has 11 tokens, fewer than one chunk of seq_len=64"),
    Case("text", "text file not UTF-8", ["ppl", *M, "--text-file", "LATIN1"], "is not valid UTF-8"),
    Case("text", "text file missing", ["ppl", "--text-file", "missing.txt"], "does not exist"),
    Case("text", "first chunk past the text", [*PPL[:-2], "--first-chunk", "99"], "first chunk 99 is past the text's"),
    Case("text", "no chunks", [*PPL[:-1], "0"], "chunks must be at least 1, got 0"),
    Case("text", "sequence length 0", ["ppl", *TXT, "--seq-len", "0"], "seq_len must be at least 2, got 0"),
    Case("text", "sequence longer than the model's maximum positions", ["ppl", *TXT, "--seq-len", "300", "--chunks", "1"],
         "--seq-len 300 is past the 256 positions MODEL was trained for"),
    Case("text", "positions refused before the weights load (their file is cut short)",
         ["ppl", "--model", "CUT_MODEL", "--text-file", "TEXT", "--seq-len", "300"], "--seq-len 300 is past the 256 positions CUT_MODEL"),
    Case("text", "calibration longer than the model's maximum positions", [*CALIB, "--samples", "1", "--seq-len", "300"],
         "--seq-len 300 is past the 256 positions MODEL was trained for"),
    Case("text", "passkey contexts longer than the model's maximum positions",
         ["passkey", *M, "--contexts", "1k", "--transforms", "hadamard", "--trials", "1"],
         "--contexts 1024 is past the 256 positions MODEL was trained for"),
    Case("text", "agreement prompts and tokens longer than the model's maximum positions",
         ["agree", *TXT, "--prompt-len", "200", "--new-tokens", "100", "--transforms", "hadamard"],
         "--prompt-len + --new-tokens 300 is past the 256 positions MODEL was trained for"),
    Case("text", "reconstruction longer than the model's maximum positions",
         ["recon", *TXT, "--seq-len", "300", "--calibration", "CAL", "--transforms", "wush"],
         "--seq-len 300 is past the 256 positions MODEL was trained for"),
    Case("text", "clip tuning longer than the model's maximum positions",
         ["tune-clip", *TXT, "--seq-len", "300", "--transforms", "hadamard", "--out", "OUT.json"],
         "--seq-len 300 is past the 256 positions MODEL was trained for"),
    Case("text", "a covered context longer than the model's maximum positions",
         ["calibration", "cover", "--calibration", "CAL", "--serve-len", "4096", "--out", "OUT.safetensors", "--model", "MODEL"],
         "--serve-len 4096 is past the 256 positions"),
    Case("text", "no passkey trials", ["passkey", "--trials", "0"], "argument --trials: expected an integer >= 1, got 0"),
    Case("text", "no agreement tokens", ["agree", "--new-tokens", "0"], "argument --new-tokens: expected an integer >= 1, got 0"),
    Case("text", "no held-out documents", ["data", "heldout", "--source", "c4", "--documents", "0", "--out", "OUT.txt"],
         "argument --documents: expected an integer >= 1, got 0"),
    Case("text", "a prompt file that is a folder", ["generate", *M, "--prompt-file", ".", "--transform", "hadamard"], "is a folder, not a file"),
    Case("text", "a prompt file not UTF-8", ["generate", *M, "--prompt-file", "LATIN1", "--transform", "hadamard"],
         "text file 'LATIN1' is not valid UTF-8"),
    Case("text", "calibration text too short for the samples", [*CALIB, "--samples", "200", "--seq-len", "64"], "fewer than samples=200"),
    Case("text", "calibration on an empty file", ["calibrate", *M, "--calib-text-file", "EMPTY", "--out", "OUT.safetensors", "--samples", "2",
                                                  "--seq-len", "64"], "the text has 0 tokens, fewer than one chunk of seq_len=64"),
    # -- widths, windows, groups
    Case("quantizer", "key bits 1", [*PPL, "--transform", "hadamard", "--k-bits", "1"], "k_bits=1 is not supported; the cache stores [2, 3, 4, 8] bits"),
    Case("quantizer", "key bits 9", ["ppl", "--transform", "hadamard", "--k-bits", "9"], "k_bits=9 is not supported"),
    Case("quantizer", "value bits 0", ["ppl", "--transform", "hadamard", "--v-bits", "0"], "v_bits=0 is not supported"),
    Case("quantizer", "bits not a number", ["ppl", "--transform", "hadamard", "--k-bits", "x"], "bits must be one of 2, 3, 4, 8 or 16 (full precision), got 'x'"),
    Case("quantizer", "a width list with a bad width", ["compare", "--bits", "2,5"], "k_bits=5 is not supported"),
    Case("quantizer", "a width list that is not numbers", ["compare", "--bits", "two"], "expected comma-separated bit widths such as 2,3,4, got 'two'"),
    Case("quantizer", "an empty width list", ["compare", "--bits", ""], "no widths in ''; give comma-separated bit widths such as 2,3,4"),
    Case("quantizer", "negative sink", [*PPL, "--transform", "hadamard", "--sink", "-1"], "S_sink must be an integer >= 0, got -1"),
    Case("quantizer", "negative recent window", [*PPL, "--transform", "hadamard", "--keep", "-1"], "S_keep must be an integer >= 0, got -1"),
    Case("quantizer", "flush of 0 tokens", [*PPL, "--transform", "hadamard", "--flush", "0"], "S_flush must be an integer >= 1, got 0"),
    Case("quantizer", "windows that never quantize a token", ["ppl", *TXT, "--seq-len", "100", "--chunks", "1", "--transform", "hadamard"],
         "sequences of 100 tokens are too short for windows 16/128/16"),
    Case("quantizer", "windows of one method that never quantize a token, before the weights load",
         ["compare", "--model", "CUT_MODEL", "--text-file", "TEXT", "--seq-len", "200", "--transforms", "hadamard,kvarn", "--sink", "4",
          "--keep", "8", "--flush", "4"], "sequences of 200 tokens are too short for windows 128/0/128"),
    Case("quantizer", "group size 0", [*PPL, "--transform", "hadamard", "--group-size", "0"], "group_size=0: must be an integer >= 1 that divides head_dim (or None: head_dim)"),
    Case("quantizer", "group size not dividing head_dim", [*PPL, "--transform", "hadamard", "--group-size", "7", "--sink", "4", "--keep", "8",
                                                           "--flush", "4"], "group_size 7 must divide the last dim, got last dim 32"),
    Case("quantizer", "unknown quantizer", ["ppl", "--transform", "hadamard", "--quantizer", "nf4"], "unknown quantizer 'nf4'"),
    Case("quantizer", "unknown key quantizer", ["ppl", "--transform", "hadamard", "--key-quantizer", "nf4"], "unknown key quantizer 'nf4'"),
    Case("quantizer", "negative tile clip", ["compare", "--tile-clip", "-1"], "tile_clip=-1.0"),
    Case("quantizer", "negative clip search", [*PPL, "--transform", "hadamard", "--clip-search", "-1"], "clip_search=-1: must be an integer in 0..256"),
    Case("quantizer", "one-byte steps for affine", [*PPL, "--transform", "hadamard", "--quantizer", "affine", "--metadata-dtype", "e5m3"],
         "metadata_dtype 'e5m3' stores one positive step per token"),
    Case("quantizer", "QuEST clip multiplier below 0", [*PPL, "--transform", "hadamard", "--k-alpha", "-1"], "k_alpha=-1.0"),
    Case("quantizer", "library: bits 5", "QuantConfig(k_bits=5)", "k_bits=5 is not supported"),
    Case("quantizer", "library: bits as a float", "QuantConfig(k_bits=2.0)", "k_bits=2.0 is not supported; the cache stores [2, 3, 4, 8] bits (an int"),
    Case("quantizer", "library: an affine clip ratio above 1", "QuantConfig(k_clip=5)",
         "k_clip=5: the affine quantizer's clip ratio must be a number <= 1"),
    Case("quantizer", "library: a group of 0 channels", "QuantConfig(group_size=0)", "group_size=0: must be an integer >= 1 that divides head_dim"),
    Case("quantizer", "library: windows as a tuple", "QuantConfig(windows=(4, 8, 4))", "windows must be a WindowConfig"),
    Case("quantizer", "library: a window as a bool", "WindowConfig(True, 8, 4)", "S_sink must be an integer >= 0, got True"),
    Case("quantizer", "library: a config of another version", "QuantConfig(version=2)", "QuantConfig version 2 is not supported"),
    Case("quantizer", "library: a dict for the cache's config", "WushKVCache(meta_model, {'k_bits': 2})",
         "config must be a QuantConfig, or a list of one per attention layer; got dict"),
    Case("calibration", "library: a negative sample count", "calibrate(meta_model, CharTokenizer(), samples=-1)",
         "samples must be an integer >= 1, got -1"),
    Case("calibration", "library: an unknown calibrated method", "calibrate(meta_model, CharTokenizer(), seq_len=64, methods=('bogus',))",
         "methods ['bogus'] are not calibrated transforms; known:"),
    Case("quantizer", "library: windows negative", "WindowConfig(-1, 8, 4)", "S_sink must be an integer >= 0, got -1"),
    # -- methods
    Case("methods", "unknown method", ["ppl", "--transform", "foo"], "unknown transform 'foo'"),
    Case("methods", "unknown method in a list", ["compare", "--transforms", "identity,bogus"], "unknown transform 'bogus'"),
    Case("methods", "quantizer flags without a method", [*PPL, "--k-bits", "3", "--quantizer", "kivi"],
         "--k-bits 3: a quantizer flag without --transform: ppl measures full precision without one"),
    Case("methods", "a quantizer flag at its default without a method", [*PPL, "--quantizer", "quest"],
         "--quantizer quest: a quantizer flag without --transform"),
    Case("methods", "the affine clip under QuEST", [*PPL, "--transform", "hadamard", "--k-clip", "0.9"],
         "--k-clip 0.9 changes nothing here: it sets the affine quantizer's key clip (below 5 bits), which no method of this "
         "run reads (hadamard at K2V2 quest 16/128/16)"),
    Case("methods", "the affine clip at 8 bits", [*PPL, "--transform", "hadamard", "--quantizer", "affine", "--v-bits", "8",
                                                  "--v-clip", "0.9"], "--v-clip 0.9 changes nothing here"),
    Case("methods", "QuEST's clip under affine", ["agree", "--transforms", "hadamard,wush", "--k-alpha", "1.2"],
         "--k-alpha 1.2 changes nothing here: it sets QuEST's key clip multiplier, which no method of this run reads "
         "(hadamard at K2V2 affine 64/256/8; wush at K2V2 affine 64/256/8)"),
    Case("methods", "windows with KVarN's tiles", ["compare", "--transforms", "kvarn,wush+tiles", "--flush", "32"],
         "--flush 32 changes nothing here: it sets the tokens quantized per flush, which no method of this run reads "
         "(kvarn at K2V2/K3V3/K4V4 kvarn 128/0/128; wush+tiles at K2V2/K3V3/K4V4 kvarn 128/0/128)"),
    Case("methods", "a tile clip without tiles", ["compare", "--transforms", "hadamard,wush", "--tile-clip", "1.5"],
         "--tile-clip 1.5 changes nothing here: it sets the clip of KVarN's tiles"),
    Case("methods", "quantizer flags for full precision alone", ["passkey", "--transforms", "full-precision", "--quantizer", "kivi"],
         "--quantizer kivi changes nothing here: it sets the quantizer, which no method of this run reads (full-precision: "
         "not a wushkv cache)"),
    Case("methods", "a quantizer a listed method cannot run", ["passkey", "--transforms", "hadamard,wush+ldlq", "--quantizer", "kivi"],
         "method 'wush+ldlq': error-feedback rounding (+ldlq) needs a per-token quantizer (quest, affine), got --quantizer 'kivi'"),
    Case("methods", "a flush for the per-token keys of a served model", ["export-model", *M, "--method", "hadamard", "--quantizer", "quest",
                                                                         "--flush", "16", "--out", "OUT_DIR"],
         "--flush 16 changes nothing here: a serving engine stores per-token keys as they come"),
    Case("methods", "a tile clip where auto stands for a method without tiles",
         ["generate", *M, "--calibration", "CAL", "--transform", "auto", "--k-bits", "4", "--v-bits", "2", "--tile-clip", "1.7"],
         "--tile-clip 1.7 changes nothing here: it sets the clip of KVarN's tiles (kvarn, +tiles, +ktiles, --key-quantizer kvarn), "
         "which no method of this run reads (wush"),
    Case("methods", "a tile clip where auto stands for a method without tiles, in compare",
         ["compare", *TXT, "--calibration", "CAL", "--transforms", "auto", "--bits", "2", "--seq-len", "200", "--chunks", "1",
          "--tile-clip", "1.5"],
         "--tile-clip 1.5 changes nothing here: it sets the clip of KVarN's tiles (kvarn, +tiles, +ktiles, --key-quantizer kvarn), "
         "which no method of this run reads (wush at K2V2 quest 16/128/16)"),
    Case("methods", "a flush where auto stands for per-token keys, in export-model",
         ["export-model", *M, "--calibration", "CAL", "--method", "auto", "--flush", "16", "--out", "OUT_DIR"],
         "--flush 16 changes nothing here: a serving engine stores per-token keys as they come"),
    Case("methods", "a width where --bits sets both", ["compare", "--k-bits", "4"],
         "--k-bits 4 changes nothing here: compare runs each width of --bits on keys and values alike"),
    Case("methods", "a clip multiplier tune-clip searches", ["tune-clip", "--out", "OUT.json", "--v-alpha", "1"],
         "--v-alpha 1.0 changes nothing here: tune-clip searches QuEST's clip multipliers itself"),
    Case("methods", "quantizer flags with --report-only", ["agree", "--report-only", "--json", "AGREE_JSON", "--sink", "8"],
         "--sink 8: --report-only prints the saved run, at the settings it was run with"),
    Case("methods", "a method listed twice", ["compare", "--transforms", "hadamard,wush,hadamard"],
         "--transforms names hadamard twice ('hadamard,wush,hadamard'); give each method once"),
    Case("quantizer", "a width listed twice", ["compare", "--bits", "2,3,2"], "width 2 given twice in '2,3,2'; give each width once"),
    Case("methods", "an empty method list", ["compare", "--transforms", ""], "no methods in --transforms ''"),
    Case("methods", "misspelled suffix", ["compare", "--transforms", "wush+tile"], "+tiles (both sides in KVarN's tiles"),
    Case("methods", "suffixes that cannot combine", ["compare", "--transforms", "wush+ldlq+tiles"], "cannot be combined"),
    Case("methods", "+coverN on a method that reads no calibration", ["compare", "--transforms", "hadamard+cover4096"],
         "+cover4096 covers calibration statistics; this method reads none"),
    Case("methods", "+coverN no longer than the calibration's sequences", ["compare", *TXT, "--seq-len", "128", "--chunks", "1", "--bits", "2", "--sink", "4",
                                                                           "--keep", "16", "--flush", "4",
                                                                           "--calibration", "CAL", "--transforms", "wush+cover64"],
         "+cover64: the calibration's sequences already hold 64 positions; +coverN covers a longer context (N > 64), or drop it"),
    Case("methods", "auto where it is not resolved", ["ppl", "--transform", "auto"], "resolved per model and width"),
    Case("methods", "tile method in recon", ["recon", "--calibration", "x.safetensors", "--transforms", "wush+tiles"], "tile methods"),
    Case("methods", "export of a tile method", ["export", "--calibration", "CAL", "--out", "OUT.safetensors", "--transform", "wush+tiles"],
         "unknown transform 'wush+tiles'"),
    Case("methods", "export of a transform the calibration lacks", ["export", "--calibration", "CAL", "--out", "OUT.safetensors", "--transform", "wush-a"],
         "needs statistics ['H_K_A', 'H_V_A'], not in this calibration (recalibrate with --wush-a)"),
    Case("methods", "export tolerance below 0", ["export", "--calibration", "CAL", "--out", "OUT.safetensors", "--tolerance", "-1"],
         "argument --tolerance: expected a finite number >= 0, got '-1'"),
    Case("methods", "export dtype not offered", ["export", "--calibration", "CAL", "--out", "OUT.safetensors", "--dtype", "int8"],
         "argument --dtype: invalid choice: 'int8'"),
    # -- calibration files
    Case("calibration", "calibration file missing", [*PPL, "--transform", "wush", "--calibration", "missing.safetensors"],
         "calibration file 'missing.safetensors' does not exist; create it with `wushkv calibrate --out missing.safetensors`"),
    Case("calibration", "not a safetensors file", [*PPL, "--transform", "wush", "--calibration", "NOT_ST"], "'NOT_ST' is corrupted or not a safetensors file"),
    Case("calibration", "calibration from an older format version", [*PPL, "--transform", "wush", "--calibration", "OLD_CAL"],
         "'OLD_CAL' has calibration format version 0; this wushkv"),
    Case("calibration", "calibration from a newer format version", [*PPL, "--transform", "wush", "--calibration", "NEW_CAL"],
         "'NEW_CAL' has calibration format version 99; this wushkv"),
    Case("calibration", "calibration of another model", [*PPL, "--transform", "wush", "--calibration", "OTHER_CAL"],
         "does not match 'MODEL': weights_sha256"),
    Case("calibration", "calibration damaged on disk", [*PPL, "--transform", "wush", "--calibration", "DAMAGED_CAL"],
         "calibration file 'DAMAGED_CAL' is damaged: its contents do not match the sha256"),
    Case("calibration", "calibration written over itself by upgrade", ["calibration", "upgrade", "--calibration", "CAL", "--out", "CAL"], "must differ"),
    Case("calibration", "calibrating over a file holding selections", ["calibrate", *M, "--calib-text-file", "TEXT", "--out", "SELECTED_CAL",
                                                                     "--samples", "2", "--seq-len", "64"],
         "--out SELECTED_CAL holds 1 selection(s) `wushkv select` made for auto, which a new calibration would drop"),
    Case("calibration", "damping below 0", [*CALIB, "--samples", "2", "--seq-len", "64", "--damping", "-1"], "damping must be a finite float >= 0, got -1.0"),
    Case("calibration", "skip more positions than a sequence has", [*CALIB, "--samples", "2", "--seq-len", "64", "--skip-first", "100"],
         "skip_first = 100: expected an integer in [0, 63]"),
    Case("calibration", "attention weights not SINK,KEEP", [*CALIB, "--attention-weights", "3"], "expected SINK,KEEP such as 16,128, got '3'"),
    Case("calibration", "no samples", [*CALIB, "--samples", "0", "--seq-len", "64"], "--samples 0: expected at least 1 calibration sequence"),
    # -- run files
    Case("runs", "a resumed run damaged on disk", ["compare", *TXT, "--seq-len", "200", "--chunks", "1", "--transforms", "hadamard", "--json", "DAMAGED_JSON"],
         "--json DAMAGED_JSON: cannot resume from it"),
    Case("runs", "a resumed run edited by hand", ["compare", *TXT, "--seq-len", "200", "--chunks", "1", "--transforms", "hadamard", "--json", "EDITED_JSON"],
         "is damaged or was edited: its contents do not match the sha256"),
    Case("runs", "merge of a file no run wrote", ["merge", "compare", "OTHER_JSON"], "run file OTHER_JSON is not a file a wushkv run wrote"),
    Case("runs", "merge of a missing file", ["merge", "compare", "missing.json"], "run file missing.json does not exist"),
    Case("runs", "merge compare of a passkey run", ["merge", "compare", "PASSKEY_JSON"],
         "run file PASSKEY_JSON holds a run of `wushkv passkey`, not of `wushkv compare`"),
    Case("runs", "merge compare of an agree run from before commands were recorded", ["merge", "compare", "AGREE_JSON"],
         "AGREE_JSON: not a file `wushkv compare --json` wrote (no perplexities by method and width)"),
    Case("runs", "an agreement resumed from a passkey run", ["agree", *TXT, "--prompt-len", "32", "--new-tokens", "8", "--prompts", "1",
                                                            "--transforms", "hadamard", "--json", "PASSKEY_JSON"],
         "--json PASSKEY_JSON holds a run of `wushkv passkey`, not of `wushkv agree`; give another path or delete it"),
    Case("runs", "an agreement report of a passkey run", ["agree", "--report-only", "--json", "PASSKEY_JSON"],
         "--json PASSKEY_JSON holds a run of `wushkv passkey`, not of `wushkv agree`"),
    Case("runs", "merge passkey of an agree run", ["merge", "passkey", "AGREE_JSON", "--out", "OUT.json"],
         "AGREE_JSON: not a file `wushkv passkey --json` wrote"),
    Case("runs", "clip table missing", ["compare", "--clips", "missing.json"], "does not exist"),
    Case("runs", "sweep configuration missing", ["sweep", "--config", "missing.toml"], "missing.toml"),
    Case("runs", "sweep configuration with a misspelled key", ["sweep", "--config", "TYPO_TOML"], "chunk"),
    Case("runs", "two outputs naming one file", ["compare", "--json", "OUT.json", "--markdown", "OUT.json"],
         "--json OUT.json and --markdown OUT.json are one file: give each output its own path"),
    Case("runs", "an output that is the text read", [*PPL, "--json", "TEXT"], "--json TEXT is also the --text-file the run reads"),
    Case("runs", "export written over the calibration it reads", ["export", "--calibration", "CAL", "--out", "CAL"],
         "--out CAL is also the --calibration the run reads: an output must differ from the run's inputs"),
    Case("runs", "an output that is a folder", [*PPL, "--json", "."], "--json . is a folder: give a file path"),
    Case("runs", "an empty output path", [*CALIB[:-1], ""], "--out is empty (''): give a file path"),
    Case("runs", "an output whose folder is a file", [*PPL, "--json", "TEXT/r.json"], "cannot write TEXT/r.json: TEXT is a file, not a folder"),
    Case("runs", "a one-shot result written over a resumable run", [*PPL, "--json", "RUN_JSON"],
         "--json RUN_JSON holds a resumable run (compare, agree, passkey, tune-clip or merge results) that this command would overwrite"),
    Case("runs", "another run holds the output", "with exclusive_output('OUT.json'):\n    with exclusive_output('OUT.json'): pass",
         "another wushkv run is writing OUT.json (pid"),
    # -- models
    Case("generation", "empty prompt", ["generate", *M, "--prompt", " ", "--transform", "hadamard"], "a prompt is empty"),
    Case("generation", "no new tokens", ["generate", *M, "--prompt", "hi", "--transform", "hadamard", "--max-new-tokens", "0"],
         "`max_new_tokens` must be greater than 0, but is 0"),
    Case("models", "a device torch does not know", ["ppl", "--device", "bogus"], "'bogus' is not a torch device; expected cpu, cuda, cuda:N or mps"),
    Case("models", "model weights cut short", ["ppl", "--model", "CUT_MODEL", "--text-file", "TEXT", "--seq-len", "64"],
         "could not load model 'CUT_MODEL' from 'CUT_MODEL': its weights file is damaged or cut short"),
    Case("models", "pickled model weights", ["ppl", "--model", "BIN_MODEL", "--text-file", "TEXT", "--seq-len", "64"],
         "wushkv loads safetensors weights only and never unpickles a checkpoint"),
    Case("models", "model folder missing", ["ppl", "--model", "missing-model", "--text-file", "TEXT"], "missing-model"),
    Case("models", "model on the meta device", "WushKVCache(meta_model, QuantConfig())", "a WushKVCache needs a model with weights; 'tiny-llama' is on the meta device"),
    Case("models", "calibrating a model on the meta device", "calibrate(meta_model, CharTokenizer(), samples=1, seq_len=32, text_file='TEXT')",
         "calibration needs a model with weights; 'tiny-llama' is on the meta device"),
]


# -- the files ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{placeholder: path} of the files the cases name, under one folder (the cases run there)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from conftest import CharTokenizer, hf_char_tokenizer, tiny_model
    from wushkv.calibration import calibrate
    from wushkv.io import write_json

    d = tmp_path_factory.mktemp("bad")
    model = tiny_model("llama", vocab_size=128, max_position_embeddings=256)
    model.save_pretrained(d / "MODEL")
    hf_char_tokenizer().save_pretrained(d / "MODEL")
    import shutil

    import torch

    for name in ("CUT_MODEL", "BIN_MODEL"):
        shutil.copytree(d / "MODEL", d / name)
    weights = (d / "MODEL" / "model.safetensors").read_bytes()
    (d / "CUT_MODEL" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (d / "BIN_MODEL" / "model.safetensors").unlink()
    torch.save(model.state_dict(), d / "BIN_MODEL" / "pytorch_model.bin")
    (d / "TEXT").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (d / "EMPTY").write_text("")
    (d / "SHORT").write_text("short text\n")
    (d / "LATIN1").write_bytes("café au lait".encode("latin-1"))
    (d / "NOT_ST").write_text("not a safetensors file")
    cal = calibrate(model, CharTokenizer(), samples=2, seq_len=64, text_file=str(d / "TEXT"), show_progress=False)
    cal.save(d / "CAL")
    cal.set_selection({"setting": {"quantizer": "quest", "k_bits": 2}, "choice": "wush"})
    cal.save(d / "SELECTED_CAL")
    other = tiny_model("llama", seed=1, vocab_size=128, max_position_embeddings=256)
    calibrate(other, CharTokenizer(), samples=2, seq_len=64, text_file=str(d / "TEXT"), show_progress=False).save(d / "OTHER_CAL")
    with safe_open(str(d / "CAL"), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(d / "OLD_CAL"), metadata=header | {"format_version": "0"})
    save_file(tensors, str(d / "NEW_CAL"), metadata=header | {"format_version": "99"})
    data = bytearray((d / "CAL").read_bytes())
    data[-100] ^= 0x01
    (d / "DAMAGED_CAL").write_bytes(bytes(data))
    run = {"settings": {"model": "m"}, "fp": {"ppl": 12.5}, "results": {"wush": {"2": {"ppl": 13.25}}}}
    write_json(d / "EDITED_JSON", run)
    write_json(d / "RUN_JSON", run)
    text = (d / "EDITED_JSON").read_text()
    (d / "DAMAGED_JSON").write_text(text[: len(text) // 2])
    (d / "EDITED_JSON").write_text(text.replace("13.25", "13.26"))
    (d / "OTHER_JSON").write_text(json.dumps({"hello": "world"}))
    write_json(d / "PASSKEY_JSON", {"command": "passkey", "settings": {"model": "m"}, "state": {"wush": {"1024/0.5/0": {"found": True}}},
                                    "results": {"wush": {"accuracy": 1.0}}})
    write_json(d / "AGREE_JSON", {"settings": {"model": "m"}, "state": {"continuations": [[1, 2]], "rows": {}}, "results": {}})
    (d / "TYPO_TOML").write_text('[grid]\nmodels=["a"]\ntransforms=["wush"]\nbits=[2]\n[eval]\nchunk = 3\n')
    return d


def _namespace(d: Path) -> dict:
    import torch

    from conftest import CharTokenizer, tiny_model
    from wushkv.cache import WushKVCache
    from wushkv.calibration import calibrate
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.io import exclusive_output

    with torch.device("meta"):
        meta_model = tiny_model("llama")
    return {"QuantConfig": QuantConfig, "WindowConfig": WindowConfig, "WushKVCache": WushKVCache, "calibrate": calibrate,
            "CharTokenizer": CharTokenizer, "exclusive_output": exclusive_output, "meta_model": meta_model}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.topic}: {c.what}" for c in CASES])
def test_bad_input(case, files, monkeypatch, capsys):
    from wushkv.cli import main

    monkeypatch.chdir(files)  # the placeholders are the files' names there
    if isinstance(case.call, list):
        try:
            rc = main(list(case.call))
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2, err
        assert case.message in err, err
        assert "Traceback" not in err
    else:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            exec(case.call, _namespace(files))
        assert case.message in str(e.value)


def test_enough_cases():
    assert len(CASES) >= 40 and len({(c.topic, c.what) for c in CASES}) == len(CASES)


# -- the table in the docs --------------------------------------------------------------------------------------------------
BEGIN, END = "<!-- BEGIN GENERATED: bad inputs -->", "<!-- END GENERATED: bad inputs -->"


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def table() -> str:
    """The markdown table of :data:`CASES` and the legend of the files they name."""
    lines = ["| topic | bad input | given as | message (fragment) |", "|---|---|---|---|"]
    for c in CASES:
        given = f"`wushkv {' '.join(a if a else repr(a) for a in c.call)}`" if isinstance(c.call, list) else f"`{_cell(c.call)}`"
        lines.append(f"| {c.topic} | {_cell(c.what)} | {_cell(given)} | {_cell(c.message)} |")
    legend = ["", "Files named in the commands:", ""] + [f"* `{k}`: {v}" for k, v in FILES.items()]
    return "\n".join(lines + legend) + "\n"


def render(text: str) -> str:
    a, b = text.find(BEGIN), text.find(END)
    if a < 0 or b < a:
        raise ValueError(f"expected the markers {BEGIN!r} and {END!r}, in that order")
    return text[: a + len(BEGIN)] + "\n" + table() + text[b:]


def test_error_table_is_generated_from_the_cases():
    path = ROOT / "docs" / "reference" / "errors.md"
    text = path.read_text(encoding="utf-8")
    assert render(text) == text, "docs/reference/errors.md is stale: PYTHONPATH=src python tests/test_bad_inputs.py docs/reference/errors.md"


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "reference" / "errors.md")
    new = render(out.read_text(encoding="utf-8"))
    if new != out.read_text(encoding="utf-8"):
        out.write_text(new, encoding="utf-8")
        print(f"updated {out}")
