"""Membership generations and the torch.distributed group each one forms.

A generation g is a numbered membership: which workers, their ranks, and the key prefix of
its rendezvous in the controller's TCPStore. A worker leaves generation g by dropping its
process group (aborting it on NCCL, where destroying a group with a dead peer can hang) and
joins g+1 in the same process. Every generation has its own prefix, so keys of a broken one
never confuse the next.

Joining is two steps. First a cancellable barrier (`rendezvous`): each member counts itself
in under `generation/<g>/arrived`; the last to arrive sets `generation/<g>/outcome` to "go",
while the controller sets it to "abort" the moment a member dies or leaves. Whoever writes
first wins (`compare_set`), so every member learns the same outcome within milliseconds and
nobody waits on a timeout, however long the others take to reach their switch step. Only
after "go", when every member is known to be there, does `init_process_group` connect them.

Leaving is prompt on every member alike: `GradientAllReduce` makes a generation's gradient
all-reduces abortable from another thread, which gloo itself cannot do.

Forgetting: once a later generation commits, nobody reads an older one's keys again, and the
controller deletes them (`forget_generation`): the barrier's two and the address each rank's
gloo connect wrote, ~8W bytes each. Left alone they added up to ~8W^2 bytes per formation.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.comm.retirement import retirement

# NCCL's watchdog must turn a dead peer into an error in the waiting thread, and abort only
# the broken communicator: mode 2 ("CleanUpOnly"). Modes 1 and 3 tear the whole process down,
# which would kill every survivor of a death; 0 would leave a survivor hanging.
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_SURVIVOR_MODE = "2"
os.environ[NCCL_ERROR_HANDLING] = NCCL_SURVIVOR_MODE

# After the barrier every member is known to be present, so connecting takes milliseconds (at
# most 0.31 s in this project's suite and soak runs, 8 workers on 2 cores); the timeout bounds
# only a member that dies in that window. A survivor that listens for the dead member's
# connection waits five times it in gloo (measured: 50 s at 10 s, 15 s at 3 s, 0.51 s at 0.1 s).
# The controller offers each generation a deadline from the last connect's time
# (`elastic.controller.policies.connect_deadline`, at most `CONNECT_CEILING_S`, this value);
# this is a spec's default.
CONNECT_TIMEOUT_S = 3.0
# How long one wait on the barrier's outcome key lasts before it is renewed.
BARRIER_POLL_S = 30.0
GO, ABORT = "go", "abort"
# How often a rank waiting on the end-of-step agreement (`GradientAllReduce.agree`) looks for
# its outcome or an abort: the first pause and the longest.
AGREE_POLL_S = (0.0005, 0.01)
# How the reason an aborted all-reduce fails with begins.
PEER_ABORT_MARKER = "process group was aborted"

@dataclass(frozen=True)
class GenerationSpec:
    """Everything a worker needs to join generation `generation` as `rank`."""

    generation: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    store_host: str
    store_port: int
    backend: str
    reason: str
    collective_timeout_s: float
    # How long connecting the generation's groups may take (`elastic.controller.policies.connect_deadline`).
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    # Where the members of the running generation switch to this one; None: at once.
    switch_step: int | None = None
    # No member holds live state: every member drops its progress and rank 0 loads this
    # checkpoint (None: the run restarts from step 0).
    restart: bool = False
    resume_from: Any = None
    # The node of every rank (each rank's node_rank); () where unknown: the flat all-reduce.
    nodes: tuple[int, ...] = ()
    # Some member was not in the running generation (a spare, a replacement): it begins at the next
    # step, so a member inside a between-steps block declines (`Membership.join`).
    newcomers: bool = False

    @property
    def prefix(self) -> str:
        return generation_prefix(self.generation)


def generation_prefix(generation: int) -> str:
    return f"generation/{generation}"


def outcome_key(generation: int) -> str:
    return f"{generation_prefix(generation)}/outcome"


# Where gloo's connect of a generation's default group writes each rank's address. torch puts a
# group's keys under PrefixStore(f"{group_name}/") and then PrefixStore(f"{device}/")
# (torch/distributed/distributed_c10d.py, `_new_process_group_helper`); ProcessGroupGloo connects
# one gloo context per device under PrefixStore(str(index)), and gloo's connectFullMesh sets one key
# per rank, named by the rank. PrefixStore joins with "/". The default group is named "0" (the
# first group of a fresh world, after `destroy_process_group`) and has one gloo device unless
# GLOO_SOCKET_IFNAME names several interfaces. tests/test_store_keys.py checks it against torch.
GLOO_CONNECT_KEYS = "group/0//cpu//0/{rank}"


def generation_keys(generation: int, world_size: int, backend: str) -> list[str]:
    """The keys generation `generation` of `world_size` members leaves in the store: its barrier's,
    and on gloo each rank's address from the connect of its default group."""
    prefix = generation_prefix(generation)
    keys = [f"{prefix}/arrived", outcome_key(generation)]
    if backend == "gloo":
        keys += [f"{prefix}/{GLOO_CONNECT_KEYS.format(rank=rank)}" for rank in range(world_size)]
    return keys


