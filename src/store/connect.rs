//! Opening connections for the store and the notifier, with TLS when the URL asks for it.

use diesel::{ConnectionError, ConnectionResult};
#[cfg(not(feature = "tls"))]
use diesel_async::AsyncConnection;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};

/// Session settings of the store's own connections.
///
/// `synchronous_commit = off`: the store's transactions (claim, complete, retry, dead-letter,
/// release) do not wait for their commit record to reach disk. Delivery is at least once, so a
/// crash that loses the last few of them loses nothing: a lost claim leaves the message pending, a
/// lost completion or retry leaves it leased until its lease expires and it is delivered again.
/// The enqueue, which must be durable, runs in the app's transaction on the app's connection.
/// `jit = off`: the store's statements are short, and the planner settings some of them take
/// (`enable_seqscan = off`) put a plan's cost past `jit_above_cost`, whose compile then costs more
/// than the statement (the depth sample's exact count: 335 ms with JIT, 49 ms without, on a table
/// a pinned horizon had grown to 52 MB).
/// Every relay and engine session runs READ COMMITTED whatever the server's or role's default: a
/// claim under a running limit and an ordered key's promotion must see the commits they waited for.
/// A statement that runs longer than [`STATEMENT_TIMEOUT`] (a claim waiting on a migration's lock
/// of the table) is ended by the server, so no engine task waits on one for ever; a timeout the
/// role, database or URL (`options=-c statement_timeout=…`) sets is kept. In a `SQL_ASCII`
/// database, text is read as stored (client encoding `SQL_ASCII`): converting it to UTF-8 fails the
/// whole statement on one row that is not UTF-8, where reading it as bytes lets the store
/// dead-letter that row alone.
const SESSION: &str = "SET synchronous_commit = off; SET jit = off; SET application_name = 'postbox'; SET postbox.promotes_heads = 'caller'; SET default_transaction_isolation = 'read committed'; SELECT set_config('statement_timeout', '60s', false) WHERE current_setting('statement_timeout') IN ('0', '0ms'); SELECT set_config('client_encoding', 'SQL_ASCII', false) WHERE current_setting('server_encoding') = 'SQL_ASCII'";

/// The server-side limit on one statement of the store's connections, unless the session has one.
pub const STATEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Network settings every async connection gets unless its URL sets them: a connect that gets no
/// answer gives up; a connection whose peer vanished without a reset (a NAT or firewall that
/// dropped it) is found dead by TCP keepalives while idle, and by the TCP user timeout while data
/// it sent goes unacknowledged. Seconds, as tokio-postgres reads them.
const NETWORK_DEFAULTS: [(&str, &str); 5] = [
    ("connect_timeout", "10"),
    ("keepalives_idle", "30"),
    ("keepalives_interval", "10"),
    ("keepalives_retries", "3"),
    ("tcp_user_timeout", "60"),
];

/// `url` with [`NETWORK_DEFAULTS`] for the parameters it does not set (URL form only).
fn with_network_defaults(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return url.to_owned();
    };
    let set: Vec<String> = parsed.query_pairs().map(|(k, _)| k.into_owned()).collect();
    let missing: Vec<_> = NETWORK_DEFAULTS
        .iter()
        .filter(|(k, _)| !set.iter().any(|s| s == k))
        .collect();
    if missing.is_empty() {
        return url.to_owned();
    }
    parsed.query_pairs_mut().extend_pairs(missing);
    spaces_as_percent(parsed)
}

/// `url` as a string whose query writes a space as `%20`: rewriting a query (above) encodes one
/// as `+`, which the PostgreSQL client reads as a `+` (`options=-c lock_timeout=200` would reach
/// the server as `-c+lock_timeout=200`, and the connection be refused). A `+` of the value itself
/// was encoded as `%2B`: every `+` left is a space.
fn spaces_as_percent(url: url::Url) -> String {
    match url.query() {
        Some(q) if q.contains('+') => {
            let q = q.replace('+', "%20");
            let mut url = url;
            url.set_query(Some(&q));
            url.into()
        }
        _ => url.into(),
    }
}

/// How the URL asks for TLS (`sslmode`), as libpq means it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsMode {
    /// No `sslmode` (the async side does not negotiate TLS unless asked), or `disable`: plain TCP.
    Off,
    /// `allow`: plain TCP; TLS (certificate not checked) if the server refuses a plain session.
    Allow,
    /// `prefer`: TLS (certificate not checked) if the server offers it, else plain TCP.
    Prefer,
    /// `require` without `sslrootcert`: encrypted, the server's certificate is not checked.
    Require,
    /// `verify-ca`, or `require` with `sslrootcert` (libpq's rule): encrypted, the certificate
    /// chains to `sslrootcert` (a PEM file) or to the public web roots; the host name is not checked.
    VerifyCa {
        /// `sslrootcert`: a PEM file of the roots to trust.
        root_cert: Option<String>,
    },
    /// `verify-full`: as `verify-ca`, and the certificate names the host.
    VerifyFull {
        /// `sslrootcert`: a PEM file of the roots to trust.
        root_cert: Option<String>,
    },
}

