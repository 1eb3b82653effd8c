//! `make gpu-check`'s and `make gpu-lease`'s orchestration, tested where there is no GPU: the
//! HTTP and speculation phases and the report dry-run against the CPU (`--device cpu`), and the
//! lease end to end on the CPU, with the binary under test standing in for the bundle's. On a GPU
//! the same phases start `serve --device cuda` and expect the fast tier.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

#[test]
fn the_http_phase_and_the_report_run_against_a_cpu_server() {
    let root = common::crate_root();
    let dir = tempfile::tempdir().expect("tempdir");
    let bundle = dir.path().join("bundle");
    std::fs::create_dir_all(&bundle).expect("mkdir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_smolchat"), bundle.join("smolchat"))
        .expect("symlink");
    let out = dir.path().join("out");
    let run = |args: &[&str]| {
        let o = Command::new("bash")
            .arg(root.join("scripts/gpu-check.sh"))
            .args(args)
            .arg("--bundle")
            .arg(&bundle)
            .arg("--out")
            .arg(&out)
            .arg("--work")
            .arg(dir.path().join("work"))
            .current_dir(&root)
            .output()
            .expect("gpu-check.sh runs");
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
    };
    // Runs a phase dry (`--device cpu`) and reads its record, which must say it passed.
    let passed = |phase: &str| -> serde_json::Value {
        let said = run(&[phase, "--device", "cpu"]);
        let path = out.join(format!("{phase}.json"));
        let record: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}: {said}")),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(record["status"], "passed", "{said}\n{record}");
        record
    };
    let http = passed("http");
    let checks = http["result"]["checks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for name in [
        "reply streamed to done",
        "reply stored complete",
        "/v1 streamed",
        "metrics name the device",
    ] {
        assert!(
            checks.iter().any(|c| c["check"] == name && c["ok"] == true),
            "{name}: {http}"
        );
    }
    assert_eq!(http["result"]["tier"], "cpu");
    // The speculation phase, dry-run on the tiny test file: the three workloads, drafts off and
    // on, with the same tokens.
    let spec = passed("speculation");
    let rows = spec["result"]["speculative"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(rows.len(), 3, "{spec}");
    assert!(rows.iter().all(|r| r["same_tokens"] == true), "{spec}");
    // A phase with nothing to run says so, and the report gathers every phase.
    run(&["llama"]);
    run(&["profile", "--device", "cpu"]);
    let said = run(&["report"]);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("gpu-check.json")).expect("report"))
            .expect("json");
    let status = |p: &str| {
        report["phases"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["phase"] == p))
            .map(|r| r["status"].clone())
    };
    assert_eq!(status("http"), Some("passed".into()), "{said}");
    assert_eq!(status("llama"), Some("skipped".into()), "{said}");
    assert_eq!(status("profile"), Some("skipped".into()), "{said}");
    assert_eq!(status("kernels"), Some("not run".into()), "{said}");
    let md = std::fs::read_to_string(out.join("gpu-check.md")).expect("md");
    assert!(md.contains("| http | passed |"), "{md}");
    assert!(md.contains("| speculation | passed |"), "{md}");
    assert!(
        md.contains("| rewrite |") && md.contains("Chat series:"),
        "{md}"
    );
}

/// What a lease left and said: its exit status, stdout, stderr, gpu-lease.json.
struct Lease {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    report: serde_json::Value,
}

impl Lease {
    fn phase(&self, name: &str) -> &serde_json::Value {
        self.report["phases"]
            .as_array()
            .and_then(|a| a.iter().find(|p| p["phase"] == name))
            .unwrap_or_else(|| panic!("no {name} in {}", self.report))
    }

    fn status(&self, name: &str) -> &str {
        self.phase(name)["status"].as_str().unwrap_or_default()
    }

    fn reason(&self, name: &str) -> &str {
        self.phase(name)["reason"].as_str().unwrap_or_default()
    }
}

/// The lease's order of phases, without --with-llama.
const LEASE_ORDER: [&str; 8] = [
    "env",
    "kernels",
    "bench",
    "tiers",
    "profile",
    "server",
    "http",
    "sanitizer",
];

