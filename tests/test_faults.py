"""Faults: runs killed mid-write, damaged files, two runs writing one output (issue #36).

Each: a clear error or a correct result, nothing lost, nothing half-written. The killed runs are real ``python -m
wushkv.cli`` subprocesses on a tiny model saved to disk, killed with SIGKILL at points found by watching their output
folder (the moment a temporary file of the final output appears: the write itself); the reference results are made
in this process by the same CLI, and the rerun after the kill must equal them.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import hf_char_tokenizer, tiny_model
from wushkv.calibration import Calibration, CalibrationError
from wushkv.cli import main
from wushkv.export import read_export
from wushkv.io import CorruptFileError, OutputLockedError, atomic_write, exclusive_output, lock_path, read_json, write_json
from wushkv.runs import read_run

WINDOWS = ["--sink", "4", "--keep", "16", "--flush", "4"]


# -- the tiny artifacts every test here starts from -------------------------------------------------------------------
@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """A tiny llama saved with its tokenizer, a text, and the reference outputs of ``calibrate``, ``compare`` and
    ``export`` made by the CLI in this process: a namespace of paths and argument lists."""
    d = tmp_path_factory.mktemp("faults")
    model = tiny_model("llama", vocab_size=128, max_position_embeddings=1024)
    model.save_pretrained(d / "m")
    hf_char_tokenizer().save_pretrained(d / "m")
    text = d / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)

    class A:
        pass

    a = A()
    a.dir, a.model, a.text = d, d / "m", text
    a.calibrate = lambda out: ["calibrate", "--model", str(a.model), "--samples", "2", "--seq-len", "64",
                               "--calib-text-file", str(text), "--out", str(out)]
    a.compare = lambda cal, out: ["compare", "--model", str(a.model), "--calibration", str(cal), "--transforms",
                                  "identity,hadamard,wush,oscar", "--bits", "2,3", "--text-file", str(text), "--seq-len", "120",
                                  "--chunks", "2", *WINDOWS, "--json", str(out)]
    a.export = lambda cal, out: ["export", "--calibration", str(cal), "--out", str(out)]
    a.cal, a.cmp, a.exp = d / "ref" / "c.safetensors", d / "ref" / "r.json", d / "ref" / "e.safetensors"
    assert main(a.calibrate(a.cal)) == 0
    assert main(a.compare(a.cal, a.cmp)) == 0
    assert main(a.export(a.cal, a.exp)) == 0
    return a


def _same_calibration(a: Calibration, b: Calibration) -> bool:
    strip = lambda m: {k: v for k, v in m.items() if k not in ("date", "seconds")}  # noqa: E731
    return (strip(a.meta) == strip(b.meta) and len(a.stats) == len(b.stats)
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a.stats, b.stats))
            and a.solved.keys() == b.solved.keys()
            and all(torch.equal(s, t) for m in a.solved for p, q in zip(a.solved[m], b.solved[m])
                    for s, t in zip(p.tensors().values(), q.tensors().values())))


def _results(run: dict) -> dict:
    """What a compare run found, less the timings."""
    fp = {k: v for k, v in run["fp"].items() if k != "seconds"}
    rows = {t: {b: {k: v for k, v in r.items() if k != "seconds"} for b, r in by.items()} for t, by in run["results"].items()}
    return {"fp": fp, "results": rows}


# -- killing a subprocess at a point of its writes ----------------------------------------------------------------------
def _temp_of(path: Path) -> bool:
    """A temporary file of ``atomic_write`` for ``path`` exists: a write of it is under way."""
    return any(f.startswith(f".{path.name}.") and f.endswith(".tmp") for f in os.listdir(path.parent)) if path.parent.is_dir() else False


def _temporaries(folder: Path) -> list[str]:
    """The temporary files of ``atomic_write`` in ``folder`` (``.NAME.XXXXXXXX.tmp``)."""
    return sorted(f for f in os.listdir(folder) if f.startswith(".") and f.endswith(".tmp"))


def _leave_stale_temporary(path: Path) -> None:
    """A temporary file of ``path`` as a run killed inside its write leaves it (mkstemp's name): whether the kill
    itself left one is a race with the rename, so the rerun's cleanup is always given one to remove."""
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / f".{path.name}.k1lled_0.tmp").write_bytes(b"half a file")


