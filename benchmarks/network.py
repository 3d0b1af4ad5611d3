"""Each technique of `Strategy` over links slower than compute: samples/s against fp32 DDP and
against the link's floor, on a real multi-node Ray cluster in network namespaces
(elastic.testing.NetworkCluster) whose worker nodes' links `tc tbf` shapes.

    .venv/bin/python -m benchmarks.network                                    # all of it: hours
    .venv/bin/python -m benchmarks.network --nodes 2 --rates 1gbit unshaped --rounds 2
    .venv/bin/python -m benchmarks.network --strategies ddp bf16 --rounds 1 --out /tmp/network.json
    .venv/bin/python -m benchmarks.network --only throughput --rates 10gbit --rounds 1 --add-rounds
    .venv/bin/python -m benchmarks.network --only hierarchical                # 2 nodes x 2 workers
    .venv/bin/python -m benchmarks.network --only target_loss                 # the LM's time to DDP's loss

Run it from the repository root, as root on Linux, on a quiet machine: on 2 shared cores the
figures move by up to half under load, so each round prints the load average.

**The workload.** An MLP 1024 -> 2048 -> 2048 -> 2048 -> 10 (10.5 M float32 parameters, 42 MB of
gradients), AdamW, 64 samples per worker and step, STEPS steps; throughput is taken over the
committed steps WINDOW (rank 0's commit times), past the start and the first generation's
warm-up. One worker per node: a head with no CPUs for workers and `--nodes` worker nodes of
one CPU each. Every strategy of a round runs on the same cluster and link, one after another,
and the compute floor is the same workload on one worker, measured in the same round.

**The floor.** max(compute step time, link bytes per step / link rate): the time a step cannot
beat on this link. Link bytes are what rank 0's node sent through its interface over the
window (kernel counters, TCP/IP headers and Ray's own traffic included): the wire's figure,
not the payload's. `floor_fraction` is floor / measured step time, 1.0 at the floor.
`floor_fraction_together` takes the compute of all the round's workers computing side by side
instead (the same workload, never syncing inside the run): on 2 shared cores one worker's
compute alone is a floor no run of several workers can reach.

Figures, each with min, median and max over the rounds (under `spread.<key>`):

- network.<rate>.<strategy>.samples_s_ratio_vs_ddp, network.<rate>.<strategy>.floor_fraction
  (2 worker nodes; `network_<n>nodes.<rate>...` for other counts), with `network_details_<rate>`
  holding every round's samples/s, step time, link and payload bytes per step, compute floor
  and load average;
- network.hierarchical_vs_flat_ratio: samples/s of the topology-aware all-reduce over the flat
  ring, 2 nodes x 2 workers at 1 Gbit/s (--only hierarchical);
- network.time_to_target_loss_ratio_vs_ddp: the demo's transformer LM (elastic.demo.model,
  widened so a step's gradients weigh on a 1 Gbit/s link) trained to the loss fault-free fp32
  DDP reaches at its last step; the best technique's wall time to it over DDP's
  (--only target_loss), with the loss-over-wall-time plot in benchmarks/results/;
  network.stale_time_to_target_loss_ratio_vs_ddp the same for the best `stale:bound=S` given
  (--strategies ddp stale_s2 ...), each round's final losses beside it.

The keys are merged into benchmarks/results/bench.json (or --out), keeping the others. With
`--add-rounds` the throughput rounds join the rounds `network_details_<rate>` already holds
(each round keeps its date and load average), and the figures are taken over all of them: a
third round on another day adds to the first two instead of replacing them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script inside a node's namespace (the driver)

from benchmarks.bench import (  # noqa: E402
    DEFAULT_OUT, command_line, merge_figures, parse_rounds, print_medians, read_report)

STEPS = 80
WINDOW = (16, 79)  # committed steps whose span measures throughput
PER_WORKER_BATCH = 64
LR = 1e-3
RATES = {"1gbit": 1e9, "10gbit": 1e10, "unshaped": None}
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "powersgd_r1": {"compression": "powersgd:rank=1,start_iter=2"},
    "powersgd_r4": {"compression": "powersgd:rank=4,start_iter=2"},
    "powersgd_r16": {"compression": "powersgd:rank=16,start_iter=2"},
    "local_sgd_h8": {"sync": "local_sgd:every=8"},
    "local_sgd_h32": {"sync": "local_sgd:every=32"},
    "diloco_h8": {"sync": "diloco:every=8"},
    "diloco_h32": {"sync": "diloco:every=32"},
    "zero1": {"zero": 1},
    "zero2": {"zero": 2},
    "zero3": {"zero": 3},
    "bf16_amp_fp16": {"precision": "bf16", "compression": "fp16"},
    "bf16_amp_bf16": {"precision": "bf16", "compression": "bf16"},
    "bf16_amp_powersgd_r4": {"precision": "bf16", "compression": "powersgd:rank=4,start_iter=2"},
    "stale_s1": {"sync": "stale:bound=1"},
    "stale_s2": {"sync": "stale:bound=2"},
    "stale_s4": {"sync": "stale:bound=4"},
    "ddp_overlap": {"overlap_optimizer": True},
    "bf16_overlap": {"compression": "bf16", "overlap_optimizer": True},
}
# The target-loss runs: the demo's LM, widened so that its 29 MB of gradients weigh on a 1 Gbit/s
# link against a step's compute on one core, with short windows to keep that compute small.
LM = {"seq_len": 64, "d_model": 384, "n_layers": 4, "n_heads": 6}
LM_STEPS = 300
LM_WINDOWS_PER_WORKER = 2
LM_LR = 3e-3
LM_SMOOTHING = 20  # committed steps in the trailing mean that is held against the target
# The fastest per step at 1 Gbit/s in the throughput rounds (README), PowerSGD rank 1 for compression.
LM_CANDIDATES = ("diloco_h32", "local_sgd_h32", "local_sgd_h8", "powersgd_r1")
COMPUTE = "compute"  # the one-worker run that measures the compute floor
# The same workers computing side by side, never syncing inside the run: what W workers' compute
# costs when they share the machine's cores, memory bandwidth and Ray's daemons.
COMPUTE_TOGETHER = "compute_together"
NEVER = {"sync": f"local_sgd:every={10 * STEPS}"}
DRIVER_TIMEOUT_S = 3600.0
DEFINITIONS = {
    "network": "techniques on a NetworkCluster whose worker links tc tbf shapes (benchmarks/network.py): samples/s "
               "over fp32 DDP's in the same round, and floor / step time, the floor being max(compute step, link "
               "bytes per step / link rate)",
}


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 10),
    )


def link_tx_bytes() -> int:
    """What this node's link interface sent so far (a Ray worker runs in its node's namespace)."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import elastic

    ctx = elastic.get_context()
    generator = torch.Generator().manual_seed(0)
    samples = PER_WORKER_BATCH * config["world_size"] * 8
    dataset = torch.utils.data.TensorDataset(torch.randn(samples, 1024, generator=generator),
                                             torch.randint(0, 10, (samples,), generator=generator))
    model = ctx.prepare_model(make_model())
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    commits: dict[int, float] = {}
    at_window: dict[str, int] = {}
    for step in ctx.steps(dataset):
        with step:
            for mb in step.micro_batches():
                inputs, labels = mb.data
                mb.backward(F.cross_entropy(model(inputs), labels))
            optimizer.step()
            optimizer.zero_grad()
        if step.committed:
            commits[step.index] = time.time()
            if step.index in WINDOW:
                at_window[f"tx_{step.index}"] = link_tx_bytes()
                at_window[f"payload_{step.index}"] = ctx.communication["sync_bytes"]
    return {"commits": commits, **at_window, "world_size": ctx.world_size}


def lm_loop(config: dict[str, Any]) -> dict[str, Any]:
    """The demo's LM (elastic.demo.model) at LM's size on the demo corpus: each committed step's
    wall time and loss (rank 0's share)."""
    import torch

    import elastic
    from elastic.demo.corpus import prepare_corpus
    from elastic.demo.model import ModelConfig, TinyLM, next_byte_loss, next_byte_pairs

    ctx = elastic.get_context()
    dataset = elastic.ParquetDataset(str(prepare_corpus(None, LM["seq_len"])))
    model = ctx.prepare_model(TinyLM(ModelConfig(**LM), seed=0))
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=LM_LR))
    curve = []
    for step in ctx.steps(dataset):
        with step:
            for mb in step.micro_batches():
                inputs, targets = next_byte_pairs(mb.data["tokens"])
                loss = next_byte_loss(model(inputs), targets)
                mb.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step.committed:
            curve.append((time.time(), loss.item()))
    return {"curve": curve}


def measure(run: dict[str, Any], storage: str) -> dict[str, Any]:
    """One strategy's run on the cluster this driver joined: its throughput figures."""
    import elastic

    world = run["workers"]
    if run.get("lm"):
        return lm_run(run, storage)
    fitted = elastic.ElasticTrainer(
        train_loop,
        train_loop_config={"world_size": world},
        scaling_config=elastic.ScalingConfig(min_workers=world, max_workers=world),
        run_config=elastic.RunConfig(name=f"network-{run['label']}-{time.monotonic_ns()}", storage_path=storage),
        data_config=elastic.DataConfig(global_batch_size=PER_WORKER_BATCH * world, micro_batch_size=PER_WORKER_BATCH,
                                       max_steps=STEPS),
        strategy=elastic.Strategy(**run["strategy"]),
        show_progress=False,
    ).fit()
    out = fitted.value
    first, last = WINDOW
    commits = {int(step): at for step, at in out["commits"].items()}
    span_s = commits[last] - commits[first]
    steps = last - first
    return {"samples_s": PER_WORKER_BATCH * world * steps / span_s, "step_s": span_s / steps,
            "link_bytes_per_step": (out[f"tx_{last}"] - out[f"tx_{first}"]) / steps,
            "payload_bytes_per_step": (out[f"payload_{last}"] - out[f"payload_{first}"]) / steps}


