"""method="transfer" judged on samples it does not train on: the held-out split, the early stop on the held-out
layer error with the best weights kept, the warnings when the samples are too few or too alike to judge or to
train on (as a user's process prints them), both errors in the report, its JSON and its figure, and the progress
lines."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import conversion_models as cm
import pytest
import torch

from polyattn_lightning import convert
from polyattn_lightning.cli.run_log import run_log
from polyattn_lightning.conversion import transfer
from polyattn_lightning.conversion.holdout import GAP, MIN_HELD_OUT, gap, repeated, split
from polyattn_lightning.conversion.report import ConversionReport

#: Full q/k deltas at a high lr on 30 random token rows: the training error keeps falling, the held-out one turns.
OVERFIT = dict(qk="full", lr=1e-2, steps=400, check_every=5, patience=5)


def overfitting_samples():
    return cm.token_samples(batches=1, rows=40, length=12)


def test_the_split_holds_out_every_kth_sample_across_batches_and_keeps_the_rest():
    ids = torch.arange(20 * 3).reshape(20, 3)
    samples = [{"input_ids": ids[:6], "flag": True}, {"input_ids": ids[6:8]}, {"input_ids": ids[8:]}]
    train, held_out = split(samples, 0.25)
    rows_of = lambda part: [int(r) for b in part for r in b["input_ids"][:, 0] // 3]  # noqa: E731
    assert rows_of(held_out) == [3, 7, 11, 15, 19]  # the 4th, 8th... sample, counted across batches
    assert rows_of(train) == [i for i in range(20) if i not in (3, 7, 11, 15, 19)]
    assert held_out[0]["flag"] is True and train[0]["flag"] is True  # a value without a batch dimension: both
    again = split(samples, 0.25)  # the same on every call (and every rank)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(again[1], held_out))
    images = [torch.randn(3, 3, 4, 4), torch.randn(5, 3, 4, 4)]
    train, held_out = split(images, 0.5)
    assert [len(b) for b in train] == [2, 2] and [len(b) for b in held_out] == [1, 3]
    torch.testing.assert_close(held_out[0], images[0][1:2])
    train, held_out = split(images, 0.0)
    assert held_out == [] and all(a is b for a, b in zip(train, images))


def test_the_held_out_error_stops_the_transfer_and_its_best_weights_are_kept():
    report = convert(cm.llama(), "poly3", overfitting_samples(), "transfer", **OVERFIT)
    t = report.transfer
    checks = [(step, held) for _, step, _, held in t["curve"]]
    best_step, best = min(checks, key=lambda c: c[1])
    assert t["stopped"] == "held-out" and t["steps"] < OVERFIT["steps"]
    assert checks[-1][0] == t["steps"] and checks[-1][1] > best  # it stopped on a worse held-out error...
    assert t["kept_steps"] == [best_step] and best_step > 0
    # ...and kept the weights of the lowest: the folded model's held-out error is that check's
    assert sum(report.error_held_out) == pytest.approx(best, rel=1e-4)
    assert report.held_out == 10 and report.samples == 40 and not report.warnings
    # the training error kept falling past the kept step: it is the held-out part that stopped the transfer
    training = [(step, loss) for _, step, loss, _ in t["curve"] if loss is not None]
    assert training[-1][1] < min(loss for step, loss in training if step <= best_step)
    nothing_held_out = convert(cm.llama(), "poly3", overfitting_samples(), "transfer", **OVERFIT, holdout=0)
    assert nothing_held_out.held_out == 0 and nothing_held_out.error_held_out is None
    assert nothing_held_out.transfer["steps"] > t["steps"]


def test_the_kept_weights_are_those_of_a_transfer_run_only_to_its_best_check():
    """The reference: the same transfer given its best check's step as its cap and a patience it cannot run out
    of, so it trains exactly that far and nothing is restored. The early-stopped model must equal it, weight for
    weight, though it trained on past that check."""
    stopped = cm.llama()
    report = convert(stopped, "poly3", overfitting_samples(), "transfer", **OVERFIT)
    [best_step] = report.transfer["kept_steps"]
    assert 0 < best_step < report.transfer["steps"] and report.transfer["stopped"] == "held-out"
    reference = cm.llama()
    capped = convert(
        reference, "poly3", overfitting_samples(), "transfer", **{**OVERFIT, "steps": best_step, "patience": 10_000}
    )
    assert capped.transfer["steps"] == best_step and capped.transfer["kept_steps"] == [best_step]
    weights, expected = stopped.state_dict(), reference.state_dict()
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name
    assert report.error_held_out == capped.error_held_out and report.error_after == capped.error_after


def test_a_transfer_that_only_gets_worse_ends_where_it_started():
    """The closed-form start is the first check: at an lr that throws the first steps far off (0.3 with full
    deltas), no check beats it, the transfer stops after ``patience`` checks, and the start's weights are kept."""
    report = convert(cm.llama(), "poly3", overfitting_samples(), "transfer", **{**OVERFIT, "lr": 0.3})
    start, *checks = [held for _, _, _, held in report.transfer["curve"]]
    assert len(checks) == OVERFIT["patience"] and min(checks) > 10 * start
    assert report.transfer["kept_steps"] == [0] and report.transfer["stopped"] == "held-out"
    assert sum(report.error_held_out) == pytest.approx(start, rel=1e-4)


