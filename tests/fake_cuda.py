"""Fake CUDA tensors: code written for a GPU run on a CPU-only torch, what a GPU would refuse or wait for recorded.

A fake CUDA tensor (:func:`on_device`) reports ``device == cuda:0`` while its data is an ordinary CPU tensor. Code
that branches on the device (``t.device.type == "cuda"``) or allocates on another tensor's device
(``torch.zeros(..., device=kv_cache.device)``) takes its CUDA path and computes the same values, on the CPU. Inside
:func:`active`, the calls a real GPU would fail on are recorded as errors (:func:`errors`) and those that make the host
wait for the device as syncs (:func:`syncs`), each with the lines of code under test that made it; the computation goes
on either way, so that one run lists them all::

    cache = fake_cuda.on_device(torch.zeros(...))        # CPU data, device cuda:0
    with fake_cuda.active():                             # the rules on; device="cuda" allocates fake tensors
        impl.forward(..., cache, ...)
    fake_cuda.errors(), fake_cuda.syncs()                # ["file:line <- caller: what"], {"file:line: kind": n}
    fake_cuda.host(cache)                                # the CPU data, to compare (no sync recorded)
    fake_cuda.reset()

Device rules enforced (each break is an error), as PyTorch applies them on CUDA:

* an operator's tensors share one device, but for CPU tensors of 0 dimensions, which CUDA operators take as scalars
  (TensorIterator's CPU scalars); a 0-dim CUDA tensor does not join CPU tensors;
* the exceptions: ``copy_`` and ``to`` (any direction), and a CUDA tensor indexed by CPU index tensors (``t[idx]``,
  ``t[idx] = v``), which torch copies to the device;
* a CPU tensor is indexed by CPU indices only, and takes no CUDA values of 1 or more dimensions through an
  advanced-index assignment (a 0-dim one is read as a scalar: a sync);
* an advanced-index assignment into a CUDA tensor takes values on the device or a 0-dim CPU scalar;
* only CPU tensors are pinned (``pin_memory()``, ``pin_memory=True`` beside ``device="cuda"`` is refused);
* a kernel launched through :func:`launch` (Triton's) takes device tensors only (Triton refuses a host pointer).

Recorded as syncs (the host waits for the device, so it cannot queue work ahead of it):

* a copy from the device to the host (``.cpu()``, ``.to("cpu")``, ``tolist()``, ``copy_`` into a CPU tensor); one
  with ``non_blocking`` is recorded too, under its own name (its result is only safe to read after a sync);
* a copy from the host to the device out of pageable memory (``.to("cuda")``, ``.cuda()``,
  ``torch.tensor(data, device="cuda")``, ``copy_`` into a CUDA tensor, a CPU index tensor of a CUDA tensor). A
  ``non_blocking`` copy out of pinned memory is not one;
* reading a value on the host: ``item()``, ``bool()``, ``int()``, ``float()``, ``torch.equal``;
* operators whose output's size depends on the data: ``nonzero``, boolean-mask indexing, ``masked_select``,
  ``unique``, ``bincount``, ``repeat_interleave`` with tensor repeats and no ``output_size``;
* ``torch.cuda.synchronize()``.

Most of this happens in ``__torch_dispatch__``, on ATen operators. What a CPU-only torch refuses before any operator
runs is handled on the Python calls (a ``TorchFunctionMode``): allocations and copies naming a CUDA device, pinning,
and the hand-written bindings that enter a CUDA device guard (indexing, ``int()``, ``copy_``, ``contiguous``, ...),
which are emulated or sent on to the same operator through ``torch.ops.aten``; one not covered raises
NotImplementedError naming it. While active, ``torch.cuda.is_current_stream_capturing`` says False,
``torch.cuda.get_device_properties`` gives an H100 SXM's 132 multiprocessors, ``torch.cuda.current_stream`` the
default stream (``cuda_stream`` 0), and ``torch.cuda.synchronize`` records a sync; ``torch.cuda.is_available()`` stays
False. A CUDA device is recognized as a ``device=`` keyword, a
``.to``/``.cuda`` argument, or a tensor's.

Not emulated: streams, events and asynchrony (every operator runs when called: a pinned buffer reused before its copy
ran, or a non_blocking device-to-host result read before a sync, go unseen); CUDA graphs (nothing is ever capturing);
devices other than cuda:0; memory limits and the caching allocator; GPU numerics (operators run as the CPU's: TF32,
reduction orders, half precision support may differ); autograd (fake tensors never require grad); compilation for a GPU
(a kernel given to :func:`launch` gets the CPU tensors: Triton's interpreter runs it).

Private torch APIs (torch 2.13): ``torch.Tensor._make_wrapper_subclass`` (a tensor whose metadata says cuda:0 over
no storage of its own) and ``torch._C._disabled_torch_function_impl`` (the subclass's results are built by its
``__torch_dispatch__``, not converted to the subclass by the default ``__torch_function__``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections import Counter
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
H100_SMS = 132

_errors: Counter = Counter()  # "site: message" -> times
_syncs: Counter = Counter()  # "site: kind" -> times
_pinned: dict[int, torch.Tensor] = {}  # storage address -> a tensor on it, held so that the address is not reused
_state = SimpleNamespace(scope="/src/", paused=False)


# -- the public API ------------------------------------------------------------------------------------------------
def on_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) as a fake CUDA tensor over the same data (no copy, no sync recorded)."""
    if is_fake(t) or t.device.type != "cpu":
        raise ValueError(f"on_device takes a CPU tensor, got one on {t.device}")
    return _Fake(t)


