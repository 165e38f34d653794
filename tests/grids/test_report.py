"""The grid report read from hand-written grid folders: tables against the metrics files and hand-computed numbers,
cells that do not count said in the table and on the terminal, the papers' numbers, and errors in one line."""

from __future__ import annotations

import csv
import json
import math

import pytest
from report_grids import metrics, write_grid

from polyattn_lightning.errors import ConfigError, MissingPathError, UserInputError
from polyattn_lightning.grids.paper import PAPERS, paper_table
from polyattn_lightning.grids.report import write_report

ATTENTION = (
    "model.init_args.attention",
    {"softmax": "softmax", "poly3-scaled": {"name": "poly3", "scale": "inv_sqrt_n"}, "relu": "relu"},
)
SEEDS = ("seed_everything", {"seed1": 1, "seed2": 2, "seed3": 3})
T2 = 4.302652729749  # t(0.975, 2)


def rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture
def digits_grid(tmp_path):
    """3 activations x 3 seeds: poly3-scaled/seed2 interrupted, relu/seed2 failed, relu/seed3 never started."""
    cells = {
        "softmax/seed1": metrics(0.93),
        "softmax/seed2": metrics(0.90),
        "softmax/seed3": metrics(0.96),
        "poly3-scaled/seed1": metrics(0.95),
        "poly3-scaled/seed2": metrics(0.40, status="interrupted"),
        "poly3-scaled/seed3": metrics(0.99),
        "relu/seed1": metrics(0.80, at_chance=True),
        "relu/seed2": metrics(0.10, status="failed", error="RuntimeError: loss is nan"),
        "relu/seed3": None,
    }
    logs = {"relu/seed2": "epoch 1\nRuntimeError: loss is nan\n"}
    report = {"metric": "val/top1", "use": "best", "seeds": "seed", "baseline": {"attention": "softmax"}}
    root = write_grid(tmp_path / "digits", {"attention": ATTENTION, "seed": SEEDS}, report, cells, logs=logs)
    return root, cells


def test_table_numbers_are_the_hand_computed_ones(digits_grid, capsys):
    root, _ = digits_grid
    folder = write_report(root)
    table = {row["group"]: row for row in rows(folder / "table.csv")}
    softmax, poly3, relu = table["softmax"], table["poly3-scaled"], table["relu"]
    # softmax: 0.93, 0.90, 0.96 -> mean 0.93, s 0.03, interval 0.93 ± 4.3027 * 0.03 / sqrt(3)
    assert (softmax["n"], softmax["seeds"], softmax["missing"]) == ("3", "seed1;seed2;seed3", "")
    assert float(softmax["mean"]) == pytest.approx(0.93, abs=1e-15)
    assert float(softmax["std"]) == pytest.approx(0.03, abs=1e-15)
    half = T2 * 0.03 / math.sqrt(3)
    assert (float(softmax["ci_low"]), float(softmax["ci_high"])) == pytest.approx((0.93 - half, 0.93 + half), 1e-12)
    assert softmax["baseline"] == "(baseline)" and softmax["diff_mean"] == ""
    # poly3-scaled: seed2 interrupted -> n 2 (0.95, 0.99); paired with softmax on seeds 1 and 3: 0.02 and 0.03
    assert (poly3["n"], poly3["missing"], poly3["baseline"], poly3["diff_n"]) == ("2", "seed2", "softmax", "2")
    assert float(poly3["mean"]) == pytest.approx(0.97, abs=1e-15)
    assert float(poly3["diff_mean"]) == pytest.approx(0.025, abs=1e-15)
    assert float(poly3["diff_std"]) == pytest.approx(math.sqrt(0.005**2 * 2), abs=1e-15)
    assert float(poly3["t"]) == pytest.approx(12.706204736, rel=1e-9)  # n = 2: one degree of freedom
    # relu: one finished seed -> a mean, no spread, no interval; one pair -> a difference without interval
    assert (relu["n"], relu["mean"], relu["std"], relu["ci_low"], relu["t"]) == ("1", "0.8", "", "", "")
    assert (relu["diff_n"], float(relu["diff_mean"]), relu["diff_low"]) == ("1", pytest.approx(-0.13), "")


