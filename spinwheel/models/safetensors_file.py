"""A safetensors file written tensor by tensor (:mod:`~spinwheel.parallel.io.streamed_save`: a consolidated checkpoint
whose tensors reach the writing rank one at a time).

The format: an 8-byte little-endian header length, a JSON header (``__metadata__``, then every tensor's dtype, shape
and byte range in the data), padded with spaces to a multiple of 8, then the tensors' bytes back to back. The header
depends on names, dtypes and shapes alone, so it is written first and each tensor lands at its offset when it comes.
The tensor order and dtype names are the installed ``safetensors`` library's own (read from its serialisation of
empty tensors): the file equals ``save_file``'s byte for byte.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from spinwheel.models.hf import SAFETENSORS_METADATA
from spinwheel.models.hf_format import apply_umask


def safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, int]]:
    """The bytes before the data of a safetensors file holding ``entries`` (HF name, dtype, shape) with spinwheel's
    metadata, and each tensor's byte offset into the data. The tensor order and dtype names are the installed
    library's: it serialises empty tensors of the same names and dtypes (the order depends on nothing else)."""
    shapes = {name: (dtype, shape) for name, dtype, shape in entries}
    probe = safetensors_bytes({name: torch.empty(0, dtype=dtype) for name, dtype, _ in entries}, SAFETENSORS_METADATA)
    size = int.from_bytes(probe[:8], "little")
    order = json.loads(probe[8 : 8 + size])
    header: dict[str, object] = {"__metadata__": order.pop("__metadata__")}
    offsets, offset = {}, 0
    for name, info in order.items():
        dtype, shape = shapes[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": info["dtype"], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[name], offset = offset, offset + nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


class SafetensorsWriter:
    """A safetensors file at ``path`` for ``tensors`` (name -> dtype, shape), its header written first; :meth:`write`
    puts each tensor at its offset as it arrives (in any order), :meth:`close` checks that every one came."""

    def __init__(self, path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.path, self.tensors = path, tensors
        prefix, offsets = safetensors_header([(name, dtype, shape) for name, (dtype, shape) in tensors.items()])
        self.offsets = {name: len(prefix) + offset for name, offset in offsets.items()}
        self.left = set(tensors)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            size = sum(math.prod(shape) * dtype.itemsize for dtype, shape in tensors.values())
            os.ftruncate(self.fd, len(prefix) + size)
            self._pwrite(memoryview(prefix), 0)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, name: str, t: torch.Tensor) -> None:
        if name not in self.left:
            raise RuntimeError(f"{self.path}: tensor {name!r} is not in the header or came twice")
        dtype, shape = self.tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(f"{self.path}: {name} arrived as {tuple(t.shape)} {t.dtype}, not {shape} {dtype}")
        if t.numel():
            # A view of a host tensor (nothing copied); a device tensor comes to the host one tensor at a time.
            data = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
            self._pwrite(memoryview(data), self.offsets[name])
        self.left.discard(name)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        while len(data):  # pwrite may write less than asked (over 2 GiB at once on Linux)
            try:
                n = os.pwrite(self.fd, data, offset)
            except OSError as e:  # a full disk says ENOSPC alone: name the file
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            data, offset = data[n:], offset + n

    def close(self, check: bool = True) -> None:
        os.close(self.fd)
        apply_umask(self.path)
        if check and self.left:
            raise RuntimeError(f"{self.path}: {len(self.left)} tensors never arrived, e.g. {sorted(self.left)[0]}")
