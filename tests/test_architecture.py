"""The layering rules of docs/architecture.md, checked on the sources (no build needed).

* No object reaches into another's private attributes: ``x._name`` is allowed only on ``self``,
  ``cls`` and ``super()``, and on modules (``torch._C``); anything else must say why on its line
  (or in the comment right above it) with a ``# private-ok: <reason>`` comment -- kept for PyTorch's own
  interfaces that have no public spelling.
* No import loop between fastamp's modules (imports inside functions count: they only hide a
  loop).
* One concern per file: every file opens with a header (the module docstring; in csrc a leading
  comment) saying what it is for, and a Python file's header names every public class the file
  defines -- a class the header cannot honestly name as part of that concern belongs in its own
  file. Length is not a rule: a long file with one concern is fine.
* Classes call the op layer, never ``torch.ops.fastamp`` directly (only ``*/_ops.py`` and the
  loader do).
* No module imports another capability's private (``_*``) modules: it uses what that capability
  exports.
* The package root is shared ground: a private module at the root (``fastamp/_x.py``) is imported
  by at least two capabilities; what one capability alone uses lives in its folder.
* A class reads only attributes it assigns or declares in its own body (or a base class has as a
  class attribute): a reader of one file sees every attribute its classes use.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
from collections.abc import Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY = ROOT / "python" / "fastamp"


def _py_files() -> list[pathlib.Path]:
    return sorted(p for p in PY.rglob("*.py") if "__pycache__" not in p.parts)


EACH_PY_FILE = pytest.mark.parametrize("path", _py_files(), ids=lambda p: str(p.relative_to(PY)))


def _assert_none_found(path: pathlib.Path, found: list[str], says: str, sep: str, fix: str) -> None:
    """Fails naming ``path``, what ``says`` is wrong, each of ``found`` and the ``fix``."""
    assert not found, f"{path.relative_to(ROOT)}{says}{sep.join(found)} -- {fix}"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PY.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names.add(a.asname or a.name)
    return names


def private_accesses(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of each ``x._name`` on something other than self/cls/super()/a module,
    without a ``# private-ok:`` note on its line or in the comment lines above it."""
    tree = ast.parse(source)
    lines = source.splitlines()
    modules = _imported_modules(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
        ):
            target = node.args[0]
            if not (isinstance(target, ast.Name) and target.id in ("self", "cls")) and not _noted(
                lines, node.lineno - 1
            ):
                found.append((node.lineno, ast.unparse(node)))
            continue
        if not (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not (node.attr.startswith("__") and node.attr.endswith("__"))
        ):
            continue
        base = node.value
        root = base
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if (
            isinstance(base, ast.Call)
            and isinstance(base.func, ast.Name)
            and base.func.id == "super"
        ):
            continue
        if (
            isinstance(root, ast.Name)
            and root.id in modules
            and all(not isinstance(n, ast.Call) for n in ast.walk(base))
            and _looks_like_module_path(base, modules)
        ):
            continue
        if not _noted(lines, node.lineno - 1):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _noted(lines: list[str], i: int) -> bool:
    """A ``# private-ok:`` note on line ``i`` or in the comment lines right above it."""
    if "private-ok:" in lines[i]:
        return True
    i -= 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        if "private-ok:" in lines[i]:
            return True
        i -= 1
    return False


def _looks_like_module_path(base: ast.expr, modules: set[str]) -> bool:
    """``torch``, ``torch._C``, ``dist``...: a chain of names from an imported module whose parts
    are modules by convention (lower case), not a class (``torch.autograd.Variable``)."""
    parts = []
    while isinstance(base, ast.Attribute):
        parts.append(base.attr)
        base = base.value
    if not isinstance(base, ast.Name) or base.id not in modules:
        return False
    return all(p == p.lower() or p == "_C" for p in parts) and base.id == base.id.lower()


def test_private_access_scanner_catches_and_allows():
    src = (
        "import torch\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        self._x = 1\n"
        "        super()._y()\n"
        "        torch._C._foo()\n"
        "        other._z = 2\n"
        "        # private-ok: a documented reason\n"
        "        other._w\n"
        "        torch.autograd.Variable._engine\n"
        "        getattr(other, '_v', None)\n"
        "        getattr(self, '_u', None)\n"
    )
    assert [e for _, e in private_accesses(src)] == [
        "other._z",
        "torch.autograd.Variable._engine",
        "getattr(other, '_v', None)",
    ]


