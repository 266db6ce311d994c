"""`runner.companions` names each installed torchvision / torchaudio /
torchcodec that fails to import (version and error) and only those: one that
loads, or none installed, is no problem."""

from __future__ import annotations

import sys

from vllm_chunked_kv.runner import companions


def test_only_the_companion_that_cannot_load_is_named(broken_torchvision, tmp_path, monkeypatch):
    working = tmp_path / "working"
    (working / "torchaudio").mkdir(parents=True)
    (working / "torchaudio" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(working))
    monkeypatch.delitem(sys.modules, "torchaudio", raising=False)

    assert companions.broken() == [f"torchvision 0.28.0 does not load: RuntimeError: {broken_torchvision}"]
    assert companions.problem().endswith(f"vLLM and transformers cannot start next to it; {companions.FIX}")


def test_nothing_installed_is_no_problem(monkeypatch):
    monkeypatch.setattr(companions.importlib.util, "find_spec", lambda name: None)
    assert companions.broken() == [] and companions.problem() is None
