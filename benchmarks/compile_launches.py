"""Every kernel launch a test run makes, compiled for a GPU this machine does not have: which fail, which take long.

Without a GPU the kernel tests run under Triton's interpreter, which never compiles: a kernel that a GPU cannot
compile, or compiles in minutes, shows only on the GPU, inside ``benchmarks/gpu_check.sh``'s few minutes. This runs
the tests first (pytest in a subprocess, its launches recorded through ``wushkv.triton_kernels.launches_through``:
each distinct kernel, constexprs and argument kinds once), then compiles each launch for sm_90 as a GPU's run of
the same tests would launch it (the interpreter's own choices set to a GPU's: bfloat16 dots not emulated, 8 rows a
store program), with ``benchmarks/kernel_sass.py``'s compile and profile: seconds to compile, registers, stack and
instructions of each, the failures' errors.

    python benchmarks/compile_launches.py [--tests "tests/test_triton_kernels.py tests/test_vllm_plugin.py -k triton"]
        [--record out/launches.json] [--from out/launches.json] [--limit N] [--json out/compile_launches.json]

Session 73's run over the kernel, plugin and decode tests: 336 distinct launches, all compile (652 s); the slowest,
104 s, was the store kernel's affine clip at head_dim 128 (17.8 KB of stack a thread), since rewritten (1 s).
A test run here is single-process and slow (the kernel tests take ~10 minutes): ``--tests`` narrows it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

DEFAULT_TESTS = "tests/test_triton_kernels.py tests/test_vllm_plugin.py tests/test_decode.py"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", default=DEFAULT_TESTS, help="pytest arguments of the run whose launches are compiled")
    p.add_argument("--record", default=os.path.join(ROOT, "out", "launches.json"), help="where the run's launches go")
    p.add_argument("--from", dest="source", default=None, help="compile the launches recorded here (no test run)")
    p.add_argument("--limit", type=int, default=0, help="compile at most this many launches (0: all)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


# -- recording (a pytest plugin, in the test run's process) ----------------------------------------------------------
_RECORDED: dict = {}


def _kind(a):
    """What of a launch argument the compiler specializes on: a tensor's dtype and its pointer's 16-byte alignment,
    an integer's class (1, a multiple of 16, other; its value kept), a float, a bool."""
    import torch

    if torch.is_tensor(a):
        return {"tensor": str(a.dtype).removeprefix("torch."), "align": a.data_ptr() % 16}
    if isinstance(a, bool):
        return {"bool": a}
    if isinstance(a, int):
        return {"int": a, "class": 1 if a == 1 else 16 if a % 16 == 0 else 0}
    if isinstance(a, float):
        return {"float": a}
    return {"none": None}


def _meta(v):
    """A constexpr as JSON: triton dtypes by their name in ``triton.language`` (``float32``)."""
    return v if isinstance(v, (bool, int, float, str, type(None))) else {"tl": repr(v).rsplit(".", 1)[-1]}


def _launch_key(name: str, kinds: list[dict], meta: dict) -> str:
    """What tells two launches apart for the compiler: the kernel, its constexprs (as JSON) and its arguments' kinds
    (an integer's class, not its value; a float's nothing)."""
    return json.dumps([name, [{k: v for k, v in kd.items() if k not in ("int", "float")} for kd in kinds], meta],
                      sort_keys=True)


def pytest_sessionstart(session):
    """Records every launch of the run (the outermost hook: a test's own hooks run inside it)."""
    from wushkv import triton_kernels as tk

    def hook(name, grid, args, meta, run):
        kinds, as_json = [_kind(a) for a in args], {k: _meta(v) for k, v in meta.items()}
        _RECORDED.setdefault(_launch_key(name, kinds, as_json), {"name": name, "args": kinds, "meta": as_json})
        return run(name, grid, args, meta)

    session.config._launches = tk.launches_through(hook)
    session.config._launches.__enter__()


def pytest_sessionfinish(session, exitstatus):
    from wushkv.io import write_json

    session.config._launches.__exit__(None, None, None)
    write_json(os.environ["WUSHKV_LAUNCHES_OUT"], {"launches": list(_RECORDED.values())})


def record(tests: str, out: str) -> None:
    """Runs pytest on ``tests`` with this module as a plugin; the run's launches land in ``out``."""
    env = dict(os.environ, WUSHKV_LAUNCHES_OUT=out, TRITON_INTERPRET="1")  # the tests on CPU tensors
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"), os.path.dirname(__file__),
                                         env.get("PYTHONPATH", "")])
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "compile_launches", "-p", "no:cacheprovider", *shlex.split(tests)]
    print("recording:", " ".join(cmd[1:]), flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env=env)
    if not os.path.exists(out):
        raise SystemExit(f"the test run (exit {res.returncode}) recorded no launches into {out}")
    if res.returncode:
        print(f"warning: the test run failed (exit {res.returncode}); compiling what it launched", flush=True)


