"""The package layout shows the stages, and the stages import downwards only.

``fastamp.reference`` (the spec) is below ``fastamp.ops`` (op table, dispatch, checked ops), which
is below ``fastamp.optim`` and ``fastamp.scaler``. A module-level import that points upwards, or
a circle of module-level imports, fails here (read from the sources with ``ast``, so an import
hidden in a function body, which runs only when called, is listed separately and allowed only
where it is not upwards). The public paths ``fastamp.backends`` and ``fastamp.functional`` are
the ``fastamp.ops`` modules themselves.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "fastamp"

# stage of each package prefix: a module may import only from its own stage or lower ones
STAGES = {
    "fastamp.reference": 0,
    "fastamp.ops": 1,
    "fastamp.kernels": 1,
    "fastamp.optim": 2,
    "fastamp.scaler": 2,
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(path, module):
    """(target, top_level) for every ``fastamp`` import in the file."""
    tree = ast.parse(path.read_text())
    top = set(id(n) for n in tree.body)

    def walk(node, at_top):
        for child in ast.iter_child_nodes(node):
            here = at_top and (id(child) in top or isinstance(child, (ast.If, ast.Try)))
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module == "fastamp" or child.module.startswith("fastamp."):
                    for a in child.names:  # a submodule, or a name of the module (reduced in _graph)
                        yield f"{child.module}.{a.name}", here
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith("fastamp."):
                        yield a.name, here
            yield from walk(
                child, here and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            )

    yield from walk(tree, True)


def _stage(module):
    best = None
    for prefix, stage in STAGES.items():
        if module == prefix or module.startswith(prefix + "."):
            best = stage
    return best


_ALIASES = {"fastamp.backends": "fastamp.ops.backends", "fastamp.functional": "fastamp.ops.functional"}


def _graph():
    names = {m for m, _ in _modules()}
    graph = {}
    for module, path in _modules():
        edges = []
        for target, top in _imports(path, module):
            target = _ALIASES.get(target, target)
            while target not in names and "." in target:  # `from fastamp.x import name` -> fastamp.x
                target = target.rsplit(".", 1)[0]
            if target in names and target != module:
                edges.append((target, top))
        graph[module] = edges
    return graph


def test_the_stages_exist():
    for pkg in ("ops", "optim/engine", "optim/formats", "optim/rules", "scaler", "reference"):
        assert (PKG / pkg / "__init__.py").is_file(), pkg
    for gone in ("_ops.py", "_validate.py", "optim/_base.py", "optim/_plan.py", "optim/adamw.py"):
        assert not (PKG / gone).exists(), f"{gone} moved into a stage folder"


def test_no_import_points_upwards():
    upwards = []
    for module, edges in _graph().items():
        s = _stage(module)
        for target, top in edges:
            t = _stage(target)
            if s is not None and t is not None and t > s:
                upwards.append(f"{module} -> {target}" + ("" if top else " (in a function)"))
    assert not upwards, upwards


def test_no_module_level_import_circle():
    graph = {m: [t for t, top in edges if top] for m, edges in _graph().items()}
    state, circles = {}, []

    def visit(m, path):
        state[m] = 1
        for t in graph.get(m, ()):
            if state.get(t) == 1:
                circles.append(path[path.index(t) :] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    # the package __init__ files import their children (and fastamp/__init__ everything): those
    # parent -> child edges are how packages work, not circles between stages
    real = [c for c in circles if not any(b.startswith(a + ".") for a, b in zip(c, c[1:]))]
    assert not real, real


def test_the_import_graph_is_read():
    # guards the tests above against reading nothing: known edges are found
    graph = _graph()
    assert ("fastamp.ops.registry", True) in graph["fastamp.ops.backends"]
    assert any(t == "fastamp.optim.engine.base" for t, _ in graph["fastamp.optim.rules.adamw"])


@pytest.mark.parametrize("first", ["fastamp.functional", "fastamp.backends", "fastamp.optim", "fastamp.ops.validate"])
def test_public_paths_are_the_stage_modules(first):
    code = (
        f"import {first}\n"
        "import fastamp, fastamp.backends, fastamp.functional, fastamp.ops.backends, fastamp.ops.functional\n"
        "assert fastamp.backends is fastamp.ops.backends\n"
        "assert fastamp.functional is fastamp.ops.functional\n"
        "from fastamp.backends import set_backend, available\n"
        "from fastamp.functional import adamw_\n"
        "assert fastamp.optim.AdamW.__module__ == 'fastamp.optim.rules.adamw'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
