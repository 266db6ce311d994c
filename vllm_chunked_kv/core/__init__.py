"""The ground floor: settings (`config`, `presets`, `serve_file`), the chunk grid
(`grid`, `boundaries`) and how rows map to pages (`layout`).

Nothing here imports vLLM or torch at import time; every other floor builds on it
(docs/design.md, "Code layout").
"""
