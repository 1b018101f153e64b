//! Test harness: every test gets a database of its own, copied from a migrated template, so tests
//! run in parallel against a real PostgreSQL.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::{Connection, PgConnection, RunQueryDsl};

#[cfg(feature = "kafka")]
pub mod broker;
pub mod proxy;
pub mod relay;
pub mod scram_front;
pub mod webdriver;

/// Server to test against: `POSTBOX_TEST_DATABASE_URL` (without a database name), or the local
/// default.
pub fn server_url() -> String {
    std::env::var("POSTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
        .trim_end_matches('/')
        .to_owned()
}

/// A command for a binary of this crate (the relay) with an environment of its own: nothing of the
/// caller's (`DATABASE_URL`, `POSTBOX_*`, …) reaches it but `PATH`; a test sets what it should read.
pub fn hermetic(bin: &str) -> std::process::Command {
    let mut c = std::process::Command::new(bin);
    c.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        c.env("PATH", path);
    }
    c
}

fn admin() -> PgConnection {
    PgConnection::establish(&format!("{}/postgres", server_url()))
        .expect("PostgreSQL must be running (see docs/src/contributing/tests.md)")
}

/// Name of the template for the migrations the crate embeds: a new one whenever they change.
/// (Named after what the binary carries, not the files: a run started before a migration was
/// edited would otherwise build the new files' template from the old embedded SQL.)
fn template_name() -> String {
    format!("postbox_tpl_{}", postbox::MIGRATIONS_DIGEST)
}

fn ensure_template(admin: &mut PgConnection) -> String {
    let name = template_name();
    diesel::sql_query("SELECT pg_advisory_lock(4242001)")
        .execute(admin)
        .unwrap();
    if !database_exists(admin, &name) {
        let building = format!("{name}_building");
        diesel::sql_query(format!("DROP DATABASE IF EXISTS {building} WITH (FORCE)"))
            .execute(admin)
            .unwrap();
        diesel::sql_query(format!("CREATE DATABASE {building}"))
            .execute(admin)
            .unwrap();
        {
            let mut c = PgConnection::establish(&format!("{}/{building}", server_url())).unwrap();
            postbox::migrate(&mut c).unwrap();
        }
        diesel::sql_query(format!("ALTER DATABASE {building} RENAME TO {name}"))
            .execute(admin)
            .unwrap();
    }
    diesel::sql_query("SELECT pg_advisory_unlock(4242001)")
        .execute(admin)
        .unwrap();
    name
}

fn database_exists(conn: &mut PgConnection, name: &str) -> bool {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let r: N = diesel::sql_query("SELECT count(*) AS n FROM pg_database WHERE datname = $1")
        .bind::<diesel::sql_types::Text, _>(name)
        .get_result(conn)
        .unwrap();
    r.n > 0
}

/// A database that exists for one test and is dropped after it.
pub struct TestDb {
    pub name: String,
    pub url: String,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

impl TestDb {
    fn fresh_name() -> String {
        format!(
            "postbox_t_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            fastrand::u32(..)
        )
    }