#[test]
fn the_lease_dry_runs_on_the_cpu_in_its_order_within_its_budget() {
    let root = common::crate_root();
    let dir = tempfile::tempdir().expect("tempdir");
    let bundle = dir.path().join("bundle");
    std::fs::create_dir_all(&bundle).expect("mkdir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_smolchat"), bundle.join("smolchat"))
        .expect("symlink");
    let work = dir.path().join("work");
    let lease = |out: &Path, budget: &str, extra: &[&str]| -> Lease {
        let o = Command::new("bash")
            .arg(root.join("scripts/gpu-check.sh"))
            .args(["lease", "--device", "cpu", "--budget", budget])
            .arg("--out")
            .arg(out)
            .arg("--bundle")
            .arg(&bundle)
            .arg("--work")
            .arg(&work)
            .args(extra)
            // No GPU, even on a machine with one.
            .env("NVIDIA_SMI", dir.path().join("no-nvidia-smi"))
            .env_remove("OUT")
            .current_dir(&root)
            .output()
            .expect("gpu-check.sh runs");
        let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        let report = serde_json::from_str(
            &std::fs::read_to_string(out.join("gpu-lease.json"))
                .unwrap_or_else(|e| panic!("{e}: {stdout}{stderr}")),
        )
        .expect("gpu-lease.json");
        Lease {
            code: o.status.code(),
            stdout,
            stderr,
            report,
        }
    };

    // With budget for every phase: the ones a CPU can dry-run run, the ones that need a GPU are
    // skipped saying so, and no GPU fails the lease, said on the first line.
    let started = Instant::now();
    let out = dir.path().join("out");
    let full = lease(&out, "480", &["--card", "NVIDIA H100 80GB HBM3"]);
    let said = format!("{}\n{}", full.stdout, full.stderr);
    let seconds = started.elapsed().as_secs_f64();
    assert_eq!(full.code, Some(1), "{said}");
    let first = full.stdout.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("gpu-lease: FAILED — env: no GPU: ")
            && first.contains("no-nvidia-smi is not installed"),
        "{said}"
    );
    let order: Vec<&str> = full.report["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| p["phase"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(order, LEASE_ORDER, "{said}");
    assert_eq!(full.status("env"), "failed", "{said}");
    for gpu_only in ["kernels", "tiers", "profile", "sanitizer"] {
        assert_eq!(full.status(gpu_only), "skipped", "{gpu_only}: {said}");
        assert!(
            full.reason(gpu_only).starts_with("no GPU"),
            "{gpu_only}: {said}"
        );
    }
    for dry in ["bench", "server", "http"] {
        assert_eq!(full.status(dry), "passed", "{dry}: {said}");
    }
    // The server phase also ran the same streams through the one OpenAI client on /v1 (and on
    // llama-server where `llama` built it: not here).
    let v1 = full.phase("server")["result"]["v1"]["concurrency"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(v1.len(), 2, "{}", full.phase("server"));
    assert!(
        v1.iter()
            .all(|r| r["tokens"].as_u64().is_some_and(|t| t > 0)
                && r["errors"] == serde_json::json!([])),
        "{v1:?}"
    );
    assert!(full.phase("server")["result"]["llama_server"].is_null());
    // Each phase in turn on stderr, the report rewritten after each one that ran.
    let mut at = 0;
    for p in LEASE_ORDER {
        let line = format!("gpu-lease {p}: ");
        at += full.stderr[at..]
            .find(&line)
            .unwrap_or_else(|| panic!("{p} out of order: {said}"));
    }
    assert_eq!(
        full.stderr.matches("; report rewritten").count(),
        4,
        "env, bench, server, http: {said}"
    );
    // At the start, before and after each phase run, after each phase skipped, at the end.
    assert_eq!(full.report["rewrites"], 1 + 2 * 4 + 4 + 1, "{said}");
    // The bench figures over the H100's anchors, each with the card, driver, commit and depth.
    let rows = full.report["comparison"]["rows"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(rows.len(), 3, "{}", full.report);
    for r in &rows {
        assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
        assert_eq!(r["anchor_card"], "NVIDIA H100 80GB HBM3", "{r}");
        assert!(
            r["smolchat_context"]
                .as_str()
                .is_some_and(|c| c.contains('→')),
            "{r}"
        );
        assert!(
            r.get("commit").is_some() && r.get("driver").is_some(),
            "{r}"
        );
    }
    let md = std::fs::read_to_string(out.join("gpu-lease.md")).expect("md");
    assert_eq!(md.lines().next(), Some(first), "{md}");
    assert!(md.contains("| 3 | bench | passed |"), "{md}");
    assert!(md.contains("DRY RUN"), "{md}");
    // The output folder holds the report and one small archive, nothing more.
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .expect("out")
        .map(|e| {
            let e = e.expect("entry");
            let len = e.metadata().expect("metadata").len();
            assert!(len < 1 << 20, "{:?}: {len} bytes", e.file_name());
            e.file_name().to_string_lossy().into_owned()
        })
        .collect();
    names.sort();
    assert_eq!(names, ["gpu-lease.json", "gpu-lease.md", "raw.tar.xz"]);
    let listed = Command::new("tar")
        .arg("-tJf")
        .arg(out.join("raw.tar.xz"))
        .output()
        .expect("tar");
    let listed = String::from_utf8_lossy(&listed.stdout);
    for f in [
        "raw/env.log",
        "raw/bench.json",
        "raw/server.json",
        "raw/lease.log",
    ] {
        assert!(listed.lines().any(|l| l == f), "{f}: {listed}");
    }

    // A small budget: what does not fit is skipped with a line saying so; a card with no
    // anchor (none found, here) fails the bench phase instead of passing silently.
    let out = dir.path().join("out-small");
    let small = lease(&out, "85", &[]);
    let said = format!("{}\n{}", small.stdout, small.stderr);
    assert_eq!(small.code, Some(1), "{said}");
    assert!(
        small
            .stdout
            .starts_with("gpu-lease: FAILED — env: no GPU: "),
        "{said}"
    );
    assert_eq!(small.status("bench"), "failed", "{said}");
    assert!(
        small
            .reason("bench")
            .starts_with("missing figure: no llama.cpp anchor"),
        "{said}"
    );
    assert_eq!(small.status("server"), "skipped", "{said}");
    assert!(
        small.reason("server").starts_with("budget: ")
            && small
                .reason("server")
                .ends_with("server is estimated at 120 s"),
        "{said}"
    );
    let md = std::fs::read_to_string(out.join("gpu-lease.md")).expect("md");
    assert!(md.contains("| 6 | server | skipped | 120 |"), "{md}");
    eprintln!("the full dry run took {seconds:.1} s");
}

/// The profile phase's summary of an Nsight Compute log: the per-kernel table, of the last
/// `--tail` launches when one decode token of a longer run is wanted (llama-bench's), with the
/// units ncu declares; and the report's tables of one decode step, ours beside llama.cpp's.
#[test]
fn ncu_logs_are_summed_per_kernel_and_the_report_sets_the_decode_steps_side_by_side() {
    let root = common::crate_root();
    let dir = tempfile::tempdir().expect("tempdir");
    let csv = dir.path().join("ncu.csv");
    std::fs::write(
        &csv,
        "==PROF== Connected to process\n\
         \"ID\",\"Process ID\",\"Kernel Name\",\"gpu__time_duration.sum\"\n\
         \"\",\"\",\"\",\"usecond\"\n\
         \"0\",\"1\",\"prefill_kernel(float*)\",\"100.0\"\n\
         \"1\",\"1\",\"matvec_q4_k\",\"3.5\"\n\
         \"2\",\"1\",\"rms_norm\",\"1.0\"\n\
         \"3\",\"1\",\"matvec_q4_k\",\"4.5\"\n",
    )
    .expect("write");
    let summary = |extra: &[&str]| -> serde_json::Value {
        let o = Command::new("python3")
            .arg(root.join("scripts/gpu_check.py"))
            .arg("ncu-summary")
            .arg(&csv)
            .arg("a decode step")
            .args(extra)
            .output()
            .expect("gpu_check.py runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).expect("JSON")
    };
    let all = summary(&[]);
    assert_eq!(all["launches"], 4);
    assert_eq!(all["top"][0]["kernel"], "prefill_kernel");
    let tail = summary(&["--tail", "3"]);
    assert_eq!(tail["launches"], 3);
    assert_eq!(tail["workload"], "a decode step");
    assert_eq!(tail["top"][0]["kernel"], "matvec_q4_k");
    assert_eq!(tail["top"][0]["launches"], 2);
    assert_eq!(tail["top"][0]["total_us"], 8.0);
    assert_eq!(tail["total_us"], 9.0);
    let o = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import sys, json; sys.path.insert(0, {:?}); import gpu_check as g; \
             t = json.loads(sys.argv[1]); \
             print('\\n'.join(g.ncu_lines({{'decode': {{'0': {{'ours': t, 'llama': t}}}}}})))",
            root.join("scripts").display().to_string()
        ))
        .arg(tail.to_string())
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        text.contains("One decode step at depth 0") && text.contains("llama.cpp's ÷ ours: 1.00"),
        "{text}"
    );
    assert!(
        text.contains("| `matvec_q4_k` | 2 | 8.0 | 4.00 |"),
        "{text}"
    );
}
