"""The run's HDF5 metrics file, written by rank 0 only.

The file is opened for single-writer/multiple-reader (SWMR): every dataset is created before
SWMR is switched on, rows are appended in batches and flushed every few seconds, so another
process can follow the run and a crash loses at most the last unflushed seconds. The schema
is documented in docs/METRICS.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import h5py
import numpy as np

from gem_mpi.config import synchronous
from gem_mpi.errors import OutputError, UsageError
from gem_mpi.outputs.files import atomic_write, h5py_write_errors, os_reason
from gem_mpi.protocol import WORKER_TIME_COLUMNS
from gem_mpi.version import __version__

SCHEMA_VERSION = 1

# (name, dtype) of the per-update columns every method writes
UPDATE_COLUMNS = [
    ("time", "f8"),  # seconds since the master started serving
    ("worker", "i4"),  # MPI rank of the worker
    ("seq", "i8"),  # the worker's own update counter
    ("ticket", "i8"),  # global arrival ticket (Fetch_and_op on the master's counter)
    ("version_pulled", "i8"),  # master clock when the worker pulled the θ it computed on
    ("clock", "i8"),  # master clock when this update was applied (θ's version before it)
    ("staleness", "i4"),  # clock - version_pulled
    ("loss", "f4"),  # the worker's mini-batch loss
    ("queue", "i4"),  # updates waiting at the master when this one was picked
    ("compute_s", "f4"),  # worker seconds spent computing this update
    ("apply_s", "f4"),  # master seconds spent applying it (the kernel, inside θ's write)
]
GEM_COLUMNS = [
    ("energy_central", "f8"),  # ½‖θ_new − s‖²
    ("energy_proxy", "f8"),  # ½‖κ m‖²
    ("pi_median_all", "f4"),  # median π over all parameters (kernel.pooled_median)
]
# --method gap-aware: the mean over the elements of 1/P, the share of Δθ applied
GAP_AWARE_COLUMNS = [("ga_scale_mean", "f4")]
# --local-steps H > 1: the local steps each update took (H; fewer for a slower worker, --dylu)
LOCAL_STEPS_COLUMNS = [("steps", "i4")]
# --method sync: one row per synchronous step (every worker's gradient averaged); worker,
# ticket, staleness, queue and the GEM columns have no meaning there and are not written
SYNC_COLUMNS = [
    ("time", "f8"),  # seconds since training started, at the end of the step
    ("seq", "i8"),  # the step number (each worker's own update counter)
    ("clock", "i8"),  # θ's version before the step (= seq: one update per step)
    ("loss", "f4"),  # the workers' mini-batch losses, averaged
    ("loss_max", "f4"),  # the highest of them
    ("compute_s", "f4"),  # the slowest worker's forward + backward (+ --straggler sleep)
    ("allreduce_s", "f4"),  # rank 0's wait in the optimizer step for the averaged gradient
]
EVAL_COLUMNS = [("time", "f8"), ("clock", "f8"), ("test_loss", "f8"), ("test_accuracy", "f8")]
REJECTED_COLUMNS = [("time", "f8"), ("worker", "i4"), ("seq", "i8"), ("ticket", "i8")]
# a worker that left the live run (SIGTERM): after how many of its updates, at which clock,
# its batches not done then (dealt to the others), and how many workers train on
DEPARTURE_COLUMNS = [("time", "f8"), ("worker", "i4"), ("updates", "i8"), ("clock", "i8"),
                     ("not_done", "i8"), ("workers_left", "i4")]
# the run's speed, over its last start's training time (gem_mpi.run.throughput): NaN where it
# does not apply (tokens: text only; model FLOP/s: torch models; MFU: a known accelerator)
THROUGHPUT_FIELDS = ["tokens", "samples_per_s", "samples_per_s_per_worker", "tokens_per_s",
                     "model_flops_per_s", "mfu"]
SUMMARY_FIELDS = ["updates", "wall_s", "test_loss", "test_accuracy", "finished", "rejected",
                  "diverged",
                  "master_wait_s", "master_apply_s", "master_metrics_s", "master_mpi_s",
                  "master_cpu_s", *THROUGHPUT_FIELDS]
# the asynchronous workers' own time split, WORKER_TIME_COLUMNS (seconds, one row per
# worker, sent with their DONE message, gem_mpi.protocol; /summary/worker_time, NaN for a
# worker that did not finish): what each worker's wall time went to, from its first pull to
# its last message
SYNC_SUMMARY_FIELDS = ["updates", "wall_s", "test_loss", "test_accuracy", "finished",
                       "diverged", "compute_s", "allreduce_s", *THROUGHPUT_FIELDS]


# --masters K > 1, /summary: each shard's clock (updates it applied) and rejected updates,
# shard 0 first; -1 until the run finished
SHARD_SUMMARY = ("shard_clock", "shard_rejected")


def summary_fields(method: str) -> list[str]:
    return SYNC_SUMMARY_FIELDS if synchronous(method) else SUMMARY_FIELDS


def library_versions() -> dict[str, str]:
    """Versions a reader needs to reproduce the run."""
    import mpi4py
    from mpi4py import MPI

    out = {
        "gem_mpi": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "mpi4py": mpi4py.__version__,
        "mpi": MPI.Get_library_version().strip().splitlines()[0],
    }

    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].__version__
    return out


@dataclass
class _Table:
    group: h5py.Group
    columns: list[tuple[str, str, tuple[int, ...]]]
    rows: dict[str, list] = field(default_factory=dict)
    written: int = 0

    def __post_init__(self) -> None:
        for name, dtype, extra in self.columns:
            self.group.create_dataset(
                name, shape=(0, *extra), maxshape=(None, *extra), dtype=dtype,
                chunks=(1024, *extra),
            )
            self.rows[name] = []

    def append(self, values: dict) -> None:
        for name, _, _ in self.columns:
            self.rows[name].append(values[name])

    def pending(self) -> int:
        return len(self.rows[self.columns[0][0]])

    def write(self) -> None:
        n = self.pending()
        if n == 0:
            return
        for name, dtype, extra in self.columns:
            ds = self.group[name]
            ds.resize(self.written + n, axis=0)
            ds[self.written:self.written + n] = np.asarray(self.rows[name], dtype=dtype).reshape(
                n, *extra
            )
            self.rows[name].clear()
        self.written += n


class MetricsWriter:
    """Appends per-update and per-evaluation rows; flushes every ``flush_seconds``."""

    def __init__(
        self,
        path: str,
        config: dict,
        tensor_names: list[str],
        tensor_sizes: list[int],
        n_workers: int,
        kernel: str,
        flush_seconds: float = 2.0,
        resume_rows: tuple[int, int, int] | None = None,
        min_free_bytes: int = 0,
        run_id: str = "",
        resume_log: dict | None = None,
        masters: int = 1,
        resume_shard_rows: list[int] | None = None,
        wire_bytes: tuple[int, int] | None = None,
    ) -> None:
        """``resume_rows``: continue this run's file, cut back to these rows; ``resume_log``:
        this start is a resume (at which update, from which checkpoint, changing what).
        ``masters`` K > 1: one more table per shard 1..K-1 (``shard<k>``, the columns of
        ``updates``: that shard's own event order); ``resume_shard_rows``: their rows.
        ``wire_bytes``: (committed, pulled) bytes per update, recorded as the root's
        ``bytes_committed_per_update`` and ``bytes_pulled_per_update`` (the asynchronous
        methods; gem_mpi.protocol.UpdatePayload)."""
        self.wire_bytes = wire_bytes
        self.shard_tables: list[_Table] = []
        self.path = path
        self.flush_seconds = flush_seconds
        self.min_free_bytes = min_free_bytes
        # set when the file system runs low: rows then wait in memory, and the run's owner
        # stops (checked like a stop signal) and closes the file while it still fits
        self.low_space: str | None = None
        self.closed = False
        self.summary_fields = summary_fields(config["method"])
        self._space_is_low()  # a disk already nearly full stops the run at its first check
        if resume_rows is not None:
            self._reopen(resume_rows, resume_log, resume_shard_rows or [0] * (masters - 1),
                         n_workers)
            return
        # no chunk cache: a failed write (disk full) then raises at once, in our call,
        # instead of when HDF5 evicts the chunk later, or at exit
        self._f = h5py.File(path, "w", libver="latest", rdcc_nbytes=0)
        f = self._f
        f.attrs["gem_mpi_schema"] = SCHEMA_VERSION
        f.attrs["config"] = json.dumps(config, sort_keys=True)
        f.attrs["versions"] = json.dumps(library_versions(), sort_keys=True)
        f.attrs["method"] = config["method"]
        f.attrs["n_workers"] = n_workers
        f.attrs["kernel"] = kernel
        f.attrs["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        f.attrs["run_id"] = run_id
        self._record_wire()
        if resume_log is not None:  # a resumed run whose metrics file starts here
            _log_resume(f, resume_log)
        _begin_segment(f, resume_log["clock"] if resume_log else 0, n_workers)
        t = f.create_group("tensors")
        t.create_dataset("name", data=np.array(tensor_names, dtype=h5py.string_dtype()))
        t.create_dataset("size", data=np.asarray(tensor_sizes, dtype=np.int64))
        sync = synchronous(config["method"])
        cols = [(n, d, ()) for n, d in (SYNC_COLUMNS if sync else UPDATE_COLUMNS)]
        if config["method"] == "gem":
            k = len(tensor_names)
            cols += [(n, d, ()) for n, d in GEM_COLUMNS]
            cols += [("pi_median", "f4", (k,)), ("clamp_frac", "f4", (k,)),
                     ("clamp_low", "f4", (k,)), ("zero_delta", "f4", (k,))]
        if config["method"] == "gap-aware":
            cols += [(n, d, ()) for n, d in GAP_AWARE_COLUMNS]
        if not sync and config.get("local_steps", 1) > 1:
            cols += [(n, d, ()) for n, d in LOCAL_STEPS_COLUMNS]
        self.updates = _Table(f.create_group("updates"), cols)
        f.attrs["masters"] = masters
        self.shard_tables = [_Table(f.create_group(f"shard{k}"), cols)
                             for k in range(1, masters)]
        self.evals = _Table(f.create_group("eval"), [(n, d, ()) for n, d in EVAL_COLUMNS])
        self.rejected = None if sync else _Table(f.create_group("rejected"),
                                                 [(n, d, ()) for n, d in REJECTED_COLUMNS])
        self.departures = None if sync else _Table(f.create_group("departures"),
                                                   [(n, d, ()) for n, d in DEPARTURE_COLUMNS])
        summary = f.create_group("summary")
        for name in self.summary_fields:
            summary.create_dataset(name, shape=(), dtype="f8", data=np.nan)
        if not sync:
            wt = summary.create_dataset("worker_time", data=np.full(
                (n_workers, len(WORKER_TIME_COLUMNS)), np.nan))
            wt.attrs["columns"] = json.dumps(WORKER_TIME_COLUMNS)
        if masters > 1:  # per shard, once the run finished (-1 until then)
            for name in SHARD_SUMMARY:
                summary.create_dataset(name, data=np.full(masters, -1, np.int64))
        f.swmr_mode = True
        self._last_flush = time.monotonic()

    def _record_wire(self) -> None:
        """The bytes an update commits and a pull reads, as this start's --wire makes them."""
        if self.wire_bytes is not None:
            self._f.attrs["bytes_committed_per_update"] = int(self.wire_bytes[0])
            self._f.attrs["bytes_pulled_per_update"] = int(self.wire_bytes[1])

    def _reopen(self, rows: tuple[int, int, int], log: dict | None,
                shard_rows: list[int], n_workers: int) -> None:
        """Continue a checkpointed run's file (:func:`check_resumable` made sure it is this
        run's): cut every table back to the checkpoint's rows."""
        try:
            try:
                self._f = h5py.File(self.path, "r+", libver="latest", rdcc_nbytes=0)
            except OSError as exc:
                if "already open for write" not in str(exc):
                    raise
                _rewrite_after_crash(self.path)  # its writer was killed: flags still set
                self._f = h5py.File(self.path, "r+", libver="latest", rdcc_nbytes=0)
        except OSError as exc:
            raise UsageError(f"--metrics {self.path!r}: cannot reopen to resume ({exc})") from None
        f = self._f
        if "gem_mpi_schema" not in f.attrs:
            raise UsageError(f"--metrics {self.path!r} is not a gem_mpi metrics file")
        tables = []
        shards = [f"shard{k}" for k in range(1, len(shard_rows) + 1)]
        for name, count in zip(("updates", "eval", "rejected", *shards),
                               (*rows, *shard_rows)):
            if name not in f:  # sync runs have no rejected table
                tables.append(None)
                continue
            group = f[name]
            columns = [(k, group[k].dtype, group[k].shape[1:]) for k in group]
            table = _Table.__new__(_Table)
            table.group, table.columns, table.rows, table.written = group, columns, {}, count
            for k, _, _ in columns:
                if group[k].shape[0] < count:
                    raise UsageError(f"--metrics {self.path!r} holds fewer rows than the "
                                     "checkpoint: not the file of this run")
                group[k].resize(count, axis=0)
                table.rows[k] = []
            tables.append(table)
        self.updates, self.evals, self.rejected = tables[:3]
        self.shard_tables = tables[3:]
        self.departures = None if self.rejected is None else self._reopen_departures(
            int(log["clock"]) if log is not None else None)
        for name in self.summary_fields:
            f["summary"][name][()] = np.nan
        if "worker_time" in f["summary"]:
            wt = f["summary"]["worker_time"]
            if wt.shape[0] != n_workers:  # resumed on another number of workers
                columns = wt.attrs["columns"]
                del f["summary"]["worker_time"]
                wt = f["summary"].create_dataset("worker_time", data=np.full(
                    (n_workers, len(WORKER_TIME_COLUMNS)), np.nan))
                wt.attrs["columns"] = columns
            wt[...] = np.nan
        f.attrs["n_workers"] = n_workers
        if log is not None:
            _begin_segment(f, int(log["clock"]), n_workers)
        f.attrs["resumes"] = int(f.attrs.get("resumes", 0)) + 1
        self._record_wire()
        if log is not None:
            _log_resume(f, log)
        f.swmr_mode = True
        self._last_flush = time.monotonic()

    def _reopen_departures(self, clock: int | None) -> _Table:
        """The departures up to the resume's clock (the checkpoint a departure writes is at
        its clock or later); a file from before the table gets it now."""
        f = self._f
        if "departures" not in f:
            return _Table(f.create_group("departures"),
                          [(n, d, ()) for n, d in DEPARTURE_COLUMNS])
        group = f["departures"]
        count = group["clock"].shape[0] if clock is None else int(
            np.count_nonzero(group["clock"][()] <= clock))
        table = _Table.__new__(_Table)
        table.group, table.written, table.rows = group, count, {}
        table.columns = [(n, np.dtype(d), ()) for n, d in DEPARTURE_COLUMNS]
        for name, _, _ in table.columns:
            group[name].resize(count, axis=0)
            table.rows[name] = []
        return table

    def departed(self, row: dict, workers_left: int) -> None:
        """A worker left the live run (``row``: DEPARTURE_COLUMNS but the last)."""
        self.departures.append({**row, "workers_left": workers_left})
        self.flush()

    def shard_rows(self) -> list[int]:
        """Rows on disk of each shard's table (call after flush)."""
        return [t.written for t in self.shard_tables]

    def add_shard_update(self, shard: int, row: dict) -> None:
        self.shard_tables[shard - 1].append(row)

    def rows(self) -> tuple[int, int, int]:
        """Rows on disk per table (call after flush)."""
        return (self.updates.written, self.evals.written,
                0 if self.rejected is None else self.rejected.written)

    def add_update(self, row: dict) -> None:
        self.updates.append(row)
        if time.monotonic() - self._last_flush > self.flush_seconds:
            self.flush()

    def add_rejected(self, row: dict) -> None:
        self.rejected.append(row)
        self.flush()

    def add_eval(self, row: dict) -> None:
        self.evals.append(row)
        self.flush()

    def flush(self, check_space: bool = True, durable: bool = False) -> None:
        """Write the pending rows; ``durable``: and fsync the file, so that the rows a
        checkpoint counts are on the disk before the checkpoint says so."""
        self._last_flush = time.monotonic()
        if self.closed or check_space and self._space_is_low():
            return
        good = (*self.rows(), *self.shard_rows())
        try:
            with h5py_write_errors():
                self.updates.write()
                self.evals.write()
                if self.rejected is not None:
                    self.rejected.write()
                for table in self.shard_tables:
                    table.write()
                if self.departures is not None:
                    self.departures.write()
                self._f.flush()
                if durable:
                    os.fsync(self._f.id.get_vfd_handle())
        except (OSError, RuntimeError) as exc:
            self._fail(exc, good)

    def _space_is_low(self) -> bool:
        if self.low_space is None and self.min_free_bytes > 0:
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.path))).free
            if free < self.min_free_bytes:
                self.low_space = (f"--metrics {self.path!r}: only {free / 2**20:.1f} MB left on "
                                  f"its file system, below --min-free-mb "
                                  f"{self.min_free_bytes / 2**20:g}")
        return self.low_space is not None

    def _fail(self, exc: BaseException, good: tuple[int, ...]) -> None:
        """A write failed (disk full, quota, I/O error). HDF5 may have recorded rows whose
        data never reached the disk (they would read back as zeros): cut every table (the
        shards' too) back to the rows known written (``good``: :meth:`rows`, then
        :meth:`shard_rows`), or remove the file if even that fails, and say which."""
        self.closed = True
        with contextlib.suppress(Exception), h5py_write_errors():
            self._f.close()
        shards = [f"shard{k}" for k in range(1, len(self.shard_tables) + 1)]
        try:
            with h5py_write_errors(), h5py.File(self.path, "r+", libver="latest") as f:
                for name, count in zip(("updates", "eval", "rejected", *shards), good):
                    for ds in f[name].values() if name in f else ():
                        ds.resize(min(count, ds.shape[0]), axis=0)
            with h5py.File(self.path, "r", libver="latest") as f:
                kept = (f"it keeps the {f['updates/clock'].shape[0]} rows written before, "
                        "marked unfinished")
            self.updates.written, self.evals.written = good[0], good[1]
            if self.rejected is not None:
                self.rejected.written = good[2]
            for table, count in zip(self.shard_tables, good[3:]):
                table.written = count
        except Exception:  # noqa: BLE001 - whatever went wrong, the file cannot be trusted
            aside = f"{self.path}.damaged"
            try:  # never deleted: its rows may still be read, by h5py or by hand
                os.replace(self.path, aside)
                kept = f"it could not be repaired and was moved to {aside}"
            except OSError:
                kept = "it could not be repaired (nor moved aside)"
        raise OutputError(f"--metrics {self.path!r}: writing failed ({os_reason(exc)}); "
                          f"{kept}") from None

    def close(self, summary: dict) -> None:
        """Write the summary and close; a file without a finished summary was cut short.
        Pending rows are written even when space is low: the margin is there for this."""
        if self.closed:
            return
        self.flush(check_space=False)
        if self.closed:  # that flush failed
            return
        good = (*self.rows(), *self.shard_rows())
        try:
            with h5py_write_errors():
                for name in self.summary_fields:
                    self._f["summary"][name][()] = float(summary.get(name, np.nan))
                if "worker_time" in summary and "worker_time" in self._f["summary"]:
                    self._f["summary"]["worker_time"][...] = summary["worker_time"]
                for name in SHARD_SUMMARY:  # --masters K > 1
                    if name in summary and name in self._f["summary"]:
                        self._f["summary"][name][...] = summary[name]
                self._f.flush()
                os.fsync(self._f.id.get_vfd_handle())  # the run's end is on the disk
                self._f.close()
        except (OSError, RuntimeError) as exc:
            self._fail(exc, good)
        self.closed = True


