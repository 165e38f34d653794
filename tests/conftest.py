"""Shared fixtures: tiny image data sets written to disk as real JPEG files; a private SLURM on localhost."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from slurm_cluster import SlurmCluster, SlurmUnavailable, unavailable_reason
from training_helpers import write_jpeg


def pytest_collection_modifyitems(config, items):
    """Tests marked ``docker`` (a multi-GB image build) run only when ``-m`` names them: ``pytest -m docker``."""
    if "docker" in (config.option.markexpr or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("docker")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("docker")]


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The test models are tiny: a second intra-op thread buys nothing, and on shared cores it spin-waits (30x slower).

    Session-wide, so it is set before any module-scoped fixture runs: a reference run computed with two threads
    and compared bit for bit with a resumed run on one thread differs in the last float bits (reduction order).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CLASSES = ("n01443537", "n01629819", "n01641577")  # Tiny-ImageNet style wnids, also used as folder names


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """ImageNet-style ``train/<class>/*.JPEG`` (4 per class) and ``val/<class>/*.JPEG`` (2 per class)."""
    root = tmp_path / "imagenet"
    for label, name in enumerate(CLASSES):
        for i in range(4):
            write_jpeg(root / "train" / name / f"{name}_{i}.JPEG", seed=10 * label + i)
        for i in range(2):
            write_jpeg(root / "val" / name / f"ILSVRC2012_val_{label}{i}.JPEG", seed=100 + 10 * label + i)
    return root


@pytest.fixture
def tiny_imagenet(tmp_path: Path) -> Path:
    """Tiny-ImageNet's layout: wnids.txt, train/<wnid>/images/*.JPEG, val/images + val_annotations.txt."""
    root = tmp_path / "tiny-imagenet-200"
    root.mkdir()
    (root / "wnids.txt").write_text("\n".join(reversed(CLASSES)) + "\n")  # not sorted, as in the real file
    annotations = []
    for label, wnid in enumerate(CLASSES):
        for i in range(4):
            write_jpeg(root / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", seed=10 * label + i, size=64)
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
        for i in range(2):
            name = f"val_{2 * label + i}.JPEG"
            write_jpeg(root / "val" / "images" / name, seed=100 + 10 * label + i, size=64)
            annotations.append(f"{name}\t{wnid}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(annotations) + "\n")
    return root


@pytest.fixture(autouse=True)
def logging_left_as_found():
    """A test (or the code it calls in-process) must leave every logger's level as it found it: a command that
    silenced Lightning or transformers for the rest of the process made later tests miss the lines they check."""
    import logging

    def levels() -> dict[str, int]:
        return {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
                if isinstance(logger, logging.Logger)}

    before = levels()
    yield
    changed = {name: (level, before[name]) for name, level in levels().items() if name in before and before[name] != level}
    assert not changed, f"logger levels changed and not restored (now, before): {changed}"


@pytest.fixture(scope="session")
def slurm_cluster(request, tmp_path_factory):
    """A private SLURM on localhost, started on first use and stopped at the session's end
    (tests/cluster/slurm_cluster.py). Where none can run, the test skips with one line saying why (fails with
    ``POLYATTN_REQUIRE_SLURM=1``, as in CI)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def say(line: str) -> None:  # on the terminal while the test's output is captured
        with capture.global_and_fixture_disabled():
            print(f"\n{line}", file=sys.stderr, flush=True)

    def cannot_run(reason: str) -> None:
        if os.environ.get("POLYATTN_REQUIRE_SLURM") == "1":
            pytest.fail(f"POLYATTN_REQUIRE_SLURM=1, but no private SLURM: {reason}", pytrace=False)
        pytest.skip(f"no private SLURM: {reason}")

    reason = unavailable_reason()
    if reason:
        cannot_run(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), say)
    try:
        cluster.start()
    except SlurmUnavailable as error:
        cluster.stop()
        cannot_run(str(error))
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm(slurm_cluster, monkeypatch):
    """The private SLURM, with its client settings (``SLURM_CONF``, ``PATH``, ``PYTHONPATH``) in ``os.environ`` for
    this test, as in-process submitters (submitit) and the commands a test starts need them."""
    wanted = slurm_cluster.environ()
    for name in set(os.environ) - set(wanted):
        monkeypatch.delenv(name)
    for name, value in wanted.items():
        monkeypatch.setenv(name, value)
    return slurm_cluster
