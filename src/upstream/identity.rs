//! The broker's device identity (gateway-protocol.md §2.4): an Ed25519 key
//! made once and kept in the state dir, the v3 signature over each
//! challenge nonce, and the device tokens the gateway mints for it.
//!
//! Why a device identity at all, when `gateway-client`/`backend` keeps its
//! scopes on loopback with the token alone: a gateway on another host, or
//! an older one (v3.24), clears the scopes of a device-less connect (§2.5).
//! A signed device is paired silently on loopback and keeps its scopes on
//! every version.
//!
//! Files in the state dir (directory 0700, files 0600, see `private_files`):
//! - `device.json`: `{version, deviceId, publicKey, privateKey, createdAtMs}`;
//!   keys as base64url without padding (the private key is the 32-byte seed).
//!   Created once and never rewritten: a new key is a new, unpaired device.
//! - `device-tokens.json`: `{version, deviceId, gateways: {<url>: {role,
//!   token, scopes, issuedAtMs}}}`: the last device token each gateway minted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ed25519_dalek::{Signer as _, SigningKey};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use crate::config::Secret;
use crate::private_files::{self, Existing, PrivateFileError, Written};
use crate::protocol::now_ms;

/// The key file's name inside the state dir.
pub const KEY_FILE: &str = "device.json";
/// The device-token file's name inside the state dir.
pub const TOKENS_FILE: &str = "device-tokens.json";

/// Why the device identity cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(transparent)]
    File(#[from] PrivateFileError),
    /// The key file exists but is not a key this broker wrote. It is left
    /// alone (replacing it would silently become a new, unpaired device).
    #[error("the device key {path} is unreadable ({reason}); move it away to make a new device identity (the gateway will see a new device)")]
    CorruptKey { path: PathBuf, reason: String },
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct KeyFile {
    version: u32,
    device_id: String,
    public_key: String,
    private_key: String,
    created_at_ms: u64,
}

#[derive(Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct TokensFile {
    version: u32,
    device_id: String,
    gateways: BTreeMap<String, StoredToken>,
}

#[derive(Serialize, Deserialize, Clone)]
#[serde(rename_all = "camelCase")]
struct StoredToken {
    role: String,
    token: String,
    #[serde(default)]
    scopes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    issued_at_ms: Option<u64>,
}

/// What a connect signature covers, besides the device id (§2.4, v3).
#[derive(Debug, Clone)]
pub struct ConnectProof<'a> {
    pub client_id: &'a str,
    pub client_mode: &'a str,
    pub role: &'a str,
    /// Exactly as sent in `scopes`, in order.
    pub scopes: &'a [&'a str],
    pub signed_at_ms: u64,
    /// `auth.token ?? auth.deviceToken ?? auth.bootstrapToken ?? ""` of the
    /// same connect.
    pub token: &'a str,
    /// The challenge nonce.
    pub nonce: &'a str,
    pub platform: &'a str,
    pub device_family: &'a str,
}

/// The v3 string a device signs:
/// `v3|deviceId|clientId|clientMode|role|scopesCSV|signedAtMs|token|nonce|platform|deviceFamily`,
/// platform and device family trimmed and ASCII-lowercased.
pub fn v3_payload(device_id: &str, p: &ConnectProof<'_>) -> String {
    [
        "v3",
        device_id,
        p.client_id,
        p.client_mode,
        p.role,
        &p.scopes.join(","),
        &p.signed_at_ms.to_string(),
        p.token,
        p.nonce,
        &p.platform.trim().to_ascii_lowercase(),
        &p.device_family.trim().to_ascii_lowercase(),
    ]
    .join("|")
}

