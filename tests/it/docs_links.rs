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
