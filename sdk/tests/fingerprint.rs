//! The ABI fingerprint covers types and signatures, not documentation: the function the build
//! script hashes `src/abi/` with, checked on sources that differ only in comments or layout
//! (same tokens) and on sources whose ABI differs (different tokens), and recomputed over the
//! real `src/abi/` to equal the `ABI_HASH` this build embeds.

include!("../abi_fingerprint.rs");

const ORIGINAL: &str = r#"
/// A tensor's shape.
#[repr(C)]
pub struct Shape {
    /// Number of dimensions.
    pub rank: u32,
    pub dims: [u64; 4], // outermost first
}
/* a block comment /* nested */ still a comment */
pub fn name() -> &'static str { "a // not a comment" }
"#;

#[test]
fn rewording_docs_and_reformatting_keep_the_tokens() {
    let reworded = r#"
/// The dimensions of a tensor, outermost first; reworded at length
/// over two lines.
#[repr(C)]
pub struct Shape {
    /// How many dimensions are in use.
    pub rank: u32,
        pub dims: [u64; 4],
}
pub fn name() -> &'static str {
    "a // not a comment"
}
"#;
    assert_eq!(abi_tokens(ORIGINAL), abi_tokens(reworded));
}

#[test]
fn changing_a_type_field_or_literal_changes_the_tokens() {
    for (what, changed) in [
        (
            "field type",
            ORIGINAL.replace("pub rank: u32", "pub rank: u64"),
        ),
        ("field name", ORIGINAL.replace("pub rank", "pub ndim")),
        ("array length", ORIGINAL.replace("[u64; 4]", "[u64; 8]")),
        ("repr", ORIGINAL.replace("#[repr(C)]", "#[repr(C, u8)]")),
        (
            "signature",
            ORIGINAL.replace("-> &'static str", "-> String"),
        ),
        (
            "string literal",
            ORIGINAL.replace("not a comment", "not a remark"),
        ),
    ] {
        assert_ne!(abi_tokens(ORIGINAL), abi_tokens(&changed), "{what}");
    }
}

#[test]
fn comments_are_removed_and_literals_kept_verbatim() {
    let tokens = abi_tokens(ORIGINAL);
    assert!(!tokens.contains("dimensions"), "{tokens}");
    assert!(!tokens.contains("nested"), "{tokens}");
    assert!(tokens.contains(r#""a // not a comment""#), "{tokens}");
}

#[test]
fn abi_hash_is_the_fingerprint_of_src_abi() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/abi");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("src/abi")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).expect("source"))
        })
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    assert_eq!(fingerprint(&files), u_sdk::ABI_HASH);
    // A doc comment added to the ABI leaves the fingerprint alone; a new field does not.
    let mut documented = files.clone();
    documented[0]
        .1
        .insert_str(0, "//! One more line of documentation.\n");
    assert_eq!(fingerprint(&documented), u_sdk::ABI_HASH);
    let mut changed = files;
    changed[0].1.push_str("\npub struct Added { pub x: u8 }\n");
    assert_ne!(fingerprint(&changed), u_sdk::ABI_HASH);
}
