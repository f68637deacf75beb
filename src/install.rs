//! `clawmux install-service`: writes the systemd user units (kept in
//! `systemd/` and embedded here) into the user's unit directory, with the
//! running binary's path in `ExecStart=`, and says how to enable them.
//!
//! It is idempotent (identical files are left alone) and never overwrites a
//! unit that differs from what it would write — edited by hand, or installed
//! from another binary — unless told to with `--force`.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The socket unit, as shipped.
pub const SOCKET_UNIT: &str = include_str!("../systemd/clawmux.socket");
/// The service unit template; [`render_service`] puts the binary path in.
pub const SERVICE_UNIT: &str = include_str!("../systemd/clawmux.service");

/// The program of the template's `ExecStart=` and `ExecReload=` (where
/// `cargo install` puts clawmux), replaced by the path of the binary that
/// runs `install-service`.
const TEMPLATE_PROGRAM: &str = "=%h/.cargo/bin/clawmux ";

/// Why installing failed; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("cannot find the user unit directory: set XDG_CONFIG_HOME or HOME")]
    NoConfigDir,
    #[error("cannot tell where the clawmux binary is: {0}")]
    CurrentExe(io::Error),
    #[error("the binary path {0:?} cannot be written into a unit file (it is not UTF-8 or contains a quote, backslash, '$' or control character); move the binary, e.g. cargo install --path .")]
    UnsupportedPath(PathBuf),
    #[error("{} already exist(s) and differ(s) from what install-service writes (edited by hand, or installed from another binary path); rerun with --force to replace, and keep local changes in a drop-in (systemctl --user edit clawmux.service)", list(.0))]
    Changed(Vec<PathBuf>),
    #[error("cannot write {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("there is no systemd user manager for you here ({0}), so `systemctl --user` cannot enable the units (it fails with \"Failed to connect to bus\"). Either:\n  - start one that runs without a login session: `loginctl enable-linger $USER` (an administrator may have to), then log in again (or `export XDG_RUNTIME_DIR=/run/user/$(id -u)`) and rerun `clawmux install-service`;\n  - or run `clawmux serve` under the supervisor you have (a system unit with User=, runit, s6, supervisord, a container's entry point): it needs no systemd.\nNothing was written (--force writes the units anyway, e.g. to prepare this home for later).")]
    NoUserManager(String),
}

fn list(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    names.join(", ")
}

/// What the command was asked to do.
#[derive(Debug, Clone, Copy, Default)]
pub struct InstallOptions {
    /// Show what would be written; write nothing.
    pub dry_run: bool,
    /// Replace units that differ.
    pub force: bool,
}

/// One unit file and how it compares with what is on disk.
#[derive(Debug)]
pub struct UnitFile {
    pub path: PathBuf,
    pub contents: String,
    pub state: UnitState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitState {
    Missing,
    Unchanged,
    Differs,
}

/// Whether this user has a running systemd user manager that `systemctl
/// --user` can reach: its private socket (`$XDG_RUNTIME_DIR/systemd/private`,
/// which systemctl tries first) or the user bus (`$XDG_RUNTIME_DIR/bus`).
/// Only the file system is looked at: nothing is started or asked, so a
/// check cannot half-succeed. `Err` says why there is none.
pub fn user_manager_present() -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    let runtime = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if Path::new(&dir).is_absolute() => PathBuf::from(dir),
        _ => {
            return Err(
                "XDG_RUNTIME_DIR is not set: no login session (su, sudo, a container, SSH without lingering?)"
                    .into(),
            )
        }
    };
    let candidates = [runtime.join("systemd/private"), runtime.join("bus")];
    if candidates
        .iter()
        .any(|p| fs::metadata(p).is_ok_and(|m| m.file_type().is_socket()))
    {
        return Ok(());
    }
    Err(format!(
        "neither {} nor {} is a socket",
        candidates[0].display(),
        candidates[1].display()
    ))
}

/// `$XDG_CONFIG_HOME` (if set and absolute, as the XDG spec requires), else `~/.config`.
pub fn config_home() -> Result<PathBuf, InstallError> {
    match std::env::var_os("XDG_CONFIG_HOME") {
        Some(dir) if Path::new(&dir).is_absolute() => Ok(PathBuf::from(dir)),
        _ => match std::env::var_os("HOME") {
            Some(home) if Path::new(&home).is_absolute() => Ok(Path::new(&home).join(".config")),
            _ => Err(InstallError::NoConfigDir),
        },
    }
}

/// Where the service's `LoadCredential=` reads the token (`%E/clawmux/gateway-token`).
pub fn token_path(config_home: &Path) -> PathBuf {
    config_home
        .join("clawmux")
        .join(crate::systemd::TOKEN_CREDENTIAL)
}

