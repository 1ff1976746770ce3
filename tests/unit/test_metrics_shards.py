"""The metrics file of a --masters K > 1 run: its ``shard<k>`` tables are held to the same
rules as ``updates`` (a resume checks them before writing anything; a failed write cuts them
back to the rows that reached the disk). Real HDF5 files; the failed write is one table's
write made to fail after HDF5 has grown the table, as a full disk does."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import pytest

from gem_mpi.errors import OutputError, UsageError
from gem_mpi.outputs import metrics
from gem_mpi.outputs.metrics import MetricsWriter, check_resumable

CONFIG = {"method": "downpour"}


def _row(clock: int) -> dict:
    return {"time": 0.1 * clock, "worker": 1 + clock % 2, "seq": clock // 2, "ticket": clock,
            "version_pulled": clock, "clock": clock, "staleness": 0, "loss": 1.0, "queue": 0,
            "compute_s": 0.01, "apply_s": 0.001}


def _writer(path: Path) -> MetricsWriter:
    return MetricsWriter(str(path), CONFIG, ["a", "b"], [3, 4], n_workers=2, kernel="numpy",
                         flush_seconds=3600, run_id="r1", masters=3)


def _write(w: MetricsWriter, updates: int, shard_rows: tuple[int, int]) -> None:
    for clock in range(updates):
        w.add_update(_row(clock))
    for shard, rows in enumerate(shard_rows, start=1):
        for clock in range(rows):
            w.add_shard_update(shard, _row(clock))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_resume_checks_every_shard_table_before_writing(tmp_path):
    path = tmp_path / "run.h5"
    w = _writer(path)
    _write(w, 10, (10, 7))
    w.close({"updates": 10})
    before = _sha(path)
    check_resumable(str(path), "r1", "ck.h5", (10, 0, 0), [10, 7])  # as counted: fine
    with pytest.raises(UsageError, match=r"holds 7 rows in /shard2, fewer than the 9"):
        check_resumable(str(path), "r1", "ck.h5", (10, 0, 0), [10, 9])
    with pytest.raises(UsageError, match=r"holds 10 rows in /updates, fewer than the 11"):
        check_resumable(str(path), "r1", "ck.h5", (11, 0, 0), [10, 7])
    assert _sha(path) == before  # read only


def test_a_failed_write_cuts_the_shard_tables_back(tmp_path, monkeypatch):
    path = tmp_path / "run.h5"
    w = _writer(path)
    _write(w, 5, (5, 4))
    w.flush()
    assert w.rows()[0] == 5 and w.shard_rows() == [5, 4]
    _write(w, 3, (3, 3))
    real = metrics._Table.write

    def full_disk(table: metrics._Table) -> None:
        real(table)  # the rows are recorded in the table's size...
        if table.group.name == "/shard2":
            raise OSError(28, "No space left on device")  # ...but never reach the disk

    monkeypatch.setattr(metrics._Table, "write", full_disk)
    with pytest.raises(OutputError, match="No space left on device"):
        w.flush()
    with h5py.File(path, "r") as f:
        assert f["updates/clock"].shape[0] == 5
        assert f["shard1/clock"].shape[0] == 5 and f["shard2/clock"].shape[0] == 4
        assert f["shard2/clock"][()].tolist() == [0, 1, 2, 3]
    assert w.shard_rows() == [5, 4]
