//! Cutting a document's text into the passages retrieval returns: by tokens (at most
//! `max_tokens` each), consecutive passages sharing up to `overlap_tokens` at their seam, never
//! across a Markdown heading (each passage knows the headings it falls under) and never inside a
//! fenced code block unless the block alone is too long (then it is cut between lines). Prose
//! too long for one passage is cut between sentences, then between words. Each passage is a
//! byte range of the document's text, so the page can show it in place.

use smolchat_store::NewChunk;

/// How passages are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkShape {
    pub max_tokens: usize,
    pub overlap_tokens: usize,
}

/// A span of the text that is never cut further unless it is too long: a paragraph, a code
/// block, a sentence, a word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    start: usize,
    end: usize,
    tokens: usize,
    /// The section (index into the headings seen) it belongs to.
    section: usize,
}

/// The passages of `text`; `count` gives the tokens of a piece of text.
pub fn chunk(text: &str, shape: ChunkShape, count: &dyn Fn(&str) -> usize) -> Vec<NewChunk> {
    let max = shape.max_tokens.max(8);
    let (blocks, headings) = blocks(text);
    let mut pieces: Vec<Piece> = Vec::new();
    for (start, end, section, code) in blocks {
        split(text, start, end, section, code, max, count, &mut pieces);
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < pieces.len() {
        // As many pieces of this section as fit.
        let section = pieces[i].section;
        let mut j = i;
        let mut tokens = pieces[i].tokens;
        while j + 1 < pieces.len()
            && pieces[j + 1].section == section
            && tokens + pieces[j + 1].tokens <= max
        {
            j += 1;
            tokens += pieces[j].tokens;
        }
        out.push(NewChunk {
            heading: headings[section].clone(),
            text: text[pieces[i].start..pieces[j].end].to_string(),
            start_byte: pieces[i].start as i64,
            end_byte: pieces[j].end as i64,
            tokens: tokens as i64,
        });
        let next = j + 1;
        if next >= pieces.len() || pieces[next].section != section {
            i = next;
            continue;
        }
        // The next passage starts with the tail of this one that fits in the overlap.
        let mut k = next;
        let mut tail = 0;
        while k > i + 1 && tail + pieces[k - 1].tokens <= shape.overlap_tokens {
            k -= 1;
            tail += pieces[k].tokens;
        }
        i = k;
    }
    out
}

/// A block of the text: `(start, end, section, is_code)`.
type Block = (usize, usize, usize, bool);

/// The text's blocks in order, and the heading path of each section (section 0: before any
/// heading, "").
fn blocks(text: &str) -> (Vec<Block>, Vec<String>) {
    let mut out = Vec::new();
    let mut headings = vec![String::new()];
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut section = 0;
    let mut para: Option<usize> = None;
    let mut fence: Option<(usize, &str)> = None;
    let mut pos = 0;
    for line in text.split_inclusive('\n') {
        let start = pos;
        pos += line.len();
        let trimmed = line.trim();
        if let Some((open, marker)) = fence {
            if trimmed.starts_with(marker) {
                out.push((open, pos, section, true));
                fence = None;
            }
            continue;
        }
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        let level = trimmed.chars().take_while(|c| *c == '#').count();
        let is_heading = (1..=6).contains(&level)
            && trimmed[level..].starts_with(' ')
            && !trimmed[level..].trim().is_empty();
        if marker.is_some() || is_heading || trimmed.is_empty() {
            if let Some(p) = para.take() {
                out.push((p, start, section, false));
            }
        }
        if let Some(m) = marker {
            fence = Some((start, m));
        } else if is_heading {
            path.retain(|(l, _)| *l < level);
            path.push((level, trimmed[level..].trim().to_string()));
            headings.push(
                path.iter()
                    .map(|(_, h)| h.as_str())
                    .collect::<Vec<_>>()
                    .join(" › "),
            );
            section = headings.len() - 1;
        } else if !trimmed.is_empty() && para.is_none() {
            para = Some(start);
        }
    }
    if let Some((open, _)) = fence {
        out.push((open, text.len(), section, true));
    }
    if let Some(p) = para {
        out.push((p, text.len(), section, false));
    }
    (out, headings)
}

/// Pieces of block `start..end` no longer than `max` tokens each: code cut between lines,
/// prose between sentences, then either between words, then between characters.
#[allow(clippy::too_many_arguments)]
fn split(
    text: &str,
    start: usize,
    end: usize,
    section: usize,
    code: bool,
    max: usize,
    count: &dyn Fn(&str) -> usize,
    out: &mut Vec<Piece>,
) {
    split_at_level(
        text,
        start,
        end,
        section,
        if code { 0 } else { 1 },
        max,
        count,
        out,
    )
}

/// Where a too-long span may be cut, finest last: 0 lines, 1 sentences, 2 words, 3 characters.
#[allow(clippy::too_many_arguments)]
fn split_at_level(
    text: &str,
    start: usize,
    end: usize,
    section: usize,
    level: u8,
    max: usize,
    count: &dyn Fn(&str) -> usize,
    out: &mut Vec<Piece>,
) {
    let block = &text[start..end];
    let tokens = count(block);
    if tokens <= max {
        if !block.trim().is_empty() {
            out.push(Piece {
                start,
                end,
                tokens,
                section,
            });
        }
        return;
    }
    let cuts: Vec<usize> = match level {
        0 => cut_after(block, |_, c| c == '\n'),
        1 => cut_after(block, |rest, c| {
            matches!(c, '.' | '!' | '?' | '\n') && rest.starts_with(char::is_whitespace)
        }),
        2 => cut_after(block, |rest, c| {
            c.is_whitespace() && !rest.starts_with(char::is_whitespace)
        }),
        _ => {
            // One unbreakable run: cut between characters, about `max` tokens' worth of bytes.
            let step = (block.len() * max / tokens.max(1)).max(1);
            let mut at = 0;
            while at < block.len() {
                let mut to = (at + step).min(block.len());
                while !block.is_char_boundary(to) {
                    to += 1;
                }
                out.push(Piece {
                    start: start + at,
                    end: start + to,
                    tokens: count(&block[at..to]),
                    section,
                });
                at = to;
            }
            return;
        }
    };
    let finer = if level == 0 { 2 } else { level + 1 };
    if cuts.len() <= 1 {
        split_at_level(text, start, end, section, finer, max, count, out);
        return;
    }
    // Each part a piece of its own (the passages pack them); one too long alone is cut finer.
    let mut from = 0;
    for cut in cuts {
        split_at_level(
            text,
            start + from,
            start + cut,
            section,
            finer,
            max,
            count,
            out,
        );
        from = cut;
    }
}

/// Byte offsets just after each character `is_cut` accepts (given the text after it), and the
/// end: the places a block may be cut.
fn cut_after(block: &str, is_cut: impl Fn(&str, char) -> bool) -> Vec<usize> {
    let mut cuts = Vec::new();
    for (i, c) in block.char_indices() {
        let after = i + c.len_utf8();
        if after < block.len() && is_cut(&block[after..], c) {
            cuts.push(after);
        }
    }
    cuts.push(block.len());
    cuts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token per word, as a stand-in tokenizer.
    fn words(t: &str) -> usize {
        t.split_whitespace().count()
    }

    fn shape(max: usize, overlap: usize) -> ChunkShape {
        ChunkShape {
            max_tokens: max,
            overlap_tokens: overlap,
        }
    }

    #[test]
    fn headings_start_passages_and_name_them() {
        let text = "Intro words here.\n\n# Setup\n\nInstall it.\n\n## Linux\n\nUse apt.\n\n# Use\n\nRun it.\n";
        let chunks = chunk(text, shape(50, 5), &words);
        let got: Vec<(&str, &str)> = chunks
            .iter()
            .map(|c| (c.heading.as_str(), c.text.trim()))
            .collect();
        assert_eq!(
            got,
            [
                ("", "Intro words here."),
                ("Setup", "Install it."),
                ("Setup › Linux", "Use apt."),
                ("Use", "Run it."),
            ]
        );
        for c in &chunks {
            assert_eq!(
                &text[c.start_byte as usize..c.end_byte as usize],
                c.text,
                "a passage is its byte range"
            );
        }
    }

    #[test]
    fn long_sections_are_cut_by_tokens_with_overlap() {
        let para: String = (0..10)
            .map(|i| format!("Sentence number {i} is here. "))
            .collect();
        let text = format!("# Long\n\n{para}\n");
        let chunks = chunk(&text, shape(12, 5), &words);
        assert!(chunks.len() > 3, "{chunks:?}");
        for c in &chunks {
            assert!(c.tokens <= 12, "{c:?}");
            assert_eq!(c.heading, "Long");
        }
        // Consecutive passages share their seam, and together cover every sentence.
        for pair in chunks.windows(2) {
            assert!(pair[1].start_byte < pair[0].end_byte, "overlap: {pair:?}");
            assert!(
                pair[1].start_byte > pair[0].start_byte,
                "progress: {pair:?}"
            );
        }
        let all: String = chunks.iter().map(|c| c.text.clone()).collect();
        for i in 0..10 {
            assert!(all.contains(&format!("number {i} is")), "{i}");
        }
    }

    #[test]
    fn code_blocks_stay_whole_when_they_fit_and_are_cut_between_lines_when_not() {
        let text = "Before.\n\n```rust\nfn a() {}\n\n# not a heading\nfn b() {}\n```\n\nAfter.\n";
        let chunks = chunk(text, shape(20, 0), &words);
        let code = chunks
            .iter()
            .find(|c| c.text.contains("fn a"))
            .expect("the code");
        assert!(
            code.text.contains("fn b") && code.text.contains("# not a heading"),
            "{chunks:?}"
        );
        assert!(
            chunks.iter().all(|c| c.heading.is_empty()),
            "no heading inside code"
        );

        let long: String = (0..20).map(|i| format!("let x{i} = {i};\n")).collect();
        let text = format!("```\n{long}```\n");
        let chunks = chunk(&text, shape(10, 0), &words);
        assert!(chunks.len() > 1);
        for c in &chunks {
            assert!(c.tokens <= 10, "{c:?}");
            assert!(
                c.end_byte as usize == text.len() || c.text.ends_with('\n'),
                "{c:?}"
            );
        }
    }

    #[test]
    fn an_unbreakable_run_is_cut_between_characters() {
        let text = "é".repeat(300);
        // A token per 4 bytes.
        let chunks = chunk(&text, shape(16, 0), &|t: &str| t.len().div_ceil(4));
        assert!(chunks.len() > 1);
        let joined: String = chunks.iter().map(|c| c.text.clone()).collect();
        assert_eq!(joined, text);
    }

    #[test]
    fn empty_text_has_no_passages() {
        assert!(chunk("", shape(10, 2), &words).is_empty());
        assert!(chunk("\n\n  \n", shape(10, 2), &words).is_empty());
    }
}
