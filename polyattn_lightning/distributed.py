"""``torch.distributed`` plumbing: orderly teardown before the interpreter exits, and gathering Python objects.

A process that ends with its process group alive leaves the backend's threads
running into interpreter finalisation. With gloo, a worker thread that drops the
last reference to a finished collective (it holds a tensor owned by Python) then
needs the GIL; CPython ends the thread with ``pthread_exit``, whose forced unwind
through a ``noexcept`` C++ frame calls ``std::terminate``: the run did all its
work and still dies with SIGABRT (about 1 in 4 two-process CPU runs). Lightning
destroys the process group at exit only for NCCL. :func:`distributed_teardown`
wraps every process this project starts (``cli.main``, the test workers) and does
it for every backend; it only imports torch, so any entry point can use it.

:func:`gather_objects` is the one place where code outside Lightning's strategies gathers picklable
values from every rank (RNG states for checkpoints, detections for the COCO metric).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist


def teardown_process_group(wait: bool = True) -> None:
    """Finish pending collectives (``wait``), then ``destroy_process_group()``; nothing without a process group.

    ``wait`` is a barrier (NCCL: on this rank's device, then a CUDA synchronize): after it no
    collective of this rank is still running on a backend thread. A failed rank skips it, since its
    peers may be inside another collective; destroying the group closes its connections, so they
    fail at once instead of waiting out the timeout. Ctrl-C is ignored meanwhile, as Lightning does.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        if wait:
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
    finally:
        try:
            dist.destroy_process_group()
        finally:
            if in_main_thread:
                signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def distributed_teardown() -> Iterator[None]:
    """Run the body, then tear down the process group it may have started: after a barrier if it
    succeeded, without one if it raised (also ``KeyboardInterrupt``, and the ``SystemExit`` Lightning
    raises after an interrupt). Exactly one ``destroy_process_group()`` per rank."""
    try:
        yield
    except BaseException:
        teardown_process_group(wait=False)
        raise
    teardown_process_group(wait=True)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable) in rank order, on every rank; ``[obj]`` without a process group of 2+."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts
