//! TLS to PostgreSQL for the async pool (rustls): `sslmode=require` encrypts, `verify-full`
//! checks the certificate chain and the host name. Runs against the local server with the
//! certificate it is configured with (Debian's default cluster: ssl on, a certificate for
//! `localhost`).

mod common;

use common::TestDb;

fn server_cert_file() -> String {
    #[derive(diesel::QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        v: String,
    }
    use diesel::RunQueryDsl;
    let db = TestDb::migrated();
    let ssl: S = diesel::sql_query("SELECT current_setting('ssl') AS v")
        .get_result(&mut db.conn())
        .unwrap();
    assert_eq!(
        ssl.v, "on",
        "the test server must have ssl = on (scripts/ensure-postgres.sh)"
    );
    let file: S = diesel::sql_query("SELECT current_setting('ssl_cert_file') AS v")
        .get_result(&mut db.conn())
        .unwrap();
    file.v
}

/// The URL of `db` on another host name, with query parameters.
fn url(db: &TestDb, host: &str, query: &str) -> String {
    let u = db.url.replacen("127.0.0.1", host, 1);
    format!("{u}?{query}")
}

async fn encrypted(store: &postbox::Store) -> bool {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct B {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        ssl: bool,
    }
    let mut c = store.pool().get().await.unwrap();
    let b: B = diesel::sql_query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .get_result(&mut c)
        .await
        .unwrap();
    b.ssl
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_encrypts_the_pool() {
    let _ = server_cert_file();
    let db = TestDb::migrated();
    let store = postbox::Store::connect(&url(&db, "127.0.0.1", "sslmode=require"), 2)
        .await
        .unwrap();
    assert!(encrypted(&store).await);
    store.stats().await.unwrap();
    let plain = postbox::Store::connect(&db.url, 2).await.unwrap();
    assert!(
        !encrypted(&plain).await,
        "the control connection should be plain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_verify_full_checks_the_chain_and_the_host_name() {
    let cert = server_cert_file();
    let db = TestDb::migrated();
    let good = url(
        &db,
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={cert}"),
    );
    let store = postbox::Store::connect(&good, 2).await.unwrap();
    assert!(encrypted(&store).await);
    // The engine's LISTEN connection goes the same way.
    postbox::store::connect::establish(&good).await.unwrap();

    // The certificate does not name 127.0.0.1.
    let wrong_host = url(
        &db,
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={cert}"),
    );
    let e = postbox::store::connect::establish(&wrong_host)
        .await
        .err()
        .expect("host name not checked");
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    // Public roots do not vouch for a local self-signed certificate.
    let e = postbox::store::connect::establish(&url(&db, "localhost", "sslmode=verify-full"))
        .await
        .err()
        .expect("chain not checked");
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_prefer_allow_and_verify_ca_mean_what_libpq_means() {
    let cert = server_cert_file();
    let db = TestDb::migrated();
    let store = |q: String| {
        let u = url(&db, "127.0.0.1", &q);
        async move { postbox::Store::connect(&u, 2).await }
    };
    // prefer: the server offers TLS, so the session is encrypted (it used to be plain).
    assert!(encrypted(&store("sslmode=prefer".into()).await.unwrap()).await);
    // allow: plain first, and the server accepts it.
    assert!(!encrypted(&store("sslmode=allow".into()).await.unwrap()).await);
    // verify-ca: the chain is checked, the host name (127.0.0.1, not in the certificate) is not.
    let ca = store(format!("sslmode=verify-ca&sslrootcert={cert}"))
        .await
        .unwrap();
    assert!(encrypted(&ca).await);
    // require with a root certificate is verify-ca (libpq's rule): the chain is checked.
    assert!(
        encrypted(
            &store(format!("sslmode=require&sslrootcert={cert}"))
                .await
                .unwrap()
        )
        .await
    );
    let e = postbox::store::connect::establish(&url(&db, "127.0.0.1", "sslmode=verify-ca"))
        .await
        .err()
        .expect("public roots do not vouch for the local certificate");
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
}
