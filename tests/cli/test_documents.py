"""The documents say what the project does: the paths and numbers they give agree with the files."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from polyattn_lightning.cli.prechecks import yaml_references

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIGS_README = (ROOT / "configs" / "README.md").read_text()
#: the documentation site's pages, which hold what README.md held before it became a front door
DOCS = "\n".join(path.read_text() for path in sorted((ROOT / "docs").rglob("*.md")) if "_build" not in path.parts)
QUICKSTART = ROOT / "configs" / "classification" / "quickstart.yaml"
FINETUNE = ROOT / "configs" / "classification" / "finetune" / "vit_small_softmax_to_poly3.yaml"


def test_every_yaml_a_config_names_exists():
    missing = [f"{path.relative_to(ROOT)}: {name}" for path in (ROOT / "configs").rglob("*.yaml")
               for name in yaml_references(yaml.safe_load(path.read_text())) if not (path.parent / name).is_file()]
    assert not missing


def test_every_config_the_documents_name_exists():
    """Also the configs in the README's ``python3 -m venv`` lines, which a new user runs verbatim, the site's pages, and
    the shipped grid files (``configs/grids/...``) ``polyattn grid`` is given."""
    venv_lines = [line for line in README.splitlines() if line.startswith("python3 -m venv")]
    assert any("--config" in line for line in venv_lines)
    named = re.findall(r"(?:--config[ =]|polyattn grid (?=configs/))(\S+\.yaml)", README + CONFIGS_README + DOCS)
    assert len(named) > 5 and any(name.startswith("configs/grids/") for name in named)
    assert [name for name in named if not {"<", "$"} & set(name) and not (ROOT / name).is_file()] == []


def test_fine_tune_weights_path_is_the_file_the_download_command_writes():
    download = re.search(r"huggingface-cli download \S+ (\S+) --local-dir (\S+)", CONFIGS_README)
    written = f"{download.group(2)}/{download.group(1)}"
    assert yaml.safe_load(FINETUNE.read_text())["model"]["init_args"]["pretrained"] == written
    given = set(re.findall(r"vit_small_softmax_to_poly3\.yaml.*?--model\.pretrained (\S+)", README + CONFIGS_README,
                           flags=re.S))
    assert given == {written}


def test_quickstart_time_is_the_same_number_everywhere():
    """The time the YAML header states (``about N s``) is the one README.md and configs/README.md state for the
    digits quickstart (measurement details beside it give exact figures, not ``about``)."""
    header = QUICKSTART.read_text().splitlines()[0]
    seconds = re.search(r"about (\d+) s\b", header).group(1)
    for document in (README, CONFIGS_README):
        sentences = [s for s in re.split(r"(?<=[.:])\s|\n\s*\n", document) if "quickstart" in s.lower()
                     and ("digits" in s or "classification/quickstart.yaml" in s)]
        stated = [t for s in sentences for t in re.findall(r"about (\d+) s\b|~ ?(\d+)|(\d+) min|half a minute", s)]
        assert stated and all(found == (seconds, "", "") for found in stated), stated


def test_debug_switch_and_data_check_are_documented():
    assert "POLYATTN_DEBUG=1" in README
    assert "polyattn check-data --config" in README
