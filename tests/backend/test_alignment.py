"""Contract of `backend.alignment` (what `align: prompt_end` needs from vLLM):

- a request's cache salt gains its grid shift, keeping the user's salt, so
  requests of different shifts never share prefix-cache pages (the engine
  side: `tests/models/test_prefix_hits.py`);
- prompt lengths are read from the model runner built with the very
  VllmConfig the builder holds, row for row; with no runner registered the
  error names the cause instead of serving wrong grids;
- the prompt length counts token ids, or embeddings when those were sent.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_chunked_kv.backend import alignment


def test_salt_keeps_the_users_salt_and_names_the_shift():
    assert alignment.salted(None, 3) == f"|{alignment.SALT_PREFIX}3"
    assert alignment.salted("tenant-a", 0) == f"tenant-a|{alignment.SALT_PREFIX}0"
    assert len({alignment.salted("s", shift) for shift in range(4)}) == 4


class _Runner:  # what the builder reads of vLLM's model runner
    def __init__(self, prompt_lengths: list[int]) -> None:
        self.input_batch = SimpleNamespace(num_prompt_tokens_cpu_tensor=torch.tensor(prompt_lengths, dtype=torch.int32))


def test_prompt_lengths_come_from_the_runner_of_the_same_config(monkeypatch):
    config, other = object(), object()
    runner = _Runner([5, 9, 12, 0])
    monkeypatch.setitem(alignment._runners, id(config), runner)
    got = alignment.prompt_lengths(config, 3)
    assert got.tolist() == [5, 9, 12] and got.dtype == torch.long
    with pytest.raises(RuntimeError, match="no runner was registered"):
        alignment.prompt_lengths(other, 3)


def test_prompt_length_counts_tokens_or_embeddings():
    assert alignment._prompt_length(SimpleNamespace(prompt_token_ids=[1, 2, 3], prompt_embeds=None)) == 3
    assert alignment._prompt_length(SimpleNamespace(prompt_token_ids=None, prompt_embeds=torch.zeros(7, 4))) == 7
