"""The `elastic` command line. Each subcommand is one `_add_<name>` function below.

    elastic demo                               # 3 workers on a local Ray; rank 1 dies and the run heals
    elastic demo --inject none --steps 100     # no fault
    elastic demo --inject kill:rank=0,step=50 --summary-json /tmp/demo.json
    elastic demo --pipeline-stages 2           # 1-2 replicas of 2 stages; a stage's death takes out its replica
    elastic demo --use-gpu                     # over NCCL; 2-3 workers share the GPU where there is one

    elastic status demo                        # state, world size, step, goodput, recent events
    elastic events demo --type worker_failed --type generation_formed [--json]
    elastic checkpoints demo                   # complete checkpoints; damaged ones with the reason
    elastic plot demo -o timeline.png          # world size, samples/s and loss over time

The last four read only the run folder `{--storage-path}/{name}/` (local, s3://, gs://), never
Ray, so they work on a finished run, a failed one, or one training elsewhere.

Usage errors (a bad fault spec, a fault beyond the last step, inconsistent sizes) exit with
status 2 and say what to change; a run that fails, or a run folder that cannot be read,
exits with status 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any, Callable

from pydantic import ValidationError

from elastic.demo.train import DEFAULT_REPLICAS, DemoConfig, default_fault, run_demo
from elastic.errors import ElasticError
from elastic.faults import Fault, parse_fault
from elastic.journal.events import EVENT_TYPES
from elastic.journal.run_view import (
    Run,
    checkpoints_uri,
    format_age,
    format_bytes,
    format_event,
    format_time,
    list_checkpoints,
    open_run,
    run_status,
)

NO_FAULTS = "none"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic", description="Elastic data-parallel training on Ray.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(commands)
    _add_status(commands)
    _add_events(commands)
    _add_checkpoints(commands)
    _add_plot(commands)
    return parser


# --- elastic demo ------------------------------------------------------------------------
def _add_demo(commands: argparse._SubParsersAction) -> None:
    defaults = DemoConfig()
    demo = commands.add_parser(
        "demo",
        help="train a small LM on Python's stdlib source with elastic workers, injecting a fault",
        description="Train a byte-level transformer on Python's standard-library source (no download) "
        f"with {defaults.min_workers}-{defaults.max_workers} workers, or with --pipeline-stages S "
        f"{DEFAULT_REPLICAS[0]}-{DEFAULT_REPLICAS[1]} replicas of S workers, one per pipeline stage. Unless --inject "
        "says otherwise, rank 1 is killed a quarter into the run so you can watch the run heal and grow back.",
    )
    demo.add_argument("--min-workers", type=int,
                      help=f"fewest workers (default: {defaults.min_workers}, or {DEFAULT_REPLICAS[0]} replica of "
                      "--pipeline-stages x --tensor-parallel workers)")
    demo.add_argument("--max-workers", type=int,
                      help=f"most workers (default: {defaults.max_workers}, or {DEFAULT_REPLICAS[1]} replicas of "
                      "--pipeline-stages x --tensor-parallel workers)")
    demo.add_argument("--pipeline-stages", type=int, default=defaults.pipeline_stages, metavar="S",
                      help="workers per replica, each holding one pipeline stage of the LM; above 1 a replica is "
                      "the unit that heals and grows: a stage worker's death takes out its replica, the others "
                      "go on, and a new replica joins (default: %(default)s)")
    demo.add_argument("--tensor-parallel", type=int, default=defaults.tensor_parallel, metavar="T",
                      help="workers per replica that cut each block of the LM between them (Megatron's cut of the "
                      "attention heads and the MLP); above 1 a worker's death takes out its replica, the others go "
                      "on, and a new replica joins (default: %(default)s)")
    demo.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (default: %(default)s)")
    demo.add_argument(
        "--inject", action="append", type=_fault_or_none, metavar="SPEC",
        help="fault to inject, e.g. kill:rank=1,step=20 or kill:rank=0,step=50,where=allreduce; repeatable. "
        f"'{NO_FAULTS}' injects nothing. Default: kill rank 1 a quarter into the run",
    )
    strategy = defaults.strategy
    demo.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=strategy.precision,
                      help="autocast the forward; fp16 also scales the loss (default: %(default)s)")
    demo.add_argument("--compression", default=strategy.compression, metavar="SPEC",
                      help="none, fp16, bf16 (the gradient all-reduce's dtype) or powersgd:rank=R[,start_iter=N] "
                      "(default: %(default)s)")
    demo.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=strategy.zero,
                      help="ZeRO stage: 1 shards the optimizer state, 2 the gradients too, 3 the parameters too "
                      "(2 and 3 on FSDP2) (default: %(default)s)")
    demo.add_argument("--sync", default=strategy.sync, metavar="SPEC",
                      help="ddp, local_sgd:every=H, diloco:every=H[,outer_lr=X][,outer_momentum=X], "
                      "easgd:every=H[,alpha=X] or stale:bound=S (default: %(default)s)")
    demo.add_argument("--overlap-optimizer", action="store_true", default=strategy.overlap_optimizer,
                      help="step the optimizer on each gradient bucket as its all-reduce lands, for links slower "
                      "than compute")
    demo.add_argument("--use-gpu", action="store_true",
                      help="train on GPUs over NCCL; with fewer GPUs than --max-workers the workers share them (a "
                      "mode for tests and small runs: NCCL's network transport, not NVLink)")
    demo.add_argument("--storage-path", default=defaults.storage_path, help="where run folders go (default: %(default)s)")
    demo.add_argument("--name", default=defaults.name,
                      help="run name; an earlier run of this name is replaced (default: %(default)s)")
    demo.add_argument("--data-dir", default=None, help="corpus folder (default: ~/.cache/elastic/corpus-stdlib-<seq_len>)")
    demo.add_argument("--summary-json", metavar="PATH", help="also write the run summary as JSON to PATH")
    demo.add_argument("--address", default=None,
                      help="Ray address; 'auto' joins a cluster started here with `ray start` "
                      "(default: RAY_ADDRESS, else a new local Ray)")
    demo.set_defaults(handler=functools.partial(_run_demo, demo))


def _fault_or_none(spec: str) -> Fault | None:
    if spec == NO_FAULTS:
        return None
    try:
        return parse_fault(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    injected = args.inject or []
    if None in injected and len(injected) > 1:
        parser.error(f"--inject {NO_FAULTS} cannot be combined with other --inject faults")
    fields = dict(
        name=args.name, storage_path=args.storage_path, address=args.address, data_dir=args.data_dir,
        pipeline_stages=args.pipeline_stages, tensor_parallel=args.tensor_parallel, min_workers=args.min_workers,
        max_workers=args.max_workers, use_gpu=args.use_gpu,
        steps=args.steps, faults=[f for f in injected if f is not None],
        strategy={"precision": args.precision, "compression": args.compression, "sync": args.sync, "zero": args.zero,
                  "overlap_optimizer": args.overlap_optimizer},
    )
    try:
        config = DemoConfig(**fields)
        # The default fault only where the run survives it: with a second worker (replica) to heal with.
        if not injected and config.can_heal:
            config = DemoConfig(**{**fields, "faults": [default_fault(config.steps)]})
    except ValidationError as exc:
        parser.error("; ".join(_validation_message(e) for e in exc.errors()))
    if not injected and config.faults:
        fault = config.faults[0]
        size, where = config.replica_size, ""
        then = (f"watch the run heal with the survivors and grow back to {config.max_workers} workers when Ray has "
                "started a replacement")
        if size > 1:
            role = "stage" if config.pipeline_stages > 1 else "tensor-parallel rank"
            where = f" ({role} {fault.rank % size} of replica {fault.rank // size})"
            then = (f"watch its replica leave whole, the other heal in place, and a new replica join, back to "
                    f"{config.max_workers} workers, when Ray has started it")
        print(f"elastic demo: no --inject given, so rank {fault.rank}{where} will be killed at step {fault.step} of "
              f"{config.steps}; {then} (Ray then logs that a worker died unexpectedly: that is this fault). Pass "
              f"--inject {NO_FAULTS} to run without faults.", flush=True)
    try:
        summary = run_demo(config)
    except ElasticError as exc:
        print(f"elastic demo: the run failed: {exc}", file=sys.stderr)
        return 1
    if args.summary_json:
        with open(args.summary_json, "w") as out:
            json.dump(summary, out, indent=2)
            out.write("\n")
    print(_format_summary(summary, args.summary_json))
    return 0


def _validation_message(error: dict[str, Any]) -> str:
    where = ".".join(map(str, error["loc"]))
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _format_summary(summary: dict[str, Any], summary_json: str | None) -> str:
    history = summary["world_size_history"]
    start = history[0]["time"] if history else 0.0
    sizes = " -> ".join(
        f"{h['world_size']} ({h['reason'].split(':')[0]} at {h['time'] - start:.0f}s)" for h in history
    )
    recoveries = ", ".join(f"{r['seconds']:.1f}s with {r['steps_lost']} steps lost" for r in summary["recoveries"])
    final, first = summary["final_loss"], summary["first_loss"]
    loss = "n/a" if final is None else f"{final:.3f}" + (f" (first reported {first:.3f})" if first is not None else "")
    lines = [
        f"elastic demo finished: {summary['steps']} steps, {summary['samples']} samples in {summary['wall_s']:.0f} s",
        f"  world sizes: {sizes or 'none formed'}",
        f"  recoveries:  {len(summary['recoveries'])}" + (f" ({recoveries})" if recoveries else ""),
        f"  goodput:     {summary['goodput']:.2f} (share of wall time spent in committed steps)",
        f"  final loss:  {loss}",
        f"  events:      {summary['events']}",
        f"  checkpoint:  {summary['checkpoint']}",
    ]
    if summary["resumed_from_step"] is not None:
        lines.insert(1, f"  resumed from the checkpoint of step {summary['resumed_from_step']}")
    if summary_json:
        lines.append(f"  summary:     {summary_json}")
    return "\n".join(lines)



# --- commands that read a run folder -----------------------------------------------------
def _add_run_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("name", help="run name (RunConfig.name; the demo's is 'demo')")
    command.add_argument("--storage-path", default=DemoConfig().storage_path,
                         help="where run folders are: a local path, s3://… or gs://… (default: %(default)s)")


def _reading_run(action: Callable[[Run, argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Open the run folder for `action`; a missing or unreadable one is one line on stderr, status 1."""

    def handler(args: argparse.Namespace) -> int:
        try:
            return action(open_run(args.storage_path, args.name), args)
        except (ElasticError, OSError) as exc:
            message = " ".join(str(exc).split())
            print(f"elastic {args.command}: {message}", file=sys.stderr)
            return 1

    return handler