def test_cells_csv_values_are_the_metrics_files(digits_grid):
    root, cells = digits_grid
    folder = write_report(root)
    for row in rows(folder / "cells.csv"):
        body = json.loads((root / "cells" / row["cell"] / "metrics.json").read_text()) if cells[row["cell"]] else None
        if body is not None and body["status"] == "finished":
            assert float(row["value"]) == body["best"]["value"]  # full precision: exactly the file's number
            assert row["reason"] == ""
        else:
            assert row["value"] == "" and row["reason"]
    assert {row["cell"]: row["status"] for row in rows(folder / "cells.csv")}["relu/seed3"] == "not started"


def test_missing_and_unfinished_seeds_are_said_out_loud(digits_grid, capsys):
    root, _ = digits_grid
    folder = write_report(root)
    shown = capsys.readouterr().out
    assert "6 of 9 cells counted" in shown
    assert "not counted: poly3-scaled/seed2: interrupted: was interrupted; resumes from checkpoints/last.ckpt" in shown
    assert "not counted: relu/seed2: failed: RuntimeError: loss is nan; log: cells/relu/seed2/cell.log" in shown
    assert "not counted: relu/seed3: not started" in shown
    table = (folder / "table.md").read_text()
    poly3_row = next(line for line in table.splitlines() if line.startswith("| poly3-scaled |"))
    assert "missing seed2 (interrupted)" in poly3_row
    relu_row = next(line for line in table.splitlines() if line.startswith("| relu |"))
    assert "missing seed2 (failed), seed3 (not started); at chance: seed1" in relu_row
    assert "at chance" not in poly3_row and "At chance: the seeds whose metrics.json says `at_chance`" in table
    assert "n=1: no interval" in relu_row and "one pair: no interval" in relu_row
    assert "Not counted (3 of 9 cells):" in table
    assert "- `poly3-scaled/seed2`: interrupted" in table
    report = json.loads((folder / "report.json").read_text())
    poly3 = next(group for group in report["groups"] if group["name"] == "poly3-scaled")
    assert poly3["values"] == {"seed1": 0.95, "seed3": 0.99}
    assert list(poly3["missing"]) == ["seed2"]
    assert poly3["paired"]["only_baseline"] == ["seed2"]


def test_a_cell_finishing_later_counts_on_the_next_report(digits_grid):
    root, _ = digits_grid
    write_report(root)
    (root / "cells/poly3-scaled/seed2/metrics.json").write_text(json.dumps(metrics(0.97)))
    table = {row["group"]: row for row in rows(write_report(root) / "table.csv")}
    assert (table["poly3-scaled"]["n"], table["poly3-scaled"]["missing"]) == ("3", "")
    assert float(table["poly3-scaled"]["mean"]) == pytest.approx((0.95 + 0.97 + 0.99) / 3, abs=1e-15)


def test_final_value_of_another_metric(tmp_path):
    cells = {
        f"{a}/seed{s}": metrics(0.5 + 0.1 * s + (a == "poly3-scaled") * 0.01) for a in ATTENTION[1] for s in (1, 2, 3)
    }
    root = write_grid(
        tmp_path / "g", {"attention": ATTENTION, "seed": SEEDS}, {"metric": "test/top1", "use": "final"}, cells
    )
    table = {row["group"]: row for row in rows(write_report(root) / "table.csv")}
    expected = [cells[f"softmax/seed{s}"]["metrics"]["test/top1"] for s in (1, 2, 3)]
    assert float(table["softmax"]["mean"]) == pytest.approx(math.fsum(expected) / 3, abs=1e-15)
    assert float(table["poly3-scaled"]["diff_mean"]) == pytest.approx(0.01, abs=1e-12)
    assert table["poly3-scaled"]["baseline"] == "softmax"  # no report.baseline: the 'softmax' label, said in notes
    assert "Baseline: attention=softmax (report.baseline not set" in (root / "report/table.md").read_text()


def test_best_of_a_metric_that_is_not_monitored_is_refused(tmp_path):
    cells = {f"{a}/seed{s}": metrics(0.9) for a in ATTENTION[1] for s in (1, 2, 3)}
    root = write_grid(tmp_path / "g", {"attention": ATTENTION, "seed": SEEDS}, {"metric": "test/top1"}, cells)
    with pytest.raises(ConfigError, match=r"monitors val/top1, not test/top1; .* set report.use: final$"):
        write_report(root)
    root = write_grid(tmp_path / "h", {"attention": ATTENTION, "seed": SEEDS}, {"metric": "test/top5", "use": "final"},
                      cells)  # fmt: skip
    with pytest.raises(ConfigError, match=r"'test/top5' \(did you mean 'test/top1'\?\) is in no finished cell"):
        write_report(root)


