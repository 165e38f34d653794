"""No silent wait: each long wait's lines, read from the log file the CLI writes (``run.log``) and from the output.

The C++ kernel build is faked slow (its loader sleeps: a real compiler cannot be made slow on demand), the
generators are slowed per image or expression, a fit's step by a callback that sleeps; the intervals are set small.
The tests assert which lines appear, what they say and in which order, never how long anything took.
"""

from __future__ import annotations

import io
import re
import sys
import time
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_ctrl_c import RUNS, SHORT
from test_first_hour import CLASSES, MODEL_KWARGS, assert_short_error, project, run, write_folder  # noqa: F401

from polyattn_lightning import waits
from polyattn_lightning.attention.kernels.base import cpp
from polyattn_lightning.cli.run_log import RUN_LOG, kept_for_run_log, run_log
from polyattn_lightning.data.image_folder import ImageFolderDataModule
from polyattn_lightning.data.lra import listops, snakes
from polyattn_lightning.tasks.classification import ClassificationModule

#: a line of run.log: its date, time, level and text
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR) (.*)$")
#: the status of counted work: ``what: done/total unit (percent%)[, rate/s, about T left] (T so far)``
COUNTED = r"(\d+)/{total} {unit} \([\d.]+%\)(, [\d.e+]+/s, about [\d.]+ (s|min|h) left)? \([\d.]+ (s|min|h) so far\)"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def messages(path: Path) -> list[str]:
    """The texts of a run.log's records, in order (every line a record: date, time, level, text)."""
    lines = path.read_text().splitlines()
    assert all(LOG_LINE.match(line) for line in lines), lines
    return [LOG_LINE.match(line)[2] for line in lines]


@pytest.fixture
def fast_waits(monkeypatch):
    """Status lines every 0.05 s in the log, in-place updates every 0.02 s, an estimate for any counted work."""
    monkeypatch.setattr(waits, "LOG_SECONDS", 0.05)
    monkeypatch.setattr(waits, "TERMINAL_SECONDS", 0.02)
    monkeypatch.setattr(waits, "ESTIMATE_ABOVE", 0.0)


