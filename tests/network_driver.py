"""A driver for runs on a `NetworkCluster`, run inside its head's namespace by the network tests.

    python tests/network_driver.py <run.json>

`run.json` names the run (name, storage_path), its sizes (workers: [min, max]), the train
loop's config (`workloads.regression_loop`: max_steps, compute_s, sleep_s, gate) and the
FailureConfig's fields; the driver fits it and saves the result (step, params, ledger) to
`out` with torch.save, for the test to compare.
"""

import json
import os
import sys

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads  # noqa: E402
from elastic import CheckpointConfig, DataConfig, ElasticTrainer, FailureConfig, RunConfig, ScalingConfig  # noqa: E402

ray.cloudpickle.register_pickle_by_value(workloads)


def main(path: str) -> None:
    run = json.loads(open(path).read())
    ray.init(log_to_driver=False)
    config = run["loop"]
    result = ElasticTrainer(
        workloads.regression_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(min_workers=run["workers"][0], max_workers=run["workers"][1]),
        run_config=RunConfig(
            name=run["name"], storage_path=run["storage_path"],
            checkpoint_config=CheckpointConfig(every_steps=run.get("checkpoint_every"), keep_last=2),
            failure_config=FailureConfig(**run.get("failure", {})),
        ),
        data_config=DataConfig(global_batch_size=workloads.GLOBAL_BATCH, micro_batch_size=16,
                               max_steps=config["max_steps"], seed=3),
        show_progress=False,
    ).fit()
    torch.save({"step": result.step, "params": result.value["params"], "ledger": result.value["ledger"]}, run["out"])


if __name__ == "__main__":
    main(sys.argv[1])
