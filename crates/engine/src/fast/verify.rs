//! The check that a verifying step ([`LogitsMode::SampleAll`]: a decode with drafts, every
//! position drawn on the device) draws what plain decoding draws, inside one decode graph. The
//! same check runs on the CPU runner's twins (a unit test) and on a GPU (`tests/gpu.rs`, in
//! `make gpu-check`).

use crate::fast::twin::sample::SampleRow;
use crate::logits::{DeviceSampling, Logits, LogitsMode};
use crate::step::{Engine, SeqStep};

/// Draw `j` of a reply whose tokens so far are `history`: sampled (temperature, top-k, top-p,
/// a repetition penalty over `history`) with a fixed uniform, or greedy.
fn draw(j: usize, sampled: bool, history: &[u32]) -> DeviceSampling {
    if !sampled {
        return DeviceSampling {
            row: SampleRow::GREEDY,
            penalties: Vec::new(),
        };
    }
    let mut penalties: Vec<(u32, u32)> = Vec::new();
    for &t in history {
        match penalties.iter_mut().find(|p| p.0 == t) {
            Some(p) => p.1 += 1,
            None => penalties.push((t, 1)),
        }
    }
    penalties.sort_unstable();
    DeviceSampling {
        row: SampleRow {
            temperature: 0.9,
            inv_temperature: 1.0 / 0.9,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.3,
            uniform: [0.13, 0.71, 0.42, 0.88, 0.05, 0.57, 0.33][j % 7],
            ..SampleRow::GREEDY
        },
        penalties,
    }
}

/// Steps run through decode graphs so far (0 without graphs).
fn graph_steps(e: &Engine) -> u64 {
    e.graph_stats()
        .map_or(0, |s| s.warmups + s.captures + s.replays)
}

fn step(
    e: &mut Engine,
    step: SeqStep<'_>,
    draws: &[DeviceSampling],
    out: &mut Logits,
) -> Result<(), String> {
    e.step_sampled_into(&[step], &[draws], out)
        .map_err(|err| err.to_string())
}

