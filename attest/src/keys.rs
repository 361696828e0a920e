//! Publisher keys: ed25519, stored as one line of hex with a type prefix.
//!
//! `NAME.pub` holds `ed25519:<64 hex>`; `NAME.key` holds `ed25519-secret:<64 hex>` (the seed)
//! and is created with mode 0600.

use ed25519_dalek::{SigningKey, VerifyingKey};
use std::{fmt, fs, io::Write, path::Path};

/// Why a key could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The text is not a key of the expected form.
    #[error("{0}")]
    Malformed(String),
    /// The OS random source failed.
    #[error("no randomness for key generation: {0}")]
    Random(String),
}

/// A publisher's public key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey(pub [u8; 32]);

impl PublicKey {
    /// Parses `ed25519:<hex>` or bare hex.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let hex_part = text.trim().strip_prefix("ed25519:").unwrap_or(text.trim());
        let bytes = decode32(hex_part).ok_or_else(|| {
            KeyError::Malformed(format!(
                "not an ed25519 public key (expected `ed25519:` and 64 hex digits): `{}`",
                text.trim()
            ))
        })?;
        VerifyingKey::from_bytes(&bytes)
            .map_err(|_| KeyError::Malformed("not a valid ed25519 curve point".into()))?;
        Ok(PublicKey(bytes))
    }

    /// Reads a `.pub` file.
    pub fn read(path: &Path) -> Result<Self, KeyError> {
        let text = fs::read_to_string(path).map_err(|source| KeyError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
    }

    /// A short id for messages: the first 8 bytes in hex.
    pub fn short_id(&self) -> String {
        hex::encode(&self.0[..8])
    }

    /// The dalek verifying key.
    pub fn verifying_key(&self) -> Result<VerifyingKey, KeyError> {
        VerifyingKey::from_bytes(&self.0)
            .map_err(|_| KeyError::Malformed("not a valid ed25519 curve point".into()))
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ed25519:{}", hex::encode(self.0))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({})", self.short_id())
    }
}

/// A publisher's signing key.
pub struct SecretKey(SigningKey);

impl SecretKey {
    /// Generates a fresh key from the OS random source.
    pub fn generate() -> Result<Self, KeyError> {
        let mut seed = [0u8; 32];
        getrandom::getrandom(&mut seed).map_err(|e| KeyError::Random(e.to_string()))?;
        Ok(SecretKey(SigningKey::from_bytes(&seed)))
    }

    /// Parses `ed25519-secret:<hex>`.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let hex_part = text.trim().strip_prefix("ed25519-secret:").ok_or_else(|| {
            KeyError::Malformed("secret key must start with `ed25519-secret:`".into())
        })?;
        let seed = decode32(hex_part)
            .ok_or_else(|| KeyError::Malformed("secret key must be 64 hex digits".into()))?;
        Ok(SecretKey(SigningKey::from_bytes(&seed)))
    }

    /// Reads a `.key` file.
    pub fn read(path: &Path) -> Result<Self, KeyError> {
        let text = fs::read_to_string(path).map_err(|source| KeyError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
    }

    /// The matching public key.
    pub fn public(&self) -> PublicKey {
        PublicKey(self.0.verifying_key().to_bytes())
    }

    /// The dalek signing key.
    pub(crate) fn signing_key(&self) -> &SigningKey {
        &self.0
    }

    /// Writes `<stem>.key` (mode 0600, refusing to overwrite) and `<stem>.pub`.
    pub fn write_pair(&self, stem: &Path) -> Result<(), KeyError> {
        use std::os::unix::fs::OpenOptionsExt;
        let key_path = stem.with_extension("key");
        let pub_path = stem.with_extension("pub");
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| KeyError::Io { path, source }
        };
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&key_path)
            .map_err(io(&key_path))?;
        writeln!(f, "ed25519-secret:{}", hex::encode(self.0.to_bytes())).map_err(io(&key_path))?;
        fs::write(&pub_path, format!("{}\n", self.public())).map_err(io(&pub_path))?;
        Ok(())
    }
}

fn decode32(text: &str) -> Option<[u8; 32]> {
    let bytes = hex::decode(text).ok()?;
    bytes.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_files() {
        let dir = tempfile::tempdir().unwrap();
        let key = SecretKey::generate().unwrap();
        key.write_pair(&dir.path().join("dev")).unwrap();
        let back = SecretKey::read(&dir.path().join("dev.key")).unwrap();
        assert_eq!(back.public(), key.public());
        assert_eq!(
            PublicKey::read(&dir.path().join("dev.pub")).unwrap(),
            key.public()
        );
        // Never overwrites an existing secret key.
        assert!(key.write_pair(&dir.path().join("dev")).is_err());
    }

    #[test]
    fn malformed_keys_are_refused() {
        assert!(PublicKey::parse("ed25519:abcd").is_err());
        assert!(PublicKey::parse("rsa:00").is_err());
        assert!(SecretKey::parse(&"0".repeat(64)).is_err());
    }
}
