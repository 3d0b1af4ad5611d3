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

The hook waits for its all-reduces itself (they depend on each other), so a compressed
bucket does not overlap with the rest of the backward. `start_iter` steps all-reduce plainly
first, as torch's `start_powerSGD_iter` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist


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
        self.bytes_sent = 0
        self._index = {id(p): i for i, p in enumerate(params)}

    def all_reduce(self, bucket: dist.GradBucket,
                   reduce: Callable[[torch.Tensor], torch.futures.Future]) -> torch.futures.Future:
        """Average the bucket's gradients across ranks; a future of the bucket's buffer."""
        buffer = bucket.buffer()
        world_size = dist.get_world_size()
        if self.iter < self.start_iter:
            self.bytes_sent += buffer.numel() * buffer.element_size()
            future = reduce(buffer.div_(world_size))
        else:
            self._compress(bucket, world_size, reduce)
            future = torch.futures.Future()
            future.set_result(buffer)
        if bucket.is_last():
            self._staged.iters = 1
        return future

    def commit(self) -> None:
        """The step committed: keep what it changed."""
        self.q.update(self._staged.q)
        self.error.update(self._staged.error)
        self.iter += self._staged.iters
        self._staged = _Staged()

    def discard(self) -> None:
        """The step failed and will be redone: forget what it changed."""
        if self._staged.rng is not None:
            self.rng.set_state(self._staged.rng)
        self._staged = _Staged()

    def _compress(self, bucket: dist.GradBucket, world_size: int,
                  reduce: Callable[[torch.Tensor], torch.futures.Future]) -> None:
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
            self._send(flat, reduce)
            flat.div_(world_size)
            for grad, part in zip(plain, flat.split([g.numel() for g in plain])):
                grad.copy_(part.view_as(grad))
        if not matrices:
            return
        staged = self._staged
        wanted, warm = {}, {}
        for index, matrix, rank in matrices:
            if index in self.error:
                matrix.add_(self.error[index])
            wanted[index] = matrix.clone()
            # The generator draws a first Q once per parameter: a redone step draws it again,
            # so it is saved before and restored if the step fails (with the rest, at commit).
            q = self.q.get(index)
            if q is None:
                if staged.rng is None:
                    staged.rng = self.rng.get_state()
                q = torch.randn(matrix.shape[1], rank, generator=self.rng, dtype=matrix.dtype).to(matrix.device)
            warm[index] = _orthonormal(q)
        ps = [matrix @ warm[index] for index, matrix, _ in matrices]
        ps = [_orthonormal(p) for p in self._sum(ps, reduce)]
        # M^T P as (P^T M)^T: the same product, but torch's CPU matmul over a transposed M is
        # several times slower at rank 4 (the MLP of benchmarks/network.py).
        qs = [(p.t() @ matrix).t() for (_, matrix, _), p in zip(matrices, ps)]
        qs = [q.div_(world_size) for q in self._sum(qs, reduce)]
        for (index, matrix, _), p, q in zip(matrices, ps, qs):
            staged.q[index] = q
            torch.matmul(p, q.t(), out=matrix)
            staged.error[index] = wanted[index] - matrix

    def _sum(self, tensors: list[torch.Tensor],
             reduce: Callable[[torch.Tensor], torch.futures.Future]) -> list[torch.Tensor]:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._send(flat, reduce)
        return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    def _send(self, flat: torch.Tensor, reduce: Callable[[torch.Tensor], torch.futures.Future]) -> None:
        """Sum `flat` across ranks in place, through the generation's abortable all-reduce."""
        self.bytes_sent += flat.numel() * flat.element_size()
        reduce(flat).wait()

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
