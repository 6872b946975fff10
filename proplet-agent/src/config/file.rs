//! The optional TOML file, read into [`Settings`] (serde): either top-level keys or a
//! `[proplet]` section (upstream's layout). A bad value is reported with its file, line and
//! key.

use std::path::Path;

use serde::Deserialize;

use crate::config::settings::Settings;

use super::ConfigError;

#[derive(Deserialize)]
struct Sectioned {
    proplet: Settings,
}

/// Reads and checks the file at `path`; an error names the file and the line at fault, and
/// the key when one is.
pub(super) fn load(path: &Path) -> Result<Settings, ConfigError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let at_line = |e: &toml::de::Error| {
        let line = e
            .span()
            .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
        match line {
            Some(line) => format!("{shown}:{line}"),
            None => shown.clone(),
        }
    };
    let syntax = |e: toml::de::Error| ConfigError::File {
        path: at_line(&e),
        message: e.message().to_owned(),
    };
    // A value that does not fit its key: the key is the path serde followed to it.
    let value = |e: serde_path_to_error::Error<toml::de::Error>, section: &str| {
        let key = e.path().to_string();
        let key = key.strip_prefix(section).unwrap_or(&key).to_owned();
        let e = e.into_inner();
        match key.as_str() {
            "" | "." => syntax(e),
            _ => ConfigError::FileKey {
                path: at_line(&e),
                key,
                message: e.message().to_owned(),
            },
        }
    };
    let table: toml::Table = toml::from_str(&text).map_err(syntax)?;
    let document = || toml::Deserializer::parse(&text).map_err(syntax);
    match table.get("proplet") {
        Some(toml::Value::Table(_)) => {
            serde_path_to_error::deserialize::<_, Sectioned>(document()?)
                .map(|s| s.proplet)
                .map_err(|e| value(e, "proplet."))
        }
        Some(_) => Err(ConfigError::File {
            path: shown,
            message: "`proplet` must be a table".into(),
        }),
        None => serde_path_to_error::deserialize(document()?).map_err(|e| value(e, "")),
    }
}
