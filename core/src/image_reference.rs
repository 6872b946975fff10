//! Which `imageUrl`s name an OCI artifact, and the digest-pinned form sent to devices.
//!
//! Pure: used by the Task plan (does this run need a registry resolution?) and by the
//! puller. An `http://` or `https://` URL is fetched by the device itself; anything else
//! non-empty is a registry reference (an `oci://` prefix is accepted and dropped).

use oci_spec::distribution::Reference;

/// Scheme prefix some users write before a registry reference.
const OCI_SCHEME: &str = "oci://";

/// The registry reference in `image_url`, or `None` when the device fetches it itself
/// (an HTTP(S) URL) or there is nothing to fetch.
pub fn registry_reference(image_url: &str) -> Option<&str> {
    let url = image_url.trim();
    if url.is_empty() {
        return None;
    }
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return None;
    }
    Some(url.strip_prefix(OCI_SCHEME).unwrap_or(url))
}

/// Parses a registry reference (`registry/repo:tag`, `repo@sha256:…`, Docker Hub short
/// names), with the parser's own message on failure.
pub fn parse(reference: &str) -> Result<Reference, String> {
    reference.parse::<Reference>().map_err(|e| e.to_string())
}

/// `image_url` pinned to `digest` (`registry/repo@sha256:…`), the name devices ask for so
/// every copy and retry of a run gets the same bytes. `None` if `image_url` is not a
/// registry reference.
pub fn pinned(image_url: &str, digest: &str) -> Option<String> {
    let reference = parse(registry_reference(image_url)?).ok()?;
    let pinned = Reference::with_digest(
        reference.registry().to_owned(),
        reference.repository().to_owned(),
        digest.to_owned(),
    );
    Some(pinned.whole())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_urls_are_fetched_by_the_device() {
        assert_eq!(registry_reference("https://example.com/add.wasm"), None);
        assert_eq!(registry_reference("HTTP://example.com/add.wasm"), None);
        assert_eq!(registry_reference("  "), None);
    }

    #[test]
    fn registry_references_are_recognised_with_or_without_scheme() {
        assert_eq!(
            registry_reference("oci://registry.example/add:1"),
            Some("registry.example/add:1")
        );
        assert_eq!(
            registry_reference("docker.io/mrstevenyaga/add.wasm:latest"),
            Some("docker.io/mrstevenyaga/add.wasm:latest")
        );
    }

    #[test]
    fn pinning_keeps_registry_and_repository_and_drops_the_tag() {
        let digest = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            pinned("127.0.0.1:5000/wasm/add:1.0", &digest).as_deref(),
            Some(format!("127.0.0.1:5000/wasm/add@{digest}").as_str())
        );
        assert_eq!(
            pinned("oci://ghcr.io/acme/app:v2", &digest).as_deref(),
            Some(format!("ghcr.io/acme/app@{digest}").as_str())
        );
        assert_eq!(pinned("https://example.com/a.wasm", &digest), None);
    }

    #[test]
    fn malformed_references_are_reported() {
        assert!(parse("a b:1").is_err());
        assert!(parse("repo:").is_err());
        assert!(parse("registry.example/add:1").is_ok());
    }
}
