"""Token arrays are compact little-endian binary: 4 bytes per id, version or logprob."""

from __future__ import annotations

import struct

import pytest

from store.arrays import decode_f32, decode_i32, decode_u8, encode_f32, encode_i32, encode_u8


def test_int32_round_trip_is_little_endian_and_four_bytes_each() -> None:
    ids = [0, 1, -1, 151_643, 2**31 - 1, -(2**31)]
    data = encode_i32(ids)
    assert len(data) == 4 * len(ids)
    assert data == struct.pack(f"<{len(ids)}i", *ids)
    assert decode_i32(data) == ids


def test_float32_round_trip_rounds_to_float32() -> None:
    logprobs = [0.0, -0.5, -(2.0**-30), -23.75, float("-inf")]
    data = encode_f32(logprobs)
    assert len(data) == 4 * len(logprobs)
    assert data == struct.pack(f"<{len(logprobs)}f", *logprobs)
    assert decode_f32(data) == logprobs  # all exactly representable in float32
    (x,) = decode_f32(encode_f32([0.1]))
    assert x == struct.unpack("<f", struct.pack("<f", 0.1))[0]
    assert x != 0.1


def test_uint8_masks_and_empty_arrays() -> None:
    assert encode_u8([0, 1, 1, 0]) == b"\x00\x01\x01\x00"
    assert decode_u8(b"\x00\x01") == [0, 1]
    assert encode_i32([]) == encode_f32([]) == b""
    assert decode_i32(b"") == decode_f32(b"") == []


def test_out_of_range_values_and_torn_data_are_refused() -> None:
    with pytest.raises(OverflowError):
        encode_i32([2**31])
    with pytest.raises(OverflowError):
        encode_u8([256])
    with pytest.raises(ValueError, match="multiple of 4"):
        decode_i32(b"\x00\x00\x00")
    with pytest.raises(ValueError, match="multiple of 4"):
        decode_f32(b"\x00")
