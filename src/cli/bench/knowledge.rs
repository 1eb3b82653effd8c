//! `smolchat bench --knowledge-passages N`: what a knowledge search costs at N passages, on the
//! store `--database-url` names (a temporary SQLite file when none): passages of 150 words drawn
//! from this project's README (real English for the keyword index) with random unit vectors of
//! SmolLM2-135M's 576 dimensions, written as the indexer writes them; then, each the median of
//! 50 searches, the keyword ranking (FTS5's bm25 / PostgreSQL's ts_rank_cd over 50
//! candidates), loading the collection's vectors (once, then cached), the exact vector scan, and
//! reading the 5 passages found. The query's own embedding (one forward pass of the embedding
//! model) is not in these figures. Prints one JSON object.

use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;

use smolchat_service::knowledge::retrieve::VectorSet;
use smolchat_store::{NewChunk, NewDocument, Store};

/// Dimensions of SmolLM2-135M's embeddings.
const DIMS: usize = 576;
/// Passages a document holds here.
const PER_DOCUMENT: usize = 1_000;
const WORDS: usize = 150;
const SEARCHES: usize = 50;

/// SplitMix64: a seeded, repeatable stream of numbers (no dependency for a benchmark's noise).
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// In `-1.0..1.0`.
    fn signed(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(passages: usize, database_url: Option<&str>) -> Result<()> {
    anyhow::ensure!(passages > 0, "--knowledge-passages must be at least 1");
    let dir = tempfile::tempdir().context("a temporary folder")?;
    let url = database_url
        .map(str::to_string)
        .unwrap_or_else(|| format!("sqlite://{}", dir.path().join("bench.sqlite").display()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench(passages, &url))
}

async fn bench(passages: usize, url: &str) -> Result<()> {
    let readme =
        std::fs::read_to_string("README.md").context("README.md (run from the repository)")?;
    let vocabulary: Vec<&str> = readme
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.len() > 2)
        .collect();
    anyhow::ensure!(!vocabulary.is_empty(), "README.md has no words");
    let store = Store::open(url).await.context("opening the store")?;
    let mut rng = Noise(53);
    let unit = |rng: &mut Noise| -> Vec<f32> {
        let v: Vec<f32> = (0..DIMS).map(|_| rng.signed()).collect();
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.into_iter().map(|x| x / n).collect()
    };
    let collection = store
        .create_collection("bench", &format!("bench {passages}"), "")
        .await?;
    let started = Instant::now();
    let mut left = passages;
    let mut d = 0;
    while left > 0 {
        let n = left.min(PER_DOCUMENT);
        let chunks: Vec<NewChunk> = (0..n)
            .map(|i| {
                let text: Vec<&str> = (0..WORDS)
                    .map(|_| vocabulary[rng.below(vocabulary.len())])
                    .collect();
                let text = text.join(" ");
                NewChunk {
                    heading: format!("Section {i}"),
                    start_byte: 0,
                    end_byte: text.len() as i64,
                    tokens: WORDS as i64,
                    text,
                }
            })
            .collect();
        let doc = store
            .add_document(
                collection.id,
                "bench",
                &NewDocument {
                    name: &format!("doc-{d}.md"),
                    kind: "markdown",
                    size_bytes: 0,
                    text: "",
                },
            )
            .await?;
        store
            .set_document_chunks(doc.id, collection.id, &chunks)
            .await?;
        loop {
            let batch = store.chunks_to_embed(doc.id, 256).await?;
            if batch.is_empty() {
                break;
            }
            let rows: Vec<(i64, Vec<f32>)> = batch
                .iter()
                .map(|(id, _, _)| (*id, unit(&mut rng)))
                .collect();
            store.set_chunk_embeddings(doc.id, &rows).await?;
        }
        store.finish_document(doc.id, None).await?;
        left -= n;
        d += 1;
    }
    let written_s = started.elapsed().as_secs_f64();

    let collections = [collection.id];
    let mut keyword = Vec::new();
    let mut found_any = 0;
    for _ in 0..SEARCHES {
        let words: Vec<String> = (0..5)
            .map(|_| vocabulary[rng.below(vocabulary.len())].to_lowercase())
            .collect();
        let t = Instant::now();
        let hits = store.keyword_search(&collections, &words, 50).await?;
        keyword.push(t.elapsed().as_secs_f64() * 1e3);
        found_any += usize::from(!hits.is_empty());
    }
    let t = Instant::now();
    let rows = store.chunk_vectors(collection.id).await?;
    let read_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let set = VectorSet::new(
        rows.into_iter()
            .filter_map(|(id, b)| smolchat_store::decode_vector(&b).map(|v| (id, v))),
    );
    let build_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut scan = Vec::new();
    let mut fetch = Vec::new();
    for _ in 0..SEARCHES {
        let q = unit(&mut rng);
        let t = Instant::now();
        let near = set.nearest(&q, 50);
        scan.push(t.elapsed().as_secs_f64() * 1e3);
        let ids: Vec<i64> = near.iter().take(5).map(|n| n.0).collect();
        let t = Instant::now();
        let got = store.chunks(&ids).await?;
        fetch.push(t.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(got.len() == ids.len(), "passages went missing");
    }
    let report = json!({
        "passages": passages,
        "backend": if url.starts_with("sqlite") { "sqlite" } else { "postgres" },
        "dims": DIMS,
        "write_s": written_s,
        "keyword_ms_median": median(keyword),
        "keyword_searches_with_hits": found_any,
        "vectors_read_ms": read_ms,
        "vectors_build_ms": build_ms,
        "vector_scan_ms_median": median(scan),
        "fetch_5_ms_median": median(fetch),
        "vector_memory_mib": (set.len() * DIMS * 4) as f64 / (1 << 20) as f64,
        "searches": SEARCHES,
    });
    println!("{report}");
    Ok(())
}
