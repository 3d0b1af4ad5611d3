"""The timeline of a run as a picture: world size, throughput and loss over time, with marks.

    elastic plot demo -o timeline.png          # or, from Python:
    draw_timeline(open_run("./runs", "demo").events, "timeline.png", name="demo")
    elastic plot demo --compare demo-bf16 demo-diloco    # loss over steps, one line per run

Three panels share the time axis (seconds since the run started): the world size as a step
plot, shaded where the controller was not training (waiting or reconfiguring), then samples/s
and the loss from the `metrics` events. Vertical lines mark failures (`worker_failed`), heals
and regrowth (`generation_formed` whose reason starts with "heal" or "grow"), restarts (every
worker lost, the controller restarted, or a new attempt) and saved checkpoints. The title
carries the goodput of a finished run. matplotlib is an optional extra
(`pip install 'elastic[plot]'`), imported only when a timeline is drawn, and draws with its
Agg backend into the file, so no display is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from elastic.errors import ElasticError
from elastic.journal.run_view import count_attempts, latest_attempt

# kind -> (color, line style, legend label); the order is the legend's.
MARKS = {
    "failure": ("#d62728", "-", "worker failed"),
    "heal": ("#ff7f0e", "--", "healed (smaller group)"),
    "grow": ("#2ca02c", "--", "grew back"),
    "restart": ("#9467bd", "-.", "restart"),
    "checkpoint": ("#7f7f7f", ":", "checkpoint saved"),
}
IDLE_LABEL = "not training (waiting, reconfiguring)"


class PlotUnavailableError(ElasticError):
    """matplotlib, an optional extra, is not installed."""


@dataclass(frozen=True)
class Timeline:
    """What `draw_timeline` drew: the marks of each kind (seconds since start) and the legend."""

    path: str
    marks: dict[str, list[float]]
    legend: list[str]
    title: str


def mark_kind(event: dict[str, Any]) -> str | None:
    """Which vertical mark an event gets, if any."""
    kind = event["type"]
    if kind == "worker_failed":
        return "failure"
    if kind == "checkpoint_saved":
        return "checkpoint"
    if kind == "controller_restarted":
        return "restart"
    if kind == "generation_formed":
        if event.get("kind") == "restart":
            return "restart"  # from storage: every worker lost, or the live state lost
        reason = event.get("reason", "")
        if reason.startswith("heal"):
            return "heal"
        if reason.startswith("grow"):
            return "grow"
        # A later "start" re-forms from storage: every worker was lost.
        if reason.startswith("start") and event.get("generation", 0) > 0:
            return "restart"
    return None


def collect_marks(events: list[dict[str, Any]], start: float) -> dict[str, list[float]]:
    """Seconds since `start` of each mark, by kind; a later attempt's `run_started` is a restart."""
    marks: dict[str, list[float]] = {}
    attempts = set()
    for event in events:
        kind = mark_kind(event)
        if event["type"] == "run_started":
            attempt = event.get("attempt")
            if attempts and attempt not in attempts:
                kind = "restart"
            attempts.add(attempt)
        if kind:
            marks.setdefault(kind, []).append(event["time"] - start)
    return {k: marks[k] for k in MARKS if k in marks}


def world_size_series(events: list[dict[str, Any]], start: float) -> tuple[list[float], list[int]]:
    """(seconds, workers) steps: 0 until a generation forms, and 0 again once an attempt ends."""
    times, sizes = [0.0], [0]
    for event in events:
        if event["type"] == "generation_formed":
            size = event["world_size"]
        elif event["type"] in ("run_finished", "run_failed", "run_started", "controller_restarted"):
            size = 0
        else:
            continue
        times.append(event["time"] - start)
        sizes.append(size)
    times.append(events[-1]["time"] - start)
    sizes.append(sizes[-1])
    return times, sizes


def metric_series(events: list[dict[str, Any]], start: float,
                  value: Callable[[dict[str, Any]], Any]) -> tuple[list[float], list[float]]:
    """(seconds, value) of each `metrics` event with a numeric value; NaN where an attempt or a
    restarted controller begins, so the line breaks instead of bridging the time nothing ran."""
    times, values = [], []
    for event in events:
        if event["type"] in ("run_started", "controller_restarted") and times:
            times.append(event["time"] - start)
            values.append(math.nan)
        elif event["type"] == "metrics":
            number = value(event)
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                times.append(event["time"] - start)
                values.append(float(number))
    return times, values


def idle_spans(events: list[dict[str, Any]], start: float) -> list[tuple[float, float]]:
    """(from, to) seconds in which the controller was not RUNNING: waiting or reconfiguring."""
    spans, idle_since = [], 0.0
    for event in events:
        if event["type"] == "state":
            running = event["state"] in ("RUNNING", "FINISHED", "FAILED")
            if running and idle_since is not None:
                spans.append((idle_since, event["time"] - start))
                idle_since = None
            elif not running and idle_since is None:
                idle_since = event["time"] - start
    if idle_since is not None:
        spans.append((idle_since, events[-1]["time"] - start))
    return spans


def describe(events: list[dict[str, Any]], name: str) -> str:
    """The title: run name, steps and wall time, and goodput if the run finished."""
    finished = [e for e in events if e["type"] == "run_finished"]
    failed = [e for e in events if e["type"] == "run_failed"]
    resumed = [e for e in events if e["type"] == "run_resumed"]
    attempts = count_attempts(events)
    head = (f"{name}: " if name else "") + (f"{attempts} attempts, the last: " if attempts > 1 else "")
    if finished:
        end = finished[-1]
        text = (f"{head}{end['step']} steps in {end.get('wall_s', 0):.0f} s, "
                f"goodput {end['goodput']:.2f}")
    elif failed:
        text = f"{head}failed: {failed[-1].get('error', '')}"[:90]
    else:
        text = f"{head}not finished (no run_finished event yet)"
    if resumed:
        text += f" (resumed from step {resumed[-1]['step']})"
    return text


