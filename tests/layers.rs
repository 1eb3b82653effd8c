//! The layer check of `make lint` (`scripts/check-layers.py`): the workspace as it is passes, and
//! the check fails when a crate gains a forbidden dependency or a module an import cycle (on a
//! copy of the workspace's manifests and sources).

mod common;

use std::path::Path;
use std::process::Command;

fn check(root: &Path) -> (bool, String) {
    let out = Command::new("python3")
        .arg(common::crate_root().join("scripts/check-layers.py"))
        .arg("--root")
        .arg(root)
        .output()
        .expect("python3 runs the layer check");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

/// A copy of the workspace (its manifests, `src/` and `crates/`) with `edit` applied to the text
/// of `file`.
fn with_edit(file: &str, edit: impl Fn(&str) -> String) -> tempfile::TempDir {
    let root = common::crate_root();
    let dir = tempfile::tempdir().expect("tempdir");
    for f in ["Cargo.toml", "Cargo.lock"] {
        std::fs::copy(root.join(f), dir.path().join(f)).expect("copy manifest");
    }
    for d in ["src", "crates"] {
        copy_dir(&root.join(d), &dir.path().join(d));
    }
    let path = dir.path().join(file);
    let text = std::fs::read_to_string(&path).expect("read");
    let edited = edit(&text);
    assert_ne!(edited, text, "the edit must change {file}");
    std::fs::write(&path, edited).expect("write");
    dir
}

/// `line` added at the top of a source file.
fn with_line(file: &str, line: &str) -> tempfile::TempDir {
    with_edit(file, |text| format!("{line}\n{text}"))
}

/// `dependency` added to a crate's `[dependencies]`.
fn with_dependency(crate_dir: &str, dependency: &str) -> tempfile::TempDir {
    with_edit(&format!("crates/{crate_dir}/Cargo.toml"), |text| {
        text.replacen(
            "[dependencies]\n",
            &format!("[dependencies]\n{dependency}.workspace = true\n"),
            1,
        )
    })
}

#[test]
fn the_crate_graph_holds_and_there_is_no_import_cycle() {
    let (ok, text) = check(&common::crate_root());
    assert!(ok, "{text}");
    assert!(text.contains("the crate graph holds, no cycles"), "{text}");
}

#[test]
fn a_forbidden_crate_dependency_fails_the_check() {
    // The web layer reaching past the services to the store.
    let dir = with_dependency("web", "smolchat-store");
    let (ok, text) = check(dir.path());
    assert!(!ok, "the web layer may not depend on the store:\n{text}");
    assert!(
        text.contains("`smolchat-web` depends on `smolchat-store`, which it may not use"),
        "{text}"
    );
    // The engine depending on a crate above it.
    let dir = with_dependency("engine", "smolchat-serving");
    let (ok, text) = check(dir.path());
    assert!(!ok, "{text}");
    assert!(
        text.contains("`smolchat-engine` depends on `smolchat-serving`"),
        "{text}"
    );
}

#[test]
fn a_framework_of_a_higher_layer_in_the_engine_fails_the_check() {
    let dir = with_dependency("engine", "actix-web");
    let (ok, text) = check(dir.path());
    assert!(!ok, "the engine may not know HTTP:\n{text}");
    assert!(
        text.contains("`smolchat-engine` depends on `actix-web`, a framework of a layer above it"),
        "{text}"
    );
}

#[test]
fn an_import_cycle_fails_the_check() {
    // `step` names `backend` already; `backend` naming `step` closes a circle.
    let dir = with_line("crates/engine/src/backend.rs", "use crate::step::SeqId;");
    let (ok, text) = check(dir.path());
    assert!(!ok, "{text}");
    assert!(
        text.contains("import cycle in `smolchat-engine` between backend")
            && text.contains("backend -> step (SeqId)"),
        "{text}"
    );
}
