"""The package's layers, as docs/architecture.md draws them, hold in the source: every ``import`` (module level or
inside a function) points down or sideways, never up, and no two modules share a name at different levels."""

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "offpolicy"
KERNELS = ROOT / "kernels"

# Layer of each top-level subpackage or module of ``offpolicy`` (a lower number is lower in the house). The core is
# everything a user imports for the loss; the fleet (sampler groups, router, reference sampler, quantisers) sits on
# it, and so do the MoE routing hooks for transformers models (routing/); adapters may use the fleet's records; the
# demo and the command line sit on top.
KERNEL, CORE, FLEET, ADAPTERS, DEMO, CLI = range(6)
LAYER = {
    "kernels": KERNEL,
    "ops": CORE, "records": CORE, "corrections": CORE, "loss": CORE, "parallel": CORE, "reference": CORE,
    "advantages": CORE, "presets": CORE, "testing": CORE, "__init__": CORE,
    "fleet": FLEET, "routing": FLEET,
    "adapters": ADAPTERS,
    "diagnose": ADAPTERS,
    "demo": DEMO,
    "__main__": CLI,
}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        yield path, rel.parts[0].removesuffix(".py")
    for path in sorted(KERNELS.rglob("*.py")):
        yield path, "kernels"


def _imports(path: Path):
    """Every ``offpolicy`` module that ``path`` imports, anywhere in the file, with the line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "offpolicy" or name.startswith("offpolicy."):
                yield name, node.lineno


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) == 1:
        return CORE  # ``import offpolicy``: the public API
    return LAYER.get(parts[1])


def test_every_top_level_module_has_a_layer():
    tops = {top for _, top in _modules()}
    assert tops <= set(LAYER), f"modules without a layer (add them to LAYER and docs/architecture.md): {tops - set(LAYER)}"


def test_imports_point_down_the_layers():
    upward = []
    for path, top in _modules():
        mine = LAYER[top]
        for name, line in _imports(path):
            theirs = _layer_of(name)
            if theirs is not None and theirs > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_kernels_know_nothing_of_the_library():
    offenders = [f"{p.relative_to(ROOT)}:{line} {name}" for p, top in _modules() if top == "kernels"
                 for name, line in _imports(p) if not name.startswith("offpolicy.kernels")]
    assert not offenders, offenders


def test_no_two_modules_share_a_name():
    names = Counter()
    for path, _ in _modules():
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        if path.name != "__init__.py" or path.parent != SRC:
            names[stem] += 1
    assert not [n for n, c in names.items() if c > 1 and n != "__main__"], names.most_common(5)


def test_the_reference_imports_nothing_from_the_library():
    """The float64 oracle shares no code with what it checks: a wrong predicate, default or trait in the registry
    would otherwise reach the fast loss and the reference alike, and agreement tests could not see it."""
    path = SRC / "reference.py"
    shared = [f"{path.relative_to(ROOT)}:{line} imports {name}" for name, line in _imports(path)]
    assert not shared, "\n".join(shared)
    tree = ast.parse(path.read_text())
    relative = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not relative, f"relative imports in reference.py at lines {relative}"
    dynamic = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")]
    assert not dynamic, f"dynamic imports in reference.py at lines {dynamic}"


def test_the_corrections_do_not_import_the_loss():
    """Inside the core, the correction nodes sit below the loss pipeline that reads them: no module of
    ``offpolicy.corrections`` imports ``offpolicy.loss`` (the nodes declare the reductions they need as a protocol,
    ``offpolicy.corrections.node.Reductions``)."""
    upward = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path, top in _modules() if top == "corrections"
              for name, line in _imports(path) if name == "offpolicy.loss" or name.startswith("offpolicy.loss.")]
    assert not upward, "the corrections import the loss layer:\n" + "\n".join(upward)


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = ("offpolicy",) + rel.parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, module level or inside a function (``from a import b``
    counts as importing ``a.b`` where that is a module, else ``a``)."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported, _ in _imports(path):
            target = imported if imported in modules else imported.rsplit(".", 1)[0]
            if target in modules and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None. A package's
    ``__init__`` importing its own submodules is not a cycle by itself (importing a submodule runs the
    package first): edges from a submodule up to its own package are left out."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    """No module of the package imports, directly or through others, a module that imports it back (function-level
    imports included: a deferred import hides a cycle, it does not remove it)."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("probe", ["offpolicy.fleet", "offpolicy.demo", "offpolicy.adapters.common"])
def test_the_layer_test_can_fail(probe, tmp_path):
    """A core module that imported ``probe`` would be reported."""
    bad = tmp_path / "bad.py"
    bad.write_text(f"def f():\n    import {probe}\n")
    assert [(name, line) for name, line in _imports(bad)] == [(probe, 2)]
    assert _layer_of(probe) > CORE


#: What a correction node or tree carries that the reference must not read through a ``Correction`` it is handed
#: (an attribute read needs no import): the tree, the nodes, and everything they declare.
NODE_ATTRIBUTES = {"tree", "_tree", "nodes", "named_rules", "surrogate",
                   "weighting", "keywords", "inputs", "table_traits", "table_form", "example", "jumps", "fast",
                   "token_keep", "drop", "mask_drop", "from_tree"}


def _node_reads(source: str) -> list[str]:
    tree = ast.parse(source)
    reads = [f"line {n.lineno}: .{n.attr}" for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr in NODE_ATTRIBUTES]
    reads += [f"line {n.lineno}: getattr(..., {n.args[1].value!r})" for n in ast.walk(tree)
              if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and len(n.args) >= 2
              and isinstance(n.args[1], ast.Constant) and n.args[1].value in NODE_ATTRIBUTES]
    return reads


def test_the_reference_reads_no_node():
    """The reference reads a correction's keyword fields by name and nothing the nodes hold: each correction keeps
    its own literal formula there, so a wrong node cannot agree with itself."""
    reads = _node_reads((SRC / "reference.py").read_text())
    assert not reads, "reference.py reads the correction's nodes:\n" + "\n".join(reads)
    assert _node_reads("def f(corr):\n    return corr.tree.surrogate\n"), "the check cannot fail"
