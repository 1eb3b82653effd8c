//! The logits a step asked for, in one buffer a caller keeps from step to step: every item's
//! rows (`vocab` floats each) back to back, and which rows are whose. A backend writes them where
//! they land (host memory for the CPU, a copy from the device for a GPU) without allocating once
//! the buffer has grown to the largest step.

/// Which logits a sequence wants from a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// None (a prefill chunk that is not the prompt's last).
    None,
    /// The last position only (what sampling needs).
    Last,
    /// Every position of the chunk (for `smolchat logits` and teacher-forced checks).
    All,
    /// No logits: the backend draws the next token from the last position on its device with
    /// the item's [`DeviceSampling`], and only the token comes back ([`Logits::token`]). For a
    /// backend whose `samples_on_device()` is set.
    Sample,
    /// No logits: the backend draws a token from every position of the chunk, each row with its
    /// own [`DeviceSampling`], and only the tokens come back ([`Logits::tokens`]). Verifying
    /// drafts: row `j` is drawn as a decode step at that position would draw it, so the drafts
    /// stand while each draw equals the next draft. Each row runs as a decode row of its own
    /// (it sees the positions before it, the step's earlier rows included), so the step fits a
    /// decode graph.
    SampleAll,
    /// No logits: the final hidden state (after the output norm, `hidden` floats) of every
    /// position of the chunk, for embeddings ([`Logits::hidden`]). The LM head is skipped.
    Hidden,
}

pub use crate::fast::twin::sample::{SampleRow, NO_TOKEN};

/// How a backend that samples on its device draws one sequence's next token: the parameters
/// (the draw's uniform number included, from the sequence's seeded generator) and the penalty
/// window as (token, occurrences), distinct tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSampling {
    pub row: SampleRow,
    pub penalties: Vec<(u32, u32)>,
}

impl LogitsMode {
    /// Rows of logits that come back to the host for a chunk of `tokens` tokens.
    pub fn host_rows(self, tokens: usize) -> usize {
        match self {
            LogitsMode::None | LogitsMode::Sample | LogitsMode::SampleAll | LogitsMode::Hidden => 0,
            LogitsMode::Last => 1,
            LogitsMode::All => tokens,
        }
    }

    /// Rows that go through the output norm on the device: those whose logits are computed (a
    /// sampled row's on the device) or whose hidden state is wanted.
    pub fn device_rows(self, tokens: usize) -> usize {
        match self {
            LogitsMode::Sample => 1,
            LogitsMode::SampleAll | LogitsMode::Hidden => tokens,
            other => other.host_rows(tokens),
        }
    }

    /// Tokens drawn on the device that come back to the host.
    pub fn drawn_rows(self, tokens: usize) -> usize {
        match self {
            LogitsMode::Sample => 1,
            LogitsMode::SampleAll => tokens,
            _ => 0,
        }
    }

    /// Whether the device draws this chunk's tokens ([`LogitsMode::Sample`],
    /// [`LogitsMode::SampleAll`]).
    pub fn samples(self) -> bool {
        matches!(self, LogitsMode::Sample | LogitsMode::SampleAll)
    }

