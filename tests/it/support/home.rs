//! A private home directory for settings tests: files written 0600 under
//! it, and the environment that names it.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use clawmux::settings::Env;

pub struct Home {
    pub dir: tempfile::TempDir,
}

impl Home {
    pub fn new() -> Home {
        Home {
            dir: tempfile::tempdir().unwrap(),
        }
    }
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
    pub fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    }
    pub fn env(&self, extra: &[(&str, &str)]) -> Env {
        let mut vars: HashMap<String, String> = HashMap::new();
        vars.insert("HOME".into(), self.path().display().to_string());
        for (k, v) in extra {
            vars.insert(k.to_string(), v.to_string());
        }
        Env { vars }
    }
}
