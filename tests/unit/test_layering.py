"""The package layering of ARCHITECTURE.md, checked on every import statement (lazy ones and
`if TYPE_CHECKING:` ones too).

    bsr_cli  ->  bsr_harness  ->  bsr_runtime.integrations.{vllm,lmcache}  ->  bsr_runtime (core)  ->  bsr_kernels

- bsr_kernels (the device layer) imports nothing of bsr_runtime, bsr_harness or bsr_cli.
- The protocol core (bsr_runtime outside integrations/) imports no integration and no engine or
  cache library.
- The runtime (all of bsr_runtime, integrations included) never imports the harness or the CLI.
- The harness never imports the CLI.
- Only bsr_runtime.integrations.lmcache imports `lmcache`; only bsr_runtime.integrations.vllm and
  the harness's engine drivers (bsr_harness.vllm_engines, bsr_harness.dsv4_engine) import `vllm`.
- No import cycle among the modules of the four packages.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bsr_kernels", "bsr_runtime", "bsr_harness", "bsr_cli")
VLLM_ENGINE_DRIVER = "bsr_harness.vllm_engines"
DSV4_ENGINE_DRIVER = "bsr_harness.dsv4_engine"  # vLLM CPU's DeepSeek-V4 test support (its shim, its KV-cache objects)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(root: Path, path: Path) -> list[tuple[str, ...]]:
    """Every name `path` imports, relative imports resolved: one tuple per imported name, most
    specific first (`from pkg import name` is (pkg.name, pkg): name may be a submodule)."""
    module = _module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, ...]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name,) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out += [(f"{name}.{a.name}", name) for a in node.names]
    return out


def scan(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, list[tuple[str, ...]]]:
    """Module name -> what it imports, for every .py file of `packages` under `root`."""
    return {_module_name(root, p): _imports(root, p)
            for pkg in packages if (root / pkg).is_dir() for p in sorted((root / pkg).rglob("*.py"))}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _under_any(name: str, prefixes: Iterable[str]) -> bool:
    return any(_under(name, p) for p in prefixes)


Rule = tuple[str, Callable[[str], bool], Callable[[str], bool]]  # (what it says, applies to, forbidden import)

RULES: list[Rule] = [
    ("bsr_kernels imports nothing of bsr_runtime, bsr_harness or bsr_cli",
     lambda m: _under(m, "bsr_kernels"), lambda i: _under_any(i, ("bsr_runtime", "bsr_harness", "bsr_cli"))),
    ("the protocol core imports no integration",
     lambda m: _under(m, "bsr_runtime") and not _under(m, "bsr_runtime.integrations"),
     lambda i: _under(i, "bsr_runtime.integrations")),
    ("the runtime (integrations included) imports neither the harness nor the CLI",
     lambda m: _under(m, "bsr_runtime"), lambda i: _under_any(i, ("bsr_harness", "bsr_cli"))),
    ("the harness does not import the CLI",
     lambda m: _under(m, "bsr_harness"), lambda i: _under(i, "bsr_cli")),
    ("only bsr_runtime.integrations.lmcache imports lmcache",
     lambda m: not _under(m, "bsr_runtime.integrations.lmcache"), lambda i: _under(i, "lmcache")),
    ("only bsr_runtime.integrations.vllm and the harness's engine drivers import vllm",
     lambda m: not _under_any(m, ("bsr_runtime.integrations.vllm", VLLM_ENGINE_DRIVER, DSV4_ENGINE_DRIVER)),
     lambda i: _under(i, "vllm")),
]


def violations(modules: Mapping[str, list[tuple[str, ...]]], rules: list[Rule] = RULES) -> dict[str, list[str]]:
    """Rule -> sorted 'module imports name' lines breaking it (rules that hold are left out)."""
    out = {}
    for what, applies, forbidden in rules:
        bad = sorted({f"{m} imports {i}" for m, imports in modules.items() if applies(m)
                      for names in imports for i in names if forbidden(i)})
        if bad:
            out[what] = bad
    return out


def _longest_module(name: str, modules: Mapping[str, object]) -> str | None:
    parts = name.split(".")
    return next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), None)


def import_graph(modules: Mapping[str, list[tuple[str, ...]]]) -> dict[str, set[str]]:
    """Module -> the scanned modules it imports: each imported name resolved to the longest scanned
    module it names (`from pkg import name`: pkg.name when that is a module, else pkg)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, imports in modules.items():
        for names in imports:
            target = _longest_module(names[0], modules)
            if target is not None and target != m:
                graph[m].add(target)
    return graph


