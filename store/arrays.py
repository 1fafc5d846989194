"""Token arrays as compact little-endian binary: int32 for token ids and policy versions,
float32 for logprobs, uint8 for loss masks. `len(encode_*(xs)) == itemsize * len(xs)`.

Pure functions over the standard `array` module, so the store needs no numpy; a big-endian host
swaps bytes so the stored format never depends on the machine that wrote it.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_SWAP = sys.byteorder == "big"

assert array("i").itemsize == 4, "the store needs a 4-byte C int"
assert array("f").itemsize == 4, "the store needs a 4-byte C float"


def encode_i32(values: Sequence[int]) -> bytes:
    """Little-endian int32; raises OverflowError for a value outside [-2**31, 2**31)."""
    arr = array("i", values)
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def decode_i32(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"int32 data must be a multiple of 4 bytes, got {len(data)}")
    arr = array("i")
    arr.frombytes(data)
    if _SWAP:
        arr.byteswap()
    return arr.tolist()


def encode_f32(values: Sequence[float]) -> bytes:
    """Little-endian IEEE float32 (each value rounded from Python's float64)."""
    arr = array("f", values)
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def decode_f32(data: bytes) -> list[float]:
    if len(data) % 4:
        raise ValueError(f"float32 data must be a multiple of 4 bytes, got {len(data)}")
    arr = array("f")
    arr.frombytes(data)
    if _SWAP:
        arr.byteswap()
    return arr.tolist()


def encode_u8(values: Sequence[int]) -> bytes:
    """One byte per value in [0, 255] (loss masks); raises OverflowError otherwise."""
    return array("B", values).tobytes()


def decode_u8(data: bytes) -> list[int]:
    return list(data)