def forget_generation(store: dist.Store, generation: int, world_size: int, backend: str) -> int:
    """Delete what generation `generation` left in the store (`generation_keys`); call once a later
    generation committed, when no member reads them again. The number of keys it deleted."""
    return sum(store.delete_key(key) for key in generation_keys(generation, world_size, backend))


def abort_generation(store: dist.Store, generation: int) -> bool:
    """Cancel generation `generation` unless every member already arrived; True if cancelled."""
    return store.compare_set(outcome_key(generation), "", ABORT).decode() == ABORT


def rendezvous(spec: GenerationSpec, store: dist.Store) -> bool:
    """Wait, without a deadline, until every member arrived (True) or the controller aborted
    the generation (False)."""
    key = outcome_key(spec.generation)
    if store.add(f"{spec.prefix}/arrived", 1) == spec.world_size:
        store.compare_set(key, "", GO)
    while True:
        try:
            store.wait([key], timedelta(seconds=BARRIER_POLL_S))
            return store.get(key).decode() == GO
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise


def _agreement_keys(generation: int, step: int) -> tuple[str, str]:
    """The count and the outcome of `GradientAllReduce.agree` on `step` in `generation`."""
    count = f"{generation_prefix(generation)}/averaged/{step}"
    return count, f"{count}/outcome"


def set_torchrun_env(spec: GenerationSpec) -> None:
    """Expose the generation as torchrun's environment variables."""
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.local_rank),
        LOCAL_WORLD_SIZE=str(spec.local_world_size),
        GROUP_RANK=str(spec.node_rank),
        MASTER_ADDR=spec.store_host,
        MASTER_PORT=str(spec.store_port),
        TORCHELASTIC_RESTART_COUNT=str(spec.generation),
    )


class StoreClient:
    """One connection to the controller's TCPStore, reused by every generation."""

    def __init__(self) -> None:
        self._store: dist.TCPStore | None = None
        self._address: tuple[str, int] | None = None

    def get(self, host: str, port: int) -> dist.TCPStore:
        if self._address != (host, port):
            self._store = dist.TCPStore(
                host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
            )
            self._address = (host, port)
        return self._store


def form_group(spec: GenerationSpec, store: dist.TCPStore) -> None:
    """Connect the default process group of generation `spec.generation`; call after a "go".

    The collective timeout applies once the group exists; connecting is bounded by the spec's
    connect timeout, which only a member dying right after the barrier (or a machine far slower
    than at the last connect) can reach.
    """
    leave_group(spec.backend)
    set_torchrun_env(spec)
    # torch names a default group by the count of groups the process created, and a connect that
    # failed (a member died after the barrier) counted one without any destroy to reset it: the
    # survivors would name the next generation's group "1" and a worker that never saw the failure
    # "0", each waiting for the other's connect keys (GLOO_CONNECT_KEYS). Every member starts at 0.
    dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(
        spec.backend,
        store=dist.PrefixStore(f"{spec.prefix}/group", store),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=min(spec.connect_timeout_s, spec.collective_timeout_s)),
    )
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=spec.collective_timeout_s))