def _run_killed(argv: list[str], trigger, timeout: float = 120) -> tuple[bool, str]:
    """Run ``python -m wushkv.cli ARGV`` and SIGKILL it the moment ``trigger()`` is true (polled every ~0.2 ms);
    (killed, stderr). A run that finishes first is not killed (the caller's checks still hold)."""
    proc = subprocess.Popen([sys.executable, "-m", "wushkv.cli", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    t0, killed = time.monotonic(), False
    while proc.poll() is None:
        if trigger():
            proc.send_signal(signal.SIGKILL)
            killed = True
            break
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"{argv[0]} ran past {timeout}s")
        time.sleep(0.0002)
    _, err = proc.communicate()
    err = err.decode(errors="replace")
    assert killed or proc.returncode == 0, err
    if killed:
        assert proc.returncode == -signal.SIGKILL
    return killed, err


def test_atomic_write_killed_inside_the_write(tmp_path):
    """SIGKILL in the middle of the write callback (half the bytes out): the final name keeps the old file, or stays
    absent; only a hidden temporary file is left beside it."""
    import multiprocessing

    def half_then_die(target):
        def w(tmp):
            with open(tmp, "wb") as f:
                f.write(b"x" * 5000)
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        atomic_write(target, w)

    ctx = multiprocessing.get_context("fork")
    old = tmp_path / "old.bin"
    old.write_bytes(b"the old content")
    for target in (old, tmp_path / "new.bin"):
        p = ctx.Process(target=half_then_die, args=(target,))
        p.start()
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
    assert old.read_bytes() == b"the old content" and not (tmp_path / "new.bin").exists()
    left = sorted(f.name for f in tmp_path.iterdir() if f.name not in ("old.bin",))
    assert len(left) == 2 and all(n.startswith((".old.bin.", ".new.bin.")) and n.endswith(".tmp") for n in left)


@pytest.mark.slow
def test_calibrate_and_export_killed_mid_write(art, tmp_path):
    """``calibrate`` and ``export`` killed while writing their output: nothing, or the complete file, under the final
    name; a rerun writes what an uninterrupted run writes, and removes the temporary file the killed run left."""
    ref_cal, (ref_meta, ref_exp) = Calibration.load(art.cal), read_export(art.exp)
    out = tmp_path / "c.safetensors"
    killed, _ = _run_killed(art.calibrate(out), lambda: _temp_of(out))
    if out.exists():  # the kill came after the rename
        assert _same_calibration(Calibration.load(out), ref_cal)
    _leave_stale_temporary(out)
    _leave_stale_temporary(Path(f"{out}.json"))
    assert main(art.calibrate(out)) == 0
    assert _same_calibration(Calibration.load(out), ref_cal)
    assert _temporaries(tmp_path) == []

    exp = tmp_path / "e.safetensors"
    killed, _ = _run_killed(art.export(art.cal, exp), lambda: _temp_of(exp))
    if exp.exists():
        assert read_export(exp)[1].keys() == ref_exp.keys()
    _leave_stale_temporary(exp)
    assert main(art.export(art.cal, exp)) == 0
    meta, tensors = read_export(exp)
    assert meta == ref_meta and tensors.keys() == ref_exp.keys() and all(torch.equal(tensors[k], ref_exp[k]) for k in tensors)
    assert _temporaries(tmp_path) == []


@pytest.mark.slow
def test_compare_killed_mid_write_resumes(art, tmp_path, capsys, after=2):
    """``compare --json`` killed while writing the JSON after ``after`` results: the file under the final name is
    always a complete run file holding a prefix of the results; the rerun resumes (runs only what is missing) and
    ends with the results of an uninterrupted run."""
    out = tmp_path / "r.json"
    seen = []

    def trigger():
        try:
            n = sum(len(by) for by in read_json(out)["results"].values()) if out.exists() else -1
        except (ValueError, OSError):  # a damaged file under the final name would fail the test below
            n = -2
        seen.append(n)
        return (n >= after and _temp_of(out)) or n > after + 1

    killed, _ = _run_killed(art.compare(art.cal, out), trigger)
    assert -2 not in seen  # never a half-written file under the final name
    ref = _results(read_json(art.cmp))
    partial = None
    if out.exists():
        partial = _results(read_run(out, ("settings", "results")))
        assert partial["fp"] == ref["fp"]
        assert all(partial["results"][t][b] == ref["results"][t][b] for t in partial["results"] for b in partial["results"][t])
    _leave_stale_temporary(out)
    assert main(art.compare(art.cal, out)) == 0
    err = capsys.readouterr().err
    if partial is not None:
        assert "resuming from" in err
        assert err.count(" PPL ") == 8 - sum(len(by) for by in partial["results"].values())  # the missing ones only
    assert _results(read_json(out)) == ref
    assert _temporaries(tmp_path) == []  # the killed run's temporary of r.json went with the rerun's lock


@pytest.mark.slow
def test_sweep_killed_mid_write_resumes(art, tmp_path):
    """``sweep`` killed while writing a job's result: every job file under its final name is a complete record; the
    rerun runs only the missing jobs and collects the results of an uninterrupted run."""
    (tmp_path / "eval.txt").write_text(art.text.read_text())
    base = f'''[grid]
models = ["{art.model}"]
transforms = ["hadamard", "wush"]
bits = [2]
quantizers = ["quest"]
evaluations = ["ppl"]
[eval]
chunks = 2
seq_len = 96
text_file = "eval.txt"
sink = 4
keep = 16
flush = 4
[calibration]
samples = 2
seq_len = 64
text_file = "eval.txt"
[resources]
num_cpus = 1
'''
    for name in ("ref", "run"):
        (tmp_path / f"{name}.toml").write_text(f'out = "{name}"\n' + base)
    assert main(["sweep", "--config", str(tmp_path / "ref.toml")]) == 0
    jobs = tmp_path / "run" / "jobs"
    killed, _ = _run_killed(["sweep", "--config", str(tmp_path / "run.toml")],
                            lambda: jobs.is_dir() and any(f.endswith(".tmp") for f in os.listdir(jobs)) and len(os.listdir(jobs)) >= 2)
    for f in jobs.glob("*.json"):
        assert read_json(f)["value"] > 0  # complete records only
    _leave_stale_temporary(jobs / "0123456789abcdef.json")
    assert main(["sweep", "--config", str(tmp_path / "run.toml")]) == 0
    assert _temporaries(jobs) == [] and _temporaries(tmp_path / "run") == []
    vals = lambda name: [(r["transform"], r["k_bits"], r["value"]) for r in read_json(tmp_path / name / "results.json")["results"]]  # noqa: E731
    assert vals("run") == vals("ref") and all(v is not None for *_, v in vals("run"))


# -- a write that fails, an interrupted run ----------------------------------------------------------------------------------
def test_a_write_that_fails_keeps_the_old_file(tmp_path):
    """A disk that fills up in the middle of a write (ENOSPC from the writer): the previous file stays under the final
    name, no temporary is left, and the error names the file."""
    import errno

    def fill_up(tmp):
        with open(tmp, "wb") as f:
            f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    old = tmp_path / "r.json"
    write_json(old, {"results": 1})
    with pytest.raises(OSError, match=rf"No space left on device while writing {old} \(the previous file is kept\)") as e:
        atomic_write(old, fill_up)
    assert e.value.errno == errno.ENOSPC
    assert read_json(old) == {"results": 1} and _temporaries(tmp_path) == []
    with pytest.raises(OSError, match="nothing was written"):
        atomic_write(tmp_path / "new.json", fill_up)
    assert not (tmp_path / "new.json").exists() and _temporaries(tmp_path) == []


@pytest.mark.slow
def test_calibrate_past_the_file_size_limit_keeps_the_old_file(art, tmp_path):
    """``calibrate`` whose output cannot be written (the process may write files of at most 64 KiB: RLIMIT_FSIZE, the
    way a full disk fails a write): exit 2 with a message naming the file, no traceback, the previous calibration
    intact under the final name and no temporary beside it."""
    import resource

    out = tmp_path / "c.safetensors"
    out.write_bytes(art.cal.read_bytes())
    assert art.cal.stat().st_size > 65536

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))

    r = subprocess.run([sys.executable, "-m", "wushkv.cli", *art.calibrate(out)], capture_output=True, text=True, timeout=120,
                       preexec_fn=limit)
    assert r.returncode == 2, r.stderr
    assert f"while writing {out} (the previous file is kept)" in r.stderr and "Traceback" not in r.stderr
    assert out.read_bytes() == art.cal.read_bytes() and _temporaries(tmp_path) == []


