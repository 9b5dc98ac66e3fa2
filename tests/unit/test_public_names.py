"""No public name of a package is both a submodule and something else (a function, a class, a
constant): once the submodule is imported (by LMCache's plugin loader, say), Python rebinds the
package attribute to the module and every caller of the function gets `'module' object is not
callable`. Checked from the source of every package's __init__.py, so no engine or cache library
has to be importable."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bsr_kernels", "bsr_runtime", "bsr_harness")


def _packages() -> list[Path]:
    return sorted(p.parent for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py"))


def _submodules(pkg: Path) -> set[str]:
    mods = {p.stem for p in pkg.glob("*.py") if p.name != "__init__.py"}
    return mods | {d.name for d in pkg.iterdir() if (d / "__init__.py").is_file()}


def _bindings(init: Path) -> dict[str, str]:
    """Names the package's __init__ binds at top level (and lists in __all__) -> what they are;
    "module" for `from . import x` (the submodule itself)."""
    out: dict[str, str] = {}
    for node in ast.parse(init.read_text(), str(init)).body:
        if isinstance(node, ast.ImportFrom):
            kind = "module" if node.level == 1 and node.module is None else f"imported from {node.module}"
            for a in node.names:
                out[a.asname or a.name] = kind
        elif isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.partition(".")[0]] = "module" if a.asname else "package"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = type(node).__name__
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                    for e in node.value.elts:
                        if isinstance(e, ast.Constant) and isinstance(e.value, str):
                            out.setdefault(e.value, "listed in __all__")
                elif isinstance(t, ast.Name):
                    out[t.id] = "assigned"
    return out


def shadowed_names(pkg: Path, root: Path = ROOT) -> list[str]:
    subs = _submodules(pkg)
    return [f"{pkg.relative_to(root).as_posix()}: {name!r} is a submodule and {what}"
            for name, what in sorted(_bindings(pkg / "__init__.py").items())
            if name in subs and what != "module" and not name.startswith("_")]


@pytest.mark.parametrize("pkg", _packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_public_name_is_both_a_function_and_a_submodule(pkg):
    assert not shadowed_names(pkg)


def test_the_checker_sees_a_shadowing_export(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "plugin.py").write_text("X = 1\n")
    (pkg / "config.py").write_text("def plugin():\n    pass\n")
    (pkg / "__init__.py").write_text("from .config import plugin\n__all__ = ['plugin']\n")
    assert shadowed_names(pkg, tmp_path) == ["pkg: 'plugin' is a submodule and imported from config"]
    (pkg / "__init__.py").write_text("from . import plugin\nfrom .config import plugin as make_plugin\n")
    assert shadowed_names(pkg, tmp_path) == []


def test_sweep_over_the_same_lmcache_tier_twice(tmp_path):
    """The member issue 27 found: once LMCache had loaded the FS plugin, `fs_l2` was the module, and the
    second `--tier lmcache-fs` (now lmcache-filesystem) failed with `'module' object is not callable`."""
    pytest.importorskip("lmcache.v1.distributed.storage_manager", reason="lmcache 0.5.6 is not installed")
    import json

    from bsr_cli import main

    js = tmp_path / "rows.json"
    assert main(["sweep", "--tier", "lmcache-filesystem,lmcache-filesystem", "--tokens", "512", "--window-chunks", "1",
                 "--registration", "llama-like", "--quiet", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())
    assert [r["tier"] for r in rows] == ["lmcache-filesystem"] * 2 and all(r["state_hash_ok"] for r in rows)
