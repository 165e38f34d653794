"""A cell's process for the launcher's tests, scripted by its first argument: ``finish`` (write a finished
``metrics.json``), ``fail`` (print lines, exit 3), ``train`` (write a checkpoint, say ``ready``; on SIGINT write an
interrupted ``metrics.json`` and exit 130, as the project's StopOnSignal does), ``stubborn`` (as ``train``, but a
first SIGINT is only noted). It runs in its cell's folder (argument 2) and records what it saw in ``seen.json``.

The real fit is what the end-to-end tests run; this one makes the launcher's bookkeeping fast to test and lets a
test hold a cell in a known state."""
import json
import os
import signal
import sys
import time
import zipfile
from pathlib import Path

mode, folder, running = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])


def write_metrics(status: str) -> None:
    (folder / "metrics.json").write_text(json.dumps({"schema": 1, "status": status, "steps": 1}))


if mode == "fail":
    for index in range(20):
        print(f"fail line {index}")
    sys.exit(3)

mine = running / str(os.getpid())
mine.touch()
seen = 1
deadline = time.monotonic() + 20
while mode == "finish" and time.monotonic() < deadline:  # wait for a second cell to run beside this one
    seen = max(seen, len(list(running.iterdir())))
    if seen >= 2:
        break
    time.sleep(0.05)
(folder / "seen.json").write_text(json.dumps({"beside": seen, "threads": os.environ.get("OMP_NUM_THREADS")}))
if mode == "finish":
    time.sleep(0.3)
    mine.unlink()
    write_metrics("finished")
    sys.exit(0)

sigints = []
signal.signal(signal.SIGINT, lambda *_: sigints.append(1))
(folder / "checkpoints").mkdir(exist_ok=True)
with zipfile.ZipFile(folder / "checkpoints" / "last.ckpt", "w") as archive:
    archive.writestr("data.pkl", b"state")
print("ready", flush=True)
while len(sigints) < (2 if mode == "stubborn" else 1):
    time.sleep(0.05)
write_metrics("interrupted")
sys.exit(130)