def lm_run(run: dict[str, Any], storage: str) -> dict[str, Any]:
    import elastic

    world = run["workers"]
    fitted = elastic.ElasticTrainer(
        lm_loop,
        scaling_config=elastic.ScalingConfig(min_workers=world, max_workers=world),
        run_config=elastic.RunConfig(name=f"network-lm-{run['label']}-{time.monotonic_ns()}", storage_path=storage),
        data_config=elastic.DataConfig(global_batch_size=LM_WINDOWS_PER_WORKER * world,
                                       micro_batch_size=LM_WINDOWS_PER_WORKER, max_steps=run["steps"], seed=0),
        strategy=elastic.Strategy(**run["strategy"]),
        show_progress=False,
    ).fit()
    curve = fitted.value["curve"]
    start = curve[0][0]
    return {"curve": [(at - start, loss) for at, loss in curve]}


def drive(path: str) -> None:
    """The driver, inside the head's namespace: every run of one round, one after another."""
    import ray

    plan = json.loads(Path(path).read_text())
    ray.init(log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory(prefix="elastic-network-") as storage:
        for run in plan["runs"]:
            results[run["label"]] = measure(run, storage)
            print(f"  {run['label']}: done", flush=True)
    Path(plan["out"]).write_text(json.dumps(results))


def run_round(cluster, runs: list[dict[str, Any]], folder: Path, name: str) -> dict[str, Any]:
    plan = folder / f"{name}.json"
    out = folder / f"{name}-out.json"
    plan.write_text(json.dumps({"runs": runs, "out": str(out)}))
    done = cluster.run_driver(Path(__file__), ["--drive", str(plan)], timeout_s=DRIVER_TIMEOUT_S)
    print(done.stdout[-4000:], flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"the driver of {name} failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}")
    return json.loads(out.read_text())


def floor_fraction(outcome: dict[str, Any], compute_s: float, rate_bits: float | None) -> float:
    wire_s = 0.0 if rate_bits is None else outcome["link_bytes_per_step"] * 8 / rate_bits
    return max(compute_s, wire_s) / outcome["step_s"]


def throughput(args, figures: dict[str, list[float | None]], details: dict[str, Any]) -> None:
    from elastic.testing import NetworkCluster

    prefix = "network" if args.nodes == 2 else f"network_{args.nodes}nodes"
    runs = [{"label": COMPUTE, "workers": 1, "strategy": {}},
            {"label": COMPUTE_TOGETHER, "workers": args.nodes, "strategy": NEVER}] + [
        {"label": name, "workers": args.nodes, "strategy": STRATEGIES[name]} for name in args.strategies]
    earlier = read_report(args.out) if args.add_rounds else {}
    for rate in args.rates:
        details[f"{prefix}_details_{rate}"] = list(earlier.get(f"{prefix}_details_{rate}", []))
    with NetworkCluster(nodes=args.nodes + 1, cpus_per_node=1, head_cpus=0) as cluster, \
            tempfile.TemporaryDirectory(prefix="elastic-network-") as folder:
        for round_index in range(args.rounds):
            for rate in args.rates:
                for node in range(1, args.nodes + 1):
                    cluster.shape(node, None if RATES[rate] is None else rate)
                load = os.getloadavg()[0]
                outcomes = run_round(cluster, runs, Path(folder), f"round-{round_index}-{rate}")
                compute_s = outcomes.pop(COMPUTE)["step_s"]
                together_s = outcomes.pop(COMPUTE_TOGETHER)["step_s"]
                kept = details[f"{prefix}_details_{rate}"]
                kept.append({"round": len(kept), "rate": rate, "load_average_1m": load, "compute_step_s": compute_s,
                             "compute_together_step_s": together_s, "runs": outcomes,
                             "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
                print(f"round {round_index + 1}/{args.rounds} {rate} (load {load:.1f}, compute {compute_s * 1e3:.0f} ms, "
                      f"{together_s * 1e3:.0f} ms side by side): "
                      + ", ".join(f"{n} {o['samples_s']:.0f}/s {o['link_bytes_per_step'] / 1e6:.1f} MB"
                                  for n, o in outcomes.items()), flush=True)
    for rate in args.rates:
        figures.update(rate_figures(prefix, rate, details[f"{prefix}_details_{rate}"], args.strategies))


def rate_figures(prefix: str, rate: str, rounds: list[dict[str, Any]], names: list[str]) -> dict[str, list]:
    """The figures of `names` at `rate` over every kept round (None in a round that did not run the strategy)."""
    figures: dict[str, list[float | None]] = {}
    for kept in rounds:
        runs, ddp = kept["runs"], kept["runs"]["ddp"]
        for name in names:
            outcome, key = runs.get(name), f"{prefix}.{rate}.{name}"
            if name != "ddp":
                figures.setdefault(f"{key}.samples_s_ratio_vs_ddp", []).append(
                    None if outcome is None else outcome["samples_s"] / ddp["samples_s"])
            for suffix, compute_s in (("", kept["compute_step_s"]), ("_together", kept["compute_together_step_s"])):
                figures.setdefault(f"{key}.floor_fraction{suffix}", []).append(
                    None if outcome is None else floor_fraction(outcome, compute_s, RATES[rate]))
    return figures


def hierarchical(args, figures: dict[str, list[float | None]], details: dict[str, Any]) -> None:
    """2 worker nodes of 2 workers each at 1 Gbit/s: the topology-aware all-reduce against the flat ring."""
    from elastic.testing import NetworkCluster

    runs = [{"label": layout, "workers": 4, "strategy": {"all_reduce": layout}} for layout in ("flat", "hierarchical")]
    rounds = []
    with NetworkCluster(nodes=3, cpus_per_node=2, head_cpus=0, rate="1gbit") as cluster, \
            tempfile.TemporaryDirectory(prefix="elastic-network-hier-") as folder:
        for round_index in range(args.rounds):
            load = os.getloadavg()[0]
            outcomes = run_round(cluster, runs, Path(folder), f"hier-round-{round_index}")
            ratio = outcomes["hierarchical"]["samples_s"] / outcomes["flat"]["samples_s"]
            figures.setdefault("network.hierarchical_vs_flat_ratio", []).append(ratio)
            rounds.append({"round": round_index, "load_average_1m": load, "runs": outcomes})
            print(f"2x2 round {round_index + 1}/{args.rounds} (load {load:.1f}): " + ", ".join(
                f"{n} {o['samples_s']:.0f}/s {o['link_bytes_per_step'] / 1e6:.1f} MB" for n, o in outcomes.items())
                + f", ratio {ratio:.2f}", flush=True)
    details["network_hierarchical"] = {"layout": "2 worker nodes x 2 workers, 1gbit", "rounds": rounds}


def smoothed(curve: list[list[float]]) -> list[tuple[float, float]]:
    """(wall time, trailing mean of the last LM_SMOOTHING losses) from the LM_SMOOTHING-th step on."""
    losses = [loss for _, loss in curve]
    return [(curve[i][0], statistics.fmean(losses[i + 1 - LM_SMOOTHING:i + 1]))
            for i in range(LM_SMOOTHING - 1, len(curve))]


def time_to(curve: list[list[float]], target: float) -> float | None:
    return next((at for at, loss in smoothed(curve) if loss <= target), None)


def target_loss(args, figures: dict[str, list[float | None]], details: dict[str, Any]) -> None:
    """DDP and the candidates on the LM at 1 Gbit/s: wall time to DDP's final smoothed loss."""
    from elastic.testing import NetworkCluster

    candidates = [name for name in args.strategies if name in LM_CANDIDATES or name.startswith("stale")] or list(
        LM_CANDIDATES)
    runs = [{"label": "ddp", "workers": args.nodes, "strategy": {}, "lm": True, "steps": LM_STEPS}] + [
        {"label": name, "workers": args.nodes, "strategy": STRATEGIES[name], "lm": True, "steps": LM_STEPS}
        for name in candidates]
    rounds = []
    with NetworkCluster(nodes=args.nodes + 1, cpus_per_node=1, head_cpus=0, rate="1gbit") as cluster, \
            tempfile.TemporaryDirectory(prefix="elastic-network-lm-") as folder:
        # The corpus is built once, before the runs, so no run's first steps pay for it.
        cluster.run_driver("from elastic.demo.corpus import prepare_corpus; "
                           f"prepare_corpus(None, {LM['seq_len']})", timeout_s=600)
        for round_index in range(args.rounds):
            load = os.getloadavg()[0]
            curves = {name: out["curve"] for name, out in
                      run_round(cluster, runs, Path(folder), f"lm-round-{round_index}").items()}
            target = smoothed(curves["ddp"])[-1][1]
            reached = {name: time_to(curve, target) for name, curve in curves.items()}
            # Stale synchrony has a figure of its own (issue 24), beside the best of the others.
            best = {}
            for key, names in (("network.time_to_target_loss_ratio_vs_ddp", [n for n in candidates if "stale" not in n]),
                               ("network.stale_time_to_target_loss_ratio_vs_ddp", [n for n in candidates if "stale" in n])):
                if not names:
                    continue
                best[key] = min((n for n in names if reached[n] is not None), key=lambda n: reached[n], default=None)
                figures.setdefault(key, []).append(reached[best[key]] / reached["ddp"] if best[key] else None)
            final = {name: smoothed(curve)[-1][1] for name, curve in curves.items()}
            rounds.append({"round": round_index, "load_average_1m": load, "target_loss": target,
                           "time_to_target_s": reached, "final_loss": final, "best": best, "curves": curves})
            print(f"LM round {round_index + 1}/{args.rounds} (load {load:.1f}): target {target:.3f}; " + ", ".join(
                f"{n} {'-' if t is None else f'{t:.1f} s'}" for n, t in reached.items()), flush=True)
    details["network_time_to_target_loss"] = {"model": LM, "steps": LM_STEPS, "rate": "1gbit",
                                              "smoothing_steps": LM_SMOOTHING,
                                              "rounds": [{k: v for k, v in r.items() if k != "curves"}
                                                         for r in rounds]}
    draw_loss_over_time(rounds[-1]["curves"], rounds[-1]["target_loss"], args.png)


def draw_loss_over_time(curves: dict[str, list[list[float]]], target: float, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for name, curve in curves.items():
        points = smoothed(curve)
        ax.plot([at for at, _ in points], [loss for _, loss in points], label=name,
                linewidth=2.4 if name == "ddp" else 1.3, color="black" if name == "ddp" else None)
    ax.axhline(target, linestyle=":", color="grey", label="target: fp32 DDP's final loss")
    ax.set_xlabel("wall time (s), 2 worker nodes, 1 Gbit/s links")
    ax.set_ylabel(f"loss (trailing mean of {LM_SMOOTHING} steps)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    figure.savefig(path, format="png", dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--drive"]:
        drive(argv[1])
        return 0

    def more(parser):
        parser.add_argument("--nodes", type=int, default=2, help="worker nodes, one worker each")
        parser.add_argument("--rates", nargs="+", choices=list(RATES), default=list(RATES))
        parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
        parser.add_argument("--only", choices=["throughput", "hierarchical", "target_loss"], default=None)
        parser.add_argument("--add-rounds", action="store_true",
                            help="add the throughput rounds to those --out holds at the same rates and node count, "
                                 "the figures taken over all of them (default: replace them)")
        parser.add_argument("--png", default=str(REPO / "benchmarks" / "results" / "loss_over_time_1gbit.png"))

    parser, args = parse_rounds(__doc__, argv, more)
    if "ddp" not in args.strategies:
        parser.error("--strategies must include ddp: every figure is a ratio against it")
    from elastic.testing import NetworkCluster

    reason = NetworkCluster.unavailable()
    if reason is not None:
        parser.error(f"the network cluster cannot run here: {reason}")
    started = time.time()
    figures: dict[str, list[float | None]] = {}
    details: dict[str, Any] = {}
    if args.only in (None, "throughput"):
        throughput(args, figures, details)
    if args.only in (None, "hierarchical"):
        hierarchical(args, figures, details)
    if args.only in (None, "target_loss"):
        target_loss(args, figures, details)
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.network", argv),
                  time.time() - started)
    print_medians(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