def capability_private_imports(source: str, capability: str) -> list[tuple[int, str]]:
    """``(line, module)`` of each import of another capability's private module
    (``fastamp.<other>._x``, or ``_x`` from ``fastamp.<other>``). ``capability`` is the folder
    the source lives in ("" for the package's top-level modules, which are everyone's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for mod in mods:
            parts = mod.split(".")
            if (
                len(parts) >= 3
                and parts[0] == "fastamp"
                and not parts[1].startswith("_")
                and parts[1] != capability
                and parts[2].startswith("_")
            ):
                found.append((node.lineno, mod))
                break
    return found


def test_capability_private_import_scanner_catches_and_allows():
    src = (
        "from fastamp.optim import _ops as optim_ops\n"
        "from fastamp.scaler._validation import check_state_dict\n"
        "import fastamp.parallel._backward\n"
        "from fastamp.optim import ops\n"
        "from fastamp._checks import is_real\n"
        "from fastamp.checkpoint._ops import x\n"
    )
    assert [m for _, m in capability_private_imports(src, "checkpoint")] == [
        "fastamp.optim._ops",
        "fastamp.scaler._validation",
        "fastamp.parallel._backward",
    ]


@EACH_PY_FILE
def test_no_import_of_another_capabilitys_private_modules(path):
    rel = path.relative_to(PY)
    capability = rel.parts[0] if len(rel.parts) > 1 else ""
    bad = capability_private_imports(path.read_text(), capability)
    _assert_none_found(
        path,
        [f"line {n}: {m}" for n, m in bad],
        " imports other capabilities' private modules: ",
        "; ",
        "use what that capability exports (its __init__: e.g. fastamp.optim.ops)",
    )


def _capability_of(path: pathlib.Path) -> str:
    """The folder of python/fastamp a file belongs to ("" for the package root's files)."""
    rel = path.relative_to(PY)
    return rel.parts[0] if len(rel.parts) > 1 else ""


def root_modules_used_by_fewer_than_two(
    graph: dict[str, set[str]], capability: dict[str, str]
) -> dict[str, list[str]]:
    """``{module: the capabilities that import it}`` for each private module at the package root
    (``fastamp._x``) that fewer than two capabilities import."""
    out = {}
    for mod in graph:
        name = mod.rpartition(".")[2]
        if mod.count(".") != 1 or not name.startswith("_") or name.startswith("__"):
            continue  # (__main__: the command line, no module's dependency)
        users = sorted({capability[m] for m, deps in graph.items() if mod in deps} - {""})
        if len(users) < 2:
            out[mod] = users
    return out


def test_root_module_scanner_catches_and_allows():
    graph = {
        "fastamp._shared": set(),
        "fastamp._one": set(),
        "fastamp._none": set(),
        "fastamp.__main__": {"fastamp._shared"},
        "fastamp.tool": {"fastamp._none"},
        "fastamp.a.x": {"fastamp._shared", "fastamp._one"},
        "fastamp.b._y": {"fastamp._shared"},
    }
    capability = {"fastamp.tool": "", "fastamp.a.x": "a", "fastamp.b._y": "b"}
    capability.update({m: "" for m in graph if m.count(".") == 1})
    assert root_modules_used_by_fewer_than_two(graph, capability) == {
        "fastamp._one": ["a"],
        "fastamp._none": [],
    }


def test_private_root_modules_are_shared():
    capability = {_module_name(p): _capability_of(p) for p in _py_files()}
    bad = root_modules_used_by_fewer_than_two(_import_graph(), capability)
    assert not bad, (
        "private modules at the package root that fewer than two capabilities import: "
        + "; ".join(f"{m} (imported by {users or 'no capability'})" for m, users in bad.items())
        + " -- the root holds what capabilities share; move it into its capability's folder "
        "(as fastamp/resume/_checksums.py)"
    )


def undeclared_self_reads(
    source: str,
    provided: Callable[[str, str], bool] = lambda c, a: False,
) -> list[tuple[str, str]]:
    """``(class, attribute)`` for each ``self.<attribute>`` a class of ``source`` reads that the
    class neither assigns (``self.x = ...`` in its methods) nor declares in its body (an
    annotation, an assignment, a method), unless ``provided(class, attribute)``: its base classes
    have it as a class attribute, method or annotation."""
    found = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        declared = set()
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                declared.add(st.target.id)
            elif isinstance(st, ast.Assign):
                declared.update(t.id for t in st.targets if isinstance(t, ast.Name))
            elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                declared.add(st.name)
        reads, assigned = set(), set()
        for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    (assigned if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
        found += [
            (cls.name, a) for a in sorted(reads - declared - assigned) if not provided(cls.name, a)
        ]
    return found


def test_self_attribute_scanner_catches_and_allows():
    src = (
        "class Base:\n"
        "    def m(self): pass\n"
        "class A(Base):\n"
        "    x: int\n"
        "    def f(self):\n"
        "        self.y = 1\n"
        "        return self.x + self.y + self.z + self.m() + self.g() + self.w\n"
        "    def g(self): pass\n"
    )
    provided = lambda c, a: c == "A" and a == "m"  # noqa: E731 (what a base class has)
    assert undeclared_self_reads(src, provided) == [("A", "w"), ("A", "z")]


def _provided_by_bases(module_name: str) -> Callable[[str, str], bool]:
    """Whether a class of the module has ``attribute`` from a base class (as a class attribute,
    method or annotation). A module that cannot be imported here (a client library missing)
    provides nothing: its classes must declare what they read themselves."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return lambda c, a: False

    def provided(cls_name: str, attr: str) -> bool:
        cls = getattr(module, cls_name, None)
        if not isinstance(cls, type):
            return False
        return any(
            attr in vars(b) or attr in getattr(b, "__annotations__", {}) for b in cls.__mro__[1:]
        )

    return provided


@EACH_PY_FILE
def test_classes_declare_what_they_read(path):
    bad = undeclared_self_reads(path.read_text(), _provided_by_bases(_module_name(path)))
    _assert_none_found(
        path,
        [f"{c}.{a}" for c, a in bad],
        ": classes read attributes they neither assign nor declare: ",
        ", ",
        "assign it in the class, or declare it in the class body (an annotation saying where it "
        "is set), so a reader of this file sees every attribute the class uses",
    )


@EACH_PY_FILE
def test_no_private_access_across_objects(path):
    bad = private_accesses(path.read_text())
    _assert_none_found(
        path,
        [f"line {n}: {e}" for n, e in bad],
        " reaches into private attributes of other objects: ",
        "; ",
        "add a public interface (see fastamp.handoff), or a '# private-ok: <reason>' note for "
        "PyTorch/client internals with no public spelling",
    )


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _py_files()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for t in targets:
                if t in modules and t != mod and not mod.startswith(t + "."):
                    # a submodule importing its own package's __init__ is Python's import order,
                    # not a dependency of the layers
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_loop():
    cycles = _cycles(_import_graph())
    assert not cycles, f"import loops between fastamp modules: {cycles}"


def _sources() -> list[pathlib.Path]:
    files = _py_files()
    for ext in ("*.cpp", "*.h", "*.cu", "*.cuh", "*.inc"):
        files += sorted((ROOT / "csrc").rglob(ext))
    return files


def header_problems(source: str) -> list[str]:
    """What a Python file's header fails to say: no module docstring, or public classes defined in
    the file that the docstring does not name."""
    tree = ast.parse(source)
    doc = ast.get_docstring(tree)
    if not doc:
        return ["no module docstring"]
    return [
        f"class {n.name} is not named in the module docstring"
        for n in tree.body
        if isinstance(n, ast.ClassDef)
        and not n.name.startswith("_")
        and not re.search(rf"\b{re.escape(n.name)}\b", doc)
    ]


def test_header_scanner_catches_and_allows():
    assert header_problems("class A: pass\n") == ["no module docstring"]
    src = '"""Bucket layout: :class:`Layout` and its :class:`Bucket`."""\nclass Layout: pass\nclass Bucket: pass\n'
    assert header_problems(src) == []
    planted = src + "class Reducer: pass\nclass _Private: pass\n"  # a second concern slipped in
    assert header_problems(planted) == ["class Reducer is not named in the module docstring"]
    assert header_problems('"""A :class:`LayoutPlan`."""\nclass Layout: pass\n') == [
        "class Layout is not named in the module docstring"
    ]


@EACH_PY_FILE
def test_one_concern_per_python_file(path):
    _assert_none_found(
        path,
        header_problems(path.read_text()),
        ": ",
        "; ",
        "the header says what the file is for and names each class in it; a class that is not "
        "part of that concern goes in its own file",
    )


_CSRC_HEADER = re.compile(r"\A(//|/\*)")


@pytest.mark.parametrize(
    "path", [p for p in _sources() if p.suffix != ".py"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_one_concern_per_csrc_file(path):
    assert _CSRC_HEADER.match(path.read_text()), (
        f"{path.relative_to(ROOT)} does not open with a comment saying what the file is for"
    )


@EACH_PY_FILE
def test_classes_call_the_op_layer(path):
    if path.name in ("_ops.py", "_library.py"):
        return
    assert "torch.ops.fastamp" not in path.read_text(), (
        f"{path.relative_to(ROOT)} calls torch.ops.fastamp directly; call the capability's _ops.py"
    )


# The shipped library speaks only the LibTorch stable ABI (csrc/common/torch_api.h): no libtorch C++
# header, no at:: / torch:: C++ API. c10:: names are allowed only where the header-only library
# defines them (torch/headeronly: ScalarType, Half, BFloat16, toString). csrc/emu/ is the CUDA
# emulator, a test harness built against the running torch, and is exempt.
_UNSTABLE = [
    (
        re.compile(
            r"#\s*include\s*[<\"](ATen/|c10/|torch/library\.h|torch/extension\.h|torch/all\.h)"
        ),
        "includes a libtorch C++ header",
    ),
    (re.compile(r"\bat::"), "uses the at:: C++ API"),
    (
        re.compile(r"\bc10::(?!(ScalarType|Half|BFloat16|toString|DeviceType|Layout)\b)\w+"),
        "uses a c10:: name outside torch/headeronly",
    ),
    (re.compile(r"\bTORCH_(CHECK|INTERNAL_ASSERT|LIBRARY)\w*\("), "uses a libtorch C++ macro"),
]


def unstable_uses(text: str) -> list[str]:
    """Lines of ``text`` (C++ source, comments stripped) that reach past the stable ABI."""
    code = re.sub(r"//[^\n]*", "", text)
    out = []
    for n, line in enumerate(code.splitlines(), 1):
        out += [f"line {n}: {why}" for rx, why in _UNSTABLE if rx.search(line)]
    return out


def test_stable_abi_scanner_catches_and_allows():
    ok = '#include "common/torch_api.h"\nc10::ScalarType t; c10::Half h; // at::Tensor in a comment\n'
    assert unstable_uses(ok) == []
    assert unstable_uses("#include <ATen/ATen.h>\n") == ["line 1: includes a libtorch C++ header"]
    assert unstable_uses("x;\nat::Tensor t;\n") == ["line 2: uses the at:: C++ API"]
    assert unstable_uses("c10::cuda::CUDAGuard g(d);\n") == [
        "line 1: uses a c10:: name outside torch/headeronly"
    ]
    assert unstable_uses("TORCH_LIBRARY_IMPL(fastamp, CPU, m) {}\n") == [
        "line 1: uses a libtorch C++ macro"
    ]


@pytest.mark.parametrize(
    "path",
    [p for p in _sources() if p.suffix != ".py" and "emu" not in p.relative_to(ROOT).parts],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_csrc_uses_only_the_stable_abi(path):
    bad = unstable_uses(path.read_text())
    assert not bad, f"{path.relative_to(ROOT)} reaches past the LibTorch stable ABI: {bad}"


def test_docs_architecture_places_every_python_file():
    """docs/architecture.md's "Where things go" table names every file of python/fastamp (a row
    may name several files of one folder, `dir/a.py`, `b.py`, or a whole folder, `dir/`), and
    names no file that does not exist."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc[doc.index("Python (`python/fastamp/`") : doc.index("C++ (`csrc/`)")]
    named: set[str] = set()
    folders: set[str] = set()
    for row in re.findall(r"^\| (`[^|]+) \|", table, flags=re.M):
        folder = ""
        for item in re.findall(r"`([\w/.]+)`", row):
            if item.endswith("/"):
                folders.add(item)
                continue
            if "/" in item:
                folder = item.rsplit("/", 1)[0] + "/"
                named.add(item)
            else:
                named.add(folder + item)
    files = {str(p.relative_to(PY)) for p in _py_files()}
    # (a capability's __init__.py holds its public names, as the table's first row says)
    unplaced = sorted(
        f
        for f in files
        if f not in named
        and not any(f.startswith(d) for d in folders)
        and not f.endswith("/__init__.py")
    )
    assert not unplaced, f"docs/architecture.md does not place {unplaced}"
    missing = sorted(n for n in named if n not in files)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
