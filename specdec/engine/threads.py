"""Intra-op threads that survive a busy machine: the engine's CPU thread policy.

torch's OpenMP threads spin while they wait for work. When another CPU-bound process shares the cores,
our threads and its threads take turns on them, and every parallel region waits for the thread that was
descheduled: on this project's 2-core host, plain decoding of SmolLM2-135M fell from 17 to 2.5 tok/s
beside one other 2-thread job. Using as many threads as there are *free* cores avoids that (1 thread
kept 9.7 tok/s, 55 % of idle); OpenMP's passive wait policy (``OMP_WAIT_POLICY=PASSIVE``) avoids it too
but costs a third of the idle speed (9.4-11.4 tok/s idle), so it is not the default.

:class:`ThreadPolicy` with ``threads="auto"`` (the engine's default on the CPU) samples, every
``interval_s``, the CPU time that *other* processes used on the cores this process may run on (from
``/proc/stat`` minus this process's own time, ``/proc/self/stat``), and sets
``torch.set_num_threads(max(1, min(max_threads, round(cores - others))))`` (a lower count only when two
samples in a row ask for it; a higher one at once), where ``max_threads`` is the
thread count when the engine started (``OMP_NUM_THREADS`` or ``torch.set_num_threads`` set it). An
integer fixes the count; None leaves torch's setting alone. Where ``/proc`` is missing (not Linux),
``"auto"`` keeps the starting count.

With ``compile=True`` a change of the count reuses the compiled graphs (the compiled decoder drops
dynamo's global-state guard, which holds the count; :mod:`specdec.compilation.compiled_model`).

Only the thread count changes; outputs do not depend on it (every kernel's reduction order is fixed
per row) beyond float32 rounding in torch's own parallel reductions.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from specdec.errors import ConfigError

__all__ = ["ThreadPolicy", "check_threads"]

logger = logging.getLogger("specdec.threads")

#: (count, max_threads) of the last ``torch.set_num_threads`` by an ``"auto"`` policy: a later engine in
#: the same process starts from the original maximum, not from a count lowered under load.
_last_set: tuple[int, int] | None = None


def check_threads(value: object) -> int | str | None:
    """``"auto"``, None, or a positive int; anything else is a :class:`ConfigError` naming the field."""
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"cpu_threads must be 'auto', None or a positive integer, got {value!r}")
    return value


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _busy_ticks(cpus: list[int]) -> int | None:
    """Busy clock ticks of the CPUs ``cpus`` since boot (all processes), or None without ``/proc``: user,
    nice, system, irq and softirq time (not steal: a hypervisor's other guests are not ours to yield to,
    and fewer threads would not give us their time back)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{i}" for i in cpus}
    busy = 0
    for line in lines:
        parts = line.split()
        if parts and parts[0] in wanted:
            values = [int(v) for v in parts[1:8]] + [0] * 7
            busy += sum(values[i] for i in (0, 1, 2, 5, 6))  # user, nice, system, irq, softirq
    return busy


def _own_ticks() -> int | None:
    """This process's user + system clock ticks (all its threads)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


@dataclass
class ThreadPolicy:
    """Chooses the engine's intra-op thread count (see the module docstring).

    Attributes:
        threads: ``"auto"``, a fixed count, or None (torch's setting untouched).
        interval_s: seconds between two samples of the machine's load (``"auto"``).
        max_threads: the most threads ``"auto"`` uses; None: torch's count when the policy starts.
    """

    threads: int | str | None = "auto"
    interval_s: float = 0.5
    max_threads: int | None = None
    #: Thread counts chosen, in order (``"auto"``), for the engine's metrics and tests.
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.threads = check_threads(self.threads)
        if isinstance(self.threads, int):
            torch.set_num_threads(self.threads)
            self.history.append(self.threads)
        self._cpus = _allowed_cpus()
        if self.max_threads is None:
            current = torch.get_num_threads()
            self.max_threads = _last_set[1] if _last_set is not None and _last_set[0] == current else current
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, int, int] | None = None
        self._pending_drop: int | None = None
        self._sample(time.monotonic())

    def _sample(self, now: float) -> float | None:
        """Cores that other processes used since the last sample (None on the first, or without /proc)."""
        busy, own = _busy_ticks(self._cpus), _own_ticks()
        if busy is None or own is None:
            return None
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return None
        others = (busy - last[1]) - (own - last[2])
        return max(0.0, others / self._hz / (now - last[0]))

    def threads_for(self, others: float) -> int:
        """The thread count for ``others`` cores busy with other processes."""
        assert self.max_threads is not None
        free = len(self._cpus) - others
        return max(1, min(self.max_threads, int(free + 0.5)))

    def step(self) -> None:
        """Called once per engine step: with ``"auto"``, re-samples the load every ``interval_s`` and
        sets torch's thread count when it changes."""
        if self.threads != "auto":
            return
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return
        others = self._sample(now)
        if others is None:
            return
        n = self.threads_for(others)
        current = torch.get_num_threads()
        if n < current and self._pending_drop != n:
            self._pending_drop = n  # fewer threads only when two samples in a row agree (one busy spell of
            return  # a short-lived process, or tick-sampling noise, does not halve the engine)
        self._pending_drop = None
        if n != current:
            global _last_set
            logger.info("other processes use %.1f cores: %d intra-op threads", others, n)
            torch.set_num_threads(n)
            _last_set = (n, self.max_threads)
            self.history.append(n)
