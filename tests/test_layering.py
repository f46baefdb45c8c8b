"""The import graph of `torchkv` (every import, function-level ones included, read with `ast`): modules import only
their own layer or the layers below, no import closes a circle, and no private name crosses a package border.

Layers, lowest first: `ops` (and the GPU kernels) <- `transforms` <- `pipeline` <- `methods` and the stores <-
`models` <- `fitting` (calibration and tuning) <- `eval` <- `cli`; `version`, `registry`, `data` and `memory` sit below
every layer. `KVPipeline.fit`/`tune`/`for_model` reach the layers above through `registry.delegate`."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "torchkv"
#: module-name prefix -> layer (the longest prefix decides); the package facade `torchkv` re-exports every layer
LAYERS = {
    "torchkv._compat": 0, "torchkv.version": 0, "torchkv.registry": 0, "torchkv.corpora": 0, "torchkv.memory": 0,
    "torchkv.ops": 1, "torchkv.transforms": 2, "torchkv.window": 3, "torchkv.pipeline": 3, "torchkv.methods": 4, "torchkv.store": 4,
    "torchkv.static_store": 4, "torchkv.encoded": 4, "torchkv.fp_window": 4, "torchkv.positions": 4, "torchkv.models": 5, "torchkv.fitting": 6, "torchkv.testing": 7, "torchkv.eval": 7,
    "torchkv.tasks": 7, "torchkv.cli": 8, "torchkv.__main__": 8,
}
#: the package `torchkv`, which re-exports every layer: the command line may use it, nothing below
FACADE = 8


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(imported module, names taken from it) of every import in the module `name`, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torchkv"):
                    yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("torchkv"):
                continue
            names = []
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # `from torchkv.x import submodule`
                    yield f"{base}.{alias.name}", []
                else:
                    names.append(alias.name)
            if names:  # `from torchkv import registry` imports the module `torchkv.registry`, not the facade's names
                yield base, names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _layer(name: str) -> int | None:
    if name == "torchkv":  # the facade, above every layer
        return FACADE
    prefixes = [p for p in LAYERS if name == p or name.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)] if prefixes else None


def _graph() -> tuple[dict[str, set[str]], set[tuple[str, str, str]]]:
    modules = _modules()
    edges, private = {name: set() for name in modules}, set()
    for name, path in modules.items():
        for imported, names in _imports(name, path, modules):
            if imported == name or imported not in modules:
                continue
            edges[name].add(imported)
            top = name.split(".")[:2], imported.split(".")[:2]
            private |= {(name, imported, n) for n in names if _private(n) and top[0] != top[1]}
    return edges, private


def _circles(edges: dict[str, set[str]]) -> set[str]:
    """Modules in a strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), set(), [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.update(component)

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    assert [m for m in _modules() if _layer(m) is None] == []


def test_no_import_goes_up_a_layer():
    edges, _ = _graph()
    upward = {(a, b) for a, targets in edges.items() if a != "torchkv" for b in targets if _layer(b) > _layer(a)}
    assert upward == set(), "imports that go up a layer"


def test_no_import_circles():
    edges, _ = _graph()
    circles = _circles({a: {b for b in targets if b != "torchkv"} for a, targets in edges.items()})
    assert circles == set(), "modules on an import circle"


def test_no_private_name_crosses_a_package():
    _, private = _graph()
    assert private == set(), "private names imported across packages"


def test_the_checks_see_a_violation(tmp_path):
    """The graph reader finds a function-level upward import and a circle in a module written for the test."""
    edges = {"torchkv.ops.a": {"torchkv.models.b"}, "torchkv.models.b": {"torchkv.ops.a"}, "torchkv.ops.c": set()}
    assert _circles(edges) == {"torchkv.ops.a", "torchkv.models.b"}
    source = tmp_path / "torchkv" / "ops" / "a.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from torchkv.models import _private, arch\n")
    found = list(_imports("torchkv.ops.a", source, {"torchkv.models.arch": source}))
    assert found == [("torchkv.models.arch", []), ("torchkv.models", ["_private"])]
    assert _layer("torchkv.models") > _layer("torchkv.ops.a") and _private("_private") and not _private("__version__")
