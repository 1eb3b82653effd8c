//! Which device the engine computes on: the one parser for `model.device` / `--device`, and the
//! choice between the CPU and a CUDA GPU.
//!
//! The choice is a pure function of what was asked for, what this binary can do and how many CUDA
//! devices answered ([`choose`]), so it is unit-tested without a GPU; [`select`] feeds it the real
//! facts and logs the outcome.

use std::fmt;
use std::str::FromStr;

use crate::{EngineError, Result};

/// What the configuration asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    /// A CUDA GPU when this binary and the machine can use one, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// `cuda` (= `cuda:0`) or `cuda:N`.
    Cuda(usize),
}

/// Where the engine computes, once chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

const EXPECTED: &str = "expected auto, cpu, cuda or cuda:N";

impl FromStr for DeviceRequest {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| EngineError::BadDevice {
            value: s.to_string(),
            reason: reason.to_string(),
        };
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            // Accepted by candle, but smolchat has no Metal path: say so instead of "unknown".
            "metal" => Err(bad(
                "Metal is not supported; smolchat runs on the CPU or a CUDA GPU (auto, cpu, cuda:N)",
            )),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => Err(bad(EXPECTED)),
            },
        }
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

// The config file stores the request as a string; (de)serializing through the parser keeps the
// parsing in this one place and turns a bad value into a load-time error naming the key.
crate::serde_via_str!(DeviceRequest);

/// Which path runs the model on a GPU (`model.gpu_tier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuTier {
    /// The fast tier after it passes its start-up self-check against the reference tier; the
    /// reference tier when it does not (or when the file has matrices it cannot run).
    #[default]
    Auto,
    /// The fast tier, unchecked.
    Fast,
    /// The reference tier (candle's operations), always.
    Reference,
}

impl FromStr for GpuTier {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "fast" => Ok(Self::Fast),
            "reference" => Ok(Self::Reference),
            _ => Err(EngineError::BadDevice {
                value: s.to_string(),
                reason: "expected auto, fast or reference (model.gpu_tier)".into(),
            }),
        }
    }
}

impl fmt::Display for GpuTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Fast => "fast",
            Self::Reference => "reference",
        })
    }
}

crate::serde_via_str!(GpuTier);

/// What computes the model: the CPU engine, or one of the GPU tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Cpu,
    /// Candle's operations on a device (`reference.rs`).
    Reference,
    /// The operation list with our kernels (`fast/`).
    Fast,
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu",
            Self::Reference => "reference",
            Self::Fast => "fast",
        })
    }
}

/// What this binary can do with a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Built with the `cuda` feature (candle's CUDA backend and kernels linked in).
    pub cuda_compiled: bool,
    /// The engine has a CUDA backend to run the model on: with the `cuda` feature, the reference
    /// tier (`reference.rs`) on the GPU.
    pub cuda_backend: bool,
}

impl Capabilities {
    /// This build's capabilities.
    pub const fn this_build() -> Self {
        Self {
            cuda_compiled: cfg!(feature = "cuda"),
            cuda_backend: cfg!(feature = "cuda"),
        }
    }
}

/// The outcome of [`choose`]: the device and, for the log, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub device: Device,
    pub reason: String,
    /// A GPU answered but is left unused: worth a warning rather than an info line.
    pub gpu_unused: bool,
}

/// What probing for CUDA devices found: how many answered, or why none could be asked.
pub type GpuProbe = std::result::Result<usize, String>;

/// Picks the device for `request`. `probe` counts the CUDA devices; it is called only when the
/// answer matters (never for `cpu`, never in a build without the `cuda` feature).
pub fn choose(
    request: DeviceRequest,
    caps: Capabilities,
    probe: impl FnOnce() -> GpuProbe,
) -> Result<Choice> {
    let choice = |device, reason: String| {
        Ok(Choice {
            device,
            reason,
            gpu_unused: false,
        })
    };
    let unavailable = |reason: String| Err(EngineError::Device(request.to_string(), reason));
    match request {
        DeviceRequest::Cpu => choice(Device::Cpu, "requested".into()),
        DeviceRequest::Auto if !caps.cuda_compiled => choice(
            Device::Cpu,
            "this binary was built without the `cuda` feature".into(),
        ),
        DeviceRequest::Auto => match probe() {
            Err(why) => choice(Device::Cpu, format!("no CUDA device answered ({why})")),
            Ok(0) => choice(Device::Cpu, "no CUDA device found".into()),
            Ok(n) if caps.cuda_backend => choice(
                Device::Cuda(0),
                format!("{n} CUDA device(s) found; using the first"),
            ),
            Ok(n) => Ok(Choice {
                device: Device::Cpu,
                reason: format!(
                    "{n} CUDA device(s) found, but the engine's CUDA backend is not built yet; \
                     running on the CPU"
                ),
                gpu_unused: true,
            }),
        },
        DeviceRequest::Cuda(_) if !caps.cuda_compiled => unavailable(
            "this binary was built without the `cuda` feature (build it with `make cuda`), \
             or use device = \"cpu\""
                .into(),
        ),
        DeviceRequest::Cuda(n) => match probe() {
            Err(why) => unavailable(format!("no CUDA device answered ({why})")),
            Ok(0) => unavailable("no CUDA device found".into()),
            Ok(count) if n >= count => unavailable(format!(
                "{count} CUDA device(s) found, so the highest ordinal is {}",
                count - 1
            )),
            Ok(_) if !caps.cuda_backend => unavailable(
                "the engine's CUDA backend is not built yet (the model runs on the CPU only); \
                 use device = \"cpu\" or \"auto\""
                    .into(),
            ),
            Ok(count) => choice(
                Device::Cuda(n),
                format!("requested; {count} CUDA device(s) found"),
            ),
        },
    }
}

