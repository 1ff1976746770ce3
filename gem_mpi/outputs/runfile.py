"""Reading a metrics file, after or while its run trains: the one reader of the schema.

The writer and the schema are in gem_mpi/outputs/metrics.py (docs/METRICS.md); this module
reads any version-1 file, whatever its method, including one cut short by a crash
(``summary/finished`` NaN) and one still being written (SWMR): :func:`load_run` reads a whole
run into a :class:`Run`, :class:`RunFollower` reads a live one's new rows. Columns are
optional here: a method that does not write ``pi_median`` or ``staleness`` simply has none.
The tests, ``tools/`` and gem_mpi.reproduce all read runs through it, so they agree on what
a gem_mpi run is and on what a missing column means; what they compute from a run is
:mod:`gem_mpi.outputs.analysis`. It needs h5py and numpy only.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Self

import h5py
import numpy as np

from gem_mpi.config import synchronous
from gem_mpi.errors import GemError
from gem_mpi.outputs.metrics import (
    EVAL_COLUMNS,
    GEM_COLUMNS,
    SCHEMA_VERSION,
    SYNC_COLUMNS,
    UPDATE_COLUMNS,
)

# What the writer puts in every run and in GEM runs only; a file that lacks one of these is
# read all the same (with a note), and a column outside them is read too.
COMMON_UPDATE_COLUMNS = [name for name, _ in UPDATE_COLUMNS]
GEM_ONLY_COLUMNS = [name for name, _ in GEM_COLUMNS] + ["pi_median", "clamp_frac",
                                                         "clamp_low", "zero_delta"]
EVAL_COLUMN_NAMES = [name for name, _ in EVAL_COLUMNS]


def expected_columns(method: str) -> dict[str, list[str]]:
    """The columns gem_mpi.outputs.metrics writes for a run of this method, per group."""
    if synchronous(method):  # one row per synchronous step: its own columns
        return {"updates": [name for name, _ in SYNC_COLUMNS], "eval": EVAL_COLUMN_NAMES}
    updates = COMMON_UPDATE_COLUMNS + (GEM_ONLY_COLUMNS if method == "gem" else [])
    return {"updates": updates, "eval": EVAL_COLUMN_NAMES}


class RunFileError(GemError):
    """The path is missing, not HDF5, or not a gem_mpi metrics file: one line for the user."""


# --- opening ----------------------------------------------------------------------------

def open_run_file(path: str | Path) -> h5py.File:
    """Open a metrics file read-only under SWMR, so that a live writer is no obstacle.

    Raises RunFileError with one readable sentence when the path is no gem_mpi run.
    """
    p = Path(path)
    if not p.exists():
        raise RunFileError(f"{path}: no such file")
    if p.is_dir():
        raise RunFileError(f"{path}: is a directory, not a gem_mpi metrics file")
    if not h5py.is_hdf5(p):
        raise RunFileError(f"{path}: not an HDF5 file (expected the file that "
                           "python -m gem_mpi.train --metrics writes)")
    try:
        f = h5py.File(p, "r", libver="latest", swmr=True)
    except OSError as exc:
        hint = ""
        if "lock" in str(exc).lower():
            hint = ("; if its writer has not switched SWMR on yet, retry (watch.py --wait); on "
                    "a file system without locks set HDF5_USE_FILE_LOCKING=FALSE")
        raise RunFileError(f"{path}: cannot open it for reading ({exc}){hint}") from None
    if "gem_mpi_schema" not in f.attrs:
        f.close()
        raise RunFileError(f"{path}: HDF5, but not a gem_mpi run (no gem_mpi_schema "
                           "attribute)")
    raw = f.attrs["gem_mpi_schema"]
    try:
        version = int(raw)
    except (TypeError, ValueError):
        f.close()
        raise RunFileError(f"{path}: unreadable gem_mpi_schema attribute {raw!r}") from None
    if version > SCHEMA_VERSION:
        f.close()
        raise RunFileError(f"{path}: schema version {version} is newer than this gem_mpi "
                           f"reads ({SCHEMA_VERSION}): update gem_mpi")
    return f


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _header(f: h5py.File) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(attributes, config, notes) of an open run; a damaged config is a note, not a crash."""
    attrs = {k: (_text(v) if isinstance(v, (str, bytes)) else v) for k, v in f.attrs.items()}
    notes: list[str] = []
    try:
        config = json.loads(attrs.get("config", "{}"))
    except ValueError:
        config = {}
        notes.append("the config attribute is not valid JSON: run settings unknown")
    return attrs, config, notes


def _method(attrs: dict[str, Any], config: dict[str, Any]) -> str:
    return _text(attrs.get("method", config.get("method", "?")))


def _columns(group: h5py.Group | None) -> dict[str, h5py.Dataset]:
    if group is None:
        return {}
    return {k: v for k, v in group.items() if isinstance(v, h5py.Dataset)}


def _rows(datasets: dict[str, h5py.Dataset]) -> int:
    """Rows every column has: the writer resizes column by column, so a crash can leave
    them uneven, and only the common prefix is a whole row."""
    lengths = [ds.shape[0] for ds in datasets.values() if ds.ndim >= 1]
    return min(lengths) if lengths else 0


class _Described:
    """What the root attributes say about a run, for Run and RunFollower alike."""

    attrs: dict[str, Any]
    config: dict[str, Any]

    @property
    def method(self) -> str:
        return _method(self.attrs, self.config)

    @property
    def n_workers(self) -> int:
        return int(self.attrs.get("n_workers", 0))

    @property
    def model(self) -> str:
        return f"{self.config.get('model', '?')}/{self.config.get('dataset', '?')}"

    @property
    def label(self) -> str:
        return f"{self.method}, {self.n_workers} workers"


