"""The package layout holds: imports run down the layers, no private names cross modules, modules
stay small, and deployments/ uses only what `ponytail` exports. Read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ponytail

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "ponytail_core"

# Bottom to top; a module may import its own layer and the layers below (docs/design.md).
LAYERS = ["errors", "utils", "kernels", "kv", "attention", "sampling", "models", "config", "runner", "engine",
          "plugin", "llm", "engine_core", "async_llm", "process_llm", "bench", "serve_command", "cli", "__init__"]
MAX_LINES = 400


def _layer(module: str) -> str:
    """'kv.paged_cache' -> 'kv'; 'llm' -> 'llm'."""
    return module.split(".")[0]


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute module (relative to ponytail) an ImportFrom names, or None if outside ponytail."""
    if node.level == 0:
        name = node.module or ""
        if name == "ponytail" or name.startswith("ponytail."):
            return name.removeprefix("ponytail").removeprefix(".")
        return None
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _core_imports():
    """(importing module, imported module, imported names, line) for every ponytail-internal import."""
    for path in sorted(CORE.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, path, node)
                if target is None:
                    continue
                names = [a.name for a in node.names]
                if not target:  # `from . import x` at the top: x is the module
                    for name in names:
                        yield module, name, [], node.lineno
                elif all((CORE / target.replace(".", "/") / f"{n}.py").exists() for n in names):
                    for name in names:  # `from .pkg import module`
                        yield module, f"{target}.{name}", [], node.lineno
                else:
                    yield module, target, names, node.lineno


def test_imports_run_down_the_layers():
    upward = []
    for module, target, _, line in _core_imports():
        if module == "__init__":
            continue  # the package exports names from every layer
        if LAYERS.index(_layer(target)) > LAYERS.index(_layer(module)):
            upward.append(f"{module}:{line} imports {target} ({_layer(target)} is above {_layer(module)})")
    assert not upward, "\n".join(upward)


def test_no_private_name_is_imported_across_modules():
    private = [f"{module}:{line} imports {target}.{name}" for module, target, names, line in _core_imports()
               for name in names if name.startswith("_") and name != "__version__"]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_modules_stay_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (> {MAX_LINES}): two jobs in one file?"


def test_every_subpackage_says_its_job_and_what_it_may_import():
    for init in CORE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Imports:" in doc, f"{init.relative_to(ROOT)}'s docstring must say what it may import"


def test_deployments_use_only_public_ponytail_names():
    offending = []
    for path in sorted((ROOT / "deployments").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ponytail"):
                if node.module != "ponytail":
                    offending.append(f"{path.name}:{node.lineno} imports from {node.module}")
                offending += [f"{path.name}:{node.lineno} imports ponytail.{a.name}, which ponytail does not export"
                              for a in node.names if a.name not in ponytail.__all__]
            elif isinstance(node, ast.Import):
                offending += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                              if a.name.startswith("ponytail.")]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ponytail":
                if node.attr not in ponytail.__all__ and node.attr != "__version__":
                    offending.append(f"{path.name}:{node.lineno} uses ponytail.{node.attr}, which ponytail does not export")
    assert not offending, "\n".join(offending)
