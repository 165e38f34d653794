"""README.md is the front door: short, the install first, the quickstart lines verbatim, links that reach the site."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LINKS = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)

#: Lines a tool runs in a fresh clone (every README line that starts with ``python3 -m venv``): kept verbatim.
VENV_LINES = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch torchvision --index-url "
    "https://download.pytorch.org/whl/cpu",
    *(
        f"python3 -m venv .venv && . .venv/bin/activate && pip install -e {extra} && lightning fit --config {config}"
        for extra, config in [
            (".", "configs/classification/quickstart.yaml"),
            (".", "configs/lra/quickstart.yaml"),
            ('".[detection]"', "configs/detection/quickstart.yaml"),
            ('".[hf,hf-example]"', "configs/hf/minilm_poly3.yaml"),
            ('".[hf,hf-example]"', "configs/hf/tiny_llama_poly3.yaml"),
        ]
    ),
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && pytest',
    'python3 -m venv .venv-lowest && . .venv-lowest/bin/activate && PIP_FIND_LINKS="$(mktemp -d)" pip install -e '
    '".[test]" -c .ci/lowest-constraints.txt && pytest tests/attention/switch',
]


def test_readme_is_at_most_12_kib():
    assert len((ROOT / "README.md").read_bytes()) <= 12_288


def test_the_fresh_clone_lines_are_kept_and_the_cpu_torch_line_comes_first():
    lines = [line for line in README.splitlines() if line.startswith("python3 -m venv")]
    assert lines == VENV_LINES


def test_every_relative_link_leads_to_a_file():
    relative = [link for link in LINKS if "://" not in link]
    assert len(relative) > 20
    assert [link for link in relative if not (ROOT / link).exists()] == []


def test_each_goal_is_at_most_two_clicks_away():
    """Linked from the README itself, or from a page the README links (one more click)."""
    first = {(ROOT / link).resolve() for link in LINKS if "://" not in link}
    second = set(first)
    for page in first:
        if page.suffix == ".md":
            for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
                second.add((page.parent / link).resolve())
            second |= {(page.parent / f"{name}.md").resolve() for name in re.findall(r"^(\S+)$", page.read_text(), re.M)}
    goals = ["getting-started", "training", "howto/own-images", "howto/lra", "howto/detection", "howto/switch-hf",
             "howto/switch-timm", "howto/convert", "howto/slurm", "reference/timm-models", "reference/hf-models"]
    assert [goal for goal in goals if (ROOT / "docs" / f"{goal}.md").resolve() not in second] == []
    assert (ROOT / "docs" / "api" / "polyattn_lightning.rst").resolve() in first  # where set_attention is documented


def test_no_measurement_history():
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b|\bat load \d|\bload \d+(-\d+)?\)", README) == []