/// Bytes of memory free on GPU `ordinal` now (`None` without the `cuda` feature or a GPU).
pub fn free_memory(ordinal: usize) -> Option<usize> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        let ctx = CudaContext::new(ordinal).ok()?;
        ctx.mem_get_info().ok().map(|(free, _total)| free)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        None
    }
}

/// What a GPU's memory holds now (for the admin page and `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemory {
    /// The weights as uploaded.
    pub weights_bytes: usize,
    /// The KV arena as allocated (its blocks, used or not).
    pub kv_bytes: usize,
    /// Free on the device, as the driver reports it.
    pub free_bytes: usize,
    pub total_bytes: usize,
}

/// Serving limits that suit a device: the KV budget, how many sequences run at once and how many
/// tokens one step takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suggested {
    pub kv_budget_bytes: usize,
    pub max_running: usize,
    pub batch_token_budget: usize,
}

impl Suggested {
    /// The CPU's: a 2 GiB KV cache, 16 sequences, 512 tokens a step (a few cores serve a handful
    /// of users; larger steps only delay everyone's next token).
    pub const CPU: Suggested = Suggested {
        kv_budget_bytes: 2048 << 20,
        max_running: 16,
        batch_token_budget: 512,
    };

    /// A GPU's, with `free_bytes` of memory left after the weights: all but a margin for the
    /// step's buffers (a tenth of it, at least 1 GiB) for the KV cache, 64 sequences, 2048 tokens
    /// a step.
    pub fn gpu(free_bytes: usize) -> Suggested {
        let margin = (free_bytes / 10).max(1 << 30);
        Suggested {
            kv_budget_bytes: free_bytes.saturating_sub(margin),
            max_running: 64,
            batch_token_budget: 2048,
        }
    }
}

/// What suits `device` when the configuration leaves the serving limits unset: its free
/// memory decides a GPU's KV budget.
pub fn suggested_for(device: Device) -> Suggested {
    match device {
        Device::Cpu => Suggested::CPU,
        Device::Cuda(n) => free_memory(n).map_or(Suggested::CPU, Suggested::gpu),
    }
}

/// Counts the CUDA devices through the driver. Only meaningful with the `cuda` feature.
pub fn probe_cuda() -> GpuProbe {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        let n = CudaContext::device_count().map_err(|e| e.to_string())?;
        Ok(usize::try_from(n).unwrap_or(0))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this binary was built without the `cuda` feature".into())
    }
}

