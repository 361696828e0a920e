//! Signing a component in place, and verifying it.
//!
//! The signature is ed25519 (`verify_strict`) over a domain tag followed by the SHA-256 of the
//! whole file with only the 64-byte signature slot zeroed. The publisher key and code hash lie
//! inside the signed bytes, so nothing — code, manifest, key id — can change unnoticed.
//! The code hash is the SHA-256 of the file with both the code-hash field and the signature slot
//! zeroed: a stable identity of "this build, this manifest, this publisher".

use crate::{
    elf::{self, ElfError},
    keys::{PublicKey, SecretKey},
};
use ed25519_dalek::{Signature, Signer};
use sha2::{Digest, Sha256};
use u_sdk::{
    abi_id,
    manifest::{ManifestError, PluginManifest},
    meta::{CODE_HASH_RANGE, MetaError, MetaRecord, PUBLISHER_RANGE, SIGNATURE_RANGE},
};

/// Domain separation for signatures.
pub const SIGNATURE_DOMAIN: &[u8] = b"u-component-signature/v1\0";

/// Why signing failed.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    /// The file is not a well-formed component.
    #[error(transparent)]
    Elf(#[from] ElfError),
    /// The section is malformed.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// The embedded manifest is invalid (refusing to sign it).
    #[error(transparent)]
    Manifest(#[from] ManifestError),
}

/// Why a component was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// The file is not a well-formed component.
    #[error(transparent)]
    Elf(#[from] ElfError),
    /// The section is malformed.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// No signature.
    #[error("not signed (no publisher key or signature in .u.meta)")]
    Unsigned,
    /// Signed by a key that is not trusted.
    #[error("signed by untrusted key {key}")]
    UntrustedKey {
        /// The key found.
        key: String,
    },
    /// The signature does not match the file.
    #[error("signature does not match the file: it was modified after signing (tampered)")]
    BadSignature,
    /// The code hash does not match.
    #[error("code hash does not match the file: it was modified after signing (tampered)")]
    CodeHashMismatch,
    /// The signed manifest is invalid.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// Built against another SDK ABI.
    #[error("built against SDK ABI {found}, but this host speaks ABI {expected}")]
    AbiMismatch {
        /// The plugin's ABI identity.
        found: String,
        /// The host's ABI identity.
        expected: String,
    },
}

/// What a successful verification establishes.
#[derive(Debug, Clone)]
pub struct Verified {
    /// The signed manifest.
    pub manifest: PluginManifest,
    /// The raw record (ABI identity, key, hash, signature).
    pub record: MetaRecord,
    /// Who signed it.
    pub publisher: PublicKey,
    /// The code hash.
    pub code_hash: [u8; 32],
}

impl Verified {
    /// The ABI identity the component was built with, e.g. `1:3fa94c0e12d7`.
    pub fn abi(&self) -> String {
        abi_id(self.record.abi_major, &self.record.abi_hash)
    }
}

/// Signs the component in `bytes` in place with `key`; returns its code hash.
pub fn sign_bytes(bytes: &mut [u8], key: &SecretKey) -> Result<[u8; 32], SignError> {
    let facts = elf::analyse(bytes)?;
    let record = MetaRecord::parse(&bytes[facts.meta.clone()])?;
    PluginManifest::parse(&record.manifest)?;
    let base = facts.meta.start;
    bytes[base + PUBLISHER_RANGE.start..base + PUBLISHER_RANGE.end]
        .copy_from_slice(&key.public().0);
    bytes[base + CODE_HASH_RANGE.start..base + CODE_HASH_RANGE.end].fill(0);
    bytes[base + SIGNATURE_RANGE.start..base + SIGNATURE_RANGE.end].fill(0);
    let code_hash: [u8; 32] = Sha256::digest(&*bytes).into();
    bytes[base + CODE_HASH_RANGE.start..base + CODE_HASH_RANGE.end].copy_from_slice(&code_hash);
    let signature = key.signing_key().sign(&signed_message(bytes, base));
    bytes[base + SIGNATURE_RANGE.start..base + SIGNATURE_RANGE.end]
        .copy_from_slice(&signature.to_bytes());
    Ok(code_hash)
}

/// Verifies the component in `bytes` against `trusted` keys.
pub fn verify_bytes(bytes: &[u8], trusted: &[PublicKey]) -> Result<Verified, VerifyError> {
    let facts = elf::analyse(bytes)?;
    let base = facts.meta.start;
    let record = MetaRecord::parse(&bytes[facts.meta.clone()])?;
    let (Some(publisher), Some(code_hash), Some(signature)) =
        (record.publisher, record.code_hash, record.signature)
    else {
        return Err(VerifyError::Unsigned);
    };
    let publisher = PublicKey(publisher);
    if !trusted.contains(&publisher) {
        return Err(VerifyError::UntrustedKey {
            key: publisher.to_string(),
        });
    }
    let verifying = publisher
        .verifying_key()
        .map_err(|_| VerifyError::BadSignature)?;
    let mut copy = bytes.to_vec();
    copy[base + SIGNATURE_RANGE.start..base + SIGNATURE_RANGE.end].fill(0);
    let message = signed_message(&copy, base);
    verifying
        .verify_strict(&message, &Signature::from_bytes(&signature))
        .map_err(|_| VerifyError::BadSignature)?;
    copy[base + CODE_HASH_RANGE.start..base + CODE_HASH_RANGE.end].fill(0);
    let actual: [u8; 32] = Sha256::digest(&copy).into();
    if actual != code_hash {
        return Err(VerifyError::CodeHashMismatch);
    }
    let manifest = PluginManifest::parse(&record.manifest)?;
    Ok(Verified {
        manifest,
        record,
        publisher,
        code_hash,
    })
}

/// Checks that a verified component was built against the ABI `expected` (major, hash).
pub fn check_abi(verified: &Verified, major: u32, hash: &[u8; 32]) -> Result<(), VerifyError> {
    if verified.record.abi_major != major || &verified.record.abi_hash != hash {
        return Err(VerifyError::AbiMismatch {
            found: verified.abi(),
            expected: abi_id(major, hash),
        });
    }
    Ok(())
}

/// The domain tag followed by the SHA-256 of `bytes` (whose signature slot is zero).
fn signed_message(bytes: &[u8], base: usize) -> Vec<u8> {
    debug_assert!(
        bytes[base + SIGNATURE_RANGE.start..base + SIGNATURE_RANGE.end]
            .iter()
            .all(|&b| b == 0)
    );
    let mut message = SIGNATURE_DOMAIN.to_vec();
    message.extend_from_slice(&Sha256::digest(bytes));
    message
}