/// Reads `sslmode` and `sslrootcert` from a `postgres://` URL (query values percent-decoded) and
/// returns the URL without them. A `key=value` connection string is passed on as it is (plain
/// TCP): TLS options need the URL form.
pub fn tls_mode(url: &str) -> Result<(TlsMode, String), String> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return match url.contains("sslmode") {
            false => Ok((TlsMode::Off, url.to_owned())),
            true => Err("sslmode needs the URL form postgres://…?sslmode=…".to_owned()),
        };
    }
    let mut parsed = url::Url::parse(url).map_err(|e| format!("not a PostgreSQL URL: {e}"))?;
    let (mut mode, mut root) = (None, None);
    let mut rest = Vec::new();
    for (k, v) in parsed.query_pairs() {
        match &*k {
            "sslmode" => mode = Some(v.into_owned()),
            "sslrootcert" => root = Some(v.into_owned()),
            _ => rest.push((k.into_owned(), v.into_owned())),
        }
    }
    if rest.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(&rest);
    }
    let mode = match mode.as_deref() {
        None | Some("disable") => TlsMode::Off,
        Some("allow") => TlsMode::Allow,
        Some("prefer") => TlsMode::Prefer,
        Some("require") if root.is_none() => TlsMode::Require,
        Some("require" | "verify-ca") => TlsMode::VerifyCa { root_cert: root },
        Some("verify-full") => TlsMode::VerifyFull { root_cert: root },
        Some(other) => {
            return Err(format!(
                "sslmode={other} is not one of disable, allow, prefer, require, verify-ca, verify-full"
            ));
        }
    };
    Ok((mode, spaces_as_percent(parsed)))
}

/// `url` with `sslmode` from the environment's `PGSSLMODE` (as libpq reads it) when the URL has
/// none.
fn with_sslmode_from_env(url: &str) -> String {
    match std::env::var("PGSSLMODE") {
        Ok(mode) if !mode.is_empty() => add_sslmode(url, &mode),
        _ => url.to_owned(),
    }
}

fn add_sslmode(url: &str, mode: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return url.to_owned();
    };
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://"))
        || parsed.query_pairs().any(|(k, _)| k == "sslmode")
    {
        return url.to_owned();
    }
    parsed.query_pairs_mut().append_pair("sslmode", mode);
    spaces_as_percent(parsed)
}

/// Opens one connection, over TLS when the URL's `sslmode` asks for it.
pub async fn open(url: &str) -> ConnectionResult<AsyncPgConnection> {
    let (mode, stripped) =
        tls_mode(&with_sslmode_from_env(url)).map_err(ConnectionError::BadConnection)?;
    let stripped = with_network_defaults(&stripped);
    match mode {
        #[cfg(feature = "tls")]
        TlsMode::Off => tls::plain(&stripped).await,
        #[cfg(not(feature = "tls"))]
        TlsMode::Off => AsyncPgConnection::establish(&stripped).await,
        #[cfg(feature = "tls")]
        TlsMode::Allow => match tls::plain(&stripped).await {
            Ok(c) => Ok(c),
            Err(_) => tls::establish(&stripped, TlsMode::Require).await,
        },
        #[cfg(feature = "tls")]
        tls => tls::establish(&stripped, tls).await,
        #[cfg(not(feature = "tls"))]
        _ => Err(ConnectionError::BadConnection(
            "TLS (sslmode) needs postbox's `tls` feature".into(),
        )),
    }
}

/// [`open`], then the store's session settings.
pub async fn establish(url: &str) -> ConnectionResult<AsyncPgConnection> {
    let mut conn = open(url).await?;
    conn.batch_execute(SESSION)
        .await
        .map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
    Ok(conn)
}

#[cfg(feature = "tls")]
mod tls;

