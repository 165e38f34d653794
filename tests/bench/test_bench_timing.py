"""bench/timing.py: the helpers every benchmark command times, measures and records the machine with."""
import json
import os
import subprocess
import sys

import torch

from polyattn_lightning.bench.timing import interleaved, machine, step_peak_bytes


def test_interleaved_warms_up_then_runs_round_robin_starting_one_later_each_round():
    calls = []
    steps = {name: (lambda r, name=name: calls.append((name, r))) for name in "abc"}
    times = interleaved(steps, repeats=3)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1), ("b", 2), ("c", 2), ("a", 2),
                     ("c", 3), ("a", 3), ("b", 3)]
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for samples in times.values() for t in samples)


def test_step_peak_bytes_counts_what_the_step_allocates_above_the_level_before():
    held = torch.zeros(1 << 20)  # allocated before the step: not counted
    size = 4 * (1 << 18)
    peak = step_peak_bytes(lambda: torch.ones(1 << 18) + 1, torch.device("cpu"))  # two 1 MiB tensors live at once
    assert 2 * size <= peak < 3 * size
    del held


def test_a_cpu_memory_profile_prints_nothing_about_a_missing_gpu():
    """A CUDA build of torch without a GPU (as here) printed ``gpuGetDeviceCount failed`` at every CPU profile."""
    code = ("import torch; from polyattn_lightning.bench.timing import step_peak_bytes; "
            "print(step_peak_bytes(lambda: torch.ones(1 << 18) + 1, torch.device('cpu')))")
    env = {key: value for key, value in os.environ.items() if key != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.splitlines()[-1]) >= 2 * 4 * (1 << 18)  # the profile still ran
    assert "gpuGetDeviceCount" not in done.stderr and "profiler_start" not in done.stderr, done.stderr


def test_machine_records_the_load_before_and_after_under_one_key_pair():
    before = os.getloadavg()
    record = json.loads(json.dumps(machine(before)))
    assert record["load_average_before"] == list(before)
    assert len(record["load_average_after"]) == 3
    assert record["cpu_count"] == os.cpu_count() and record["device"] == "cpu"
