"""The shape of the code, checked: one dependency direction, no import circles, no sys.path edits,
no monkeypatching of wushkv from outside.

* The import-linter contracts of ``pyproject.toml`` (``[tool.importlinter]``: the layers, lowest
  first attention math | codecs < decode < layer < hf < cache < folding | calibration | export <
  eval < sweep | lm_eval < cli, and "the core never imports evaluations") must hold.
* No import cycle among the modules of ``src/wushkv``.
* No tracked ``.py`` file edits ``sys.path``.
* Nothing assigns to an attribute of a wushkv module or class from outside it.

Both graph checks count imports inside functions too: grimp (which import-linter uses) reads every
``import`` statement of a module's source, wherever it sits, so a lazy import cannot hide a circle.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# -------------------------------------------------------------------------------------------------
# Known offenders that other changes of issue #31 remove. Each entry is expected to fail (xfail, not
# strict): when it is fixed, delete it here.
PENDING_SYS_PATH: dict[str, str] = {}
PENDING_MONKEYPATCH: dict[str, str] = {}
# Import cycles that the rewrite of eval/methods.py and eval/compare.py removes (issue #31).
PENDING_CYCLES: set[frozenset] = set()


# ------------------------------------------------------------------------------------- contracts
def test_import_contracts_hold():
    """``lint-imports`` (import-linter, the version the test extra pins) keeps every contract of pyproject.toml."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: install the test extra (pip install -e '.[test]')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"import contracts broken (lint-imports exit {r.returncode}):\n{r.stdout}\n{r.stderr}"


# ---------------------------------------------------------------------------------------- cycles
def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (module -> modules it imports)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]  # iterative: no recursion limit
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.add(m)
                        if m == node:
                            break
                    out.append(comp)
    return out


def _module_graph() -> dict[str, set[str]]:
    grimp = pytest.importorskip("grimp")
    spec = importlib.util.find_spec("wushkv")
    if spec is None or not Path(spec.origin).resolve().is_relative_to(SRC):
        pytest.skip(f"wushkv is imported from {spec and spec.origin}, not from this checkout's src/")
    g = grimp.build_graph("wushkv", cache_dir=None)
    return {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}


def test_strongly_connected_components():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(map(sorted, _strongly_connected(g))) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_import_cycles():
    """Every strongly connected component of the module graph is one module.

    Edges are the imports written in the source, function-level ones included. A package's
    ``__init__`` is the module ``wushkv.x``: its imports of its own submodules are edges like any other,
    so a submodule that imports its package back (``from . import y`` while ``__init__`` imports the
    submodule) is a cycle, and it is one at runtime too (a partly initialised module). The parent
    package Python loads before a submodule is not an edge: counting it would make every package that
    re-exports its submodules a cycle by construction, and it is no design dependency.
    """
    graph = _module_graph()
    cycles = [frozenset(c) for c in _strongly_connected(graph) if len(c) > 1]
    unexpected = [sorted(c) for c in cycles if c not in PENDING_CYCLES]
    assert not unexpected, f"import cycles among wushkv modules: {unexpected}"
    gone = [sorted(c) for c in PENDING_CYCLES if c not in cycles]
    assert not gone, f"these cycles are gone: remove them from PENDING_CYCLES: {gone}"


# ------------------------------------------------------------------------------- tracked sources
def _tracked_py() -> list[str]:
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(p for p in r.stdout.split("\0") if p and (ROOT / p).is_file())


_TRACKED = _tracked_py()


def _cases(pending: dict[str, str], where=lambda p: True) -> list:
    if not _TRACKED:
        return [pytest.param(None, marks=pytest.mark.skip(reason="not a git checkout"))]
    return [pytest.param(p, marks=pytest.mark.xfail(strict=False, reason=pending[p])) if p in pending else p
            for p in _TRACKED if where(p)]


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines calling ``sys.path.<anything>(...)`` (insert, append, extend, ...)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            v = node.func.value
            if isinstance(v, ast.Attribute) and v.attr == "path" and isinstance(v.value, ast.Name) and v.value.id == "sys":
                out.append(node.lineno)
    return out


@pytest.mark.parametrize("path", _cases(PENDING_SYS_PATH))
def test_no_sys_path_edits(path):
    if path is None:
        return
    lines = _sys_path_edits(ast.parse((ROOT / path).read_text(encoding="utf-8"), path))
    assert not lines, f"{path} edits sys.path at lines {lines}: import the installed package instead"


# ---------------------------------------------------------------------------------- monkeypatching
_NOT_FOUND = object()


def _package_of(path: str) -> str | None:
    """``wushkv.x.y`` for ``src/wushkv/x/y.py`` (the package relative imports start from), else None."""
    p = Path(path)
    if p.parts[:2] != ("src", "wushkv"):
        return None
    parts = list(p.with_suffix("").parts[1:])
    return ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")


