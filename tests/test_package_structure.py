"""The package's shape, as docs/design.md ("Code layout") promises it:

- floors: every subpackage sits on one floor, and a module imports only from
  its own floor or the floors below it (lazy imports included):
  tools -> serving -> backend -> ops -> core; among the tools, the shared
  libraries (tasks, hf, runner) sit below the tools that use them, and the
  commands on top;
- the serving path (`core/`, `ops/`, `backend/`, `serving/`) imports only vLLM,
  what vLLM brings (torch, triton, fastapi) and the core dependencies in
  pyproject.toml; the scanner's, demo's and model tools' packages are extras;
- loading the plugin the way vLLM does (register, then the metrics and
  feedback entry points) imports no tool;
- inside `ops/`, floors too: the math (`reference`, `masked`, `fp8`) -> `plans/`
  -> `kernels/` -> `dispatch`; a kernel module imports no other kernel
  module but `shared` (the helpers they share), `jit` (the build) and
  `triton_fp8` (the Triton kernels' FP8 loads and stores);
- the package root holds only `__init__.py`; no import circle between the
  package's modules; no module over 400 lines.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_chunked_kv"
# subpackage -> floor; an import may only go to the same floor or a lower one
FLOORS = {
    "core": 0, "ops": 1, "backend": 2, "serving": 3,
    "tasks": 4, "hf": 4, "runner": 4,  # libraries the tools share
    "models": 5, "scan": 5,
    "adapt": 6, "demo": 6,
    "commands": 7,
}
SERVING = ("core", "ops", "backend", "serving")
# inside ops/: module or folder -> floor
OPS_FLOORS = {"reference": 0, "masked": 0, "fp8": 0, "plans": 1, "kernels": 2, "dispatch": 3, "host_sync": 3}
KERNEL_SHARED = {"shared", "jit", "triton_fp8"}
FROM_VLLM = {"vllm", "torch", "triton", "fastapi"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every absolute import in the file, at any depth (lazy ones too):
    ``import a.b`` gives a.b, ``from a import b`` gives a.b (a module or a name in a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def subpackage(name: str) -> str | None:
    """`vllm_chunked_kv.ops.reference` -> "ops"; the root itself -> None."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "vllm_chunked_kv" else None


def test_every_subpackage_has_a_floor_and_the_root_only_registers():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == set(FLOORS)
    assert [p.name for p in PACKAGE.glob("*.py")] == ["__init__.py"]


def test_no_import_goes_up_a_floor():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        here = subpackage(module_name(path))
        if here is None:  # the root's register(): vLLM's entry point into backend/
            continue
        for name in imports(path):
            there = subpackage(name)
            if there in FLOORS and FLOORS[there] > FLOORS[here]:
                upward.append(f"{path.relative_to(ROOT)} ({here}, floor {FLOORS[here]}) imports {name} (floor {FLOORS[there]})")
    assert not upward, "\n".join(upward)


def ops_part(name: str) -> str | None:
    """`vllm_chunked_kv.ops.kernels.cpu_ext` -> "kernels"; outside ops/ -> None."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["vllm_chunked_kv", "ops"] else None


def test_ops_floors_and_kernels_apart():
    found = {p.stem for p in (PACKAGE / "ops").glob("*.py")} | {p.name for p in (PACKAGE / "ops").iterdir() if p.is_dir()}
    assert found - {"__init__", "__pycache__"} == set(OPS_FLOORS)
    upward, crossed = [], []
    for path in (PACKAGE / "ops").rglob("*.py"):
        name = module_name(path)
        here = ops_part(name)
        for imported in imports(path):
            there = ops_part(imported)
            if here in OPS_FLOORS and there in OPS_FLOORS and OPS_FLOORS[there] > OPS_FLOORS[here]:
                upward.append(f"{name} imports {imported}")
            if here == there == "kernels" and path.stem != "__init__":
                target = imported.split(".")[3] if len(imported.split(".")) > 3 else None
                if target not in KERNEL_SHARED | {path.stem, None}:
                    crossed.append(f"{name} imports {imported}")
    assert not upward, "\n".join(upward)
    assert not crossed, "\n".join(crossed)


def test_serving_path_needs_only_the_core_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {dep.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_") for dep in project["dependencies"]}
    allowed = core | FROM_VLLM | {"pydantic_core", "vllm_chunked_kv"} | set(sys.stdlib_module_names)
    paths = [PACKAGE / "__init__.py", *(p for floor in SERVING for p in (PACKAGE / floor).rglob("*.py"))]
    for path in paths:
        third_party = {name.split(".")[0] for name in imports(path)} - allowed
        assert not third_party, f"{path.relative_to(ROOT)} imports {sorted(third_party)}"
    extras = project["optional-dependencies"]
    assert {"scan", "demo", "models", "cpu", "cuda", "test"} <= set(extras)
    assert not {"numpy", "scipy", "matplotlib", "openai", "httpx"} & core


def test_loading_the_plugin_imports_no_tool():
    code = (
        "import json, sys\n"
        "import vllm_chunked_kv\n"
        "vllm_chunked_kv.register()\n"
        "import vllm_chunked_kv.backend.attention, vllm_chunked_kv.serving.metrics, vllm_chunked_kv.serving.feedback\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vllm_chunked_kv.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "vllm_chunked_kv.backend.attention" in loaded and "vllm_chunked_kv.backend.registration" in loaded
    assert not [m for m in loaded if subpackage(m) not in SERVING]


def test_no_import_circle():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports(path):
            while imported and imported not in modules:  # `from mod import function`: the module mod
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join(stack[stack.index(nxt):] + [node, nxt])
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_modules_stay_readable():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long


def test_tests_mirror_the_package():
    """Every subpackage has its tests in tests/<subpackage>/ (the whole-package
    checks, like this file, stay at the top)."""
    tested = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert set(FLOORS) <= tested, f"no tests/<name>/ for {sorted(set(FLOORS) - tested)}"
    stray = [p.name for p in (ROOT / "tests").glob("test_*.py")
             if p.name not in {"test_package_structure.py", "test_packaging.py", "test_front_door.py"}]
    assert not stray, f"tests at the top that belong to a subpackage: {stray}"
