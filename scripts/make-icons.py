#!/usr/bin/env python3
"""Writes the web app's PNG icons (static/icons/icon-192.png, icon-512.png, and a maskable
512 with a safe margin) from the same shape as static/favicon.svg: a rounded square in the
accent colour with a white four-point star. Pure Python (zlib), no image library; run it again
only if the favicon changes."""

import struct
import zlib
from pathlib import Path

ACCENT = (0x6D, 0x5E, 0xFC)
STAR = [(16, 6), (18.6, 13.4), (26, 16), (18.6, 18.6), (16, 26), (13.4, 18.6), (6, 16), (13.4, 13.4)]


def inside_star(x, y):
    # Even-odd rule over the 32-unit favicon's star.
    c = False
    n = len(STAR)
    for i in range(n):
        (x1, y1), (x2, y2) = STAR[i], STAR[(i + 1) % n]
        if (y1 > y) != (y2 > y) and x < (x2 - x1) * (y - y1) / (y2 - y1) + x1:
            c = not c
    return c


def inside_rounded(x, y, r):
    cx = min(max(x, r), 32 - r)
    cy = min(max(y, r), 32 - r)
    return (x - cx) ** 2 + (y - cy) ** 2 <= r * r


def render(size, maskable=False):
    ss = 3  # supersamples per axis
    rows = []
    for py in range(size):
        row = bytearray([0])  # filter: none
        for px in range(size):
            acc = [0, 0, 0, 0]
            for sy in range(ss):
                for sx in range(ss):
                    u = (px + (sx + 0.5) / ss) / size * 32
                    v = (py + (sy + 0.5) / ss) / size * 32
                    if maskable:
                        # Full bleed background; the star within the middle 80 %.
                        bg = True
                        su, sv = (u - 16) / 0.8 + 16, (v - 16) / 0.8 + 16
                    else:
                        bg = inside_rounded(u, v, 8)
                        su, sv = u, v
                    if not bg:
                        continue
                    colour = (255, 255, 255) if inside_star(su, sv) else ACCENT
                    acc[0] += colour[0]
                    acc[1] += colour[1]
                    acc[2] += colour[2]
                    acc[3] += 255
            n = ss * ss
            alpha = acc[3] // n
            if alpha:
                row += bytes((acc[0] * 255 // acc[3], acc[1] * 255 // acc[3], acc[2] * 255 // acc[3], alpha))
            else:
                row += b"\0\0\0\0"
        rows.append(bytes(row))
    raw = b"".join(rows)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


out = Path(__file__).resolve().parent.parent / "static" / "icons"
out.mkdir(exist_ok=True)
(out / "icon-192.png").write_bytes(render(192))
(out / "icon-512.png").write_bytes(render(512))
(out / "icon-maskable-512.png").write_bytes(render(512, maskable=True))
print("wrote", *sorted(p.name for p in out.iterdir()))
