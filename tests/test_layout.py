"""The package layout holds, read from the source with ast and tokenize: the library's imports run
down its layers, no private names cross modules, modules stay small, no import circle anywhere,
the library never imports the serving code, the HTTP layer never imports Ray or the Ray app, the
serving code uses only what `ponytail` exports (and `ponytail.config`), and no comment, docstring
or config comment reads as a lab notebook (sessions, leases, dates)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import ponytail

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "ponytail_core"
SERVING = ROOT / "deployments"
PRODUCT = sorted([*CORE.rglob("*.py"), *SERVING.rglob("*.py")])

# Bottom to top; a module may import its own layer and the layers below (docs/design.md).
LAYERS = ["errors", "utils", "kernels", "kv", "attention", "sampling", "models", "config", "runner", "engine",
          "plugin", "llm", "engine_core", "async_llm", "process_llm", "bench", "cli", "__init__"]
MAX_LINES = 400
PUBLIC_MODULES = ("ponytail", "ponytail.config")  # what deployments/ may import from the library


def _module_name(path: Path) -> str:
    """The dotted name users import: ponytail_core/kv/config.py -> ponytail.kv.config."""
    if path.is_relative_to(CORE):
        parts = ("ponytail",) + path.relative_to(CORE).with_suffix("").parts
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(module: str, package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


MODULES = {_module_name(path): path for path in PRODUCT}


def _imports(path: Path):
    """(imported module, names, line) for every import of one file, relative ones resolved; a name
    that is a module of ours counts as importing that module."""
    module = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, _is_package(path), node)
            names = [a.name for a in node.names]
            submodules = [n for n in names if f"{target}.{n}" in MODULES]
            for name in submodules:
                yield f"{target}.{name}", [], node.lineno
            if len(submodules) < len(names):
                yield target, [n for n in names if n not in submodules], node.lineno


def _ours(target: str) -> str | None:
    """The module of ours an import names (a name inside a module: that module), or None."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _layer(module: str) -> str:
    """'ponytail.kv.paged_cache' -> 'kv'; 'ponytail' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_run_down_the_layers():
    upward = []
    for path in CORE.rglob("*.py"):
        module = _module_name(path)
        if module == "ponytail":
            continue  # the package exports names from every layer
        for target, _, line in _imports(path):
            if target.startswith("ponytail") and (ours := _ours(target)) is not None and ours != "ponytail":
                if LAYERS.index(_layer(ours)) > LAYERS.index(_layer(module)):
                    upward.append(f"{module}:{line} imports {ours} ({_layer(ours)} is above {_layer(module)})")
    assert not upward, "\n".join(upward)


def test_no_private_name_is_imported_across_modules():
    private = [f"{_module_name(path)}:{line} imports {target}.{name}" for path in PRODUCT
               for target, names, line in _imports(path) for name in names
               if name.startswith("_") and name not in ("__version__", "__future__") and target != "__future__"]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (> {MAX_LINES}): two jobs in one file?"


def test_no_import_circle_anywhere():
    """Tarjan's strongly connected components over the module graph: any with two modules is a circle."""
    graph = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for target, _, _ in _imports(path):
            ours = _ours(target)
            if ours is not None and ours != module and not _is_ancestor(ours, module):
                graph[module].add(ours)
    circles = [sorted(component) for component in _components(graph) if len(component) > 1]
    assert not circles, "\n".join(" <-> ".join(circle) for circle in circles)


def _is_ancestor(package: str, module: str) -> bool:
    """Importing from one's own package's __init__ (its exports) is how a package is used, not a circle."""
    return module.startswith(package + ".")


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            found.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_library_never_imports_the_serving_code():
    offending = [f"{_module_name(path)}:{line} imports {target}" for path in CORE.rglob("*.py")
                 for target, _, line in _imports(path) if target == "deployments" or target.startswith("deployments.")]
    assert not offending, "\n".join(offending)


def test_the_http_layer_never_imports_ray_or_the_ray_app():
    offending = [f"{_module_name(path)}:{line} imports {target}" for path in (SERVING / "api").rglob("*.py")
                 for target, _, line in _imports(path)
                 if target.split(".")[0] == "ray" or target.startswith("deployments.app")]
    assert not offending, "\n".join(offending)


def test_every_subpackage_says_its_job_and_what_it_may_import():
    for init in [*CORE.glob("*/__init__.py"), *SERVING.glob("*/__init__.py")]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Imports:" in doc, f"{init.relative_to(ROOT)}'s docstring must say what it may import"


def test_serving_code_uses_only_public_ponytail_names():
    offending = []
    for path in SERVING.rglob("*.py"):
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ponytail":
                if node.module not in PUBLIC_MODULES:
                    offending.append(f"{where}:{node.lineno} imports from {node.module}")
                elif node.module == "ponytail":
                    offending += [f"{where}:{node.lineno} imports ponytail.{a.name}, which ponytail does not export"
                                  for a in node.names if a.name not in ponytail.__all__]
            elif isinstance(node, ast.Import):
                offending += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                              if a.name.startswith("ponytail.") and a.name not in PUBLIC_MODULES]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ponytail":
                if node.attr not in ponytail.__all__ and node.attr != "__version__":
                    offending.append(f"{where}:{node.lineno} uses ponytail.{node.attr}, which ponytail does not export")
    assert not offending, "\n".join(offending)


# A lab notebook's marks: "session 40", "the fortieth session", "lease 73", a lease at all, a date.
DIARY = re.compile(r"\b[a-z-]*(?:first|second|third|[a-z]th)[\s-]+sessions?\b|\bsessions?\s+\d+|\bleases?\b"
                   r"|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)
NOTEBOOK_SOURCES = sorted([*PRODUCT, *(ROOT / "cuda_kernels").glob("*.cu"), *(ROOT / "benchmarks").glob("*.py")])


def _comments_and_docstrings(path: Path):
    """(line, text) of every comment and docstring of a Python file; of every // and /* */ comment of
    a .cu file; of every # comment of a YAML file."""
    source = path.read_text()
    if path.suffix == ".py":
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                yield token.start[0], token.string
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield getattr(node, "lineno", 1), doc
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                yield node.lineno, node.value.value  # attribute docstrings (ponytail.config's fields)
    else:
        pattern = r"#.*" if path.suffix == ".yaml" else r"//.*|/\*.*?\*/"
        for match in re.finditer(pattern, source, re.DOTALL):
            yield source.count("\n", 0, match.start()) + 1, match.group()


@pytest.mark.parametrize("path", [*NOTEBOOK_SOURCES, SERVING / "app.yaml", ROOT / "cluster.yaml"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_comment_or_docstring_reads_as_a_diary(path: Path):
    """Comments say what the code guarantees and why; when it was measured, in which session or
    lease, lives in git and in docs/benchmarks.md's one table."""
    found = sorted({f"{path.relative_to(ROOT)}:{line}: {DIARY.search(text).group()!r}"
                    for line, text in _comments_and_docstrings(path) if DIARY.search(text)})
    assert not found, "\n".join(found)
