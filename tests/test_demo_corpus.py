"""The demo corpus: byte windows of the stdlib, built once, atomically, readable by ParquetDataset."""

import json
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from elastic import ParquetDataset
from elastic.demo import corpus
from elastic.demo.corpus import MANIFEST, prepare_corpus

pytestmark = pytest.mark.timeout(60)

# __future__.py sorts first in the stdlib and is longer than this, so the corpus is its prefix.
SMALL_BYTES = 2_000
SEQ_LEN = 15


def first_stdlib_bytes(count: int) -> bytes:
    return (Path(sysconfig.get_paths()["stdlib"]) / "__future__.py").read_bytes()[:count]


def test_windows_are_consecutive_stdlib_bytes_in_a_few_shards(tmp_path):
    folder = prepare_corpus(tmp_path / "corpus", seq_len=SEQ_LEN, max_bytes=SMALL_BYTES, shards=3)

    windows = SMALL_BYTES // (SEQ_LEN + 1)
    assert sorted(p.name for p in folder.glob("*.parquet")) == ["shard-000.parquet", "shard-001.parquet", "shard-002.parquet"]
    assert json.loads((folder / MANIFEST).read_text())["windows"] == windows
    dataset = ParquetDataset(str(folder))
    assert len(dataset) == windows
    tokens = dataset.__getitems__(list(range(windows)))["tokens"]
    assert tokens.shape == (windows, SEQ_LEN + 1) and tokens.dtype == torch.uint8
    assert bytes(tokens.reshape(-1).tolist()) == first_stdlib_bytes(windows * (SEQ_LEN + 1))


def test_second_call_reuses_the_corpus(tmp_path):
    folder = prepare_corpus(tmp_path / "corpus", seq_len=SEQ_LEN, max_bytes=SMALL_BYTES)
    written = {p: p.stat().st_mtime_ns for p in folder.iterdir()}

    assert prepare_corpus(tmp_path / "corpus", seq_len=SEQ_LEN, max_bytes=SMALL_BYTES) == folder
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]


def test_corpus_of_other_settings_is_rejected_with_a_fix(tmp_path):
    prepare_corpus(tmp_path / "corpus", seq_len=SEQ_LEN, max_bytes=SMALL_BYTES)

    with pytest.raises(ValueError, match=r"seq_len: found 15, asked 31.*delete that folder"):
        prepare_corpus(tmp_path / "corpus", seq_len=31, max_bytes=SMALL_BYTES)


def test_build_that_dies_midway_leaves_nothing_that_counts(tmp_path, monkeypatch):
    real_write = pq.write_table
    calls = []

    def write_then_fail(table, where):
        calls.append(where)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(table, where)

    monkeypatch.setattr(corpus.pq, "write_table", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        prepare_corpus(tmp_path / "corpus", seq_len=SEQ_LEN, max_bytes=SMALL_BYTES, shards=3)
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setattr(corpus.pq, "write_table", real_write)
    assert len(ParquetDataset(str(prepare_corpus(tmp_path / "corpus", seq_len=SEQ_LEN, max_bytes=SMALL_BYTES)))) > 0


def test_a_size_cap_below_one_window_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="max_bytes >= seq_len \\+ 1"):
        prepare_corpus(tmp_path / "corpus", seq_len=SEQ_LEN, max_bytes=SEQ_LEN)