def test_paper_numbers_stand_beside_ours(tmp_path):
    models = ("model.init_args.model_name", {"vit_s": "vit_small_patch16_224", "xcit_s12": "xcit_small_12_p16_224"})
    attention = (
        "model.init_args.attention",
        {"softmax": "softmax", "poly3": {"name": "poly3", "scale": 1 / 14}, "poly3-sqrt-n": "poly3"},
    )
    seeds = ("seed_everything", {"seed1": 1, "seed2": 2})
    cells, configs = {}, {}
    for m, timm_name in models[1].items():
        for a, spec in attention[1].items():
            for s in seeds[1]:
                cells[f"{m}/{a}/{s}"] = metrics(0.8 + 0.01 * len(a) + 0.001 * int(s[-1]))
                configs[f"{m}/{a}/{s}"] = {"model": {"init_args": {"model_name": timm_name, "attention": spec}}}
    report = {"baseline": {"attention": "softmax"}, "paper": "imagenet_top1"}
    root = write_grid(tmp_path / "imagenet", {"model": models, "attention": attention, "seed": seeds}, report, cells,
                      configs)  # fmt: skip
    folder = write_report(root)
    table = {row["group"]: row for row in rows(folder / "table.csv")}
    assert (table["vit_s/softmax"]["paper_reported"], table["vit_s/softmax"]["paper"]) == ("80.2", "0.802")
    assert (table["vit_s/poly3"]["paper_reported"], table["vit_s/poly3"]["paper_model"]) == ("80.5", "ViT-S")
    assert (table["xcit_s12/poly3"]["paper_reported"], table["xcit_s12/softmax"]["paper_reported"]) == ("82.1", "81.2")
    assert table["vit_s/poly3-sqrt-n"]["paper"] == ""  # x^3 / sqrt(N): the paper reports x^3 at 1/14 only
    assert table["xcit_s12/poly3"]["baseline"] == "xcit_s12/softmax"  # paired within the model
    assert float(table["xcit_s12/poly3"]["diff_mean"]) == pytest.approx(0.01 * (5 - 7), abs=1e-12)
    markdown = (folder / "table.md").read_text()
    assert "| vit_s | poly3 | 2 |" in markdown and "80.5 % (ViT-S, x^3, scale 1/14)" in markdown
    assert "| vit_s | poly3-sqrt-n |" in markdown and "not reported" in markdown
    assert "arXiv 2410.18613" in markdown


def test_the_paper_tables_hold_the_facts_numbers():
    imagenet = PAPERS["imagenet_top1"].numbers
    assert {model: (row["softmax"], row["x^3, scale 1/14"]) for model, row in imagenet.items()} == {
        "ViT-B": (79.6, 79.6), "ViT-S": (80.2, 80.5), "Swin-B": (83.0, 83.2), "Swin-S": (83.3, 83.4),
        "XCiT-S12": (81.2, 82.1),
    }  # fmt: skip
    lra = paper_table("lra")
    assert lra.lookup("vit_base_patch16_224", "softmax") is None and "no numbers" in lra.source
    swin = PAPERS["imagenet_top1"].lookup("swin_base_patch4_window7_224.ms_in1k", {"name": "poly3", "scale": 1 / 14})
    assert (swin.reported, swin.value, swin.model) == (83.2, 0.832, "Swin-B")


def test_a_loss_metric_gets_no_accuracy_from_the_paper(tmp_path):
    cells = {f"{a}/seed{s}": metrics(0.9) for a in ATTENTION[1] for s in (1, 2, 3)}
    report = {"metric": "val/loss", "use": "final", "paper": "imagenet_top1"}
    root = write_grid(tmp_path / "g", {"attention": ATTENTION, "seed": SEEDS}, report, cells)
    folder = write_report(root)
    assert all(row["paper"] == "" for row in rows(folder / "table.csv"))
    assert "the report's metric val/loss is not that quantity" in (folder / "table.md").read_text()


