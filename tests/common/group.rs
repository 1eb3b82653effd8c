//! Child programs that start programs of their own (chromedriver starts Chromium, nginx its
//! workers) run in a process group of their own, and are stopped as a group.
//!
//! Why: killing only the child orphans what it started. Before this, every `make test` left
//! about a hundred Chromium processes and nginx workers running after the suite had finished.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

/// Makes `cmd` start a new process group, led by the child, that its own children inherit.
pub fn own_group(cmd: &mut Command) -> &mut Command {
    cmd.process_group(0)
}

/// SIGKILL to every process of `child`'s group (see [`own_group`]), then reaps the child.
pub fn kill_group(child: &mut Child) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) with a negative pid signals that process group; it touches no memory.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}
