//! What the Debian package is built from (`.ci/dist-assets.sh`, then
//! `cargo deb --no-build`; `.ci/deb.sh` builds and checks the package itself):
//! the assets script says "build first" when there is no release binary, and
//! writes the man pages, completions and units where Cargo.toml takes them.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_clawmux");

fn dist_assets(target: &Path) -> std::process::Output {
    Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/dist-assets.sh"))
        .env("CARGO_TARGET_DIR", target)
        .output()
        .expect("bash runs the assets script")
}

#[test]
fn dist_assets_without_a_release_binary_says_build_first() {
    let target = tempfile::tempdir().unwrap();
    let out = dist_assets(target.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("is missing: build it first with cargo build --release"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line, no crash: {stderr}");
}

#[test]
fn dist_assets_writes_what_the_package_takes() {
    let target = tempfile::tempdir().unwrap();
    let release = target.path().join("release");
    std::fs::create_dir_all(&release).unwrap();
    crate::support::install_executable(Path::new(BIN), &release.join("clawmux"));
    let out = dist_assets(target.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dist = release.join("dist");
    // Every asset [package.metadata.deb] names under target/release/dist.
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let mut named = 0;
    for asset in manifest
        .lines()
        .filter_map(|l| l.trim().strip_prefix("[\"target/release/dist/"))
    {
        let rel = asset.split('"').next().unwrap();
        named += 1;
        if let Some(dir) = rel.strip_suffix("/*.1.gz") {
            let pages = std::fs::read_dir(dist.join(dir)).unwrap().count();
            assert!(pages >= 2, "{rel}: {pages} man pages");
        } else {
            assert!(dist.join(rel).is_file(), "{rel} missing");
        }
    }
    assert!(named >= 8, "Cargo.toml names {named} dist assets");
    let unit = std::fs::read_to_string(dist.join("systemd/clawmux.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/clawmux serve"), "{unit}");
}

#[test]
fn the_package_names_a_maintainer_address() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.starts_with("maintainer = "))
        .expect("[package.metadata.deb] maintainer");
    let (name, rest) = line.split_once('<').expect("Name <address>");
    assert!(name.len() > "maintainer = \"".len(), "{line}");
    assert!(rest.contains('@') && rest.ends_with(">\""), "{line}");
}

/// The README and the benchmarks page state one binary size, and the
/// README says how to measure it; `.ci/deb.sh` checks it against the
/// release binary (within 10 %).
#[test]
fn the_stated_binary_size_is_one_figure_with_how_to_measure_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md"))
        .unwrap()
        .replace('\n', " ");
    let bench = std::fs::read_to_string(root.join("docs/src/benchmarks.md"))
        .unwrap()
        .replace('\n', " ");
    let stated = readme
        .split("The binary is ")
        .nth(1)
        .and_then(|r| r.split(" MiB").next())
        .expect("README: The binary is N MiB");
    assert!(stated.parse::<f64>().is_ok(), "{stated}");
    assert!(
        bench.contains(&format!(
            "`cargo build --release` gives a {stated} MiB `clawmux`"
        )),
        "docs/src/benchmarks.md states another size than the README's {stated} MiB"
    );
    assert!(
        readme.contains("`ls -l target/release/clawmux`"),
        "how to measure it"
    );
    let deb = std::fs::read_to_string(root.join(".ci/deb.sh")).unwrap();
    assert!(
        deb.contains("grep -o 'binary is [0-9.]* MiB'"),
        "deb.sh checks it"
    );
}
