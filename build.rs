//! Finds which of the tools some integration tests need are installed, so a
//! test that cannot run here is marked ignored *with its reason* in the plain
//! `cargo test` summary instead of passing without running (tests/it uses
//! `#[cfg_attr(not(has_tool = "jq"), ignore = "…")]`). Nothing outside the
//! tests reads these cfgs; the broker does not depend on any of the tools.
//!
//! Under `CI=true` every tool counts as present: CI installs them all
//! (.ci/doc-tools.sh, .ci/systemd-tools.sh, runs as root), so there each test
//! runs and one whose tool is missing fails instead of being ignored.
//!
//! The probe reruns when `PATH`, `NODE_PATH` or `CI` change; after installing
//! a tool into a directory already on `PATH`, `touch build.rs`.

use std::process::{Command, Stdio};

/// Each cfg value and the command that must succeed for it.
const PROBES: &[(&str, &str, &[&str])] = &[
    ("curl", "curl", &["--version"]),
    ("jq", "jq", &["--version"]),
    ("python_websockets", "python3", &["-c", "import websockets"]),
    ("node_ws", "node", &["-e", "require('ws')"]),
    ("tmux", "tmux", &["-V"]),
    ("man", "man", &["--version"]),
    ("script", "script", &["--version"]),
];

fn succeeds(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in ["PATH", "NODE_PATH", "CI"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let values: Vec<String> = PROBES
        .iter()
        .map(|(name, _, _)| format!("\"{name}\""))
        .chain(["\"root\"".to_owned()])
        .collect();
    println!(
        "cargo:rustc-check-cfg=cfg(has_tool, values({}))",
        values.join(", ")
    );
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    for (name, program, args) in PROBES {
        if ci || succeeds(program, args) {
            println!("cargo:rustc-cfg=has_tool=\"{name}\"");
        }
    }
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    if ci || root {
        println!("cargo:rustc-cfg=has_tool=\"root\"");
    }
}