# --- the whole run ----------------------------------------------------------------------

@dataclass
class Run(_Described):
    """One metrics file read into memory; absent columns are absent, not errors."""

    path: str
    attrs: dict[str, Any]
    config: dict[str, Any]
    tensor_names: list[str]
    tensor_sizes: np.ndarray
    updates: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]
    summary: dict[str, float]
    other: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # asynchronous runs: each worker's time split (column -> one value per worker, NaN for a
    # worker that did not finish); empty for sync runs and older files
    worker_time: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return Path(self.path).stem

    @property
    def n_workers(self) -> int:
        if "n_workers" in self.attrs:
            return int(self.attrs["n_workers"])
        w = self.col("worker")
        return int(np.unique(w).size) if w is not None else 0

    @property
    def finished(self) -> bool:
        """True only when the master wrote its summary: NaN means crashed or still running."""
        return self.summary.get("finished", math.nan) == 1.0

    @property
    def n_updates(self) -> int:
        return rows_of(self.updates)

    def col(self, name: str) -> np.ndarray | None:
        """An /updates column, or None when this run's method or version does not write it."""
        return self.updates.get(name)

    def eval_col(self, name: str) -> np.ndarray | None:
        """An /eval column, or None when absent."""
        return self.eval.get(name)


def rows_of(table: dict[str, np.ndarray]) -> int:
    """Rows of a table read into memory: its shortest column's."""
    return min((len(v) for v in table.values()), default=0)


def _read_table(datasets: dict[str, h5py.Dataset], n: int) -> dict[str, np.ndarray]:
    return {k: ds[:n] for k, ds in datasets.items() if ds.ndim >= 1}


def load_run(path: str | Path) -> Run:
    """Read a whole run (finished, crashed or live) into numpy arrays."""
    with open_run_file(path) as f:
        return _snapshot(f, str(path))


def _snapshot(f: h5py.File, path: str) -> Run:
    attrs, config, notes = _header(f)
    tables: dict[str, dict[str, np.ndarray]] = {}
    for gname, group in f.items():
        if not isinstance(group, h5py.Group) or gname in ("tensors", "summary"):
            continue
        cols = _columns(group)
        lengths = {ds.shape[0] for ds in cols.values() if ds.ndim >= 1}
        n = _rows(cols)
        if len(lengths) > 1:
            notes.append(f"the columns of /{gname} have different lengths ({min(lengths)} to "
                         f"{max(lengths)} rows; the writer stopped mid-flush): "
                         f"{n} whole rows used")
        tables[gname] = _read_table(cols, n)
    tensors = _columns(f.get("tensors"))
    names = [_text(x) for x in tensors["name"][()]] if "name" in tensors else []
    sizes = tensors["size"][()] if "size" in tensors else np.ones(len(names), np.int64)
    worker_time = {}
    if "summary/worker_time" in f:
        ds = f["summary/worker_time"]
        table = ds[()]
        worker_time = {c: table[:, i] for i, c in enumerate(json.loads(ds.attrs["columns"]))}
    summary = {k: float(ds[()]) for k, ds in _columns(f.get("summary")).items()
               if ds.ndim == 0}
    method = _method(attrs, config)
    for gname, names_expected in expected_columns(method).items():
        lacking = [c for c in names_expected if c not in tables.get(gname, {})]
        if lacking:
            notes.append(f"/{gname} has no {', '.join(lacking)} column(s), which gem_mpi "
                         f"writes for {method} runs: what needs them is skipped")
    updates = tables.pop("updates", {})
    evals = tables.pop("eval", {})
    return Run(path, attrs, config, names, np.asarray(sizes), updates, evals, summary,
               tables, notes, worker_time)


# --- following a live run ---------------------------------------------------------------

class RunFollower(_Described):
    """Keeps a run's file open under SWMR and reads only the rows that are new.

    Rereading a whole file every few seconds costs as much as the file is large (a long
    GEM run on a big model writes a π median per tensor per update); this reads the tail.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.f = open_run_file(path)
        self.attrs, self.config, self.notes = _header(self.f)
        self._updates = _columns(self.f.get("updates"))
        self._eval = _columns(self.f.get("eval"))
        self._summary = _columns(self.f.get("summary"))
        tensors = _columns(self.f.get("tensors"))
        self.tensor_sizes = tensors["size"][()] if "size" in tensors else None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.f.close()

    def refresh(self) -> None:
        """See what the writer flushed since the last call."""
        for table in (self._updates, self._eval, self._summary):
            for ds in table.values():
                ds.refresh()

    def n_updates(self) -> int:
        return _rows(self._updates)

    def n_evals(self) -> int:
        return _rows(self._eval)

    def updates(self, start: int, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Rows start: of the /updates columns asked for (those that exist)."""
        n = self.n_updates()
        wanted = self._updates if names is None else {
            k: v for k, v in self._updates.items() if k in names}
        return {k: ds[start:n] for k, ds in wanted.items()}

    def last_eval(self) -> dict[str, float] | None:
        n = self.n_evals()
        if n == 0:
            return None
        return {k: float(ds[n - 1]) for k, ds in self._eval.items()}

    def summary(self) -> dict[str, float]:
        return {k: float(ds[()]) for k, ds in self._summary.items() if ds.ndim == 0}

    def finished(self) -> bool:
        return self.summary().get("finished", math.nan) == 1.0


# --- command-line plumbing shared by tools/ -------------------------------------------------

def cli(prog: str, main: Callable[[list[str]], int]) -> NoReturn:
    """Run a tool's main; a bad input file or an unwritable output is one line on stderr and
    exit code 2, never a traceback."""
    try:
        rc = main(sys.argv[1:])
    except (RunFileError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        rc = 130
    sys.exit(rc)