    /// Rows of final hidden states that come back to the host.
    pub fn hidden_rows(self, tokens: usize) -> usize {
        match self {
            LogitsMode::Hidden => tokens,
            _ => 0,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logits {
    data: Vec<f32>,
    /// Per item of the step: its first row and how many rows it has (0: it asked for none).
    spans: Vec<(usize, usize)>,
    /// Tokens drawn on the device ([`LogitsMode::Sample`], [`LogitsMode::SampleAll`]), every
    /// item's back to back (`None` until the backend sets them), and per item its first and
    /// count.
    tokens: Vec<Option<u32>>,
    token_spans: Vec<(usize, usize)>,
    vocab: usize,
    /// Final hidden states ([`LogitsMode::Hidden`]), `width` floats a row, and per item its
    /// first row and row count.
    hidden: Vec<f32>,
    hidden_spans: Vec<(usize, usize)>,
    width: usize,
}

impl Logits {
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries of a row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Items of the step these are for.
    pub fn items(&self) -> usize {
        self.spans.len()
    }

    /// Item `i`'s rows, row after row (`rows × vocab`); `None` when it asked for none.
    pub fn get(&self, i: usize) -> Option<&[f32]> {
        let &(first, rows) = self.spans.get(i)?;
        (rows > 0).then(|| &self.data[first * self.vocab..(first + rows) * self.vocab])
    }

    /// The token drawn on the device for item `i` (it asked for [`LogitsMode::Sample`]; the
    /// first row's for [`LogitsMode::SampleAll`]); [`NO_TOKEN`] when its logits had no usable
    /// value.
    pub fn token(&self, i: usize) -> Option<u32> {
        self.tokens(i).first().copied().flatten()
    }

    /// The tokens drawn on the device for item `i`, one per row it asked to be drawn, in row
    /// order (`None` where the backend set none); empty when it asked for none.
    pub fn tokens(&self, i: usize) -> &[Option<u32>] {
        self.token_spans
            .get(i)
            .map_or(&[], |&(first, n)| &self.tokens[first..first + n])
    }

    /// `n` rows from row `first` of the buffer, to fill.
    pub(crate) fn rows_mut(&mut self, first: usize, n: usize) -> &mut [f32] {
        &mut self.data[first * self.vocab..(first + n) * self.vocab]
    }

    /// Records the tokens drawn on the device for item `i` (as many as it asked for).
    pub(crate) fn set_tokens(&mut self, i: usize, drawn: &[u32]) {
        if let Some(&(first, n)) = self.token_spans.get(i) {
            for (slot, &t) in self.tokens[first..first + n].iter_mut().zip(drawn) {
                *slot = Some(t);
            }
        }
    }

    /// Item `i`'s final hidden states, row after row (`rows × hidden`); `None` when it asked for
    /// none ([`LogitsMode::Hidden`]).
    pub fn hidden(&self, i: usize) -> Option<&[f32]> {
        let &(first, rows) = self.hidden_spans.get(i)?;
        (rows > 0).then(|| &self.hidden[first * self.width..(first + rows) * self.width])
    }

    /// Entries of a hidden-state row.
    pub fn hidden_width(&self) -> usize {
        self.width
    }

    /// Item `i`'s hidden-state rows, to fill.
    pub(crate) fn hidden_item_mut(&mut self, i: usize) -> Option<&mut [f32]> {
        let &(first, rows) = self.hidden_spans.get(i)?;
        let width = self.width;
        (rows > 0).then(|| &mut self.hidden[first * width..(first + rows) * width])
    }

    /// Item `i`'s rows, to change in place (a sampler applies penalties to them).
    pub fn get_mut(&mut self, i: usize) -> Option<&mut [f32]> {
        let &(first, rows) = self.spans.get(i)?;
        let vocab = self.vocab;
        (rows > 0).then(|| &mut self.data[first * vocab..(first + rows) * vocab])
    }

    /// Item `i`'s last row (the one a decode step samples from).
    pub fn last_row_mut(&mut self, i: usize) -> Option<&mut [f32]> {
        let vocab = self.vocab;
        self.get_mut(i).map(|rows| {
            let at = rows.len() - vocab;
            &mut rows[at..]
        })
    }

    /// Every item's rows as owned vectors (tests and one-off callers).
    pub fn into_vecs(self) -> Vec<Option<Vec<f32>>> {
        (0..self.items())
            .map(|i| self.get(i).map(<[f32]>::to_vec))
            .collect()
    }

    /// Lays the buffer out for a step whose items have `tokens` new tokens each and ask for
    /// `modes`, and returns all rows to fill (zeroed), in item order. Keeps its capacity.
    pub(crate) fn prepare(
        &mut self,
        vocab: usize,
        items: impl Iterator<Item = (usize, LogitsMode)>,
    ) -> &mut [f32] {
        self.vocab = vocab;
        self.spans.clear();
        self.tokens.clear();
        self.token_spans.clear();
        self.hidden_spans.clear();
        let mut rows = 0;
        let mut hidden_rows = 0;
        for (tokens, mode) in items {
            let n = mode.host_rows(tokens);
            self.spans.push((rows, n));
            let drawn = mode.drawn_rows(tokens);
            self.token_spans.push((self.tokens.len(), drawn));
            self.tokens.extend(std::iter::repeat_n(None, drawn));
            rows += n;
            let h = mode.hidden_rows(tokens);
            self.hidden_spans.push((hidden_rows, h));
            hidden_rows += h;
        }
        self.data.clear();
        self.data.resize(rows * vocab, 0.0);
        self.hidden.clear();
        self.hidden.resize(hidden_rows * self.width, 0.0);
        &mut self.data
    }

    /// Sets the width of hidden-state rows (the model's hidden size); call before
    /// [`Logits::prepare`] when some item asks for [`LogitsMode::Hidden`].
    pub(crate) fn set_hidden_width(&mut self, width: usize) {
        self.width = width;
    }

    /// Every hidden-state row of the step laid out by [`Logits::prepare`], in item order.
    pub(crate) fn hidden_mut(&mut self) -> &mut [f32] {
        &mut self.hidden
    }

    /// Forgets every row (a failed step leaves none).
    pub(crate) fn clear(&mut self) {
        self.data.clear();
        self.spans.clear();
        self.tokens.clear();
        self.token_spans.clear();
        self.hidden.clear();
        self.hidden_spans.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_laid_out_per_item_and_the_buffer_is_reused() {
        let mut l = Logits::new();
        let rows = l.prepare(
            3,
            [
                (5, LogitsMode::Last),
                (1, LogitsMode::None),
                (2, LogitsMode::All),
            ]
            .into_iter(),
        );
        assert_eq!(rows.len(), 3 * 3);
        for (i, x) in rows.iter_mut().enumerate() {
            *x = i as f32;
        }
        assert_eq!(l.items(), 3);
        assert_eq!(l.get(0), Some(&[0.0, 1.0, 2.0][..]));
        assert_eq!(l.get(1), None);
        assert_eq!(l.get(2), Some(&[3.0, 4.0, 5.0, 6.0, 7.0, 8.0][..]));
        assert_eq!(
            l.last_row_mut(2).map(|r| r.to_vec()),
            Some(vec![6.0, 7.0, 8.0])
        );
        let capacity = l.data.capacity();
        l.prepare(3, [(1, LogitsMode::Last)].into_iter());
        assert_eq!(
            l.data.capacity(),
            capacity,
            "a smaller step allocates nothing"
        );
        assert_eq!(l.get(0), Some(&[0.0, 0.0, 0.0][..]), "rows start zeroed");
        assert_eq!(l.clone().into_vecs(), vec![Some(vec![0.0; 3])]);
    }
}
