//! The keys an agent may log in with. After `propeller rotate` it holds its new key and, until
//! the grace period ends, the one it replaced: every broker accepts the new key at once except
//! one that holds a single password per client (NATS's rendered users keep the old key until
//! the grace ends), so a login that fails is tried next with the other key.

use chrono::{DateTime, Utc};

/// The current key and, during a rotation's grace, the replaced one.
#[derive(Clone, PartialEq, Eq)]
pub struct LoginKeys {
    current: String,
    previous: Option<(String, DateTime<Utc>)>,
    /// Whether the last login attempt used the previous key.
    using_previous: bool,
}

impl std::fmt::Debug for LoginKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoginKeys")
            .field("previous_until", &self.previous.as_ref().map(|(_, u)| u))
            .field("using_previous", &self.using_previous)
            .finish_non_exhaustive()
    }
}

impl LoginKeys {
    /// Keys starting from `current`, with the key it replaced while that works.
    pub fn new(current: String, previous: Option<(String, DateTime<Utc>)>) -> Self {
        Self {
            current,
            previous,
            using_previous: false,
        }
    }

    /// The current key.
    pub fn current(&self) -> &str {
        &self.current
    }

    /// A new key from propeller; the current one becomes the previous until `until`.
    /// Returns `false` (and changes nothing) when `key` is already the current one.
    pub fn rotate(&mut self, key: String, until: DateTime<Utc>) -> bool {
        if key == self.current {
            return false;
        }
        let replaced = std::mem::replace(&mut self.current, key);
        self.previous = Some((replaced, until));
        self.using_previous = false;
        true
    }

    /// The previous key and until when it works, while it does at `now`.
    pub fn previous(&self, now: DateTime<Utc>) -> Option<(&str, DateTime<Utc>)> {
        self.previous
            .as_ref()
            .filter(|(_, until)| now < *until)
            .map(|(key, until)| (key.as_str(), *until))
    }

    /// The key for the next login: after a login that failed, the other key while the
    /// previous one still works; after a session that was lost, the key that worked.
    pub fn next(&mut self, login_failed: bool, now: DateTime<Utc>) -> &str {
        let previous_works = self.previous(now).is_some();
        if !previous_works {
            self.using_previous = false;
        } else if login_failed {
            self.using_previous = !self.using_previous;
        }
        match (&self.previous, self.using_previous) {
            (Some((key, _)), true) => key,
            _ => &self.current,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_login_tries_the_other_key_until_the_grace_ends() {
        let now = Utc::now();
        let until = now + chrono::Duration::minutes(5);
        let mut keys = LoginKeys::new("old".into(), None);
        assert_eq!(keys.next(true, now), "old", "one key: always it");
        assert!(keys.rotate("new".into(), until));
        assert!(!keys.rotate("new".into(), until), "the same key twice");
        assert_eq!(keys.next(false, now), "new");
        assert_eq!(keys.next(true, now), "old", "the new key was refused");
        assert_eq!(keys.next(false, now), "old", "the old key worked");
        assert_eq!(keys.next(true, now), "new");
        let after = until + chrono::Duration::seconds(1);
        assert_eq!(keys.next(true, after), "new");
        assert_eq!(keys.next(true, after), "new", "the old key stopped");
        assert_eq!(keys.previous(after), None);
        assert_eq!(keys.previous(now).map(|(k, _)| k), Some("old"));
        assert!(!format!("{keys:?}").contains("old\""));
    }
}
