"""The data cursor, the batch split and the gradient weights: pure math, no Ray."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elastic.data import (
    DataCursor,
    ParquetDataset,
    epoch_order,
    fetch,
    gradient_weight,
    micro_bounds,
    share_bounds,
    step_indices,
)


@pytest.mark.parametrize("global_batch, world_size", [(64, 1), (64, 3), (10, 4), (7, 7), (100, 6)])
def test_shares_cover_the_global_batch_without_overlap_and_differ_by_at_most_one(global_batch, world_size):
    bounds = [share_bounds(global_batch, world_size, r) for r in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == global_batch
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_micro_batches_cut_a_share_into_pieces_of_at_most_the_micro_batch_size():
    assert micro_bounds(22, 8) == [(0, 8), (8, 16), (16, 22)]
    assert micro_bounds(8, 8) == [(0, 8)]


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


def test_cursor_moves_to_the_next_epoch_when_less_than_a_global_batch_is_left():
    cursor = DataCursor(seed=3)
    for _ in range(3):
        cursor = cursor.advance(64, 200)
    assert cursor == DataCursor(epoch=1, consumed=0, seed=3)


def test_every_sample_of_an_epoch_is_taken_once_whatever_the_world_size_of_each_step():
    num_samples, global_batch = 120, 12
    order = epoch_order(num_samples, epoch=0, seed=5, shuffle=True)
    cursor, taken = DataCursor(seed=5), []
    for world_size in [3, 3, 2, 1, 4, 4, 2, 3, 1, 2]:
        for rank in range(world_size):
            taken += step_indices(cursor, order, global_batch, world_size, rank).tolist()
        cursor = cursor.advance(global_batch, num_samples)
    assert sorted(taken) == list(range(num_samples))
    assert cursor.epoch == 1


def test_epoch_order_is_a_seeded_permutation_that_changes_per_epoch():
    first = epoch_order(50, 0, seed=1, shuffle=True)
    assert torch.equal(first, epoch_order(50, 0, seed=1, shuffle=True))
    assert not torch.equal(first, epoch_order(50, 1, seed=1, shuffle=True))
    assert sorted(first.tolist()) == list(range(50))
    assert torch.equal(epoch_order(5, 0, seed=1, shuffle=False), torch.arange(5))


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


def test_parquet_dataset_without_rows_is_rejected(tmp_path):
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="has no rows"):
        ParquetDataset(str(tmp_path))
