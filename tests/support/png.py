"""Decode a PNG (8-bit RGB or RGBA, not interlaced: what Chromium's --screenshot writes) to pixels
with zlib alone, so a screenshot's content can be asserted without an imaging library."""

from __future__ import annotations

import struct
import zlib
from collections import Counter

__all__ = ["colours", "decode"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def decode(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes); AssertionError for a PNG this does not read."""
    assert data[:8] == _SIGNATURE, "not a PNG"
    pos, idat, header = 8, bytearray(), b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = chunk
        elif kind == b"IDAT":
            idat += chunk
        elif kind == b"IEND":
            break
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(bytes(idat))
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up = prev[i]
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                line[i] = (line[i] + _paeth(left, up, prev[i - bpp] if i >= bpp else 0)) & 0xFF
        prev = line
        rows.append(bytes(line) if bpp == 3 else bytes(b for j, b in enumerate(line) if j % 4 != 3))
    return width, height, rows


def colours(data: bytes) -> Counter[tuple[int, int, int]]:
    """How many pixels of each RGB colour the PNG has."""
    _, _, rows = decode(data)
    out: Counter[tuple[int, int, int]] = Counter()
    for row in rows:
        out.update(zip(row[0::3], row[1::3], row[2::3], strict=True))
    return out
