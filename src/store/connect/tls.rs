//! TLS to PostgreSQL for the async connections (rustls), as the URL's `sslmode` asks.

use std::sync::Arc;

use diesel::{ConnectionError, ConnectionResult};
use diesel_async::AsyncPgConnection;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

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
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain is checked as for verify-full, the host name is not.
#[derive(Debug)]
struct AnyHostName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        cert: &CertificateDer<'_>,
        chain: &[CertificateDer<'_>],
        name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(cert, chain, name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(m, c, d)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(m, c, d)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

fn roots(root_cert: Option<&str>) -> ConnectionResult<RootCertStore> {
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
    Ok(roots)
}

fn client_config(mode: &TlsMode) -> ConnectionResult<ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(bad)?;
    Ok(match mode {
        TlsMode::Allow | TlsMode::Prefer | TlsMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCert(provider)))
            .with_no_client_auth(),
        TlsMode::VerifyCa { root_cert } => {
            let verifier = WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots(root_cert.as_deref())?),
                provider,
            )
            .build()
            .map_err(bad)?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyHostName(verifier)))
                .with_no_client_auth()
        }
        TlsMode::VerifyFull { root_cert } => builder
            .with_root_certificates(roots(root_cert.as_deref())?)
            .with_no_client_auth(),
        TlsMode::Off => unreachable!("plain connections do not come here"),
    })
}

/// A plain connection, as diesel-async makes one, but its error says the cause ("error
/// connecting to server: Connection refused"), not only that it failed.
pub(super) async fn plain(url: &str) -> ConnectionResult<AsyncPgConnection> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| chain(&e))?;
    AsyncPgConnection::try_from_client_and_connection(client, connection).await
}

pub(super) async fn establish(url: &str, mode: TlsMode) -> ConnectionResult<AsyncPgConnection> {
    let mut config: tokio_postgres::Config = url.parse().map_err(bad)?;
    // Prefer: TLS if the server offers it, else plain (tokio-postgres falls back itself).
    config.ssl_mode(match mode {
        TlsMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    let tls = tokio_postgres_rustls::MakeRustlsConnect::new(client_config(&mode)?);
    let (client, connection) = config.connect(tls).await.map_err(|e| chain(&e))?;
    AsyncPgConnection::try_from_client_and_connection(client, connection).await
}