/// The service unit with `binary` as the program. Unit-file syntax: `%` is a
/// specifier (doubled), a path with spaces is quoted; characters that would
/// need escaping beyond that are refused rather than risked.
pub fn render_service(binary: &Path) -> Result<String, InstallError> {
    let unsupported = || InstallError::UnsupportedPath(binary.to_owned());
    let text = binary.to_str().ok_or_else(unsupported)?;
    if !binary.is_absolute()
        || text
            .chars()
            .any(|c| c.is_control() || matches!(c, '"' | '\'' | '\\' | '$'))
    {
        return Err(unsupported());
    }
    let escaped = text.replace('%', "%%");
    let program = if escaped.contains(char::is_whitespace) {
        format!("\"{escaped}\"")
    } else {
        escaped
    };
    debug_assert_eq!(SERVICE_UNIT.matches(TEMPLATE_PROGRAM).count(), 2);
    Ok(SERVICE_UNIT.replace(TEMPLATE_PROGRAM, &format!("={program} ")))
}

/// Where a package (the Debian one) puts the user units.
pub const PACKAGED_UNIT_DIRS: &[&str] = &["/usr/lib/systemd/user", "/lib/systemd/user"];

/// When a package's units exist too: systemd takes a user's units in
/// `~/.config/systemd/user` over a package's of the same name, so the
/// user is told which ones win and how to go back to the package's.
pub fn shadowing_note(dir: &Path, packaged: &[&str]) -> Option<String> {
    let shadowed: Vec<String> = ["clawmux.socket", "clawmux.service"]
        .iter()
        .filter_map(|name| {
            packaged
                .iter()
                .map(|d| Path::new(d).join(name))
                .find(|p| p.exists())
        })
        .map(|p| p.display().to_string())
        .collect();
    if shadowed.is_empty() {
        return None;
    }
    Some(format!(
        "note: these units in {} take the place of the installed package's ({}): systemd runs this binary, not the package's; to use the package's again, delete clawmux.socket and clawmux.service there and run `systemctl --user daemon-reload`",
        dir.display(),
        shadowed.join(", ")
    ))
}

/// The two units for `binary` in `dir`, compared with what is there.
pub fn plan(dir: &Path, binary: &Path) -> Result<Vec<UnitFile>, InstallError> {
    let wanted = [
        ("clawmux.socket", SOCKET_UNIT.to_owned()),
        ("clawmux.service", render_service(binary)?),
    ];
    wanted
        .into_iter()
        .map(|(name, contents)| {
            let path = dir.join(name);
            let state = match crate::files::read(&path, crate::files::CONFIG_MAX_BYTES) {
                Ok(bytes) if bytes == contents.as_bytes() => UnitState::Unchanged,
                Ok(_) => UnitState::Differs,
                Err(e) if e.is_not_found() => UnitState::Missing,
                // A unit that is not a regular file, or is absurdly large, is
                // one to replace, not to read.
                Err(crate::files::ReadError::Io { source, .. }) => {
                    return Err(InstallError::Io { path, source })
                }
                Err(_) => UnitState::Differs,
            };
            Ok(UnitFile {
                path,
                contents,
                state,
            })
        })
        .collect()
}