/// Lowercase hex SHA-256 of the raw 32-byte public key.
fn device_id_of(public_key: &[u8; 32]) -> String {
    Sha256::digest(public_key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The broker's device: its key and the state dir it lives in.
pub struct DeviceIdentity {
    key: SigningKey,
    device_id: String,
    public_key: String,
    dir: PathBuf,
}

impl std::fmt::Debug for DeviceIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceIdentity")
            .field("device_id", &self.device_id)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl DeviceIdentity {
    /// Loads the key from `dir`, or makes one (the directory is created
    /// 0700 if needed). Two brokers starting at once end up with the same key.
    pub fn load_or_create(dir: &Path) -> Result<DeviceIdentity, IdentityError> {
        private_files::ensure_private_dir(dir)?;
        let path = dir.join(KEY_FILE);
        if let Some(bytes) = private_files::read_private(&path)? {
            return Self::from_key_file(dir, &path, &bytes);
        }
        // 32 bytes from the OS, as `SigningKey::generate(&mut OsRng)` takes:
        // through rand 0.9 (which tungstenite needs anyway), so the tree has
        // one random-number stack, not rand_core 0.6 beside it.
        let mut seed = [0u8; 32];
        rand::TryRngCore::try_fill_bytes(&mut rand::rngs::OsRng, &mut seed)
            .expect("the operating system's random number generator");
        let key = SigningKey::from_bytes(&seed);
        let public = key.verifying_key().to_bytes();
        let file = KeyFile {
            version: 1,
            device_id: device_id_of(&public),
            public_key: URL_SAFE_NO_PAD.encode(public),
            private_key: URL_SAFE_NO_PAD.encode(key.to_bytes()),
            created_at_ms: now_ms(),
        };
        let text = serde_json::to_vec_pretty(&file).unwrap_or_default();
        match private_files::write_private(&path, &text, Existing::Keep)? {
            Written::Written => {
                tracing::info!(device_id = %file.device_id, file = %path.display(), "created the broker's device identity");
                Ok(Self::from_key(dir, key))
            }
            Written::AlreadyThere => {
                let bytes = private_files::read_private(&path)?.unwrap_or_default();
                Self::from_key_file(dir, &path, &bytes)
            }
        }
    }

    /// The identity for `dir` when device identity is on (`Some`). A state
    /// dir that cannot be used does not stop the broker (a token-only
    /// connect still works on loopback), but it is logged as an error.
    pub fn load_configured(dir: Option<&Path>) -> Option<DeviceIdentity> {
        let Some(dir) = dir else {
            tracing::info!("device identity is off: the gateway sees a token-only backend client");
            return None;
        };
        match DeviceIdentity::load_or_create(dir) {
            Ok(identity) => {
                tracing::info!(device_id = identity.device_id(), state_dir = %dir.display(), "device identity loaded");
                Some(identity)
            }
            Err(e) => {
                tracing::error!("device identity unavailable, connecting without it: {e}");
                None
            }
        }
    }

    fn from_key(dir: &Path, key: SigningKey) -> DeviceIdentity {
        let public = key.verifying_key().to_bytes();
        DeviceIdentity {
            device_id: device_id_of(&public),
            public_key: URL_SAFE_NO_PAD.encode(public),
            key,
            dir: dir.to_owned(),
        }
    }

    fn from_key_file(
        dir: &Path,
        path: &Path,
        bytes: &[u8],
    ) -> Result<DeviceIdentity, IdentityError> {
        let corrupt = |reason: String| IdentityError::CorruptKey {
            path: path.to_owned(),
            reason,
        };
        let file: KeyFile =
            serde_json::from_slice(bytes).map_err(|e| corrupt(format!("not a key file: {e}")))?;
        let seed: [u8; 32] = URL_SAFE_NO_PAD
            .decode(file.private_key.trim())
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| corrupt("privateKey is not 32 base64url bytes".into()))?;
        let identity = Self::from_key(dir, SigningKey::from_bytes(&seed));
        if identity.device_id != file.device_id || identity.public_key != file.public_key {
            return Err(corrupt(
                "deviceId/publicKey do not match the private key".into(),
            ));
        }
        Ok(identity)
    }

    /// `device.id`: hex SHA-256 of the raw public key.
    pub fn device_id(&self) -> &str {
        &self.device_id
    }

    /// `device.publicKey`: base64url of the raw public key.
    pub fn public_key(&self) -> &str {
        &self.public_key
    }

    /// The `device` block of a connect: `{id, publicKey, signature, signedAt, nonce}`.
    pub fn sign_connect(&self, proof: &ConnectProof<'_>) -> Value {
        let payload = v3_payload(&self.device_id, proof);
        let signature = self.key.sign(payload.as_bytes());
        json!({
            "id": self.device_id,
            "publicKey": self.public_key,
            "signature": URL_SAFE_NO_PAD.encode(signature.to_bytes()),
            "signedAt": proof.signed_at_ms,
            "nonce": proof.nonce,
        })
    }

    fn tokens_path(&self) -> PathBuf {
        self.dir.join(TOKENS_FILE)
    }

    /// Stored tokens of this device (tokens of an older key are ignored).
    fn read_tokens(&self) -> TokensFile {
        let path = self.tokens_path();
        let parsed = match private_files::read_private(&path) {
            Ok(Some(bytes)) => serde_json::from_slice::<TokensFile>(&bytes)
                .map_err(|e| tracing::warn!(file = %path.display(), "ignoring an unreadable device-token file: {e}"))
                .ok(),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!("ignoring the device-token file: {e}");
                None
            }
        };
        parsed
            .filter(|t| t.device_id == self.device_id)
            .unwrap_or_else(|| TokensFile {
                version: 1,
                device_id: self.device_id.clone(),
                gateways: BTreeMap::new(),
            })
    }

    /// The device token `gateway_url` minted for this device, if any.
    pub fn stored_token(&self, gateway_url: &str) -> Option<Secret> {
        self.read_tokens()
            .gateways
            .get(gateway_url)
            .filter(|t| !t.token.is_empty())
            .map(|t| Secret::new(t.token.clone()))
    }

    /// Keeps the device token a gateway minted in its `hello-ok`. Returns
    /// whether the file changed (an unchanged token is not rewritten).
    pub fn store_token(
        &self,
        gateway_url: &str,
        role: &str,
        token: &Secret,
        scopes: &[String],
        issued_at_ms: Option<u64>,
    ) -> Result<bool, IdentityError> {
        let mut file = self.read_tokens();
        if file
            .gateways
            .get(gateway_url)
            .is_some_and(|t| t.token == token.expose() && t.scopes == scopes)
        {
            return Ok(false);
        }
        file.gateways.insert(
            gateway_url.to_owned(),
            StoredToken {
                role: role.to_owned(),
                token: token.expose().to_owned(),
                scopes: scopes.to_vec(),
                issued_at_ms,
            },
        );
        let text = serde_json::to_vec_pretty(&file).unwrap_or_default();
        private_files::write_private(&self.tokens_path(), &text, Existing::Replace)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signature, Verifier as _, VerifyingKey};
    use std::os::unix::fs::MetadataExt as _;

    const SCOPES: [&str; 5] = [
        "operator.admin",
        "operator.read",
        "operator.write",
        "operator.approvals",
        "operator.pairing",
    ];

    fn proof<'a>(token: &'a str, nonce: &'a str) -> ConnectProof<'a> {
        ConnectProof {
            client_id: "gateway-client",
            client_mode: "backend",
            role: "operator",
            scopes: &SCOPES,
            signed_at_ms: 1767225600123,
            token,
            nonce,
            platform: " Linux ",
            device_family: "",
        }
    }

    #[test]
    fn v3_payload_matches_the_protocol_example() {
        // gateway-protocol.md §9, with the elided parts filled in.
        let p = proof("3f9a-c1", "4f0c2a7e-9d1b-4c55-8a8e-2f7d1c0b9a31");
        assert_eq!(
            v3_payload("9c1e", &p),
            "v3|9c1e|gateway-client|backend|operator|operator.admin,operator.read,operator.write,operator.approvals,operator.pairing|1767225600123|3f9a-c1|4f0c2a7e-9d1b-4c55-8a8e-2f7d1c0b9a31|linux|"
        );
    }

    #[test]
    fn key_is_made_once_kept_private_and_signs_verifiably() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state/clawmux");
        let a = DeviceIdentity::load_or_create(&dir).unwrap();
        let b = DeviceIdentity::load_or_create(&dir).unwrap();
        assert_eq!(a.device_id(), b.device_id(), "the key is reused");
        assert_eq!(a.device_id().len(), 64);
        let meta = std::fs::metadata(dir.join(KEY_FILE)).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);

        let p = proof("tok", "nonce-1");
        let block = a.sign_connect(&p);
        assert_eq!(block["id"], a.device_id());
        assert_eq!(block["nonce"], "nonce-1");
        assert_eq!(block["signedAt"], 1767225600123u64);
        let raw: [u8; 32] = URL_SAFE_NO_PAD
            .decode(block["publicKey"].as_str().unwrap())
            .unwrap()
            .try_into()
            .unwrap();
        assert_eq!(device_id_of(&raw), a.device_id());
        let sig = URL_SAFE_NO_PAD
            .decode(block["signature"].as_str().unwrap())
            .unwrap();
        let sig = Signature::from_slice(&sig).unwrap();
        let key = VerifyingKey::from_bytes(&raw).unwrap();
        key.verify(v3_payload(a.device_id(), &p).as_bytes(), &sig)
            .expect("v3 signature verifies");
    }

    #[test]
    fn a_corrupt_key_is_refused_and_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(KEY_FILE);
        std::fs::write(&path, b"{\"version\":1}").unwrap();
        let err = DeviceIdentity::load_or_create(tmp.path()).unwrap_err();
        assert!(matches!(err, IdentityError::CorruptKey { .. }), "{err}");
        assert!(err.to_string().contains("move it away"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"version\":1}");
    }

    #[test]
    fn device_tokens_are_kept_per_gateway_and_private() {
        let tmp = tempfile::tempdir().unwrap();
        let id = DeviceIdentity::load_or_create(tmp.path()).unwrap();
        assert!(id.stored_token("ws://a").is_none());
        let scopes = vec!["operator.read".to_string()];
        assert!(id
            .store_token("ws://a", "operator", &Secret::new("dt_1"), &scopes, Some(5))
            .unwrap());
        assert!(!id
            .store_token("ws://a", "operator", &Secret::new("dt_1"), &scopes, Some(5))
            .unwrap());
        id.store_token("ws://b", "operator", &Secret::new("dt_2"), &scopes, None)
            .unwrap();
        assert_eq!(id.stored_token("ws://a").unwrap().expose(), "dt_1");
        assert_eq!(id.stored_token("ws://b").unwrap().expose(), "dt_2");
        let meta = std::fs::metadata(tmp.path().join(TOKENS_FILE)).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        // Tokens minted for another key are not offered by this one.
        std::fs::remove_file(tmp.path().join(KEY_FILE)).unwrap();
        let other = DeviceIdentity::load_or_create(tmp.path()).unwrap();
        assert!(other.stored_token("ws://a").is_none());
    }
}
