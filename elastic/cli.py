"""The `elastic` command line. Each subcommand is one `_add_<name>` function below.

    elastic demo                               # 3 workers on a local Ray; rank 1 dies and the run heals
    elastic demo --inject none --steps 100     # no fault
    elastic demo --inject kill:rank=0,step=50 --summary-json /tmp/demo.json

Usage errors (a bad fault spec, a fault beyond the last step, inconsistent sizes) exit with
status 2 and say what to change; a run that fails exits with status 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

from pydantic import ValidationError

from elastic.demo.train import DemoConfig, default_fault, run_demo
from elastic.errors import ElasticError
from elastic.faults import Fault, parse_fault

NO_FAULTS = "none"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic", description="Elastic data-parallel training on Ray.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(commands)
    return parser


# --- elastic demo ------------------------------------------------------------------------
def _add_demo(commands: argparse._SubParsersAction) -> None:
    defaults = DemoConfig()
    demo = commands.add_parser(
        "demo",
        help="train a small LM on Python's stdlib source with elastic workers, injecting a fault",
        description="Train a byte-level transformer on Python's standard-library source (no download) "
        f"with {defaults.min_workers}-{defaults.max_workers} workers. Unless --inject says otherwise, rank 1 "
        "is killed a quarter into the run so you can watch the run heal and grow back.",
    )
    demo.add_argument("--min-workers", type=int, default=defaults.min_workers, help="fewest workers (default: %(default)s)")
    demo.add_argument("--max-workers", type=int, default=defaults.max_workers, help="most workers (default: %(default)s)")
    demo.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (default: %(default)s)")
    demo.add_argument(
        "--inject", action="append", type=_fault_or_none, metavar="SPEC",
        help="fault to inject, e.g. kill:rank=1,step=20 or kill:rank=0,step=50,where=allreduce; repeatable. "
        f"'{NO_FAULTS}' injects nothing. Default: kill rank 1 a quarter into the run",
    )
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
    if not injected:
        faults = [default_fault(args.steps)] if args.max_workers > 1 else []
    else:
        faults = [f for f in injected if f is not None]
    try:
        config = DemoConfig(
            name=args.name, storage_path=args.storage_path, address=args.address, data_dir=args.data_dir,
            min_workers=args.min_workers, max_workers=args.max_workers, steps=args.steps, faults=faults,
        )
    except ValidationError as exc:
        parser.error("; ".join(_validation_message(e) for e in exc.errors()))
    if not injected and faults:
        fault = faults[0]
        print(f"elastic demo: no --inject given, so rank {fault.rank} will be killed at step {fault.step} of "
              f"{config.steps}; watch the run heal with the survivors and grow back to {config.max_workers} workers "
              f"when Ray has started a replacement (Ray then logs that a worker died unexpectedly: that is this "
              f"fault). Pass --inject {NO_FAULTS} to run without faults.", flush=True)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
