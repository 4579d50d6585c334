"""The shape the code keeps: source files under 450 lines, functions under 60 lines outside kernel
bodies (``@triton.jit`` / ``@gluon.jit``), one installed package, at most 15 modules a folder, and no
import circle (imports inside functions count: a lazy import still ties two modules together)."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("fusedserve", "kernels", "models", "service")
SOURCES = sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60


def _is_kernel(node) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_source_files_and_functions_stay_short(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path.name}: {len(text.splitlines())} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.slow
def test_the_wheel_installs_only_fusedserve(tmp_path):
    # Built from a copy (a build/ folder left in the checkout would leak stale modules into the
    # wheel), without isolation: every module of the source folders must be in it.
    source = tmp_path / "source"
    for name in (*PACKAGE_DIRS, "pyproject.toml", "README.md"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                             if (ROOT / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    names = zipfile.ZipFile(next(tmp_path.glob("fusedserve-*.whl"))).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"fusedserve"}, tops
    want = {f"fusedserve/{p.relative_to(ROOT)}" if p.parts[len(ROOT.parts)] != "fusedserve"
            else str(p.relative_to(ROOT)) for p in SOURCES}
    assert want <= set(names), sorted(want - set(names))
    assert "fusedserve/models/repository/digits/model.safetensors" in names
    for asset in ("index.html", "dashboard.js", "dashboard.css"):  # the live page ships in the package
        assert f"fusedserve/service/dashboard/{asset}" in names, asset


MAX_MODULES_PER_FOLDER = 15
PACKAGES = {"kernels": "fusedserve.kernels", "models": "fusedserve.models", "service": "fusedserve.service"}


def _modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _imports(path: Path, modules: dict) -> set[str]:
    """The package's modules ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusedserve"):
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fusedserve"))
    return {name for name in found if name in modules}


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import circle: " + " -> ".join(trail[trail.index(name):] + [name]))
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, trail + [name])
            done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_no_folder_holds_more_than_15_modules():
    folders = {path.parent for folder in PACKAGES for path in (ROOT / folder).rglob("*.py")}
    crowded = {str(f.relative_to(ROOT)): n for f in folders
               if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules: {crowded}"
