"""Named pause points: where a test holds a running command to interrupt or kill it at a known moment.

Interrupt and kill tests must not race the clock (a run on a fast machine finishes before a signal sent "after a
while" arrives). Instead the command itself announces that it reached a point and waits there: with
``VITLENS_PAUSE_AT=NAME[,NAME...]`` in the environment, :func:`pause_point` ``(NAME)`` writes ``NAME`` to the file
``VITLENS_PAUSE_FILE`` (atomically) and then sleeps until a signal arrives, or ``VITLENS_PAUSE_SECONDS`` (default
120) have passed, after which the run goes on. Without the variable a pause point costs one dictionary look-up.

Points (see tests/test_errors_interrupts.py): ``start`` and ``shutdown`` (the command line, before parsing and after
the command returned), ``model-loaded``, ``bench.unit.K`` (K units stored), ``train.step.K`` (the checkpoint of step
K written), ``explain.image.K`` (K images done) and ``write.NAME`` (a result file ``NAME`` written to its temporary,
not yet in place).
"""

from __future__ import annotations

import os
import time

__all__ = ["pause_point"]


def pause_point(name: str) -> None:
    """Hold here if a test asked for point ``name`` (see the module docstring); otherwise return at once."""
    wanted = os.environ.get("VITLENS_PAUSE_AT")
    if not wanted or name not in wanted.split(","):
        return
    marker = os.environ.get("VITLENS_PAUSE_FILE")
    if marker:
        tmp = f"{marker}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name)
        os.replace(tmp, marker)
    end = time.monotonic() + float(os.environ.get("VITLENS_PAUSE_SECONDS", "120"))
    while time.monotonic() < end:
        time.sleep(0.005)
