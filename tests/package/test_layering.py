"""The package's layer order: imports point one way only, and no module imports itself back.

Every module of ``megatron_qrl`` is parsed (``ast``, not imported), every import statement
counts — at module level, inside functions, under ``TYPE_CHECKING`` (between files, one under
``TYPE_CHECKING`` counts where its name is used at run time: instantiated, or a method called
on a parameter it annotates) — and so does loading one
of the package's own modules by name (``importlib.import_module("megatron_qrl...")``,
``importlib.util.find_spec(...)``, ``__import__``): the package's own modules are imported
plainly. Failures name the file and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_qrl"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("compat", "utils"),
    ("sync",),
    ("quant",),
    ("models",),
    ("losses", "moe", "te_quant", "data", "rewards"),
    ("rollout",),
    ("rollout_sglang",),
    ("config",),
    ("rl", "cli"),
    ("integrations",),
)
"""Lowest first. A package imports only packages of its own tier or a lower one, and the
imports inside a tier form no cycle.

- ``sync`` (the weight sync's protocol: wire format, fingerprints, reserved names) needs
  only torch and the HF-name parser of ``utils``: both sides of the process boundary import
  it, the SGLang-side loader without loading any trainer-side package.
- ``data`` (tokenizer, prompt files, synthetic task) and ``rewards`` (answer scoring) are
  task inputs of the RL loop that need only ``utils``: they sit in the tier of ``losses``
  (pure functions the RL loop composes), below ``rollout`` so that a rollout worker may score
  and tokenize.
- ``config`` (the option dataclasses, ``--qrl-*`` flags and their checks) sits under ``rl``:
  the driver, trainer and CLI of ``rl`` are built from its dataclasses, and it reads nothing
  of ``rl``. The command line (``rl/cli.py``, ``qrl-train``) is the top of ``rl``.
- The top-level ``megatron_qrl/__init__.py`` (``__version__``) imports nothing of its own, so
  any module may import it."""

KNOWN_UPWARD: dict[tuple[str, str], str] = {}
"""(file under megatron_qrl/, imported package) -> why it is allowed for now."""

_LOADERS = {"import_module", "find_spec", "__import__"}


def _tier(package: str) -> int:
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    raise KeyError(package)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _module_name(path).split(".")
    if not _is_package(path):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every import of ``path`` (all of them, also inside functions)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(path, node)
            for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                yield node.lineno, f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") \
                    else base
        elif isinstance(node, ast.Call) and _called(node) in _LOADERS and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, f"importlib:{arg.value}"


def _called(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _files() -> list[Path]:
    return sorted((ROOT / PACKAGE).rglob("*.py"))


def _package_of(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[0] != PACKAGE:
        return None
    return parts[1] if len(parts) > 1 else ""


def _rel(path: Path) -> str:
    return path.relative_to(ROOT / PACKAGE).as_posix()


def _edges() -> list[tuple[Path, int, str, str]]:
    """``(file, line, its package ('' for the top level), imported module)`` of every import."""
    return [(path, line, _package_of(_module_name(path)), target)
            for path in _files() for line, target in imports(path)]


def test_the_top_level_module_imports_nothing_of_its_own():
    top = ROOT / PACKAGE / "__init__.py"
    assert [t for _, t in imports(top) if t.startswith(PACKAGE)] == []


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in (ROOT / PACKAGE).glob("*/__init__.py")}
    packages |= {p.stem for p in (ROOT / PACKAGE).glob("*.py") if p.stem != "__init__"}
    missing = sorted(p for p in packages if not any(p in t for t in LAYERS))
    assert not missing, f"add {missing} to LAYERS in tests/package/test_layering.py"


def _module_strings(path: Path) -> Iterator[tuple[int, str]]:
    """In a file that uses ``importlib``: string constants (not docstrings) that are exactly
    the dotted name of an own module, a by-name load in disguise (``LAZY =
    ("megatron_qrl.losses", ...)``). Dotted paths handed to a host framework's hooks (slime's
    ``--custom-*-path``) are names for the host to load, not loads of ours."""
    tree = ast.parse(path.read_text(), str(path))
    if not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "importlib" in ast.unparse(n)
               for n in ast.walk(tree)):
        return
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)
            and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                and node.value.startswith(f"{PACKAGE}.") and _is_module(node.value)):
            yield node.lineno, node.value


def test_own_modules_are_imported_plainly():
    """No ``importlib`` / ``find_spec`` / "whether or not installed" guard for own modules."""
    bad = [f"megatron_qrl/{_rel(path)}:{line} loads {target[len('importlib:'):]} by name"
           for path, line, _, target in _edges()
           if target.startswith(f"importlib:{PACKAGE}")]
    bad += [f"megatron_qrl/{_rel(path)}:{line} names module {name!r} in a string"
            for path in _files() for line, name in _module_strings(path)]
    bad += [f"megatron_qrl/{_rel(path)}:{line} guards the import of {name} with "
            "except ImportError" for path in _files() for line, name in _guarded(path)]
    assert not bad, "import the package's own modules with a plain import statement:\n" + \
        "\n".join(bad)


def _guarded(path: Path) -> Iterator[tuple[int, str]]:
    """Own-module imports inside ``try:`` blocks that catch ImportError ("if installed")."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Try):
            continue
        caught = " ".join(ast.unparse(h.type) for h in node.handlers if h.type is not None)
        if "ImportError" not in caught and "ModuleNotFoundError" not in caught:
            continue
        for stmt in node.body:
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.ImportFrom) and (sub.level or (sub.module or "")
                                                        .startswith(PACKAGE)):
                    yield sub.lineno, "." * sub.level + (sub.module or "")
                elif isinstance(sub, ast.Import):
                    yield from ((sub.lineno, a.name) for a in sub.names
                                if a.name.startswith(PACKAGE))


