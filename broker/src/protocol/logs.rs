//! Task logs (`control/proplet/logs`): lines a task printed, sent by the agent that runs it
//! in batches. Propeller's own message; upstream agents never send it.

use serde_json::{Map, Value};

use super::error::DecodeError;
use super::fields::{number_to_i64, to_bytes, Fields, ObjectBuilder};

/// Which output of the task a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogStream {
    /// The guest's stdout.
    Stdout,
    /// The guest's stderr.
    Stderr,
    /// Written by the agent about the log itself (lines dropped at a limit).
    Agent,
}

impl LogStream {
    /// The wire form: `stdout`, `stderr` or `agent`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stdout => "stdout",
            Self::Stderr => "stderr",
            Self::Agent => "agent",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text {
            "stdout" => Some(Self::Stdout),
            "stderr" => Some(Self::Stderr),
            "agent" => Some(Self::Agent),
            _ => None,
        }
    }
}

/// One line a task printed, without its line break.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// `t`: when the agent read it, milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// `s`: the stream.
    pub stream: LogStream,
    /// `l`: the text (invalid UTF-8 replaced).
    pub text: String,
}

/// Lines of one task from one agent (`control/proplet/logs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskLogs {
    /// `task_id` (required): the task's UID.
    pub task_id: String,
    /// `proplet_id` (required): the agent that ran it; the broker drops a batch whose
    /// `proplet_id` is not the client that published it.
    pub proplet_id: String,
    /// `lines`, oldest first.
    pub lines: Vec<LogLine>,
}

/// Lines longer than this are cut by the agent; longer ones on the wire are refused.
pub const MAX_LINE_BYTES: usize = 16 * 1024;

impl TaskLogs {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        let invalid = |reason: String| DecodeError::InvalidValue {
            key: f.key("lines"),
            reason,
        };
        let lines = match f.get("lines") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| line_from(item).map_err(|e| invalid(format!("line {i}: {e}"))))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(invalid("expected an array of lines".into())),
        };
        Ok(Self {
            task_id: f.req_id("task_id")?,
            proplet_id: f.req_id("proplet_id")?,
            lines,
        })
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        let lines: Vec<Value> = self
            .lines
            .iter()
            .map(|line| {
                let mut object = Map::new();
                object.insert("t".into(), line.at_ms.into());
                object.insert("s".into(), line.stream.as_str().into());
                object.insert("l".into(), line.text.clone().into());
                Value::Object(object)
            })
            .collect();
        ObjectBuilder::new()
            .put("task_id", self.task_id.clone())
            .put("proplet_id", self.proplet_id.clone())
            .put("lines", lines)
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

fn line_from(item: &Value) -> Result<LogLine, String> {
    let object = item.as_object().ok_or("expected an object")?;
    let at_ms = object
        .get("t")
        .and_then(number_to_i64)
        .ok_or("`t` must be milliseconds since the epoch")?;
    let stream = object
        .get("s")
        .and_then(Value::as_str)
        .and_then(LogStream::parse)
        .ok_or("`s` must be stdout, stderr or agent")?;
    let text = object
        .get("l")
        .and_then(Value::as_str)
        .ok_or("`l` must be the line's text")?;
    if text.len() > MAX_LINE_BYTES {
        return Err(format!("`l` is longer than {MAX_LINE_BYTES} bytes"));
    }
    Ok(LogLine {
        at_ms,
        stream,
        text: text.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode, Inbound, TopicKind};

    #[test]
    fn batches_round_trip_and_bad_lines_are_named() {
        let batch = TaskLogs {
            task_id: "uid-1".into(),
            proplet_id: "edge".into(),
            lines: vec![
                LogLine {
                    at_ms: 1_700_000_000_000,
                    stream: LogStream::Stdout,
                    text: "hello".into(),
                },
                LogLine {
                    at_ms: 1_700_000_000_001,
                    stream: LogStream::Agent,
                    text: "3 lines dropped".into(),
                },
            ],
        };
        assert_eq!(
            decode(&TopicKind::Logs, &batch.encode()),
            Ok(Inbound::Logs(batch.clone()))
        );
        let bad = br#"{"task_id":"u","proplet_id":"p","lines":[{"t":1,"s":"tty","l":"x"}]}"#;
        let error = decode(&TopicKind::Logs, bad).expect_err("a bad stream");
        assert!(error.to_string().contains("line 0"), "{error}");
        let long = format!(
            r#"{{"task_id":"u","proplet_id":"p","lines":[{{"t":1,"s":"stdout","l":"{}"}}]}}"#,
            "x".repeat(MAX_LINE_BYTES + 1)
        );
        assert!(decode(&TopicKind::Logs, long.as_bytes()).is_err());
    }
}