def test_too_few_held_out_samples_are_said_and_kept_in_the_report():
    samples = cm.token_samples()  # 12 samples: 3 held out
    with pytest.warns(
        UserWarning,
        match=rf"convert: only 3 of 12 samples held out \(holdout 0.25\), fewer than "
        rf"{MIN_HELD_OUT}: too few to judge .* give at least 32 samples",
    ):
        report = convert(cm.llama(), "poly3", samples, "transfer", steps=10)
    assert report.held_out == 3 and "only 3 of 12 samples held out" in report.warnings[0]
    assert "; 2 warnings: convert: only 3 of 12 samples held out" in report.summary()  # and the step cap's


def test_held_out_samples_that_repeat_training_ones_are_too_alike_to_judge():
    batch = cm.token_samples(batches=1, rows=10)[0]  # 4 copies: each held-out row is a training row of another
    with pytest.warns(UserWarning, match="convert: 10 of the 10 held-out samples repeat training samples: too alike"):
        report = convert(cm.llama(), "poly3", [batch] * 4, "transfer", steps=10)
    assert "repeat training samples" in report.warnings[0]
    # near-duplicate images (noise 1e-6 of their size) too; distinct ones are not
    images = cm.image_samples(16, batches=1, rows=10)
    noisy = [images[0] + 1e-6 * torch.randn_like(images[0]) for _ in range(3)]
    train, held_out = split(images + noisy, 0.25)
    assert repeated(train, held_out) == 10
    distinct = cm.image_samples(16, batches=4, rows=8)
    assert repeated(*split(distinct, 0.25)) == 0
    # tokens compare on the real ones only: the same sentence padded differently is the same sample
    ids = torch.randint(1, cm.VOCAB, (1, 6))
    short = {
        "input_ids": torch.cat([ids, torch.zeros(1, 2, dtype=torch.long)], 1),
        "attention_mask": torch.tensor([[1] * 6 + [0] * 2]),
    }
    assert repeated([{"input_ids": ids, "attention_mask": torch.ones(1, 6, dtype=torch.long)}], [short]) == 1


def overfit_bert(batches: int, holdout: float):
    """A BERT converted with full q/k deltas at a high lr on random tokens (nothing to generalise from): its layers
    fit the samples they train on and not the held-out ones."""
    samples = cm.token_samples(batches=batches, rows=8, padded=True)
    return convert(cm.bert(), "poly3", samples, "transfer", **{**OVERFIT, "steps": 300, "holdout": holdout})