def test_no_finished_cell_still_writes_a_report(tmp_path, capsys):
    cells = {"softmax/seed1": metrics(0.3, status="interrupted")}
    root = write_grid(tmp_path / "g", {"attention": ATTENTION, "seed": SEEDS}, {}, cells)
    folder = write_report(root)
    assert all(row["n"] == "0" and row["mean"] == "" for row in rows(folder / "table.csv"))
    assert "no finished seed" in (folder / "table.md").read_text()
    assert "0 of 9 cells counted" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("report", "message"),
    [
        ({"seeds": "seeds"}, r"report.seeds: 'seeds' is not an axis \(did you mean 'seed'\?\); axes: attention, seed"),
        ({"baseline": {"attention": "softmx"}}, r"'softmx' is not a label of axis 'attention'; labels: softmax, "),
        ({"baseline": {"seed": "seed1"}}, r"report.baseline: 'seed' is not an axis; axes: attention$"),
        ({"paper": "imagenet"}, r"unknown paper table 'imagenet' \(did you mean 'imagenet_top1'\?\); known: "),
        ({"use": "mean"}, r"report.use must be one of best, last, final, got 'mean'"),
        ({"metrc": "val/top1"}, r"unknown report key 'metrc' \(did you mean 'metric'\?\)"),
        ({"figure": "lines"}, r"report.figure must be one of bars, scale-sweep"),
        ({"figure": "scale-sweep"}, r"report.x: 'scale' is not an axis; axes: attention$"),
        (
            {"figure": "scale-sweep", "x": "attention", "lines": "seed"},
            r"report.lines: 'seed' is not an axis; axes: attention$",
        ),
        ({"x": "attention"}, r"report.x names an axis of figure: scale-sweep; figure is bars$"),
    ],
)
def test_bad_report_settings_are_one_line_errors(tmp_path, report, message):
    root = write_grid(tmp_path / "g", {"attention": ATTENTION, "seed": SEEDS}, report, {"softmax/seed1": metrics(0.9)})
    with pytest.raises(UserInputError, match=message) as error:
        write_report(root)
    assert "\n" not in str(error.value) and str(root / "grid.json") in str(error.value)
    assert not (root / "report").exists()


def test_a_folder_without_grid_json_is_refused(tmp_path):
    with pytest.raises(MissingPathError, match=r"no grid.json here; a grid's folder .* holds grid.json and cells/"):
        write_report(tmp_path)


def test_a_diverged_cell_is_left_out_and_said(tmp_path, capsys):
    cells = {f"{a}/seed{s}": metrics(0.9 - 0.01 * s) for a in ATTENTION[1] for s in (1, 2, 3)}
    cells["relu/seed2"] = metrics(float("nan"))  # json writes NaN, as a diverged fit's metrics.json would hold
    root = write_grid(tmp_path / "g", {"attention": ATTENTION, "seed": SEEDS}, {}, cells)
    table = {row["group"]: row for row in rows(write_report(root) / "table.csv")}
    assert (table["relu"]["n"], table["relu"]["missing"]) == ("2", "seed2")
    assert float(table["relu"]["mean"]) == pytest.approx(0.88, abs=1e-15)
    assert "not counted: relu/seed2: finished, but its best.value is nan (diverged?)" in capsys.readouterr().out
    assert "missing seed2 (finished without a usable value)" in (root / "report/table.md").read_text()


def test_paper_targets_show_before_any_cell_finishes(tmp_path):
    attention = ("model.init_args.attention", {"softmax": "softmax", "poly3": {"name": "poly3", "scale": 1 / 14}})
    models = ("model.init_args.model_name", {"swin_s": "swin_small_patch4_window7_224"})
    root = write_grid(tmp_path / "g", {"model": models, "attention": attention, "seed": SEEDS},
                      {"paper": "imagenet_top1"}, {})  # fmt: skip
    table = {row["group"]: row for row in rows(write_report(root) / "table.csv")}
    assert (table["swin_s/softmax"]["paper_reported"], table["swin_s/poly3"]["paper_reported"]) == ("83.3", "83.4")
    assert table["swin_s/poly3"]["n"] == "0"


def test_cells_without_a_monitored_metric_need_report_metric(tmp_path):
    cells = {f"{a}/seed{s}": metrics(0.9, monitor=None, best=None, last=None) for a in ATTENTION[1] for s in (1, 2, 3)}
    root = write_grid(tmp_path / "g", {"attention": ATTENTION, "seed": SEEDS}, {}, cells)
    with pytest.raises(ConfigError, match=r"name no monitored metric; set report.metric and report.use: final$"):
        write_report(root)
    root = write_grid(tmp_path / "h", {"attention": ATTENTION, "seed": SEEDS}, {"metric": "val/loss", "use": "final"},
                      cells)  # fmt: skip
    table = {row["group"]: row for row in rows(write_report(root) / "table.csv")}
    assert float(table["relu"]["mean"]) == pytest.approx(0.1, abs=1e-12)  # val/loss = 1 - 0.9
