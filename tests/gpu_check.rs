//! `make gpu-check`'s orchestration, tested where there is no GPU: its HTTP phase and its report,
//! dry-run against a CPU server (`--device cpu`) with the binary under test standing in for the
//! bundle's. On a GPU the same phase starts `serve --device cuda` and expects the fast tier.

mod common;

use std::process::Command;

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