def test_layers_that_fit_their_training_samples_far_better_than_the_held_out_ones_are_said():
    report = overfit_bert(batches=2, holdout=0.5)  # 8 trained on, 8 held out
    (trained, held) = (sum(errors) / 2 for errors in (report.error_after, report.error_held_out))  # 2 layers: medians
    assert held > GAP * trained and report.held_out == MIN_HELD_OUT
    assert report.warnings == [
        f"convert: the converted layers' median error is {held:.3g} on the held-out samples, {held / trained:.1f} "
        f"times the {trained:.3g} on those they trained on: too few or too alike samples for what the transfer "
        "trains (it fits them, not inputs it has not seen); give more, and more varied, samples"
    ]
    # the rule at its edge: more than GAP times, medians over the layers
    assert gap([0.1, 0.2, 0.3], [0.35, 0.4, 0.5]) == [] and len(gap([0.1, 0.2, 0.3], [0.05, 0.41, 0.5])) == 1
    # too few held out to judge: that is said, and not this, though their error is as far off (it is noise)
    few = overfit_bert(batches=1, holdout=0.5)
    assert sum(few.error_held_out) > GAP * sum(few.error_after)
    assert len(few.warnings) == 1 and few.warnings[0].startswith("convert: only 4 of 8 samples held out (holdout 0.5)")


#: A user's script: samples too few to judge, too alike to judge, too few to train on (its own process, so its
#: warnings print as they do for a user, not into pytest's record).
USER_SCRIPT = textwrap.dedent("""
    import conversion_models as cm
    from polyattn_lightning import convert

    convert(cm.llama(), "poly3", cm.token_samples(), "transfer", steps=10)
    convert(cm.llama(), "poly3", [cm.token_samples(batches=1, rows=10)[0]] * 4, "transfer", steps=10)
    convert(cm.bert(), "poly3", cm.token_samples(batches=2, rows=8, padded=True), "transfer", qk="full", lr=1e-2,
            steps=300, check_every=5, holdout=0.5)
""")


