//! Checkpoints belong to the client that saved them (`GenerateRequest::owner`,
//! `CheckpointRequest::owner`): an owner's names are stored behind
//! [`u_sdk::checkpoint_namespace`] (`o-<16 hex>.<name>`), and every operation and listing sees
//! only its owner's names, with the prefix taken off. Another owner's checkpoint is simply not
//! found, so its existence is not revealed. Clients the transport cannot tell apart (empty
//! owner) share the plain names, and may not use a name of the owned form. The admin scope
//! (`CheckpointRequest::admin`) sees and names every checkpoint as stored.
//!
//! Cached prompt prefixes are parted the same way ([`Sharing`]): by default each owner's
//! prompts key the prefix cache through a secret per-owner mask, so another client's identical
//! prompt is not found (its first request prefills in full, and timing reveals nothing).

use crate::{Error, Result};
use std::hash::{BuildHasher, RandomState};

/// Which clients share cached prompt prefixes (runner-text's `share_prefixes`).
#[derive(Clone, Debug)]
pub enum Sharing {
    /// Every client shares one prefix cache.
    All,
    /// Each owner has prefixes of its own (clients without an owner share theirs), so no
    /// client's request is faster for another's prompt: the default.
    Client(RandomState),
    /// No request reuses another's prefix.
    None,
}

impl Default for Sharing {
    fn default() -> Self {
        Sharing::Client(RandomState::new())
    }
}

impl Sharing {
    /// From the plugin setting: `all`, `client` or `none`.
    pub fn parse(s: &str) -> Option<Sharing> {
        match s {
            "all" => Some(Sharing::All),
            "client" => Some(Sharing::default()),
            "none" => Some(Sharing::None),
            _ => None,
        }
    }

    /// How `owner`'s prompts are keyed in the prefix cache.
    pub(crate) fn key(&self, owner: &str) -> PrefixKey {
        match self {
            Sharing::All => PrefixKey::Shared,
            Sharing::Client(_) if owner.is_empty() => PrefixKey::Shared,
            // A per-process secret mask per owner: the prefix tree's paths of two owners
            // diverge at their first token, and no client can aim at another's.
            Sharing::Client(secret) => PrefixKey::Masked((secret.hash_one(owner) as u32).max(1)),
            Sharing::None => PrefixKey::Off,
        }
    }
}

/// How one request's tokens key the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PrefixKey {
    /// The tokens themselves: shared with every other `Shared` request.
    Shared,
    /// Each token id XOR this mask: shared only with requests of the same mask.
    Masked(u32),
    /// Not looked up or inserted.
    Off,
}

impl PrefixKey {
    /// This key for a request under `adapters` (name, scale): KV computed under one set of
    /// adapters is found only by requests under the same set, never by the base model's.
    pub(crate) fn under(self, adapters: &[(String, f32)], secret: &RandomState) -> PrefixKey {
        if adapters.is_empty() {
            return self;
        }
        let set: Vec<(&str, u32)> = adapters
            .iter()
            .map(|(n, s)| (n.as_str(), s.to_bits()))
            .collect();
        let mask = secret.hash_one(set) as u32;
        match self {
            PrefixKey::Off => PrefixKey::Off,
            PrefixKey::Shared => PrefixKey::Masked(mask.max(1)),
            PrefixKey::Masked(m) => PrefixKey::Masked((m ^ mask).max(1)),
        }
    }

    /// The cache's key for `tokens`, or `None` when the request does not use the cache.
    pub(crate) fn of(self, tokens: &[u32]) -> Option<Vec<u32>> {
        match self {
            PrefixKey::Shared => Some(tokens.to_vec()),
            PrefixKey::Masked(m) => Some(tokens.iter().map(|t| t ^ m).collect()),
            PrefixKey::Off => None,
        }
    }
}

