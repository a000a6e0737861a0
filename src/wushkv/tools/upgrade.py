"""``wushkv calibration upgrade``: bring a calibration file made by an older wushkv to the current format: add the
pre-RoPE key mean (``mu_K_pre``, needed by the ``+rmean`` methods) where it was made before the mean was collected,
keep its statistics, solved transforms and selections bit for bit (so WUSH stays the same solution, signs included),
and write the result, in the current file format version, to a new file atomically."""

from __future__ import annotations

from pathlib import Path

import torch

from ..calibration import Calibration, calibration_sequences, pre_rope_key_mean


def add_rope_mean(cal: Calibration, model, tokenizer, seqs: int = 4, text_file: str | None = None,
                  show_progress: bool = True) -> Calibration:
    """Set ``mu_K_pre`` (Hkv, d) float64 in every layer's statistics of ``cal`` (in place; returned too).

    The mean comes from the first ``seqs`` calibration sequences (C4, or ``text_file``) of the file's own sequence
    length; ``meta["mu_K_pre"]`` records where it came from (:func:`wushkv.calibration.calibration_documents` reads
    it to know which C4 documents the file has seen). Nothing else in ``cal`` changes.
    """
    seq_len = int(cal.meta["seq_len"])
    with torch.no_grad():
        mus = pre_rope_key_mean(model, calibration_sequences(tokenizer, seqs, seq_len, text_file=text_file),
                                show_progress=show_progress)
    for st, mu in zip(cal.stats, mus):
        st["mu_K_pre"] = mu
    cal.meta["mu_K_pre"] = {"sequences": seqs, "seq_len": seq_len, "text_file": text_file}
    return cal


def upgrade_file(calibration: str | Path, out: str | Path, seqs: int = 4, text_file: str | None = None,
                 model=None, tokenizer=None, show_progress: bool = True) -> Path:
    """Read ``calibration``, add ``mu_K_pre`` (:func:`add_rope_mean`) if it lacks it, and save to ``out`` in the current
    format version (atomically); the original is kept, so ``out`` must be another path. ``model``/``tokenizer``
    default to loading the model the file names (``meta["model"]``), only when the mean must be computed; the file is
    checked against the model whenever one is at hand. Returns ``out``."""
    if Path(out).resolve() == Path(calibration).resolve():
        raise ValueError("--out must differ from --calibration (the original is kept)")
    cal = Calibration.load(calibration, model=model)
    if not all("mu_K_pre" in st for st in cal.stats):
        if model is None:
            from ..models import load

            model, tokenizer = load(cal.meta["model"])
            cal.check_model(model)
        add_rope_mean(cal, model, tokenizer, seqs=seqs, text_file=text_file, show_progress=show_progress)
    return cal.save(out)