def _sigint_back():
    """In the child before exec: SIGINT delivered and handled by default (what a terminal's Ctrl-C meets)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow
def test_compare_interrupted_resumes(art, tmp_path, capsys):
    """Ctrl-C (SIGINT) in a ``compare --json`` run once a result is saved: exit 130 with a line saying so, no
    traceback; the file is a complete run file holding a prefix of the results, no temporary is left, and the
    rerun resumes and ends with the results of an uninterrupted run. 16 cells of 4 chunks each, so that the run is
    still going when the interrupt arrives on a loaded machine. The child gets SIGINT back, unblocked and with its
    default disposition: an ignored or blocked SIGINT is inherited through exec, and in two full clean-clone runs
    (not alone) the child finished its run instead of stopping, and the test skipped."""
    def compare(out):
        argv = art.compare(art.cal, out)
        argv[argv.index("--bits") + 1], argv[argv.index("--chunks") + 1] = "2,3,4,8", "4"
        return argv

    assert main(compare(tmp_path / "ref.json")) == 0
    ref = _results(read_json(tmp_path / "ref.json"))
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "wushkv.cli", *compare(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_back)
    t0 = time.monotonic()
    while not (out.exists() and sum(len(by) for by in read_json(out)["results"].values()) >= 1):
        assert proc.poll() is None and time.monotonic() - t0 < 120, "compare saved no result"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("compare finished before the interrupt reached it")
    assert proc.returncode == 130, err
    assert "wushkv compare: interrupted; the files it wrote are whole" in err and "Traceback" not in err
    partial = _results(read_run(out, ("settings", "results")))
    assert all(partial["results"][t][b] == ref["results"][t][b] for t in partial["results"] for b in partial["results"][t])
    assert _temporaries(tmp_path) == []
    assert main(compare(out)) == 0
    assert "resuming from" in capsys.readouterr().err
    assert _results(read_json(out)) == ref


# -- two runs writing one output ------------------------------------------------------------------------------------------
def test_output_lock_refuses_a_second_writer(tmp_path):
    out = tmp_path / "r.json"
    # a killed run's temporary of r.json, and those of r2.json and of r.json.x (other outputs)
    stale, *others = (tmp_path / n for n in (".r.json.ab_c1234.tmp", ".r2.json.ab_c1234.tmp", ".r.json.x.ab_c1234.tmp"))
    for f in (stale, *others):
        f.write_text("{")
    with exclusive_output(out):
        assert not stale.exists() and all(f.exists() for f in others)  # its own output's leftovers go, others' stay
        assert lock_path(out).read_text().strip() == str(os.getpid())
        with pytest.raises(OutputLockedError, match=rf"another wushkv run is writing {out} \(pid {os.getpid()}\)"):
            with exclusive_output(out):
                pass
    with exclusive_output(out):  # released: taken again
        pass


@pytest.mark.parametrize("command", ["compare", "agree", "passkey", "ppl", "tune-clip", "calibrate", "calibrate PATH.json", "export",
                                     "compare --plot", "passkey NAME_pkey.png", "merge agree", "sweep",
                                     "calibration upgrade PATH.json"])
def test_every_command_refuses_a_file_another_run_writes(art, tmp_path, command, capsys):
    """Every command holds the lock of every file it writes (--json, --out, --markdown, --plot, and the files it writes
    beside them) for the whole run: while another run holds one, the command is refused at once, naming the file, and
    leaves it as it was."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    model = ["--model", str(art.model), "--calibration", str(art.cal)]
    passkey = ["passkey", *model, "--transforms", "hadamard", "--contexts", "300"]
    (tmp_path / "sweep.toml").write_text(f'out = "{tmp_path}"\n[grid]\nmodels = ["{art.model}"]\ntransforms = ["hadamard"]\n'
                                         'bits = [2]\nevaluations = ["ppl"]\n')
    argv, held = {  # the command line, and the file another run holds
        "compare": (art.compare(art.cal, out), out),
        "agree": (["agree", *model, "--transforms", "hadamard", "--prompts", "1", "--text-file", str(art.text), "--json", str(out)], out),
        "passkey": ([*passkey, "--json", str(out)], out),
        "ppl": (["ppl", "--model", str(art.model), "--text-file", str(art.text), "--json", str(out)], out),
        "tune-clip": (["tune-clip", *model, "--transforms", "wush", "--text-file", str(art.text), "--out", str(out)], out),
        "calibrate": (art.calibrate(out), out),
        "calibrate PATH.json": (art.calibrate(tmp_path / "r"), out),  # the metadata copy beside --out r
        "export": (art.export(art.cal, out), out),
        "compare --plot": ([*art.compare(art.cal, tmp_path / "c.json"), "--plot", str(png)], png),
        "passkey NAME_pkey.png": ([*passkey, "--plot", str(png)], tmp_path / "r_pkey.png"),
        "merge agree": (["merge", "agree", str(art.cmp), "--out", str(out)], out),
        "calibration upgrade PATH.json": (["calibration", "upgrade", "--calibration", str(art.cal), "--out", str(tmp_path / "r")], out),
        "sweep": (["sweep", "--config", str(tmp_path / "sweep.toml")], tmp_path / "results.json"),  # the lock of its folder's results.json
    }[command]
    held.write_text('{"partial": "results of the other run"}\n')
    with exclusive_output(held):
        assert main(argv) == 2
    assert f"another wushkv run is writing {held}" in capsys.readouterr().err
    assert held.read_text() == '{"partial": "results of the other run"}\n'


