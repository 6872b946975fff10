//! Finding the Wasm binary in a manifest: the CNCF Wasm OCI artifact layout (`wkg`, wasmCloud,
//! `oras` with a Wasm media type), the older `wasm-to-oci` layout, and a plain single-layer
//! artifact whose one layer turns out to be a Wasm binary, or a one-layer image whose layer
//! ocicrypt encrypted (Confidential Containers' tools), passed on to the device to decrypt.

use oci_client::manifest::{ImageIndexEntry, OciDescriptor, OciImageManifest};

/// Layer media types that declare a Wasm binary.
pub const WASM_LAYER_MEDIA_TYPES: [&str; 3] = [
    "application/wasm",
    oci_client::manifest::WASM_LAYER_MEDIA_TYPE,
    "application/vnd.module.wasm.content.layer.v1+wasm",
];

/// The suffix ocicrypt adds to an encrypted layer's media type.
const ENCRYPTED_SUFFIX: &str = "+encrypted";

/// Whether ocicrypt encrypted `layer` (propeller cannot read it; the device decrypts it).
pub fn is_encrypted_layer(layer: &OciDescriptor) -> bool {
    layer.media_type.ends_with(ENCRYPTED_SUFFIX)
}

/// The first bytes of every Wasm module and component.
const WASM_MAGIC: &[u8; 4] = b"\0asm";

/// The layer that holds the Wasm binary, or why there is none.
pub fn wasm_layer(manifest: &OciImageManifest) -> Result<&OciDescriptor, String> {
    let declared: Vec<&OciDescriptor> = manifest
        .layers
        .iter()
        .filter(|l| WASM_LAYER_MEDIA_TYPES.contains(&l.media_type.as_str()))
        .collect();
    match (declared.as_slice(), manifest.layers.as_slice()) {
        ([one], _) => Ok(one),
        ([], [only]) => Ok(only),
        ([], []) => Err("the manifest has no layers".into()),
        ([], layers) if layers.iter().any(is_encrypted_layer) => Err(format!(
            "the image has {} layers, some encrypted; an encrypted module must be an image of one layer holding its .wasm file",
            layers.len()
        )),
        ([], layers) => Err(format!(
            "the manifest has {} layers and none is a Wasm layer (types: {})",
            layers.len(),
            media_types(layers)
        )),
        (several, _) => Err(format!(
            "the manifest has {} Wasm layers; a task runs exactly one binary",
            several.len()
        )),
    }
}

fn media_types(layers: &[OciDescriptor]) -> String {
    let mut types: Vec<&str> = layers.iter().map(|l| l.media_type.as_str()).collect();
    types.dedup();
    types.join(", ")
}

/// Whether `bytes` start like a Wasm binary (module or component).
pub fn is_wasm(bytes: &[u8]) -> bool {
    bytes.starts_with(WASM_MAGIC)
}

/// Why a pulled layer is not a Wasm binary, naming what it looks like instead.
pub fn not_wasm_reason(bytes: &[u8]) -> String {
    let looks_like = match bytes {
        [0x1f, 0x8b, ..] => " (it is gzip data: a container image layer?)",
        [] => " (it is empty)",
        _ => "",
    };
    format!("its layer is not a Wasm binary{looks_like}")
}

/// Picks the Wasm entry of an image index (`os` wasi*/`architecture` wasm), else the only
/// entry; an index of several container platforms is not a Wasm artifact.
pub fn wasm_platform(entries: &[ImageIndexEntry]) -> Option<String> {
    let wasm = entries.iter().find(|e| {
        e.platform.as_ref().is_some_and(|p| {
            let os = p.os.to_string();
            os.starts_with("wasi") || p.architecture.to_string() == "wasm"
        })
    });
    match (wasm, entries) {
        (Some(entry), _) => Some(entry.digest.clone()),
        (None, [only]) => Some(only.digest.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(media_type: &str) -> OciDescriptor {
        OciDescriptor {
            media_type: media_type.into(),
            digest: format!("sha256:{}", "0".repeat(64)),
            size: 8,
            ..Default::default()
        }
    }

    fn manifest(layers: Vec<OciDescriptor>) -> OciImageManifest {
        OciImageManifest {
            layers,
            ..Default::default()
        }
    }

    #[test]
    fn the_declared_wasm_layer_is_chosen_among_others() {
        let m = manifest(vec![layer("application/json"), layer("application/wasm")]);
        assert_eq!(
            wasm_layer(&m).map(|l| l.media_type.as_str()),
            Ok("application/wasm")
        );
    }

    #[test]
    fn a_single_layer_of_any_type_is_a_candidate() {
        let m = manifest(vec![layer("application/vnd.oci.image.layer.v1.tar")]);
        assert!(wasm_layer(&m).is_ok());
    }

    #[test]
    fn container_images_and_multi_module_apps_are_refused() {
        let image = manifest(vec![
            layer("application/vnd.oci.image.layer.v1.tar+gzip"),
            layer("application/vnd.oci.image.layer.v1.tar+gzip"),
        ]);
        let err = wasm_layer(&image).err().unwrap_or_default();
        assert!(err.contains("none is a Wasm layer"), "{err}");
        let spin = manifest(vec![layer("application/wasm"), layer("application/wasm")]);
        assert!(wasm_layer(&spin).is_err());
        assert!(wasm_layer(&manifest(vec![])).is_err());
    }

    #[test]
    fn an_encrypted_layer_is_taken_only_alone() {
        let encrypted = layer("application/vnd.oci.image.layer.v1.tar+gzip+encrypted");
        assert!(is_encrypted_layer(&encrypted));
        assert!(!is_encrypted_layer(&layer("application/wasm")));
        let one = manifest(vec![encrypted.clone()]);
        assert!(wasm_layer(&one).is_ok_and(is_encrypted_layer));
        let image = manifest(vec![encrypted.clone(), encrypted]);
        let err = wasm_layer(&image).err().unwrap_or_default();
        assert!(err.contains("one layer holding its .wasm"), "{err}");
    }

    #[test]
    fn magic_bytes_decide_what_is_wasm() {
        assert!(is_wasm(b"\0asm\x01\0\0\0"));
        assert!(!is_wasm(b"\x1f\x8b\x08"));
        assert!(not_wasm_reason(b"\x1f\x8b\x08").contains("gzip"));
    }
}
