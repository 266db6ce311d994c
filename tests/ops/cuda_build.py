"""Building the CUDA sources of csrc/ outside torch's JIT, for the tests.

- `cuda_include()`: the CUDA headers' folder, or None.
- `run_all(commands)`: compilers run side by side, their results in order.
- `compile_emulated` / `link_emulated`: the kernels' very source built with
  g++ over csrc/cuda/cpu_emulation.h (each block's threads run as fibers),
  linked into an importable extension.
- The session fixtures `emulated_objects` and `emulated_module` (registered
  by conftest.py, so test_cuda_ext.py and test_cuda_fp8.py share one build)
  and `emulated`, which points `cuda_ext` at the emulated extension.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from vllm_chunked_kv.ops.kernels import cuda_ext

CSRC = Path(cuda_ext.SOURCES_DIR)


def cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    candidates = [Path("/usr/local/cuda/include")]
    if nvcc:
        candidates.append(Path(nvcc).resolve().parents[1] / "include")
    return next((p for p in candidates if (p / "cuda_runtime_api.h").is_file() and (p / "cuda_bf16.h").is_file()),
                None)


def object_name(name: str) -> str:
    """The object file of source `name` (a path under csrc/): its file name + ``.o``."""
    return f"{Path(name).name}.o"


def run_all(commands: list[list[str]], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Run the commands at the same time; their results in order."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    results = []
    for cmd, proc in zip(commands, procs):
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return results


def compile_emulated(source_dir: Path, out_dir: Path, names, module: str = "chunked_kv_emulated") -> None:
    """Compile sources `names` of `source_dir` with g++ for the emulation
    into ``out_dir/<file name>.o``; the binding as extension `module`."""
    from torch.utils import cpp_extension

    torch_dir = Path(torch.__file__).parent
    no_implicit = [flag for flag in cpp_extension.COMMON_NVCC_FLAGS if flag.startswith("-D")]  # as under nvcc
    flags = ["-std=c++20", "-O1", "-fPIC", "-DCHUNKED_KV_CPU_EMULATION", *no_implicit, f"-I{source_dir}",
             f"-I{cuda_include()}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    torch_flags = [f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include/torch/csrc/api/include'}",
                   f"-I{sysconfig.get_paths()['include']}", f"-DTORCH_EXTENSION_NAME={module}"]
    commands = [["g++", *flags, *(torch_flags if name.endswith(".cpp") else ["-x", "c++"]), "-c",
                 str(source_dir / name), "-o", str(out_dir / object_name(name))] for name in names]
    for done in run_all(commands):
        assert done.returncode == 0, done.stderr[-3000:]


def link_emulated(objects: list[Path], library: Path):
    """Link the objects into the extension `library` (named as its file) and import it."""
    torch_lib = Path(torch.__file__).parent / "lib"
    link = ["g++", "-shared", "-Wl,-Bsymbolic", *map(str, objects), f"-L{torch_lib}", "-lc10", "-ltorch",
            "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{torch_lib}", "-o", str(library)]  # -Bsymbolic: its own
    # kernels, whatever other build of them is loaded
    done = subprocess.run(link, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.EMULATED
    return module


@pytest.fixture(scope="session")
def emulated_objects(tmp_path_factory) -> Path:
    """A folder with every source of csrc/ compiled for the emulation."""
    if shutil.which("g++") is None or cuda_include() is None:
        pytest.skip("the CPU emulation needs g++ and the CUDA headers")
    out_dir = tmp_path_factory.mktemp("chunked_kv_emulated")
    compile_emulated(CSRC, out_dir, cuda_ext.SOURCES)
    return out_dir


@pytest.fixture(scope="session")
def emulated_module(emulated_objects):
    """The extension built from csrc/ with g++ over csrc/cuda/cpu_emulation.h."""
    return link_emulated([emulated_objects / object_name(name) for name in cuda_ext.SOURCES],
                         emulated_objects / "chunked_kv_emulated.so")


@pytest.fixture
def emulated(emulated_module):
    """cuda_ext running the emulated extension on CPU tensors (the test module's
    autouse fixture resets cuda_ext's state afterwards)."""
    cuda_ext._state.update(tried=True, module=emulated_module, reason=None)
    return emulated_module
