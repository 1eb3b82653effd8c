//! The layer check of `make lint` (`scripts/check-layers.py`): the tree as it is passes, and the
//! check fails when a forbidden dependency or an import cycle is added (on a copy of `src/`).

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

/// A copy of the repository's `src/` with `line` added at the top of `file`.
fn with_line(file: &str, line: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_dir(&common::crate_root().join("src"), &dir.path().join("src"));
    let path = dir.path().join("src").join(file);
    let text = std::fs::read_to_string(&path).expect("read");
    std::fs::write(&path, format!("{line}\n{text}")).expect("write");
    dir
}

#[test]
fn the_layers_hold_and_there_is_no_import_cycle() {
    let (ok, text) = check(&common::crate_root());
    assert!(ok, "{text}");
    assert!(text.contains("layers hold, no cycles"), "{text}");
}

#[test]
fn a_forbidden_dependency_fails_the_check() {
    // The engine naming the web layer.
    let dir = with_line("engine/npy.rs", "use crate::web::AppState;");
    let (ok, text) = check(dir.path());
    assert!(!ok, "the engine may not name the web layer:\n{text}");
    assert!(
        text.contains("engine/npy.rs")
            && text.contains("`crate::web::AppState` names the `web` layer"),
        "{text}"
    );
    // The store naming the actors, inside a use tree.
    let dir = with_line("store/bus.rs", "use crate::{actors::{Sessions}, engine};");
    let (ok, text) = check(dir.path());
    assert!(!ok, "{text}");
    assert!(text.contains("names the `actors` layer"), "{text}");
}

#[test]
fn an_import_cycle_fails_the_check() {
    // `session` names `text` already; `text` naming `session` closes a circle.
    let dir = with_line("actors/text.rs", "use super::session::SessionError;");
    let (ok, text) = check(dir.path());
    assert!(!ok, "{text}");
    assert!(
        text.contains("import cycle between")
            && text.contains("actors::text -> actors::session (SessionError)"),
        "{text}"
    );
}
