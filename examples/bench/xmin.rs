//! `--only xmin`: a pinned xmin horizon at a fixed offered rate.
//!
//! On a PostgreSQL cluster of its own, started here with autovacuum on as production runs it
//! (`autovacuum_naptime` 1 min; the machine's shared server runs with autovacuum off) and fsync
//! off (the disk is not what is measured), logging the plan of every statement slower than 250 ms
//! and each autovacuum run (kept in `target/bench-xmin-server.log`): writers enqueue `--rate` messages a second (default
//! 800; 4 connections, each message its own transaction), the embedded engine drains them (every
//! topic, a no-op handler), and after 2 clean minutes a `REPEATABLE READ` transaction holds its
//! snapshot for `--pin-minutes` (default 10), then rolls back; 3 minutes follow. With
//! `--xmin-topics N` the messages go to N topics in turn, each with a handler of its own (an
//! engine claiming topics named exactly), and the claim measured is that of the N topics. With
//! `--xmin-glob` as well, one sink serves them through the glob `bench.xmin.*` (a relay's route
//! of a pattern), and the claim measured is that of the glob; no take is measured (the engine
//! takes the glob from its floors as it claims it).
//!
//! Every minute: e2e latency (the writer's clock before its commit → the handler) p50 and p99,
//! the cost of one claim of 100 of its topic as the engine's store runs it (from its floors; the median of
//! samples every 10 s, time and buffers, from `Store::explain_claim_as_run`, which leaves out the walks from the front), the same for the take of a
//! held batch of 100 (`Store::explain_hold`, what the engine runs while there is a backlog), the table's dead tuples
//! and size, and the depth. Then the ratios: p99 and claim cost of the last pinned minute
//! against the clean minutes, and how long after the release p99 was back within 2× clean.
//!
//! With `POSTBOX_BENCH_XMIN_TRACE` set: the clean minutes and the pinned ones (`--pin-minutes 0`:
//! the clean minutes only), none after; every message's life traced by
//! triggers of the bench's cluster (written to the intake, moved, made available, claimed,
//! deleted: each event's time and its transaction's commit time, `track_commit_timestamp`), and
//! every claim's floors (given, kept, left, taken ids); the 40 slowest messages are printed, the
//! events and the handler's times left in `/tmp/xmin-trace.csv`, `/tmp/xmin-floor.csv` and
//! `/tmp/xmin-handled.csv`. This is how a delay between two stages is found.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use postbox::engine::Engine;
use postbox::sink::handlers::{Handlers, Job};
use postbox::sink::{Outcome, Sink, Unavailable};
use postbox::{Message, Topics};
use tokio_util::sync::CancellationToken;

use super::{median, percentile};

const CLEAN_MINUTES: u64 = 2;
const AFTER_MINUTES: u64 = 3;
const WRITERS: u64 = 4;

/// A cluster of this bench's own, removed when dropped.
struct Cluster {
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
    port: u16,
}

fn root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

impl Cluster {
    fn tool(&self, name: &str) -> std::process::Command {
        let path = self.bin.join(name);
        if root() {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            std::process::Command::new(path)
        }
    }

