//! Embedding requests: admitted without sampling, their hidden states pooled chunk by chunk
//! (mean or last, L2-normalized) into one vector.

use super::*;

/// What an embedding request has pooled of the hidden states computed so far.
pub(super) struct PoolState {
    pub(super) pooling: Pooling,
    /// Sum over positions (mean pooling) or the latest row (last pooling), in f64 so a long
    /// prompt's mean does not depend on the order of its chunks more than rounding must.
    pub(super) acc: Vec<f64>,
    pub(super) positions: usize,
}

impl PoolState {
    pub(super) fn new(pooling: Pooling) -> Self {
        Self {
            pooling,
            acc: Vec::new(),
            positions: 0,
        }
    }

    /// Adds `rows` (each `width` floats) of consecutive positions.
    pub(super) fn add(&mut self, rows: &[f32], width: usize) {
        if width == 0 {
            return;
        }
        if self.acc.len() != width {
            self.acc = vec![0.0; width];
        }
        for row in rows.chunks_exact(width) {
            match self.pooling {
                Pooling::Mean => {
                    for (a, &v) in self.acc.iter_mut().zip(row) {
                        *a += v as f64;
                    }
                }
                Pooling::Last => {
                    for (a, &v) in self.acc.iter_mut().zip(row) {
                        *a = v as f64;
                    }
                }
            }
            self.positions += 1;
        }
    }

    /// The pooled vector, L2-normalized (a zero vector stays zero).
    pub(super) fn finish(&self) -> Vec<f32> {
        let n = match self.pooling {
            Pooling::Mean => self.positions.max(1) as f64,
            Pooling::Last => 1.0,
        };
        let pooled: Vec<f64> = self.acc.iter().map(|a| a / n).collect();
        let norm = pooled.iter().map(|v| v * v).sum::<f64>().sqrt();
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        pooled.iter().map(|v| (v * scale) as f32).collect()
    }
}

impl ModelWorker {
    /// Admits an embedding request: a fresh sequence, since pooling needs the hidden state of
    /// every position (a cached prefix has none), and no generation state beyond the prompt.
    pub(super) fn admit_embedding(&mut self, id: RequestId) {
        let seq = self.engine.create_sequence();
        let Some(a) = self.active.get_mut(&id) else {
            self.engine.free_sequence(seq);
            return;
        };
        a.seq = Some(seq);
        a.keyed = false;
        if let Some(pool) = a.pool.as_mut() {
            // After a preemption: the positions pooled so far are computed again.
            *pool = PoolState::new(pool.pooling);
        }
        let first = a.resume.take().is_none();
        a.pending_prompt = a.request.prompt.clone();
        a.last_token = None;
        if !first {
            return;
        }
        a.cached_tokens = 0;
        a.admitted = Some(Instant::now());
        match Generation::new(&self.tokenizer, a.request.params.clone(), &a.request.prompt) {
            Ok(g) => a.generation = Some(g),
            Err(e) => tracing::warn!("bad sampling parameters reached the worker: {e}"),
        }
        let _ = a.request.events.send(GenEvent::Admitted {
            prompt_tokens: a.request.prompt.len(),
            cached_tokens: 0,
        });
    }

    /// Adds an embedding request's hidden-state rows of this step to its pool; after its last
    /// chunk, sends the vector and ends it.
    pub(super) fn pool_hidden(
        &mut self,
        id: RequestId,
        rows: Option<&[f32]>,
        width: usize,
        last: bool,
    ) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        let Some(pool) = a.pool.as_mut() else {
            return;
        };
        if let Some(rows) = rows {
            pool.add(rows, width);
        }
        if last {
            let vector = pool.finish();
            let _ = a.request.events.send(GenEvent::Embedding(vector));
            self.finish(id, StopReason::EndOfGeneration);
        }
    }
}
