"""The package's shape: no import cycle between its modules (lazy imports included), every import points down the
layers below, the engine knows nothing of the layers above it, no module opens with more than a short docstring,
and no function or module outgrows what a reader takes in (80 and 500 lines)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MODULES = {}
for path in SRC.rglob("*.py"):
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    MODULES[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path


def imports(module: str) -> set[str]:
    """The package's modules that `module` imports anywhere in its body."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{target}.{alias.name}" for alias in node.names]
            found.update(s for s in subs if s in MODULES)
            if any(s not in MODULES for s in subs) and target in MODULES:
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
    return found - {module}


def test_no_import_cycles():
    graph = {m: imports(m) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            assert state.get(nxt) != 1, " -> ".join([*path, module, nxt])
            if nxt not in state:
                visit(nxt, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_engine_does_not_reach_up():
    above = ("metasd.cli", "metasd.serving", "metasd.bench", "metasd.specialists", "metasd.learning")
    for module in MODULES:
        if module.startswith(above) or module == "metasd":
            continue
        reached = {m for m in imports(module) if m.startswith(above)}
        assert not reached, f"{module} imports {sorted(reached)}"


def test_module_docstrings_are_short():
    for module, path in MODULES.items():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        assert len(doc.splitlines()) <= 15, f"{module}: a {len(doc.splitlines())}-line docstring"


def test_argparse_lives_in_the_cli():
    for module, path in MODULES.items():
        if not module.startswith("metasd.cli"):
            assert "argparse" not in path.read_text(), module


# Lowest first: a module may import its own layer's modules and those of the layers below, never one above.
LAYERS = [
    # names, token lists, records, sampling, the OpenMP runtime's threads, the machine, files
    (
        "metasd.names",
        "metasd.tokens",
        "metasd.draft",
        "metasd.sampling",
        "metasd.stats",
        "metasd.processors",
        "metasd.openmp",
        "metasd.machine",
        "metasd.files",
    ),
    ("metasd.tree", "metasd.outcome"),  # a round's draft tree and what it yielded
    ("metasd.verify", "metasd.round", "metasd.models"),  # acceptance rules, a round's state, loading models
    ("metasd.cached_model", "metasd.slots", "metasd.costs"),  # a model's caches (one sequence, rows), the costs
    ("metasd.drafters",),
    ("metasd.policy",),
    ("metasd.drafting", "metasd.generation", "metasd.engine"),  # one request's round
    ("metasd.batching",),  # many requests' rounds
    ("metasd.hf", "metasd.specialists", "metasd.learning", "metasd.serving"),
    ("metasd.bench",),
    ("metasd.cli",),
    ("metasd",),  # the package's public names
]


def layer(module: str) -> int:
    """The layer of the longest name in LAYERS that is the module or a package holding it."""
    matches = [
        (len(name), i)
        for i, names in enumerate(LAYERS)
        for name in names
        if module == name or module.startswith(name + ".")
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def test_each_module_is_in_its_own_layer_not_the_packages():
    assert layer("metasd.draft") == 0 and layer("metasd.generation") == layer("metasd.engine") == 6
    assert layer("metasd.cli.generate") == layer("metasd.cli") == len(LAYERS) - 2 and layer("metasd") == len(LAYERS) - 1


def test_no_module_imports_upward():
    for module in MODULES:
        up = {m for m in imports(module) if layer(m) > layer(module)}
        assert not up, f"{module} (layer {layer(module)}) imports {sorted(up)} from above"


def test_no_function_over_80_lines_and_no_module_over_500():
    long = []
    for module, path in MODULES.items():
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long.append(f"{module}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_public_classes_and_functions_have_docstrings():
    """Every public class and module-level function says what it is; a public method does too, unless some class in
    the package documents a method of the same name (an override need not repeat its base's or Protocol's docstring).
    """
    trees = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}
    documented = {
        item.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(item) is not None
    }
    missing = []

    def walk(module: str, nodes: list[ast.stmt], owner: str | None) -> None:
        for node in nodes:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name[0] == "_":
                continue
            name = f"{owner}.{node.name}" if owner else node.name
            method = owner is not None and not isinstance(node, ast.ClassDef)
            if ast.get_docstring(node) is None and not (method and node.name in documented):
                missing.append(f"{MODULES[module].relative_to(SRC.parent)}:{node.lineno} {name}")
            if isinstance(node, ast.ClassDef):
                walk(module, node.body, name)

    for module, tree in sorted(trees.items()):
        walk(module, tree.body, None)
    assert not missing, f"{len(missing)} public names without a docstring:\n" + "\n".join(missing)


def test_every_public_name_resolves_where_it_is_defined():
    """`metasd.X` for each name of `__all__` (imported on first use) is the object its module defines."""
    import importlib

    import metasd

    for name in metasd.__all__:
        value = getattr(metasd, name)
        assert getattr(importlib.import_module(value.__module__), name) is value
    assert set(metasd.__all__) <= set(dir(metasd))
