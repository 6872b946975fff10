//! Who may connect: credentials looked up per client id and compared in constant time.
//!
//! A device logs in with username = its client id and password = its client key. The sources
//! behind [`CredentialSource`] differ by mode (Proplet resources and Secrets in Kubernetes, the
//! embedded store in standalone mode, a file for `propeller broker`), but all are consulted on
//! every connect, so adding or removing a credential takes effect without a restart.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, RwLock};

use serde::Deserialize;
use subtle::ConstantTimeEq;

/// What an authenticated client is allowed to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A device: may publish only its own reports and subscribe only to literal topics that
    /// are not agent reports.
    #[default]
    Proplet,
    /// A trusted service such as an OCI proxy: may publish and subscribe anywhere.
    Service,
    /// A device enrolling with a bootstrap token: may publish its one enrolment request and
    /// read its one reply, nothing else. Never granted by a credentials file.
    #[serde(skip)]
    Enrolee,
}

/// The topic channel a device belongs to: `m/{domain}/c/{channel}/...`. A device bound to a
/// channel may use only that channel's topics where the broker lets propeller decide per topic
/// (the external brokers' callbacks and rendered configs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChannelScope {
    /// The `{domain}` level; `None` accepts any domain.
    pub domain: Option<String>,
    /// The `{channel}` level.
    pub channel: String,
}

impl ChannelScope {
    /// Whether a topic's `{domain}` and `{channel}` levels fall within this scope.
    pub fn covers(&self, domain: &str, channel: &str) -> bool {
        self.channel == channel && self.domain.as_deref().is_none_or(|d| d == domain)
    }
}

/// A client's secret and role, and for a device the channel it belongs to.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    key: String,
    role: Role,
    scope: Option<ChannelScope>,
    /// The key before a rotation and until when it still works.
    previous: Option<(String, chrono::DateTime<chrono::Utc>)>,
}

impl Credential {
    /// A credential with the given key and role.
    pub fn new(key: impl Into<String>, role: Role) -> Self {
        Self {
            key: key.into(),
            role,
            scope: None,
            previous: None,
        }
    }

    /// The same credential also accepting `key`, the one it replaced, until `until`.
    pub fn with_previous(
        mut self,
        key: impl Into<String>,
        until: chrono::DateTime<chrono::Utc>,
    ) -> Self {
        self.previous = Some((key.into(), until));
        self
    }

    /// Until when the key before the last rotation still works, while it does at `now`.
    pub fn previous_valid_until(
        &self,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Option<chrono::DateTime<chrono::Utc>> {
        self.previous
            .as_ref()
            .map(|(_, until)| *until)
            .filter(|until| now < *until)
    }

    /// A device credential.
    pub fn proplet(key: impl Into<String>) -> Self {
        Self::new(key, Role::Proplet)
    }

    /// The same credential bound to one channel.
    pub fn on_channel(mut self, scope: ChannelScope) -> Self {
        self.scope = Some(scope);
        self
    }

    /// The role granted by this credential.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The key itself, for writing a broker's user table (never log it).
    pub fn secret(&self) -> &str {
        &self.key
    }

    /// The one key a broker that holds a single password per client (NATS's rendered users)
    /// must accept at `now`: the replaced key while its grace lasts (the connected device keeps
    /// its session and is sent its new key over it; an agent whose new key is refused logs in
    /// with the old one), then the current key. Never log it.
    pub fn single_key(&self, now: chrono::DateTime<chrono::Utc>) -> &str {
        match &self.previous {
            Some((previous, until)) if now < *until => previous,
            _ => &self.key,
        }
    }

    /// The channel a device is bound to, if any.
    pub fn scope(&self) -> Option<&ChannelScope> {
        self.scope.as_ref()
    }

    /// Whether `password` is this credential's key (or, during a rotation's grace period,
    /// the key it replaced), in time independent of where they differ.
    pub fn accepts(&self, password: &str) -> bool {
        let current = bool::from(self.key.as_bytes().ct_eq(password.as_bytes()));
        let previous = self.previous.as_ref().is_some_and(|(key, until)| {
            chrono::Utc::now() < *until && bool::from(key.as_bytes().ct_eq(password.as_bytes()))
        });
        current | previous
    }
}

impl fmt::Debug for Credential {
    // Secrets never reach logs: only the role is shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credential")
            .field("key", &"<redacted>")
            .field("role", &self.role)
            .field("scope", &self.scope)
            .field(
                "previous_until",
                &self.previous.as_ref().map(|(_, until)| until),
            )
            .finish()
    }
}