    /// A database with postbox's migrations applied.
    pub fn migrated() -> TestDb {
        let mut admin = admin();
        let template = ensure_template(&mut admin);
        let name = Self::fresh_name();
        let mut tries = 0;
        loop {
            match diesel::sql_query(format!("CREATE DATABASE {name} TEMPLATE {template}"))
                .execute(&mut admin)
            {
                Ok(_) => break,
                // Another test may be copying the same template this instant.
                Err(e) if tries < 50 && e.to_string().contains("being accessed") => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20 + fastrand::u64(..40)));
                }
                Err(e) => panic!("create test database: {e}"),
            }
        }
        TestDb {
            url: format!("{}/{name}", server_url()),
            name,
        }
    }

    /// A migrated database with this server encoding (`SQL_ASCII`: text is stored as given, not
    /// checked to be UTF-8).
    pub fn migrated_with_encoding(encoding: &str) -> TestDb {
        let name = Self::fresh_name();
        diesel::sql_query(format!(
            "CREATE DATABASE {name} ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        ))
        .execute(&mut admin())
        .unwrap();
        let db = TestDb {
            url: format!("{}/{name}", server_url()),
            name,
        };
        postbox::migrate(&mut db.conn()).unwrap();
        db
    }

    /// An empty database (for migration tests).
    pub fn empty() -> TestDb {
        let name = Self::fresh_name();
        diesel::sql_query(format!("CREATE DATABASE {name}"))
            .execute(&mut admin())
            .unwrap();
        TestDb {
            url: format!("{}/{name}", server_url()),
            name,
        }
    }

    pub fn conn(&self) -> PgConnection {
        PgConnection::establish(&self.url).unwrap()
    }

    #[cfg(feature = "async")]
    pub async fn aconn(&self) -> diesel_async::AsyncPgConnection {
        use diesel_async::AsyncConnection;
        diesel_async::AsyncPgConnection::establish(&self.url)
            .await
            .unwrap()
    }

    #[cfg(feature = "async")]
    pub async fn store(&self) -> postbox::Store {
        postbox::Store::connect(&self.url, 16).await.unwrap()
    }

    /// Runs one SQL statement that returns a single bigint (for assertions).
    pub fn scalar(&self, sql: &str) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct V {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            v: i64,
        }
        let r: V = diesel::sql_query(sql).get_result(&mut self.conn()).unwrap();
        r.v
    }

    /// Runs one SQL statement that returns a single text `v` (for assertions and messages).
    #[allow(dead_code)]
    pub fn text(&self, sql: &str) -> String {
        #[derive(diesel::QueryableByName)]
        struct V {
            #[diesel(sql_type = diesel::sql_types::Text)]
            v: String,
        }
        let r: V = diesel::sql_query(sql).get_result(&mut self.conn()).unwrap();
        r.v
    }

    pub fn exec(&self, sql: &str) {
        use diesel::connection::SimpleConnection;
        self.conn().batch_execute(sql).unwrap();
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Ok(mut a) = PgConnection::establish(&format!("{}/postgres", server_url())) {
            let _ = diesel::sql_query(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .execute(&mut a);
        }
    }
}

/// Moves what writers committed to `postbox.intake` (unordered messages without a dedup key)
/// into `postbox.messages`, as a relay does before it claims: for a test that reads
/// `postbox.messages` after an enqueue. Returns how many were moved.
#[allow(dead_code)]
pub fn move_intake(db: &TestDb) -> i64 {
    db.scalar("SELECT coalesce(sum(moved), 0)::bigint AS v FROM postbox.move_intake(1000000, NULL)")
}

/// Enqueues `msgs` in one call on a connection of its own; their ids.
pub fn enqueue(db: &TestDb, msgs: Vec<postbox::Message>) -> Vec<i64> {
    postbox::enqueue_many(&mut db.conn(), &msgs)
        .unwrap()
        .into_iter()
        .map(|e| e.id().unwrap())
        .collect()
}

/// Polls `check` until it returns true or `deadline` passes; returns whether it became true.
pub async fn eventually<F, Fut>(deadline: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + deadline;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A port of 127.0.0.1 nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET path` on 127.0.0.1:`port`: the status code and the body, or None if nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    Some((
        code,
        buf.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    ))
}

/// Chaos ledger: creates `public.produced`, where [`ledger_writer`] records each message id in the
/// same transaction as the message.
pub fn create_ledger(db: &TestDb) {
    db.exec("CREATE TABLE public.produced (id bigint PRIMARY KEY)");
}

/// Writes messages of `topic` until `stop`, each with its id in `public.produced` in the same
/// transaction (a transaction that fails is not counted), reconnecting after failures. Returns the
/// commits it saw.
pub fn ledger_writer(
    url: String,
    topic: &'static str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut conn = PgConnection::establish(&url).unwrap();
        let mut committed = 0;
        while !stop.load(Ordering::Acquire) {
            let r = conn.transaction::<_, postbox::Error, _>(|c| {
                let e = postbox::enqueue(c, &postbox::Message::new(topic))?;
                let id = e.id().expect("no dedup key: always a new message");
                diesel::sql_query(format!("INSERT INTO public.produced (id) VALUES ({id})"))
                    .execute(c)?;
                Ok(())
            });
            match r {
                Ok(()) => committed += 1,
                Err(_) => {
                    if let Ok(c) = PgConnection::establish(&url) {
                        conn = c;
                    }
                }
            }
        }
        committed
    })
}

#[derive(diesel::QueryableByName)]
struct LedgerId {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

fn ledger_ids(conn: &mut PgConnection, sql: &str) -> std::collections::HashSet<i64> {
    diesel::sql_query(sql)
        .load::<LedgerId>(conn)
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// What the ledger shows, given each delivered id with its delivery count: (produced, lost,
/// duplicates, dead). lost = produced − delivered − still queued − dead.
pub fn ledger(
    db: &TestDb,
    delivered: &std::collections::HashMap<i64, u32>,
) -> (usize, Vec<i64>, u32, usize) {
    let mut conn = db.conn();
    let produced = ledger_ids(&mut conn, "SELECT id FROM public.produced");
    let queued = ledger_ids(&mut conn, "SELECT id FROM postbox.messages");
    let dead = ledger_ids(&mut conn, "SELECT id FROM postbox.dead_letters");
    let lost: Vec<i64> = produced
        .iter()
        .filter(|id| !delivered.contains_key(id) && !queued.contains(id) && !dead.contains(id))
        .copied()
        .collect();
    let duplicates = delivered.values().map(|n| n - 1).sum();
    (produced.len(), lost, duplicates, dead.len())
}

/// A PostgreSQL server of a test's own (initdb in a temporary directory, trust auth, a free port),
/// for faults that would disturb every other test on the shared server: a restart, connection
/// exhaustion. Stopped and removed when dropped. Run as root, the server runs as user postgres.
pub struct OwnServer {
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
    pub port: u16,
    settings: Vec<String>,
}

impl OwnServer {
    /// Initialises and starts a server with `settings` (`name=value`).
    pub fn start(settings: &[&str]) -> OwnServer {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL's server binaries in /usr/lib/postgresql")
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("bin"))
            .filter(|p| p.join("initdb").exists())
            .max()
            .expect("an initdb under /usr/lib/postgresql/*/bin");
        let dir = std::env::temp_dir().join(format!(
            "postbox-pg-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let server = OwnServer {
            dir,
            bin,
            port,
            settings: settings.iter().map(|s| s.to_string()).collect(),
        };
        if Self::root() {
            let ok = std::process::Command::new("chown")
                .args(["postgres:postgres", server.dir.to_str().unwrap()])
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let data = server.dir.join("data");
        server.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        server.start_again();
        server
    }

    /// Whether this process runs as root (`/proc/self` belongs to the effective user).
    fn root() -> bool {
        std::fs::metadata("/proc/self")
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
            .unwrap_or(false)
    }

    /// `tool` of the server's binaries, run as user postgres when this process is root.
    fn command(&self, tool: &str) -> std::process::Command {
        let path = self.bin.join(tool);
        if Self::root() {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            std::process::Command::new(path)
        }
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = self.command(tool).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{tool} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the (stopped) server and waits until it accepts connections.
    pub fn start_again(&self) {
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off",
            self.port,
            self.dir.display()
        );
        for s in &self.settings {
            options.push_str(&format!(" -c {s}"));
        }
        let data = self.dir.join("data");
        let log = self.dir.join("log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-o",
                &options,
                "start",
            ],
        );
    }

    /// Stops the server: `fast` (sessions are terminated, as on an orderly restart) or `immediate`.
    pub fn stop(&self, mode: &str) {
        let data = self.dir.join("data");
        self.run(
            "pg_ctl",
            &["-D", data.to_str().unwrap(), "-m", mode, "-w", "stop"],
        );
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The server's data directory (stop the server before copying or replacing it).
    pub fn data_dir(&self) -> std::path::PathBuf {
        self.dir.join("data")
    }

    /// A database on this server with postbox's migrations applied.
    pub fn migrated(&self) -> TestDb {
        let mut admin = PgConnection::establish(&self.url("postgres")).unwrap();
        diesel::sql_query("CREATE DATABASE postbox")
            .execute(&mut admin)
            .unwrap();
        let url = self.url("postbox");
        postbox::migrate(&mut PgConnection::establish(&url).unwrap()).unwrap();
        // The name is not a database of the shared server: dropping this TestDb there is a no-op.
        TestDb {
            name: format!("postbox_own_{}_{}", std::process::id(), self.port),
            url,
        }
    }

    /// [`OwnServer::migrated`] with stream mode set up (slot `postbox`, publication
    /// `postbox_stream`); the server must run with `wal_level = logical`.
    #[cfg(feature = "async")]
    pub async fn stream_db(&self) -> TestDb {
        let db = self.migrated();
        db.store()
            .await
            .stream_setup("postbox", "postbox_stream")
            .await
            .unwrap();
        db
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = self
            .command("pg_ctl")
            .args([
                "-D",
                data.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Index entries of `postbox.messages` read by `sql` (and by the functions it calls), run in a
/// transaction that is rolled back: the index statistics before and after, flushed at once.
pub fn index_entries_read(db: &TestDb, sql: &str) -> i64 {
    use diesel::connection::SimpleConnection;
    use diesel::{QueryableByName, RunQueryDsl};
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        v: i64,
    }
    let mut conn = db.conn();
    let read = |conn: &mut diesel::PgConnection| {
        // The previous statement's counters reach the statistics when the session goes idle.
        conn.batch_execute("SELECT pg_stat_force_next_flush()")
            .unwrap();
        conn.batch_execute("SELECT pg_stat_clear_snapshot()")
            .unwrap();
        diesel::sql_query(
            "SELECT coalesce(sum(idx_tup_read), 0)::bigint AS v FROM pg_stat_user_indexes
             WHERE schemaname = 'postbox' AND relname = 'messages'",
        )
        .get_result::<V>(conn)
        .unwrap()
        .v
    };
    let before = read(&mut conn);
    conn.batch_execute(&format!("BEGIN; {sql}; ROLLBACK"))
        .unwrap();
    read(&mut conn) - before
}
