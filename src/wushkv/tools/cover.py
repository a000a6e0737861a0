"""``wushkv calibration cover``: a calibration whose key-space statistics cover the positions of a longer served
context (:func:`wushkv.calibration.cover_positions`), its transforms solved again from them, written to a new file.

Calibrated on sequences of L tokens, WUSH's key statistics hold the RoPE angles of positions 0..L−1 only; served at
4·L they miss most of the turn of the low-frequency channels. On SmolLM2 (2-bit QuEST 16/128/16, WikiText-2 4 × 4096)
a calibration of 16 × 1024 tokens puts the paper recipe at +39.8% over full precision (Hadamard: +14.2%) and keeps
0.62 of `auto`'s margin over Hadamard; covered to 4096 it is +14.2% and `auto` keeps all of it
(docs/lab/calibration-length.md).
"""

from __future__ import annotations

from pathlib import Path

from ..calibration import Calibration, cover_positions


def cover_file(calibration: str | Path, out: str | Path, serve_len: int, model=None) -> Path:
    """Read ``calibration``, cover its statistics to ``serve_len`` positions (recorded as ``meta["positions"]``) and save to
    ``out`` (atomically; the original is kept, so ``out`` must be another path). ``model`` defaults to loading the
    model the file names (its RoPE frequencies are needed); the file is checked against it. Returns ``out``."""
    if Path(out).resolve() == Path(calibration).resolve():
        raise ValueError("--out must differ from --calibration (the original is kept)")
    from ..models import describe, rope_parameters

    if model is None:
        from ..models import load

        model, _ = load(Calibration.load(calibration).meta["model"])
    cal = Calibration.load(calibration, model=model)
    L = int(cal.meta["seq_len"])
    if isinstance(serve_len, bool) or not isinstance(serve_len, int) or serve_len <= L:
        raise ValueError(f"--serve-len {serve_len!r}: the context to cover must be longer than the calibration's "
                         f"sequences ({L} tokens); at {L} or fewer the statistics already cover it")
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and serve_len > limit:
        raise ValueError(f"--serve-len {serve_len} is past the {limit} positions {cal.meta['model']} was trained for "
                         f"(max_position_embeddings); give --serve-len <= {limit}")
    spec = describe(model)
    covered = cover_positions(cal, [rope_parameters(model, l, spec) for l in range(spec.num_layers)], serve_len)
    return covered.save(out)