/// A bootstrap token as the broker knows it: the digest of its secret, never the secret.
#[derive(Debug, Clone)]
pub struct TokenCredential {
    digest: String,
    bcrypt: Option<String>,
    require_tls: bool,
    attempts: Arc<TokenAttempts>,
}

impl TokenCredential {
    /// A token whose secret digests to `digest` (see
    /// [`crate::protocol::enrolment::secret_digest`]); `require_tls` refuses it over plain TCP.
    pub fn new(digest: impl Into<String>, require_tls: bool) -> Self {
        Self {
            digest: digest.into(),
            bcrypt: None,
            require_tls,
            attempts: Arc::default(),
        }
    }

    /// The same token with the bcrypt hash of the whole token, for brokers that check a
    /// rendered password themselves (NATS).
    pub fn with_bcrypt(mut self, hash: Option<String>) -> Self {
        self.bcrypt = hash;
        self
    }

    /// The bcrypt hash of the whole token, when the token has one.
    pub fn bcrypt(&self) -> Option<&str> {
        self.bcrypt.as_deref()
    }
}

/// Failed secrets tried against one token id, for throttling guesses.
#[derive(Debug, Default)]
pub struct TokenAttempts {
    state: std::sync::Mutex<AttemptState>,
}

#[derive(Debug, Default)]
struct AttemptState {
    failures: u32,
    locked_until: Option<std::time::Instant>,
}

/// Wrong secrets a token id takes before it is locked.
pub const TOKEN_FAILURES_BEFORE_LOCK: u32 = 10;
/// How long a token id stays locked after too many wrong secrets.
pub const TOKEN_LOCK: std::time::Duration = std::time::Duration::from_secs(15 * 60);

impl TokenAttempts {
    /// Whether the id is locked now.
    fn locked(&self, now: std::time::Instant) -> bool {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.locked_until.is_some_and(|until| now < until)
    }

    /// Records a wrong secret; locks the id after [`TOKEN_FAILURES_BEFORE_LOCK`] of them.
    fn failed(&self, now: std::time::Instant) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.locked_until.is_some_and(|until| now >= until) {
            *state = AttemptState::default();
        }
        state.failures += 1;
        if state.failures >= TOKEN_FAILURES_BEFORE_LOCK {
            state.locked_until = Some(now + TOKEN_LOCK);
        }
    }

    /// A right secret resets the count of wrong ones.
    fn succeeded(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.failures = 0;
    }
}

/// Where the broker looks up a client's credential; consulted on every connect.
pub trait CredentialSource: Send + Sync + 'static {
    /// The credential of `client_id`, or `None` if it may not connect.
    fn lookup(&self, client_id: &str) -> Option<Credential>;

    /// The bootstrap token `id`, or `None` if there is no such token.
    fn lookup_token(&self, _id: &str) -> Option<TokenCredential> {
        None
    }
}

/// How a connection reached the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Over TLS (or a broker that does not tell: an external cluster's callback).
    Encrypted,
    /// Plain TCP or websocket.
    Plain,
}

/// Why a login was refused; logged and counted, never with the password.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No username or password was given.
    Anonymous,
    /// The username is not the client id (for an enrolment login: not its token's login name).
    UsernameMismatch,
    /// No credential exists for the client id.
    UnknownClient,
    /// The password is not the client's key.
    WrongKey,
    /// An enrolment login named a token that does not exist (deleted or never made).
    UnknownToken,
    /// An enrolment login gave a wrong token secret.
    WrongTokenSecret,
    /// The token id is locked after too many wrong secrets.
    TokenLocked,
    /// The token may only be used over TLS and the connection was plain.
    TokenNeedsTls,
}

