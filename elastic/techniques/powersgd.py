"""PowerSGD gradient compression whose state survives every heal and grow.

PowerSGD (Vogels et al., 2019) sends, for each gradient matrix M (n x m), two thin factors
instead: P = M Q (n x r) and Q = M^T P (m x r), each all-reduced, with P orthogonalized in
between; M is replaced by P Q^T. Q is kept for the next step (warm start), and each rank
keeps the error M - P Q^T of its own gradient and adds it to the next one (error feedback).
Vectors (biases) and matrices too small to gain are all-reduced plainly.

torch's `powerSGD_hook` keys that state by DDP bucket. Buckets are rebuilt after the first
step of every DDP, which elastic builds anew in every generation, so bucket-keyed state would
meet other tensors after a rescale; and a newcomer with a fresh `iter` would all-reduce
uncompressed while the others send factors, which gloo answers by killing the process. Here
the state is keyed by parameter, and it moves with the run:

- replicated (the same on every rank, synced from the source like the model): `iter`, the
  random generator that draws the first Q, and each Q;
- per rank: the error buffers. At each new generation they become the average over the
  ranks that held them, newcomers included in receiving it. The averaged gradient then
  carries the same correction (1/W' * W' * mean = mean), so a planned rescale stays exact;
  after a death it is the survivors' average, an approximation.

The hook does not wait for the link until the last bucket. Bucket k's hook computes its P
and starts P's all-reduce; the next bucket's hook (or bucket k's own, if it is the last)
orthogonalizes the summed P, computes Q and starts Q's all-reduce; the last bucket's hook
then rebuilds every bucket's gradients as its Q comes back. So the factors travel while the
backward computes, and every rank issues its collectives in one order (bucket k's P, then
bucket k's Q ahead of bucket k+1's), which gloo needs: it matches collectives by issue order.
torch's `powerSGD_hook` issues Q from P's completion on gloo's thread instead, an order that
can differ between ranks. The products run on the training thread: rebuilt on gloo's thread
(as Q's completion callback) rank 4 ran at 1.68x DDP over 1 Gbit/s in one round, against 2.38x
here, the cause not isolated. `start_iter` steps all-reduce plainly first, as torch's
`start_powerSGD_iter` does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic.comm.state_sync import RunState
from elastic.config import PowerSGDSpec, Strategy
from elastic.techniques.technique import Codec, RankState, Run


class PowerSGD:
    """One worker's PowerSGD state and hook body, for every generation of the run."""

    def __init__(self, params: list[torch.nn.Parameter], approximation_rank: int, start_iter: int, seed: int = 0) -> None:
        self.approximation_rank = approximation_rank
        self.start_iter = start_iter
        self.iter = 0  # steps whose gradients were all-reduced, plainly or compressed
        self.rng = torch.Generator().manual_seed(seed)
        self.q: dict[int, torch.Tensor] = {}
        self.error: dict[int, torch.Tensor] = {}
        # What the step in flight changes, applied only when it commits: a step that fails
        # is redone, and its gradient must not be in the error buffers twice.
        self._staged = _Staged()
        self._on_wire: _Factors | None = None  # the bucket whose P is being summed
        self._unfinished: list[_Unfinished] = []  # this step's buckets, each finished by the last hook
        self.bytes_sent = 0
        self._index = {id(p): i for i, p in enumerate(params)}

    def all_reduce(self, bucket: dist.GradBucket,
                   reduce: Callable[[torch.Tensor], torch.futures.Future]) -> torch.futures.Future:
        """Average the bucket's gradients across ranks; a future of the bucket's buffer."""
        buffer = bucket.buffer()
        world_size = dist.get_world_size()
        if self._on_wire is not None:
            self._send_q(reduce)
        if self.iter < self.start_iter:
            self.bytes_sent += buffer.numel() * buffer.element_size()
            future = reduce(buffer.div_(world_size))
        else:
            future = self._compress(bucket, world_size, reduce)
        if bucket.is_last():
            if self._on_wire is not None:
                self._send_q(reduce)
            self._staged.iters = 1
            self._finish()
        return future

    def commit(self) -> None:
        """The step committed: keep what it changed."""
        self.q.update(self._staged.q)
        self.error.update(self._staged.error)
        self.iter += self._staged.iters
        self._staged = _Staged()

    def discard(self) -> None:
        """The step failed and will be redone: forget what it changed, and the bucket whose Q
        was never sent (the redone step's hooks start from its first bucket)."""
        if self._staged.rng is not None:
            self.rng.set_state(self._staged.rng)
        self._staged = _Staged()
        self._on_wire = None
        self._unfinished = []

    def _compress(self, bucket: dist.GradBucket, world_size: int,
                  reduce: Callable[[torch.Tensor], torch.futures.Future]) -> torch.futures.Future:
        """Start the bucket's plain all-reduce and its P's; a future of the buffer, complete
        once the last hook rebuilt its gradients (`_finish`)."""
        unfinished = _Unfinished(bucket.buffer())
        self._unfinished.append(unfinished)
        matrices, plain = [], []
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            matrix = grad.view(grad.shape[0], -1) if grad.dim() > 1 else None
            rank = min(*matrix.shape, self.approximation_rank) if matrix is not None else 0
            if matrix is not None and (matrix.shape[0] + matrix.shape[1]) * rank < matrix.numel():
                matrices.append((self._index[id(param)], matrix, rank))
            else:
                plain.append(grad)
        if plain:
            flat = torch.cat([g.reshape(-1) for g in plain])
            unfinished.steps.append(functools.partial(_unflatten_mean, plain, world_size, self._send(flat, reduce)))
        if matrices:
            staged = self._staged
            ps = []
            for index, matrix, rank in matrices:
                if index in self.error:
                    matrix.add_(self.error[index])
                # The generator draws a first Q once per parameter: a redone step draws it again,
                # so it is saved before and restored if the step fails (with the rest, at commit).
                q = self.q.get(index)
                if q is None:
                    if staged.rng is None:
                        staged.rng = self.rng.get_state()
                    q = torch.randn(matrix.shape[1], rank, generator=self.rng, dtype=matrix.dtype).to(matrix.device)
                ps.append(matrix @ _orthonormal(q))
            flat_p = torch.cat([p.reshape(-1) for p in ps])
            self._on_wire = _Factors(matrices, [p.shape for p in ps], flat_p, self._send(flat_p, reduce),
                                     staged, world_size, unfinished)
        return unfinished.done

    def _send_q(self, reduce: Callable[[torch.Tensor], torch.futures.Future]) -> None:
        """Finish the bucket whose P is on the wire: wait for its sum, send Q = M^T P."""
        factors, self._on_wire = self._on_wire, None
        factors.p_summed.wait()
        ps = [_orthonormal(p) for p in _split(factors.flat_p, factors.p_shapes)]
        # M^T P as (P^T M)^T: the same product, but torch's CPU matmul over a transposed M is
        # several times slower at rank 4 (the MLP of benchmarks/network.py).
        qs = [(p.t() @ matrix).t() for (_, matrix, _), p in zip(factors.matrices, ps)]
        flat_q = torch.cat([q.reshape(-1) for q in qs])
        rebuild = functools.partial(_rebuild, factors, ps, [q.shape for q in qs], self._send(flat_q, reduce))
        factors.unfinished.steps.append(rebuild)

    def _finish(self) -> None:
        """In the last bucket's hook: rebuild each bucket's gradients as its all-reduces come
        back, and complete the futures DDP waits on (failed from the first that failed on)."""
        unfinished, self._unfinished = self._unfinished, []
        error = None
        for bucket in unfinished:
            if error is None:
                try:
                    for step in bucket.steps:
                        step()
                except Exception as exc:
                    error = exc
            if error is None:
                bucket.done.set_result(bucket.buffer)
            else:
                bucket.done.set_exception(error)
        if error is not None:
            raise error

    def _send(self, flat: torch.Tensor, reduce: Callable[[torch.Tensor], torch.futures.Future]) -> torch.futures.Future:
        """Start summing `flat` across ranks in place, through the generation's abortable all-reduce."""
        self.bytes_sent += flat.numel() * flat.element_size()
        return reduce(flat)

    # --- the state a heal or a grow carries -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"iter": self.iter, "rng": self.rng.get_state(), "q": dict(self.q), "error": dict(self.error)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = state["iter"]
        self.rng.set_state(state["rng"])
        self.q = dict(state["q"])
        self.error = dict(state["error"])

    def local_state(self) -> dict[str, Any]:
        """The per-rank part: the error buffers."""
        return dict(sorted(self.error.items()))  # one order on every rank, for the average

    def load_local_state(self, error: dict[int, torch.Tensor]) -> None:
        self.error = dict(error)


