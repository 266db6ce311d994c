"""Session fixtures and the suite's rules.

- The tiny test models are built once per test session.
- Under pytest-xdist every worker gets an equal share of the cores for
  OpenMP (`OMP_NUM_THREADS`, inherited by the engines and servers the tests
  start), unless the caller set it. Two workers each running a 2-thread
  engine on 2 cores made every engine step wait on descheduled OpenMP
  threads: measured side by side, one invariance schedule took 95 s instead
  of 10 s.
- A test that starts an in-process engine, a `vllm serve` server or a pip
  download carries the `engine`, `server` or `download` marker (its fixtures
  included): the runner's entry points refuse otherwise, so the tiers
  (`-m "not slow"`, `-m "not server"`, ...) select what they say.
- `load_benchmark(name)` imports `benchmarks/<name>.py` (scripts, not a package).
- pytest-xdist groups (`--dist loadgroup`): a test file is one group (its
  module fixtures are built once) unless its tests name their own
  `xdist_group`; groups with slow tests are sent first, so the longest ones
  do not start last; a run whose ids carry no group is refused.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:  # before anything imports torch
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

import pytest  # noqa: E402

from vllm_chunked_kv.models import download  # noqa: E402
from vllm_chunked_kv.models import tiny as models  # noqa: E402
from vllm_chunked_kv.runner import engine, server  # noqa: E402

_running: pytest.Item | None = None  # the test being set up, run or torn down


def _declared(marker: str, what: str, function):
    def guarded(*args, **kwargs):
        if _running is not None and _running.get_closest_marker(marker) is None:
            raise AssertionError(f"{_running.nodeid} {what} but is not marked @pytest.mark.{marker}")
        return function(*args, **kwargs)

    return guarded


engine.run_forked = _declared("engine", "starts a vLLM engine", engine.run_forked)
server.vllm_executable = _declared("server", "starts `vllm serve`", server.vllm_executable)
download.run_pip = _declared("download", "runs a pip download", download.run_pip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _running
    _running = item
    try:
        return (yield)
    finally:
        _running = None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """One xdist group per file unless a test names its own; files with slow tests first."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    group = {item: item.get_closest_marker("xdist_group").args[0] for item in items}
    slow_groups = {group[item] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: group[item] not in slow_groups)  # stable: files keep their order


def pytest_xdist_node_collection_finished(node, ids):
    """Under `--dist loadgroup`, refuse a run whose groups did not reach the scheduler.

    pytest-xdist sends a group to one worker only when its items' ids end in
    `@group` (its worker adds the suffix); with a pytest it cannot suffix
    (9.2 with xdist 3.8) the run goes on spread over both workers, every module
    fixture built twice, minutes later and with no error."""
    if node.config.getoption("dist") == "loadgroup":
        plain = [nodeid for nodeid in ids if "@" not in nodeid.rsplit("]", 1)[-1]]
        if plain:
            pytest.exit(f"--dist loadgroup: {len(plain)} tests have no xdist group in their id (e.g. {plain[0]}); "
                        f"pytest {pytest.__version__} with this pytest-xdist cannot group "
                        "(pyproject.toml pins a pytest that can)", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(scope="session")
def test_models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("test-models")


@pytest.fixture(scope="session")
def tiny_llama(test_models_dir):
    return models.build_tiny_llama(test_models_dir / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen(test_models_dir):
    return models.build_tiny_qwen(test_models_dir / "tiny-qwen")


@pytest.fixture(scope="session")
def tiny_gemma2(test_models_dir):
    return models.build_tiny_gemma2(test_models_dir / "tiny-gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3(test_models_dir):
    return models.build_tiny_gemma3(test_models_dir / "tiny-gemma3")


@pytest.fixture(scope="session")
def tiny_gptoss(test_models_dir):
    return models.build_tiny_gptoss(test_models_dir / "tiny-gptoss")


@pytest.fixture(scope="session")
def tiny_mistral(test_models_dir):
    return models.build_tiny_mistral(test_models_dir / "tiny-mistral")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_benchmark(name: str):
    """Import `benchmarks/<name>.py` as a module, with benchmarks/ on the path as when
    it runs as a script (a benchmark may import another: `from cpu_kernel import ...`)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_benchmark():
    return _load_benchmark


@pytest.fixture
def broken_torchvision(tmp_path, monkeypatch):
    """A torchvision 0.28.0 on the path that fails on import the way a CUDA
    build does next to torch's CPU build; the error message it raises."""
    message = "operator torchvision::nms does not exist"
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(f"raise RuntimeError({message!r})\n")
    (tmp_path / "torchvision-0.28.0.dist-info").mkdir()
    (tmp_path / "torchvision-0.28.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    return message
