"""Contract of the demo's training batches (`demo.data`).

- every example has exactly the requested length and starts with <bos>;
- labels are -100 except where the token is predictable from the context:
  copy: the repetition of the segment; pairs: each repeated key's value;
  recall: the value of every queried key, which is the value its record holds;
- batches are deterministic from the rng.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_chunked_kv.demo.data import IGNORE, batch, copy_example, pairs_example, recall_example
from vllm_chunked_kv.tasks.kv_retrieval import COPY_MARK, KEYS, QUERY, VALUES, VOCAB


def _words(ids):
    return [VOCAB[i] for i in ids]


@pytest.mark.parametrize("length", [32, 33, 96])
def test_copy_labels_are_the_repetition(length):
    rng = random.Random(length)
    for _ in range(50):
        ids, labels = copy_example(rng, length)
        assert len(ids) == len(labels) == length and VOCAB[ids[0]] == "<bos>"
        mark = _words(ids).index(COPY_MARK)
        labelled = [i for i, label in enumerate(labels) if label != IGNORE]
        assert labelled == list(range(mark + 1, mark + 1 + len(labelled)))
        segment = ids[mark - len(labelled) : mark]
        assert [labels[i] for i in labelled] == segment == ids[mark + 1 : mark + 1 + len(labelled)]


@pytest.mark.parametrize("length", [48, 96])
def test_pairs_labels_are_the_values_of_repeated_keys(length):
    rng = random.Random(length)
    for _ in range(50):
        ids, labels = pairs_example(rng, length)
        words = _words(ids)
        assert len(ids) == len(labels) == length
        mark = words.index(COPY_MARK)
        first = {words[i]: words[i + 1] for i in range(mark) if words[i] in KEYS}
        labelled = [i for i, label in enumerate(labels) if label != IGNORE]
        assert len(labelled) == len(first) >= 2
        for i in labelled:
            assert i > mark and words[i - 1] in KEYS and VOCAB[labels[i]] == first[words[i - 1]] == words[i]


@pytest.mark.parametrize("length,queries", [(96, 4), (288, 8), (64, 1)])
def test_recall_labels_answer_each_query(length, queries):
    rng = random.Random(length)
    for _ in range(20):
        ids, labels = recall_example(rng, length, queries)
        words = _words(ids)
        assert len(ids) == len(labels) == length
        labelled = [i for i, label in enumerate(labels) if label != IGNORE]
        assert len(labelled) == queries
        haystack_end = labelled[0] - 2
        records = {words[i]: words[i + 1] for i in range(1, haystack_end) if words[i] in KEYS}
        for i in labelled:
            assert words[i - 2] == QUERY and words[i] in VALUES
            assert records[words[i - 1]] == words[i] == VOCAB[labels[i]]
        assert labelled[-1] == length - 1


def test_batches_are_deterministic():
    for task in ("copy", "pairs", "recall"):
        a = batch(random.Random(3), task, 4, 96, 4)
        b = batch(random.Random(3), task, 4, 96, 4)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert a[0].shape == a[1].shape == (4, 96)
