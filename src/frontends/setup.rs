//! `clawmux setup claw3d`: points Claw3D studio at this broker, and
//! `--undo` puts everything back.
//!
//! What it changes, in this order (so a failure leaves Claw3D as it was):
//! 1. a copy of Claw3D's `settings.json` beside it, `settings.json.clawmux-backup`;
//! 2. when the broker found its gateway in that file, the gateway's URL in
//!    clawmux's config.toml (`[gateway] url`) and its token in a file of its
//!    own (`gateway-token` beside config.toml, `[gateway] token_file`), so the
//!    broker still finds the gateway once the file points at the broker;
//! 3. a record of what was done (`claw3d-setup.json` beside config.toml, no
//!    secret in it), which `--undo` follows;
//! 4. `settings.json` itself, with `gateway.url` set to
//!    `ws+unix://localhost<socket>:/api/gateway/ws`: the host is what Claw3D's
//!    proxy checks against `UPSTREAM_ALLOWLIST`, derives `Origin` from and
//!    counts as a local gateway; Node's `ws` takes the socket from the path.
//!
//! Every file written holds or may hold a secret and is written 0600
//! (atomically, see [`crate::private_files`]). Undo removes only what setup
//! added and is still as setup left it.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::config::Secret;
use crate::private_files::{write_private, Existing, Written};
use crate::settings::{self, fingerprint, Env, Resolved, Source};

/// The suffix of the copy of Claw3D's settings kept beside it.
pub const BACKUP_SUFFIX: &str = ".clawmux-backup";
/// The record of a setup, beside config.toml.
pub const RECORD_FILE: &str = "claw3d-setup.json";
/// The token file setup writes beside config.toml.
pub const TOKEN_FILE: &str = "gateway-token";
/// The token setup gives Claw3D when it has none of its own: Claw3D's
/// proxy will not connect without one, and the broker, which holds the
/// gateway's credential, does not send a client's.
pub const PLACEHOLDER_TOKEN: &str = "clawmux-holds-the-gateway-token";

/// What the command was asked to do.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Claw3D's settings file [default: `<stateDir>/claw3d/settings.json`].
    pub settings_file: Option<PathBuf>,
    /// Show the change, write nothing.
    pub dry_run: bool,
}

/// Why setup (or undo) did nothing; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// Claw3D already points at this broker: nothing to change (not a failure).
    #[error("{0}")]
    AlreadyDone(String),
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    File(#[from] crate::private_files::PrivateFileError),
}

fn refused(message: impl Into<String>) -> SetupError {
    SetupError::Refused(message.into())
}

/// The change setup would make, shown before it is made.
#[derive(Debug)]
pub struct Plan {
    settings_file: PathBuf,
    original: Option<Vec<u8>>,
    new_settings: Vec<u8>,
    new_url: String,
    old_url: Option<String>,
    config_file: PathBuf,
    config_before: Option<String>,
    config_after: Option<String>,
    record_url: Option<String>,
    record_token: Option<Secret>,
    placeholder_token: bool,
}

/// The URL Claw3D's proxy is given for `socket`.
pub fn claw3d_url(socket: &Path) -> Result<String, SetupError> {
    let text = socket.to_string_lossy();
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+~@".contains(c);
    if !socket.is_absolute() || !text.chars().all(plain) {
        return Err(refused(format!(
            "the socket path {} cannot be written into a ws+unix URL as it is (it must be absolute, \
             with no ':', '%', '?', '#' or spaces: Node's ws splits the URL at ':'); \
             serve on a plainer path with --socket",
            crate::sanitize::field(&text, 300)
        )));
    }
    Ok(format!("ws+unix://localhost{text}:/api/gateway/ws"))
}

