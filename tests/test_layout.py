"""The package's shape: imports point down, no import circles, `import glm5_bridge` changes nothing in
other libraries, and docs/ARCHITECTURE.md names every module."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "glm5_bridge"

# Lower layers never import higher ones (glm5_bridge/__init__.py's docstring draws the same picture).
LAYERS = [
    ("glm5_bridge.kernels",),
    ("glm5_bridge.files", "glm5_bridge.distributed", "glm5_bridge.compat", "glm5_bridge.hf"),
    ("glm5_bridge.model",),
    ("glm5_bridge.train",),
    ("glm5_bridge",),  # convert, parity, plan, tiny, testing, demo, cli, __init__
]


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module → the glm5_bridge modules it imports, at module level or inside functions."""
    graph = {}
    for name, file in modules.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # `from pkg import submodule` imports the submodule; any other name comes from pkg itself
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name and m != "glm5_bridge"}
    return graph


def _layer(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "glm5_bridge"):
            return rank
    return len(LAYERS) - 1


def test_imports_point_down():
    graph = _imports(_modules())
    upward = sorted(f"{a} → {b}" for a, deps in graph.items() for b in deps if _layer(b) > _layer(a))
    assert upward == []
    kernels_out = sorted(f"{a} → {b}" for a, deps in graph.items() if a.startswith("glm5_bridge.kernels")
                         for b in deps if not b.startswith("glm5_bridge.kernels"))
    assert kernels_out == []


def test_no_import_circles():
    graph = _imports(_modules())
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" → ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_check_finds_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The two checks above on a planted package: they can fail."""
    pkg = tmp_path / "glm5_bridge"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "model").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "kernels" / "a.py").write_text("from glm5_bridge.model import b\n")
    (pkg / "model" / "b.py").write_text("def f():\n    from glm5_bridge.kernels import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    graph = _imports(_modules())
    assert graph["glm5_bridge.kernels.a"] == {"glm5_bridge.model.b"}
    assert graph["glm5_bridge.model.b"] == {"glm5_bridge.kernels.a"}
    assert _layer("glm5_bridge.model.b") > _layer("glm5_bridge.kernels.a")


IMPORT_CHANGES_NOTHING = """
import warnings
import torch
from glm5_bridge import compat

current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
filters = list(warnings.filters)
import glm5_bridge
assert torch.cuda.current_device is current_device and torch.cuda.synchronize is synchronize
assert warnings.filters == filters, "import glm5_bridge added warning filters"

# Registering the bridge imports megatron-core / -bridge, which add filters of their own at import:
# import those first, then ours may add none.
import transformers.models.glm_moe_dsa.modeling_glm_moe_dsa
from megatron.core.models.gpt.gpt_model import GPTModel
with compat.megatron_bridge_without_te():
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.models.glm_moe_dsa.glm5_bridge import GLM5Bridge
    from megatron.bridge.models.mla_provider import MLAModelProvider
    import megatron.bridge.peft.lora
import megatron.core.pipeline_parallel.schedules as schedules
upstream = list(warnings.filters)
schedules_torch = schedules.torch
import sys
glm5_bridge.register()
import glm5_bridge.train.rl, glm5_bridge.train.sft, glm5_bridge.train.colocated, glm5_bridge.convert, glm5_bridge.cli
assert warnings.filters == upstream, [f for f in warnings.filters if f not in upstream]
assert torch.cuda.current_device is current_device and schedules.torch is schedules_torch
assert not any(type(f).__name__ == "_LoraLayersWithoutTE" for f in sys.meta_path)
print("unchanged")
"""


def test_import_changes_nothing_in_other_libraries():
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHANGES_NOTHING], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("unchanged"), proc.stderr[-2000:]


def test_architecture_names_every_module():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = []
    for name, file in _modules().items():
        rel = file.relative_to(PACKAGE).as_posix()
        if file.name == "__init__.py" and file.parent != PACKAGE:
            rel = file.parent.relative_to(PACKAGE).as_posix() + "/"
        if file.name == "__init__.py" and file.parent == PACKAGE:
            continue
        if f"`{rel}`" not in text:
            missing.append(rel)
    assert missing == []
