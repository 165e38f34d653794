"""The pages the build generates from the repository's files: the config catalogue from ``configs/`` and the
benchmark figures from ``benchmarks/*.json``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import bench_figures  # noqa: E402
import config_catalogue  # noqa: E402


def test_the_catalogue_lists_every_config_with_its_leading_comment(site):
    assert site.returncode == 0, site.output[-4000:]
    html = (site.html / "reference" / "configs.html").read_text()
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&#8217;", "'").replace("&#39;", "'")
    configs = sorted((ROOT / "configs").rglob("*.yaml"))
    assert len(configs) > 100
    missing = [str(p.relative_to(ROOT)) for p in configs if str(p.relative_to(ROOT)) not in text]
    assert not missing, f"configs the catalogue does not list: {missing}"
    quickstart = config_catalogue.leading_comment(ROOT / "configs" / "classification" / "quickstart.yaml")
    assert quickstart.startswith("Quickstart: a 4-layer ViT") and quickstart[:60] in text.replace("&quot;", '"')


def test_a_config_without_a_leading_comment_is_an_error_naming_it(tmp_path, monkeypatch):
    folder = tmp_path / "configs" / "family"
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text("model:\n  class_path: ClassificationModule\n")
    monkeypatch.setattr(config_catalogue, "ROOT", tmp_path)
    monkeypatch.setattr(config_catalogue, "CONFIGS", tmp_path / "configs")
    with pytest.raises(ValueError, match=r"configs/family/run\.yaml: no leading comment"):
        config_catalogue.table(folder)


def test_the_catalogue_reads_model_and_attention_from_the_file():
    kind, model, attention = config_catalogue.describe(ROOT / "configs" / "lra" / "quickstart.yaml")
    assert (kind, model, attention) == ("run", "LRAModule", "poly3, 1/14")
    kind, model, attention = config_catalogue.describe(ROOT / "configs" / "grids" / "digits_table1.yaml")
    assert kind == "grid" and model == "base: ../classification/quickstart.yaml" and "softmax" in attention


def test_every_figure_is_drawn_and_shown_on_a_benchmark_page(site):
    assert site.returncode == 0, site.output[-4000:]
    pages = "\n".join(p.read_text() for p in (site.html / "benchmarks").glob("*.html"))
    for name in bench_figures.FIGURES:
        assert (site.html / "_images" / name).stat().st_size > 10_000, name
        assert f"_images/{name}" in pages, f"{name} is drawn but no benchmark page shows it"


def test_a_missing_measurement_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(RuntimeError, match=r"cannot read .*benchmarks/long_context_poly3_cpu_2core\.json"):
        bench_figures.crossover(tmp_path)