class PowerSGDCompression(Codec):
    """`Strategy(compression="powersgd:...")` as a technique: the `PowerSGD` of the prepared model, its
    step's changes kept only if the step commits, its error buffers a per-rank state."""

    hooks_gradients = True
    keeps_torch_buckets = True  # why: `elastic.worker.data_parallel.GLOO_BUCKET_CAP_MB`

    def __init__(self, spec: PowerSGDSpec, seed: int) -> None:
        self._spec, self._seed = spec, seed
        self._powersgd: PowerSGD | None = None  # made by prepare_model

    @classmethod
    def build(cls, strategy: Strategy, run: Run) -> PowerSGDCompression | None:
        spec = strategy.compression_options
        return cls(spec, run.seed) if isinstance(spec, PowerSGDSpec) else None

    def prepare_model(self, model: torch.nn.Module, state: RunState) -> None:
        self._powersgd = state.powersgd = PowerSGD(list(model.parameters()), self._spec.rank,
                                                   self._spec.start_iter, seed=self._seed)

    def all_reduce(self, bucket: dist.GradBucket,
                   reduce: Callable[[torch.Tensor], torch.futures.Future]) -> torch.futures.Future:
        return self._powersgd.all_reduce(bucket, reduce)

    def committed(self) -> None:
        if self._powersgd is not None:
            self._powersgd.commit()

    def failed(self) -> None:
        if self._powersgd is not None:  # a formation before the model is prepared calls it too
            self._powersgd.discard()

    def rank_states(self, optimizer: torch.optim.Optimizer | None) -> list[RankState]:
        if self._powersgd is None:
            return []
        return [RankState("powersgd", "error", self._powersgd.local_state, self._powersgd.load_local_state)]

    @property
    def bytes_sent(self) -> int:
        return self._powersgd.bytes_sent if self._powersgd is not None else 0


