"""A GGUF file's weight format from its header: the file type and each tensor type's share of the parameters.

    weight_types(path)   # "GGUF Q4_K_M: Q4_K 76%, Q6_K 24%, F32 <1%"

Reads the header only (the key-value metadata is skipped, the tensor infos read: name, shape, type), in well under a
second; `gguf.GGUFReader` builds an array for every vocabulary entry and takes seconds. The type names are the `gguf`
package's (GGMLQuantizationType, LlamaFileType). The format: github.com/ggml-org/ggml, docs/gguf.md.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from pathlib import Path

from gguf import GGMLQuantizationType, LlamaFileType

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # value types
STRING, ARRAY = 8, 9


class _Header:
    """A little-endian cursor over the file's bytes."""

    def __init__(self, data) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.at)[0]
        self.at += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        size = self.take("Q")
        self.at += size
        return bytes(self.data[self.at - size : self.at]).decode("utf-8", "replace")

    def value(self, kind: int):
        """The value of type `kind` (an array's values are skipped: None)."""
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in SCALARS:
                self.at += count * struct.calcsize("<" + SCALARS[item])
            else:
                for _ in range(count):
                    self.value(item)
            return None
        return self.take(SCALARS[kind])


def tensor_types(path: Path) -> tuple[int | None, Counter[str]]:
    """(general.file_type or None, {tensor type name: parameters of that type})."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _Header(data)
        if header.take("I") != 0x46554747:  # b"GGUF"
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_values = header.take("I"), header.take("Q"), header.take("Q")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not read here (2 and later are)")
        file_type = None
        for _ in range(n_values):
            key = header.string()
            value = header.value(header.take("I"))
            file_type = value if key == "general.file_type" else file_type
        sizes: Counter[str] = Counter()
        for _ in range(n_tensors):
            header.string()
            shape = [header.take("Q") for _ in range(header.take("I"))]
            kind, _offset = header.take("I"), header.take("Q")
            count = 1
            for dim in shape:
                count *= dim
            sizes[GGMLQuantizationType(kind).name if kind in GGMLQuantizationType._value2member_map_ else str(kind)] += count
    return file_type, sizes


def weight_types(path: Path) -> str:
    """The GGUF's native tensor types by share of the parameters, e.g. "GGUF Q4_K_M: Q4_K 76%, Q6_K 24%, F32 <1%"."""
    file_type, sizes = tensor_types(path)
    kind = ""
    if file_type is not None:
        known = file_type in LlamaFileType._value2member_map_
        kind = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if known else str(file_type)
    total = sum(sizes.values()) or 1
    shares = [(name, n / total) for name, n in sizes.most_common()]
    return f"GGUF {kind}: " + ", ".join(f"{name} {share:.0%}" if share >= 0.005 else f"{name} <1%" for name, share in shares)
