//! The one rule for image references, which `tessera-manifests` and the chart's values schema
//! both apply.
//!
//! An image is `[registry[:port]/]path[:tag][@digest]` as the OCI distribution reference
//! grammar has it: a registry has a dot or a port or is `localhost`; path components are
//! lowercase letters and digits joined by `.`, `_`, `__` or dashes; a tag is 1 to 128 of
//! letters, digits, `_`, `.` and `-`, not starting with `.` or `-`; a digest is
//! `algorithm:hex` of at least 32 hex digits. The pattern is written for both regex engines
//! (Rust's `regex`, Go's RE2 under Helm's JSON schema): no look-around, no `\w` (Unicode in
//! Rust).

use std::sync::LazyLock;

/// The image reference pattern, anchored.
pub const IMAGE_PATTERN: &str = concat!(
    "^",
    // Registry: with a dot (and a port), one word with a port, or localhost.
    r"(?:(?:localhost|[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)+)(?::[0-9]+)?/",
    r"|[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?:[0-9]+/)?",
    // Path.
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*",
    // Tag.
    r"(?::[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,127})?",
    // Digest.
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?",
    "$"
);

static IMAGE: LazyLock<regex::Regex> =
    LazyLock::new(|| regex::Regex::new(IMAGE_PATTERN).expect("the image pattern compiles"));

/// Whether `image` is an image reference by [`IMAGE_PATTERN`].
pub fn is_image_reference(image: &str) -> bool {
    IMAGE.is_match(image)
}

/// What a good image reference looks like, for error messages.
pub const IMAGE_SHAPE: &str =
    "[registry[:port]/]name[:tag][@digest], the name in lowercase (e.g. ghcr.io/tessera-gpu/tessera:0.1.0)";

#[cfg(test)]
mod tests {
    use super::*;

    mod names {
        include!("../tests/image_names.rs");
    }

    #[test]
    fn the_rule_accepts_and_refuses_the_lists() {
        for g in names::GOOD {
            assert!(is_image_reference(g), "{g:?} refused");
        }
        for b in names::BAD {
            assert!(!is_image_reference(b), "{b:?} accepted");
        }
        let long_tag = format!("t:{}", "a".repeat(128));
        assert!(is_image_reference(&long_tag));
        assert!(!is_image_reference(&format!("{long_tag}a")));
    }
}
