"""The README is a front door that tells the truth:

- at most 130 lines;
- its Limitations section names everything the backend refuses: each
  refusal is read from the code that raises it (`backend/attention.py`,
  `backend/startup_checks.py`), the Mistral-style one (every layer slides,
  nothing left to compress) included, and must appear in that section;
- it names the fast tier and the full suite, and `.ci/run` runs the full
  suite (no marker selection);
- the shipped adapter's perplexity figure (its card's `served.json`) stands
  in at most two Markdown files: the card and the README.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKEND = ROOT / "vllm_chunked_kv" / "backend"
ADAPTER = ROOT / "vllm_chunked_kv" / "models" / "adapters" / "smollm2-135m"


def _plain(text: str) -> str:
    return " ".join(text.replace("`", "").lower().split())


def refusals() -> set[str]:
    """What the backend refuses, as its error messages name it."""
    impl = (BACKEND / "attention.py").read_text()
    checks = (BACKEND / "startup_checks.py").read_text()
    found = set()
    table = re.search(r"unsupported = \{(.*?)\n        \}", impl, re.S).group(1)  # the impl's refusal table
    found |= {key.split(" {")[0] for key in re.findall(r'^\s*f?"([^"]+)":', table, re.M)}
    found |= set(re.findall(r'does not support ([a-z ]+)"', impl))
    found |= set(re.findall(r"\(([^()]+)\) is not supported", impl))
    for source in (checks,):
        found |= {m.split(" {")[0] for m in re.findall(r'"([^"]+?) (?:is|are) not supported', source)}
        found |= set(re.findall(r"not supported with ([^:\"]+)", source))
        found |= set(re.findall(r"the model uses (?:its own )?([a-z ]+?)[;(\"]", source))
        found |= set(re.findall(r'"(every layer of the model [a-z ]+?) ?[;(:"]', source))  # Mistral-style
    return {name.strip() for name in found if name.strip()}


def limitations() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Limitations", 1)[1].split("\n## ", 1)[0]


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 130


def test_limitations_name_every_refusal():
    names = refusals()
    assert len(names) >= 12, names  # the extraction itself still finds the refusals
    assert any(name.startswith("every layer") and "sliding window" in name for name in names), names
    section = _plain(limitations())
    missing = sorted(name for name in names if _plain(name) not in section)
    assert not missing, f"README Limitations does not name: {missing}"
    assert "0.32.0" in section


def test_both_tiers_are_named_and_ci_runs_the_full_suite():
    readme = (ROOT / "README.md").read_text()
    assert "scripts/setup.sh test --fast" in readme and "scripts/setup.sh test " in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup.sh test" in ci and "--fast" not in ci and " -m " not in ci


def test_adapter_perplexity_has_one_home():
    served = json.loads((ADAPTER / "served.json").read_text())
    figure = f"{served['perplexity']['chunked']['value']:.2f}"
    markdown = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split()
    holders = sorted(path for path in markdown if figure in (ROOT / path).read_text())
    assert (ADAPTER / "ADAPT.md").relative_to(ROOT).as_posix() in holders
    assert len(holders) <= 2, holders
