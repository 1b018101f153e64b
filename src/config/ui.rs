//! `[ui]`: the operator console the relay serves.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// `[ui]`: off unless `enabled = true`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UiSection {
    /// Serve the console (default false).
    pub enabled: Option<bool>,
    /// Its own address, not the metrics port (default `127.0.0.1:9465`).
    pub listen: Option<String>,
    /// A path prefix for a reverse proxy (`/postbox`; default none).
    pub path_prefix: Option<String>,
    /// Allow actions (pause, resume, replay, purge): they need the token (default false).
    pub actions: Option<bool>,
    /// The token actions need (a bearer token, or the password of basic auth); also
    /// `POSTBOX_UI_TOKEN`.
    pub token: Option<String>,
    /// Show payloads (default true; false for payloads that carry personal data).
    pub show_payloads: Option<bool>,
    /// The host names a request's `Host` may name (against DNS rebinding); `["*"]`: any. Default:
    /// the loopback names when `listen` is a loopback address, else any.
    pub allowed_hosts: Option<Vec<String>>,
    /// The database connections the console's pages may use at once (its own, never the
    /// delivery's; default 2).
    pub pool_size: Option<u32>,
    /// The longest a page's statement may run before the server ends it (default `5s`).
    pub statement_timeout: Option<String>,
}

/// The default number of database connections of the console's pages.
pub const DEFAULT_UI_POOL_SIZE: u32 = 2;
/// The default limit on one statement of a console page.
pub const DEFAULT_UI_STATEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The default address of the console.
pub const DEFAULT_UI_LISTEN: &str = "127.0.0.1:9465";

/// `[ui]` validated, every default filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UiSettings {
    /// The address it listens on.
    pub listen: SocketAddr,
    /// The path prefix (empty, or `/name` without a trailing slash).
    pub path_prefix: String,
    /// Whether actions are allowed.
    pub actions: bool,
    /// The token actions need.
    pub token: Option<String>,
    /// Whether payloads are shown.
    pub show_payloads: bool,
    /// Host names (lower case, no port) a request's `Host` may name; empty: any.
    pub allowed_hosts: Vec<String>,
    /// Database connections of the console's pages.
    pub pool_size: u32,
    /// The limit on one statement of a page.
    pub statement_timeout: std::time::Duration,
    /// The token as given had spaces or line breaks around it, removed (see
    /// [`UiSettings::notes`]).
    pub token_trimmed: bool,
}

/// The host names of a console that listens on a loopback address.
pub const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

impl UiSettings {
    /// What `config check` and the relay's start say about these settings beyond errors.
    pub fn notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.token_trimmed {
            out.push(
                "ui.token: the spaces or line break around it (a Secret made from a file?) were removed"
                    .to_owned(),
            );
        }
        out
    }

    /// Whether a request's `Host` header (`name` or `name:port`) is one the console answers.
    pub fn host_allowed(&self, host: Option<&str>) -> bool {
        if self.allowed_hosts.is_empty() {
            return true;
        }
        let Some(host) = host else { return false };
        let host = host.trim().to_ascii_lowercase();
        // `[::1]:9465`, `localhost:9465`, `localhost`: the name, then nothing or a port.
        let (name, rest) = match host.find(']') {
            Some(i) if host.starts_with('[') => host.split_at(i + 1),
            _ => host.split_at(host.find(':').unwrap_or(host.len())),
        };
        let port_ok = rest.is_empty()
            || rest.strip_prefix(':').is_some_and(|p| {
                !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
            });
        port_ok && self.allowed_hosts.iter().any(|h| h == name)
    }
}

impl UiSection {
    /// `None` when the console is off; else its settings, or the field that is wrong.
    pub fn settings(&self) -> Result<Option<UiSettings>, ConfigError> {
        let err = |field: &str, problem: String| ConfigError {
            field: field.to_owned(),
            problem,
        };
        if !self.enabled.unwrap_or(false) {
            return Ok(None);
        }
        let listen = self.listen.as_deref().unwrap_or(DEFAULT_UI_LISTEN);
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| err("ui.listen", format!("{listen:?} is not host:port ({e})")))?;
        let path_prefix = self.path_prefix.clone().unwrap_or_default();
        if !path_prefix.is_empty()
            && (!path_prefix.starts_with('/')
                || path_prefix.ends_with('/')
                || path_prefix.contains(['?', '#', ' ']))
        {
            return Err(err(
                "ui.path_prefix",
                format!("{path_prefix:?} must start with / and not end with one (\"/postbox\")"),
            ));
        }
        // A token read from a file (a Secret made with --from-file) ends with a newline that no
        // header can carry: spaces and line breaks around it are not part of it.
        let token = self.token.as_deref().map(str::trim).map(str::to_owned);
        let token_trimmed = token.as_deref().map(str::len) != self.token.as_deref().map(str::len);
        if let Some(t) = &token
            && t.len() < 16
        {
            return Err(err("ui.token", "must be at least 16 characters".into()));
        }
        let actions = self.actions.unwrap_or(false);
        if actions && token.is_none() {
            return Err(err(
                "ui.actions",
                "actions need a token: set ui.token or POSTBOX_UI_TOKEN".into(),
            ));
        }
        let allowed_hosts = match &self.allowed_hosts {
            Some(hosts) if hosts.iter().any(|h| h == "*") => Vec::new(),
            Some(hosts) => {
                let mut out = Vec::new();
                for h in hosts {
                    let h = h.trim().to_ascii_lowercase();
                    let bracketed = h.starts_with('[') && h.ends_with(']');
                    if h.is_empty()
                        || h.contains(['/', ' ', '@'])
                        || (h.contains(':') && !bracketed)
                    {
                        return Err(err(
                            "ui.allowed_hosts",
                            format!(
                                "{h:?} is not a host name (no scheme, port or path: \"postbox.internal\")"
                            ),
                        ));
                    }
                    out.push(h);
                }
                if out.is_empty() {
                    return Err(err(
                        "ui.allowed_hosts",
                        "name at least one host, or \"*\" for any".into(),
                    ));
                }
                out
            }
            None if listen.ip().is_loopback() => {
                LOOPBACK_HOSTS.iter().map(|h| (*h).to_owned()).collect()
            }
            None => Vec::new(),
        };
        let pool_size = self.pool_size.unwrap_or(DEFAULT_UI_POOL_SIZE);
        if !(1..=16).contains(&pool_size) {
            return Err(err("ui.pool_size", "must be between 1 and 16".into()));
        }
        let statement_timeout = match &self.statement_timeout {
            None => DEFAULT_UI_STATEMENT_TIMEOUT,
            Some(t) => {
                let d = super::parse_duration(t).map_err(|e| err("ui.statement_timeout", e))?;
                if d < std::time::Duration::from_millis(100)
                    || d > std::time::Duration::from_secs(300)
                {
                    return Err(err(
                        "ui.statement_timeout",
                        "must be between 100ms and 5m".into(),
                    ));
                }
                d
            }
        };
        Ok(Some(UiSettings {
            listen,
            path_prefix,
            actions,
            token,
            show_payloads: self.show_payloads.unwrap_or(true),
            allowed_hosts,
            pool_size,
            statement_timeout,
            token_trimmed,
        }))
    }
}