def test_the_warnings_print_as_one_line_each_saying_what_is_wrong_and_what_to_give():
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(cm.__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run([sys.executable, "-c", USER_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line.split(": ", 1)[1] for line in result.stderr.splitlines() if ": convert: " in line]
    assert said[:3] == [
        "convert: only 3 of 12 samples held out (holdout 0.25), fewer than 8: too few to judge the transfer on samples "
        "it has not seen (its stop and its held-out error are noise); give at least 32 samples",
        "convert: the transfer reached its step cap (steps 10) with its held-out error still falling; give more steps",
        "convert: 10 of the 10 held-out samples repeat training samples: too alike to judge the transfer on samples it "
        "has not seen (their error is the training error again); give distinct samples",
    ]  # the second step cap's is the same words from the same line: Python prints it once
    assert len(said) == 4 and re.fullmatch(
        r"convert: the converted layers' median error is 0\.\d+ on the held-out samples, \d+\.\d times the 0\.\d+ on "
        r"those they trained on: too few or too alike samples for what the transfer trains \(it fits them, not inputs "
        r"it has not seen\); give more, and more varied, samples",
        said[3],
    )
    assert "Traceback" not in result.stderr


def test_distinct_samples_enough_to_judge_give_no_warning(recwarn):
    report = convert(cm.llama(), "poly3", cm.token_samples(batches=4, rows=8), "transfer", steps=10)
    capped = (
        "convert: the transfer reached its step cap (steps 10) with its held-out error still falling; give more steps"
    )
    said = [str(w.message) for w in recwarn if "convert:" in str(w.message)]
    assert report.held_out == 8 and said == [capped] == report.warnings


def test_both_errors_are_in_the_report_its_summary_json_and_figure(tmp_path):
    report = convert(cm.bert(), "poly3", cm.token_samples(batches=4, rows=8, padded=True), "transfer", steps=20)
    assert len(report.error_held_out) == len(report.error_after) == 2 and report.held_out == 8
    assert all(0 < e < 1 for e in report.error_held_out)
    summary = report.summary()
    assert "on 24 training samples" in summary and "on 8 held out" in summary
    data, figure = report.write(tmp_path)
    saved = json.loads(data.read_text())
    assert saved["error_held_out"] == report.error_held_out and saved["held_out"] == 8
    assert saved["transfer"]["curve"][0][:3] == [0, 0, None] and saved["warnings"] == report.warnings
    assert ConversionReport.from_dict(saved) == report
    assert figure.read_bytes()[:4] == b"\x89PNG"
    # a report saved before held-out samples existed still loads (a checkpoint's)
    old = {k: v for k, v in saved.items() if k not in ("held_out", "error_held_out", "warnings")}
    assert ConversionReport.from_dict(old).error_held_out is None


def transfer_lines(monkeypatch, caplog, seconds: float) -> list[str]:
    """The lines a two-layer transfer logs (the log, not only stderr), a chunk of one layer at a time, with
    ``PROGRESS_SECONDS`` at ``seconds``."""
    monkeypatch.setattr(transfer, "PROGRESS_SECONDS", seconds)
    samples = cm.token_samples(batches=4, rows=8)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        convert(cm.llama(), "poly3", samples, "transfer", steps=12, check_every=5, layers_per_pass=1)
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith("convert transfer")]


def test_progress_lines_name_the_layers_step_and_both_errors(monkeypatch, caplog):
    lines = transfer_lines(monkeypatch, caplog, 0.0)
    assert lines[0] == (
        "convert transfer: 2 layers on 24 samples, stopping on the layer error of 8 held out, "
        "checked every 5 steps, at most 12 steps"
    )
    steps = [line for line in lines if line.startswith("convert transfer: layer 2 of 2, step 7 ")]
    assert steps and "at step 5: training error" in steps[0] and ", held-out " in steps[0]
    assert any(line.startswith("convert transfer: layer 1 of 2 stopped at step 12 (the step cap") for line in lines)
    # every pass over the samples before and after the training is named too
    for phase in (
        "the closed-form start of each head's factor",
        "the layer errors at that start",
        "layer 2 of 2: the held-out error at the start",
        "the converted layers' errors on the training and held-out samples",
    ):
        assert f"convert transfer: {phase}" in lines


def test_the_lines_between_checks_come_only_when_the_last_is_progress_seconds_old(monkeypatch, caplog):
    lines = transfer_lines(monkeypatch, caplog, 3600.0)
    assert len(lines) == 3 and lines[0].startswith("convert transfer: 2 layers on 24 samples")
    assert [line.split(" stopped")[0] for line in lines[1:]] == [
        "convert transfer: layer 1 of 2",
        "convert transfer: layer 2 of 2",
    ]


def test_the_lines_reach_the_run_log_layer_by_layer(monkeypatch, tmp_path):
    """Under the CLI the transfer runs inside ``fit`` (the convert step), where ``run.log`` receives Lightning's
    logger: its lines are in that file, in order."""
    monkeypatch.setattr(transfer, "PROGRESS_SECONDS", 0.0)
    samples = cm.token_samples(batches=4, rows=8)
    with run_log(tmp_path) as path:
        convert(cm.llama(), "poly3", samples, "transfer", steps=12, check_every=5, layers_per_pass=1)
    lines = [line.split(" INFO ", 1)[1] for line in path.read_text().splitlines() if " INFO convert transfer" in line]
    assert lines[0].startswith("convert transfer: 2 layers on 24 samples")
    stops = [i for i, line in enumerate(lines) if re.match(r"convert transfer: layer \d of 2 stopped at step", line)]
    assert [lines[i].split(" of 2")[0] for i in stops] == ["convert transfer: layer 1", "convert transfer: layer 2"]
    first = [i for i, line in enumerate(lines) if line.startswith("convert transfer: layer 1 of 2, step ")]
    second = [i for i, line in enumerate(lines) if line.startswith("convert transfer: layer 2 of 2, step ")]
    assert first and second and max(first) < stops[0] < min(second) <= max(second) < stops[1]