class GradientAllReduce:
    """The gradient all-reduces of one generation's group, which another thread can abort.

    When a peer dies, gloo fails at once only the ranks next to it in its ring; every other
    rank fails when a neighbour of its own drops the group, one rank after another (measured
    on 2 cores: 0.4 s until the last of 15 survivors knew). The controller's heal offer frees
    them all at once: its abort (`elastic.comm.generation.GenerationGroup.abort`) severs the
    generation's connections, which fails every gloo operation waiting on them, DDP's own C++
    all-reduce included, at any world size. So DDP's gradients take its own path at every
    world size, with no Python hook (which cost 2-4% of the benchmark's 25 ms step at 2 ranks,
    `benchmarks/hook_cost.py`). Where the replicas' own averages and agreement need more
    (`abortable`), an abort also fails the futures they wait on at once, and later all-reduces
    of the generation fail without starting; otherwise this passes calls on.

    `world` sums across the generation's default group: gloo's flat ring unless the generation
    reduces within its nodes first (`elastic.comm.hierarchical`).
    """

    def __init__(self, generation: int, abortable: bool,
                 world: Callable[[torch.Tensor], torch.futures.Future] | None = None) -> None:
        self.generation = generation
        self.abortable = abortable
        self.aborted: str | None = None  # the reason, once aborted
        self._world = world or flat_all_reduce
        self._lock = threading.Lock()
        self._pending: set[torch.futures.Future] = set()

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.futures.Future:
        """Sum `tensor` across `group` (the generation's default group, through `world`, if None) in
        place: a future of it, failed if the generation is aborted. Nothing here keeps `group` alive: a
        callback that dropped its last reference would run its destructor on gloo's own thread, which
        joins itself."""
        reduce = self._world if group is None else functools.partial(flat_all_reduce, group=group)
        if not self.abortable:
            return reduce(tensor)
        result: torch.futures.Future = torch.futures.Future()
        with self._lock:
            started = None if self.aborted else reduce(tensor)
            if started is not None:
                self._pending.add(result)
        if started is None:
            result.set_exception(RuntimeError(self.aborted))
        else:
            started.add_done_callback(lambda done: self._settle(result, done))
        return result

    def agree(self, store: dist.Store, step: int, world_size: int) -> None:
        """Return once every rank of the generation finished `step`'s gradient averages, or
        raise a peer failure on every survivor alike if the generation was aborted first.

        A collective cannot decide this: a death inside it can complete it on some ranks and
        not on others, leaving one worker a step ahead of its replica, which no sync can undo.
        The controller's store decides instead, as the rendezvous does: the last rank to count
        itself in writes "go", and a rank told of the abort writes "abort"; whoever writes first
        wins, and every rank reads that one outcome. A rank whose average failed never counts
        itself in, so "go" means that every rank holds its averaged gradients.
        """
        key, outcome = _agreement_keys(self.generation, step)
        if store.add(key, 1) == world_size:
            store.compare_set(outcome, "", GO)
            # Every rank counted itself into `step`, so none reads the step before's keys again.
            for done in _agreement_keys(self.generation, step - 1):
                store.delete_key(done)
        # The abort comes from the control thread, which cannot use this thread's store
        # connection while it waits; so this thread polls, backing off from a fraction of a
        # millisecond (the wait is that short when no rank failed). A store wait with a timeout
        # would log a warning at each expiry.
        pause_s = AGREE_POLL_S[0]
        while not store.check([outcome]):
            if self.aborted is not None:
                store.compare_set(outcome, "", ABORT)
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, AGREE_POLL_S[1])
        if store.get(outcome).decode() != GO:
            raise RuntimeError(self.aborted or f"{PEER_ABORT_MARKER}: generation {self.generation} was aborted")

    def abort(self, reason: str) -> None:
        """Fail every pending and later all-reduce of this generation with `reason`."""
        with self._lock:
            self.aborted = self.aborted or reason
            failed, self._pending = self._pending, set()
        for future in failed:
            future.set_exception(RuntimeError(reason))

    def _settle(self, result: torch.futures.Future, done: torch.futures.Future) -> None:
        with self._lock:
            if result not in self._pending:
                return  # aborted: already failed
            self._pending.discard(result)
        try:
            value = done.value()
        except Exception as exc:
            result.set_exception(exc)
            return
        result.set_result(value)


