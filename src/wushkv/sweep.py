"""Sweeps: every (model, transform, bits, quantizer, evaluation) job of a grid, on Ray or in-process.

A sweep is described by a TOML file (see ``docs/reference/integrations.md``)::

    out = "out/sweep"                  # results directory (resumable)
    [grid]
    models = ["smollm2-135m"]
    transforms = ["hadamard", "wush"]
    bits = [2, 3, 4]                   # K = V bits, or strings "K4V2"
    quantizers = ["quest"]
    evaluations = ["ppl"]              # ppl | recon
    [eval]                             # chunks, seq_len, text_file, sink, keep, flush, recon_seqs
    [calibration]                      # samples, seq_len, text_file, damping
    [resources]                        # num_cpus, num_gpus per job (also the torch thread count)

* One job per Ray task, with its resources declared. Calibration runs once per model, as its own
  task, only for models whose grid has a calibrated transform; its safetensors bytes travel to the
  job tasks through the object store (no shared file system needed) and are also kept under
  ``out/calibrations`` so a rerun skips it.
* Each finished job writes ``out/jobs/<id>.json`` atomically; the id hashes the job and every
  setting that affects its result, so a rerun after an interruption skips finished jobs and never
  reuses a result computed under other settings.
* ``results.json``, ``results.md`` and one PNG per (model, evaluation) collect everything.
* Without a Ray address the same jobs run in-process, one model load per model. Each job runs with
  ``torch.set_num_threads(num_cpus)`` in both modes, so both give bit-identical numbers.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import PER_TOKEN_QUANTIZERS
from .methods.spec import MethodSpec, UnknownMethodError, canonical_name, grammar_help, method_config, parse
from .io import atomic_write, read_json, write_json
from .runs import settings_key

__all__ = ["Job", "SweepConfig", "run_sweep", "collect"]

EVALUATIONS = ("ppl", "recon")
FULL_PRECISION = "full-precision"
_SECTIONS = {
    "grid": {"models", "transforms", "bits", "quantizers", "evaluations"},
    "eval": {"chunks", "seq_len", "text_file", "sink", "keep", "flush", "recon_seqs", "dtype", "device"},
    "calibration": {"samples", "seq_len", "text_file", "damping", "wush_a", "skip_first", "skip_first_queries"},
    "resources": {"num_cpus", "num_gpus"},
}


class SweepError(ValueError):
    """A sweep file that cannot be run (unknown key, bad value)."""


def quantizers_of(transform: str, quantizers) -> list[str]:
    """The quantizers a sweep runs ``transform`` with: KVarN's for tile methods, the per-token ones for ``+ktiles``
    (keys in tiles, values per token), all of ``quantizers`` otherwise."""
    m = parse(transform)
    if isinstance(m, MethodSpec) and m.tiles:
        return ["kvarn"]
    return [q for q in quantizers if q in PER_TOKEN_QUANTIZERS] if isinstance(m, MethodSpec) and m.key_tiles else list(quantizers)


@dataclass(frozen=True)
class Job:
    """One point of the grid. ``transform`` is ``full-precision`` for the reference perplexity."""

    model: str
    transform: str
    k_bits: int | None
    v_bits: int | None
    quantizer: str
    evaluation: str

    def label(self) -> str:
        if self.transform == FULL_PRECISION:
            return f"{self.model} full precision {self.evaluation}"
        k = "16" if self.k_bits is None else self.k_bits
        v = "16" if self.v_bits is None else self.v_bits
        return f"{self.model} {self.transform} K{k}V{v} {self.quantizer} {self.evaluation}"


def _parse_bits(b) -> tuple[int | None, int | None]:
    from .config import CACHE_BITS

    if isinstance(b, bool):
        raise SweepError(f"grid.bits entry {b!r}: expected an int in {list(CACHE_BITS)} or a string like 'K4V2'")
    if isinstance(b, int):
        kv = (b, b)
    elif isinstance(b, str) and b.upper().startswith("K") and "V" in b.upper():
        k, v = b.upper()[1:].split("V", 1)
        try:
            kv = tuple(None if x == "16" else int(x) for x in (k, v))
        except ValueError:
            raise SweepError(f"grid.bits entry {b!r}: expected 'K<bits>V<bits>', e.g. 'K4V2'") from None
    else:
        raise SweepError(f"grid.bits entry {b!r}: expected an int in {list(CACHE_BITS)} or a string like 'K4V2'")
    for x in kv:
        if x is not None and x not in CACHE_BITS:
            raise SweepError(f"grid.bits entry {b!r}: bits must be in {list(CACHE_BITS)} (16 = full precision)")
    return kv


@dataclass
class SweepConfig:
    out: Path
    models: list[str]
    transforms: list[str]
    bits: list[tuple[int | None, int | None]]
    quantizers: list[str] = field(default_factory=lambda: ["quest"])
    evaluations: list[str] = field(default_factory=lambda: ["ppl"])
    eval: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    resources: dict = field(default_factory=dict)

    EVAL_DEFAULTS = {"chunks": 4, "seq_len": 2048, "text_file": None, "sink": 16, "keep": 128, "flush": 16, "recon_seqs": 1,
                     "dtype": "float32", "device": "cpu"}
    CALIB_DEFAULTS = {"samples": 16, "seq_len": 2048, "text_file": None, "damping": 0.01}
    RESOURCE_DEFAULTS = {"num_cpus": 1, "num_gpus": 0}

    @classmethod
    def load(cls, path: str | Path) -> SweepConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"sweep file {str(path)!r} does not exist")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise SweepError(f"{str(path)!r} is not valid TOML: {e}") from None
        return cls.from_dict(raw, base=path.parent)

    @classmethod
    def from_dict(cls, raw: dict, base: Path = Path(".")) -> SweepConfig:
        from .config import QUANTIZER_NAMES

        unknown = set(raw) - set(_SECTIONS) - {"out"}
        if unknown:
            raise SweepError(f"unknown top-level keys {sorted(unknown)}; known: ['out'] + {sorted(_SECTIONS)}")
        for sec, keys in _SECTIONS.items():
            bad = set(raw.get(sec, {})) - keys
            if bad:
                raise SweepError(f"unknown keys {sorted(bad)} in [{sec}]; known: {sorted(keys)}")
        grid = raw.get("grid", {})
        for k in ("models", "transforms", "bits"):
            if not grid.get(k):
                raise SweepError(f"[grid] needs a non-empty list `{k}`")
        transforms = []
        for t in grid["transforms"]:
            try:
                m = parse(t)
            except UnknownMethodError:
                raise SweepError(f"unknown transform {t!r} in grid.transforms; {grammar_help()}") from None
            except ValueError as e:
                raise SweepError(f"grid.transforms entry {t!r}: {e}") from None
            if not isinstance(m, MethodSpec):
                raise SweepError(f"grid.transforms entry {t!r}: a sweep runs wushkv methods; {grammar_help()}")
            transforms.append(canonical_name(m))  # results are keyed by the canonical name
        quantizers = list(grid.get("quantizers", ["quest"]))
        for q in quantizers:
            if q not in ("quest", "affine", "kivi"):
                raise SweepError(f"grid.quantizers entry {q!r}: use quest, affine or kivi (tiles come with the kvarn transform and with <transform>+tiles); "
                                 f"known quantizers: {list(QUANTIZER_NAMES)}")
        evaluations = list(grid.get("evaluations", ["ppl"]))
        for e in evaluations:
            if e not in EVALUATIONS:
                raise SweepError(f"grid.evaluations entry {e!r}; known: {list(EVALUATIONS)}")

        def resolve(d: dict) -> dict:
            d = dict(d)
            if d.get("text_file"):
                d["text_file"] = str((base / d["text_file"]).resolve()) if not Path(d["text_file"]).is_absolute() else d["text_file"]
            return d

        calibration = cls.CALIB_DEFAULTS | resolve(raw.get("calibration", {}))
        # wush_a / skip_first / skip_first_queries enter the calibration (and job) keys only when used, so older sweeps keep their results
        wants_a = [t for t in transforms if parse(t).uses_wush_a]
        if wants_a:
            if calibration.get("wush_a") is False:
                raise SweepError(f"grid.transforms {wants_a} need the attention-aware statistics: remove `wush_a = false` from [calibration]")
            calibration["wush_a"] = True
        nonneg = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
        for k, ok in (("wush_a", lambda v: isinstance(v, bool)), ("skip_first", nonneg), ("skip_first_queries", nonneg)):
            if k in calibration and not ok(calibration[k]):
                raise SweepError(f"[calibration] {k} = {calibration[k]!r}: expected {'true or false' if k == 'wush_a' else 'an integer >= 0'}")
        models = [str((base / m).resolve()) if (base / m).exists() and not Path(m).is_absolute() else m for m in grid["models"]]
        cfg = cls(
            out=(base / raw.get("out", "sweep-out")).resolve(),
            models=models,
            transforms=transforms,
            bits=[_parse_bits(b) for b in grid["bits"]],
            quantizers=quantizers,
            evaluations=evaluations,
            eval=cls.EVAL_DEFAULTS | resolve(raw.get("eval", {})),
            calibration=calibration,
            resources=cls.RESOURCE_DEFAULTS | raw.get("resources", {}),
        )
        cfg.quant_config("hadamard", "quest", 2, 2)  # validates windows early
        return cfg

    # -- the grid ---------------------------------------------------------------------------
    def jobs(self) -> list[Job]:
        jobs = []
        for m in self.models:
            for e in self.evaluations:
                if e == "ppl":
                    jobs.append(Job(m, FULL_PRECISION, None, None, "-", e))
                for t in self.transforms:
                    for q in quantizers_of(t, self.quantizers):
                        for k, v in self.bits:
                            jobs.append(Job(m, t, k, v, q, e))
        return list(dict.fromkeys(jobs))

    def quant_config(self, transform: str, quantizer: str, k_bits, v_bits):
        from .config import QuantConfig, WindowConfig

        e = self.eval
        base = QuantConfig(k_bits=k_bits, v_bits=v_bits, quantizer="quest" if quantizer == "kvarn" else quantizer,
                           windows=WindowConfig(e["sink"], e["keep"], e["flush"]))
        return method_config(transform, base)

    def job_id(self, job: Job) -> str:
        key = {"job": asdict(job), "eval": self.eval, "resources": self.resources,
               "calibration": self.calibration if job.transform != FULL_PRECISION else None}
        return settings_key(key)

    def calibration_key(self, model: str) -> str:
        return settings_key({"model": model, "calibration": self.calibration, "dtype": self.eval["dtype"]})

    def settings(self) -> dict:
        return {"eval": self.eval, "calibration": self.calibration, "resources": self.resources}


# -- work done by one job (same code in a Ray task and in-process) -------------------------------
def _load_model(cfg: SweepConfig, name: str):
    from .models import load

    return load(name, dtype=cfg.eval["dtype"], device=cfg.eval["device"])


def calibration_bytes(cfg: SweepConfig, model_name: str, model=None, tok=None) -> bytes:
    """Calibrate ``model_name`` (or read the kept file) and return the safetensors file's bytes."""
    import torch

    from .calibration import calibrate

    path = cfg.out / "calibrations" / f"{cfg.calibration_key(model_name)}.safetensors"
    if not path.is_file():
        if model is None:
            model, tok = _load_model(cfg, model_name)
        c = cfg.calibration
        prev = torch.get_num_threads()
        torch.set_num_threads(int(cfg.resources["num_cpus"]))
        try:
            cal = calibrate(model, tok, samples=c["samples"], seq_len=c["seq_len"], text_file=c["text_file"],
                            damping=c["damping"], wush_a=c.get("wush_a", False), skip_first=c.get("skip_first", 0), show_progress=False,
                            skip_first_queries=c.get("skip_first_queries", 0))
        finally:
            torch.set_num_threads(prev)
        cal.save(path)
    return path.read_bytes()