impl AuthFailure {
    /// A stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Anonymous => "anonymous",
            Self::UsernameMismatch => "username_mismatch",
            Self::UnknownClient => "unknown_client",
            Self::WrongKey => "wrong_key",
            Self::UnknownToken => "unknown_token",
            Self::WrongTokenSecret => "wrong_token_secret",
            Self::TokenLocked => "token_locked",
            Self::TokenNeedsTls => "token_needs_tls",
        }
    }
}

/// Decides a login: username must equal the client id and the password must be its key.
pub fn authenticate(
    source: &dyn CredentialSource,
    client_id: &str,
    username: &str,
    password: &str,
) -> Result<Role, AuthFailure> {
    login(source, client_id, username, password).map(|c| c.role())
}

/// Like [`authenticate`], returning the whole credential (role and channel scope).
pub fn login(
    source: &dyn CredentialSource,
    client_id: &str,
    username: &str,
    password: &str,
) -> Result<Credential, AuthFailure> {
    login_over(source, client_id, username, password, Transport::Encrypted)
}

/// Like [`login`], for a connection that came over `transport`. A client id of the form
/// `enrol-<token id>-<nonce>` is an enrolment login: its username must be `enrol-<token id>`,
/// its password that bootstrap token, over TLS unless the token allows plain TCP, and it gets
/// [`Role::Enrolee`].
pub fn login_over(
    source: &dyn CredentialSource,
    client_id: &str,
    username: &str,
    password: &str,
    transport: Transport,
) -> Result<Credential, AuthFailure> {
    decide_login(source, client_id, username, password, transport, true)
}

/// The decision [`login_over`] made for a CONNECT, taken again by a second reader of the
/// same CONNECT (rumqttd's own auth hook after the guard): a wrong token secret is not
/// counted against the token's throttle a second time.
pub fn login_again(
    source: &dyn CredentialSource,
    client_id: &str,
    username: &str,
    password: &str,
    transport: Transport,
) -> Result<Credential, AuthFailure> {
    decide_login(source, client_id, username, password, transport, false)
}

fn decide_login(
    source: &dyn CredentialSource,
    client_id: &str,
    username: &str,
    password: &str,
    transport: Transport,
    count_attempt: bool,
) -> Result<Credential, AuthFailure> {
    if username.is_empty() && password.is_empty() {
        return Err(AuthFailure::Anonymous);
    }
    if let Some(token_id) = crate::protocol::enrolment::enrol_client_token_id(client_id) {
        if username != crate::protocol::enrolment::token_login_name(token_id) {
            return Err(AuthFailure::UsernameMismatch);
        }
        return token_login(source, token_id, password, transport, count_attempt);
    }
    if username != client_id {
        return Err(AuthFailure::UsernameMismatch);
    }
    let credential = source.lookup(client_id).ok_or(AuthFailure::UnknownClient)?;
    if credential.accepts(password) {
        Ok(credential)
    } else {
        Err(AuthFailure::WrongKey)
    }
}

/// Checks an enrolment login against the token table and its throttle (counting the
/// attempt when `count_attempt`).
fn token_login(
    source: &dyn CredentialSource,
    token_id: &str,
    password: &str,
    transport: Transport,
    count_attempt: bool,
) -> Result<Credential, AuthFailure> {
    let token = source
        .lookup_token(token_id)
        .ok_or(AuthFailure::UnknownToken)?;
    let now = std::time::Instant::now();
    if token.attempts.locked(now) {
        return Err(AuthFailure::TokenLocked);
    }
    if !crate::protocol::enrolment::token_matches(token_id, &token.digest, password) {
        if count_attempt {
            token.attempts.failed(now);
        }
        return Err(AuthFailure::WrongTokenSecret);
    }
    if count_attempt {
        token.attempts.succeeded();
    }
    if token.require_tls && transport == Transport::Plain {
        return Err(AuthFailure::TokenNeedsTls);
    }
    Ok(Credential::new(String::new(), Role::Enrolee))
}