/// The namespace of one owner's checkpoint names.
pub(crate) enum Owner {
    /// Clients the transport cannot tell apart: plain names.
    Shared,
    /// One owner: names behind its prefix, `o-<hash>.`.
    Client(String),
    /// The admin scope: every stored name, as stored.
    Admin,
}

impl Owner {
    /// The namespace of `owner` (empty: the shared one), or every one for `admin`.
    pub(crate) fn new(owner: &str, admin: bool) -> Owner {
        match owner {
            _ if admin => Owner::Admin,
            "" => Owner::Shared,
            o => Owner::Client(u_sdk::checkpoint_namespace(o)),
        }
    }

    /// The stored name of the owner's checkpoint `name` (empty stays empty: no checkpoint).
    pub(crate) fn stored(&self, name: &str) -> Result<String> {
        match self {
            _ if name.is_empty() => Ok(String::new()),
            Owner::Client(p) => Ok(format!("{p}{name}")),
            Owner::Shared if is_owned(name) => Err(Error::InvalidRequest(format!(
                "checkpoint name `{name}`: names of the form o-<16 hex digits>.… are reserved"
            ))),
            Owner::Shared | Owner::Admin => Ok(name.to_string()),
        }
    }

    /// The owner's name for stored name `stored`, if it is one of the owner's.
    pub(crate) fn visible(&self, stored: &str) -> Option<String> {
        match self {
            Owner::Client(p) => stored.strip_prefix(p.as_str()).map(str::to_string),
            Owner::Shared => (!is_owned(stored)).then(|| stored.to_string()),
            Owner::Admin => Some(stored.to_string()),
        }
    }
}

/// Whether `name` is in an owner's namespace (`o-<16 hex>.…`).
fn is_owned(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() > 19
        && name.starts_with("o-")
        && b[2..18].iter().all(u8::is_ascii_hexdigit)
        && b[18] == b'.'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_keys_part_owners_and_keep_one_owner_together() {
        let s = Sharing::default();
        let (a, b) = (s.key("key:alice"), s.key("key:bob"));
        assert_ne!(a, b);
        assert_eq!(a, s.key("key:alice"));
        assert_eq!(s.key(""), PrefixKey::Shared);
        let t = [1, 2, 3];
        assert_ne!(a.of(&t), b.of(&t));
        assert_eq!(PrefixKey::Shared.of(&t).unwrap(), t);
        assert_eq!(Sharing::None.key("key:alice").of(&t), None);
        assert_eq!(Sharing::All.key("key:alice"), PrefixKey::Shared);
        assert!(Sharing::parse("client").is_some() && Sharing::parse("some").is_none());
    }

    #[test]
    fn owners_see_only_their_own_names() {
        let (a, b, shared, admin) = (
            Owner::new("key:alice", false),
            Owner::new("key:bob", false),
            Owner::new("", false),
            Owner::new("key:bob", true),
        );
        let stored = a.stored("private").unwrap();
        assert!(is_owned(&stored), "{stored}");
        assert_eq!(a.visible(&stored).as_deref(), Some("private"));
        assert_eq!(b.visible(&stored), None);
        assert_eq!(shared.visible(&stored), None);
        assert_ne!(b.stored("private").unwrap(), stored);
        assert_eq!(shared.stored("notes").unwrap(), "notes");
        assert_eq!(shared.visible("notes").as_deref(), Some("notes"));
        assert_eq!(a.visible("notes"), None);
        assert!(shared.stored(&stored).is_err(), "reserved for owners");
        assert_eq!(a.stored("").unwrap(), "");
        // The admin scope names and sees every checkpoint as stored.
        assert_eq!(admin.stored(&stored).unwrap(), stored);
        assert_eq!(admin.visible(&stored).as_deref(), Some(stored.as_str()));
        assert_eq!(admin.visible("notes").as_deref(), Some("notes"));
        // The same owner always gets the same namespace (persisted checkpoints stay theirs).
        assert_eq!(stored, "o-9463fd1432e88892.private");
    }
}
