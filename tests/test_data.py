"""The data cursor, the epoch order, the batch split, the gradient weights and the loader:
pure math, plain threads and worker processes, no Ray."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elastic.config import DataConfig
from elastic.data.loader import Loader
from elastic.data.order import (
    DataCursor,
    EpochOrder,
    fetch,
    gradient_weight,
    map_style_blocks,
    micro_batches_of,
    micro_bounds,
    micro_count,
    share_bounds,
    step_positions,
)
from elastic.data.parquet import ParquetDataset
from elastic.errors import ElasticError


@pytest.mark.parametrize("global_batch, world_size", [(64, 1), (64, 3), (10, 4), (7, 7), (100, 6)])
def test_shares_cover_the_global_batch_without_overlap_and_differ_by_at_most_one(global_batch, world_size):
    bounds = [share_bounds(global_batch, world_size, r) for r in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == global_batch
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("step_samples, world_size, micro_batch_size",
                         [(64, 3, 7), (64, 3, 8), (256, 7, 4), (63, 2, 31), (5, 4, 1), (3, 4, 2), (64, 1, 64)])
def test_every_rank_cuts_its_share_into_as_many_micro_batches_of_at_most_the_micro_batch_size(
        step_samples, world_size, micro_batch_size):
    # ZeRO-2/3 gather parameters in each micro-batch's forward: every rank must run as many.
    count = micro_count(step_samples, world_size, micro_batch_size)
    for rank in range(world_size):
        start, stop = share_bounds(step_samples, world_size, rank)
        bounds = micro_bounds(stop - start, count)
        assert len(bounds) == count
        assert all(0 <= b - a <= micro_batch_size for a, b in bounds)
        assert [a for a, _ in bounds[1:]] == [b for _, b in bounds[:-1]] and bounds[-1][1] == stop - start
    assert micro_bounds(22, 4) == [(0, 6), (6, 12), (12, 17), (17, 22)]
    assert micro_bounds(1, 2) == [(0, 1), (1, 1)]  # an empty one: a pass that weighs 0


def test_a_micro_batch_left_empty_passes_over_the_shares_first_sample_and_weighs_nothing():
    ids = torch.tensor([40])
    loaded = micro_batches_of(ids, lambda a, b: ids[a:b].tolist(), micro_batch_size=1, step_samples=3, world_size=2)
    assert [(m.indices.tolist(), m.data, m.samples) for m in loaded] == [([40], [40], 1), ([], [40], 0)]


def test_gradient_weights_of_an_uneven_split_sum_to_the_world_size():
    # DDP divides by W, so weights summing to W make the step the exact global-batch mean.
    shares = [22, 21, 21]
    assert sum(gradient_weight(n, 3, 64) for n in shares) == pytest.approx(3.0)


def test_weighted_ddp_average_equals_the_global_batch_mean_for_an_uneven_split():
    losses = torch.arange(64, dtype=torch.float64)
    world_size = 3
    per_rank = []
    for rank in range(world_size):
        start, stop = share_bounds(64, world_size, rank)
        share = losses[start:stop]
        per_rank.append(share.mean() * gradient_weight(len(share), world_size, 64))
    assert (sum(per_rank) / world_size).item() == pytest.approx(losses.mean().item())


def test_an_epochs_last_partial_step_is_kept_by_default_and_dropped_with_drop_last():
    kept, dropped = DataCursor(seed=3), DataCursor(seed=3)
    sizes = []
    for _ in range(4):
        sizes.append(kept.step_samples(64, 200))
        kept = kept.advance(64, 200)
        dropped = dropped.advance(64, 200, drop_last=True) if dropped.epoch == 0 else dropped
    assert sizes == [64, 64, 64, 8]
    assert kept == DataCursor(epoch=1, consumed=0, seed=3)
    assert dropped == DataCursor(epoch=1, consumed=0, seed=3)
    three = DataCursor(seed=3)
    for _ in range(3):
        three = three.advance(64, 200, drop_last=True)
    assert three.epoch == 1, "with drop_last the 8 samples left after three steps are not a step"


@pytest.mark.parametrize("blocks, window", [([4096] * 3 + [17], 5000), ([7, 1, 30, 12, 50], 16), ([120], 1000)])
def test_the_epoch_order_is_a_seeded_permutation_that_changes_per_epoch(blocks, window):
    n = sum(blocks)
    first = EpochOrder(blocks, epoch=0, seed=1, shuffle=True, window=window).ids(0, n)
    assert sorted(first.tolist()) == list(range(n))
    assert torch.equal(first, EpochOrder(blocks, epoch=0, seed=1, shuffle=True, window=window).ids(0, n))
    assert not torch.equal(first, EpochOrder(blocks, epoch=1, seed=1, shuffle=True, window=window).ids(0, n))
    assert torch.equal(EpochOrder(blocks, 0, seed=1, shuffle=False, window=window).ids(0, n), torch.arange(n))


def test_the_epoch_order_reads_any_range_alike_and_a_window_holds_whole_blocks():
    blocks, window = [10] * 40, 50
    order = EpochOrder(blocks, epoch=2, seed=9, shuffle=True, window=window)
    whole = order.ids(0, 400)
    pieces = torch.cat([EpochOrder(blocks, 2, 9, True, window).ids(a, min(a + 37, 400)) for a in range(0, 400, 37)])
    assert torch.equal(whole, pieces)
    # Positions [0, 50) come from exactly five blocks, all of each: a streaming reader needs
    # only those row groups for the first window.
    first_window_blocks = set((whole[:50] // 10).tolist())
    assert len(first_window_blocks) == 5
    assert sorted(whole[:50].tolist()) == sorted(i for b in first_window_blocks for i in range(10 * b, 10 * b + 10))


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_of_an_epoch_is_taken_once_whatever_the_world_size_of_each_step(drop_last):
    num_samples, global_batch = 125, 12
    order = EpochOrder(map_style_blocks(num_samples), epoch=0, seed=5, shuffle=True, window=64)
    cursor, taken = DataCursor(seed=5), []
    sizes = iter([3, 3, 2, 1, 4, 4, 2, 3, 1, 2, 7])
    while cursor.epoch == 0:
        world_size = next(sizes)
        samples = cursor.step_samples(global_batch, num_samples)
        for rank in range(world_size):
            taken += order.ids(*step_positions(cursor, samples, world_size, rank)).tolist()
        cursor = cursor.advance(global_batch, num_samples, drop_last)
    assert sorted(taken) == sorted(order.ids(0, 120 if drop_last else 125).tolist())
    assert len(set(taken)) == len(taken)


def test_a_rank_with_nothing_in_the_last_step_joins_it_with_a_pass_that_weighs_nothing():
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0))
    loader = Loader(dataset, DataConfig(global_batch_size=4, micro_batch_size=2, max_steps=3, shuffle=False))
    last = DataCursor(consumed=8)
    shares = [loader.step(last, 4, rank) for rank in range(4)]
    assert [[m.indices.tolist() for m in share] for share in shares] == [[[8]], [[9]], [[]], [[]]]
    assert [share[0].samples for share in shares] == [1, 1, 0, 0]
    assert shares[3][0].data[0].tolist() == [8.0], "the stand-in is a real sample of the step, so its loss is finite"
    weights = [gradient_weight(m.samples, 4, loader.step_samples(last)) for share in shares for m in share]
    assert sum(weights) == 4


def _read_alike(plain, ahead, world_sizes, values):
    """Step both loaders through one step per world size, asserting every rank reads the same
    samples and `values(data)` from both; yields each world size and what `ahead` read for it."""
    cursor = DataCursor()
    try:
        for world_size in world_sizes:
            read = []
            for rank in range(world_size):
                want, got = plain.step(cursor, world_size, rank), ahead.step(cursor, world_size, rank)
                assert [m.indices.tolist() for m in got] == [m.indices.tolist() for m in want]
                assert all(torch.equal(values(g.data), values(w.data)) for g, w in zip(got, want))
                read += got
            cursor = plain.advance(cursor)
            yield world_size, read
    finally:
        ahead.close()


def test_prefetched_steps_equal_steps_read_in_place_and_a_new_world_size_drops_them():
    dataset = torch.utils.data.TensorDataset(torch.arange(300.0))
    config = dict(global_batch_size=24, micro_batch_size=5, max_steps=30)
    plain = Loader(dataset, DataConfig(**config))
    ahead = Loader(dataset, DataConfig(**config, prefetch_threads=2, prefetch_steps=3))
    sizes = [2, 2, 2, 3, 3, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    for world_size, _ in _read_alike(plain, ahead, sizes, lambda data: data[0]):
        assert all(key[2] == world_size for key in ahead._ahead), "reads for another world size are dropped"


def test_fetch_collates_map_style_and_tensor_datasets_alike():
    x = torch.arange(10.0).reshape(5, 2)
    tensors = torch.utils.data.TensorDataset(x)
    as_list = [{"x": row} for row in x]
    indices = torch.tensor([4, 1])
    assert torch.equal(fetch(tensors, indices)[0], x[indices])
    assert torch.equal(fetch(as_list, indices)["x"], x[indices])


def test_parquet_dataset_reads_numeric_and_fixed_length_list_columns(tmp_path):
    table = pa.table({"label": [0, 1, 2], "tokens": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]})
    pq.write_table(table.slice(0, 2), tmp_path / "part-0.parquet")
    pq.write_table(table.slice(2), tmp_path / "part-1.parquet")
    dataset = ParquetDataset(str(tmp_path))
    assert len(dataset) == 3
    batch = fetch(dataset, torch.tensor([2, 0]))
    assert batch["tokens"].tolist() == [[7, 8, 9], [1, 2, 3]]
    assert batch["label"].tolist() == [2, 0]


def test_parquet_dataset_streams_row_groups_and_keeps_at_most_its_cache(tmp_path):
    for part in range(4):
        rows = pa.table({"x": list(range(part * 100, part * 100 + 100))})
        pq.write_table(rows, tmp_path / f"part-{part}.parquet", row_group_size=25)
    dataset = ParquetDataset(str(tmp_path), cache_rows=50)
    assert dataset.block_sizes == [25] * 16 and len(dataset) == 400
    assert dataset.row_groups_read == 0, "nothing but the footers is read up front"
    ids = [399, 0, 26, 27, 1]
    assert fetch(dataset, torch.tensor(ids))["x"].tolist() == ids
    assert dataset.row_groups_read == 3
    assert sum(dataset.block_sizes[b] for b in dataset._cache) <= 50


def test_parquet_dataset_without_rows_is_rejected(tmp_path):
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="has no rows"):
        ParquetDataset(str(tmp_path))


def test_parquet_files_with_different_integer_widths_are_read_with_one_schema(tmp_path):
    pq.write_table(pa.table({"x": pa.array([1, 2], pa.int64())}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"x": pa.array([3], pa.int32())}), tmp_path / "part-1.parquet")
    assert fetch(ParquetDataset(str(tmp_path)), torch.tensor([2, 0]))["x"].tolist() == [3, 1]


def test_parquet_columns_that_are_not_tensors_are_refused_with_their_name(tmp_path):
    table = pa.table({"x": [1.0, 2.0], "text": ["a", "b"], "ragged": [[1], [2, 3]], "gaps": [1, None],
                      "inner_gaps": [[1, None], [2, 3]]})
    pq.write_table(table, tmp_path / "part-0.parquet")
    with pytest.raises(ValueError, match=r"column 'text' is string, which is not a tensor.*columns=\[\.\.\.\]"):
        ParquetDataset(str(tmp_path))
    with pytest.raises(ValueError, match=r"no column 'y'; the files have \['x', 'text', 'ragged', 'gaps', 'inner_gaps'\]"):
        ParquetDataset(str(tmp_path), columns=["y"])
    with pytest.raises(ValueError, match=r"column 'ragged' has rows of 1 to 2 values.*one length"):
        fetch(ParquetDataset(str(tmp_path), columns=["ragged"]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"column 'gaps' has 1 nulls"):
        fetch(ParquetDataset(str(tmp_path), columns=["gaps"]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"column 'inner_gaps' has 1 nulls"):
        fetch(ParquetDataset(str(tmp_path), columns=["inner_gaps"]), torch.tensor([0, 1]))


def test_a_cursor_beyond_the_datasets_end_is_refused_rather_than_weighted_negatively():
    loader = Loader(torch.utils.data.TensorDataset(torch.arange(50.0)), DataConfig(global_batch_size=8,
                                                                               micro_batch_size=8, max_steps=9))
    with pytest.raises(ElasticError, match=r"cursor is at sample 56 of epoch 0, but the dataset has 50 samples"):
        loader.step_samples(DataCursor(consumed=56))


def test_the_loader_sizes_a_parquet_cache_to_two_windows_and_a_row_group(tmp_path):
    pq.write_table(pa.table({"x": list(range(100))}), tmp_path / "part-0.parquet", row_group_size=30)
    dataset = ParquetDataset(str(tmp_path))
    Loader(dataset, DataConfig(global_batch_size=8, micro_batch_size=8, max_steps=9, shuffle_window=20))
    assert dataset.cache_rows == 2 * 20 + 30


def test_a_torch_style_getitems_returning_a_list_of_samples_is_collated():
    class Listing(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.tensor([float(index)])

        def __getitems__(self, indices):
            return [self[i] for i in indices]

    assert fetch(Listing(), torch.tensor([3, 1])).tolist() == [[3.0], [1.0]]


class _ReaderPid(torch.utils.data.Dataset):
    """Samples are their index; each fetch also says which process read it."""

    def __len__(self):
        return 60

    def __getitem__(self, index):
        return torch.tensor([float(index)])

    def __getitems__(self, indices):
        return {"x": torch.tensor(indices, dtype=torch.float64), "pid": torch.full((len(indices),), os.getpid())}


def test_prefetch_processes_read_in_other_processes_and_give_the_same_batches():
    config = dict(global_batch_size=12, micro_batch_size=5, max_steps=10)
    plain = Loader(_ReaderPid(), DataConfig(**config))
    ahead = Loader(_ReaderPid(), DataConfig(**config, prefetch_processes=2))
    readers = {int(pid) for _, read in _read_alike(plain, ahead, [2, 2, 3, 3, 1, 2], lambda data: data["x"])
               for micro in read for pid in micro.data["pid"]}
    assert readers and os.getpid() not in readers, "the reads did not happen in worker processes"


def test_prefetch_processes_need_a_dataset_that_pickles_and_exclude_threads():
    import threading

    class Locked(torch.utils.data.TensorDataset):
        lock = None

    dataset = Locked(torch.arange(20.0))
    dataset.lock = threading.Lock()
    with pytest.raises(ElasticError, match=r"prefetch_processes=1\) sends the dataset to worker processes, but Locked "
                                           r"cannot be pickled .*use prefetch_threads"):
        Loader(dataset, DataConfig(global_batch_size=4, micro_batch_size=4, max_steps=1, prefetch_processes=1))
    with pytest.raises(ValueError, match=r"prefetch_threads\(1\) and prefetch_processes\(2\) are both set"):
        DataConfig(global_batch_size=4, micro_batch_size=4, max_steps=1, prefetch_threads=1, prefetch_processes=2)
