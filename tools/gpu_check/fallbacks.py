"""Stand-ins for the two small packages the checkpoint loader imports, for a GPU machine that lacks them (the lent
ones have torch and triton, nothing is installed there): `safetensors.safe_open` and `safetensors.torch.save_file`
in pure Python (the format: an 8-byte header length, a JSON header of dtype / shape / data_offsets, then the raw bytes;
the model registry imports the writer), and a `tqdm` that draws nothing. Installed only when the real package
does not import; the record names them."""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import mmap
import sys
import types

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafeOpen:
    """`safe_open(path, "pt")`: keys(), get_tensor(name), get_slice(name)[a:b] (rows), metadata()."""

    def __init__(self, path, framework: str = "pt", device: str = "cpu"):
        self._file = open(path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        size = int.from_bytes(self._map[:8], "little")
        self._header = json.loads(self._map[8 : 8 + size])
        self._meta = self._header.pop("__metadata__", None)
        self._start = 8 + size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._map.close()
        self._file.close()

    def keys(self) -> list[str]:
        return list(self._header)

    def metadata(self):
        return self._meta

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self._header[name]
        begin, end = entry["data_offsets"]
        raw = bytearray(self._map[self._start + begin : self._start + end])
        dtype = DTYPES[entry["dtype"]]
        if not raw:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype).view(entry["shape"])

    def get_slice(self, name: str) -> "_Slice":
        return _Slice(self, name)


class _Slice:
    def __init__(self, handle: SafeOpen, name: str):
        self._handle, self._name = handle, name

    def __getitem__(self, index):
        return self._handle.get_tensor(self._name)[index].clone()

    def get_shape(self) -> list[int]:
        return list(self._handle._header[self._name]["shape"])


def save_file(tensors: dict, filename, metadata: dict | None = None) -> None:
    """`safetensors.torch.save_file`: the header (8-byte aligned), then each tensor's bytes in order."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        blob = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(filename, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        for blob in blobs:
            handle.write(blob)


class _NoBar:
    def __init__(self, *args, **kwargs):
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def stand_in(name: str, package: bool = False) -> types.ModuleType:
    """An empty module with a spec (torch's dynamo looks specs up by name), a package if asked."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    return module


def install() -> list[str]:
    """Registers the stand-ins whose package does not import; returns their names."""
    installed = []
    try:
        importlib.import_module("safetensors")
    except ImportError:
        module, writer = stand_in("safetensors", package=True), stand_in("safetensors.torch")
        module.safe_open, module.torch, writer.save_file = SafeOpen, writer, save_file
        sys.modules["safetensors"], sys.modules["safetensors.torch"] = module, writer
        installed.append("safetensors (pure-Python safe_open and save_file)")
    try:
        importlib.import_module("tqdm")
    except ImportError:
        module = stand_in("tqdm")
        module.tqdm = _NoBar
        sys.modules["tqdm"] = module
        installed.append("tqdm (no progress bar)")
    return installed
