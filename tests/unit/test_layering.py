"""The package layering of ARCHITECTURE.md, checked on every import statement (lazy ones too).

- bsr_kernels (the device layer) imports nothing of bsr_runtime or bsr_harness.
- The protocol core (bsr_runtime outside integrations/ and cli/) imports no integration, no
  CLI and no harness, and no engine or cache library.
- Only bsr_runtime.integrations.lmcache imports `lmcache`; only bsr_runtime.integrations.vllm
  imports `vllm`.
- Nothing in the runtime imports the harness except the CLI (the harness serves tests,
  benchmarks and the CLI).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bsr_kernels", "bsr_runtime", "bsr_harness")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[str]:
    """Absolute names of every module `path` imports, relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append(name)
            out += [f"{name}.{a.name}" for a in node.names]  # `from pkg import submodule`
    return out


def _all_modules() -> list[tuple[str, list[str]]]:
    return [(_module_name(p), _imports(p)) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _core(module: str) -> bool:
    return (_under(module, "bsr_runtime") and not _under(module, "bsr_runtime.integrations")
            and not _under(module, "bsr_runtime.cli"))


RULES = [
    ("bsr_kernels imports nothing of bsr_runtime or bsr_harness",
     lambda m: _under(m, "bsr_kernels"), lambda i: _under(i, "bsr_runtime") or _under(i, "bsr_harness")),
    ("the protocol core imports no integration, CLI or harness",
     _core, lambda i: any(_under(i, p) for p in ("bsr_runtime.integrations", "bsr_runtime.cli", "bsr_harness"))),
    ("only bsr_runtime.integrations.lmcache imports lmcache",
     lambda m: not _under(m, "bsr_runtime.integrations.lmcache"), lambda i: _under(i, "lmcache")),
    ("only bsr_runtime.integrations.vllm imports vllm",
     lambda m: not _under(m, "bsr_runtime.integrations.vllm"), lambda i: _under(i, "vllm")),
    ("the runtime imports the harness only from the CLI",
     lambda m: _under(m, "bsr_runtime") and not _under(m, "bsr_runtime.cli"), lambda i: _under(i, "bsr_harness")),
]


@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
def test_layering_rule_holds(rule):
    _, applies, forbidden = rule
    bad = [f"{m} imports {i}" for m, imports in _all_modules() if applies(m) for i in imports if forbidden(i)]
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from ..integrations.lmcache import adapter\n    import vllm.config\n")
    fake = ROOT / "bsr_runtime" / "tiers" / "_layering_probe.py"
    try:
        fake.write_text(src.read_text())
        found = _imports(fake)
    finally:
        fake.unlink()
    assert "bsr_runtime.integrations.lmcache" in found and "vllm.config" in found
    assert any(RULES[1][2](i) for i in found) and any(RULES[3][2](i) for i in found)
