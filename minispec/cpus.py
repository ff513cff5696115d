"""The CPUs other processes leave free: a load's default thread count. Threads that wait for a core another
process holds stall every parallel region of a step, so a process gets one thread per free CPU it may run on,
judged from the CPU time spent on them since `import minispec` (Linux's /proc/stat; elsewhere all of them)."""

import math
import os
import time

HELD = 0.5  # another process holding more than half a core on average takes that core
SHORTEST = 0.25  # seconds: /proc/stat counts in ticks of 10 ms, too coarse to judge a shorter time
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
chosen = False  # the user chose the threads (--threads): no default overrides them


def sample():
    """(busy seconds of the CPUs this process may run on, its own CPU seconds, now), or None off Linux."""
    try:
        allowed = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except (OSError, AttributeError):
        return None
    # user, nice, system, idle, iowait, irq, softirq, steal: all but idle and iowait is busy
    busy = sum(sum(map(int, fields[1:4] + fields[6:9])) for fields in lines if fields[0] in allowed)
    return busy / TICKS, time.process_time(), time.monotonic()


STARTED = sample()  # at `import minispec`: a command line's torch import lies between this and its load


def free_cpus(start=STARTED, now=None):
    """How many of this process's CPUs other processes left free since `start`, at least one; None where the
    time is too short to tell or the counts are unknown."""
    now = now or sample()
    if start is None or now is None or now[2] - start[2] < SHORTEST:
        return None
    others = ((now[0] - start[0]) - (now[1] - start[1])) / (now[2] - start[2])  # cores, on average
    return max(1, len(os.sched_getaffinity(0)) - max(0, math.ceil(others - HELD)))