/// The credential a client that already logged in holds, by its username (for a broker's
/// later checks, which carry no password): its own, or for an enrolment login (its username
/// `enrol-<token id>`, or its client id where a broker gives that instead) whose token still
/// exists, [`Role::Enrolee`].
pub fn known_credential(source: &dyn CredentialSource, username: &str) -> Option<Credential> {
    source.lookup(username).or_else(|| {
        let token = crate::protocol::enrolment::token_login_token_id(username)
            .or_else(|| crate::protocol::enrolment::enrol_client_token_id(username))?;
        source
            .lookup_token(token)
            .map(|_| Credential::new(String::new(), Role::Enrolee))
    })
}

/// Like [`login`], for an external cluster's auth callbacks: there a service account
/// (propeller's own, shared by its replicas, each under a client id of its own) may also use
/// any client id no device owns; a device's client id stays its own.
pub fn login_shared_service(
    source: &dyn CredentialSource,
    client_id: &str,
    username: &str,
    password: &str,
) -> Result<Credential, AuthFailure> {
    match login(source, client_id, username, password) {
        Err(AuthFailure::UsernameMismatch) => {
            let service = source
                .lookup(username)
                .filter(|c| c.role() == Role::Service);
            match service {
                Some(service) if source.lookup(client_id).is_none() => {
                    if service.accepts(password) {
                        Ok(service)
                    } else {
                        Err(AuthFailure::WrongKey)
                    }
                }
                _ => Err(AuthFailure::UsernameMismatch),
            }
        }
        decided => decided,
    }
}

/// An in-memory credential table that drivers keep up to date (Proplet watch, store, file),
/// with an index of which devices belong to each channel.
#[derive(Debug, Default, Clone)]
pub struct CredentialStore {
    entries: Arc<RwLock<Table>>,
}

#[derive(Debug, Default)]
struct Table {
    /// Whether the table was filled at least once (see [`CredentialStore::is_loaded`]).
    loaded: bool,
    /// Bumped by every change (see [`CredentialStore::generation`]).
    generation: u64,
    by_client: HashMap<String, Credential>,
    /// Client ids of the devices bound to each `channel` level (domains checked on lookup).
    by_channel: HashMap<String, Vec<String>>,
    /// Bootstrap tokens by id.
    tokens: HashMap<String, TokenCredential>,
}

impl Table {
    fn index(&mut self, client_id: &str, credential: &Credential) {
        if let Some(scope) = credential.scope() {
            self.by_channel
                .entry(scope.channel.clone())
                .or_default()
                .push(client_id.to_owned());
        }
    }

    fn unindex(&mut self, client_id: &str, credential: &Credential) {
        if let Some(scope) = credential.scope() {
            if let Some(ids) = self.by_channel.get_mut(&scope.channel) {
                ids.retain(|id| id != client_id);
                if ids.is_empty() {
                    self.by_channel.remove(&scope.channel);
                }
            }
        }
    }
}

impl CredentialStore {
    /// An empty store: nobody may connect until credentials are added.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces the credential of `client_id`.
    pub fn insert(&self, client_id: impl Into<String>, credential: Credential) {
        let client_id = client_id.into();
        let mut table = self.entries.write().unwrap_or_else(|e| e.into_inner());
        table.generation += 1;
        table.index(&client_id, &credential);
        if let Some(old) = table.by_client.insert(client_id.clone(), credential) {
            table.unindex(&client_id, &old);
        }
    }

    /// Removes `client_id`; its next connect is refused.
    pub fn remove(&self, client_id: &str) -> bool {
        let mut table = self.entries.write().unwrap_or_else(|e| e.into_inner());
        table.generation += 1;
        match table.by_client.remove(client_id) {
            Some(old) => {
                table.unindex(client_id, &old);
                true
            }
            None => false,
        }
    }

    /// Replaces the whole table at once (e.g. after a full relist).
    pub fn replace_all(&self, entries: HashMap<String, Credential>) {
        let mut table = Table {
            loaded: true,
            ..Table::default()
        };
        for (client_id, credential) in &entries {
            table.index(client_id, credential);
        }
        table.by_client = entries;
        let mut current = self.entries.write().unwrap_or_else(|e| e.into_inner());
        table.generation = current.generation + 1;
        table.tokens = std::mem::take(&mut current.tokens);
        *current = table;
    }