def _begin_segment(f: h5py.File, clock: int, workers: int) -> None:
    """This start's segment in the file's ``segments`` (JSON list of clock_from, clock_to,
    workers): the segments from ``clock`` on are cut (their rows were), the one before
    ends there; the last one's clock_to stays null (it ends with the file's rows: an
    attribute cannot grow while the file is open for SWMR)."""
    segments = [s for s in json.loads(f.attrs.get("segments", "[]")) if s["clock_from"] < clock]
    if segments:
        segments[-1]["clock_to"] = clock
    segments.append({"clock_from": clock, "clock_to": None, "workers": workers})
    f.attrs["segments"] = json.dumps(segments)


def _log_resume(f: h5py.File, entry: dict) -> None:
    """Append a resume to the file's ``resume_log`` (JSON list): the update it continued at,
    the checkpoint, and the settings it changed (name -> [before, now]); rows from that
    clock on were made with the changed settings."""
    log = json.loads(f.attrs.get("resume_log", "[]"))
    log.append(entry)
    f.attrs["resume_log"] = json.dumps(log, sort_keys=True)


def check_resumable(path: str, run_id: str, checkpoint_path: str,
                    rows: tuple[int, int, int], shard_rows: Sequence[int] = ()) -> None:
    """Before a resume writes anything: a metrics file that exists must be the checkpoint's
    run's own and hold at least the rows the checkpoint counts in every table (``shard_rows``:
    the ``shard<k>`` tables of --masters K > 1); UsageError otherwise (the file is only read).
    A file that does not exist yet is started afresh."""
    if not os.path.exists(path):
        return
    try:
        try:
            f = h5py.File(path, "r", libver="latest")
        except OSError as exc:
            if "already open for write" not in str(exc):
                raise
            f = h5py.File(path, "r", libver="latest", swmr=True)  # its writer was killed
    except OSError as exc:
        raise UsageError(f"--metrics {path!r}: cannot be read to resume ({exc}); nothing was "
                         "written to it") from None
    with f:
        if "gem_mpi_schema" not in f.attrs:
            raise UsageError(f"--metrics {path!r} is not a gem_mpi metrics file; nothing was "
                             "written to it")
        owner = str(f.attrs.get("run_id", ""))
        if owner != run_id:
            raise UsageError(f"--metrics {path!r} belongs to another run (id {owner or 'none'}"
                             f") than the checkpoint {checkpoint_path!r} (run {run_id}): a "
                             "resume would cut its rows, so it is left untouched; give this "
                             "run its own --metrics path")
        shards = [f"shard{k}" for k in range(1, len(shard_rows) + 1)]
        for name, count in zip(("updates", "eval", "rejected", *shards), (*rows, *shard_rows)):
            held = min((ds.shape[0] for ds in f[name].values()), default=0) if name in f else 0
            if held < count:  # read-only here: a resume that cut some tables and then
                # refused would leave the file of neither the run nor the checkpoint
                raise UsageError(f"--metrics {path!r} holds {held} rows in /{name}, fewer than "
                                 f"the {count} the checkpoint counts: not this run's file as it "
                                 "was; nothing was written to it")


def _rewrite_after_crash(path: str) -> None:
    """A writer killed in SWMR mode leaves the file marked as open for writing, and HDF5
    refuses to open it for writing again (``h5clear -s`` would clear the mark, but it is a
    separate tool). Its data reads fine under SWMR: copy the whole file into a new one, then
    put that in its place atomically."""
    def copy(tmp: str) -> None:
        with h5py.File(path, "r", libver="latest", swmr=True) as src, \
                h5py.File(tmp, "w", libver="latest") as dst:
            for key, value in src.attrs.items():
                dst.attrs[key] = value
            for name in src:
                src.copy(src[name], dst, name=name)

    atomic_write(path, copy)
