"""Long waits that talk: the project's rule that every wait longer than ten seconds says what it is doing when it
starts, then at least every :data:`LOG_SECONDS` seconds, on the terminal and in the run's log file.

A :class:`Wait` (``with Wait("compiling ...", why="...") as wait:``) says its first line at once, then, from a
timer thread (a single long call such as a compiler run never returns to say anything itself): on a terminal, the
elapsed time (and the count done, its rate and the time left, where the work is counted with :meth:`Wait.add`)
rewritten in place every second; in the log, and on a stderr that is not a terminal, that status as a line every
:data:`LOG_SECONDS` seconds; at the end, ``done in N s`` (or ``failed after N s``). Counted work expected to take
longer than :data:`ESTIMATE_ABOVE` seconds says so before most of it runs: from its first second's rate, or from a
measurement the caller gives (:meth:`Wait.estimate`). A wait that is often short (indexing a folder, building a
model) waits ``after`` seconds before its first line: one over by then says it, with how long it has run; one done
earlier says nothing.

Lines go to stderr and to the logger ``polyattn_lightning.waits``, whose records reach the run's ``run.log`` where
the CLI added it (:mod:`polyattn_lightning.cli.run_log`). Only the process of rank 0 talks.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, TextIO

from lightning.fabric.utilities.rank_zero import rank_zero_only

log = logging.getLogger(__name__)

#: Seconds between two status lines of a wait in the log (and on a stderr that is not a terminal).
LOG_SECONDS = 10.0
#: Seconds between two in-place updates of the status on a terminal.
TERMINAL_SECONDS = 1.0
#: Counted work expected to take longer than this many seconds says its estimate first.
ESTIMATE_ABOVE = 60.0
#: Seconds a wait that is often short (indexing a folder, building a model) stays quiet: its ``after``.
QUIET_SECONDS = 2.0


def talks() -> bool:
    """Whether this process says progress lines: rank 0 (or no distributed run)."""
    return getattr(rank_zero_only, "rank", 0) == 0


def say(line: str, stream: TextIO | None = None, terminal: bool = True) -> None:
    """``line`` on ``stream`` (stderr; ``terminal=False``: not there) and in the log, from rank 0 only."""
    if not talks():
        return
    if terminal:
        stream = stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()
    log.info(line)


def duration(seconds: float) -> str:
    """``42 s``, ``3.5 min``, ``1.2 h``: a duration as a person reads it."""
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Ticker:
    """Calls ``tick`` every ``interval`` seconds from a daemon thread, between :meth:`start` and :meth:`stop`."""

    def __init__(self, interval: float, tick: Callable[[], None], name: str = "polyattn-ticker"):
        self.interval, self.tick = interval, tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def start(self) -> Ticker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


class Wait:
    """One long wait and what it says (the module docstring): ``what`` it is, ``why`` it takes time (said in the
    first line), and for counted work its ``total`` in ``unit`` (``images``, ``expressions``); ``log_seconds``
    between two status lines in the log (None: :data:`LOG_SECONDS`); ``after``: seconds before the first line (0: at
    once; a wait over sooner says nothing)."""

    def __init__(
        self,
        what: str,
        why: str = "",
        total: int | None = None,
        unit: str = "",
        log_seconds: float | None = None,
        stream: TextIO | None = None,
        after: float = 0.0,
    ):
        self.what, self.why, self.total, self.unit = what, why, total, unit
        self.log_seconds, self.stream = LOG_SECONDS if log_seconds is None else log_seconds, stream or sys.stderr
        self.terminal = is_terminal(self.stream)
        self.count, self.estimated, self.shown = 0, False, False  # shown: a status in place on the terminal
        self.after, self.said = after, False  # said: the first line is out
        self._lock = threading.Lock()
        self._ticker: Ticker | None = None
        self.start = self.last_line = time.perf_counter()

    def add(self, done: int = 1) -> None:
        """``done`` more of the ``total`` done."""
        with self._lock:
            self.count += done

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def status(self) -> str:
        """``elapsed 42 s``, or for counted work ``1200/200000 images (0.6%), 95/s, about 35 min left``."""
        elapsed = self.elapsed()
        if self.total is None:
            return f"{self.what}: {duration(elapsed)} so far"
        count, rate = self.count, self.count / elapsed if elapsed > 0 else 0.0
        text = f"{self.what}: {count}/{self.total} {self.unit} ({100 * count / max(self.total, 1):.1f}%)"
        if rate > 0:
            text += f", {rate:.3g}/s, about {duration((self.total - count) / rate)} left"
        return text + f" ({duration(elapsed)} so far)"

    def estimate(self, seconds: float, basis: str) -> None:
        """Say that the whole wait takes about ``seconds`` (``basis``: what that comes from), where that is more
        than :data:`ESTIMATE_ABOVE`; once."""
        if self.estimated:
            return
        self.estimated = True
        if seconds > ESTIMATE_ABOVE:
            self._line(f"{self.what}: expected to take about {duration(seconds)} ({basis})")

    def _line(self, line: str, terminal: bool = True) -> None:
        if self.shown and terminal:
            self.stream.write("\r\033[K")  # the in-place status goes; the line stays above the next one
            self.shown = False
        say(line, self.stream, terminal)
        self.last_line = time.perf_counter()

    def _first_line(self) -> None:
        since = f" (for {duration(self.elapsed())} so far)" if self.after > 0 else ""
        self._line(f"{self.what}{f': {self.why}' if self.why else ''}{since}")
        self.said = True

    def _tick(self) -> None:
        with self._lock:
            if not self.said:
                if self.elapsed() < self.after:
                    return
                self._first_line()
            if self.total and self.count and not self.estimated:
                self.estimate(self.elapsed() * self.total / self.count, f"at the rate of the first {self.count}")
            status = self.status()
            if self.terminal and talks():
                self.stream.write("\r\033[K" + status)
                self.stream.flush()
                self.shown = True
            if time.perf_counter() - self.last_line >= self.log_seconds:
                self._line(status, terminal=not self.terminal)  # a terminal shows it in place already

    def __enter__(self) -> Wait:
        if self.after <= 0:
            self._first_line()
        interval = min(TERMINAL_SECONDS, self.log_seconds, *([self.after] if self.after > 0 else []))
        self._ticker = Ticker(interval, self._tick, name="polyattn-wait").start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._ticker.stop()
        if not self.said:
            return
        self._line(f"{self.what}: {'done in' if kind is None else 'failed after'} {duration(self.elapsed())}")
