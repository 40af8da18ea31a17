"""ipukit's floors: every module imports only its own package and lower floors, and no
import cycle exists.

The AST of every module is read (imports inside functions count; only ``if TYPE_CHECKING:``
blocks are exempt). The floor table below is the one on the package map page,
docs/package-map.md.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import subprocess
import sys
import textwrap
from typing import Dict, List, Optional, Set, Tuple

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ipukit"

#: (floor, package): a module belongs to the longest package prefix listed. Two packages on
#: one floor do not import each other. The top-level package (``ipukit/__init__.py``) is the
#: API face above every floor.
FLOORS: List[Tuple[int, str]] = [
    (0, "ipukit._torch"),     # every private torch name, behind public ones
    (1, "ipukit.schedules"),
    (2, "ipukit.core"),
    (2, "ipukit.timeline"),
    (3, "ipukit.compile"),
    (3, "ipukit.viz"),
    (4, "ipukit.runtime"),
    (5, "ipukit.model"),      # the front door: model, data, balance, datasets
    (5, "ipukit.data"),
    (5, "ipukit.balance"),
    (5, "ipukit.calibrate"),
    (5, "ipukit.plan"),       # the planner: splits × schedules × batching, modeled
    (5, "ipukit.datasets"),
    (6, "ipukit.lightning"),
    (6, "ipukit.ipuconfig"),
    (6, "ipukit.distributed"),
    (7, "ipukit.examples"),
    (8, "ipukit.widgets"),
]
#: The front door's modules share one package (ipukit's top level).
SHARED_PACKAGE = {"ipukit.model": "front door", "ipukit.data": "front door",
                  "ipukit.balance": "front door", "ipukit.datasets": "front door",
                  "ipukit.calibrate": "front door", "ipukit.plan": "front door"}

#: ``import ipukit`` itself sits between the front ends and the examples: the examples
#: and the dashboard are written as user code is.
API_FACE = 6.5

#: PopTorch's public modules (``poptorch.enums`` ...): thin re-exports that belong to the API
#: face with ``ipukit/__init__``, above every floor.
FACE = {"ipukit", "ipukit.enums", "ipukit.ops", "ipukit.optim", "ipukit.options",
        "ipukit.profiling", "ipukit.testing"}

#: Import paths that existed once and are gone (they were no PopTorch module).
REMOVED = ("ipukit.schedule", "ipukit.simulate", "ipukit.compare", "ipukit.memory",
           "ipukit.plots", "ipukit.workers", "ipukit.update", "ipukit.errors",
           "ipukit.distributed.example")


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules(root: pathlib.Path = ROOT) -> Dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(root.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    skip: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def imports_of(name: str, source: str, modules: Dict[str, pathlib.Path]) -> Set[str]:
    """The ipukit modules ``name`` imports (resolved to a module, not a name in one)."""
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    is_package = modules.get(name, pathlib.Path("x.py")).name == "__init__.py"
    found: Set[str] = set()

    def add(target: str) -> None:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules and target != name:
            found.add(target)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ipukit":
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "ipukit":
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                add(sub if sub in modules else module)
    return found


def graph(modules: Dict[str, pathlib.Path]) -> Dict[str, Set[str]]:
    return {name: imports_of(name, path.read_text(), modules) for name, path in modules.items()}


def floor_of(name: str) -> Optional[Tuple[int, str]]:
    best = None
    for floor, package in FLOORS:
        if name == package or name.startswith(package + "."):
            if best is None or len(package) > len(best[1]):
                best = (floor, package)
    if best is None:
        return None
    return best[0], SHARED_PACKAGE.get(best[1], best[1])


def violations(edges: Dict[str, Set[str]]) -> List[str]:
    bad = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            if src in FACE:
                continue
            fs, fd = floor_of(src), floor_of(dst)
            if dst in FACE:   # the API face: what user code (examples, widgets) imports
                fd = (API_FACE, "ipukit")
            if fs is None or fd is None:
                bad.append(f"{src} -> {dst}: module without a floor")
            elif fd[0] > fs[0]:
                bad.append(f"{src} (floor {fs[0]}) imports {dst} (floor {fd[0]}): upward")
            elif fd[0] == fs[0] and fd[1] != fs[1]:
                bad.append(f"{src} imports {dst}: another package on floor {fs[0]}")
    return bad


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    edges = {s: {d for d in ds if d in edges} for s, ds in edges.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_floor():
    missing = [m for m in all_modules() if m not in FACE and floor_of(m) is None]
    assert not missing


def test_imports_go_only_downward():
    assert violations(graph(all_modules())) == []


def test_no_import_cycles():
    assert cycles(graph(all_modules())) == []


def test_the_check_fails_on_an_upward_import_and_a_cycle(tmp_path):
    """The checker is not vacuous: an upward import and a cycle added to a copy are found."""
    modules = all_modules()
    edges = graph(modules)
    edges["ipukit.core.blocks"] = set(edges["ipukit.core.blocks"]) | {"ipukit.model"}
    assert any("ipukit.core.blocks (floor 2) imports ipukit.model (floor 5)" in v
               for v in violations(edges))
    assert any("ipukit.core.blocks" in c and "ipukit.model" in c for c in cycles(edges))
    # the same through the parser: a function-level import counts, TYPE_CHECKING does not
    src = textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from ..model import PoplarExecutor
        def f():
            from ..widgets import logic
    """)
    found = imports_of("ipukit.core.blocks", src, modules)
    assert found == {"ipukit.widgets.logic"}


