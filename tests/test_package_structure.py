"""The package's shape, as the docs promise it:

- the serving path (backend, config, grid, layout, presets, `integration/`,
  `serving/`, `ops/`) imports only vLLM, what vLLM brings (torch, triton,
  fastapi) and the core dependencies in pyproject.toml; the scanner's,
  demo's and model tools' packages are extras;
- loading the plugin the way vLLM does (register, then the metrics and
  feedback entry points) imports none of `scan`, `demo`, `adapt`, `models`,
  `tasks` or `testing`;
- no import circle between the package's modules (lazy imports included);
- no module over 400 lines.
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
SERVING_PATH = [*PACKAGE.glob("*.py"), *PACKAGE.glob("integration/*.py"), *PACKAGE.glob("serving/*.py"),
                *PACKAGE.glob("ops/*.py")]
COMMANDS = {"cli.py", "quickstart.py", "local_server.py"}  # entry points of the extras' commands
FROM_VLLM = {"vllm", "torch", "triton", "fastapi"}
TOOLS = ("scan", "demo", "adapt", "models", "tasks", "testing")


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


def test_serving_path_needs_only_the_core_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {dep.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_") for dep in project["dependencies"]}
    allowed = core | FROM_VLLM | {"pydantic_core", "vllm_chunked_kv"} | set(sys.stdlib_module_names)
    for path in SERVING_PATH:
        if path.name in COMMANDS:
            continue
        third_party = {name.split(".")[0] for name in imports(path)} - allowed
        assert not third_party, f"{path.relative_to(ROOT)} imports {sorted(third_party)}"
        tools = [n for n in imports(path) if n.split(".")[:2][-1] in TOOLS and n.startswith("vllm_chunked_kv.")]
        assert not tools, f"{path.relative_to(ROOT)} imports {tools}"
    extras = project["optional-dependencies"]
    assert {"scan", "demo", "models", "cpu", "cuda", "test"} <= set(extras)
    assert not {"numpy", "scipy", "matplotlib", "openai", "httpx"} & core


def test_loading_the_plugin_imports_no_tool():
    code = (
        "import json, sys\n"
        "import vllm_chunked_kv\n"
        "vllm_chunked_kv.register()\n"
        "import vllm_chunked_kv.backend, vllm_chunked_kv.serving.metrics, vllm_chunked_kv.serving.feedback\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vllm_chunked_kv.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "vllm_chunked_kv.backend" in loaded and "vllm_chunked_kv.integration.registration" in loaded
    assert not [m for m in loaded if m.split(".")[1] in TOOLS]


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
