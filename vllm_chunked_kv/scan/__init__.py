"""The scanner: find the weak phases of any OpenAI-compatible endpoint (docs/design.md §7).

`cli.py` is the `vllm-chunked-kv scan` entry; `session.py` runs one scan.
Requests: `client.py` (HTTP, retries), `render.py` (prompts in tokens or
characters), `runner.py` (concurrency, records, feedback). What is asked:
`tasks.py` and `probes.py`. What is concluded: `stats.py`, `period.py`,
`report.py`, `plot.py`. On disk: `records.py`.
"""
