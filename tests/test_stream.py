"""Iterable datasets as step sources: each step draws the stream's next global batch, ranks
split it, and the committed position travels as synced state. Several ranks are simulated by
one loader each over its own copy of the dataset; no Ray."""

import pytest
import torch

from elastic.config import DataConfig
from elastic.data.loader import open_loader
from elastic.data.order import DataCursor
from elastic.data.stream import StreamLoader
from elastic.errors import ElasticError


class Counting(torch.utils.data.IterableDataset):
    """Yields its sample numbers (offset by 1000 per epoch); saves where it is, as torchdata's Stateful."""

    def __init__(self, length):
        self.length, self.position, self.epoch = length, 0, 0

    def __iter__(self):
        while self.position < self.length:
            self.position += 1
            yield torch.tensor([float(self.position - 1 + 1000 * self.epoch)])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]

    def set_epoch(self, epoch):
        self.epoch = epoch


class Forgetful(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(10)


def _config(**options):
    return DataConfig(global_batch_size=6, micro_batch_size=2, max_steps=100, **options)


def _train(world_sizes, length, drop_last=False, prefetch_threads=0, fail_at=()):
    """Steps through `world_sizes` (one per step) with a fresh set of loaders at every change, the
    newcomers given the first rank's synced state; returns {epoch: [values]} of what was trained."""
    config = _config(drop_last=drop_last, prefetch_threads=prefetch_threads)
    cursor, seen, loaders = DataCursor(), {}, []
    for index, world_size in enumerate(world_sizes):
        if len(loaders) != world_size:
            state = loaders[0].state_dict() if loaders else None
            for loader in loaders:
                loader.close()
            loaders = [open_loader(Counting(length), config) for _ in range(world_size)]
            if state is not None:
                for loader in loaders:
                    loader.load_state_dict(state)
        settled = {loader.settle(cursor) for loader in loaders}
        assert len(settled) == 1, "ranks disagree on where the step starts"
        cursor = settled.pop()
        if index in fail_at:
            for loader in loaders:  # a step that failed is drawn again, and must be the same
                loader.step(cursor, world_size, 0)
        for rank, loader in enumerate(loaders):
            for micro in loader.step(cursor, world_size, rank):
                if micro.samples:
                    values = micro.data.flatten().tolist()
                    assert values == [i + 1000 * cursor.epoch for i in micro.indices.tolist()]
                    seen.setdefault(cursor.epoch, []).extend(values)
        cursor = [loader.advance(cursor) for loader in loaders][0]
    for loader in loaders:
        loader.close()
    return seen


@pytest.mark.parametrize("prefetch_threads", [0, 1])
def test_a_stream_is_trained_exactly_once_per_epoch_through_changes_of_world_size(prefetch_threads):
    seen = _train([2, 2, 3, 3, 1, 4, 4, 2, 2, 3, 3, 3], length=20, prefetch_threads=prefetch_threads, fail_at={4, 8})
    # 20 samples in steps of 6: 6, 6, 6, 2 per epoch, the last step kept.
    assert sorted(seen[0]) == [float(i) for i in range(20)]
    assert sorted(seen[1]) == [float(1000 + i) for i in range(20)]
    assert sorted(seen[2]) == [float(2000 + i) for i in range(20)]


def test_with_drop_last_a_streams_short_tail_is_not_a_step():
    seen = _train([2, 3, 3, 2, 2, 4], length=20, drop_last=True)
    assert sorted(seen[0]) == [float(i) for i in range(18)]
    assert sorted(seen[1]) == [float(1000 + i) for i in range(18)]


def test_a_stream_ending_on_a_step_boundary_starts_the_next_epoch_at_that_step():
    seen = _train([2] * 5, length=12)
    assert sorted(seen[0]) == [float(i) for i in range(12)] and len(seen[2]) == 6


def test_an_iterable_dataset_that_cannot_save_its_position_is_refused():
    with pytest.raises(ElasticError, match=r"Forgetful is an iterable dataset without state_dict\(\) and "
                                           r"load_state_dict\(\).*torchdata's Stateful"):
        open_loader(Forgetful(), _config())
    assert isinstance(open_loader(Counting(20), _config()), StreamLoader)
    with pytest.raises(ElasticError, match=r"ctx.steps\(\) needs a map-style dataset .* or an iterable one .*got int"):
        open_loader(42, _config())


def test_an_iterable_dataset_with_no_sample_in_an_epoch_is_refused():
    loader = open_loader(Counting(0), _config())
    with pytest.raises(ElasticError, match=r"Counting yielded 0 samples in epoch 0; an iterable dataset must yield at least one sample per epoch"):
        loader.settle(DataCursor())


def test_the_names_elastic_registers_are_refused_to_the_train_loop():
    from elastic.worker.context import TrainContext

    ctx = TrainContext(_config(), mailbox=None, faults=[], report_sink=lambda record: None, use_gpu=False)
    for name in ("rng", "data_stream"):
        with pytest.raises(ElasticError, match=rf"state '{name}' is already registered; pick another name"):
            ctx.register_state(name, torch.zeros(1))