/// Chooses the device for `request` on this machine with this build, and logs the choice.
pub fn select(request: DeviceRequest) -> Result<Device> {
    let choice = choose(request, Capabilities::this_build(), probe_cuda)?;
    if choice.gpu_unused {
        tracing::warn!(requested = %request, device = %choice.device, reason = %choice.reason, "compute device");
    } else {
        tracing::info!(requested = %request, device = %choice.device, reason = %choice.reason, "compute device");
    }
    Ok(choice.device)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU_ONLY: Capabilities = Capabilities {
        cuda_compiled: false,
        cuda_backend: false,
    };
    const CUDA_NO_BACKEND: Capabilities = Capabilities {
        cuda_compiled: true,
        cuda_backend: false,
    };
    const CUDA_FULL: Capabilities = Capabilities {
        cuda_compiled: true,
        cuda_backend: true,
    };

    fn never() -> GpuProbe {
        panic!("the probe must not run here")
    }

    fn message(r: Result<Choice>) -> String {
        match r {
            Ok(c) => panic!("expected an error, got {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn parses_every_accepted_form() {
        for (s, want) in [
            ("auto", DeviceRequest::Auto),
            ("cpu", DeviceRequest::Cpu),
            ("CPU", DeviceRequest::Cpu),
            (" cuda ", DeviceRequest::Cuda(0)),
            ("cuda:0", DeviceRequest::Cuda(0)),
            ("cuda:3", DeviceRequest::Cuda(3)),
        ] {
            assert_eq!(s.parse::<DeviceRequest>().ok(), Some(want), "{s:?}");
        }
    }

    #[test]
    fn rejects_bad_strings_naming_the_value() {
        for s in ["cuda:x", "cuda:", "cuda:-1", "gpu", "", "cuda0", "cpu:0"] {
            let e = s.parse::<DeviceRequest>().err().map(|e| e.to_string());
            assert_eq!(
                e.as_deref(),
                Some(format!("device `{s}`: expected auto, cpu, cuda or cuda:N").as_str()),
            );
        }
        let metal = "metal"
            .parse::<DeviceRequest>()
            .err()
            .map(|e| e.to_string());
        assert!(
            metal
                .as_deref()
                .is_some_and(|m| m.contains("Metal is not supported")),
            "{metal:?}"
        );
    }

    #[test]
    fn display_round_trips_through_the_parser() {
        for r in [
            DeviceRequest::Auto,
            DeviceRequest::Cpu,
            DeviceRequest::Cuda(2),
        ] {
            assert_eq!(r.to_string().parse::<DeviceRequest>().ok(), Some(r));
        }
    }

    #[test]
    fn cpu_is_chosen_without_probing() {
        for caps in [CPU_ONLY, CUDA_NO_BACKEND, CUDA_FULL] {
            let c = choose(DeviceRequest::Cpu, caps, never)
                .ok()
                .map(|c| c.device);
            assert_eq!(c, Some(Device::Cpu));
        }
    }

    #[test]
    fn auto_without_the_feature_is_cpu_without_probing() {
        let c = choose(DeviceRequest::Auto, CPU_ONLY, never).ok();
        assert_eq!(c.as_ref().map(|c| c.device), Some(Device::Cpu));
        assert!(c.is_some_and(|c| c.reason.contains("without the `cuda` feature")));
    }

    #[test]
    fn auto_falls_back_to_cpu_when_no_gpu_answers() {
        let failed = choose(DeviceRequest::Auto, CUDA_FULL, || {
            Err("CUDA_ERROR_NO_DEVICE".into())
        });
        let failed = failed.ok();
        assert_eq!(failed.as_ref().map(|c| c.device), Some(Device::Cpu));
        assert!(failed.is_some_and(|c| c.reason.contains("CUDA_ERROR_NO_DEVICE")));
        let none = choose(DeviceRequest::Auto, CUDA_FULL, || Ok(0)).ok();
        assert_eq!(none.map(|c| c.device), Some(Device::Cpu));
    }

    #[test]
    fn auto_sees_the_gpu_but_stays_on_cpu_without_the_backend() {
        let c = choose(DeviceRequest::Auto, CUDA_NO_BACKEND, || Ok(2)).ok();
        assert_eq!(c.as_ref().map(|c| c.device), Some(Device::Cpu));
        assert_eq!(c.as_ref().map(|c| c.gpu_unused), Some(true));
        assert!(
            c.is_some_and(|c| c.reason.contains("2 CUDA device(s) found")
                && c.reason.contains("CUDA backend is not built yet"))
        );
    }

    #[test]
    fn auto_picks_the_first_gpu_with_the_backend() {
        let c = choose(DeviceRequest::Auto, CUDA_FULL, || Ok(2)).ok();
        assert_eq!(c.as_ref().map(|c| c.gpu_unused), Some(false));
        assert_eq!(c.map(|c| c.device), Some(Device::Cuda(0)));
    }

    #[test]
    fn explicit_cuda_errors_name_the_cause() {
        let m = message(choose(DeviceRequest::Cuda(0), CPU_ONLY, never));
        assert!(
            m.starts_with("device `cuda:0` is not available") && m.contains("make cuda"),
            "{m}"
        );
        let m = message(choose(DeviceRequest::Cuda(0), CUDA_FULL, || {
            Err("no driver".into())
        }));
        assert!(m.contains("no CUDA device answered (no driver)"), "{m}");
        let m = message(choose(DeviceRequest::Cuda(1), CUDA_FULL, || Ok(1)));
        assert!(
            m.contains("1 CUDA device(s) found, so the highest ordinal is 0"),
            "{m}"
        );
        let m = message(choose(DeviceRequest::Cuda(0), CUDA_FULL, || Ok(0)));
        assert!(m.ends_with("no CUDA device found"), "{m}");
        // A GPU answers but the engine cannot use it yet: refuse rather than silently use the CPU.
        let m = message(choose(DeviceRequest::Cuda(0), CUDA_NO_BACKEND, || Ok(1)));
        assert!(m.contains("CUDA backend is not built yet"), "{m}");
    }

    #[test]
    fn explicit_cuda_with_the_backend_uses_the_ordinal() {
        let c = choose(DeviceRequest::Cuda(1), CUDA_FULL, || Ok(2)).ok();
        assert_eq!(c.map(|c| c.device), Some(Device::Cuda(1)));
    }
}
