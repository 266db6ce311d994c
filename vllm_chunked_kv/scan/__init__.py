"""The scanner: find the weak phases of any OpenAI-compatible endpoint (docs/design.md §7).

`cli.py` is the `vllm-chunked-kv scan` entry; `session.py` runs one scan
(against one endpoint, or two with `--compare-url`); `server_layout.py`
reads hop, geometry and units from the servers. Requests: `client.py`
(HTTP, retries), `render.py` (prompts in tokens or characters), `runner.py`
(concurrency, records, feedback). What is asked: `tasks.py` (`items.py`,
`kv_task.py`, `user_task.py`) and `probes.py` (the offset, needle and
length axes). What is concluded: `stats.py`, `period.py`, `report.py`,
`report_text.py`, `compare.py` (A/B pairing, McNemar), `plot.py`. On disk:
`records.py`. `check.py` and `check_cli.py`: the one-prompt
`vllm-chunked-kv check`.
"""