/// Works out the change without writing anything.
pub fn plan(resolved: &Resolved, env: &Env, opts: &Options) -> Result<Plan, SetupError> {
    let settings_file = opts
        .settings_file
        .clone()
        .unwrap_or_else(|| settings::claw3d_settings_path(env));
    let config_file = resolved
        .config_file
        .clone()
        .or_else(|| settings::config_file_path(&settings::Overrides::default(), env))
        .ok_or_else(|| {
            refused("cannot tell where clawmux's config.toml is: set HOME or --config")
        })?;
    let record = record_path(&config_file);
    let original = read_file(&settings_file)?;
    let mut doc: Value = match &original {
        None => json!({}),
        Some(bytes) => serde_json::from_slice(bytes).map_err(|e| {
            refused(format!(
                "{} is not valid JSON (line {} column {}); Claw3D could not read it either: fix or remove it",
                settings_file.display(),
                e.line(),
                e.column()
            ))
        })?,
    };
    if !doc.is_object() || doc.get("gateway").is_some_and(|g| !g.is_object()) {
        return Err(refused(format!(
            "{} is not a Claw3D settings file (no \"gateway\" object): name the right one with --settings-file",
            settings_file.display()
        )));
    }
    let own = resolved.settings.own_socket_paths();
    let old_url = doc
        .pointer("/gateway/url")
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned);
    if let Some(mine) = old_url
        .as_deref()
        .and_then(|u| settings::own_socket_named(u, &own))
    {
        let undo = if record.exists() {
            "; `clawmux setup claw3d --undo` goes back"
        } else {
            ""
        };
        return Err(SetupError::AlreadyDone(format!(
            "{} already points at this broker ({}): nothing to do{undo}",
            settings_file.display(),
            mine.display()
        )));
    }
    if record.exists() {
        return Err(refused(format!(
            "{} records an earlier setup, but {} no longer points at this broker (changed since, \
             e.g. in the studio's settings page): `clawmux setup claw3d --undo` first (it puts back \
             the settings from before that setup), then run setup again",
            record.display(),
            settings_file.display()
        )));
    }
    let new_url = claw3d_url(&resolved.settings.socket_path)?;
    let from_this_file = |s: &Option<Source>| matches!(s, Some(Source::File(p)) | Some(Source::FileKey(p, _)) if *p == settings_file);
    let record_url = from_this_file(&Some(resolved.url_source.clone()))
        .then(|| resolved.settings.gateway_url.clone());
    let record_token = from_this_file(&resolved.token_source)
        .then(|| resolved.settings.token.clone())
        .flatten();

    let gateway = doc
        .as_object_mut()
        .expect("checked above")
        .entry("gateway")
        .or_insert_with(|| json!({}));
    let own_token = gateway
        .get("token")
        .and_then(Value::as_str)
        .is_some_and(|t| !t.trim().is_empty());
    // Claw3D's proxy refuses to connect without a token; the broker has its
    // own credential and does not forward a client's.
    let placeholder_token = !own_token && resolved.settings.token.is_some();
    if let Some(profile) = gateway.pointer_mut("/profiles/openclaw") {
        if profile.get("url").and_then(Value::as_str).map(str::trim) == old_url.as_deref() {
            profile["url"] = json!(new_url);
        }
    }
    gateway["url"] = json!(new_url);
    if placeholder_token {
        gateway["token"] = json!(PLACEHOLDER_TOKEN);
    }
    let mut new_settings = serde_json::to_vec_pretty(&doc).expect("a JSON value");
    new_settings.push(b'\n');

    let config_before = read_file(&config_file)?
        .map(|b| {
            String::from_utf8(b)
                .map_err(|_| refused(format!("{} is not UTF-8", config_file.display())))
        })
        .transpose()?;
    let config_after = if record_url.is_some() || record_token.is_some() {
        let mut toml: toml_edit::DocumentMut = config_before
            .as_deref()
            .unwrap_or_default()
            .parse()
            .map_err(|_| {
                refused(format!(
                    "{} is not valid TOML: `clawmux doctor` says where",
                    config_file.display()
                ))
            })?;
        let table = toml
            .entry("gateway")
            .or_insert_with(|| toml_edit::Item::Table(toml_edit::Table::new()))
            .as_table_like_mut()
            .ok_or_else(|| {
                refused(format!(
                    "{}: `gateway` is not a table",
                    config_file.display()
                ))
            })?;
        if let Some(url) = &record_url {
            table.insert("url", toml_edit::value(url.as_str()));
        }
        if record_token.is_some() {
            let token_file = token_path(&config_file);
            table.insert(
                "token_file",
                toml_edit::value(token_file.display().to_string()),
            );
        }
        Some(toml.to_string())
    } else {
        None
    };
    Ok(Plan {
        settings_file,
        original,
        new_settings,
        new_url,
        old_url,
        config_file,
        config_before,
        config_after,
        record_url,
        record_token,
        placeholder_token,
    })
}

