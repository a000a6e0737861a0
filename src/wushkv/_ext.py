"""The optional fused CPU kernels of :mod:`wushkv.decode` (``csrc/codes.cpp``), built on first use.

``torch.utils.cpp_extension`` compiles them once per machine (tens of seconds, cached under
``~/.cache/torch_extensions``). Without a C++ compiler or ``ninja``, or with ``WUSHKV_NO_EXT=1``,
:func:`kernels` returns None and decoding uses the pure-PyTorch path (same results, slower).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import threading
import warnings
from pathlib import Path

_EXT = None
_LOCK = threading.Lock()
BUILD_ERROR: str | None = None  # why the last build failed ("Type: message"), None if none failed
_CALLS: collections.Counter = collections.Counter()  # kernel name -> calls since the last reset_calls()


class _Counted:
    """The compiled module, each kernel call counted by name (:func:`calls`): which path ran is then observable
    (a test can tell the fused kernels from a silent fallback to PyTorch). One dict update per call: nothing
    next to a kernel that reads a whole cache layer."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if not callable(fn):
            return fn

        def counted(*args, **kwargs):
            _CALLS[name] += 1
            return fn(*args, **kwargs)

        counted.__doc__ = fn.__doc__
        setattr(self, name, counted)  # looked up once
        return counted


def kernels():
    """The compiled kernels (``code_dot``, ``code_dot_tiles``, ``code_weighted_sum``, ``feedback_round``, and ``paged_decode``,
    ``paged_dequantize``, ``paged_store`` for the vLLM plugin's paged cells; each call counted, see
    :func:`calls`), or None where they cannot be built."""
    global _EXT
    if _EXT is None:
        with _LOCK:
            if _EXT is None:
                built = _build()
                _EXT = _Counted(built) if built else False
    return _EXT or None


def looked_up() -> bool:
    """Whether :func:`kernels` has run in this process (built, loaded from its cache, or found unavailable): an engine
    that must not pay for the build in its first request checks it was done at start."""
    return _EXT is not None


def calls() -> dict[str, int]:
    """How many times each fused kernel ran since the last :func:`reset_calls` (e.g. ``{"code_dot": 60,
    "code_weighted_sum": 60}``; empty where none ran): which path decoding actually took."""
    return dict(_CALLS)


def reset_calls() -> None:
    """Set the counts of :func:`calls` back to zero."""
    _CALLS.clear()


def toolchain() -> dict[str, str | None]:
    """The tools a build needs, found on this machine or None: the C++ compiler torch would call and ``ninja``
    (the environment's own, from the ``ninja`` package, counts)."""
    import shutil
    import sys

    cxx = os.environ.get("CXX") or "c++"
    bindir = str(Path(sys.executable).parent)
    return {"compiler": shutil.which(cxx), "ninja": shutil.which("ninja") or shutil.which("ninja", path=bindir)}


def can_build() -> bool:
    """Whether the kernels are expected to build here: a compiler and ninja present and ``WUSHKV_NO_EXT`` unset.
    Where this holds and :func:`kernels` is None, the build failed (:data:`BUILD_ERROR` says why): a bug, not a
    machine without a toolchain."""
    return os.environ.get("WUSHKV_NO_EXT", "") in ("", "0") and all(toolchain().values())


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


@contextlib.contextmanager
def build_lock(build_dir: str | Path):
    """Hold wushkv's own lock on ``build_dir`` while torch builds or loads the extension there.

    ``torch.utils.cpp_extension`` guards a build with a ``lock`` file (a baton) and waits, without
    end, for it to go. A build killed by a signal (SIGKILL, SIGTERM, out of memory) leaves that file
    behind, and every later run hangs. Here every wushkv process first takes an OS lock (``flock``) on
    ``wushkv.flock``; the OS drops it when its holder dies. Whoever holds it knows no live wushkv
    build is running, so a baton it finds is stale and is removed, whatever its age. Processes that
    start together wait for each other's build instead of both compiling. Without ``fcntl``
    (Windows) this only creates the folder.
    """
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(build_dir / "wushkv.flock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            warnings.warn(f"wushkv: waiting for another process building the CPU kernels in {build_dir}", stacklevel=3)
            fcntl.flock(fh, fcntl.LOCK_EX)  # released by close, or by the OS if its holder dies
        baton = build_dir / "lock"
        if baton.exists():
            warnings.warn(f"wushkv: removing a stale build lock {baton} (left by a build that was killed)", stacklevel=3)
            baton.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built: a wushkv folder under torch's extension root."""
    from torch.utils.cpp_extension import get_default_build_root

    import sys

    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    # one folder per Python, torch and environment: torch's build file names the torch headers of the environment
    # that wrote it, so two environments with the same torch (wushkv's, and .venv-vllm's for the vLLM plugin) sharing
    # a folder would each find the other's build stale and rebuild it, holding the lock every process waits on
    where = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
    env = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}_{where}"
    return Path(root) / "wushkv" / env / name


SOURCE = Path(__file__).with_name("csrc") / "codes.cpp"


def kernel_directory() -> Path:
    """Where this wushkv's kernels are built: per environment (:func:`build_directory`), CPU model (-march=native: the
    name carries a hash of the CPU flags, so a cached build is never loaded on a machine lacking its instructions) and
    source (two checkouts or versions of wushkv in one environment would otherwise each find the other's build stale
    and rebuild it in turn, holding the lock every process waits on)."""
    return build_directory(f"wushkv_codes_{_cpu_tag()}") / hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]


def _build():
    if os.environ.get("WUSHKV_NO_EXT", "") not in ("", "0"):
        return False
    try:
        from torch.utils.cpp_extension import load

        src = SOURCE
        name = f"wushkv_codes_{_cpu_tag()}"
        build_dir = kernel_directory()
        import sys

        bindir = str(Path(sys.executable).parent)  # the environment's own ninja (the `ninja` package)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        flags = ["-O3", "-fopenmp", "-march=native"]
        with build_lock(build_dir):
            return load(name=name, sources=[str(src)], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False,
                        build_directory=str(build_dir))
    except Exception as e:  # no compiler / ninja: the pure-PyTorch path is the reference anyway
        global BUILD_ERROR
        BUILD_ERROR = f"{type(e).__name__}: {e}"
        warnings.warn(f"wushkv: fused CPU decode kernels unavailable ({type(e).__name__}: {str(e)[:200]}); using the PyTorch path", stacklevel=2)
        return False