def until_logged(path: Path, text: str) -> None:
    """Return once ``text`` is in the log file ``path`` (the work of a slowed wait lasts until its line is out)."""
    deadline = time.monotonic() + 120
    while not (path.is_file() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{text!r} never reached {path}"
        time.sleep(0.01)


def test_a_wait_that_is_often_short_says_nothing_when_short_and_once_it_lasts_what_it_does(tmp_path, monkeypatch,
                                                                                            fast_waits, capsys):
    with run_log(tmp_path / "run") as log_file:
        with waits.Wait("short", after=60):
            pass
        with waits.Wait("long", why="it takes time", after=0.05):
            until_logged(log_file, "long: it takes time")
    lines = messages(log_file)
    assert re.fullmatch(r"long: it takes time \(for [\d.]+ s so far\)", lines[0]), lines
    assert re.fullmatch(r"long: done in [\d.]+ s", lines[-1]) and not any("short" in line for line in lines)
    assert capsys.readouterr().err.splitlines() == lines


def test_what_is_said_before_the_run_folder_is_known_opens_its_run_log_in_order(tmp_path, fast_waits, capsys):
    with kept_for_run_log() as earlier:  # as the CLI builds the model before the trainer names the run's folder
        with waits.Wait("building", after=0.0):
            pass
    with run_log(tmp_path / "run", earlier) as log_file:
        waits.say("fit: writing logs")
    lines = messages(log_file)
    assert lines[0] == "building" and re.fullmatch(r"building: done in [\d.]+ s", lines[1]), lines
    assert lines[2:] == ["fit: writing logs"]
    assert [record.getMessage() for record in earlier] == lines[:2]


def test_indexing_an_image_folder_and_building_a_model_say_so_once_they_last(tmp_path, monkeypatch, fast_waits):
    monkeypatch.setattr(waits, "QUIET_SECONDS", 0.05)
    root = write_folder(tmp_path / "imgs")
    log_file = tmp_path / "run" / RUN_LOG
    find_samples, build = ImageFolderDataModule.find_samples, ClassificationModule.build
    indexing, building = f"ImageFolderDataModule: indexing the images under {root}", "ClassificationModule: building"

    def slow_find_samples(self, folder):
        until_logged(log_file, indexing)
        return find_samples(self, folder)

    def slow_build(self):
        until_logged(log_file, building)
        return build(self)

    monkeypatch.setattr(ImageFolderDataModule, "find_samples", slow_find_samples)
    monkeypatch.setattr(ClassificationModule, "build", slow_build)
    with run_log(log_file.parent):
        data = ImageFolderDataModule(root=str(root), img_size=16, batch_size=4, num_workers=0)
        data.setup("fit")
        model = ClassificationModule(model_name="vit_tiny_patch16_224", num_classes=3, img_size=16,
                                     model_kwargs=MODEL_KWARGS, attention="poly3")
    assert data.classes == list(CLASSES) and len(data.train_set) == 12 and model.built
    lines = [line for line in messages(log_file) if line.startswith((indexing, building))]
    for what in (indexing, building):
        said = [line.removeprefix(what) for line in lines if line.startswith(what)]
        assert re.fullmatch(r".* \(for [\d.]+ s so far\)", said[0]) and re.fullmatch(r".*: done in [\d.]+ s", said[-1])
    assert lines[0].startswith(indexing) and lines[-1].startswith(building), lines


def test_kernel_build_says_why_elapsed_in_place_and_in_the_log_then_how_long(tmp_path, monkeypatch, fast_waits):
    real = cpp._import_cpp_extension()
    loads = []

    def slow_load(**kwargs):
        time.sleep(0.4)
        loads.append(kwargs["name"])

    fake = types.SimpleNamespace(
        include_paths=real.include_paths,
        _get_build_directory=lambda name, verbose: str(tmp_path / "build" / name),
        load=slow_load,
    )
    monkeypatch.setattr(cpp, "_import_cpp_extension", lambda: fake)
    monkeypatch.setattr(cpp, "_loaded", {})  # this process's real build stays loaded and unchanged
    monkeypatch.setattr(cpp, "_register_fakes", lambda: None)
    monkeypatch.setenv("PATH", str(tmp_path))  # so ninja's folder is put on it, and PATH restored afterwards
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with run_log(tmp_path / "run") as log_file:
        directory = cpp.build()
        (directory / f"{loads[0]}.so").touch()
        cpp.build()  # built: no word
    assert len(loads) == 2

    what = "compiling the C++ attention kernels for this CPU"
    said = re.escape(what)
    lines = messages(log_file)
    assert lines[0] == (
        f"{what}: gcc compiles 3 sources against torch's headers: about 15 s, minutes when the CPU is busy (once per "
        f"environment; cached in {directory})"
    )
    assert re.fullmatch(rf"{said}: done in [\d.]+ s", lines[-1])
    ticks = lines[1:-1]
    assert len(ticks) >= 2 and all(re.fullmatch(rf"{said}: [\d.]+ s so far", line) for line in ticks), lines
    # on the terminal: the first and last lines as lines, the elapsed time rewritten in place between them
    shown = terminal.getvalue()
    assert shown.startswith(lines[0] + "\n")
    assert shown.endswith("\r\033[K" + lines[-1] + "\n")
    assert re.search(rf"\r\033\[K{said}: [\d.]+ s so far\r\033\[K{said}: [\d.]+ s so far", shown)
    assert "so far\n" not in shown


def test_pathfinder_generation_estimates_first_then_counts_rate_and_time_left(tmp_path, monkeypatch, fast_waits,
                                                                                capsys):
    draw = snakes.draw_image

    def slow_draw(*args, **kwargs):
        time.sleep(0.02)
        return draw(*args, **kwargs)

    monkeypatch.setattr(snakes, "draw_image", slow_draw)
    spec = snakes.PathfinderSpec(num_images=12, images_per_folder=2)
    with run_log(tmp_path / "run") as log_file:
        root = snakes.write_dataset(spec, tmp_path / "pf", resolution=32, progress=True)
    assert len(list((root / "pathfinder32" / "curv_contour_length_14" / "imgs").rglob("*.png"))) == 12

    what = "drawing 12 pathfinder32 images"
    lines = messages(log_file)
    assert lines[0] == what
    assert re.fullmatch(rf"{what}: expected to take about [\d.]+ s \(one image took [\d.e-]+ s; 1 worker process\)",
                        lines[1]), lines
    assert re.fullmatch(rf"{what}: done in [\d.]+ s", lines[-1])
    counts = [re.fullmatch(rf"{what}: " + COUNTED.format(total=12, unit="images"), line) for line in lines[2:-1]]
    assert len(counts) >= 2 and all(counts), lines
    done = [int(match[1]) for match in counts]
    assert done == sorted(done) and done[-1] <= 12 and any(match[2] for match in counts)  # a rate once one is done
    assert capsys.readouterr().err.splitlines() == lines  # stderr is no terminal here: the same lines


def test_listops_generation_says_its_estimate_from_its_first_rate_then_counts(tmp_path, monkeypatch, fast_waits):
    tree = listops._tree

    def slow_tree(rng, depth, spec):
        if depth == 1:
            time.sleep(0.002)
        return tree(rng, depth, spec)

    monkeypatch.setattr(listops, "_tree", slow_tree)
    spec = listops.ListOpsSpec(num_train=40, num_val=5, num_test=5, min_length=5, max_length=60)
    with run_log(tmp_path / "run") as log_file:
        listops.write_dataset(spec, tmp_path / "lo")
    what = "drawing 50 ListOps expressions"
    lines = messages(log_file)
    assert lines[0] == what and re.fullmatch(rf"{what}: done in [\d.]+ s", lines[-1])
    [estimate] = [index for index, line in enumerate(lines) if "expected to take" in line]
    assert re.fullmatch(rf"{what}: expected to take about [\d.]+ s \(at the rate of the first \d+\)", lines[estimate])
    counts = [re.fullmatch(rf"{what}: " + COUNTED.format(total=50, unit="expressions"), line)
              for line in lines[1:-1] if "expected" not in line]
    assert counts and all(counts), lines
    assert [int(m[1]) for m in counts] == sorted(int(m[1]) for m in counts)


def train_losses(run_dir: Path) -> dict[int, float]:
    """The ``train/loss`` TensorBoard holds, by the optimizer steps done after it (Lightning logs at the step
    before)."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {event.step + 1: event.value for event in events.Scalars("train/loss")}


def test_fit_without_a_bar_says_steps_and_a_heartbeat_in_run_log_and_output_and_appends_on_resume(project):  # noqa: F811
    lines_every = ["--progress_lines.every_n_steps", "2", "--progress_lines.every_seconds", "1000",
                   "--progress_lines.heartbeat_seconds", "0.2", "--trainer.log_every_n_steps", "1"]
    slow = '--trainer.callbacks+={"class_path": "training_helpers.SlowStep", "init_args": {"step": 5, "seconds": 1}}'
    fit = ["fit", "--config", "folder.yaml", *SHORT, *lines_every]
    last = str(RUNS / "version_0/checkpoints/last.ckpt")
    bad = ["fit", "--config", "folder.yaml", "--progress_lines.every_n_steps", "0",
           "--progress_lines.every_seconds", "-1"]
    first, resumed, refused = run(project, [*fit, slow], [*fit, "--trainer.max_epochs", "4", "--ckpt_path", last], bad)
    assert first["rc"] == 0 and resumed["rc"] == 0, first["output"] + resumed["output"]
    assert_short_error(refused, "progress_lines: every_n_steps must be >= 1, every_seconds and heartbeat_seconds > 0; "
                       "got every_n_steps=0, every_seconds=-1.0")
    run_dir = project / RUNS / "version_0"
    lines = messages(run_dir / RUN_LOG)
    step_line = re.compile(r"train: step (\d+)/(\d+) \(epoch (\d+)\), loss ([\d.e+-]+), [\d.e+]+ steps/s, "
                           r"about [\d.]+ (s|min|h) left")
    steps = [(index, step_line.fullmatch(line)) for index, line in enumerate(lines) if step_line.fullmatch(line)]
    assert [(int(m[1]), int(m[2]), int(m[3])) for _, m in steps] == [
        (2, 9, 0), (4, 9, 1), (6, 9, 1), (8, 9, 2),  # 3 steps an epoch, a line every 2 steps
        (11, 12, 3)]  # resumed at step 9: its first line 2 steps later, of the new total
    losses = train_losses(run_dir)
    for _, match in steps:
        assert float(match[4]) == pytest.approx(losses[int(match[1])], rel=1e-3)

    beats = [index for index, line in enumerate(lines) if "running for" in line]
    assert all(re.fullmatch(r"train: (step \d+|validation after step \d+) running for [\d.]+ (s|min)", lines[index])
               for index in beats), [lines[index] for index in beats]
    step_5 = [index for index in beats if lines[index].startswith("train: step 5 running for")]
    assert step_5 and all(steps[1][0] < index < steps[2][0] for index in step_5)  # between the lines of steps 4 and 6

    # Lightning's and the project's info lines, the first run's then the resumed one's
    where = [lines.index(line) for line in lines if line.startswith("fit: ")]
    assert lines[where[0]] == f"fit: writing logs, config and checkpoints/ to {RUNS / 'version_0'}"
    assert lines[where[1]].startswith(f"fit: resuming {last}")
    # what building the trainer said before the run's folder was known comes first, as on the terminal
    assert lines[:where[0]] == ["GPU available: False, used: False", "TPU available: False, using: 0 TPU cores"]
    assert first["output"].index(lines[0]) < first["output"].index(lines[where[0]])
    assert where[0] < steps[0][0] < steps[3][0] < where[1] < steps[4][0]
    assert "`Trainer.fit` stopped: `max_epochs=3` reached." in lines[steps[3][0]:where[1]]
    assert "`Trainer.fit` stopped: `max_epochs=4` reached." in lines[where[1]:]
    # the terminal (here, a pipe) says the same lines
    for index, _ in steps[:4]:
        assert lines[index] in first["output"]
    assert lines[step_5[0]] in first["output"]