    /// Replaces the bootstrap tokens. A token already known keeps its count of wrong
    /// secrets (a relist must not reset a lock).
    pub fn replace_tokens(&self, tokens: HashMap<String, TokenCredential>) {
        let mut current = self.entries.write().unwrap_or_else(|e| e.into_inner());
        let mut next = tokens;
        for (id, token) in next.iter_mut() {
            if let Some(old) = current.tokens.get(id) {
                token.attempts = old.attempts.clone();
            }
        }
        if current.tokens.len() != next.len()
            || next.iter().any(|(id, t)| {
                current.tokens.get(id).is_none_or(|o| {
                    o.digest != t.digest || o.bcrypt != t.bcrypt || o.require_tls != t.require_tls
                })
            })
        {
            current.generation += 1;
        }
        current.tokens = next;
    }

    /// Bootstrap token ids with their digests, for rendering a broker's static configuration.
    pub fn token_snapshot(&self) -> Vec<(String, TokenCredential)> {
        let table = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<_> = table
            .tokens
            .iter()
            .map(|(id, t)| (id.clone(), t.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Whether the whole table was set at least once ([`Self::replace_all`]): a driver has
    /// read its source, so an empty table means no client, not "not read yet".
    pub fn is_loaded(&self) -> bool {
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .loaded
    }

    /// A number that changes whenever the table does: whoever derives something from the
    /// table (a rendered broker configuration) redoes it only then.
    pub fn generation(&self) -> u64 {
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .generation
    }

    /// The devices bound to the channel `m/{domain}/c/{channel}`.
    pub fn channel_members(&self, domain: &str, channel: &str) -> Vec<String> {
        let table = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let Some(ids) = table.by_channel.get(channel) else {
            return Vec::new();
        };
        ids.iter()
            .filter(|id| {
                table
                    .by_client
                    .get(*id)
                    .and_then(Credential::scope)
                    .is_some_and(|s| s.covers(domain, channel))
            })
            .cloned()
            .collect()
    }

    /// Every credential, for rendering a broker's static configuration.
    pub fn snapshot(&self) -> Vec<(String, Credential)> {
        let table = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<_> = table
            .by_client
            .iter()
            .map(|(id, c)| (id.clone(), c.clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// How many clients may connect.
    pub fn len(&self) -> usize {
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_client
            .len()
    }

    /// Whether nobody may connect.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl CredentialSource for CredentialStore {
    fn lookup(&self, client_id: &str) -> Option<Credential> {
        let table = self.entries.read().unwrap_or_else(|e| e.into_inner());
        table.by_client.get(client_id).cloned()
    }

    fn lookup_token(&self, id: &str) -> Option<TokenCredential> {
        let table = self.entries.read().unwrap_or_else(|e| e.into_inner());
        table.tokens.get(id).cloned()
    }
}

/// Looks in several sources in order; the first that knows the client decides.
pub struct LayeredCredentials {
    layers: Vec<Arc<dyn CredentialSource>>,
}

impl LayeredCredentials {
    /// Consults `layers` in order.
    pub fn new(layers: Vec<Arc<dyn CredentialSource>>) -> Self {
        Self { layers }
    }
}

impl CredentialSource for LayeredCredentials {
    fn lookup(&self, client_id: &str) -> Option<Credential> {
        self.layers.iter().find_map(|layer| layer.lookup(client_id))
    }

    fn lookup_token(&self, id: &str) -> Option<TokenCredential> {
        self.layers.iter().find_map(|layer| layer.lookup_token(id))
    }
}

/// A credentials file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsFileError {
    /// The file could not be read.
    #[error("cannot read credentials file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("credentials file {path} is invalid: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong, as the TOML parser reports it.
        message: String,
    },
    /// An entry is unusable.
    #[error("credentials file {path}: client #{index}: {message}")]
    Entry {
        /// The file.
        path: String,
        /// 1-based position of the `[[client]]` table.
        index: usize,
        /// What is wrong.
        message: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialsFile {
    #[serde(default)]
    client: Vec<FileClient>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileClient {
    id: String,
    key: String,
    #[serde(default)]
    role: Role,
}

/// Parses a credentials file:
///
/// ```toml
/// [[client]]
/// id = "proplet-1"
/// key = "a-long-random-key"
/// role = "proplet"   # or "service"; default "proplet"
/// ```
pub fn parse_credentials(
    text: &str,
    path: &str,
) -> Result<HashMap<String, Credential>, CredentialsFileError> {
    let file: CredentialsFile = toml::from_str(text).map_err(|e| CredentialsFileError::Parse {
        path: path.to_owned(),
        message: e.message().to_owned(),
    })?;
    let mut table = HashMap::with_capacity(file.client.len());
    for (position, client) in file.client.into_iter().enumerate() {
        let entry_error = |message: &str| CredentialsFileError::Entry {
            path: path.to_owned(),
            index: position + 1,
            message: message.to_owned(),
        };
        if client.id.trim().is_empty() {
            return Err(entry_error("`id` is empty"));
        }
        if client.key.is_empty() {
            return Err(entry_error("`key` is empty"));
        }
        if table.contains_key(&client.id) {
            return Err(entry_error(&format!(
                "client id `{}` appears twice",
                client.id
            )));
        }
        table.insert(client.id, Credential::new(client.key, client.role));
    }
    Ok(table)
}

/// Reads and parses a credentials file (see [`parse_credentials`]).
pub fn load_credentials_file(
    path: &Path,
) -> Result<HashMap<String, Credential>, CredentialsFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| CredentialsFileError::Read {
        path: shown.clone(),
        source,
    })?;
    parse_credentials(&text, &shown)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> CredentialStore {
        let s = CredentialStore::new();
        s.insert("dev-a", Credential::proplet("key-a"));
        s.insert("proxy", Credential::new("key-p", Role::Service));
        s
    }

    #[test]
    fn a_connect_read_twice_counts_one_wrong_secret() {
        let s = CredentialStore::new();
        let token: crate::protocol::enrolment::BootstrapToken = "abcdef.0123456789abcdef"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        s.replace_tokens(HashMap::from([(
            "abcdef".to_owned(),
            TokenCredential::new(token.secret_digest(), false),
        )]));
        let client = "enrol-abcdef-n0nce123";
        let wrong = "abcdef.0000000000000000";
        for _ in 0..TOKEN_FAILURES_BEFORE_LOCK - 1 {
            for check in [login_over, login_again] {
                assert_eq!(
                    check(&s, client, "enrol-abcdef", wrong, Transport::Plain).err(),
                    Some(AuthFailure::WrongTokenSecret)
                );
            }
        }
        let right = token.reveal();
        assert!(
            login_again(&s, client, "enrol-abcdef", &right, Transport::Plain).is_ok(),
            "one short of the lock: the guard and rumqttd's hook counted each CONNECT once"
        );
        assert_eq!(
            login_over(&s, client, "enrol-abcdef", wrong, Transport::Plain).err(),
            Some(AuthFailure::WrongTokenSecret)
        );
        assert_eq!(
            login_over(&s, client, "enrol-abcdef", &right, Transport::Plain).err(),
            Some(AuthFailure::TokenLocked)
        );
    }

    #[test]
    fn valid_login_yields_the_role() {
        let s = store();
        assert_eq!(
            authenticate(&s, "dev-a", "dev-a", "key-a"),
            Ok(Role::Proplet)
        );
        assert_eq!(
            authenticate(&s, "proxy", "proxy", "key-p"),
            Ok(Role::Service)
        );
    }

    #[test]
    fn through_the_callbacks_a_service_account_may_use_any_client_id_no_device_owns() {
        let s = store();
        let role = |client: &str, user: &str, key: &str| {
            login_shared_service(&s, client, user, key).map(|c| c.role())
        };
        assert_eq!(role("proxy-replica-1", "proxy", "key-p"), Ok(Role::Service));
        assert_eq!(
            role("proxy-replica-1", "proxy", "key-a"),
            Err(AuthFailure::WrongKey)
        );
        // Not a device's client id, and not as a device.
        assert_eq!(
            role("dev-a", "proxy", "key-p"),
            Err(AuthFailure::UsernameMismatch)
        );
        assert_eq!(
            role("other", "dev-a", "key-a"),
            Err(AuthFailure::UsernameMismatch)
        );
        // The embedded broker's logins stay bound to their client id.
        assert_eq!(
            authenticate(&s, "proxy-replica-1", "proxy", "key-p"),
            Err(AuthFailure::UsernameMismatch)
        );
    }

    #[test]
    fn each_refusal_has_its_reason() {
        let s = store();
        assert_eq!(
            authenticate(&s, "dev-a", "", ""),
            Err(AuthFailure::Anonymous)
        );
        assert_eq!(
            authenticate(&s, "dev-a", "proxy", "key-p"),
            Err(AuthFailure::UsernameMismatch)
        );
        assert_eq!(
            authenticate(&s, "ghost", "ghost", "x"),
            Err(AuthFailure::UnknownClient)
        );
        assert_eq!(
            authenticate(&s, "dev-a", "dev-a", "key-b"),
            Err(AuthFailure::WrongKey)
        );
        assert_eq!(
            authenticate(&s, "dev-a", "dev-a", "key-a-longer"),
            Err(AuthFailure::WrongKey)
        );
    }

    #[test]
    fn removal_takes_effect_on_next_lookup() {
        let s = store();
        assert!(s.remove("dev-a"));
        assert_eq!(
            authenticate(&s, "dev-a", "dev-a", "key-a"),
            Err(AuthFailure::UnknownClient)
        );
    }

    #[test]
    fn debug_output_hides_the_key() {
        let shown = format!("{:?}", Credential::proplet("super-secret"));
        assert!(!shown.contains("super-secret"), "{shown}");
    }

    #[test]
    fn layered_sources_consult_in_order() {
        let first = CredentialStore::new();
        first.insert("x", Credential::proplet("one"));
        let second = CredentialStore::new();
        second.insert("x", Credential::proplet("two"));
        second.insert("y", Credential::proplet("three"));
        let layered = LayeredCredentials::new(vec![Arc::new(first), Arc::new(second)]);
        assert_eq!(authenticate(&layered, "x", "x", "one"), Ok(Role::Proplet));
        assert_eq!(
            authenticate(&layered, "x", "x", "two"),
            Err(AuthFailure::WrongKey)
        );
        assert_eq!(authenticate(&layered, "y", "y", "three"), Ok(Role::Proplet));
    }

    #[test]
    fn credentials_file_parses_and_defaults_the_role() {
        let table = parse_credentials(
            "[[client]]\nid = \"a\"\nkey = \"k\"\n[[client]]\nid = \"p\"\nkey = \"q\"\nrole = \"service\"\n",
            "creds.toml",
        );
        let table = match table {
            Ok(t) => t,
            Err(e) => panic!("valid file refused: {e}"),
        };
        assert_eq!(table.get("a").map(Credential::role), Some(Role::Proplet));
        assert_eq!(table.get("p").map(Credential::role), Some(Role::Service));
    }

    #[test]
    fn credentials_file_errors_name_the_problem() {
        let cases = [
            ("[[client]]\nid = \"a\"\n", "key"),
            ("[[client]]\nid = \"\"\nkey = \"k\"\n", "`id` is empty"),
            (
                "[[client]]\nid = \"a\"\nkey = \"k\"\n[[client]]\nid = \"a\"\nkey = \"j\"\n",
                "appears twice",
            ),
            (
                "[[client]]\nid = \"a\"\nkey = \"k\"\nrole = \"admin\"\n",
                "admin",
            ),
            (
                "[[client]]\nid = \"a\"\nkey = \"k\"\npassword = \"x\"\n",
                "password",
            ),
        ];
        for (text, expected) in cases {
            match parse_credentials(text, "c.toml") {
                Ok(_) => panic!("accepted invalid file:\n{text}"),
                Err(e) => {
                    let shown = e.to_string();
                    assert!(shown.contains(expected), "{shown:?} lacks {expected:?}");
                    assert!(shown.contains("c.toml"), "{shown:?} lacks the path");
                }
            }
        }
    }
}