# --- elastic status ----------------------------------------------------------------------
def _add_status(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser(
        "status", help="state, world size, step, goodput and recent events of a run",
        description="Show the latest attempt of a run from its event journal: state, world size, step, "
        "throughput and loss, goodput once finished, and the last few events (metrics left out).",
    )
    _add_run_arguments(status)
    status.set_defaults(handler=_reading_run(_show_status))


def _show_status(run: Run, args: argparse.Namespace) -> int:
    status = run_status(run.events)
    steps = f"{status.step}" + (f" / {status.max_steps}" if status.max_steps is not None else "")
    lines = [
        f"run {run.name} ({run.storage.uri})",
        f"  state:       {status.state}" + (f" ({status.reason})" if status.reason else ""),
        f"  step:        {steps}",
        f"  world size:  {status.world_size}" + (f" (generation {status.generation})" if status.generation is not None else ""),
    ]
    if status.samples_per_s is not None:
        lines.append(f"  throughput:  {status.samples_per_s:.0f} samples/s (last sample)")
    if status.loss is not None:
        lines.append(f"  loss:        {status.loss:.4f} (last reported)")
    if status.goodput is not None:
        lines.append(f"  goodput:     {status.goodput:.2f} over {status.wall_s:.0f} s "
                     "(share of wall time spent in committed steps)")
    attempts = f"{status.attempts}" + (f", this one resumed from step {status.resumed_from_step}"
                                       if status.resumed_from_step is not None else "")
    lines += [
        f"  attempts:    {attempts}",
        f"  started:     {format_time(status.started)}; last event {format_age(status.last_event_time)}",
        "  recent events:",
        *(f"    {format_event(e, status.started)}" for e in status.recent),
    ]
    print("\n".join(lines))
    return 0


# --- elastic events ----------------------------------------------------------------------
def _add_events(commands: argparse._SubParsersAction) -> None:
    events = commands.add_parser(
        "events", help="the run's event journal, optionally of some types only",
        description="Print the events of a run, oldest first, with local time and seconds since the "
        "journal began. The journal holds every attempt of the run name.",
    )
    _add_run_arguments(events)
    events.add_argument("--type", action="append", choices=EVENT_TYPES, metavar="TYPE", dest="types",
                        help=f"only events of this type; repeatable. One of: {', '.join(EVENT_TYPES)}")
    events.add_argument("--json", action="store_true", help="one JSON object per line, as stored")
    events.set_defaults(handler=_reading_run(_show_events))


def _show_events(run: Run, args: argparse.Namespace) -> int:
    start = run.events[0]["time"] if run.events else 0.0
    for event in run.events:
        if args.types and event["type"] not in args.types:
            continue
        print(json.dumps(event, default=str) if args.json else format_event(event, start))
    return 0


# --- elastic checkpoints -----------------------------------------------------------------
def _add_checkpoints(commands: argparse._SubParsersAction) -> None:
    checkpoints = commands.add_parser(
        "checkpoints", help="the run's complete checkpoints, and the incomplete or damaged ones",
        description="Verify every checkpoint folder of a run (manifest, sizes, sha256 of each file) and "
        "list the complete ones with step, world size, size and age; incomplete or damaged folders are "
        "listed apart, with the reason. Resuming uses the newest complete one.",
    )
    _add_run_arguments(checkpoints)
    checkpoints.set_defaults(handler=_reading_run(_show_checkpoints))


def _show_checkpoints(run: Run, args: argparse.Namespace) -> int:
    complete, damaged = list_checkpoints(run.storage)
    now = time.time()
    if not complete and not damaged:
        print(f"run {run.name} has no checkpoints ({checkpoints_uri(run.storage)} is empty or absent)")
        return 0
    print(f"complete checkpoints of {run.name} ({checkpoints_uri(run.storage)}): {len(complete)}")
    if complete:
        print(f"  {'step':>8}  {'world':>5}  {'bytes':>14}  {'size':>10}  age")
        for c in complete:
            print(f"  {c.step:>8}  {c.world_size:>5}  {c.bytes:>14}  {format_bytes(c.bytes):>10}  {format_age(c.created, now)}")
    if damaged:
        print(f"incomplete or damaged: {len(damaged)}")
        for d in damaged:
            print(f"  step {d.step}: {d.reason}")
    return 0


# --- elastic plot ------------------------------------------------------------------------
def _add_plot(commands: argparse._SubParsersAction) -> None:
    plot = commands.add_parser(
        "plot", help="draw the run's timeline (world size, samples/s, loss, failures, heals) to a PNG",
        description="Draw world size, samples/s and loss over time, with marks for failures, heals, "
        "regrowth, restarts and checkpoints, and the goodput in the title. Needs matplotlib: "
        "pip install 'elastic[plot]'.",
    )
    _add_run_arguments(plot)
    plot.add_argument("-o", "--output", metavar="PNG", help="file to write (default: <name>-timeline.png)")
    plot.add_argument("--all-attempts", action="store_true",
                      help="draw every attempt of the run name, not only the latest")
    plot.add_argument("--compare", nargs="+", metavar="RUN",
                      help="draw the loss over committed steps of this run and of each RUN (same storage path) "
                      "in one PNG instead of the timeline (default file: <name>-compare.png)")
    plot.set_defaults(handler=_reading_run(_draw_plot))


def _draw_plot(run: Run, args: argparse.Namespace) -> int:
    from elastic.journal.timeline import draw_comparison, draw_timeline

    if args.compare:
        runs = {run.name: run.events}
        runs.update({name: open_run(args.storage_path, name).events for name in args.compare})
        output = args.output or f"{run.name}-compare.png"
        last = draw_comparison(runs, output)
        print(f"wrote {output}; last loss: " + ", ".join(f"{name} {loss:.4f}" for name, loss in last.items()))
        return 0

    output = args.output or f"{run.name}-timeline.png"
    drawn = draw_timeline(run.events, output, run.name, all_attempts=args.all_attempts)
    marks = ", ".join(f"{len(times)} {kind}" for kind, times in drawn.marks.items()) or "none"
    print(f"wrote {output}: {drawn.title}; marks: {marks}")
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
