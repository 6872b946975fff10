//! Helpers shared by the operator's integration tests.

use std::path::PathBuf;

/// Directory of the upstream sample manifests (`../shared/samples/upstream` beside the
/// repository), overridable with `PROPELLER_SAMPLES_DIR`.
pub fn upstream_samples_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("PROPELLER_SAMPLES_DIR") {
        return PathBuf::from(dir);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/samples/upstream")
}

/// Every YAML document of every file in `dir`, with the file it came from.
pub fn yaml_documents(dir: &std::path::Path) -> Vec<(String, serde_json::Value)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if !value.is_null() {
                out.push((
                    path.file_name().unwrap().to_string_lossy().into_owned(),
                    value,
                ));
            }
        }
    }
    out
}