impl Plan {
    /// The change in words, secrets as fingerprints only.
    pub fn describe(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let f = |p: &Path| crate::sanitize::field(&p.display().to_string(), 500).into_owned();
        let u = |s: &str| crate::sanitize::field(&crate::config::redact_url(s), 500).into_owned();
        writeln!(out, "Claw3D's settings {}:", f(&self.settings_file))?;
        match &self.old_url {
            Some(old) => writeln!(out, "  gateway.url  {}  ->  {}", u(old), self.new_url)?,
            None => writeln!(out, "  gateway.url  (none)  ->  {}", self.new_url)?,
        }
        if self.placeholder_token {
            writeln!(
                out,
                "  gateway.token  (none)  ->  a placeholder: Claw3D's proxy needs one, clawmux holds the gateway's"
            )?;
        }
        match &self.original {
            Some(_) => writeln!(
                out,
                "  backup       {}{BACKUP_SUFFIX} (mode 0600)",
                f(&self.settings_file)
            )?,
            None => writeln!(out, "  (the file is created; --undo removes it)")?,
        }
        if self.config_after.is_some() {
            writeln!(
                out,
                "clawmux's config {} (so the broker still finds the gateway):",
                f(&self.config_file)
            )?;
            if let Some(url) = &self.record_url {
                writeln!(out, "  [gateway] url = {}", u(url))?;
            }
            if let Some(token) = &self.record_token {
                writeln!(
                    out,
                    "  [gateway] token_file = {}  (the token from Claw3D's settings, {}, mode 0600)",
                    f(&token_path(&self.config_file)),
                    fingerprint(token)
                )?;
            }
        }
        Ok(())
    }

    /// Makes the change. Each file is written whole, 0600.
    pub fn apply(&self) -> Result<(), SetupError> {
        if let Some(original) = &self.original {
            let backup = backup_path(&self.settings_file);
            if write_private(&backup, original, Existing::Keep)? == Written::AlreadyThere
                && read_file(&backup)?.as_deref() != Some(original.as_slice())
            {
                return Err(refused(format!(
                    "{} exists from an earlier setup and differs from the settings now: move it away, then run setup again",
                    backup.display()
                )));
            }
        }
        let mut token_file_created = false;
        if let Some(token) = &self.record_token {
            let path = token_path(&self.config_file);
            ensure_parent(&path)?;
            let mut bytes = token.expose().as_bytes().to_vec();
            bytes.push(b'\n');
            match write_private(&path, &bytes, Existing::Keep)? {
                Written::Written => token_file_created = true,
                Written::AlreadyThere => {
                    let there = read_file(&path)?.unwrap_or_default();
                    if String::from_utf8_lossy(&there).trim() != token.expose() {
                        return Err(refused(format!(
                            "{} already holds another token: remove it or set [gateway] token in {} yourself",
                            path.display(),
                            self.config_file.display()
                        )));
                    }
                }
            }
        }
        if let Some(after) = &self.config_after {
            ensure_parent(&self.config_file)?;
            write_private(&self.config_file, after.as_bytes(), Existing::Replace)?;
        }
        let record = json!({
            "settings_file": self.settings_file.display().to_string(),
            "settings_created": self.original.is_none(),
            "written_url": self.new_url,
            "config_file": self.config_file.display().to_string(),
            "config_created": self.config_before.is_none() && self.config_after.is_some(),
            "added_url": self.record_url,
            "added_token_file": self.record_token.as_ref().map(|_| token_path(&self.config_file).display().to_string()),
            "token_file_created": token_file_created,
        });
        let record_path = record_path(&self.config_file);
        ensure_parent(&record_path)?;
        let mut bytes = serde_json::to_vec_pretty(&record).expect("a JSON value");
        bytes.push(b'\n');
        write_private(&record_path, &bytes, Existing::Replace)?;
        ensure_parent(&self.settings_file)?;
        write_private(&self.settings_file, &self.new_settings, Existing::Replace)?;
        Ok(())
    }
}

/// Prints the change, then (unless `dry_run`, or `confirm` says no) makes it
/// and says what to do next.
pub fn setup(
    resolved: &Resolved,
    env: &Env,
    opts: &Options,
    confirm: &mut dyn FnMut() -> bool,
    out: &mut dyn Write,
) -> Result<bool, SetupError> {
    let plan = plan(resolved, env, opts)?;
    let io = |e: std::io::Error| refused(format!("cannot print: {e}"));
    plan.describe(out).map_err(io)?;
    if opts.dry_run {
        writeln!(out, "(dry run: nothing written)").map_err(io)?;
        return Ok(false);
    }
    if !confirm() {
        writeln!(out, "nothing written").map_err(io)?;
        return Ok(false);
    }
    plan.apply()?;
    writeln!(
        out,
        "done. Next:\n  \
         - reload clawmux so it reads its settings again: systemctl --user reload clawmux (or kill -HUP the broker)\n  \
         - Claw3D reads the file at each connection: reconnect in the studio. In production (npm start, its Docker image) \
         start it with UPSTREAM_ALLOWLIST=localhost\n  \
         - to go back: clawmux setup claw3d --undo"
    )
    .map_err(io)?;
    Ok(true)
}

