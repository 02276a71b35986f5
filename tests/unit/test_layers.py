"""Imports between reroll's subpackages go one way, in the order of ``reroll/__init__.py``, with no cycle.

Every module is parsed, not imported: imports inside functions (lazy, but still dependencies), under
``TYPE_CHECKING`` (type-only, held to the same order) and ``'reroll.x.y:name'`` strings that a
registry imports by name all count.
"""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "reroll"

# Lowest first; a module may import its own subpackage and the layers before it. The same list, with
# what each layer holds, is the docstring of reroll/__init__.py (test_the_order_is_the_documented_one).
LAYERS = [
    "errors",
    "packages",
    "config",
    "data",
    "algorithms",
    "models",
    "strategies",
    "rewards",
    "envs",
    "runtime",
    "engines",
    "roles",
    "pipelines",
    "plan",
    "cli",
]
RANK = {name: i for i, name in enumerate(LAYERS)}

# Dependencies that only the layers above algorithms, config and data may need.
HEAVY = ["ray", "vllm", "megatron", "sglang", "deepspeed"]
_BY_NAME = re.compile(r"reroll(\.\w+)+:\w+")  # a registry's 'package.module:function'


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root
    line: int
    source: str | None  # the importing module's subpackage; None for reroll/__init__.py
    target: str | None  # the imported one; None for the package itself (``from reroll import __version__``)
    module: str
    how: str  # "", "inside a function", "under TYPE_CHECKING", "by name"

    def __str__(self) -> str:
        how = f", {self.how}" if self.how else ""
        return f"{self.path}:{self.line}: {self.source} -> {self.target} ({self.module}{how})"


def subpackages(package: Path) -> set[str]:
    """The top-level modules and subpackages of ``package``: ``errors``, ``config``, ..."""
    names = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    return names | {p.name for p in package.iterdir() if (p / "__init__.py").exists()}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, how: str = "") -> list[tuple[ast.AST, str]]:
    """Every node below ``node`` with where it sits: at import time, inside a function, type-only."""
    found = []
    for child in ast.iter_child_nodes(node):
        found.append((child, how))
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                found += [(stmt, "under TYPE_CHECKING"), *_walk(stmt, "under TYPE_CHECKING")]
            for stmt in child.orelse:
                found += [(stmt, how), *_walk(stmt, how)]
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += _walk(child, how or "inside a function")
        else:
            found += _walk(child, how)
    return found


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted modules ``node`` imports, relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _BY_NAME.fullmatch(node.value):
        return [node.value.split(":")[0]]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    if base == "reroll":  # ``from reroll import config`` imports reroll.config
        return [f"reroll.{alias.name}" for alias in node.names]
    return [base]


def collect_imports(package: Path) -> list[Import]:
    """Every import of one of ``package``'s subpackages from another module of ``package``."""
    tops, root = subpackages(package), package.parent
    imports = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        source = module.split(".")[1] if "." in module else None
        for node, how in _walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, module, is_package):
                head, _, rest = name.partition(".")
                if head != package.name:
                    continue
                target = rest.split(".")[0] if rest.split(".")[0] in tops else None
                if target != source:
                    kind = "by name" if isinstance(node, ast.Constant) else how
                    imports.append(
                        Import(str(path.relative_to(root)), node.lineno, source, target, name, kind)
                    )
    return imports


def order_violations(imports: list[Import], rank: dict[str, int]) -> list[str]:
    """Imports of a later layer, of a subpackage in no layer, and any import from reroll/__init__.py."""
    bad = []
    for imp in imports:
        if imp.target is None:
            continue  # the package itself, which imports nothing
        if imp.source is None:
            bad.append(f"{imp}: reroll/__init__.py imports nothing from reroll")
        elif imp.source not in rank or imp.target not in rank:
            bad.append(f"{imp}: {imp.source if imp.source not in rank else imp.target} is in no layer")
        elif rank[imp.target] > rank[imp.source]:
            bad.append(str(imp))
    return bad


