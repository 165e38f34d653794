"""What every benchmark command shares: round-robin timing, peak step memory, the machine record and the
``--json`` report file.

One module for these so that the commands time, measure, describe the machine and write their reports the
same way, and no command imports another command.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


#: A log level of libkineto (torch.profiler's) above all of its levels: none of its lines. On a machine without a
#: GPU, a CUDA build of torch (what ``pip install torch`` gives on Linux) prints ``gpuGetDeviceCount failed`` as an
#: ERROR line, and a ``profiler_start`` / ``profiler_stop`` pair, at every CPU profile; nothing is wrong.
KINETO_SILENT = "6"


def interleaved(steps: dict[str, Callable[[int], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each step, after one warm-up call each, the steps run round-robin.

    Each round starts one step later (a, b, c; b, c, a; ...): in a fixed order a step's time carries
    what the step before it left behind (caches, allocator state), measured as a steady few percent for
    the last of three EVA02-S training steps (docs/benchmarks/training.md). Repeats that are a multiple of the number of
    steps give each position to every step equally often. Each step gets the repeat's number (0 for the
    warm-up), e.g. to seed its RNG the same way as the other steps of that round.
    """
    for step in steps.values():
        step(0)
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name](r + 1)
            times[name].append(time.perf_counter() - start)
    return times


def step_peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``step()`` runs, above the allocation level before it.

    On CUDA the caching allocator's own counters; on CPU the allocator events of a
    ``torch.profiler`` run replayed in time order (unlike RSS, independent of what the C
    allocator caches), with the profiler's lines about the missing GPU silenced (:data:`KINETO_SILENT`).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if not torch.cuda.is_available():  # read as the profiler starts; a level set in the environment is kept
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    level = peak = 0
    for event in events:
        level += event.nbytes()
        peak = max(peak, level)
    return peak


def machine(load_before: tuple[float, float, float], device: str = "cpu") -> dict:
    """The machine a result was measured on, with the load average before the run and now (after it).

    Every command writes this under ``"machine"``: the load says how far a shared machine's
    times are from a quiet one's.
    """
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "load_average_before": tuple(load_before),
        "load_average_after": os.getloadavg(),
    }


def write_report(report: dict, path: str | os.PathLike | None) -> None:
    """A command's ``--json``: ``report`` as indented JSON at ``path`` (its folder made); nothing when None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))


def write_table_rows(path: str | os.PathLike, device_key: str, rows: list[dict], **fields) -> None:
    """Merge measured crossover ``rows`` (``{p, d, causal, mode, n}``) into ``device_key``'s entry of the
    crossover table at ``path`` (``kernels/base/costs.py`` reads it), replacing rows of the same key, and mark the
    entry measured; ``fields`` (``quadratic_seconds``, ``command``, ``load``) are recorded with it (``command`` and
    ``load`` per writing command, under ``measured_by``)."""
    path = Path(path)
    table = json.loads(path.read_text()) if path.exists() else {"devices": {}}
    entry = table["devices"].setdefault(device_key, {"crossover": []})
    entry["measured"] = True
    if "quadratic_seconds" in fields:
        entry["quadratic_seconds"] = fields.pop("quadratic_seconds")
    entry.setdefault("measured_by", []).append(fields)
    key = lambda row: (row["mode"], row["causal"], row["p"], row["d"])  # noqa: E731
    merged = {key(row): row for row in entry["crossover"]}
    merged.update({key(row): row for row in rows})
    entry["crossover"] = [merged[k] for k in sorted(merged, key=lambda k: (k[0], k[1], k[2], k[3]))]
    path.write_text(json.dumps(table, indent=1) + "\n")


def crossing(lengths: list[int], ratios: list[float]) -> float | None:
    """The length from which ``ratio = linear / quadratic`` stays below 1, log-log interpolated; None: never."""
    if not ratios or ratios[-1] >= 1:
        return None
    i = len(ratios) - 1
    while i > 0 and ratios[i - 1] < 1:
        i -= 1
    if i == 0:
        return float(lengths[0])  # faster from the shortest length measured
    x0, x1 = math.log(lengths[i - 1]), math.log(lengths[i])
    y0, y1 = math.log(ratios[i - 1]), math.log(ratios[i])
    return math.exp(x0 + (0 - y0) * (x1 - x0) / (y1 - y0))