/// Writes `contents` next to `path` and renames it into place, so systemd
/// never reads a half-written unit.
fn write_atomically(path: &Path, contents: &str) -> Result<(), InstallError> {
    let io_err = |source| InstallError::Io {
        path: path.to_owned(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_err)?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let written = fs::write(&tmp, contents).and_then(|()| fs::rename(&tmp, path));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written.map_err(io_err)
}

/// The whole command: plan, refuse or write, and print what happened and
/// what to run next to `out`.
pub fn install_service(opts: InstallOptions, out: &mut impl Write) -> Result<(), InstallError> {
    let config = config_home()?;
    let dir = config.join("systemd").join("user");
    let binary = std::env::current_exe().map_err(InstallError::CurrentExe)?;
    let units = plan(&dir, &binary)?;
    let differing: Vec<PathBuf> = units
        .iter()
        .filter(|u| u.state == UnitState::Differs)
        .map(|u| u.path.clone())
        .collect();
    if !differing.is_empty() && !opts.force {
        return Err(InstallError::Changed(differing));
    }
    let print = |out: &mut dyn Write, text: String| {
        let _ = writeln!(out, "{text}");
    };
    let manager = user_manager_present();
    if let Err(why) = &manager {
        if !opts.force && !opts.dry_run {
            return Err(InstallError::NoUserManager(why.clone()));
        }
    }
    let verb = if opts.dry_run { "would be " } else { "" };
    for unit in &units {
        let what = match unit.state {
            UnitState::Unchanged => "unchanged".to_owned(),
            UnitState::Missing => format!("{verb}written"),
            UnitState::Differs => format!("{verb}replaced (--force)"),
        };
        print(out, format!("{}: {what}", unit.path.display()));
        if unit.state != UnitState::Unchanged {
            if opts.dry_run {
                print(out, format!("----\n{}----", unit.contents));
            } else {
                write_atomically(&unit.path, &unit.contents)?;
            }
        }
    }
    print(out, format!("ExecStart runs {}", binary.display()));
    if binary.components().any(|c| c.as_os_str() == "target") {
        print(
            out,
            "note: this binary is in a cargo build tree; `cargo install --locked --path .` and rerunning \
             install-service from ~/.cargo/bin keeps the service working after a cargo clean"
                .into(),
        );
    }
    if let Some(note) = shadowing_note(&dir, PACKAGED_UNIT_DIRS) {
        print(out, note);
    }
    let token = token_path(&config);
    if !token.exists() {
        print(
            out,
            format!(
                "\nThe service reads the gateway token from {} (LoadCredential=), which does not exist yet;\n\
                 it will not start without it. Create it (mode 0600) with the gateway's token:\n  \
                 install -d -m 700 {dir}\n  \
                 (umask 077; printf '%s' \"$TOKEN\" > {file})",
                token.display(),
                dir = token.parent().unwrap_or(&config).display(),
                file = token.display(),
            ),
        );
    }
    if let Err(why) = manager {
        print(
            out,
            format!(
                "\nnote: there is no systemd user manager for you here ({why}); the steps below \
                 fail until there is one (`loginctl enable-linger $USER`, then log in again), or run \
                 `clawmux serve` under another supervisor"
            ),
        );
    }
    let prefix = if opts.dry_run {
        "Then (not done: --dry-run):"
    } else {
        "Next:"
    };
    print(
        out,
        format!(
            "\n{prefix}\n  systemctl --user daemon-reload\n  systemctl --user enable --now clawmux.socket\n\
             Check: systemctl --user status clawmux.socket clawmux.service"
        ),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_that_shadow_a_packages_are_named() {
        let package = tempfile::tempdir().unwrap();
        let packaged = package.path().to_str().unwrap();
        let mine = Path::new("/home/u/.config/systemd/user");
        assert_eq!(shadowing_note(mine, &[packaged]), None);
        std::fs::write(package.path().join("clawmux.service"), "[Unit]\n").unwrap();
        let note = shadowing_note(mine, &["/nonexistent", packaged]).unwrap();
        assert!(
            note.contains("/home/u/.config/systemd/user take the place of the installed package's")
                && note.contains(&format!("{packaged}/clawmux.service"))
                && note.contains("daemon-reload"),
            "{note}"
        );
    }

    #[test]
    fn the_template_has_two_programs_to_replace() {
        assert_eq!(SERVICE_UNIT.matches(TEMPLATE_PROGRAM).count(), 2);
        let unit = render_service(Path::new("/opt/claw mux/bin/clawmux%1")).unwrap();
        assert!(
            unit.contains("\nExecStart=\"/opt/claw mux/bin/clawmux%%1\" serve "),
            "{unit}"
        );
        assert!(
            unit.contains("\nExecReload=\"/opt/claw mux/bin/clawmux%%1\" upgrade"),
            "{unit}"
        );
        assert_eq!(unit.lines().count(), SERVICE_UNIT.lines().count());
    }

    #[test]
    fn unwritable_paths_are_refused() {
        for bad in [
            "relative/clawmux",
            "/a\"b/clawmux",
            "/a$HOME/clawmux",
            "/a\nb",
        ] {
            assert!(
                matches!(
                    render_service(Path::new(bad)),
                    Err(InstallError::UnsupportedPath(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn plan_tells_missing_unchanged_and_differing_apart() {
        let dir = tempfile::tempdir().unwrap();
        let bin = Path::new("/usr/local/bin/clawmux");
        let states = |d: &Path| -> Vec<UnitState> {
            plan(d, bin).unwrap().into_iter().map(|u| u.state).collect()
        };
        assert_eq!(states(dir.path()), [UnitState::Missing, UnitState::Missing]);
        for unit in plan(dir.path(), bin).unwrap() {
            write_atomically(&unit.path, &unit.contents).unwrap();
        }
        assert_eq!(
            states(dir.path()),
            [UnitState::Unchanged, UnitState::Unchanged]
        );
        let other = plan(dir.path(), Path::new("/elsewhere/clawmux")).unwrap();
        assert_eq!(other[1].state, UnitState::Differs);
        assert_eq!(other[0].state, UnitState::Unchanged);
    }
}
