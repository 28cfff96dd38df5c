"""The import graph, read from the code (every ``import`` statement, those inside functions and under
``TYPE_CHECKING`` too): no cycle anywhere in ``cp_infer/``, ``models/``, ``server/`` and ``bench/``, and every import
points downward through the layers ``bench -> server.cli -> server.http -> server.group -> server.outputs -> models ->
cp_infer``. A cycle means two modules are one concept or a third is missing; an upward import means a wing knows
what sits above it. Inside ``models/``: a family package imports no other family package, and the shared package
``models.common`` imports none (nor the registry above them); the families are found through the one table,
``models.families``, and nothing else names one: no ``family == "..."`` (nor ``family == WAN``) outside it, in
``bench/`` too (its own tables say what a benchmark needs of each family), no family's name in ``server/`` or
``cp_infer/``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from models.families import FAMILIES, all_families

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cp_infer", "models", "server", "bench")
# Lowest layer first; a module belongs to the longest prefix that names it.
LAYERS = ("cp_infer", "models", "server.outputs", "server.group", "server.http", "server.cli", "bench")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that ``name`` imports (``from a import b`` counts ``a.b`` where that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            heads = [alias.name for alias in node.names]
            subs: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            subs = [f"{base}.{alias.name}" for alias in node.names]
            # `from a import b, c` of submodules b and c imports those; the package a only for its own names.
            heads = [base] if any(sub not in modules for sub in subs) else []
        else:
            continue
        for target in [*heads, *subs]:
            while target and target not in modules:  # `import a.b.c` imports the module a.b.c; an attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    return max(i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")) \
        if any(module == layer or module.startswith(layer + ".") for layer in LAYERS) else len(LAYERS)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (or a module importing itself)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_from_the_code():
    graph = _graph()
    assert "server.http.videos" in graph["server.http.app"]  # a plain `from server.http import videos`
    assert "models.ltx2.options" in graph["models.ltx2.adapter"]  # a relative import
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (each a strongly connected set of modules): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_imports_point_down_the_layers():
    upward = [f"{name} ({LAYERS[_layer(name)]}) imports {target} ({LAYERS[_layer(target)]})"
              for name, targets in _graph().items() for target in sorted(targets) if _layer(target) > _layer(name)]
    assert not upward, "imports that point up the layers " + " > ".join(reversed(LAYERS)) + ":\n" + "\n".join(upward)


def _family_packages() -> dict[str, str]:
    """Family name -> its package (``models.families.FAMILIES``' module, less its last part)."""
    return {name: module.rpartition(".")[0] for name, (module, _) in FAMILIES.items()}


def _package_of(module: str, packages) -> str | None:
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def test_a_family_package_imports_no_other_family():
    packages = set(_family_packages().values())
    assert packages == {"models.ltx_video", "models.ltx2", "models.wan", "models.helios"} <= set(_graph())
    crossing = [f"{name} imports {target}" for name, targets in _graph().items()
                if (own := _package_of(name, packages)) is not None
                for target in sorted(targets) if _package_of(target, packages) not in (None, own)]
    assert not crossing, "a family package imports another family's package:\n" + "\n".join(crossing)


def test_the_shared_package_imports_no_family():
    above = {*_family_packages().values(), "models.registry"}
    upward = [f"{name} imports {target}" for name, targets in _graph().items() if name.startswith("models.common")
              for target in sorted(targets) if _package_of(target, above) is not None]
    assert not upward, "models.common imports what sits above it:\n" + "\n".join(upward)


# `family == "wan"`, `"ltx2" != family`, `info.family in ("ltx-video", ...)`, `w.family == WAN`, `family in (LTX2,
# WAN)`: a family chosen by its name, written out or as a constant.
_NAME = r"""(?:["']|[A-Z][A-Z0-9_]*\b)"""
_COMPARISON = re.compile(
    rf"""family\w*\s*[!=]=\s*{_NAME}|family\w*\s+(?:not\s+)?in\s*(?:["']|[\(\[{{]\s*{_NAME})"""
    rf"""|{_NAME}\s*[!=]=\s*[\w.]*family""")


def test_no_family_is_chosen_by_comparing_its_name():
    table = {REPO / "models" / "families.py"}
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for package in ("models", "server", "cp_infer", "bench")
             for path in sorted((REPO / package).rglob("*.py")) if path not in table
             for n, line in enumerate(path.read_text().splitlines(), 1) if _COMPARISON.search(line)]
    assert not found, "ask models.families (bench/: its tables) instead of comparing family names:\n" + "\n".join(found)
    for comparison in ('if family == "wan":', "info.family in ('ltx2', 'wan')", "if workload.family == WAN:",
                       "'ltx2' != family", "LTX_VIDEO == self.family", "if family not in [LTX2, WAN]:"):
        assert _COMPARISON.search(comparison), comparison
    for other in ("for family in FAMILIES:", "family(name).wrap(c)", "if family is None:", "family == other"):
        assert not _COMPARISON.search(other), other


def test_server_and_engine_name_no_family():
    names = [*FAMILIES, *(f.default_name for f in all_families()),
             *(module.split(".")[1] for module, _ in FAMILIES.values())]
    word = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for package in ("server", "cp_infer")
             for path in sorted((REPO / package).rglob("*")) if path.suffix in (".py", ".js", ".html", ".css")
             for n, line in enumerate(path.read_text().splitlines(), 1) if word.search(line)]
    assert not found, "server/ and cp_infer/ name a family (ask models.families):\n" + "\n".join(found)
    assert word.search("model_options('ltx-video')") and not word.search("tiny-ltx2-v3")
