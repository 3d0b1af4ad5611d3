"""The driver's live view of a run: one line redrawn in place, or sparse lines in a job log.

`ElasticTrainer.fit()` polls the controller's `status()` and hands each answer to `show`:

    display = ProgressDisplay()          # stderr by default
    display.show({"state": "RUNNING", "step": 12, "max_steps": 300, "world_size": 3, ...})
    display.close()

On a terminal, rich keeps a single line at the bottom (state, a bar with step/max, world size,
samples/s, loss, last event), and whatever else is printed meanwhile (Ray's worker logs)
scrolls above it. When the output is not a terminal (a job log, a pipe), a plain line is
written at most every `PLAIN_LINE_INTERVAL_S`, and at once whenever the state or the world
size changes, so a heal or a regrowth is always in the log; `close` writes the last status if
it was not written yet.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

PLAIN_LINE_INTERVAL_S = 10.0
BAR_WIDTH = 24
STATE_STYLES = {"RUNNING": "green", "FINISHED": "bold green", "FAILED": "bold red",
                "RECONFIGURING": "yellow", "WAITING": "yellow"}


def plain_line(status: dict[str, Any]) -> str:
    """The status as one line of plain text, for job logs."""
    return "[elastic] " + "  ".join(_fields(status))


def _fields(status: dict[str, Any]) -> list[str]:
    loss = (status.get("metrics") or {}).get("loss")
    fields = [
        f"{status['state']:<13}",
        f"step {status['step']}" + (f"/{status['max_steps']}" if status["max_steps"] is not None else ""),
        f"world {status['world_size']}",
        f"{status['samples_per_s']:.0f} samples/s",
    ]
    if isinstance(loss, (int, float)):
        fields.append(f"loss {loss:.4f}")
    if status.get("last_event"):
        fields.append(f"last: {status['last_event']}")
    return fields


class ProgressDisplay:
    """Shows each status the driver polls; `close` once the run is over."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self._clock = clock
        self._live: Live | None = None
        self._last_plain_at: float | None = None
        self._last_key: tuple[Any, ...] | None = None
        self._pending: str | None = None

    def show(self, status: dict[str, Any]) -> None:
        if self.live:
            self._show_live(status)
        else:
            self._show_plain(status)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._pending is not None:
            self._write(self._pending)

    def _show_live(self, status: dict[str, Any]) -> None:
        if self._live is None:
            console = Console(file=self.stream, force_terminal=True)
            # Output printed while the line is up (Ray's worker logs) goes above it, not through it.
            self._live = Live(console=console, auto_refresh=False, transient=False,
                              redirect_stdout=True, redirect_stderr=True)
            self._live.start()
        self._live.update(self._renderable(status), refresh=True)

    def _renderable(self, status: dict[str, Any]) -> Text:
        state = status["state"]
        # A run without max_steps ends where its train loops return: no bar can say how far it is.
        bar: tuple[Any, ...] = ()
        if status["max_steps"] is not None:
            done = round(BAR_WIDTH * min(status["step"] / max(status["max_steps"], 1), 1.0))
            bar = (("━" * done, "magenta"), ("━" * (BAR_WIDTH - done), "bright_black"), "  ")
        line = Text.assemble(
            "[elastic] ", (f"{state:<13}", STATE_STYLES.get(state, "")), " ", *bar,
            "  ".join(_fields(status)[1:]),
        )
        # One line whatever the terminal's width: the end is cut with an ellipsis, never wrapped.
        line.no_wrap, line.overflow = True, "ellipsis"
        return line

    def _show_plain(self, status: dict[str, Any]) -> None:
        now = self._clock()
        key = (status["state"], status["world_size"])
        line = plain_line(status)
        due = self._last_plain_at is None or now - self._last_plain_at >= PLAIN_LINE_INTERVAL_S
        if due or key != self._last_key:
            self._write(line)
            self._last_plain_at = now
            self._last_key = key
        else:
            self._pending = line

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
        self._pending = None
