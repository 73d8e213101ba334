"""Read and write the safetensors format with numpy alone (memory-mapped, zero-copy reads).

A safetensors file is: 8 bytes (little-endian u64) header length N, then N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the
raw little-endian tensor bytes; offsets count from the first byte after the header.

A Hugging Face model directory holds either ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``).
:class:`SafetensorsCheckpoint` reads either (or a single ``.safetensors`` path, or a directory of
unindexed ``*.safetensors`` files). Every error is a :class:`CheckpointError` that names the file or
the tensor at fault.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's cap

# safetensors dtype tag <-> numpy dtype (always little-endian on disk)
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


def _tag_of(dtype: np.dtype) -> str | None:
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    for tag, dt in _DTYPES.items():
        if dt == dtype:
            return tag
    return None


class CheckpointError(ValueError):
    """A checkpoint cannot be read; the message names the file or tensor at fault."""


class _TensorInfo:
    __slots__ = ("name", "file", "dtype", "shape", "start", "end")

    def __init__(self, name: str, file: Path, dtype: np.dtype, shape: tuple[int, ...], start: int, end: int):
        self.name, self.file, self.dtype, self.shape, self.start, self.end = name, file, dtype, shape, start, end


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed and validated on open, data memory-mapped lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"safetensors file not found: {self.path}")
        file_size = self.path.stat().st_size
        if file_size < 8:
            raise CheckpointError(f"{self.path}: truncated safetensors file ({file_size} bytes, no header length)")
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > file_size - 8:
                raise CheckpointError(
                    f"{self.path}: corrupt or truncated safetensors header: header length {header_len} "
                    f"exceeds the file size ({file_size} bytes)"
                )
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{self.path}: safetensors header length {header_len} is implausibly large")
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not valid JSON: {e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (JSON is not an object)")
        self.data_start = 8 + header_len
        data_size = file_size - self.data_start
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise CheckpointError(f"{self.path}: __metadata__ must be an object of strings")
        self.metadata: dict[str, str] = dict(meta)
        self._tensors: dict[str, _TensorInfo] = {}
        for name, info in header.items():
            self._tensors[name] = self._parse_entry(name, info, data_size)
        self._mmap: np.ndarray | None = None

    def _parse_entry(self, name: str, info, data_size: int) -> _TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise CheckpointError(f"{where}: header entry must have dtype, shape and data_offsets")
        tag = info["dtype"]
        if tag not in _DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {tag!r} (supported: {', '.join(_DTYPES)})")
        dtype = _DTYPES[tag]
        shape = info["shape"]
        offsets = info["data_offsets"]
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{where}: invalid shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
            raise CheckpointError(f"{where}: invalid data_offsets {offsets!r}")
        start, end = offsets
        if end > data_size:
            raise CheckpointError(
                f"{where}: data offsets [{start}, {end}) lie beyond the end of the file "
                f"(data section has {data_size} bytes; file truncated?)"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if end - start != nbytes:
            raise CheckpointError(
                f"{where}: data_offsets span {end - start} bytes but dtype {tag} and shape {shape} need {nbytes}"
            )
        return _TensorInfo(name, self.path, dtype, tuple(shape), start, end)

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> _TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None

    def get(self, name: str, copy: bool = False) -> np.ndarray:
        """The tensor as a numpy array: a read-only view of the memory map, or a private copy."""
        t = self.info(name)
        if t.end == t.start:
            return np.zeros(t.shape, dtype=t.dtype)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._mmap[self.data_start + t.start : self.data_start + t.end]
        arr = np.ndarray(t.shape, dtype=t.dtype, buffer=buf)
        return arr.copy() if copy else arr

    def close(self) -> None:
        self._mmap = None


class SafetensorsCheckpoint:
    """All tensors of a model directory (single file, indexed shards) or of one ``.safetensors`` file.

    >>> ckpt = SafetensorsCheckpoint("/models/Qwen2.5-0.5B")
    >>> ckpt.names(); ckpt.shape("model.embed_tokens.weight"); w = ckpt.get("lm_head.weight")
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.path = Path(model_dir)
        self._files: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, Path] = {}  # tensor name -> shard path
        if self.path.is_file():
            self._add_file(self.path)
            return
        if not self.path.exists():
            raise CheckpointError(f"checkpoint directory not found: {self.path}")
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint path is neither a directory nor a file: {self.path}")
        single, index = self.path / SINGLE_FILE, self.path / INDEX_FILE
        if single.is_file():
            self._add_file(single)
        elif index.is_file():
            self._load_index(index)
        else:
            others = sorted(self.path.glob("*.safetensors"))
            if not others:
                raise CheckpointError(
                    f"no safetensors weights in {self.path}: expected {SINGLE_FILE} or {INDEX_FILE}"
                )
            for p in others:
                self._add_file(p)

    def _add_file(self, path: Path) -> SafetensorsFile:
        f = SafetensorsFile(path)
        self._files[path] = f
        for name in f.names():
            if name in self._where and self._where[name] != path:
                raise CheckpointError(f"tensor {name!r} appears in both {self._where[name]} and {path}")
            self._where[name] = path
        return f

    def _load_index(self, index: Path) -> None:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: invalid JSON ({e})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: missing or invalid 'weight_map' (tensor name -> shard file)")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (self.path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} references missing shard file(s): {', '.join(missing)}")
        for s in shards:
            shard_path = self.path / s
            f = SafetensorsFile(shard_path)
            self._files[shard_path] = f
            present = set(f.names())
            for name, fname in weight_map.items():
                if fname == s and name not in present:
                    raise CheckpointError(f"{index} maps tensor {name!r} to {shard_path}, which does not contain it")
        # The index is authoritative for which shard holds a name.
        for name, fname in weight_map.items():
            self._where[name] = self.path / fname

    # --- queries -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    __contains__ = has

    def _info(self, name: str) -> _TensorInfo:
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        return self._files[path].info(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> np.dtype:
        return self._info(name).dtype

    def file_of(self, name: str) -> Path:
        return self._info(name).file

    def get(self, name: str, copy: bool = False) -> np.ndarray:
        """The tensor as a numpy array (read-only memory-map view unless ``copy``)."""
        info = self._info(name)
        return self._files[info.file].get(name, copy=copy)

    @property
    def metadata(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in self._files.values():
            out.update(f.metadata)
        return out

    @property
    def files(self) -> list[Path]:
        return sorted(self._files)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


# --- writing ---------------------------------------------------------------------------------------


def _serialize(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> tuple[bytes, list[np.ndarray]]:
    header: dict[str, object] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"safetensors metadata must map str to str; bad keys: {bad}")
        header["__metadata__"] = dict(metadata)
    arrays = {}
    for name, a in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot name a tensor")
        a = np.asarray(a)
        tag = _tag_of(a.dtype)
        if tag is None:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
        a = a.astype(_DTYPES[tag], copy=False)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        arrays[name] = (tag, a)
    # Largest element first, then by name: keeps every tensor aligned to its element size.
    order = sorted(arrays, key=lambda n: (-arrays[n][1].dtype.itemsize, n))
    offset, blobs = 0, []
    for name in order:
        tag, a = arrays[name]
        header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, blobs


def save_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (numpy arrays, bf16 via ``ml_dtypes.bfloat16``) to ``path`` atomically."""
    path = Path(path)
    head, blobs = _serialize(tensors, metadata)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for a in blobs:
            f.write(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
    os.replace(tmp, path)
    return path


def save_safetensors_sharded(model_dir: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                             max_shard_bytes: int = 5 * 1024**3,
                             metadata: Mapping[str, str] | None = None) -> list[Path]:
    """Write ``tensors`` into ``model_dir`` the way Hugging Face does: ``model.safetensors`` when it fits in
    one shard, else ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        nbytes = np.asarray(a).nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += nbytes
    if len(shards) == 1:
        return [save_safetensors(model_dir / SINGLE_FILE, shards[0], metadata)]
    n = len(shards)
    weight_map, paths, total = {}, [], 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        paths.append(save_safetensors(model_dir / fname, shard, metadata))
        for name, a in shard.items():
            weight_map[name] = fname
            total += np.asarray(a).nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return paths
