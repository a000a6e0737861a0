"""The optional fused CPU kernels of :mod:`wushkv.decode` (``csrc/codes.cpp``), built on first use.

``torch.utils.cpp_extension`` compiles them once per machine (tens of seconds, cached under
``~/.cache/torch_extensions``). Without a C++ compiler or ``ninja``, or with ``WUSHKV_NO_EXT=1``,
:func:`kernels` returns None and decoding uses the pure-PyTorch path (same results, slower).
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

_EXT = None
_LOCK = threading.Lock()


def kernels():
    """The compiled module (``code_dot``, ``code_weighted_sum``), or None where it cannot be built."""
    global _EXT
    if _EXT is None:
        with _LOCK:
            if _EXT is None:
                _EXT = _build()
    return _EXT or None


def _cpu_tag() -> str:
    import hashlib
    import platform

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()}_{hashlib.sha256(flags.encode()).hexdigest()[:10]}"


STALE_LOCK_SECONDS = 600  # a build takes well under a minute; a lock this old was left by a killed build


def clear_stale_lock(build_dir: str | Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the ``lock`` file a killed build left in ``build_dir`` (older than ``max_age`` seconds).

    ``torch.utils.cpp_extension`` takes that file as a baton and waits, without end, for it to go;
    a process killed while compiling (Ctrl-C, a stopped job) leaves it behind and every later run
    hangs. Returns whether a lock was removed.
    """
    import time

    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age < max_age:
        return False
    warnings.warn(f"wushkv: removing a stale build lock {lock} ({age:.0f}s old, left by an interrupted build)", stacklevel=2)
    try:
        lock.unlink()
    except OSError:
        return False
    return True


def _build():
    if os.environ.get("WUSHKV_NO_EXT", "") not in ("", "0"):
        return False
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        src = Path(__file__).with_name("csrc") / "codes.cpp"
        # -march=native: build per CPU model (the name carries a hash of the CPU flags, so a cached build
        # is never loaded on a machine lacking its instructions)
        name = f"wushkv_codes_{_cpu_tag()}"
        clear_stale_lock(Path(get_default_build_root()) / name)
        import sys

        bindir = str(Path(sys.executable).parent)  # the environment's own ninja (the `ninja` package)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        flags = ["-O3", "-fopenmp", "-march=native"]
        return load(name=name, sources=[str(src)], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler / ninja: the pure-PyTorch path is the reference anyway
        warnings.warn(f"wushkv: fused CPU decode kernels unavailable ({type(e).__name__}: {str(e)[:200]}); using the PyTorch path", stacklevel=2)
        return False
