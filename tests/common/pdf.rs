//! PDF files made by the tests: a well-formed writer (objects, cross-reference table, trailer)
//! and the hostile documents the document reader must survive.

use std::io::Write;

/// A PDF of `objects` (object `n` is `objects[n - 1]`, its body without `n 0 obj`), object 1 the
/// catalog, with a correct cross-reference table.
pub fn document(objects: &[Vec<u8>]) -> Vec<u8> {
    let mut out = b"%PDF-1.4\n".to_vec();
    let mut offsets = Vec::new();
    for (i, o) in objects.iter().enumerate() {
        offsets.push(out.len());
        out.extend_from_slice(format!("{} 0 obj\n", i + 1).as_bytes());
        out.extend_from_slice(o);
        out.extend_from_slice(b"\nendobj\n");
    }
    let xref = out.len();
    out.extend_from_slice(
        format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).as_bytes(),
    );
    for o in offsets {
        out.extend_from_slice(format!("{o:010} 00000 n \n").as_bytes());
    }
    out.extend_from_slice(
        format!(
            "trailer << /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            objects.len() + 1
        )
        .as_bytes(),
    );
    out
}

/// A stream object: `dict` (without `/Length`) and `data`.
pub fn stream(dict: &str, data: &[u8]) -> Vec<u8> {
    [
        format!("<< {dict} /Length {} >>\nstream\n", data.len()).into_bytes(),
        data.to_vec(),
        b"\nendstream".to_vec(),
    ]
    .concat()
}

pub fn deflate(data: &[u8]) -> Vec<u8> {
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    z.write_all(data).expect("deflate");
    z.finish().expect("deflate")
}

/// One page whose content stream is `content` (Flate-compressed when `compress`), Helvetica as
/// `/F1`, and `extra_resources` inside its resource dictionary; `more` objects follow as 6, 7…
pub fn one_page(
    content: &[u8],
    compress: bool,
    extra_resources: &str,
    more: &[Vec<u8>],
) -> Vec<u8> {
    let contents = if compress {
        stream("/Filter /FlateDecode", &deflate(content))
    } else {
        stream("", content)
    };
    let mut objects = vec![
        b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(),
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>".to_vec(),
        format!(
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 5 0 R >> {extra_resources} >> /Contents 4 0 R >>"
        )
        .into_bytes(),
        contents,
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>".to_vec(),
    ];
    objects.extend(more.iter().cloned());
    document(&objects)
}

/// A page with one line of text.
pub fn text(line: &str) -> Vec<u8> {
    one_page(
        format!("BT /F1 12 Tf 72 720 Td ({line}) Tj ET").as_bytes(),
        true,
        "",
        &[],
    )
}

/// A page that draws a form XObject whose own content draws itself (`/X0 Do` with `/X0` in its
/// own resources): a reader that follows `Do` without a depth limit recurses until its stack
/// overflows. Under a kilobyte.
pub fn self_drawing_form() -> Vec<u8> {
    one_page(
        b"BT /F1 12 Tf 72 720 Td (Hello) Tj ET /X0 Do",
        false,
        "/XObject << /X0 6 0 R >>",
        &[stream(
            "/Type /XObject /Subtype /Form /BBox [0 0 10 10] /Resources << /XObject << /X0 6 0 R >> >>",
            b"/X0 Do",
        )],
    )
}

/// An object of `depth` nested arrays: a parser that recurses per nesting level overflows.
pub fn nested_arrays(depth: usize) -> Vec<u8> {
    let mut body = "[".repeat(depth).into_bytes();
    body.extend_from_slice(&b"]".repeat(depth));
    document(&[
        b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(),
        b"<< /Type /Pages /Kids [] /Count 0 >>".to_vec(),
        body,
    ])
}

/// A page whose compressed content stream inflates to about `text_bytes` of text to show: a
/// few kilobytes of file.
pub fn inflating(text_bytes: usize) -> Vec<u8> {
    let mut content = b"BT /F1 12 Tf 72 720 Td (".to_vec();
    content.resize(content.len() + text_bytes, b'A');
    content.extend_from_slice(b") Tj ET");
    one_page(&content, true, "", &[])
}

/// A page of `ops` path operators and no text: parsing costs time, and yields nothing.
pub fn busy(ops: usize) -> Vec<u8> {
    let content = b"0 0 m 1 1 l S\n".repeat(ops);
    one_page(&content, true, "", &[])
}
