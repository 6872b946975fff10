//! Errors as one line for logs and statuses.

/// An error and its causes on one line ("a: b: c"); a cause whose text the line already
/// ends with (wrappers that repeat their source) is not repeated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}
