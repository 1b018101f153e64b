//! The replication connection's settings, read from the relay's `database_url` (the same URL and
//! `sslmode` semantics as its other connections).

use std::time::Duration;

use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};

use crate::store::connect::{TlsMode, tls_mode};

/// How soon a delivered batch's position reaches the server, at most: a status update goes out
/// at most this often while the stream moves (a hundred a second), so what a killed relay had
/// delivered and is streamed again is the batches in flight and this much more.
pub const CONFIRM_EVERY: Duration = Duration::from_millis(10);

/// A replication session of `slot` and `publication` on the database `url` names.
pub fn replication_config(
    url: &str,
    slot: &str,
    publication: &str,
    status_interval: Duration,
    buffer_events: usize,
) -> Result<ReplicationConfig, String> {
    let with_env = std::env::var("PGSSLMODE")
        .ok()
        .filter(|m| !m.is_empty() && !url.contains("sslmode"))
        .map(|m| {
            let sep = if url.contains('?') { '&' } else { '?' };
            format!("{url}{sep}sslmode={m}")
        })
        .unwrap_or_else(|| url.to_owned());
    let (mode, rest) = tls_mode(&with_env)?;
    let parsed = url::Url::parse(&rest)
        .map_err(|e| format!("stream mode needs database_url as a postgres:// URL: {e}"))?;
    let decode = |s: &str| {
        url::form_urlencoded::parse(format!("x={s}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    let mut host = parsed.host_str().unwrap_or("").to_owned();
    let mut port = parsed.port().unwrap_or(5432);
    for (k, v) in parsed.query_pairs() {
        match &*k {
            "host" => host = v.into_owned(),
            "port" => port = v.parse().map_err(|_| format!("port={v} is not a port"))?,
            _ => {}
        }
    }
    if host.is_empty() {
        host = "/var/run/postgresql".into();
    }
    let user = match parsed.username() {
        "" => std::env::var("PGUSER").unwrap_or_else(|_| "postgres".into()),
        u => decode(u),
    };
    let password = parsed
        .password()
        .map(decode)
        .or_else(|| std::env::var("PGPASSWORD").ok())
        .unwrap_or_default();
    let database = decode(parsed.path().trim_start_matches('/'));
    if database.is_empty() {
        return Err("stream mode needs database_url to name its database".into());
    }
    let tls = match mode {
        TlsMode::Off | TlsMode::Allow => TlsConfig::disabled(),
        TlsMode::Prefer => TlsConfig {
            mode: SslMode::Prefer,
            ..TlsConfig::disabled()
        },
        TlsMode::Require => TlsConfig::require(),
        TlsMode::VerifyCa { root_cert } => TlsConfig::verify_ca(root_cert.map(Into::into)),
        TlsMode::VerifyFull { root_cert } => TlsConfig::verify_full(root_cert.map(Into::into)),
    };
    let mut cfg = ReplicationConfig::new(host, user, password, database, slot, publication)
        .with_port(port)
        .with_tls(tls)
        // Confirmations as soon as a batch is delivered (at a bounded rate); `status_interval`
        // paces the updates of an idle session.
        .with_status_interval(status_interval.min(CONFIRM_EVERY))
        .with_wakeup_interval(status_interval)
        .with_buffer_size(buffer_events)
        .with_application_name("postbox-stream")
        // Observed so that a stopping relay can tell when its last confirmation reached the
        // server (`feedback_pending_since`).
        .with_feedback_observer(pgwire_replication::FeedbackObserver::new(|_| {}));
    if cfg.host.starts_with('/') {
        cfg.tls = TlsConfig::disabled();
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_gives_host_port_credentials_database_and_tls() {
        let c = replication_config(
            "postgres://app%40x:p%2Fw@db.example:6543/orders?sslmode=verify-full",
            "s",
            "p",
            Duration::from_secs(1),
            10,
        )
        .unwrap();
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.user.as_str(),
                c.password.as_str()
            ),
            ("db.example", 6543, "app@x", "p/w")
        );
        assert_eq!(c.database, "orders");
        assert_eq!(c.tls.mode, SslMode::VerifyFull);
        let c =
            replication_config("postgres://u@h/db", "s", "p", Duration::from_secs(1), 10).unwrap();
        assert_eq!(c.tls.mode, SslMode::Disable);
        assert!(
            replication_config("postgres://u@h/", "s", "p", Duration::from_secs(1), 10).is_err()
        );
    }
}