class _Patches(ast.NodeVisitor):
    """Assignments to attributes of wushkv modules and classes that a file imported.

    Names are resolved by importing what the file's ``import``/``from ... import`` statements name
    (wushkv only): ``setattr(X, ...)``, ``X.attr = ...`` (also augmented, annotated and tuple targets),
    ``<anything>.setattr(X, ...)`` / ``.delattr(X, ...)`` (pytest's monkeypatch), ``patch.object(X, ...)``,
    and those calls with a ``"wushkv...."`` string target, where X is a wushkv module or class."""

    def __init__(self, package: str | None):
        self.package = package
        self.names: dict[str, str] = {}  # local name -> dotted wushkv path it is bound to
        self.found: list[tuple[int, str]] = []

    # -- what names mean
    def visit_Import(self, node):
        for a in node.names:
            if a.name.split(".")[0] == "wushkv":
                if a.asname:
                    self.names[a.asname] = a.name
                else:
                    self.names["wushkv"] = "wushkv"

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:
            if self.package is None:
                return
            parts = self.package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        if base.split(".")[0] != "wushkv":
            return
        for a in node.names:
            if a.name != "*":
                self.names[a.asname or a.name] = f"{base}.{a.name}"

    def _dotted(self, node) -> str | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    @staticmethod
    def _resolve(dotted: str):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for name in parts[i:]:
                obj = getattr(obj, name, _NOT_FOUND)
                if obj is _NOT_FOUND:
                    return _NOT_FOUND
            return obj
        return _NOT_FOUND

    def _is_wushkv_target(self, node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("wushkv."):
            return node.value
        dotted = self._dotted(node)
        if dotted is None:
            return None
        obj = self._resolve(dotted)
        if obj is _NOT_FOUND:  # a name from wushkv that does not resolve: count it rather than miss it
            return dotted
        if isinstance(obj, types.ModuleType) and obj.__name__.split(".")[0] == "wushkv":
            return dotted
        if isinstance(obj, type) and obj.__module__.split(".")[0] == "wushkv":
            return dotted
        return None

    # -- what counts as patching
    def _targets(self, t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from self._targets(e)
        elif isinstance(t, ast.Starred):
            yield from self._targets(t.value)
        else:
            yield t

    def _check_assign(self, targets, lineno):
        for t in targets:
            for tt in self._targets(t):
                if isinstance(tt, ast.Attribute):
                    what = self._is_wushkv_target(tt.value)
                    if what:
                        self.found.append((lineno, f"{what}.{tt.attr} = ..."))

    def visit_Assign(self, node):
        self._check_assign(node.targets, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._check_assign([node.target], node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self._check_assign([node.target], node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        owner = f.value if isinstance(f, ast.Attribute) else None
        owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
        patching = name in ("setattr", "delattr", "patch") or (name == "object" and owner_name == "patch")
        if patching and node.args:
            what = self._is_wushkv_target(node.args[0])
            if what:
                self.found.append((node.lineno, f"{name}({what}, ...)"))
        self.generic_visit(node)


def _patches(path: str, source: str) -> list[tuple[int, str]]:
    v = _Patches(_package_of(path))
    tree = ast.parse(source, path)
    for node in ast.walk(tree):  # names first, wherever imported (function-level imports too)
        if isinstance(node, ast.Import):
            v.visit_Import(node)
        elif isinstance(node, ast.ImportFrom):
            v.visit_ImportFrom(node)
    v.visit(tree)
    return v.found


def test_patch_finder_sees_the_usual_forms():
    src = (
        "import wushkv.decode as d\nimport wushkv\nfrom wushkv import attention\nfrom wushkv.layer import WushKVLayer\n"
        "import os\n"
        "def t(monkeypatch):\n"
        "    monkeypatch.setattr(d, 'USE_KERNELS', False)\n"           # 7
        "    monkeypatch.setattr('wushkv.decode.USE_KERNELS', False)\n"  # 8
        "    attention.QUERY_BLOCK = None\n"                              # 9
        "    a, WushKVLayer._fake = 1, None\n"                            # 10
        "    setattr(wushkv.cache, 'x', 1)\n"                             # 11
        "    monkeypatch.setattr(os, 'replace', None)\n"                  # not wushkv
        "    x = WushKVLayer(None); x.cfg = 1\n"                          # an instance, not the class
    )
    assert [line for line, _ in _patches("tests/t.py", src)] == [7, 8, 9, 10, 11]
    inside = "from . import decode\nfrom .layer import KVView\ndecode.USE_KERNELS = 0\nKVView.x = 1\n"
    assert [line for line, _ in _patches("src/wushkv/cache.py", inside)] == [3, 4]


@pytest.mark.parametrize(
    "path", _cases(PENDING_MONKEYPATCH, lambda p: p.split("/")[0] in ("src", "tests", "benchmarks", "experiments")
                   and p != "tests/test_architecture.py"))
def test_no_monkeypatching_of_wushkv(path):
    if path is None:
        return
    found = _patches(path, (ROOT / path).read_text(encoding="utf-8"))
    assert not found, (f"{path} assigns to attributes of wushkv modules or classes from outside them: "
                       + "; ".join(f"line {n}: {what}" for n, what in found)
                       + " (give the module a proper extension point or argument instead)")


def test_deprecations_raised_from_wushkv_fail_the_suite():
    """pyproject's filterwarnings turns a DeprecationWarning / FutureWarning attributed to a wushkv module into an
    error (a keyword a host library is retiring shows up as a failing test, not a line in the log); others stay warnings."""
    import warnings

    for category in (DeprecationWarning, FutureWarning):
        with pytest.raises(category):
            warnings.warn_explicit("a retiring keyword", category, "cache.py", 1, module="wushkv.cache")
    with pytest.warns(DeprecationWarning):
        warnings.warn_explicit("not ours", DeprecationWarning, "x.py", 1, module="somebody_else")