@pytest.mark.slow
@pytest.mark.parametrize("command", ["compare", "calibrate"])
def test_two_runs_writing_one_file(art, tmp_path, command):
    """Two ``compare`` processes with the same ``--json`` (two ``calibrate`` with the same ``--out``): the second is
    refused while the first holds the file (naming the first's pid), the first's results are complete and untouched."""
    out = tmp_path / ("r.json" if command == "compare" else "c.safetensors")
    argv = [sys.executable, "-m", "wushkv.cli", *(art.compare(art.cal, out) if command == "compare" else art.calibrate(out))]
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while not (lock_path(out).is_file() and lock_path(out).read_text().strip() == str(first.pid)):
        assert first.poll() is None and time.monotonic() - t0 < 120, "the first compare never took its lock"
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # hold it inside its run while the second starts
    try:
        second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert f"another wushkv run is writing {out} (pid {first.pid})" in second.stderr
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err.decode()
    if command == "compare":
        assert _results(read_json(out)) == _results(read_json(art.cmp))
    else:
        assert _same_calibration(Calibration.load(out), Calibration.load(art.cal))


# -- damaged files ---------------------------------------------------------------------------------------------------------
def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def _damage():
    """A damage to a file of bytes: a truncation to n bytes, or one byte XORed with a nonzero mask (often in the
    header, where a change can keep the file parseable)."""
    trunc = st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True), st.just(0), st.just(False))
    flip = st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(1, 255), st.booleans())
    return st.one_of(trunc, flip)


