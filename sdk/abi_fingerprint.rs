// The ABI fingerprint, shared by `build.rs` (which computes `ABI_HASH`) and the SDK's tests
// (`tests/fingerprint.rs`). Needs `sha2` in scope.
//
// What is hashed is each `src/abi/*.rs` file's tokens: comments (doc comments included) are
// removed and runs of whitespace become one space, so rewording documentation or reformatting
// leaves the hash alone, while any change to a type, field, variant or signature changes it.

/// The fingerprint of the ABI sources `files` (`(file name, source)`, in file-name order): the
/// SHA-256 of each name and its [`abi_tokens`], each followed by a NUL.
pub fn fingerprint(files: &[(String, String)]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for (name, text) in files {
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update(abi_tokens(text).as_bytes());
        hasher.update([0]);
    }
    hasher.finalize().into()
}

/// `source` without comments, whitespace runs collapsed to one space (string and char literals
/// kept as written).
pub fn abi_tokens(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut pending_space = false;
    let mut i = 0;
    let push = |out: &mut String, pending: &mut bool, c: char| {
        if *pending && !out.is_empty() {
            out.push(' ');
        }
        *pending = false;
        out.push(c);
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            pending_space = true;
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            pending_space = true;
        } else if c == '\'' && next == Some('"') && chars.get(i + 2) == Some(&'\'') {
            for k in 0..3 {
                push(&mut out, &mut pending_space, chars[i + k]);
            }
            i += 3;
        } else if c == '"' {
            push(&mut out, &mut pending_space, c);
            i += 1;
            while i < chars.len() {
                out.push(chars[i]);
                if chars[i] == '\\' && i + 1 < chars.len() {
                    out.push(chars[i + 1]);
                    i += 2;
                    continue;
                }
                i += 1;
                if chars[i - 1] == '"' {
                    break;
                }
            }
        } else if c.is_whitespace() {
            pending_space = true;
            i += 1;
        } else {
            push(&mut out, &mut pending_space, c);
            i += 1;
        }
    }
    out
}
