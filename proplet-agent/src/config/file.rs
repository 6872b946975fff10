//! The optional TOML file: its keys, read once, each value checked where it is used.

use super::*;

/// Values of the TOML file: either top-level keys or a `[proplet]` section (upstream layout).
/// Scalars and lists are kept as text (a list joined with commas); lists are also kept as
/// given, for the settings that take one item per entry.
#[derive(Debug, Default)]
pub(super) struct FileValues {
    pub(super) text: HashMap<String, String>,
    pub(super) lists: HashMap<String, Vec<toml::Value>>,
}

impl FileValues {
    pub(super) fn get(&self, key: &str) -> Option<String> {
        self.text.get(key).cloned().filter(|v| !v.is_empty())
    }

    /// `mqtt_address` as a string (comma-separated) or a list of strings; `None` when unset
    /// (or an empty string, as for every other key).
    pub(super) fn brokers(
        &self,
        path: Option<&Path>,
    ) -> Option<Result<BrokerAddresses, ConfigError>> {
        const KEY: &str = "mqtt_address";
        let origin = format!(
            "`{KEY}` in config file {}",
            path.map(|p| p.display().to_string()).unwrap_or_default()
        );
        if let Some(items) = self.lists.get(KEY) {
            let count = items.len();
            let mut entries = Vec::with_capacity(count);
            for (i, item) in items.iter().enumerate() {
                match item.as_str() {
                    Some(text) => entries.push(text),
                    None => {
                        return Some(Err(ConfigError::Address {
                            origin,
                            entry: i + 1,
                            count,
                            value: item.to_string(),
                            problem: AddressError::NotText,
                        }))
                    }
                }
            }
            return Some(BrokerAddresses::parse(&entries, &origin));
        }
        self.get(KEY)
            .map(|text| BrokerAddresses::parse_list(&text, &origin))
    }
}

pub(super) fn load_file(path: &Path) -> Result<FileValues, ConfigError> {
    let shown = path.display().to_string();
    let file_error = |message: String| ConfigError::File {
        path: shown.clone(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| file_error(e.message().to_owned()))?;
    let section = match table.get("proplet") {
        Some(toml::Value::Table(t)) => t.clone(),
        Some(_) => return Err(file_error("`proplet` must be a table".into())),
        None => table,
    };
    let mut values = FileValues::default();
    for (key, value) in section {
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Array(items) => {
                let joined = items
                    .iter()
                    .map(|i| {
                        i.as_str()
                            .map(str::to_owned)
                            .unwrap_or_else(|| i.to_string())
                    })
                    .collect::<Vec<_>>()
                    .join(",");
                values.lists.insert(key.clone(), items);
                joined
            }
            _ => {
                return Err(file_error(format!(
                    "`{key}` must be a string, number or list"
                )))
            }
        };
        values.text.insert(key, text);
    }
    Ok(values)
}