    fn run(&self, name: &str, args: &[&str]) {
        let out = self.tool(name).args(args).output().expect(name);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn start() -> Cluster {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL's server binaries under /usr/lib/postgresql")
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("bin"))
            .filter(|p| p.join("initdb").exists())
            .max()
            .expect("an initdb under /usr/lib/postgresql/*/bin");
        let dir = std::env::temp_dir().join(format!("postbox-bench-xmin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        if root() {
            let ok = std::process::Command::new("chown")
                .args(["postgres:postgres", dir.to_str().unwrap()])
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let c = Cluster { dir, bin, port };
        let data = c.dir.join("data");
        let data = data.to_str().unwrap();
        c.run(
            "initdb",
            &["-D", data, "-U", "postgres", "--auth=trust", "--no-sync"],
        );
        // Plans of statements slower than this are logged (`POSTBOX_BENCH_EXPLAIN_MS`, 250 ms).
        let explain_ms: u64 = std::env::var("POSTBOX_BENCH_EXPLAIN_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(250);
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off \
             -c autovacuum=on -c autovacuum_naptime=60 -c shared_buffers=256MB -c max_connections=100 \
             -c session_preload_libraries=auto_explain -c auto_explain.log_min_duration={explain_ms} \
             -c auto_explain.log_nested_statements=on -c auto_explain.log_buffers=on \
             -c auto_explain.log_analyze=on -c auto_explain.log_timing=off \
             -c log_autovacuum_min_duration=0 -c track_commit_timestamp=on",
            c.port,
            c.dir.to_str().unwrap()
        );
        let log = c.dir.join("log");
        c.run(
            "pg_ctl",
            &[
                "-D",
                data,
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
            ],
        );
        c
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The server's log (the plans of statements slower than 250 ms, autovacuum's runs) is
        // kept beside the build for a look afterwards.
        let kept = std::path::Path::new("target/bench-xmin-server.log");
        if std::fs::copy(self.dir.join("log"), kept).is_ok() {
            eprintln!("xmin: the server's log is in {}", kept.display());
        }
        let data = self.dir.join("data");
        let _ = self
            .tool("pg_ctl")
            .args(["-D", data.to_str().unwrap(), "-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn micros_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

#[derive(QueryableByName)]
struct Table {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    dead: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    bytes: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    depth: i64,
}

const TABLE: &str = "SELECT coalesce((SELECT n_dead_tup FROM pg_stat_user_tables
                                      WHERE relid = 'postbox.messages'::regclass), 0) AS dead,
                            pg_total_relation_size('postbox.messages') AS bytes,
                            (SELECT count(*) FROM postbox.messages WHERE state = 'available') AS depth";

/// Time (ms) and buffers of the first EXPLAIN in `plan` (the whole claim).
fn claim_cost(plan: &str) -> (f64, f64) {
    let buffers = plan
        .lines()
        .find(|l| l.trim_start().starts_with("Buffers:"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.split_once('='))
                .filter(|(k, _)| matches!(*k, "hit" | "read"))
                .filter_map(|(_, v)| v.parse::<f64>().ok())
                .sum()
        })
        .unwrap_or(0.0);
    let ms = plan
        .lines()
        .find_map(|l| l.trim().strip_prefix("Execution Time: "))
        .and_then(|v| v.trim_end_matches(" ms").parse().ok())
        .unwrap_or(0.0);
    (ms, buffers)
}

/// One minute's figures.
struct Minute {
    phase: &'static str,
    p50: f64,
    p99: f64,
    claim_ms: f64,
    claim_buffers: f64,
    take_ms: f64,
    take_buffers: f64,
}

/// The sink of `--xmin-glob`: every topic of the glob, each message's latency recorded.
struct GlobSink {
    seen: Arc<Mutex<Vec<f64>>>,
    count: Arc<AtomicU64>,
}

impl Sink for GlobSink {
    fn name(&self) -> &str {
        "log"
    }
    fn topics(&self) -> Topics {
        Topics::only([GLOB])
    }
    fn deliver(
        &self,
        batch: Vec<postbox::ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let now = micros_now();
            let mut seen = self.seen.lock().unwrap();
            for m in &batch {
                seen.push((now - m.payload["t"].as_i64().unwrap_or(0)) as f64 / 1000.0);
            }
            self.count.fetch_add(batch.len() as u64, Ordering::Relaxed);
            Ok(vec![Outcome::Delivered; batch.len()])
        }
        .boxed()
    }
}

const GLOB: &str = "bench.xmin.*";

pub async fn run(rate: u64, pin_minutes: u64, topics: usize, glob: bool) {
    // One topic, or several (an engine with as many handlers, the writers taking them in turn).
    let names: Vec<String> = if topics <= 1 {
        vec!["bench.xmin".to_owned()]
    } else {
        (0..topics).map(|i| format!("bench.xmin.{i}")).collect()
    };
    let cluster = Cluster::start();
    let url = cluster.url();
    postbox::migrate(&mut PgConnection::establish(&url).unwrap()).unwrap();
    let trace = std::env::var_os("POSTBOX_BENCH_XMIN_TRACE").is_some();
    if trace {
        PgConnection::establish(&url)
            .unwrap()
            .batch_execute(TRACE_SETUP)
            .unwrap();
    }
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let delivered = Arc::new(AtomicU64::new(0));
    let produced = Arc::new(AtomicU64::new(0));
    let seen = latencies.clone();
    let count = delivered.clone();
    let handled: Arc<Mutex<Vec<(i64, i64)>>> = Arc::default();
    let mut handlers = Handlers::new();
    for name in &names {
        let (seen, count, handled) = (seen.clone(), count.clone(), handled.clone());
        handlers = handlers.on(name, move |job: Job<serde_json::Value>| {
            let now = micros_now();
            let ms = (now - job.payload["t"].as_i64().unwrap_or(0)) as f64 / 1000.0;
            seen.lock().unwrap().push(ms);
            handled.lock().unwrap().push((job.id, now));
            count.fetch_add(1, Ordering::Relaxed);
            async { Ok(()) }
        });
    }
    let builder = Engine::builder(url.clone());
    let builder = if glob {
        builder.sink(GlobSink {
            seen: seen.clone(),
            count: count.clone(),
        })
    } else {
        builder.handlers(handlers)
    };
    let engine = builder.build().await.unwrap();
    let claimed = if glob {
        Topics::only([GLOB])
    } else {
        Topics::only(names.iter())
    };
    let store = engine.store().clone();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(engine.run(shutdown.clone()));

    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (url, stop, produced) = (url.clone(), stop.clone(), produced.clone());
        let names = names.clone();
        writers.push(tokio::spawn(async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            let every = Duration::from_secs_f64(WRITERS as f64 / rate as f64);
            let mut next = tokio::time::Instant::now();
            let mut turn = w as usize;
            while !stop.load(Ordering::Relaxed) {
                next += every;
                tokio::time::sleep_until(next).await;
                turn += 1;
                let m = Message::new(&names[turn % names.len()])
                    .payload(&serde_json::json!({"t": micros_now()}));
                postbox::enqueue_async(&mut conn, &m).await.unwrap();
                produced.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }

    let total = if trace {
        (CLEAN_MINUTES + pin_minutes).max(1)
    } else {
        CLEAN_MINUTES + pin_minutes + AFTER_MINUTES
    };
    let mut pin: Option<PgConnection> = None;
    let mut stats = PgConnection::establish(&url).unwrap();
    let mut minutes: Vec<Minute> = Vec::new();
    println!(
        "xmin: {rate}/s offered over {} topic(s){}, {CLEAN_MINUTES} min clean, {pin_minutes} min pinned (a REPEATABLE READ snapshot), {AFTER_MINUTES} min after; own cluster, autovacuum on (naptime 1 min), fsync off",
        names.len(),
        if glob { " claimed as one glob" } else { "" }
    );
    println!(
        "minute phase   e2e_p50_ms e2e_p99_ms claim_ms claim_buffers take_ms take_buffers dead_tuples table_mb depth"
    );
    let started = Instant::now();
    for minute in 0..total {
        let phase = if minute < CLEAN_MINUTES {
            "clean"
        } else if minute < CLEAN_MINUTES + pin_minutes {
            "pinned"
        } else {
            "after"
        };
        if phase == "pinned" && pin.is_none() {
            let mut c = PgConnection::establish(&url).unwrap();
            c.batch_execute(
                "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM postbox.turns",
            )
            .unwrap();
            pin = Some(c);
        }
        if phase == "after"
            && let Some(mut c) = pin.take()
        {
            c.batch_execute("ROLLBACK").unwrap();
        }
        let mut samples = Vec::new();
        for _ in 0..6 {
            let end = started
                + Duration::from_secs(minute * 60)
                + Duration::from_secs(10 * (samples.len() as u64 + 1));
            tokio::time::sleep_until(end.into()).await;
            let plan = store.explain_claim_as_run(100, &claimed).await.unwrap();
            // And the take of a held batch (what the engine runs while there is a backlog).
            // (Not with a glob: the engine never takes the first topic by name, so that take
            // would walk from the front; a glob's take is the claim's walk, locking.)
            let held = if glob {
                (f64::NAN, f64::NAN)
            } else {
                claim_cost(&store.explain_hold(&names[0], 100, 0).await.unwrap())
            };
            samples.push((claim_cost(&plan), held));
        }
        let mut lat = std::mem::take(&mut *latencies.lock().unwrap());
        lat.sort_by(|a, b| a.total_cmp(b));
        let t: Table = diesel::sql_query(TABLE).get_result(&mut stats).unwrap();
        let m = Minute {
            phase,
            p50: percentile(&lat, 0.50),
            p99: percentile(&lat, 0.99),
            claim_ms: median(&samples.iter().map(|s| s.0.0).collect::<Vec<_>>()),
            claim_buffers: median(&samples.iter().map(|s| s.0.1).collect::<Vec<_>>()),
            take_ms: median(&samples.iter().map(|s| s.1.0).collect::<Vec<_>>()),
            take_buffers: median(&samples.iter().map(|s| s.1.1).collect::<Vec<_>>()),
        };
        println!(
            "{:>6} {:<7} {:>10.1} {:>10.1} {:>8.2} {:>13.0} {:>7.2} {:>12.0} {:>11} {:>8.1} {:>5}",
            minute + 1,
            m.phase,
            m.p50,
            m.p99,
            m.claim_ms,
            m.claim_buffers,
            m.take_ms,
            m.take_buffers,
            t.dead,
            t.bytes as f64 / 1048576.0,
            t.depth
        );
        minutes.push(m);
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while delivered.load(Ordering::Relaxed) < produced.load(Ordering::Relaxed)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    running.await.unwrap().unwrap();
    if trace {
        report_trace(&mut stats, &handled.lock().unwrap());
        return;
    }

    let of = |phase: &str| {
        minutes
            .iter()
            .filter(|m| m.phase == phase)
            .collect::<Vec<_>>()
    };
    let clean = of("clean");
    let clean_p99 = median(&clean.iter().map(|m| m.p99).collect::<Vec<_>>());
    let clean_ms = median(&clean.iter().map(|m| m.claim_ms).collect::<Vec<_>>());
    let clean_buffers = median(&clean.iter().map(|m| m.claim_buffers).collect::<Vec<_>>());
    let clean_take = median(&clean.iter().map(|m| m.take_buffers).collect::<Vec<_>>());
    let last = of("pinned").pop().expect("a pinned minute");
    let back = of("after")
        .iter()
        .position(|m| m.p99 <= 2.0 * clean_p99)
        .map(|i| (i + 1) as f64)
        .unwrap_or(f64::NAN);
    let lost = produced.load(Ordering::Relaxed) as i64 - delivered.load(Ordering::Relaxed) as i64;
    println!("xmin_p99_ratio={:.2}", last.p99 / clean_p99);
    // The last minute can hide a stall in the middle of the pin.
    let worst = of("pinned").iter().map(|m| m.p99).fold(0.0, f64::max);
    println!(
        "xmin_p99_ratio_worst_pinned_minute={:.2}",
        worst / clean_p99
    );
    println!("xmin_claim_ms_ratio={:.2}", last.claim_ms / clean_ms);
    println!(
        "xmin_claim_buffers_ratio={:.2}",
        last.claim_buffers / clean_buffers
    );
    println!(
        "xmin_take_buffers_ratio={:.2}",
        last.take_buffers / clean_take
    );
    println!("xmin_recovered_within_minutes={back}");
    println!("xmin_produced={}", produced.load(Ordering::Relaxed));
    println!("xmin_not_delivered={lost}");
    drop(cluster);
}

/// `POSTBOX_BENCH_XMIN_TRACE`: what happened to each message, by the server's commit timestamps
/// (`track_commit_timestamp`): written (the writer's insert and its commit), moved (the mover's
/// insert into postbox.messages and its commit), claimed (the update to running and its commit).
const TRACE_SETUP: &str = "
CREATE UNLOGGED TABLE public.trace (id bigint, ev \"char\", at timestamptz DEFAULT clock_timestamp(), x xid8 DEFAULT pg_current_xact_id());
CREATE FUNCTION public.trace_w() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.trace (id, ev) VALUES (NEW.id, TG_ARGV[0]); RETURN NULL; END $$;
CREATE TRIGGER trace_w AFTER INSERT ON postbox.intake FOR EACH ROW EXECUTE FUNCTION public.trace_w('w');
CREATE TRIGGER trace_m AFTER INSERT ON postbox.messages FOR EACH ROW EXECUTE FUNCTION public.trace_w('m');
CREATE UNLOGGED TABLE public.trace_floor (at timestamptz, pid int, x xid8, given text, had text, snap text, left_ text, ids bigint[]);
DO $d$ DECLARE d text; BEGIN
  d := pg_get_functiondef('postbox.claim_ready(text,integer,double precision,bigint,text,text)'::regprocedure);
  d := replace(d, 'PERFORM set_config(v_setting,', 'INSERT INTO public.trace_floor VALUES (clock_timestamp(), pg_backend_pid(), pg_current_xact_id_if_assigned(), p_floors, current_setting(v_setting, true), v_snap::text, pg_snapshot_xmax(v_snap)::text || '';'' || array_to_string(v_running, '','') || '';'' || array_to_string(v_out, '',''), v_ids); PERFORM set_config(v_setting,');
  EXECUTE d;
END $d$;
CREATE TRIGGER trace_c AFTER UPDATE ON postbox.messages FOR EACH ROW WHEN (NEW.state = 'running' AND OLD.state <> 'running') EXECUTE FUNCTION public.trace_w('c');
CREATE TRIGGER trace_a AFTER UPDATE ON postbox.messages FOR EACH ROW WHEN (NEW.state = 'available') EXECUTE FUNCTION public.trace_w('a');
CREATE FUNCTION public.trace_d() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.trace (id, ev) VALUES (OLD.id, 'd'); RETURN NULL; END $$;
CREATE TRIGGER trace_d AFTER DELETE ON postbox.messages FOR EACH ROW EXECUTE FUNCTION public.trace_d();
";

#[derive(QueryableByName)]
struct Traced {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    line: String,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    committed_us: i64,
}

fn report_trace(conn: &mut PgConnection, handled: &[(i64, i64)]) {
    // Kept for a closer look: the server writes the events, this the handler's times.
    conn.batch_execute(
        "COPY (SELECT id, ev, (extract(epoch FROM at) * 1000000)::bigint, x,
                      (extract(epoch FROM pg_xact_commit_timestamp(xid(x))) * 1000000)::bigint
               FROM public.trace) TO '/tmp/xmin-trace.csv' CSV;
         COPY (SELECT (extract(epoch FROM at) * 1000000)::bigint, pid, x, given, had, snap, left_, ids FROM public.trace_floor) TO '/tmp/xmin-floor.csv' CSV",
    )
    .unwrap();
    let csv: String = handled
        .iter()
        .map(|(id, at)| format!("{id},{at}\n"))
        .collect();
    std::fs::write("/tmp/xmin-handled.csv", csv).unwrap();
    let rows: Vec<Traced> = diesel::sql_query(
        "SELECT id, string_agg(ev::text || ' at+' || round(extract(epoch FROM at - first) * 1000, 1)
                                || ' commit+' || coalesce(round(extract(epoch FROM pg_xact_commit_timestamp(xid(x)) - first) * 1000, 1)::text, '?')
                                || ' x' || x, ' | ' ORDER BY at) AS line,
                (extract(epoch FROM min(first)) * 1000000)::bigint AS committed_us
         FROM (SELECT t.*, min(at) OVER (PARTITION BY id) AS first FROM public.trace t) s
         GROUP BY id",
    )
    .load(conn)
    .unwrap();
    let by_id: std::collections::HashMap<i64, &Traced> = rows.iter().map(|r| (r.id, r)).collect();
    let mut lat: Vec<(i64, i64)> = handled
        .iter()
        .filter_map(|(id, at)| by_id.get(id).map(|r| (at - r.committed_us, *id)))
        .collect();
    lat.sort();
    println!(
        "trace: {} messages; slowest 40 (ms from the first event to the handler):",
        lat.len()
    );
    for (us, id) in lat.iter().rev().take(40) {
        println!("{:>8.1} id {id}: {}", *us as f64 / 1000.0, by_id[id].line);
    }
}
