//! The book's link checker (`.ci/check-links.py`, run by `.ci/book.sh`):
//! the repository's own links resolve, and a broken `#anchor` is caught even
//! when the link's text wraps onto the next line.

use std::path::Path;
use std::process::Command;

fn check_links(root: &Path) -> (i32, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/check-links.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(root)
        .output()
        .expect("python3 runs the link checker");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn the_readme_and_the_book_have_no_broken_links() {
    let (code, out) = check_links(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert_eq!(code, 0, "{out}");
}

#[test]
fn a_wrapped_link_to_a_missing_anchor_is_reported_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("docs/src")).unwrap();
    std::fs::write(dir.path().join("README.md"), "# Title\n").unwrap();
    std::fs::write(
        dir.path().join("docs/src/a.md"),
        "# A\n\n## Here\n\nSee [the section\nthere](#there) and [here](#here).\n\
         Also [the other\npage](b.md#nowhere) and [b](b.md#b).\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("docs/src/b.md"), "# B\n").unwrap();
    let (code, out) = check_links(dir.path());
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("docs/src/a.md:6: #there: no heading #there"),
        "{out}"
    );
    assert!(
        out.contains("docs/src/a.md:8: b.md#nowhere: no heading #nowhere"),
        "{out}"
    );
    assert!(out.contains("2 broken"), "{out}");
}

/// A page that includes a file from elsewhere (the Benchmark results page
/// includes BENCHMARKS.md) is checked as the book renders it: the included
/// links resolve from the page's folder, where `docs/src/x.md` is a 404.
#[test]
fn links_in_an_included_file_resolve_from_the_including_page() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("docs/src")).unwrap();
    std::fs::write(dir.path().join("README.md"), "# Title\n").unwrap();
    std::fs::write(
        dir.path().join("NOTES.md"),
        "# Notes\n\nSee [x](docs/src/x.md).\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("docs/src/x.md"), "# X\n").unwrap();
    std::fs::write(
        dir.path().join("docs/src/notes.md"),
        "{{#include ../../NOTES.md}}\n",
    )
    .unwrap();
    let (code, out) = check_links(dir.path());
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("NOTES.md:3: docs/src/x.md (as included by docs/src/notes.md): no such file"),
        "{out}"
    );
}

/// `--html DIR` checks the built book: every relative href of every page,
/// print.html included, names a built file and an id in it.
#[test]
fn the_built_book_is_checked_page_by_page() {
    let dir = tempfile::tempdir().unwrap();
    let page = |name: &str, body: &str| {
        std::fs::write(
            dir.path().join(name),
            format!("<html><body>{body}</body></html>"),
        )
        .unwrap()
    };
    page("restarts.html", "<h1 id=\"restarts\">R</h1>");
    page(
        "benchmark-results.html",
        "<a href=\"docs/src/restarts.html\">r</a> <a href=\"restarts.html#restarts\">ok</a> <a href=\"https://example.com/\">x</a>",
    );
    page(
        "print.html",
        "<a href=\"#restarts\">ok</a>\n<a href=\"#nowhere\">bad</a> <div id=\"restarts\"></div>",
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/check-links.py");
    let out = Command::new("python3")
        .arg(script)
        .arg("--html")
        .arg(dir.path())
        .output()
        .expect("python3 runs the link checker");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(
            "benchmark-results.html:1: docs/src/restarts.html: no such file in the built book"
        ),
        "{text}"
    );
    assert!(
        text.contains("print.html:2: #nowhere: no id #nowhere"),
        "{text}"
    );
    assert!(text.contains("2 broken"), "{text}");
}

/// Every `cargo install` the README and the book show uses `--locked`:
/// without it cargo re-resolves the dependencies (and warns).
#[test]
fn every_cargo_install_in_the_docs_is_locked() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs/src")).unwrap() {
        files.push(entry.unwrap().path());
    }
    let mut unlocked = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            for (at, _) in line.match_indices("cargo install ") {
                let command = &line[at..];
                let command = command.split(['`', '#', ';', '&', ')']).next().unwrap();
                if !command.contains("--locked") {
                    unlocked.push(format!("{}:{}: {command}", file.display(), n + 1));
                }
            }
        }
    }
    assert!(unlocked.is_empty(), "{unlocked:#?}");
}

/// The names of the constants in the broker's source (`const NAME:`).
fn source_constants(dir: &Path, out: &mut std::collections::BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            source_constants(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            for line in text.lines() {
                let line = line.trim_start();
                let line = line
                    .strip_prefix("pub ")
                    .or_else(|| line.strip_prefix("pub(crate) "))
                    .or_else(|| line.strip_prefix("pub(super) "))
                    .unwrap_or(line);
                if let Some(rest) = line.strip_prefix("const ") {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    if name.len() > 1 {
                        out.insert(name);
                    }
                }
            }
        }
    }
}

/// The pages a user reads name limits by what they do and by their value,
/// never by the broker's internal constant (`HANDOVER_PAUSE_TIMEOUT`); the
/// maintainers' pages (how it is built, status, the gateway's own source
/// notes) may.
#[test]
fn user_docs_name_no_internal_constants() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut constants = std::collections::BTreeSet::new();
    source_constants(&root.join("src"), &mut constants);
    assert!(constants.contains("MAX_CURSOR"), "the source was read");
    let maintainers = ["how-it-is-built.md", "status.md", "gateway-source-notes.md"];
    let mut files = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs/src")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.extension().is_some_and(|e| e == "md") && !maintainers.contains(&name.as_str()) {
            files.push(path);
        }
    }
    let mut named = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            for word in line.split('`').skip(1).step_by(2) {
                if constants.contains(word) {
                    named.push(format!("{}:{}: {word}", file.display(), n + 1));
                }
            }
        }
    }
    assert!(named.is_empty(), "{named:#?}");
}
