//! Opening connections for the store and the notifier, with TLS when the URL asks for it.

use diesel::{ConnectionError, ConnectionResult};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

/// Session settings of the store's own connections.
///
/// `synchronous_commit = off`: the store's transactions (claim, complete, retry, dead-letter,
/// release) do not wait for their commit record to reach disk. Delivery is at least once, so a
/// crash that loses the last few of them loses nothing: a lost claim leaves the message pending, a
/// lost completion or retry leaves it leased until its lease expires and it is delivered again.
/// The enqueue, which must be durable, runs in the app's transaction on the app's connection.
const SESSION: &str = "SET synchronous_commit = off; SET application_name = 'postbox'; SET postbox.promotes_heads = 'caller'";

/// How the URL asks for TLS (`sslmode`), the libpq way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsMode {
    /// No `sslmode`, or `disable` / `allow` / `prefer`: plain TCP (as the sync side's default).
    Off,
    /// `require`: encrypted, the server's certificate is not checked.
    Require,
    /// `verify-full`: encrypted, the certificate chains to `sslrootcert` (a PEM file) or to the
    /// public web roots, and names the host.
    VerifyFull { root_cert: Option<String> },
}

/// Reads `sslmode` and `sslrootcert` from the URL and returns the URL without them.
pub fn tls_mode(url: &str) -> Result<(TlsMode, String), String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((TlsMode::Off, url.to_owned()));
    };
    let mut mode = None;
    let mut root = None;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("sslmode", v)) => mode = Some(v.to_owned()),
            Some(("sslrootcert", v)) => root = Some(v.to_owned()),
            _ => rest.push(pair),
        }
    }
    let stripped = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    let mode = match mode.as_deref() {
        None | Some("disable" | "allow" | "prefer") => TlsMode::Off,
        Some("require") => TlsMode::Require,
        Some("verify-full") => TlsMode::VerifyFull { root_cert: root },
        Some(other) => {
            return Err(format!(
                "sslmode={other} is not supported here (use require or verify-full)"
            ));
        }
    };
    Ok((mode, stripped))
}

/// Opens one connection, over TLS when the URL's `sslmode` asks for it.
pub async fn open(url: &str) -> ConnectionResult<AsyncPgConnection> {
    let (mode, stripped) = tls_mode(url).map_err(ConnectionError::BadConnection)?;
    match mode {
        TlsMode::Off => AsyncPgConnection::establish(&stripped).await,
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
mod tls {
    use std::sync::Arc;

    use diesel::{ConnectionError, ConnectionResult};
    use diesel_async::AsyncPgConnection;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject};
    use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

    use super::TlsMode;

    fn bad(e: impl std::fmt::Display) -> ConnectionError {
        ConnectionError::BadConnection(e.to_string())
    }

    /// The error and its causes ("error performing TLS handshake: invalid peer certificate: ...").
    fn chain(e: &(dyn std::error::Error + 'static)) -> ConnectionError {
        let mut text = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            text.push_str(": ");
            text.push_str(&c.to_string());
            cause = c.source();
        }
        ConnectionError::BadConnection(text)
    }

    /// `sslmode=require`: encryption without checking who answers (libpq's meaning).
    #[derive(Debug)]
    struct AcceptAnyCert(Arc<rustls::crypto::CryptoProvider>);

    impl ServerCertVerifier for AcceptAnyCert {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                m,
                c,
                d,
                &self.0.signature_verification_algorithms,
            )
        }
        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                m,
                c,
                d,
                &self.0.signature_verification_algorithms,
            )
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    fn client_config(mode: &TlsMode) -> ConnectionResult<ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(bad)?;
        Ok(match mode {
            TlsMode::Require => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AcceptAnyCert(provider)))
                .with_no_client_auth(),
            TlsMode::VerifyFull { root_cert } => {
                let mut roots = RootCertStore::empty();
                match root_cert {
                    Some(path) => {
                        for cert in CertificateDer::pem_file_iter(path)
                            .map_err(|e| bad(format!("sslrootcert {path}: {e}")))?
                        {
                            roots
                                .add(cert.map_err(|e| bad(format!("sslrootcert {path}: {e}")))?)
                                .map_err(|e| bad(format!("sslrootcert {path}: {e}")))?;
                        }
                    }
                    None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
                }
                builder.with_root_certificates(roots).with_no_client_auth()
            }
            TlsMode::Off => unreachable!("plain connections do not come here"),
        })
    }

    pub(super) async fn establish(url: &str, mode: TlsMode) -> ConnectionResult<AsyncPgConnection> {
        let mut config: tokio_postgres::Config = url.parse().map_err(bad)?;
        config.ssl_mode(tokio_postgres::config::SslMode::Require);
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(client_config(&mode)?);
        let (client, connection) = config.connect(tls).await.map_err(|e| chain(&e))?;
        AsyncPgConnection::try_from_client_and_connection(client, connection).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(tls_mode("postgres://h/db?sslmode=verify-ca").is_err());
    }
}
