"""Contract of the key-value retrieval task generator.

- A prompt is haystack records + `? key`; the answer is the value that follows
  that key, and the key occurs in exactly one record.
- `target_position` puts the target's value token exactly there (0 = <bos>),
  with or without prefix filler; `num_tokens` counts <bos>.
- The same rng seed gives the same prompt; `prefix_filler` only shifts the
  haystack drawn from the same rng state.
- Needle positions grouped by phase have the right phase, stay in range, and
  share their mean exactly and their variance to within a few square tokens.
- `is_correct` reads the first word of a completion.
"""

from __future__ import annotations

import random
import statistics

import pytest

from vllm_chunked_kv.tasks.kv_retrieval import (
    FILLERS,
    KEYS,
    QUERY,
    VALUES,
    VOCAB,
    is_correct,
    make_prompt,
    needle_positions_by_phase,
)


def _tokens(prompt) -> list[str]:
    return ["<bos>"] + prompt.text.split()


def _check_prompt(prompt, haystack_len: int, num_records: int, prefix_filler: int) -> None:
    tokens = _tokens(prompt)
    assert len(tokens) == prompt.num_tokens == 1 + prefix_filler + haystack_len + 2
    assert tokens[-2] == QUERY
    query = tokens[-1]
    haystack = tokens[1 + prefix_filler : -2]
    assert all(w in FILLERS for w in tokens[1 : 1 + prefix_filler])
    keys = [i for i, w in enumerate(haystack) if w in KEYS]
    assert len(keys) == num_records
    assert len({haystack[i] for i in keys}) == num_records  # keys are unique
    for i in keys:
        assert haystack[i + 1] in VALUES
    assert sum(w in VALUES for w in haystack) == num_records
    assert all(w in FILLERS or w in KEYS or w in VALUES for w in haystack)
    assert tokens[prompt.target_position - 1] == query
    assert tokens[prompt.target_position] == prompt.answer


@pytest.mark.parametrize("seed", range(20))
def test_random_prompt_is_well_formed(seed):
    prompt = make_prompt(random.Random(seed))
    _check_prompt(prompt, 240, 48, 0)


@pytest.mark.parametrize("prefix_filler", [0, 1, 5])
@pytest.mark.parametrize("haystack_len,num_records", [(240, 48), (40, 19), (100, 10)])
def test_target_position_is_exact_everywhere(haystack_len, num_records, prefix_filler):
    first = 1 + prefix_filler
    rng = random.Random(haystack_len + prefix_filler)
    for position in range(first + 1, first + haystack_len):
        prompt = make_prompt(
            rng,
            haystack_len=haystack_len,
            num_records=num_records,
            target_position=position,
            prefix_filler=prefix_filler,
        )
        assert prompt.target_position == position
        _check_prompt(prompt, haystack_len, num_records, prefix_filler)


def test_target_position_outside_haystack_is_rejected():
    with pytest.raises(ValueError):
        make_prompt(random.Random(0), target_position=1)
    with pytest.raises(ValueError):
        make_prompt(random.Random(0), target_position=241)
    with pytest.raises(ValueError):
        make_prompt(random.Random(0), haystack_len=20, num_records=11)


def test_deterministic_from_rng():
    assert make_prompt(random.Random(7)) == make_prompt(random.Random(7))
    assert make_prompt(random.Random(7), target_position=99) == make_prompt(random.Random(7), target_position=99)
    assert make_prompt(random.Random(7)) != make_prompt(random.Random(8))


def test_prefix_filler_shifts_the_same_haystack():
    base = make_prompt(random.Random(3))
    shifted = make_prompt(random.Random(3), prefix_filler=5)
    assert shifted.text.split()[5:] == base.text.split()
    assert shifted.target_position == base.target_position + 5
    assert shifted.answer == base.answer


@pytest.mark.parametrize("hop,num_per_phase", [(4, 256), (2, 64), (8, 64), (1, 10)])
def test_needle_positions_are_position_matched(hop, num_per_phase):
    lo, hi = 10, 230
    groups = needle_positions_by_phase(hop, num_per_phase, lo, hi, random.Random(hop))
    assert sorted(groups) == list(range(hop))
    means = {statistics.fmean(g) for g in groups.values()}
    assert max(means) - min(means) < 1e-9
    variances = [statistics.pvariance(g) for g in groups.values()]
    assert max(variances) - min(variances) <= hop * hop / 4 + 1  # out of several thousand
    for phase, group in groups.items():
        assert len(group) == num_per_phase
        assert all(p % hop == phase and lo <= p <= hi for p in group)
    assert groups == needle_positions_by_phase(hop, num_per_phase, lo, hi, random.Random(hop))


def test_needle_positions_reject_unmatched_counts():
    with pytest.raises(ValueError):
        needle_positions_by_phase(4, 10, 10, 200, random.Random(0))


def test_is_correct_reads_first_word():
    assert is_correct(" v17", "v17")
    assert is_correct("v17 f3", "v17")
    assert not is_correct("v1", "v17")
    assert not is_correct("", "v17")
    assert not is_correct("f2 v17", "v17")


def test_vocab_is_unique_and_holds_every_word():
    assert len(VOCAB) == len(set(VOCAB)) == 256
    assert {"<pad>", "<bos>", "<eos>", "<unk>", QUERY} <= set(VOCAB)
    assert set(KEYS + VALUES + FILLERS) <= set(VOCAB)