def test_known_exceptions_are_still_needed():
    """An exception whose import is gone must leave KNOWN_UPWARD (the layer order tightens)."""
    seen = {(_rel(p), _package_of(t)) for p, _, _, t in _edges()}
    stale = sorted(k for k in KNOWN_UPWARD if k not in seen)
    assert not stale, f"remove {stale} from KNOWN_UPWARD in tests/package/test_layering.py"


def test_no_upward_import():
    bad = []
    for path, line, own, target in _edges():
        dst = _package_of(target)
        if dst is None or not own or dst == own:
            continue
        if dst == "":  # the top-level __init__ (``__version__``) imports nothing of its own
            continue
        if _tier(dst) > _tier(own) and (_rel(path), dst) not in KNOWN_UPWARD:
            bad.append(f"megatron_qrl/{_rel(path)}:{line}: {own} (layer {_tier(own)}) imports "
                       f"{target} ({dst}, layer {_tier(dst)})")
    assert not bad, "upward imports (see LAYERS in tests/package/test_layering.py):\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _where(edges: list[tuple[Path, int, str, str]], comp: list[str], key) -> list[str]:
    return [f"  megatron_qrl/{_rel(p)}:{line} imports {t}" for p, line, own, t in edges
            if key(p, own) in comp and key(None, t) in comp and key(p, own) != key(None, t)]


def test_no_package_cycle():
    edges = [e for e in _edges() if _package_of(e[3]) and e[2]
             and (_rel(e[0]), _package_of(e[3])) not in KNOWN_UPWARD]
    graph: dict[str, set[str]] = {}
    for _, _, own, target in edges:
        graph.setdefault(own, set()).add(_package_of(target))

    def key(path, name):
        return name if path is not None else _package_of(name)

    msgs = [f"packages {comp} import each other:\n" + "\n".join(_where(edges, comp, key))
            for comp in _cycles(graph)]
    assert not msgs, "\n".join(msgs)


def _type_checking_blocks(tree: ast.AST) -> list[ast.If]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.If)
            and "TYPE_CHECKING" in ast.unparse(n.test)]


