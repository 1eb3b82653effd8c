#!/usr/bin/env python3
"""Writes tests/data/files/report.pdf: a two-page PDF with a text layer (Helvetica, standard
encoding), built by hand so the test file has no generator behind it but this script. The file
tests read it for attachments (crates/service/src/files.rs, tests/browser_files.rs)."""
import os

PAGES = [
    ["Quarterly report of the Lighthouse Bakery", "Revenue grew by 17 percent in the third quarter.",
     "The sourdough line sold 4200 loaves."],
    ["Outlook", "The bakery plans a second oven in March.", "Code word: PAPAYA-42."],
]


def esc(s):
    return s.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


objs = []
objs.append(b"<< /Type /Catalog /Pages 2 0 R >>")
n_pages = len(PAGES)
kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n_pages))
objs.append(f"<< /Type /Pages /Kids [{kids}] /Count {n_pages} >>".encode())
font_obj = 3 + 2 * n_pages
for i, lines in enumerate(PAGES):
    content_id = 4 + 2 * i
    objs.append(
        f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {content_id} 0 R "
        f"/Resources << /Font << /F1 {font_obj} 0 R >> >> >>".encode()
    )
    ops = ["BT", "/F1 14 Tf", "72 720 Td", "18 TL"]
    for line in lines:
        ops.append(f"({esc(line)}) Tj T*")
    ops.append("ET")
    stream = ("\n".join(ops) + "\n").encode()
    objs.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"endstream")
objs.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")

out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
offsets = []
for i, body in enumerate(objs, start=1):
    offsets.append(len(out))
    out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
xref = len(out)
out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
for off in offsets:
    out += b"%010d 00000 n \n" % off
out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)

path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "files", "report.pdf")
with open(path, "wb") as f:
    f.write(out)
print(f"wrote {os.path.normpath(path)} ({len(out)} bytes)")