def _apply(data: bytes, damage, header_end: int | None = None) -> bytes:
    kind, where, mask, in_header = damage
    if kind == "truncate":
        return data[: int(where * len(data))]
    n = header_end if in_header and header_end else len(data)
    i = int(where * n)
    return data[:i] + bytes([data[i] ^ mask]) + data[i + 1:]


def _write_tmp(data: bytes, suffix: str) -> Path:
    fd, p = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(p)


FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FEW
@given(damage=_damage())
def test_a_damaged_calibration_is_refused_or_identical(art, damage):
    """Every truncation and byte flip of a real calibration file either loads as exactly the original or is refused
    with a CalibrationError naming the file; never a raw error from the reader, never another calibration."""
    data = art.cal.read_bytes()
    bad = _write_tmp(_apply(data, damage, _header_end(data)), ".safetensors")
    try:
        try:
            cal = Calibration.load(bad)
        except CalibrationError as e:
            assert str(bad) in str(e)
            return
        assert _same_calibration(cal, Calibration.load(art.cal)) and cal.meta == Calibration.load(art.cal).meta
    finally:
        bad.unlink()


@FEW
@given(damage=_damage())
def test_a_damaged_export_is_refused_or_identical(art, damage):
    data = art.exp.read_bytes()
    bad = _write_tmp(_apply(data, damage, _header_end(data)), ".safetensors")
    try:
        try:
            meta, tensors = read_export(bad)
        except CorruptFileError as e:
            assert str(bad) in str(e)
            return
        ref_meta, ref = read_export(art.exp)
        assert meta == ref_meta and tensors.keys() == ref.keys() and all(torch.equal(tensors[k], ref[k]) for k in ref)
    finally:
        bad.unlink()


