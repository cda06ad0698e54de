"""The package's layer order: imports point one way only, and no module imports itself back.

Every module of ``megatron_qrl`` is parsed (``ast``, not imported), every import statement
counts — at module level, inside functions, under ``TYPE_CHECKING`` — and so does loading one
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


def _runtime_imports(path: Path) -> Iterator[tuple[int, str]]:
    """:func:`imports` without those under ``if TYPE_CHECKING:`` (never executed)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    lines = {n.lineno for n in ast.walk(tree) if id(n) in skip and hasattr(n, "lineno")}
    for line, target in imports(path):
        if line not in lines:
            yield line, target


def test_no_module_cycle():
    """No file imports itself back through other files (``a -> b -> a``), lazily or not."""
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


def test_an_upward_import_is_reported():
    assert _tier("quant") < _tier("models") < _tier("te_quant") < _tier("rollout")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