def _bound(path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str]]:
    """``(name bound in the file, imported module)`` of one import statement."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.asname or alias.name.split(".")[0], alias.name
        return
    base = _resolve(path, node)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield alias.asname or alias.name, sub if _is_module(sub) else base


def _annotation_ids(tree: ast.AST) -> set[int]:
    """Ids of every node inside an annotation (never evaluated: ``from __future__ import
    annotations`` in every module)."""
    roots = []
    for n in ast.walk(tree):
        if isinstance(n, ast.arg) and n.annotation is not None:
            roots.append(n.annotation)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            roots.append(n.returns)
        elif isinstance(n, ast.AnnAssign):
            roots.append(n.annotation)
    return {id(x) for r in roots for x in ast.walk(r)}


def _names_in(node: ast.AST | None) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node is not None else set()


def _called_through_annotation(tree: ast.AST, name: str) -> int | None:
    """Line of the first call of a method on a parameter annotated with ``name``
    (``def f(spec: QuantSpec): spec.pack(...)``): the function needs ``name``'s class at run
    time, whatever the annotation says about importing it."""
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = fn.args
        params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                  if p is not None and name in _names_in(getattr(p, "annotation", None))}
        for call in ast.walk(fn):
            if (params and isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id in params):
                return call.lineno
    return None


def _used_at_run_time(tree: ast.AST, name: str, skip: set[int]) -> int | None:
    """Line where a name imported under ``TYPE_CHECKING`` is used when the code runs: read
    outside annotations (``QuantSpec(...)``, ``isinstance(x, QuantSpec)``), or called through
    a parameter annotated with it. None where it only annotates."""
    notes = _annotation_ids(tree)
    for n in ast.walk(tree):
        if (isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                and id(n) not in notes and id(n) not in skip):
            return n.lineno
    return _called_through_annotation(tree, name)


def _runtime_imports(path: Path) -> Iterator[tuple[int, str]]:
    """:func:`imports` without those under ``if TYPE_CHECKING:`` that only annotate: an import
    there whose name is used at run time (:func:`_used_at_run_time`) is a dependency like any
    other, reported at the line of the use."""
    tree = ast.parse(path.read_text(), str(path))
    blocks = _type_checking_blocks(tree)
    skip = {id(n) for b in blocks for n in ast.walk(b)}
    lines = {n.lineno for b in blocks for n in ast.walk(b) if hasattr(n, "lineno")}
    for line, target in imports(path):
        if line not in lines:
            yield line, target
    for node in (n for b in blocks for n in ast.walk(b)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name, target in _bound(path, node):
                used = _used_at_run_time(tree, name, skip)
                if used is not None:
                    yield used, target


def test_no_module_cycle():
    """No file imports itself back through other files (``a -> b -> a``), lazily or not, nor
    through a ``TYPE_CHECKING`` import whose name the file uses at run time."""
    graph: dict[str, set[str]] = {}
    edges = []
    for path in _files():
        me = _module_name(path)
        for line, target in _runtime_imports(path):
            if target.startswith(f"{PACKAGE}.") and target != me:
                graph.setdefault(me, set()).add(target)
                edges.append((path, line, me, target))
    msgs = [f"modules {comp} import each other:\n" + "\n".join(
                f"  megatron_qrl/{_rel(p)}:{line} imports {t}" for p, line, me, t in edges
                if me in comp and t in comp)
            for comp in _cycles(graph)]
    assert not msgs, "\n".join(msgs)


@pytest.mark.parametrize("source, expected", [
    ("from megatron_qrl.rl import driver\n", "megatron_qrl.rl.driver"),
    ("def f():\n    from ..rollout_sglang import engine\n", "megatron_qrl.rollout_sglang.engine"),
    ("import importlib\nimportlib.import_module('megatron_qrl.te_quant')\n",
     "importlib:megatron_qrl.te_quant"),
])
def test_the_scan_sees_lazy_and_relative_imports(tmp_path, monkeypatch, source, expected):
    """The checker itself can fail: a lazy, relative or by-name import is found."""
    fake = ROOT / PACKAGE / "quant" / "_layering_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert expected in [t for _, t in imports(fake)]


def test_the_design_doc_states_these_layers():
    """docs/DESIGN.md's layer line is :data:`LAYERS`, lowest first."""
    line = " -> ".join(", ".join(tier) for tier in LAYERS)
    assert line in (ROOT / "docs" / "DESIGN.md").read_text(), \
        f"docs/DESIGN.md: write the layer line as {line!r} (tests/package/test_layering.py)"


def test_an_upward_import_is_reported():
    assert _tier("quant") < _tier("models") < _tier("te_quant") < _tier("rollout")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("source, runs", [
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_qrl.quant.spec "
     "import QuantSpec\ndef f(spec: QuantSpec) -> int:\n    return spec.pack(1)\n", True),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_qrl.quant.spec "
     "import QuantSpec\ndef f(x) -> None:\n    return QuantSpec()\n", True),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_qrl.quant.spec "
     "import QuantSpec\ndef f(spec: QuantSpec) -> QuantSpec:\n    return spec\n", False),
])
def test_a_type_checking_import_used_at_run_time_counts(monkeypatch, source, runs):
    """A name imported under ``TYPE_CHECKING`` and then instantiated, or called through a
    parameter it annotates, is a dependency of the module; one that only annotates is not."""
    fake = ROOT / PACKAGE / "quant" / "_layering_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert ("megatron_qrl.quant.spec" in [t for _, t in _runtime_imports(fake)]) is runs
