"""`train_mlp.py` as a job for a running Ray cluster, with its run folder and faults on the command line.

    ray job submit --working-dir . -- python examples/train_mlp_with_kill.py \
        --storage-path /tmp/runs --name mlp --inject kill:rank=1,step=30

Ray starts the driver in a temporary copy of the working directory, so a relative run folder
would vanish with it: give --storage-path as an absolute path (or an s3:// or gs:// URI).
`--inject` takes the spec of `elastic.parse_fault` and may be repeated: the survivors carry
the run on with their state, a replacement joins once Ray has started it, and the job still
succeeds. The model, data and train loop are those of `train_mlp.py`.
"""

import argparse

import ray

import train_mlp
from elastic import DataConfig, ElasticTrainer, Fault, RunConfig, ScalingConfig, parse_fault

# Workers put the working directory on their path, not examples/, so they could not import
# `train_mlp` by name; ship its train loop by value instead.
ray.cloudpickle.register_pickle_by_value(train_mlp)


def _fault(spec: str) -> Fault:
    try:
        return parse_fault(spec)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", required=True, help="absolute path or URI that holds the run folder")
    parser.add_argument("--name", default="train_mlp", help="run name, a folder under --storage-path")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--min-workers", type=int, default=1, help="fewest workers (default: %(default)s)")
    parser.add_argument("--max-workers", type=int, default=2, help="most workers (default: %(default)s)")
    parser.add_argument("--inject", action="append", default=[], type=_fault, metavar="SPEC",
                        help="fault to inject, e.g. kill:rank=1,step=30; repeatable")
    args = parser.parse_args()

    result = ElasticTrainer(
        train_mlp.train_loop,
        scaling_config=ScalingConfig(min_workers=args.min_workers, max_workers=args.max_workers),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path),
        data_config=DataConfig(global_batch_size=64, micro_batch_size=32, max_steps=args.steps),
        faults=args.inject,
        show_progress=False,
    ).fit()
    sizes = " -> ".join(str(e["world_size"]) for e in result.events_of("generation_formed"))
    print(f"{result.step} steps, world sizes {sizes}, final loss {result.metrics['loss']:.4f}; "
          f"events in {result.path}/events.jsonl")


if __name__ == "__main__":
    main()
