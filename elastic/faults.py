"""Deterministic fault injection, a public API for testing a training script's resilience.

A fault is keyed by (rank, step) and fires once per run, whatever the rescales in between:
the rank that meets it first claims it through the run's TCPStore. Faults are given in code,

    ElasticTrainer(..., faults=[Fault(kind="kill", rank=1, step=20)])

or as a spec string, as in `elastic demo --inject kill:rank=1,step=20`.

Kinds:
- `kill`: the rank's process dies (`os._exit`) when it reaches step `step`. With
  `where="allreduce"` it dies inside its gradient all-reduce of that step instead, after its
  peers have entered it; with `where="checkpoint"` it dies halfway through writing its shard
  of the checkpoint of step `step`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FAULT_KINDS = ("kill",)


class Fault(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["kill"] = Field(..., description="What happens: kill = the rank's process dies.")
    rank: int = Field(..., ge=0, description="Rank (in the generation current at that step) that fails.")
    step: int = Field(..., ge=0, description="Global step (0-based) at which the fault fires.")
    where: Literal["step_start", "allreduce", "checkpoint"] = Field(
        "step_start",
        description="step_start: before the step's forward; allreduce: inside its gradient all-reduce; "
        "checkpoint: halfway through writing its shard of the checkpoint of that step.",
    )

    def spec(self) -> str:
        extra = "" if self.where == "step_start" else f",where={self.where}"
        return f"{self.kind}:rank={self.rank},step={self.step}{extra}"


def parse_fault(spec: str) -> Fault:
    """Parse `kind:key=value,...`, e.g. `kill:rank=1,step=20`; raises ValueError naming the problem."""
    kind, sep, rest = spec.partition(":")
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r} in {spec!r}; known kinds: {', '.join(FAULT_KINDS)}")
    if not sep or not rest:
        raise ValueError(f"fault {spec!r} has no parameters; write it as {kind}:rank=R,step=S")
    fields: dict[str, str] = {"kind": kind}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"fault parameter {item!r} in {spec!r} is not key=value")
        fields[key.strip()] = value.strip()
    try:
        return Fault.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"bad fault {spec!r}: {problems}") from None


def check_faults(faults: list[Fault], max_steps: int, max_workers: int) -> None:
    """Reject faults that could never fire in this run."""
    for fault in faults:
        if fault.step >= max_steps:
            raise ValueError(
                f"fault {fault.spec()!r} fires at step {fault.step} but the run has max_steps({max_steps}); "
                f"use a step below {max_steps}"
            )
        if fault.rank >= max_workers:
            raise ValueError(
                f"fault {fault.spec()!r} targets rank {fault.rank} but the run has at most "
                f"max_workers({max_workers}) ranks; use a rank below {max_workers}"
            )