def _calibration_from_bytes(data: bytes, model):
    from .calibration import Calibration

    fd, tmp = tempfile.mkstemp(suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return Calibration.load(tmp, model)
    finally:
        os.unlink(tmp)


def execute(cfg: SweepConfig, job: Job, cal_bytes: bytes | None = None, model=None, tok=None, cal=None) -> dict:
    """Run one job; returns its result record (``value``: PPL for ppl, geomean error for recon).
    ``cal``: an already loaded calibration (in-process runs load it once per model), else ``cal_bytes``."""
    import torch

    from .calibration import calibration_sequences
    from .data import load_eval_text, tokenize_chunks
    from .eval.compare import quantized_perplexity
    from .methods.install import transforms_for
    from .eval.perplexity import perplexity
    from .eval.reconstruction import layer_reconstruction

    t0 = time.perf_counter()
    if model is None:
        model, tok = _load_model(cfg, job.model)
    prev = torch.get_num_threads()
    torch.set_num_threads(int(cfg.resources["num_cpus"]))
    try:
        e = cfg.eval
        if cal is None and cal_bytes is not None:
            cal = _calibration_from_bytes(cal_bytes, model)
        if job.evaluation == "ppl":
            text, _ = load_eval_text(e["text_file"])
            chunks = tokenize_chunks(tok, text, e["seq_len"], e["chunks"])
            if job.transform == FULL_PRECISION:
                r = perplexity(model, chunks, show_progress=False)
            else:
                qc = cfg.quant_config(job.transform, job.quantizer, job.k_bits, job.v_bits)
                r = quantized_perplexity(model, chunks, cal, job.transform, qc, show_progress=False)
            value, extra = r["ppl"], {"tokens": r["tokens"], "chunks": r["chunks"]}
        elif job.evaluation == "recon":
            c = cfg.calibration
            n = c["samples"]
            held = calibration_sequences(tok, n + e["recon_seqs"], c["seq_len"], c["text_file"])[n:]  # held out
            qc = cfg.quant_config(job.transform, job.quantizer, job.k_bits, job.v_bits)
            res = layer_reconstruction(model, held, {job.transform: transforms_for(model, cal, job.transform)}, qc, show_progress=False)
            value, extra = res[job.transform]["geomean"], {"per_layer": res[job.transform]["per_layer"]}
        else:  # pragma: no cover - validated in SweepConfig
            raise SweepError(job.evaluation)
    finally:
        torch.set_num_threads(prev)
    return {"job": asdict(job), "value": value, "seconds": time.perf_counter() - t0, **extra}


# -- drivers ---------------------------------------------------------------------------------
def _finished(cfg: SweepConfig) -> dict[str, dict]:
    done = {}
    for job in cfg.jobs():
        p = cfg.out / "jobs" / f"{cfg.job_id(job)}.json"
        if p.is_file():
            try:
                rec = read_json(p, "sweep job result")
            except (ValueError, OSError):
                continue  # unreadable: run again
            if rec.get("job") == asdict(job):
                done[cfg.job_id(job)] = rec
    return done


def _save_result(cfg: SweepConfig, job: Job, rec: dict) -> None:
    write_json(cfg.out / "jobs" / f"{cfg.job_id(job)}.json", rec)


def run_sweep(cfg: SweepConfig, ray_address: str | None = None, max_jobs: int | None = None, show_progress: bool = True, log=print) -> dict:
    """Run every unfinished job (at most ``max_jobs``), then :func:`collect`. Returns the collected results
    with ``ran``: the labels of the jobs run by this call."""
    from .progress import progress

    done = _finished(cfg)
    todo = [j for j in cfg.jobs() if cfg.job_id(j) not in done]
    if max_jobs is not None:
        todo = todo[:max_jobs]
    log(f"sweep: {len(cfg.jobs())} jobs, {len(done)} finished, running {len(todo)}" + (f" on Ray ({ray_address})" if ray_address else " in-process"))
    ran = []
    if todo:
        needs_cal = {j.model for j in todo if j.transform != FULL_PRECISION and _calibrated(j.transform)}
        bar = progress(total=len(todo), desc="sweep", enabled=show_progress, unit="job")
        if ray_address is None:
            for model_name in dict.fromkeys(j.model for j in todo):
                model, tok = _load_model(cfg, model_name)
                cal = _calibration_from_bytes(calibration_bytes(cfg, model_name, model, tok), model) if model_name in needs_cal else None
                for job in (j for j in todo if j.model == model_name):
                    rec = execute(cfg, job, model=model, tok=tok, cal=cal if _calibrated(job.transform) else None)
                    _save_result(cfg, job, rec)
                    ran.append(job.label())
                    bar.update(1)
        else:
            ran = _run_ray(cfg, todo, needs_cal, ray_address, bar)
        bar.close()
    out = collect(cfg)
    out["ran"] = ran
    return out


def _calibrated(transform: str) -> bool:
    return parse(transform).needs_calibration


def _run_ray(cfg: SweepConfig, todo: list[Job], needs_cal: set[str], address: str, bar) -> list[str]:
    try:
        import ray
    except ImportError as e:
        raise SweepError(f"--ray-address needs Ray: pip install 'wushkv[ray]' ({e})") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        res = cfg.resources
        cal_task = ray.remote(num_cpus=res["num_cpus"], num_gpus=res["num_gpus"])(calibration_bytes)
        job_task = ray.remote(num_cpus=res["num_cpus"], num_gpus=res["num_gpus"])(execute)
        cfg_ref = ray.put(cfg)
        cal_refs = {m: cal_task.remote(cfg_ref, m) for m in sorted(needs_cal)}  # once per model, shared by reference
        pending = {}
        for job in todo:
            ref = job_task.remote(cfg_ref, job, cal_refs[job.model] if _calibrated(job.transform) else None)
            pending[ref] = job
        ran = []
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            job = pending.pop(ready[0])
            _save_result(cfg, job, ray.get(ready[0]))
            ran.append(job.label())
            bar.update(1)
        return ran
    finally:
        if started:
            ray.shutdown()


# -- collection --------------------------------------------------------------------------------
def collect(cfg: SweepConfig) -> dict:
    """Gather finished jobs into ``results.json``, ``results.md`` and one PNG per (model, evaluation)."""
    from .report import markdown_table, plot_lines

    done = _finished(cfg)
    rows = []
    for job in cfg.jobs():
        rec = done.get(cfg.job_id(job))
        rows.append({**asdict(job), "value": None if rec is None else rec["value"], "seconds": None if rec is None else rec["seconds"]})
    out = {"settings": cfg.settings(), "models": cfg.models, "results": rows,
           "finished": sum(r["value"] is not None for r in rows), "total": len(rows)}
    write_json(cfg.out / "results.json", out)

    md = []
    bit_labels = [f"K{'16' if k is None else k}V{'16' if v is None else v}" for k, v in cfg.bits]
    for m in cfg.models:
        for e in cfg.evaluations:
            what = "perplexity" if e == "ppl" else "layer reconstruction error (geomean)"
            md.append(f"### {Path(m).name}: {what}\n")
            fp = next((r["value"] for r in rows if r["model"] == m and r["evaluation"] == e and r["transform"] == FULL_PRECISION), None)
            if fp is not None:
                md.append(f"full precision: {fp:.4g}\n")
            table, series = [], {}
            for t in cfg.transforms:
                for q in quantizers_of(t, cfg.quantizers):
                    vals = [next((r["value"] for r in rows if r["model"] == m and r["evaluation"] == e and r["transform"] == t
                                  and r["quantizer"] == q and (r["k_bits"], r["v_bits"]) == kv), None) for kv in cfg.bits]
                    table.append([t, q] + [float("nan") if v is None else v for v in vals])
                    series[f"{t} ({q})"] = [float("nan") if v is None else v for v in vals]
            md.append(markdown_table(["transform", "quantizer"] + bit_labels, table) + "\n")
            if any(v == v for s in series.values() for v in s):
                plot_lines(list(range(len(bit_labels))), series, cfg.out / f"results_{Path(m).name}_{e}.png", "bits (" + ", ".join(
                    f"{i}={b}" for i, b in enumerate(bit_labels)) + ")", what, f"{Path(m).name}: {what}", logy=True,
                    hline=fp, hlabel="full precision")
    atomic_write(cfg.out / "results.md", lambda tmp: Path(tmp).write_text("\n".join(md), encoding="utf-8"))
    return out
