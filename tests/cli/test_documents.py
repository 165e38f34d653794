"""The documents say what the project does: the paths and numbers they give agree with the files."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from polyattn_lightning.cli.prechecks import yaml_references

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
#: the site's pages that took over configs/README.md's content: the papers' experiments, the config catalogue's
#: prose and the benchmark pages (the quickstarts' and the conversions' measurements)
SITE_PAGES = [ROOT / "docs" / "papers.md", ROOT / "docs" / "reference" / "configs.md",
              *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
SITE = "\n\n".join(page.read_text() for page in SITE_PAGES)
QUICKSTARTS = (ROOT / "docs" / "benchmarks" / "quickstarts.md").read_text()
#: every page of the documentation site, which holds what README.md held before it became a front door
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
    named = re.findall(r"(?:--config[ =]|polyattn grid (?=configs/))(\S+\.yaml)", README + DOCS)
    assert len(named) > 5 and any(name.startswith("configs/grids/") for name in named)
    assert [name for name in named if not {"<", "$"} & set(name) and not (ROOT / name).is_file()] == []


def test_fine_tune_weights_path_is_the_file_the_download_command_writes():
    download = re.search(r"huggingface-cli download \S+ (\S+) --local-dir (\S+)", SITE)
    written = f"{download.group(2)}/{download.group(1)}"
    assert yaml.safe_load(FINETUNE.read_text())["model"]["init_args"]["pretrained"] == written
    given = set(re.findall(r"vit_small_softmax_to_poly3\.yaml.*?--model\.pretrained (\S+)", README + SITE,
                           flags=re.S))
    assert given == {written}


def test_quickstart_time_is_the_same_number_everywhere():
    """The time the YAML header states (``about N s``) is the one README.md and the site's quickstarts page state
    for the digits quickstart (measurement details beside it give exact figures, not ``about``)."""
    header = QUICKSTART.read_text().splitlines()[0]
    seconds = re.search(r"about (\d+) s\b", header).group(1)
    for document in (README, QUICKSTARTS):
        sentences = [s for s in re.split(r"(?<=[.:])\s|\n\s*\n", document) if "quickstart" in s.lower()
                     and ("digits" in s or "classification/quickstart.yaml" in s)]
        stated = [t for s in sentences for t in re.findall(r"about (\d+) s\b|~ ?(\d+)|(\d+) min|half a minute", s)]
        assert stated and all(found == (seconds, "", "") for found in stated), stated


def test_debug_switch_and_data_check_are_documented():
    assert "POLYATTN_DEBUG=1" in README
    assert "polyattn check-data --config" in README


BENCHMARK_PAGES = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))


def markdown_rows(page: str, header_start: str) -> list[list[str]]:
    """The cells of the table whose header row starts with ``header_start`` (bold marks dropped)."""
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")])
    return rows


def test_every_measurement_file_a_benchmark_page_names_exists():
    named = {name for page in BENCHMARK_PAGES
             for name in re.findall(r"(?<![\w/])((?:benchmarks|docs)/[\w./-]+\.(?:json|csv|png))", page.read_text())}  # fmt: skip
    assert len(named) > 20
    assert sorted(name for name in named if not (ROOT / name).is_file()) == []


def test_the_kernel_table_is_the_json_it_comes_from():
    """docs/benchmarks/kernels-cpu.md's Results table: each cell case / SDPA, as the JSON of that run holds it."""
    import json

    page = (ROOT / "docs" / "benchmarks" / "kernels-cpu.md").read_text()
    data = json.loads((ROOT / "benchmarks" / "attention_cpu_2core.json").read_text())
    header = next(line for line in page.splitlines() if line.startswith("| case | vit-s fwd"))
    columns = [cell.strip().split(" ", 1) for cell in header.strip("|").split("|")][1:]
    keys = {"fwd": "fwd_s", "fwd+bwd": "fwd_bwd_s", "mem": "peak_bytes"}
    rows = markdown_rows(page, "| case | vit-s fwd")
    assert len(rows) == 10
    for case, *cells in rows:
        for (shape, what), cell in zip(columns, cells, strict=True):
            ratio = (data["results"][shape]["cases"].get(case) or {}).get("ratio")
            assert cell == ("-" if ratio is None else f"{ratio[keys[what]]:.2f}"), (case, shape, what)


def test_the_long_context_table_is_the_json_it_comes_from():
    import json

    page = (ROOT / "docs" / "benchmarks" / "linear.md").read_text()
    points = json.loads((ROOT / "benchmarks" / "long_context_poly3_cpu_2core.json").read_text())["results"][0]["points"]
    rows = markdown_rows(page, "| N | quadratic s | linear s |")
    assert [int(row[0].replace(",", "")) for row in rows] == [point["n"] for point in points]
    for row, point in zip(rows, points):
        assert float(row[3]) == round(point["quadratic_over_linear"], 2), row
        assert float(row[4]) == round(point["auto_over_best"], 2), row
        assert abs(float(row[1]) - point["quadratic_s"]) < 0.01 * max(1.0, point["quadratic_s"]), row
