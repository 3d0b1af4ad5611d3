"""Deterministic fault injection, a public API for testing a training script's resilience.

A fault is keyed by (rank, step) and fires once per `fit()`, whatever the rescales in between:
the rank that meets it first claims it through the run's TCPStore. Faults are given in code,

    ElasticTrainer(..., faults=[Fault(kind="kill", rank=1, step=20)])

or as spec strings, as in `elastic demo --inject kill:rank=1,step=20`.

| kind | spec | what happens at step `step` on rank `rank` |
|---|---|---|
| kill | `kill:rank=1,step=20[,where=allreduce]` | the process dies (`os._exit`): before the step's forward, or inside its gradient all-reduce after its peers entered it |
| kill | `kill:rank=1,step=20,where=barrier` | the process dies as it reaches the barrier of the first generation it joins at or after the step, as rank `rank` of it (a death during a formation) |
| kill | `kill:rank=1,step=20,where=connect` | the process dies past the barrier of the first generation it joins at or after the step, as rank `rank` of it, before it connects: its peers wait in the connect for its address (a death inside a heal's connect) |
| kill | `kill:rank=1,step=20,where=prepare` | the process dies as it answers the first grow's prepare at or after the step (a death while a newcomer waits to join) |
| kill | `kill:rank=1,step=20,where=checkpoint` | the process dies as it snapshots the checkpoint taken once step 20 committed, before the collectives that average its per-rank state (PowerSGD's, local SGD's): its peers are inside them |
| hang | `hang:rank=1,step=20` | the rank blocks forever inside its gradient all-reduce; the controller must detect and kill it |
| slow | `slow:rank=1,step=20,factor=3` | from then on the rank's steps take `factor` times longer (a straggler) |
| raise | `raise:rank=1,step=20` | the train loop raises `InjectedError` (an application error) |
| node-loss | `node-loss:rank=1,step=20` | the Ray node hosting the rank is lost (its raylet is killed, taking every worker on it); refused on the head node |
| checkpoint-crash | `checkpoint-crash:rank=1,step=16` | the rank dies halfway through writing its shard of the checkpoint of step 16 |
| controller-kill | `controller-kill:step=20[,where=formation]` | the controller actor dies when rank 0 reaches the step, or right after it offers the first generation at or after the step; Ray restarts it |
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from elastic.errors import ElasticError

FAULT_KINDS = ("kill", "hang", "slow", "raise", "node-loss", "checkpoint-crash", "controller-kill")
FaultKind = Literal["kill", "hang", "slow", "raise", "node-loss", "checkpoint-crash", "controller-kill"]


class InjectedError(ElasticError):
    """Raised in the train loop by a `raise` fault, standing for a bug in the user's code."""


class Fault(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: FaultKind = Field(..., description="What happens; see the table in this module's docstring.")
    rank: int = Field(0, ge=0, description="Rank (in the generation current at that step) that fails.")
    step: int = Field(..., ge=0, description="Global step (0-based) at which the fault fires.")
    where: Literal["step_start", "allreduce", "barrier", "connect", "prepare", "checkpoint", "formation"] = Field(
        "step_start", description="When it fires; see the table in this module's docstring."
    )
    factor: float | None = Field(None, gt=1, description="For slow: how many times longer each step takes.")

    @model_validator(mode="after")
    def _check(self) -> "Fault":
        if self.kind == "slow" and self.factor is None:
            raise ValueError("a slow fault needs factor=F (F > 1), e.g. slow:rank=1,step=20,factor=3")
        if self.kind != "slow" and self.factor is not None:
            raise ValueError(f"factor only applies to slow faults, not {self.kind}")
        allowed = {"kill": ("step_start", "allreduce", "barrier", "connect", "prepare", "checkpoint"),
                   "controller-kill": ("step_start", "formation")}.get(self.kind, ("step_start",))
        if self.where not in allowed:
            raise ValueError(f"where={self.where} does not apply to {self.kind} faults; use one of {', '.join(allowed)}")
        return self

    @property
    def point(self) -> str:
        """Where in a worker's life it fires (see `elastic.worker.injection`); a hang always acts in the all-reduce."""
        return "allreduce" if self.kind == "hang" else self.where

    @property
    def at_or_after(self) -> bool:
        """Fires at the first chance at or after `step`, not at exactly that step: formations
        and prepares happen at steps no one can name in advance."""
        return self.where in ("barrier", "connect", "prepare", "formation")

    def spec(self) -> str:
        parts = [f"rank={self.rank}", f"step={self.step}"]
        if self.where != "step_start":
            parts.append(f"where={self.where}")
        if self.factor is not None:
            parts.append(f"factor={self.factor:g}")
        return f"{self.kind}:{','.join(parts)}"


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
        problems = "; ".join(
            (f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise ValueError(f"bad fault {spec!r}: {problems}") from None


def check_faults(faults: list[Fault], max_steps: int | None, max_workers: int) -> None:
    """Reject faults that could never fire in this run (one without max_steps ends where its loops return)."""
    for fault in faults:
        if max_steps is not None and fault.step >= max_steps:
            raise ValueError(
                f"fault {fault.spec()!r} fires at step {fault.step} but the run has max_steps({max_steps}); "
                f"use a step below {max_steps}"
            )
        if fault.rank >= max_workers:
            raise ValueError(
                f"fault {fault.spec()!r} targets rank {fault.rank} but the run has at most "
                f"max_workers({max_workers}) ranks; use a rank below {max_workers}"
            )