/// Puts back what setup changed, as its record says.
pub fn undo(resolved: &Resolved, env: &Env, out: &mut dyn Write) -> Result<(), SetupError> {
    let config_file = resolved
        .config_file
        .clone()
        .or_else(|| settings::config_file_path(&settings::Overrides::default(), env))
        .ok_or_else(|| {
            refused("cannot tell where clawmux's config.toml is: set HOME or --config")
        })?;
    let record_path = record_path(&config_file);
    let record: Value = match read_file(&record_path)? {
        None => {
            return Err(refused(format!(
                "nothing to undo: no setup is recorded ({} does not exist)",
                record_path.display()
            )))
        }
        Some(bytes) => serde_json::from_slice(&bytes).map_err(|_| {
            refused(format!(
                "{} is not valid JSON: restore by hand",
                record_path.display()
            ))
        })?,
    };
    let path_at = |key: &str| record[key].as_str().map(PathBuf::from);
    let io = |e: std::io::Error| refused(format!("cannot print: {e}"));
    let settings_file = path_at("settings_file")
        .ok_or_else(|| refused(format!("{} names no settings file", record_path.display())))?;
    if record["settings_created"] == true {
        remove(&settings_file)?;
        writeln!(
            out,
            "removed {} (setup created it)",
            settings_file.display()
        )
        .map_err(io)?;
    } else {
        let backup = backup_path(&settings_file);
        let bytes = read_file(&backup)?.ok_or_else(|| {
            refused(format!(
                "the backup {} is gone: set Claw3D's gateway URL by hand, then remove {}",
                backup.display(),
                record_path.display()
            ))
        })?;
        write_private(&settings_file, &bytes, Existing::Replace)?;
        remove(&backup)?;
        writeln!(out, "restored {} from its backup", settings_file.display()).map_err(io)?;
    }
    let config = path_at("config_file").unwrap_or(config_file);
    let added_url = record["added_url"].as_str();
    let added_token = record["added_token_file"].as_str();
    if added_url.is_some() || added_token.is_some() {
        if let Some(text) = read_file(&config)? {
            let text = String::from_utf8_lossy(&text).into_owned();
            if let Ok(mut toml) = text.parse::<toml_edit::DocumentMut>() {
                if let Some(table) = toml.get_mut("gateway").and_then(|g| g.as_table_like_mut()) {
                    for (key, added) in [("url", added_url), ("token_file", added_token)] {
                        let same = table.get(key).and_then(|v| v.as_str()) == added;
                        if added.is_some() && same {
                            table.remove(key);
                        }
                    }
                    if table.is_empty() {
                        toml.remove("gateway");
                    }
                }
                let after = toml.to_string();
                if record["config_created"] == true && after.trim().is_empty() {
                    remove(&config)?;
                } else {
                    write_private(&config, after.as_bytes(), Existing::Replace)?;
                }
                writeln!(
                    out,
                    "removed the gateway setup added to {}",
                    config.display()
                )
                .map_err(io)?;
            }
        }
    }
    if record["token_file_created"] == true {
        if let Some(token) = added_token {
            remove(Path::new(token))?;
        }
    }
    remove(&record_path)?;
    writeln!(
        out,
        "done: reload clawmux (systemctl --user reload clawmux, or kill -HUP the broker) and reconnect in Claw3D"
    )
    .map_err(io)?;
    Ok(())
}

fn backup_path(settings_file: &Path) -> PathBuf {
    let mut name = settings_file.as_os_str().to_owned();
    name.push(BACKUP_SUFFIX);
    PathBuf::from(name)
}

fn beside_config(config_file: &Path, name: &str) -> PathBuf {
    config_file
        .parent()
        .map_or_else(|| PathBuf::from(name), |d| d.join(name))
}

fn record_path(config_file: &Path) -> PathBuf {
    beside_config(config_file, RECORD_FILE)
}

fn token_path(config_file: &Path) -> PathBuf {
    beside_config(config_file, TOKEN_FILE)
}

fn read_file(path: &Path) -> Result<Option<Vec<u8>>, SetupError> {
    match crate::files::read(path, crate::files::CONFIG_MAX_BYTES) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(refused(format!("cannot read: {e}"))),
    }
}

fn ensure_parent(path: &Path) -> Result<(), SetupError> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.exists() => {
            crate::private_files::ensure_private_dir(dir).map_err(SetupError::from)
        }
        _ => Ok(()),
    }
}

fn remove(path: &Path) -> Result<(), SetupError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(refused(format!("cannot remove {}: {e}", path.display()))),
    }
}
