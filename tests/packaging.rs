//! The service recipes in `packaging/`: the systemd unit passes `systemd-analyze verify` (its
//! `ExecStart` pointed at this build's binary) and keeps a hardened exposure rating; the
//! container recipe runs as a non-root user with a `/data` volume and a health check on
//! `/readyz`. (No container engine on the test machines: the image itself is not built here.)

mod common;

use std::process::Command;

fn unit_for_this_build(dir: &std::path::Path) -> std::path::PathBuf {
    let unit = std::fs::read_to_string(common::crate_root().join("packaging/smolchat.service"))
        .expect("packaging/smolchat.service");
    assert!(
        unit.contains("ExecStart=/usr/local/bin/smolchat serve"),
        "{unit}"
    );
    let path = dir.join("smolchat.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/smolchat", env!("CARGO_BIN_EXE_smolchat")),
    )
    .expect("write the unit");
    path
}

fn systemd_analyze() -> Option<&'static str> {
    let found = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok();
    if !found && std::env::var_os("SMOLTEST_REQUIRE_SYSTEMD").is_some() {
        panic!("systemd-analyze is missing (apt-get install systemd)");
    }
    found.then_some("systemd-analyze")
}

#[test]
fn the_systemd_unit_verifies_and_is_hardened() {
    let Some(tool) = systemd_analyze() else {
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let unit = unit_for_this_build(dir.path());
    let out = Command::new(tool)
        .arg("verify")
        .arg(&unit)
        .output()
        .expect("systemd-analyze verify");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "systemd-analyze verify: {said}");
    assert!(said.trim().is_empty(), "warnings from verify: {said}");

    let out = Command::new(tool)
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze security");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let rating: f64 = text
        .lines()
        .find_map(|l| l.split("exposure level for smolchat.service: ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in: {text}"));
    assert!(
        rating <= 2.0,
        "exposure {rating} (0 best, 10 worst):\n{text}"
    );
    for setting in [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "StateDirectory=smolchat",
        "DynamicUser=yes",
        "Restart=on-failure",
    ] {
        assert!(
            std::fs::read_to_string(&unit)
                .unwrap_or_default()
                .contains(setting),
            "{setting}"
        );
    }
}

#[test]
fn the_container_recipe_runs_unprivileged_with_a_volume_and_a_health_check() {
    let recipe = std::fs::read_to_string(common::crate_root().join("packaging/Containerfile"))
        .expect("packaging/Containerfile");
    let lines: Vec<&str> = recipe
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .collect();
    let last_from = lines
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .expect("a FROM");
    let runtime = &lines[last_from..];
    let user = runtime
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the runtime stage names a USER");
    assert!(user != "root" && user != "0", "runs as {user}");
    assert!(runtime.contains(&"VOLUME [\"/data\"]"), "{recipe}");
    assert!(
        runtime.iter().any(|l| l.contains("/readyz")),
        "health check on /readyz"
    );
    assert!(
        runtime.iter().any(|l| l.starts_with("HEALTHCHECK")),
        "{recipe}"
    );
    assert!(runtime.contains(&"EXPOSE 8080"), "{recipe}");
    // The default model and the configuration the binary reads are in the image.
    for path in ["/opt/smolchat/models/", "/etc/smolchat/smolchat.toml"] {
        assert!(recipe.contains(path), "{path}");
    }
}