def import_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative),
    each sorted; a module importing itself counts too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    cycles.append(sorted(component))
    return sorted(cycles)


@pytest.fixture(scope="module")
def modules() -> dict[str, list[tuple[str, ...]]]:
    found = scan(ROOT)
    assert {m.split(".")[0] for m in found} == set(PACKAGES), "a package was not scanned"
    return found


@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
def test_layering_rule_holds(rule, modules):
    bad = violations(modules, [rule])
    assert not bad, "\n".join(bad.get(rule[0], []))


def test_no_import_cycle(modules):
    cycles = import_cycles(import_graph(modules))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_planted_violations_are_found(tmp_path):
    """A tree with one violation of each kind: the checks name each, and the clean modules stay out."""
    _write_tree(tmp_path, {
        "bsr_kernels/__init__.py": "",
        "bsr_kernels/dev.py": "def f():\n    from bsr_runtime import keys\n",
        "bsr_runtime/__init__.py": "",
        "bsr_runtime/keys.py": "import torch\n",
        "bsr_runtime/core.py": "from .integrations.lmcache import tier\n",
        "bsr_runtime/integrations/__init__.py": "",
        "bsr_runtime/integrations/lmcache/__init__.py": "",
        "bsr_runtime/integrations/lmcache/tier.py": "def f():\n    from bsr_harness import experiments\n",
        "bsr_runtime/integrations/vllm/__init__.py": "import vllm\n",
        "bsr_harness/__init__.py": "",
        "bsr_harness/experiments.py": "from bsr_cli import main\nfrom bsr_runtime import keys\n",
        "bsr_harness/vllm_engines.py": "from vllm import LLM\n",
        "bsr_harness/other.py": "import vllm.config\n",
        "bsr_cli/__init__.py": "from bsr_harness import experiments\ndef main():\n    pass\n",
    })
    found = violations(scan(tmp_path))
    assert found == {
        RULES[0][0]: ["bsr_kernels.dev imports bsr_runtime", "bsr_kernels.dev imports bsr_runtime.keys"],
        RULES[1][0]: ["bsr_runtime.core imports bsr_runtime.integrations.lmcache",
                      "bsr_runtime.core imports bsr_runtime.integrations.lmcache.tier"],
        RULES[2][0]: ["bsr_runtime.integrations.lmcache.tier imports bsr_harness",
                      "bsr_runtime.integrations.lmcache.tier imports bsr_harness.experiments"],
        RULES[3][0]: ["bsr_harness.experiments imports bsr_cli", "bsr_harness.experiments imports bsr_cli.main"],
        RULES[5][0]: ["bsr_harness.other imports vllm.config"],
    }
    # the planted tree's cycle: the CLI imports the harness, which imports the CLI back
    assert import_cycles(import_graph(scan(tmp_path))) == [["bsr_cli", "bsr_harness.experiments"]]


def test_a_lazy_type_checking_cycle_is_found(tmp_path):
    """The shape of the old LMCache adapter circle: a module imports its parts, and they import it back
    only for type hints (`if TYPE_CHECKING:`) or inside a function."""
    _write_tree(tmp_path, {
        "bsr_runtime/__init__.py": "",
        "bsr_runtime/adapter.py": "from . import retrieve as _retrieve\nfrom .store import store\n",
        "bsr_runtime/retrieve.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from .adapter import Adapter\n",
        "bsr_runtime/store.py": "def store():\n    from bsr_runtime.adapter import Adapter\n",
        "bsr_runtime/plain.py": "from .retrieve import x\n",
    })
    graph = import_graph(scan(tmp_path))
    assert graph["bsr_runtime.adapter"] == {"bsr_runtime.retrieve", "bsr_runtime.store"}
    assert import_cycles(graph) == [["bsr_runtime.adapter", "bsr_runtime.retrieve", "bsr_runtime.store"]]


@pytest.mark.parametrize("edges, cycles", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"a"}}, [["a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}, [["a", "b", "c"], ["d", "e"]]),
], ids=["chain", "pair", "self", "two-components"])
def test_cycle_finder_on_written_out_graphs(edges, cycles):
    assert import_cycles(edges) == cycles