/// Decodes six tokens after a prompt, drawn on the device one step at a time, then verifies
/// drafts of them on fresh sequences: the drafts all right, then wrong from the second. Each
/// verifying step must be one step of a decode graph (when the backend replays graphs), and its
/// rows up to the first wrong draft's must be the tokens decoding drew. `sampled` draws with
/// temperature and penalties (fixed uniforms), else greedily. Returns what went wrong.
pub fn verifying_steps_draw_as_decoding_does(e: &mut Engine, sampled: bool) -> Result<(), String> {
    let vocab = e.config().vocab_size as u32;
    // 14 positions: the verified rows (positions 14 to 18) cross into the second KV block.
    let prompt: Vec<u32> = (0..14).map(|t| (40 + 37 * t) % vocab).collect();
    let mut out = Logits::new();
    // The prompt into a new sequence, its next token drawn greedily.
    let prefilled = |e: &mut Engine, out: &mut Logits| -> Result<u64, String> {
        let seq = e.create_sequence();
        let first = SeqStep {
            seq,
            tokens: &prompt,
            logits: LogitsMode::Sample,
        };
        step(e, first, &[draw(0, false, &[])], out)?;
        Ok(seq)
    };
    let plain = prefilled(e, &mut out)?;
    let mut reply = vec![out.token(0).ok_or("the prompt's step drew no token")?];
    for j in 1..7 {
        let d = draw(j, sampled, &reply);
        let last = [reply[reply.len() - 1]];
        step(
            e,
            SeqStep {
                seq: plain,
                tokens: &last,
                logits: LogitsMode::Sample,
            },
            std::slice::from_ref(&d),
            &mut out,
        )?;
        reply.push(out.token(0).ok_or("a decode step drew no token")?);
    }
    let graphs = e.graph_stats().is_some();
    // [last, d1..d4], or fewer where the backend computes fewer rows alike (a GPU: 4, so that
    // the verifying rows go through the same kernels as the one-row decode's).
    let rows = e.rows_computed_alike(1).min(5);
    for (attempt, wrong_from) in [(0, 9), (1, 2), (2, 9)] {
        let seq = prefilled(e, &mut out)?;
        // Drafts of the reply's tokens 1.., wrong from `wrong_from` on.
        let mut input: Vec<u32> = reply[..rows].to_vec();
        for (k, t) in input.iter_mut().enumerate().skip(1) {
            if k >= wrong_from {
                *t = (*t + 1) % vocab;
            }
        }
        let draws: Vec<DeviceSampling> = (0..input.len())
            .map(|j| draw(j + 1, sampled, &input[..=j]))
            .collect();
        let before = graph_steps(e);
        step(
            e,
            SeqStep {
                seq,
                tokens: &input,
                logits: LogitsMode::SampleAll,
            },
            &draws,
            &mut out,
        )?;
        if graphs && graph_steps(e) != before + 1 {
            return Err(format!(
                "attempt {attempt}: the verifying step was not one step of a decode graph"
            ));
        }
        let drawn: Vec<u32> = out
            .tokens(0)
            .iter()
            .copied()
            .collect::<Option<_>>()
            .ok_or("the verifying step left rows undrawn")?;
        // Rows up to and including the first wrong draft's are what decoding drew.
        let valid = wrong_from.min(input.len());
        if drawn.len() != input.len() || drawn[..valid] != reply[1..=valid] {
            return Err(format!(
                "attempt {attempt} (sampled: {sampled}): the verifying step drew {drawn:?} for \
                 drafts {input:?}; decoding drew {reply:?}"
            ));
        }
    }
    if let Some(stats) = e.graph_stats() {
        if stats.replays == 0 {
            return Err(format!("no decode graph was replayed: {stats:?}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::fast::{cpu::CpuRunner, weights::FastWeights, FastBackend};
    use crate::kv::{KvOptions, KvType};
    use crate::synthetic::{self, SyntheticSpec, TypeMix};
    use smolchat_gguf::GgmlDType;

    fn engine() -> Engine {
        engine_with(true)
    }

    /// The fast tier on its CPU twins, decode graphs emulated or not.
    fn engine_with(graphs: bool) -> Engine {
        let spec = SyntheticSpec::tiny("smollm3").with_type_mix(TypeMix::Uniform(GgmlDType::Q8_0));
        let mut src = synthetic::build(&spec).unwrap_or_else(|e| panic!("{e}"));
        let config = ModelConfig::from_gguf(&src).unwrap_or_else(|e| panic!("{e}"));
        let weights =
            FastWeights::load(&mut src, config, &mut |_, _| {}).unwrap_or_else(|e| panic!("{e}"));
        let runner = CpuRunner::new(weights);
        let backend = Box::new(FastBackend::new(if graphs {
            runner.with_graph_emulation()
        } else {
            runner
        }));
        Engine::on_backend(
            backend,
            KvOptions {
                kv_type: KvType::F16,
                budget_bytes: None,
            },
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_verifying_step_draws_each_position_as_decode_does_in_a_graph_or_not() {
        for (sampled, graphs) in [(false, true), (true, true), (true, false)] {
            let mut e = engine_with(graphs);
            assert_eq!(e.graph_stats().is_some(), graphs);
            verifying_steps_draw_as_decoding_does(&mut e, sampled)
                .unwrap_or_else(|err| panic!("graphs {graphs}: {err}"));
        }
    }

    #[test]
    fn a_verifying_step_needs_one_draw_per_position() {
        let mut e = engine();
        let seq = e.create_sequence();
        let tokens = [5u32, 6, 7];
        let one = [draw(0, false, &[])];
        let err = step(
            &mut e,
            SeqStep {
                seq,
                tokens: &tokens,
                logits: LogitsMode::SampleAll,
            },
            &one,
            &mut Logits::new(),
        )
        .err()
        .unwrap_or_default();
        assert!(
            err.contains("asks for 3 tokens drawn on the device but gives 1"),
            "{err}"
        );
        assert_eq!(e.cached_tokens(seq).map(<[u32]>::len).ok(), Some(0));
    }
}