#[cfg(feature = "async")]
impl super::Store {
    /// What a connection of this store's pool lacks of the store's session settings, each with what
    /// goes wrong without it (empty when it has them; a pool built with [`establish`] as its
    /// manager's `custom_setup` has them all). `fatal` when one breaks the engine's promises
    /// rather than its speed.
    pub async fn missing_session_settings(&self) -> crate::Result<(Vec<String>, bool)> {
        use diesel::QueryableByName;
        use diesel_async::RunQueryDsl;
        #[derive(QueryableByName)]
        struct Settings {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            read_committed: bool,
            #[diesel(sql_type = diesel::sql_types::Bool)]
            promotes: bool,
            #[diesel(sql_type = diesel::sql_types::Bool)]
            timeout: bool,
        }
        let s: Settings = diesel::sql_query(
            "SELECT current_setting('default_transaction_isolation') = 'read committed' AS read_committed,
                    current_setting('postbox.promotes_heads', true) IS NOT DISTINCT FROM 'caller' AS promotes,
                    current_setting('statement_timeout') NOT IN ('0', '0ms') AS timeout",
        )
        .get_result(&mut *self.conn().await?)
        .await?;
        let mut missing = Vec::new();
        if !s.read_committed {
            missing.push("default_transaction_isolation = 'read committed' (without it a claim under a running limit fails, and an ordered key's promotion may not see the commit it waited for)".to_owned());
        }
        if !s.promotes {
            missing.push("postbox.promotes_heads = 'caller' (without it each settle of an ordered message promotes its key's next message twice: in a trigger, then again in the engine's own statement)".to_owned());
        }
        if !s.timeout {
            missing.push("a statement_timeout (without one a claim waiting on a lock of the table, a migration's, waits for ever)".to_owned());
        }
        Ok((missing, !s.read_committed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_defaults_fill_what_the_url_leaves_out() {
        assert_eq!(
            with_network_defaults("postgres://h/db?keepalives_idle=5"),
            "postgres://h/db?keepalives_idle=5&connect_timeout=10&keepalives_interval=10&keepalives_retries=3&tcp_user_timeout=60"
        );
        assert_eq!(
            with_network_defaults("host=h dbname=db"),
            "host=h dbname=db"
        );
    }

    #[test]
    fn a_space_in_an_option_stays_a_space_when_the_query_is_rewritten() {
        // As the server must read it: `-c lock_timeout=200`, a `+` of a value kept as `%2B`.
        assert_eq!(
            with_network_defaults(
                "postgres://h/db?options=-c%20lock_timeout%3D200&application_name=a%2Bb"
            ),
            "postgres://h/db?options=-c%20lock_timeout%3D200&application_name=a%2Bb&connect_timeout=10&keepalives_idle=30&keepalives_interval=10&keepalives_retries=3&tcp_user_timeout=60"
        );
        assert_eq!(
            tls_mode("postgres://h/db?sslmode=disable&options=-c%20x%3D1").unwrap(),
            (TlsMode::Off, "postgres://h/db?options=-c%20x%3D1".into())
        );
    }

    #[test]
    fn pgsslmode_applies_when_the_url_has_no_sslmode() {
        assert_eq!(
            add_sslmode("postgres://h/db", "require"),
            "postgres://h/db?sslmode=require"
        );
        assert_eq!(
            add_sslmode("postgres://h/db?sslmode=disable", "require"),
            "postgres://h/db?sslmode=disable"
        );
        assert_eq!(add_sslmode("host=h", "require"), "host=h");
    }

    #[test]
    fn sslmode_is_read_and_stripped() {
        assert_eq!(
            tls_mode("postgres://h/db").unwrap(),
            (TlsMode::Off, "postgres://h/db".into())
        );
        assert_eq!(
            tls_mode("postgres://h/db?sslmode=require&application_name=x").unwrap(),
            (
                TlsMode::Require,
                "postgres://h/db?application_name=x".into()
            )
        );
        assert_eq!(
            tls_mode("postgres://h/db?sslmode=verify-full&sslrootcert=/ca.pem").unwrap(),
            (
                TlsMode::VerifyFull {
                    root_cert: Some("/ca.pem".into())
                },
                "postgres://h/db".into()
            )
        );
        for (mode, want) in [
            ("disable", TlsMode::Off),
            ("allow", TlsMode::Allow),
            ("prefer", TlsMode::Prefer),
            ("verify-ca", TlsMode::VerifyCa { root_cert: None }),
        ] {
            assert_eq!(
                tls_mode(&format!("postgres://h/db?sslmode={mode}"))
                    .unwrap()
                    .0,
                want
            );
        }
        // libpq: require with a root certificate verifies the chain.
        assert_eq!(
            tls_mode("postgres://h/db?sslmode=require&sslrootcert=%2Fetc%2Fca.pem")
                .unwrap()
                .0,
            TlsMode::VerifyCa {
                root_cert: Some("/etc/ca.pem".into())
            }
        );
        assert!(tls_mode("postgres://h/db?sslmode=sometimes").is_err());
        // Percent-encoded credentials pass through untouched.
        assert_eq!(
            tls_mode("postgres://u:p%40ss%2Fw@h:5433/db?sslmode=disable")
                .unwrap()
                .1,
            "postgres://u:p%40ss%2Fw@h:5433/db"
        );
        assert_eq!(
            tls_mode("host=h dbname=db").unwrap(),
            (TlsMode::Off, "host=h dbname=db".into())
        );
        assert!(tls_mode("host=h sslmode=require").is_err());
    }
}