def cycles(imports: list[Import]) -> list[str]:
    """One shortest cycle through each subpackage that is on one, with an import for each edge."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if imp.source is not None and imp.target is not None:
            edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    found, seen = [], set()
    for start in sorted(edges):
        parent = {start: start}
        queue = deque([start])
        path = None
        while queue and path is None:
            node = queue.popleft()
            for nxt in sorted(edges.get(node, {})):
                if nxt == start:
                    path = [start]
                    while node != start:
                        path.insert(1, node)
                        node = parent[node]
                    path.append(start)
                    break
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        if path is not None and frozenset(path) not in seen:
            seen.add(frozenset(path))
            sites = "\n".join(f"    {edges[a][b]}" for a, b in itertools.pairwise(path))
            found.append(" -> ".join(path) + "\n" + sites)
    return found


def collect_module_imports(package: Path) -> list[Import]:
    """Every import, at run time (at import or inside a function, not under TYPE_CHECKING), of one module
    of a subpackage by another module of the same subpackage, with the modules' dotted names as source
    and target (``from reroll.config import placement`` names the module reroll.config.placement)."""
    root = package.parent
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for p in package.rglob("*.py")
    }
    imports = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        top = ".".join(module.split(".")[:2])
        for node, how in _walk(ast.parse(path.read_text(), str(path))):
            if how == "under TYPE_CHECKING":
                continue  # annotations only (``from __future__ import annotations``): never runs
            names = _imported(node, module, is_package)
            if isinstance(node, ast.ImportFrom):  # ``from pkg import mod``: the module, not pkg's __init__
                subs = [f"{n}.{a.name}" for n in names for a in node.names if f"{n}.{a.name}" in modules]
                names = subs if len(subs) == len(node.names) else names + subs
            for name in names:
                if name in modules and name != module and ".".join(name.split(".")[:2]) == top:
                    imports.append(Import(str(path.relative_to(root)), node.lineno, module, name, name, how))
    return imports


IMPORTS = collect_imports(PACKAGE)


def test_every_subpackage_has_a_layer():
    tops = subpackages(PACKAGE)
    assert tops - set(LAYERS) == set(), "add these to LAYERS here and to reroll/__init__.py's docstring"
    assert set(LAYERS) - tops == set(), "these layers have no module: drop them from LAYERS and the docstring"


def test_the_order_is_the_documented_one():
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or ""
    # a layer's line starts with 4 spaces and its name; its description may go on, indented further
    table = [line.split()[0] for line in doc.splitlines() if re.match(r"    \S", line)]
    assert table == LAYERS


def test_imports_follow_the_layers():
    bad = order_violations(IMPORTS, RANK)
    assert not bad, (
        f"{len(bad)} imports against the layer order {' < '.join(LAYERS)} (reroll/__init__.py); move the "
        "code to the lower layer, or give the lower layer a Protocol:\n" + "\n".join(bad)
    )


def test_no_cycle_between_subpackages():
    found = cycles(IMPORTS)
    assert not found, "subpackages that import each other:\n" + "\n".join(found)


def test_no_cycle_between_modules_of_a_subpackage():
    """Inside a subpackage too, modules import one way (a type-only import aside): a cycle is a module
    split in two that still needs both halves."""
    found = cycles(collect_module_imports(PACKAGE))
    assert not found, "modules that import each other:\n" + "\n".join(found)


def test_the_module_cycle_check_finds_one(tmp_path):
    pkg = tmp_path / "reroll" / "config"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "run.py").write_text("from reroll.config import pipelines\n")
    (pkg / "pipelines.py").write_text("def f():\n    from reroll.config.run import RunConfig\n")
    (pkg / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from reroll.config.run import RunConfig\n"
    )
    (found,) = cycles(collect_module_imports(tmp_path / "reroll"))
    assert found.splitlines()[0] in (
        "reroll.config.pipelines -> reroll.config.run -> reroll.config.pipelines",
        "reroll.config.run -> reroll.config.pipelines -> reroll.config.run",
    )


def test_the_checks_find_what_they_look_for(tmp_path):
    # a package where config imports runtime three ways and runtime imports config back
    pkg = tmp_path / "reroll"
    for sub in ("config", "runtime"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "config" / "schema.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from reroll.errors import E\n"
        "from . import placement\n"
        "if TYPE_CHECKING:\n"
        "    from reroll.runtime.actors import Handle\n"
        "def check():\n"
        "    from reroll.runtime import placement\n"
        "NAMES = {'x': 'reroll.runtime.x:f'}\n"
    )
    (pkg / "runtime" / "actors.py").write_text(
        "import reroll.config.schema\nfrom reroll import __version__\n"
    )
    imports = collect_imports(pkg)
    bad = order_violations(imports, {"errors": 0, "config": 1, "runtime": 2})
    assert bad == [
        "reroll/config/schema.py:5: config -> runtime (reroll.runtime.actors, under TYPE_CHECKING)",
        "reroll/config/schema.py:7: config -> runtime (reroll.runtime, inside a function)",
        "reroll/config/schema.py:8: config -> runtime (reroll.runtime.x, by name)",
    ]
    (found,) = cycles(imports)
    assert found.splitlines()[0] == "config -> runtime -> config"
    assert order_violations(imports, {"errors": 0, "runtime": 1, "config": 2}) == [
        "reroll/runtime/actors.py:1: runtime -> config (reroll.config.schema)"
    ]
    assert "is in no layer" in order_violations(imports, {"errors": 0, "config": 1})[0]


def test_algorithms_config_and_data_import_without_ray_or_engines():
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for sub in ("algorithms", "config", "data")
        for p in (PACKAGE / sub).rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {HEAVY!r}:\n"
        "    sys.modules[name] = None  # importing it raises ImportError\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"with {', '.join(HEAVY)} missing:\n{run.stderr[-3000:]}"


def test_no_two_test_modules_share_a_name():
    """The test directories are not packages, so pytest imports each module by its basename: two of the
    same name stop the whole suite at collection ("import file mismatch"), as two test_context_parallel.py
    files once did."""
    from collections import Counter

    names = Counter(p.name for p in (Path(__file__).parents[1]).rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1]