def flat_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.futures.Future:
    """Sum `tensor` across `group` (the default group if None) in place, in one collective: a future of it."""
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda done: done.value()[0])


def leave_group(backend: str, held: list[Any] | None = None) -> None:
    """Drop the current process group, if any, without waiting on peers that may be dead.

    NCCL's groups are taken out of torch's registry and aborted on the retirement thread
    (`elastic.comm.retirement`), which holds the last references to them and to `held`.

    A gloo group is let go of on a thread of its own. Its last reference closes its sockets
    one peer at a time, and each close waits for a tick of gloo's event loop (up to 10 ms):
    ~0.15 s at 16 ranks on the train thread, in every heal and every grow. It also joins
    gloo's threads, which wait for any operation still blocked on a dead peer: among them a
    send that gloo started on a connection the abort had already severed, which gloo does not
    fail and which waits for the peer's readiness until the collective timeout (seen in the
    hierarchy's queued reduces, tests/test_hierarchical.py). No garbage
    collection is forced here either: it cost about 0.2 s of every heal and grow.

    `held` lists the caller's last references to subgroups of the group (a run of replicas'),
    or to what holds them; they go to the same thread, and the list is emptied.
    """
    if not dist.is_initialized():
        return
    if backend == "nccl":
        # NCCL's abort lasts about a second: it runs on the retirement thread, off the heal's path.
        retirement.retire(forget_every_group(), held or [])
        if held:
            held.clear()
        return
    # The only reference outside torch's registry goes to the thread, so it is the last. Not
    # a daemon: the interpreter waits for it at exit instead of tearing gloo down under it.
    parcel = [dist.group.WORLD, *(held or [])]
    if held:
        held.clear()
    dist.destroy_process_group()
    threading.Thread(target=parcel.clear, name="elastic-leave").start()


def forget_every_group() -> list[dist.ProcessGroup]:
    """Take every process group out of torch's registry without aborting or destroying any, and
    return them in the order every rank aborts them: the default group first, then the others by
    name, reversed.

    The order is the same on every rank, because an NCCL abort can wait for the node's other ranks
    to abort the same communicator (NCCL's proxy thread stays while peers keep connections to it,
    https://github.com/NVIDIA/nccl/issues/863): two ranks aborting two groups in opposite orders
    would wait for each other (https://github.com/pytorch/pytorch/issues/119797). The default group
    comes first because the control thread's abort of a stale generation (`GenerationGroup.abort`)
    aborts it alone, ahead of whatever else is queued.

    It clears what torch 2.13's `_abort_process_group()` clears after its aborts
    (torch/distributed/distributed_c10d.py), so that the next generation's `init_process_group`
    forms a default group named "0" while these are still being aborted elsewhere.
    tests/test_retirement.py checks it against torch.
    """
    c10d = dist.distributed_c10d
    world = c10d._world
    default = world.default_pg
    others = sorted((group for group in world.pg_names if group is not default),
                    key=lambda group: world.pg_names[group], reverse=True)
    c10d._update_default_pg(None)
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                     world.tags_to_pg, world.pg_coalesce_state):
        registry.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
    return ([default] if default is not None else []) + others
