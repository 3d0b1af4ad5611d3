"""The demo's offline corpus: Python's own standard library, as byte tokens in Parquet shards.

    python -m elastic.demo.corpus            # builds ~/.cache/elastic/corpus-stdlib-128 once

The `*.py` files of the running interpreter's standard library are read in sorted order (test
suites and installed packages left out) until `max_bytes`, cut into non-overlapping windows of
`seq_len + 1` bytes (a window is the input plus its next-byte targets) and written as a few
Parquet shards with one column, `tokens` (list<uint8>). Nothing is downloaded, and the same
interpreter always yields the same corpus. The corpus is built in a temporary folder that is
renamed into place, so a half-written corpus never counts, and workers starting at the same
time on one node may all call `prepare_corpus` safely.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

VOCAB_SIZE = 256
DEFAULT_SEQ_LEN = 128
DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_SHARDS = 4
# pyarrow datasets skip files whose names start with "_", so ParquetDataset(folder) reads only shards.
MANIFEST = "_manifest.json"

# Test suites are mostly bytes literals and fixtures; installed packages are not the stdlib
# and differ between machines, which would make the corpus depend on the environment.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def default_corpus_dir(seq_len: int = DEFAULT_SEQ_LEN) -> Path:
    return Path("~/.cache/elastic").expanduser() / f"corpus-stdlib-{seq_len}"


def prepare_corpus(
    data_dir: str | os.PathLike | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_bytes: int = DEFAULT_MAX_BYTES,
    shards: int = DEFAULT_SHARDS,
) -> Path:
    """Build the corpus in `data_dir` unless it is already there; returns the folder."""
    if seq_len < 1 or max_bytes < seq_len + 1 or shards < 1:
        raise ValueError(
            f"prepare_corpus(seq_len={seq_len}, max_bytes={max_bytes}, shards={shards}) cannot make a window; "
            "use seq_len >= 1, max_bytes >= seq_len + 1 and shards >= 1"
        )
    target = Path(data_dir).expanduser() if data_dir is not None else default_corpus_dir(seq_len)
    wanted = {"seq_len": seq_len, "max_bytes": max_bytes, "shards": shards}
    if (target / MANIFEST).exists():
        _check_manifest(target, wanted)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        windows = _windows(_stdlib_bytes(max_bytes), seq_len)
        for index, part in enumerate(np.array_split(windows, min(shards, len(windows)))):
            offsets = pa.array(np.arange(len(part) + 1, dtype=np.int32) * (seq_len + 1))
            tokens = pa.ListArray.from_arrays(offsets, pa.array(part.reshape(-1)))
            pq.write_table(pa.table({"tokens": tokens}), staging / f"shard-{index:03d}.parquet")
        manifest = {**wanted, "windows": len(windows), "python": sys.version.split()[0]}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.rename(staging, target)
    except OSError:
        # Another process renamed its finished corpus into place first; theirs is as good as ours.
        if not (target / MANIFEST).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _check_manifest(target, wanted)
    return target


def _check_manifest(target: Path, wanted: dict[str, int]) -> None:
    found = json.loads((target / MANIFEST).read_text())
    differing = {k: (found.get(k), v) for k, v in wanted.items() if found.get(k) != v}
    if differing:
        details = ", ".join(f"{k}: found {f}, asked {w}" for k, (f, w) in differing.items())
        raise ValueError(f"the corpus in {target} was built with other settings ({details}); "
                         "delete that folder or choose another data directory")


def _stdlib_bytes(max_bytes: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        text = path.read_bytes()[: max_bytes - total]
        chunks.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return b"".join(chunks)


def _windows(text: bytes, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 bytes; the incomplete tail is dropped."""
    count = len(text) // (seq_len + 1)
    if count == 0:
        raise ValueError(f"the standard library gave {len(text)} bytes, less than one window of {seq_len + 1}")
    return np.frombuffer(text, dtype=np.uint8, count=count * (seq_len + 1)).reshape(count, seq_len + 1)


if __name__ == "__main__":
    print(prepare_corpus())