# -- compiling (this process, no interpreter) ------------------------------------------------------------------------
def as_gpu(launches: list[dict]) -> list[dict]:
    """The launches as a GPU's run of the same tests makes them, each distinct one once: no emulated bfloat16 dots
    (``EMU``), the store's 8 rows a program where the interpreter took 64 (``triton_kernels._store``)."""
    out, seen = [], set()
    for rec in launches:
        meta = dict(rec["meta"])
        if "EMU" in meta:
            meta["EMU"] = False
        if rec["name"] == "store" and meta.get("BR") == 64:
            meta["BR"] = 8
        key = _launch_key(rec["name"], rec["args"], meta)
        if key not in seen:
            seen.add(key)
            out.append({"name": rec["name"], "args": rec["args"], "meta": meta})
    return out


def _stand_ins(kinds: list[dict], keep: list):
    """Arguments of the recorded kinds: small tensors of the dtype at the same 16-byte alignment, the integers'
    and floats' values (only a pointer's dtype and alignment, and an integer's class, reach the compiler)."""
    import torch

    args = []
    for kd in kinds:
        if "tensor" in kd:
            dt = getattr(torch, kd["tensor"])
            base = torch.empty(512, dtype=torch.uint8)
            keep.append(base)
            shift = (kd["align"] - base.data_ptr() % 16) % 16
            args.append(base[shift:shift + 256].view(dt))
        else:
            args.append(next(iter(kd.values())) if "none" not in kd else None)
    return args


def compile_all(launches: list[dict], limit: int = 0) -> list[dict]:
    os.environ.pop("TRITON_INTERPRET", None)  # (before triton is imported: compiled, not interpreted)
    import triton.language as tl

    import kernel_sass

    tools = kernel_sass._tools()
    rows = []
    for i, rec in enumerate(launches[: limit or None]):
        keep: list = []
        meta = {k: getattr(tl, v["tl"]) if isinstance(v, dict) else v for k, v in rec["meta"].items()}
        row = {"name": rec["name"], "meta": rec["meta"]}
        t0 = time.perf_counter()
        try:
            prof = kernel_sass.profile(kernel_sass.compile_for_sm90((rec["name"], None, _stand_ins(rec["args"], keep), meta)),
                                       tools)
            row |= {"seconds": time.perf_counter() - t0, "registers": prof["usage"].get("reg"),
                    "stack": prof["usage"].get("stack"), "instructions": prof["instructions"]}
        except Exception as e:  # noqa: BLE001  (what the GPU would have met: reported, the others compiled on)
            row |= {"seconds": time.perf_counter() - t0, "error": f"{type(e).__name__}: {str(e)[-400:]}"}
        rows.append(row)
        status = row.get("error", f"{row['seconds']:.1f} s, {row['registers']} regs, stack {row['stack']}")
        print(f"[{i + 1}/{min(len(launches), limit or len(launches))}] {rec['name']}: {status}", flush=True)
    return rows


def run(args) -> dict:
    """Records (unless ``--from``) and compiles; returns {launches, failed, rows}."""
    source = args.source
    if source is None:
        os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
        record(args.tests, args.record)
        source = args.record
    with open(source) as f:
        launches = as_gpu(json.load(f)["launches"])
    print(f"{len(launches)} distinct launches", flush=True)
    t0 = time.perf_counter()
    rows = compile_all(launches, args.limit)
    failed = [r for r in rows if "error" in r]
    slow = sorted((r for r in rows if "error" not in r), key=lambda r: -r["seconds"])[:5]
    print(f"compiled {len(rows) - len(failed)} of {len(rows)} in {time.perf_counter() - t0:.0f} s; failed: {len(failed)}")
    for r in failed:
        print("  FAILED", r["name"], {k: v for k, v in r["meta"].items() if k in ("D", "BN", "BR", "PAGED", "K_TILE", "V_TILE")},
              r["error"][:300])
    for r in slow:
        print(f"  slowest {r['seconds']:.1f} s: {r['name']} stack {r['stack']} instructions {r['instructions']}")
    res = {"launches": len(rows), "failed": len(failed), "rows": rows}
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, res)
    return res


def main(argv=None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