@FEW
@given(damage=_damage())
def test_a_damaged_result_json_is_refused_or_identical(art, damage):
    """A compare run file (what a resumed compare and ``merge compare`` read) damaged anywhere: read back exactly, or
    refused with a ValueError naming the file."""
    data = art.cmp.read_bytes()
    bad = _write_tmp(_apply(data, damage), ".json")
    try:
        try:
            run = read_run(bad, ("settings", "results"), "compare")
        except ValueError as e:
            assert str(bad) in str(e)
            return
        assert run == read_run(art.cmp, ("settings", "results"), "compare")
    finally:
        bad.unlink()


def test_json_checksum_catches_a_changed_number_and_spares_old_files(tmp_path):
    """The flip the property test may not draw: a digit of a result changed (still valid JSON) is refused; a file without
    the checksum (older versions, hand edits that drop it) is read as it is."""
    p = tmp_path / "r.json"
    write_json(p, {"settings": {"a": 1}, "results": {"wush": {"2": {"ppl": 12.345}}}})
    assert read_json(p) == {"settings": {"a": 1}, "results": {"wush": {"2": {"ppl": 12.345}}}}
    p.write_text(p.read_text().replace("12.345", "12.346"))
    with pytest.raises(CorruptFileError, match=f"{p} is damaged or was edited"):
        read_json(p)
    old = json.loads(p.read_text())
    del old["sha256"]
    p.write_text(json.dumps(old))
    assert read_json(p)["results"]["wush"]["2"]["ppl"] == 12.346


