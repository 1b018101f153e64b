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
}

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
}

/// The host names of a console that listens on a loopback address.
pub const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

impl UiSettings {
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
        let token = self.token.clone();
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
        Ok(Some(UiSettings {
            listen,
            path_prefix,
            actions,
            token,
            show_payloads: self.show_payloads.unwrap_or(true),
            allowed_hosts,
        }))
    }
}