def host(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding a fake CUDA tensor's data (no copy, no sync recorded: for the checks, not the code under
    test); a CPU tensor as it is."""
    return t.elem if is_fake(t) else t


def is_fake(t) -> bool:
    return isinstance(t, _Fake)


@contextlib.contextmanager
def active(scope: str = "/src/"):
    """Within the block, fake CUDA tensors follow the device rules and record errors and syncs (module docstring), and
    ``device="cuda"`` allocates fake CUDA tensors. A record names the innermost frames whose file path contains
    ``scope`` (the code under test), relative to it."""
    saved = (_state.scope, torch.cuda.is_current_stream_capturing, torch.cuda.get_device_properties,
             torch.cuda.synchronize, torch.cuda.current_stream)
    _state.scope = scope
    # the CPU build's torch.cuda raises on these: what a GPU would answer
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(
        name="fake H100", multi_processor_count=H100_SMS, total_memory=80 << 30, major=9, minor=0)
    torch.cuda.synchronize = lambda device=None: _sync("torch.cuda.synchronize")
    torch.cuda.current_stream = lambda device=None: SimpleNamespace(cuda_stream=0)  # the default stream
    _forget_devices()
    try:
        with _Mode():
            yield
    finally:
        (_state.scope, torch.cuda.is_current_stream_capturing, torch.cuda.get_device_properties,
         torch.cuda.synchronize, torch.cuda.current_stream) = saved
        _forget_devices()


def _forget_devices():
    """What wushkv keeps of a device (its multiprocessors, uploads kept for the next layers, a ragged step's mask and
    row indices) is the fake one's inside the block: forgotten on the way in and out, so that no fake tensor outlives it
    there."""
    tk, views, layer = (sys.modules.get(f"wushkv.{name}") for name in ("triton_kernels", "views", "layer"))
    if tk is not None:
        tk._multiprocessors.cache_clear()
        tk._KEPT.clear()
    if views is not None:
        views._PER_STEP.clear()
    if layer is not None:
        layer._rows.cache_clear()


def launch(name: str, kernel, *args, **kwargs):
    """``kernel(*args, **kwargs)`` as the GPU kernel launch ``name``: every tensor argument should be on the device (an
    error each that is not); the kernel gets the CPU tensors (its writes land in the fake tensors' data) and runs with
    the rules off (a launch is one kernel, not torch operators)."""
    for i, a in [*enumerate(args), *kwargs.items()]:
        if isinstance(a, torch.Tensor) and not is_fake(a):
            _error(f"kernel {name}: argument {i} {tuple(a.shape)} is a host tensor")
    paused, _state.paused = _state.paused, True
    try:
        return kernel(*[host(a) if isinstance(a, torch.Tensor) else a for a in args],
                      **{k: host(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    finally:
        _state.paused = paused


def errors() -> list[str]:
    """What a GPU would have refused since :func:`reset`: ``"site: message"``, with `` (xN)`` where repeated."""
    return [k if n == 1 else f"{k} (x{n})" for k, n in _errors.items()]


def syncs() -> dict[str, int]:
    """Host-device syncs since :func:`reset`: ``{"site: kind": times}``."""
    return dict(_syncs)


def reset() -> None:
    """Forget the errors, the syncs and the pinned buffers."""
    _errors.clear()
    _syncs.clear()
    _pinned.clear()


# -- records -------------------------------------------------------------------------------------------------------
_HERE = os.path.abspath(__file__)


def _site() -> str:
    """The innermost two frames in scope (the call under test and its caller); else the innermost outside torch and
    this file."""
    stack = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)  # innermost first
    mine = [f for f in stack if _state.scope in f.filename][:2]
    if not mine:
        mine = [f for f in stack if f.filename != _HERE and f"{os.sep}torch{os.sep}" not in f.filename][:1]
    return " <- ".join(f"{f.filename.split(_state.scope)[-1]}:{f.lineno}" for f in mine)


def _error(message: str) -> None:
    _errors[f"{_site()}: {message}"] += 1


def _sync(kind: str) -> None:
    _syncs[f"{_site()}: {kind}"] += 1


def _pin(t: torch.Tensor) -> torch.Tensor:
    _pinned[t.untyped_storage().data_ptr()] = t
    return t


def _is_pinned(t: torch.Tensor) -> bool:
    return not is_fake(t) and t.untyped_storage().data_ptr() in _pinned


def _is_cuda(device) -> bool:
    if isinstance(device, bool) or device is None:
        return False
    if isinstance(device, int):  # torch reads an int device as a CUDA ordinal
        return True
    return torch.device(device).type == "cuda" if isinstance(device, (str, torch.device)) else False


def _leaves(x):
    """The tensors among an operator's arguments (nested in lists, tuples and dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)


def _unwrap(x):
    if isinstance(x, _Fake):
        return x.elem
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(y) for y in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _wrap(x, inputs: dict[int, _Fake]):
    """Results as fake tensors: an input's own data (in-place, ``out=``) as that input, new tensors wrapped."""
    if isinstance(x, torch.Tensor):
        same = inputs.get(id(x))
        return same if same is not None else _Fake(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(y, inputs) for y in x)
    return x


# -- the tensor ----------------------------------------------------------------------------------------------------
class _Fake(torch.Tensor):
    """Metadata of cuda:0 over ``elem``, the CPU tensor with the data (same shape, strides and dtype)."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype, device=CUDA,
                                                requires_grad=False)
        t.elem = elem
        return t

    def __repr__(self):
        return f"fake_cuda({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


_READ = "a value read on the host (item, bool, int, float)"
# operators whose output's size (or a Python value) needs the data on the host: the name a sync is recorded under
_DATA_DEPENDENT = {"nonzero": "nonzero", "masked_select": "masked_select", "unique": "unique", "_unique": "unique",
                   "_unique2": "unique", "unique_consecutive": "unique_consecutive", "unique_dim": "unique",
                   "bincount": "bincount", "equal": "torch.equal", "is_nonzero": _READ, "_local_scalar_dense": _READ}


def _dispatch(func, args, kwargs):
    """An ATen operator with a fake tensor among its arguments: record what a GPU would refuse or wait for, run it on
    the CPU data, wrap the results."""
    name = func.overloadpacket.__name__
    kwargs = dict(kwargs)
    tensors = list(_leaves((args, kwargs)))
    fakes = {id(t.elem): t for t in tensors if is_fake(t)}
    hosts = [t for t in tensors if not is_fake(t)]
    self = args[0] if args else None
    to_device = _is_cuda(kwargs.get("device"))
    if "device" in kwargs and to_device:
        kwargs = {**kwargs, "device": CPU}
    pin = kwargs.pop("pin_memory", None)  # asked for by a non_blocking copy to the host: a CPU-only torch cannot
    if name == "_to_copy":
        if is_fake(self) and "device" in kwargs and not to_device:
            _sync("device-to-host copy, non_blocking" if kwargs.get("non_blocking") else "device-to-host copy")
            out = func(self.elem, **kwargs)
            return _pin(out) if pin else out
        to_device = True  # a dtype or layout change on the device
    elif name == "copy_":
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if is_fake(dst) and not is_fake(src) and src.dim() and not (non_blocking and _is_pinned(src)):
            _sync("host-to-device copy_ from pageable memory")
        elif is_fake(src) and not is_fake(dst):
            _sync("device-to-host copy_, non_blocking" if non_blocking else "device-to-host copy_")
        func(host(dst), host(src), *args[2:], **kwargs)
        return dst
    elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = [i for i in args[1] if i is not None]
        values = args[2] if name != "index" else None
        if not is_fake(self):
            if any(is_fake(i) for i in indices):
                _error(f"a CPU tensor {tuple(self.shape)} indexed by CUDA index tensors ({name})")
            if values is not None and is_fake(values):
                if values.dim():
                    _error(f"a CPU tensor {tuple(self.shape)} assigned CUDA values {tuple(values.shape)} ({name})")
                else:
                    _sync(f"a 0-dim CUDA value read on the host ({name})")
            return func(*_unwrap(args), **kwargs)
        if values is not None and not is_fake(values) and values.dim():
            _error(f"a CUDA tensor {tuple(self.shape)} assigned CPU values {tuple(values.shape)} ({name})")
        if any(i.dtype == torch.bool for i in indices):
            _sync(f"boolean-mask indexing: nonzero ({name})")
        elif any(not is_fake(i) for i in indices):
            _sync(f"a CPU index tensor copied to the device ({name})")
    else:
        if hosts and any(t.dim() for t in hosts):
            shapes = [tuple(t.shape) for t in hosts if t.dim()]
            _error(f"{name}: CUDA tensors beside CPU tensors {shapes}")
        if name in _DATA_DEPENDENT:
            _sync(_DATA_DEPENDENT[name])
        elif name == "repeat_interleave" and not str(func).endswith("self_int") and kwargs.get("output_size") is None:
            _sync("repeat_interleave without output_size")
    out = func(*_unwrap(args), **_unwrap(kwargs))
    return _wrap(out, fakes) if fakes or to_device else out


# -- what never reaches __torch_dispatch__ -------------------------------------------------------------------------
# torch.tensor and friends copy their data from the host
_COPYING = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def _target(args, kwargs):
    """(device, dtype, non_blocking) of a ``Tensor.to`` call's arguments after ``self``: positional or keyword, or
    another tensor's device and dtype."""
    device, dtype, flags = kwargs.get("device"), kwargs.get("dtype"), []
    for a in args:
        if isinstance(a, bool):
            flags.append(a)
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, int, torch.device)):
            device = a
    return device, dtype, kwargs.get("non_blocking", flags[0] if flags else False)


