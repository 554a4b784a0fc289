# SPDX-License-Identifier: Apache-2.0
"""The package's shape: sides in folders, small files, no import circle, and
settings that cost nothing to build."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "vllm_infinigen"
MAX_LINES = 400


def _modules(*roots: Path) -> dict[str, Path]:
    """Modules under ``roots`` (default: the package) by dotted name."""
    modules = {}
    for path in (path for root in roots or (PACKAGE,) for path in root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(path: Path, modules: dict[str, Path], strings: bool = True) -> set[str]:
    """Package modules ``path`` imports at run time: import statements outside
    ``if TYPE_CHECKING:``, and (``strings``) "module:attr", "module.attr" or
    "module" strings naming a package module (what ``importlib`` or vLLM loads
    by name: the policy registry, the platforms' worker classes, the connector)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            target = node.value.partition(":")[0]
            found.update((target, target.rpartition(".")[0]))  # "module.Class" too
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in modules}


def test_no_package_file_is_over_400_lines():
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*")
            if path.suffix in (".py", ".cpp", ".h")
            and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("roots", [("vllm_infinigen",), ("vllm_infinigen", "benchmarks", "tests")],
                         ids=["package", "repository"])
def test_no_import_circle_including_importlib_strings(roots):
    """None in the package, nor across the package, the benchmarks and the
    tests (a benchmark importing one that imports it back is a circle too)."""
    modules = _modules(*(REPO / root for root in roots))
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    # A package's __init__ runs before its modules: importing a module imports
    # its parents, so a module importing its own parent package is no circle.
    for name in graph:
        graph[name] = {dep for dep in graph[name] if not name.startswith(dep + ".")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                circle = path[path.index(dep):] + [dep]
                pytest.fail("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_graph_sees_registry_strings():
    """The circle check reads importlib's targets: the registry's policy modules."""
    modules = _modules()
    registry = _imports(PACKAGE / "policies" / "__init__.py", modules)
    assert "vllm_infinigen.policies.infinigen" in registry
    assert "vllm_infinigen.platforms.cpu.worker" in _imports(
        PACKAGE / "platforms" / "__init__.py", modules)


def test_a_platform_folder_is_reached_through_the_tables_only():
    """The device seam: no module outside ``platforms/<name>/`` imports
    ``vllm_infinigen.platforms.<name>`` or a module in it, at any level;
    ``platforms/__init__.py`` names them in its dotted-path tables (WORKERS,
    REFUSALS), and ``platforms/devices.py`` in its device tables, as strings,
    never by an import statement."""
    modules = _modules()
    folders = [name for name, path in modules.items()
               if name.startswith("vllm_infinigen.platforms.") and path.name == "__init__.py"]
    assert "vllm_infinigen.platforms.cuda" in folders and "vllm_infinigen.platforms.cpu" in folders

    def folder_of(name: str) -> str | None:
        return next((f for f in folders if name == f or name.startswith(f + ".")), None)

    crossings = []
    for name, path in sorted(modules.items()):
        tables = name in ("vllm_infinigen.platforms", "vllm_infinigen.platforms.devices")
        for dep in sorted(_imports(path, modules, strings=not tables)):
            folder = folder_of(dep)
            if folder is not None and folder_of(name) != folder:
                crossings.append(f"{path.relative_to(PACKAGE.parent)} imports {dep}")
    assert not crossings, "\n".join(crossings)


def test_platforms_import_no_patch_and_policies_come_through_the_registry():
    """A change to vLLM lives in ``patch/`` and decides itself where it applies
    (the worker mixin applies the model runner's): no module of ``platforms/``
    imports ``vllm_infinigen.patch``. Outside ``policies/``, a policy is
    reached through the registry (``policy_class``, ``PolicyTraits``): no
    module imports one policy's file, only ``policies.base``."""
    modules = _modules()
    policy_files = {name for name in modules if name.startswith("vllm_infinigen.policies.")
                    and name != "vllm_infinigen.policies.base"}
    found = []
    for name, path in sorted(modules.items()):
        for dep in sorted(_imports(path, modules)):
            patch = dep == "vllm_infinigen.patch" or dep.startswith("vllm_infinigen.patch.")
            if (patch and name.startswith("vllm_infinigen.platforms")) or (
                    dep in policy_files and not name.startswith("vllm_infinigen.policies")):
                found.append(f"{path.relative_to(PACKAGE.parent)} imports {dep}")
    assert not found, "\n".join(found)


def test_policies_import_no_worker_module_at_run_time():
    """The policies sit beside the worker, not above it: what both read (the
    block layouts, a step's widest selection) lives below both
    (``block_layout.py``); a policy names the worker's types for type
    checking only."""
    modules = _modules()
    found = [f"{path.relative_to(PACKAGE.parent)} imports {dep}"
             for name, path in sorted(modules.items())
             if name.startswith("vllm_infinigen.policies")
             for dep in sorted(_imports(path, modules, strings=False))
             if dep.startswith("vllm_infinigen.worker")]
    assert not found, "\n".join(found)


def test_building_the_settings_imports_no_worker_module():
    """``InfiniGenConfig()`` (also what ``--help`` builds) imports no kernel,
    layer state, step plan, runtime or policy module, in a fresh interpreter."""
    code = (
        "import sys\n"
        "from vllm_infinigen.config import InfiniGenConfig\n"
        "InfiniGenConfig(policy='h2o'); InfiniGenConfig(cpu_pool_gib=1.0)\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm_infinigen')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent).stdout
    loaded = ast.literal_eval(out.strip().splitlines()[-1])
    assert "vllm_infinigen.config" in loaded
    forbidden = ("vllm_infinigen.worker", "vllm_infinigen.platforms",  # and their kernels
                 "vllm_infinigen.policies.")
    assert [m for m in loaded if m.startswith(forbidden)] == []


def test_every_import_of_the_package_resolves():
    """Benchmarks and tests import the package at function level too (lazily):
    every ``from vllm_infinigen... import name`` anywhere in the repository
    names a module that exists and a name it defines."""
    import importlib

    repo = PACKAGE.parent
    missing = []
    for path in [*repo.glob("benchmarks/**/*.py"), *repo.glob("tests/**/*.py"),
                 *PACKAGE.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] == "vllm_infinigen"):
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError as e:
                missing.append(f"{path.relative_to(repo)}:{node.lineno}: {e}")
                continue
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(repo)}:{node.lineno}: "
                                       f"{node.module}.{alias.name}")
    assert missing == []


def test_device_apis_are_reached_through_the_platforms_only():
    """No module outside ``platforms/`` calls ``torch.cuda`` or branches on a device
    type (``.device.type ==``, ``.is_cuda``): what differs by device is a
    line in ``platforms/devices.py``'s tables or a ``DataPath`` attribute. (vLLM's ``current_platform`` checks of the patches are vLLM's.)"""
    pattern = re.compile(r"torch\.cuda\b|\.type\s*[!=]=|\.is_cuda\b")
    found = []
    for name, path in sorted(_modules().items()):
        if name.startswith("vllm_infinigen.platforms"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
