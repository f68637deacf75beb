//! A test that cannot run here is ignored with its reason, visible in the
//! plain `cargo test` summary, never printed as SKIPPED while it passes.
//! build.rs finds the tools; tests use
//! `#[cfg_attr(not(has_tool = "…"), ignore = "needs …")]`.

use std::path::Path;
use std::process::Command;

/// Runtime conditions no build can know (the sandbox refusing a cross-uid
/// connect before the broker sees it) may still say SKIPPED, for part of a
/// test that otherwise ran.
const RUNTIME_SKIP: &str = "the sandbox refused";

/// Each integration test file but this one: (file name, text).
fn test_sources() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it");
    std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs") && !path.ends_with("ignored.rs"))
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).unwrap())
        })
        .collect()
}

#[test]
fn every_ignored_test_gives_a_reason_and_none_prints_skipped() {
    let mut bad = Vec::new();
    for (name, text) in test_sources() {
        let mut in_ignored_test = false;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line == "#[ignore]" {
                bad.push(format!("{name}:{}: #[ignore] without a reason", n + 1));
            }
            if line.starts_with("#[ignore = ") {
                in_ignored_test = true;
            } else if line.starts_with("#[tokio::test") || line.starts_with("#[test]") {
                in_ignored_test = false;
            }
            if line.contains("\"SKIPPED") && !line.contains(RUNTIME_SKIP) && !in_ignored_test {
                bad.push(format!(
                    "{name}:{}: prints SKIPPED and passes: {line}",
                    n + 1
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Where Node's `ws` is missing, the plain summary names the test and why.
#[test]
fn a_test_without_its_tool_shows_as_ignored_with_its_reason() {
    if cfg!(has_tool = "node_ws") {
        return; // it runs here; nothing is ignored to look at
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "readme::readme_node_examples_work_with_xdg_runtime_dir",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(
            "test readme::readme_node_examples_work_with_xdg_runtime_dir ... ignored, needs node with ws"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("1 ignored"), "{stdout}");
}

/// An ignored test's reason tells a user of this repository how to run it:
/// no path that exists only beside the maintainers' checkout, no `pip
/// install` into a system Python (PEP 668 refuses it); the doc-example
/// tests point at `source .ci/doc-tools.sh`.
#[test]
fn every_ignore_reason_is_a_usable_hint() {
    let mut bad = Vec::new();
    for (name, text) in test_sources() {
        for (n, line) in text.lines().enumerate() {
            let Some(at) = line.find("ignore = \"") else {
                continue;
            };
            let reason = &line[at..];
            let doc_tools = name == "readme.rs" || name == "serve_messages.rs";
            if reason.contains("../shared")
                || reason.contains("pip install")
                || (doc_tools && !reason.contains("`source .ci/doc-tools.sh`"))
            {
                bad.push(format!("{name}:{}: {reason}", n + 1));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
