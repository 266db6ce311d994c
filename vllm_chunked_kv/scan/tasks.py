"""What the scanner asks: the synthetic key-value task, or a team's own tasks from JSONL.

Each task yields `Item`s (`items.py`): a prompt as segments (see
`render.py`) with one `Target`, the expected answer, and the slot where the
`length` probe adds filler. Three families of items (docs/design.md §7):

- offset items: the target at the same position and the prompt of the same
  length in every item, so that prepending `k` filler units moves every
  target and every prompt end to the same new phase;
- length items: one prompt length, targets spread evenly over the phases;
  the length probe then grows the slot after the record (`items.grown`), so
  only the prompt's end moves;
- needle items: only the target's position changes, position-matched across
  phases (`needle_positions_by_phase`), each prompt's length fixed.

`place(renderer, geometry)` (called by the scan once it knows the server)
makes the default positions land where the server compresses
(`placement.py`): the kv task grows its haystack, user tasks pad between the
record and the question, so that every target has at least
`geometry.min_distance` units after it and sits past the sinks. Without it
the items are built as if the window were 0.

Tasks: `kv_task.KVTask` and `user_task.UserTask` (format in its docstring).
"""

from __future__ import annotations

from vllm_chunked_kv.scan.items import DEFAULT_FILLER, Item
from vllm_chunked_kv.scan.kv_task import KVTask
from vllm_chunked_kv.scan.user_task import SLOT, UserLine, UserTask, load_user_lines

__all__ = ["DEFAULT_FILLER", "SLOT", "Item", "KVTask", "UserLine", "UserTask", "load_user_lines"]