class _Mode(TorchFunctionMode):
    """Python-level calls that a CPU-only torch refuses before any operator runs: allocations on a CUDA device, copies
    to it, pinning, and the bindings that enter a CUDA device guard (:func:`_guarded`). Everything else goes on to
    the operators (:func:`_dispatch`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _state.paused:
            return func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            src = args[0]
            device, dtype, non_blocking = _target(args[1:], kwargs)
            if func is torch.Tensor.cuda:
                device = CUDA
            if not _is_cuda(device):
                return func(*args, **kwargs)  # a dtype change, or to the host: operators
            if not is_fake(src) and not (non_blocking and _is_pinned(src)):
                _sync("host-to-device copy from pageable memory")
            out = host(src).to(dtype=dtype, copy=kwargs.get("copy", False),
                               memory_format=kwargs.get("memory_format", torch.preserve_format))
            if is_fake(src):
                return src if out is src.elem else _Fake(out)
            return _Fake(out.clone() if out is src else out)  # a copy, even where the dtype is the same
        if func is torch.Tensor.pin_memory:
            if is_fake(args[0]):
                _error("pin_memory() of a CUDA tensor (only CPU tensors are pinned)")
                return args[0]
            return args[0] if _is_pinned(args[0]) else _pin(args[0].clone())
        if func is torch.Tensor.is_pinned:
            return _is_pinned(args[0])
        if func is torch.Tensor.tolist and is_fake(args[0]):  # torch refuses it for a subclass: a copy to the host
            _sync("tolist(): device-to-host copy")
            return args[0].elem.tolist()
        if func is torch.Tensor.data_ptr and is_fake(args[0]):
            return args[0].elem.data_ptr()  # alignment checks read it; the wrapper has no storage
        device = kwargs.get("device")
        if _is_cuda(device) or kwargs.get("pin_memory"):  # an allocation: torch.zeros(..., device="cuda"), ...
            pin = kwargs.pop("pin_memory", False)
            if _is_cuda(device):
                if pin:
                    _error(f"{func.__name__}(pin_memory=True, device={device!r}): only CPU tensors are pinned")
                if func in _COPYING and not (args and is_fake(args[0])):
                    _sync(f"host-to-device copy from pageable memory ({func.__name__})")
                kwargs["device"] = CPU
                return _wrap(func(*_unwrap(args), **kwargs), {})
            return _pin(func(*args, **kwargs))
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            if "not linked with support for cuda" not in str(e) and "from the 'CUDA' backend" not in str(e):
                raise
        return _guarded(func, args, kwargs)


def _guarded(func, args, kwargs):
    """A call that torch refused before any operator ran: a hand-written binding (indexing, ``int()``, ``nonzero``,
    ``copy_``, ``contiguous``, ...) entering a CUDA device guard, or a Python scalar made a CUDA tensor
    (``torch.where(mask, t, 0.0)``). Indexing and reads are emulated here, the rest sent to the same operator through
    the dispatcher, which does neither."""
    self = args[0]
    if func is torch.Tensor.__getitem__:
        _index_rules(self, args[1])
        return _Fake(self.elem[_unwrap(args[1])])
    if func is torch.Tensor.__setitem__:
        idx, value = args[1], args[2]
        advanced = _index_rules(self, idx)
        if isinstance(value, torch.Tensor) and not is_fake(value) and value.dim():
            if advanced:
                _error(f"a CUDA tensor {tuple(self.shape)} assigned CPU values {tuple(value.shape)} (setitem)")
            else:
                _sync("host-to-device copy_ from pageable memory (setitem)")
        self.elem[_unwrap(idx)] = host(value) if isinstance(value, torch.Tensor) else value
        return None
    if func in _READS:
        _sync(_READ)
        return func(self.elem, *args[1:], **kwargs)
    if func is torch.Tensor.new_tensor:
        _sync("host-to-device copy from pageable memory (new_tensor)")
        return _Fake(torch.tensor(args[1], dtype=kwargs.get("dtype", self.dtype)))
    if func is torch.where and len(args) == 3:  # a Python scalar as a CPU scalar, which a CUDA operator takes
        return torch.where(*(torch.tensor(a) if isinstance(a, (int, float)) else a for a in args))
    if func in (torch.Tensor.nonzero, torch.nonzero):
        out = torch.ops.aten.nonzero(self)
        return out.unbind(1) if kwargs.get("as_tuple") else out
    name = _ATEN.get(func, getattr(func, "__name__", ""))
    if not hasattr(torch.ops.aten, name):
        raise NotImplementedError(f"fake_cuda does not emulate {name or func} on a CUDA tensor (torch refuses it on a "
                                  f"CPU-only build before any operator runs): add it to fake_cuda._guarded")
    return getattr(torch.ops.aten, name)(*args, **kwargs)


_READS = {torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}  # item() and bool() reach the operators
_ATEN = {torch.Tensor.__invert__: "bitwise_not"}  # the operator of a method named otherwise


def _index_rules(self: _Fake, idx) -> bool:
    """Record what indexing a CUDA tensor by ``idx`` waits for; whether it is advanced indexing. A 0-dim integer tensor
    indexes as an int (read on the host: a sync where it is a CUDA one); lists and other tensors are index tensors,
    copied to the device where they are on the host; a boolean mask needs its nonzero."""
    advanced = False
    for i in idx if isinstance(idx, tuple) else (idx,):
        if isinstance(i, torch.Tensor) and i.dim() == 0 and i.dtype != torch.bool and not i.is_floating_point():
            if is_fake(i):
                _sync("a 0-dim CUDA index read on the host")
        elif isinstance(i, (torch.Tensor, list)):
            advanced = True
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                _sync("boolean-mask indexing: nonzero")
            elif not is_fake(i):
                _sync("a CPU index copied to the device")
    return advanced
