//! A task's log over HTTP, the same in standalone's API and in Kubernetes mode:
//! `GET …?follow=true&tailLines=N&sinceSeconds=S&proplet=P`, answered with one JSON object
//! per line ([`StoredLine`]). A follow ends once the task has finished and no line came for
//! [`FOLLOW_SETTLE`], when the task is deleted, or when the reader goes away.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use futures::future::BoxFuture;
use propeller_core::object_name::ObjectName;
use serde::Deserialize;
use tokio::sync::broadcast;
use tokio::time::Instant;

use crate::crd::task::Task;
use crate::task_logs::{LogQuery, LogStore, StoredLine};

/// How long a follow waits for late lines after its task finished: the agent sends a run's
/// last lines a moment after its result.
pub const FOLLOW_SETTLE: Duration = Duration::from_secs(3);
/// How often a follow looks whether its task finished or was deleted.
const FOLLOW_LOOK: Duration = Duration::from_secs(1);

/// The query string of a log request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogParams {
    /// Keep sending lines as they arrive.
    #[serde(default)]
    pub follow: bool,
    /// Only the last this many kept lines.
    pub tail_lines: Option<usize>,
    /// Only lines of the last this many seconds.
    pub since_seconds: Option<u64>,
    /// Only lines of this Proplet.
    pub proplet: Option<String>,
}

impl LogParams {
    /// The lines these parameters want.
    pub fn query(&self) -> LogQuery {
        LogQuery {
            tail: self.tail_lines,
            since: self.since_seconds.and_then(|s| {
                let seconds = i64::try_from(s).ok()?;
                Utc::now().checked_sub_signed(chrono::Duration::try_seconds(seconds)?)
            }),
            proplet: self.proplet.clone().filter(|p| !p.is_empty()),
        }
    }
}

/// Finds a Task by name (in a store or through the API server).
pub type FindTask = Arc<dyn Fn(ObjectName) -> BoxFuture<'static, Option<Task>> + Send + Sync>;

/// The answer to a log request for the Task `name`.
pub async fn respond(
    logs: Arc<LogStore>,
    find: FindTask,
    name: ObjectName,
    params: LogParams,
) -> Response {
    let query = params.query();
    let Some(task) = find(name.clone()).await else {
        let kept = logs.read(&name, &query);
        if kept.is_empty() {
            let message = format!("task {name} not found");
            return (
                StatusCode::NOT_FOUND,
                axum::Json(serde_json::json!({ "error": message })),
            )
                .into_response();
        }
        // Deleted, but its log is still kept: what is left, without a follow.
        return ndjson(Body::from(lines_text(&kept)));
    };
    if !params.follow {
        return ndjson(Body::from(lines_text(&logs.read(&name, &query))));
    }
    let uid = task.metadata.uid.clone().unwrap_or_default();
    let (kept, receiver) = logs.follow(&name, &uid, &query);
    let follow = Follow {
        kept: kept.into(),
        receiver,
        query,
        find,
        name,
        last_line: Instant::now(),
        next_look: Instant::now() + FOLLOW_LOOK,
    };
    let stream = futures::stream::unfold(follow, |mut follow| async move {
        let text = follow.next().await?;
        Some((Ok::<_, std::convert::Infallible>(text), follow))
    });
    ndjson(Body::from_stream(stream))
}

fn ndjson(body: Body) -> Response {
    ([("content-type", "application/x-ndjson")], body).into_response()
}

fn line_text(line: &StoredLine) -> String {
    let mut text = serde_json::to_string(line).unwrap_or_default();
    text.push('\n');
    text
}

fn lines_text(lines: &[StoredLine]) -> String {
    lines.iter().map(line_text).collect()
}

/// A follow in progress.
struct Follow {
    kept: VecDeque<StoredLine>,
    receiver: broadcast::Receiver<StoredLine>,
    query: LogQuery,
    find: FindTask,
    name: ObjectName,
    last_line: Instant,
    next_look: Instant,
}

impl Follow {
    /// The next line to send, `None` when the follow is over.
    async fn next(&mut self) -> Option<String> {
        if let Some(line) = self.kept.pop_front() {
            return Some(line_text(&line));
        }
        loop {
            tokio::select! {
                received = self.receiver.recv() => match received {
                    Ok(line) if self.query.admits(&line) => {
                        self.last_line = Instant::now();
                        return Some(line_text(&line));
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        let note = StoredLine {
                            at: Utc::now(),
                            proplet: String::new(),
                            stream: "agent",
                            text: format!("{missed} lines missed: this reader fell behind"),
                        };
                        return Some(line_text(&note));
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
                _ = tokio::time::sleep_until(self.next_look) => {
                    self.next_look = Instant::now() + FOLLOW_LOOK;
                    let task = (self.find)(self.name.clone()).await?;
                    let finished = task.status.as_ref().is_some_and(|s| s.phase.is_terminal());
                    if finished && self.last_line.elapsed() >= FOLLOW_SETTLE {
                        return None;
                    }
                }
            }
        }
    }
}
