"""Synthetic key-value retrieval: the task the demo model is trained on and probed with.

A prompt is a haystack of `kX vY` records scattered among filler words,
followed by a query `? kX`; the correct continuation is the record's value
`vY`. Every word is one token of the shipped word-level tokenizer, which puts
`<bos>` in front, so token position 0 is `<bos>` and the first word of
`KVPrompt.text` sits at position 1 (positions as vLLM and docs/design.md §2 count
them).

Everything is drawn from the `random.Random` passed in, so a seed fixes the
prompt. The haystack is drawn before the prefix filler, so two calls from the
same rng state that differ only in `prefix_filler` give the same haystack,
shifted (the offset probe of docs/design.md §7).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUM_KEYS = 128
NUM_VALUES = 64
NUM_FILLERS = 32
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
QUERY = "?"
COPY_MARK = "="  # separates a segment from its repetition in the copy task used in training
KEYS = [f"k{i}" for i in range(NUM_KEYS)]
VALUES = [f"v{i}" for i in range(NUM_VALUES)]
FILLERS = [f"f{i}" for i in range(NUM_FILLERS)]
_USED = SPECIALS + [QUERY, COPY_MARK] + KEYS + VALUES + FILLERS
# Unused words pad the vocabulary to 256 entries.
VOCAB: list[str] = _USED + [f"r{i}" for i in range(256 - len(_USED))]


@dataclass(frozen=True)
class KVPrompt:
    text: str  # space-joined words, without <bos>
    answer: str  # the expected value word, e.g. "v17"
    target_position: int  # token position (0 = <bos>) of the target record's value token
    num_tokens: int  # prompt length in tokens, <bos> included


def _arrangement(rng: random.Random, length: int, num_records: int) -> list[bool]:
    """A random layout of `num_records` two-token records in `length` slots.

    Returns one flag per slot: True where a record's key starts. Uniform over
    all orderings of records (2 slots) and fillers (1 slot).
    """
    num_fillers = length - 2 * num_records
    if num_fillers < 0:
        raise ValueError(f"{num_records} records do not fit in {length} tokens")
    units = [True] * num_records + [False] * num_fillers
    rng.shuffle(units)
    starts: list[bool] = []
    for is_record in units:
        starts.extend([True, False] if is_record else [False])
    return starts


def _layout(
    rng: random.Random, haystack_len: int, num_records: int, target_index: int | None
) -> tuple[list[bool], int]:
    """Record-start flags over the haystack and the haystack index of the target's key."""
    if target_index is None:
        starts = _arrangement(rng, haystack_len, num_records)
        record_starts = [i for i, s in enumerate(starts) if s]
        return starts, rng.choice(record_starts)
    left_len = target_index
    right_len = haystack_len - target_index - 2
    others = num_records - 1
    # Split the other records between both sides in proportion to their room.
    share = others * left_len / max(1, left_len + right_len)
    n_left = int(share) + (1 if rng.random() < share - int(share) else 0)
    n_left = max(others - right_len // 2, min(n_left, left_len // 2))
    n_right = others - n_left
    if n_left > left_len // 2 or n_right > right_len // 2:
        raise ValueError(f"{num_records} records do not fit around index {target_index}")
    starts = _arrangement(rng, left_len, n_left) + [True, False] + _arrangement(rng, right_len, n_right)
    return starts, target_index


def make_prompt(
    rng: random.Random,
    *,
    haystack_len: int = 240,
    num_records: int = 48,
    target_position: int | None = None,
    prefix_filler: int = 0,
) -> KVPrompt:
    """One retrieval prompt: `prefix_filler` fillers, the haystack, then `? key`.

    With `target_position`, the target record's value token lands exactly at
    that token position (0 = <bos>); it must lie inside the haystack.
    """
    if not 1 <= num_records <= NUM_KEYS:
        raise ValueError(f"num_records must be in [1, {NUM_KEYS}], got {num_records}")
    first = 1 + prefix_filler  # token position of the haystack's first word
    target_index = None
    if target_position is not None:
        target_index = target_position - 1 - first  # haystack index of the target's key
        if not 0 <= target_index <= haystack_len - 2:
            raise ValueError(
                f"target_position {target_position} outside the haystack "
                f"[{first + 1}, {first + haystack_len - 1}]"
            )
    starts, target_index = _layout(rng, haystack_len, num_records, target_index)
    keys = rng.sample(KEYS, num_records)
    words: list[str] = []
    record = 0
    answer = query = ""
    i = 0
    while i < haystack_len:
        if starts[i]:
            value = rng.choice(VALUES)
            words += [keys[record], value]
            if i == target_index:
                query, answer = keys[record], value
            record += 1
            i += 2
        else:
            words.append(rng.choice(FILLERS))
            i += 1
    prefix = [rng.choice(FILLERS) for _ in range(prefix_filler)]
    words = prefix + words + [QUERY, query]
    return KVPrompt(
        text=" ".join(words),
        answer=answer,
        target_position=first + target_index + 1,
        num_tokens=1 + len(words),
    )


def needle_positions_by_phase(
    hop: int, num_per_phase: int, lo: int, hi: int, rng: random.Random
) -> dict[int, list[int]]:
    """Target positions in `[lo, hi]` grouped by phase (`position mod hop`), position-matched.

    Every phase gets the same base positions (multiples of `hop`) shifted by
    the phase; then, to re-centre, `num_per_phase * phase / hop` of them move
    back by one hop. The moved ones are picked so the variance stays that of
    phase 0: every group has exactly the same mean, and variances equal to
    within a few square tokens (docs/design.md §7). `num_per_phase` must be a
    multiple of `hop` (that is what makes the means equal exactly).
    """
    if hop < 1 or num_per_phase < 1 or num_per_phase % hop:
        raise ValueError(f"num_per_phase ({num_per_phase}) must be a positive multiple of hop ({hop})")
    first = -(-(lo + hop) // hop)  # smallest base index with base - hop >= lo
    last = (hi - hop + 1) // hop  # largest with base + hop - 1 <= hi
    if last < first:
        raise ValueError(f"[{lo}, {hi}] is too narrow for hop {hop}")
    bases = sorted(hop * rng.randint(first, last) for _ in range(num_per_phase))
    mean = sum(bases) / num_per_phase
    groups: dict[int, list[int]] = {}
    for phase in range(hop):
        moved = num_per_phase * phase // hop
        # Moving base b back by a hop changes n*variance by -2*hop*(b - mean) + const; the
        # shift itself adds phase*(hop - phase) per position. Pick the moved bases so that
        # their summed deviation cancels that: target = n*phase*(hop-phase) / (2*hop).
        target = num_per_phase * phase * (hop - phase) / (2 * hop)
        chosen = _subset_with_deviation(bases, mean, moved, target)
        positions = [b + phase - (hop if i in chosen else 0) for i, b in enumerate(bases)]
        groups[phase] = sorted(positions)
    return groups


def _subset_with_deviation(bases: list[int], mean: float, count: int, target: float) -> set[int]:
    """Indices of `count` bases whose deviations from `mean` sum close to `target` (greedy)."""
    if count == 0:
        return set()
    order = sorted(range(len(bases)), key=lambda i: abs(bases[i] - mean - target / count))
    chosen = set(order[:count])
    # Improve by pairwise swaps while that brings the sum closer.
    total = sum(bases[i] - mean for i in chosen)
    improved = True
    while improved:
        improved = False
        for i in list(chosen):
            best, best_err = None, abs(total - target)
            for j in range(len(bases)):
                if j in chosen:
                    continue
                err = abs(total - (bases[i] - mean) + (bases[j] - mean) - target)
                if err < best_err - 1e-9:
                    best, best_err = j, err
            if best is not None:
                chosen.remove(i)
                chosen.add(best)
                total += (bases[best] - mean) - (bases[i] - mean)
                improved = True
    return chosen


def is_correct(completion: str, answer: str) -> bool:
    """True when the completion's first word is the answer (leading whitespace ignored)."""
    words = completion.split()
    return bool(words) and words[0] == answer