def private_reads(modules: Dict[str, pathlib.Path]) -> List[str]:
    """``from x import _name`` and ``module._name`` reaching into another ipukit module.

    A package's own private modules (``_x.py``) may be imported by their package.
    """
    bad = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        bound: Dict[str, str] = {}   # local name -> ipukit module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    one = ast.ImportFrom(module=node.module, names=[alias], level=node.level)
                    target = next(iter(imports_of(name, ast.unparse(one), modules)), None)
                    if target is None:
                        continue
                    if target.endswith("." + alias.name):        # a module imported by name
                        bound[alias.asname or alias.name] = target
                        private = alias.name.startswith("_")
                    else:
                        private = alias.name.startswith("_") and not alias.name.startswith("__")
                    own = target.rsplit(".", 1)[0] == name.rsplit(".", 1)[0] or \
                        target.startswith(name + ".")
                    if private and not (own and modules[target].name.startswith("_")):
                        bad.append(f"{name}: from {node.module} import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in bound and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                bad.append(f"{name}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return sorted(set(bad))


def test_no_module_reads_another_modules_private_name():
    assert private_reads(all_modules()) == []


def test_poptorch_module_paths_import():
    """``poptorch.<module>`` imports as ``ipukit.<module>`` and holds the same names."""
    import ipukit
    from ipukit.enums import CommGroupType, OutputMode
    from ipukit.ops import BeginBlock, identity_loss, recomputationCheckpoint
    from ipukit.optim import SGD, AdamW
    from ipukit.options import (Options, PipelinedExecution, Stage, TensorLocationSettings,
                                _TrainingOptions)
    from ipukit.profiling import Channel
    from ipukit.testing import allclose

    assert OutputMode is ipukit.OutputMode and ipukit.enums.CommGroupType is CommGroupType
    assert BeginBlock is ipukit.BeginBlock and identity_loss is ipukit.identity_loss
    assert recomputationCheckpoint is ipukit.ops.recomputationCheckpoint
    assert SGD is ipukit.optim.SGD and issubclass(AdamW, ipukit.optim.Optimizer)
    assert Options is ipukit.Options and TensorLocationSettings is ipukit.TensorLocationSettings
    assert Stage is ipukit.Stage and PipelinedExecution is ipukit.PipelinedExecution
    assert isinstance(Options().Training, _TrainingOptions)
    opts = Options().outputMode(ipukit.enums.OutputMode.All)   # PopTorch's own tests' spelling
    assert opts.output_mode is OutputMode.All
    channel = Channel("MyApp")
    with channel.tracepoint("TimeThis"):
        pass
    obj = object()
    assert channel.instrument(obj, "method") is obj
    a, b = torch.ones(2), torch.zeros(2)
    assert allclose((a, [b]), (a.clone(), [b + 1e-9]))
    assert not allclose((a, [b]), (a, [a])) and not allclose((a,), [a]) and not allclose([a], [a, a])


@pytest.mark.parametrize("name", REMOVED)
def test_paths_that_were_not_poptorch_modules_are_gone(name):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


def test_simulate_is_the_function():
    import ipukit

    assert callable(ipukit.simulate)


HEAVY = ("plotly", "tqdm", "ipywidgets", "torchvision", "pytorch_lightning", "lightning",
         "numpy", "anywidget", "huggingface_hub", "pandas", "IPython")


def test_import_ipukit_loads_no_extra():
    """Only what torch itself loads (torch.hub brings tqdm and numpy): no extra's module."""
    code = ("import sys, torch; before = {m.split('.')[0] for m in sys.modules}; "
            "import ipukit; heavy = %r; "
            "print(sorted({m.split('.')[0] for m in sys.modules} - before & set(heavy)))"
            % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