@dataclass
class _Factors:
    """A bucket whose P factors are being summed: what its Q and its rebuilt gradients need."""

    matrices: list[tuple[int, torch.Tensor, int]]  # (parameter index, gradient matrix + error, rank)
    p_shapes: list[torch.Size]
    flat_p: torch.Tensor
    p_summed: torch.futures.Future
    staged: _Staged
    world_size: int
    unfinished: _Unfinished


@dataclass
class _Unfinished:
    """A bucket of this step: what rebuilds its gradients once its all-reduces are back, and
    the future of its buffer that DDP waits on."""

    buffer: torch.Tensor
    steps: list[Callable[[], None]] = field(default_factory=list)
    done: torch.futures.Future = field(default_factory=torch.futures.Future)


def _rebuild(factors: _Factors, ps: list[torch.Tensor], q_shapes: list[torch.Size],
             q_summed: torch.futures.Future) -> None:
    """Once Q is summed: each gradient becomes P Q^T, and the error left (M - P Q^T) is
    staged for the next step."""
    qs = [q.div_(factors.world_size) for q in _split(q_summed.wait(), q_shapes)]
    for (index, matrix, _), p, q in zip(factors.matrices, ps, qs):
        factors.staged.q[index] = q
        factors.staged.error[index] = torch.addmm(matrix, p, q.t(), alpha=-1)
        torch.matmul(p, q.t(), out=matrix)


def _unflatten_mean(grads: list[torch.Tensor], world_size: int, summed: torch.futures.Future) -> None:
    for grad, part in zip(grads, _split(summed.wait().div_(world_size), [g.shape for g in grads])):
        grad.copy_(part)


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    return [part.view(shape) for part, shape in zip(flat.split([shape.numel() for shape in shapes]), shapes)]


@dataclass
class _Staged:
    """What the step in flight changed: new Qs and errors, iterations, the generator before."""

    q: dict[int, torch.Tensor] = field(default_factory=dict)
    error: dict[int, torch.Tensor] = field(default_factory=dict)
    iters: int = 0
    rng: torch.Tensor | None = None


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of `matrix`'s columns (QR). Signs may differ from Gram-Schmidt's,
    which P Q^T does not see: a column's sign flips in P and in Q = M^T P alike."""
    return torch.linalg.qr(matrix, mode="reduced").Q