def draw_timeline(events: list[dict[str, Any]], path: str, name: str = "", all_attempts: bool = False) -> Timeline:
    """Draw the run's timeline into the PNG file `path`; by default the latest attempt only."""
    Figure, FigureCanvasAgg, Line2D, Patch = _matplotlib()
    if not events:
        raise ElasticError("the run's journal is empty; there is nothing to draw yet")
    events = list(events) if all_attempts else latest_attempt(events)
    start = events[0]["time"]
    speeds = metric_series(events, start, lambda e: e.get("samples_per_s"))
    losses = metric_series(events, start, lambda e: e.get("metrics", {}).get("loss"))

    # A Figure with its own Agg canvas, not pyplot: no global backend switch, nothing to close.
    figure = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(figure)
    size_ax, speed_ax, loss_ax = figure.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.2, 1.2]})

    times, sizes = world_size_series(events, start)
    size_ax.step(times, sizes, where="post", color="#1f77b4", linewidth=2)
    spans = idle_spans(events, start)
    for begin, end in spans:
        size_ax.axvspan(begin, end, color="#bbbbbb", alpha=0.35, linewidth=0)
    size_ax.set_ylabel("workers")
    size_ax.set_ylim(0, max(sizes) + 0.8)
    size_ax.yaxis.get_major_locator().set_params(integer=True)

    # Dots show each sample when there are few, so a short run does not look like a straight line.
    dots = "." if len(speeds[0]) < 60 else None
    speed_ax.plot(*speeds, color="#1f77b4", marker=dots)
    speed_ax.set_ylabel("samples/s")
    speed_ax.set_ylim(bottom=0)

    if any(not math.isnan(v) for v in losses[1]):
        loss_ax.plot(*losses, color="#8c564b", marker=dots)
    else:
        loss_ax.text(0.5, 0.5, "no loss reported", transform=loss_ax.transAxes, ha="center", color="gray")
    loss_ax.set_ylabel("loss")
    loss_ax.set_xlabel("seconds since the run started")
    # A little room past the last event, so marks at the very end are not hidden by the frame.
    end = max(events[-1]["time"] - start, 1.0)
    loss_ax.set_xlim(0, end * 1.02)

    marks = collect_marks(events, start)
    handles = []
    for kind, seconds in marks.items():
        color, style, label = MARKS[kind]
        for ax in (size_ax, speed_ax, loss_ax):
            for t in seconds:
                ax.axvline(t, color=color, linestyle=style, linewidth=1.2, alpha=0.8)
        count = f" ×{len(seconds)}" if len(seconds) > 1 else ""
        handles.append(Line2D([], [], color=color, linestyle=style, label=f"{label}{count}"))
    if spans:
        handles.append(Patch(color="#bbbbbb", alpha=0.35, label=IDLE_LABEL))
    for ax in (size_ax, speed_ax, loss_ax):
        ax.grid(True, alpha=0.3)
    if handles:
        size_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    title = describe(events, name)
    figure.suptitle(title)
    figure.savefig(path, format="png", dpi=110)
    return Timeline(path, marks, [h.get_label() for h in handles], title)


def loss_by_step(events: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """(committed step, loss) of each `metrics` event of the latest attempt that has a loss."""
    steps, losses = [], []
    for event in latest_attempt(events):
        loss = event.get("metrics", {}).get("loss") if event["type"] == "metrics" else None
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            steps.append(int(event["step"]))
            losses.append(float(loss))
    return steps, losses


def strategy_label(events: list[dict[str, Any]]) -> str:
    """The non-default techniques the latest attempt ran with, e.g. "precision=bf16, zero=1"."""
    started = [e for e in latest_attempt(events) if e["type"] == "run_started"]
    strategy = started[0].get("strategy", {}) if started else {}
    defaults = {"precision": "fp32", "compression": "none", "zero": 0, "sync": "ddp"}
    chosen = [f"{k}={v}" for k, v in strategy.items() if k in defaults and v != defaults[k]]
    return ", ".join(chosen) or "fp32 DDP"


def draw_comparison(runs: dict[str, list[dict[str, Any]]], path: str) -> dict[str, float]:
    """Draw each run's loss over its committed steps into one PNG; returns each run's last loss.

    `runs` maps a run name to its events; the first run is drawn on top, as the reference."""
    Figure, FigureCanvasAgg, _, _ = _matplotlib()
    series = {name: loss_by_step(events) for name, events in runs.items()}
    empty = [name for name, (steps, _) in series.items() if not steps]
    if empty:
        raise ElasticError(f"runs {empty} reported no loss; elastic.report({{'loss': ...}}) from the train loop "
                           "draws it")
    figure = Figure(figsize=(10, 5.5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for order, (name, (steps, losses)) in enumerate(reversed(series.items())):
        reference = order == len(series) - 1
        ax.plot(steps, losses, linewidth=2.4 if reference else 1.3, color="black" if reference else None,
                label=f"{name} ({strategy_label(runs[name])})", zorder=3 if reference else 2)
    ax.set_xlabel("committed step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper right", fontsize=9)
    figure.suptitle(f"loss of {len(series)} runs against {next(iter(series))}")
    figure.savefig(path, format="png", dpi=110)
    return {name: losses[-1] for name, (_, losses) in series.items()}


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise PlotUnavailableError(
            "drawing a timeline needs matplotlib, which is not installed; install it with "
            "pip install 'elastic[plot]'"
        ) from None
    return Figure, FigureCanvasAgg, Line2D, Patch
