"""A GGUF file's tensor index and metadata, read with struct over one memory map: what loading the
packed weights (`--quantization gguf`) needs, without gguf-py's full parse. That parse makes Python
objects of every element of the tokenizer's arrays: ~160 MB of resident memory for SmolLM2's 49,152
tokens and merges, more than its Q4_1 weights take. Arrays of strings are skipped here (only their
length is kept); everything else matches `gguf.GGUFReader`'s `fields[key].contents()` and its
tensors' `name`, `tensor_type`, `shape` (ggml's order) and `data` (a read-only view of the file:
float types as numbers, quantized ones as uint8 rows of blocks).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class Field:
    def __init__(self, value) -> None:
        self.value = value

    def contents(self):
        return self.value


class SkippedStrings:
    """An array of strings not read: only its length."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count


@dataclass
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ggml order: the row length first
    data: np.ndarray
    n_bytes: int


class GGUFIndex:
    """`fields` and `tensors` as gguf.GGUFReader has them (see the module docstring); `data` is the
    file's memory map."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.data = np.memmap(path, mode="r")
        buf = self.data
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file")
        if struct.unpack_from("<I", buf, 4)[0] >= 0x10000:
            raise ValueError("big-endian GGUF files are not supported")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = Field(self._value(self._u32()))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._u64() for _ in range(self._u32())]
            infos.append((name, dims, self._u32(), self._u64()))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[Tensor] = []
        for name, dims, kind, offset in infos:
            qtype = gguf.GGMLQuantizationType(kind)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims)) if dims else 1
            n_bytes = count // block * block_bytes
            raw = self.data[start + offset:start + offset + n_bytes]
            shape = tuple(reversed(dims))
            if qtype.name in _FLOAT_DTYPES:
                array = raw.view(_FLOAT_DTYPES[qtype.name]).reshape(shape)
            else:
                array = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
            self.tensors.append(Tensor(name, qtype, np.array(dims, dtype=np.uint64), array, n_bytes))

    def _u32(self) -> int:
        (value,) = struct.unpack_from("<I", self.data, self._pos)
        self._pos += 4
        return value

    def _u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self._pos)
        self._pos += 8
        return value

    def _string(self) -> str:
        length = self._u64()
        text = bytes(self.data[self._pos:self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            (value,) = struct.unpack_from(fmt, self.data, self._pos)
            self._pos += struct.calcsize(fmt)
            return value
        if kind == _ARRAY:
            item, count = self._u32(), self._u64()
            if item == _STRING:
                for _ in range(count):  # skipped: their lengths are walked, their text never decoded
                    length = self._u64()  # (not `self._pos += self._u64()`: that adds to pos as it was)
                    self._pos += length
                return SkippedStrings(count)
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        raise ValueError(f"unknown GGUF value type {kind}")
