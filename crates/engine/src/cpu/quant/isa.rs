//! Which instruction set the quantized kernels use: what this CPU has, capped by the
//! configuration (`model.isa`, `--isa`) or by `SMOLCHAT_ISA`, decided once per process.

use std::sync::OnceLock;

/// Instruction sets with kernels, best last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 with `vpmaddubsw`/`vpmaddwd` dot products.
    Avx2,
    /// AVX2 plus AVX-VNNI (`vpdpbusd` on 256-bit registers).
    AvxVnni,
    /// AVX-512 (F, BW, VL) plus AVX512-VNNI.
    Avx512Vnni,
}

impl Isa {
    /// Whether this CPU can run the kernels of `self`.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::AvxVnni => avx2 && is_x86_feature_detected!("avxvnni"),
                Isa::Avx512Vnni => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// The instruction set the kernels use (decided once): the best this CPU has, or at most
    /// the one named by `SMOLCHAT_ISA` (`avx512`, `avxvnni`, `avx2`, `scalar`), else by
    /// `model.isa` (or `--isa`, through [`configure_isa`]), so that one machine can compare the
    /// paths. A set the CPU lacks falls back to the best one below it, with a warning; an
    /// unknown name in the variable is ignored with a warning.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let forced = match std::env::var(ISA_VARIABLE) {
                Ok(name) => match Isa::parse(&name) {
                    Some(isa) => Some(isa),
                    None => {
                        tracing::warn!(
                            value = %name,
                            "{ISA_VARIABLE} is not one of avx512, avxvnni, avx2, scalar; ignored"
                        );
                        None
                    }
                },
                Err(_) => None,
            };
            let cap = forced.or(CONFIGURED_ISA.get().copied().flatten());
            let isa = Isa::best_up_to(cap.unwrap_or(Isa::Avx512Vnni));
            match cap {
                Some(wanted) if wanted != isa => tracing::warn!(
                    wanted = wanted.name(),
                    using = isa.name(),
                    "{ISA_VARIABLE} or model.isa asks for an instruction set this CPU lacks"
                ),
                _ => {}
            }
            tracing::info!(
                isa = isa.name(),
                capped = cap.is_some(),
                "quantized matmul kernels"
            );
            isa
        })
    }

    /// The best available instruction set no better than `cap`.
    pub fn best_up_to(cap: Isa) -> Isa {
        [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2]
            .into_iter()
            .filter(|&i| i <= cap)
            .find(|i| i.available())
            .unwrap_or(Isa::Scalar)
    }

    /// `SMOLCHAT_ISA`'s spelling of an instruction set.
    pub fn parse(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "avx512" | "avx512vnni" | "avx512-vnni" => Some(Isa::Avx512Vnni),
            "avxvnni" | "avx-vnni" => Some(Isa::AvxVnni),
            "avx2" => Some(Isa::Avx2),
            "scalar" => Some(Isa::Scalar),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512Vnni => "avx512",
        }
    }
}

/// The environment variable that caps the kernels' instruction set.
pub const ISA_VARIABLE: &str = "SMOLCHAT_ISA";

/// The configured cap ([`configure_isa`]), read when [`Isa::best`] first decides.
static CONFIGURED_ISA: OnceLock<Option<Isa>> = OnceLock::new();

/// Records the configured cap on the kernels' instruction set (`None`: the best this CPU has).
/// Only the first call counts, and only before the first matmul; `SMOLCHAT_ISA` still overrides.
pub fn configure_isa(cap: Option<Isa>) {
    if CONFIGURED_ISA.set(cap).is_err() && CONFIGURED_ISA.get() != Some(&cap) {
        tracing::warn!(
            ?cap,
            "the kernels' instruction set was already chosen for this process; ignored"
        );
    }
}

impl std::str::FromStr for Isa {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Isa::parse(s).ok_or_else(|| {
            format!(
                "instruction set `{}` is not one of avx512, avxvnni, avx2, scalar",
                s.trim()
            )
        })
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

crate::serde_via_str!(Isa);

#[cfg(test)]
mod tests {
    use super::Isa;

    #[test]
    fn isa_names_parse_and_caps_never_exceed_the_request() {
        for isa in [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni] {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
            let chosen = Isa::best_up_to(isa);
            assert!(chosen <= isa && chosen.available(), "{isa:?} -> {chosen:?}");
        }
        assert_eq!(Isa::parse(" AVX2 "), Some(Isa::Avx2));
        assert_eq!(Isa::parse("sse4"), None);
        assert_eq!(Isa::best_up_to(Isa::Scalar), Isa::Scalar);
    }
}
