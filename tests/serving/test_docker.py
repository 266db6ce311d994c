"""Contract of docker/ that holds without Docker: the CUDA image is pinned
to the vLLM release pyproject's cuda extra pins; every image tag is pinned;
both images and the project's launcher (`runner/server.py`) allow exactly the
plugins pyproject declares; the build context
filters keep what the images install; the compose file's mounts, build
files, variables and Prometheus target line up; the shipped chunked_kv
settings are a valid configuration."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import shlex
import subprocess

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.runner.server import PROJECT_PLUGINS

from .dashboard_queries import DOCKER

ROOT = DOCKER.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
VLLM_SERVICES = ("vllm-cuda", "vllm-cpu")


def declared_plugins() -> set[str]:
    """The plugin names pyproject.toml declares, across vLLM's three plugin groups."""
    return {
        entry
        for group in ("vllm.general_plugins", "vllm.stat_logger_plugins", "vllm.endpoint_plugins")
        for entry in PYPROJECT["project"]["entry-points"][group]
    }


def _env_file(path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value
    return out


def _dockerignore_regex(pattern: str) -> re.Pattern:
    pattern = pattern.strip("/")
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _sent_to_docker(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or a parent decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _dockerignore_regex(raw[1:] if negate else raw)
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return not excluded


def test_cuda_image_pinned_to_the_cuda_extra():
    (pin,) = [dep for dep in PYPROJECT["project"]["optional-dependencies"]["cuda"] if dep.startswith("vllm==")]
    version = pin.split("==")[1]
    text = (DOCKER / "Dockerfile.cuda").read_text()
    assert re.search(rf"^FROM vllm/vllm-openai:v{re.escape(version)}$", text, re.M), text


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_images_allow_the_declared_plugins(name):
    declared = declared_plugins()
    match = re.search(r"VLLM_PLUGINS=([\w,]+)", (DOCKER / name).read_text())
    assert match and set(match.group(1).split(",")) == declared


def test_local_server_allows_the_declared_plugins():
    """The project's own launcher (quickstart, demo, benchmarks) allowlists the same three."""
    assert set(PROJECT_PLUGINS.split(",")) == declared_plugins()


def test_every_image_tag_is_pinned():
    # Pulled images only; the vLLM services build their own.
    images = [s["image"] for s in COMPOSE["services"].values() if "image" in s and "build" not in s]
    assert len(images) == 2
    images += re.findall(r"^FROM (\S+)", (DOCKER / "Dockerfile.cuda").read_text(), re.M)
    images += re.findall(r"^FROM (\S+)", (DOCKER / "Dockerfile.cpu").read_text(), re.M)
    for image in images:
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d", tag), image


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_build_context_keeps_what_the_image_installs(name):
    patterns = [line.strip() for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    needed = [p for p in tracked if p.startswith(("vllm_chunked_kv/", "scripts/")) and "__pycache__" not in p]
    needed += ["pyproject.toml", PYPROJECT["project"]["readme"]]
    for sources in PYPROJECT["tool"]["setuptools"]["data-files"].values():  # the CUDA sources the wheel carries
        needed += [p for p in tracked if any(fnmatch.fnmatch(p, pattern) for pattern in sources)]
    assert any(p.startswith("csrc/") for p in needed)
    assert all(_sent_to_docker(p, patterns) for p in needed), [p for p in needed if not _sent_to_docker(p, patterns)]
    kept = [raw[1:].rstrip("/") for raw in patterns if raw.startswith("!")]
    assert all((ROOT / path).exists() for path in kept), [path for path in kept if not (ROOT / path).exists()]
    for unwanted in (".venv/bin/python", "tests/conftest.py", ".git/HEAD", "vllm_chunked_kv/__pycache__/x.pyc"):
        assert not _sent_to_docker(unwanted, patterns), unwanted


def test_compose_files_and_variables_line_up():
    env = _env_file(DOCKER / "chunked-kv.env")
    for name in VLLM_SERVICES:
        service = COMPOSE["services"][name]
        assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        assert service["env_file"] == "chunked-kv.env"
        (script,) = service["command"]
        used = set(re.findall(r"\$\$(\w+)", script))
        assert used <= set(env) | set(service["environment"]), used
        assert "vllm" in service["networks"]["default"]["aliases"]
        assert "--port 8000" in script
        assert "127.0.0.1:8000:8000" in service["ports"]
    for service in COMPOSE["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DOCKER / source).exists(), volume
    prometheus = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == ["vllm:8000"]


def test_shipped_settings_are_a_valid_configuration():
    env = _env_file(DOCKER / "chunked-kv.env")
    import json

    cfg = ChunkedKVConfig.from_additional_config(json.loads(env["CHUNKED_KV_ADDITIONAL_CONFIG"]))
    assert cfg.hop >= 1
    assert int(env["API_SERVER_COUNT"]) >= 1
    extra = COMPOSE["services"]["vllm-cpu"]["environment"]["VLLM_EXTRA_ARGS"]
    assert "--kv-cache-memory-bytes" in shlex.split(extra.split(":-", 1)[1].rstrip("}"))


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_modules_the_image_checks_exist(name):
    """The image's build-time import check names modules of this package that exist."""
    text = (DOCKER / name).read_text()
    for imports in re.findall(r"import ([\w., ]+)", text):
        for module in (m.strip() for m in imports.split(",")):
            if module.startswith("vllm_chunked_kv"):
                assert importlib.util.find_spec(module) is not None, module