def test_a_changed_tensor_byte_is_refused_and_old_files_load(art, tmp_path):
    """A calibration whose statistics changed by one low mantissa bit (finite, plausible: nothing but the checksum can
    tell) is refused; the same file without a checksum (an older version's) loads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(art.cal), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    t = tensors["stats.0.M_K"].clone()
    t.view(torch.int64).view(-1)[5] ^= 1
    tensors["stats.0.M_K"] = t
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=header)
    with pytest.raises(CalibrationError, match=f"{bad}.*damaged"):
        Calibration.load(bad)
    del header["sha256"]
    save_file(tensors, str(bad), metadata=header)
    assert torch.equal(Calibration.load(bad).stats[0]["M_K"], t)



# -- a long generation ------------------------------------------------------------------------------------------------------
def _rss_trimmed() -> int | None:
    """Resident bytes of this process after glibc hands freed heap back (``malloc_trim``: the allocator keeps the
    attention temporaries of the last chunk otherwise, tens of MB that say nothing about what the cache holds);
    None off glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@torch.no_grad()
def test_sixteen_thousand_tokens_through_the_cache():
    """16k tokens (prefill in chunks, then greedy decoding) through a 2-bit cache on a tiny model: the logits stay
    finite, ``nbytes()`` equals the byte accounting at every checkpoint (so it grows linearly, by the per-token bytes
    of the quantized middle), and resident memory grows by the cache's bytes plus a fixed allowance, well under what
    a full-precision copy of the keys and values would take."""
    from wushkv.cache import WushKVCache
    from wushkv.config import QuantConfig, WindowConfig

    N, new, chunk = 16384, 32, 512
    L, H, d = 2, 1, 64
    model = tiny_model("llama", max_position_embeddings=N + 64, num_hidden_layers=L, num_attention_heads=2,
                       num_key_value_heads=H, head_dim=d)
    cfg = QuantConfig(2, 2, "quest", windows=WindowConfig(16, 128, 16))
    cache = WushKVCache(model, cfg)
    ids = torch.randint(3, 96, (1, N - new), generator=torch.Generator().manual_seed(0))
    per_token = L * H * 2 * (math.ceil(d * 2 / 8) + 2)  # per side: the 2-bit codes and one fp16 QuEST step

    def expected(n):
        nq = cfg.windows.quantized_count(n)
        return {"codes": L * H * nq * 2 * math.ceil(d * 2 / 8), "metadata": L * H * nq * 2 * 2,
                "full_precision": L * H * (n - nq) * d * 4 * 2}

    n, seen = 0, {}
    for s in range(0, N - new, chunk):
        logits = model(ids[:, s : s + chunk], cache=cache, use_cache=True, logits_to_keep=1).logits
        n += ids[:, s : s + chunk].shape[1]
        assert torch.isfinite(logits).all(), n
        nb = cache.nbytes()
        assert {k: nb[k] for k in ("codes", "metadata", "full_precision")} == expected(n), n
        if n % 4096 == 0:
            seen[n] = (nb["total"], _rss_trimmed())
    nxt = logits[:, -1:].argmax(-1)
    for _ in range(new):
        logits = model(nxt, cache=cache, use_cache=True, logits_to_keep=1).logits
        assert torch.isfinite(logits).all()
        nxt = logits[:, -1:].argmax(-1)
        n += 1
    nb = cache.nbytes()
    assert n == N and {k: nb[k] for k in ("codes", "metadata", "full_precision")} == expected(N)
    # linear: every 4096 tokens past the windows add the same bytes, those of 4096 quantized tokens
    steps = [seen[b][0] - seen[a][0] for a, b in zip(sorted(seen), sorted(seen)[1:])]
    assert steps == [per_token * 4096] * len(steps)
    a, b = 4096, max(seen)
    if seen[a][1] is not None:
        full_copy = L * H * (b - a) * d * 4 * 2  # what keeping these tokens in float32 would add (≈ 12.6 MB)
        rss_growth = seen[b][1] - seen[a][1]
        assert rss_growth <= seen[b][0] - seen[a][0] + 4 * 2**20 < full_copy, (rss_growth, full_copy)
