//! An orders app: each order and its `order.created` message are written in one diesel-async
//! transaction on the app's bb8 pool, and an embedded worker (postbox's engine, sharing that
//! pool) handles the messages.
//!
//! cargo run --manifest-path examples/app/Cargo.toml -- postgres://postgres@localhost/shop
//! (the database must exist)

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use postbox::Message;
use postbox::engine::Engine;
use postbox::sink::handlers::{HandlerError, Handlers, Job};
use serde::{Deserialize, Serialize};

type Pool = bb8::Pool<AsyncDieselConnectionManager<AsyncPgConnection>>;

#[derive(Serialize, Deserialize)]
struct OrderCreated {
    order_id: i64,
    customer: String,
    total_cents: i64,
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// The app's pool, shared with postbox's engine. Its connections get postbox's session settings
/// (`postbox::store::connect::establish`): `default_transaction_isolation = 'read committed'` (the
/// claims are written for it), a `statement_timeout` of 60 s unless one is set,
/// `postbox.promotes_heads = 'caller'` (the engine's statements promote ordered keys themselves)
/// and `synchronous_commit = off` — which the app's own transactions on this pool get too: an
/// order and its message still commit together or not at all, but a crash of the server can lose
/// the last moments of commits. An app that wants its own commits synchronous gives the engine its
/// own pool instead (`Engine::builder(url)` without `.pool(..)`, the default).
async fn pool(url: &str) -> anyhow::Result<Pool> {
    let mut config = ManagerConfig::<AsyncPgConnection>::default();
    config.custom_setup = Box::new(|url| Box::pin(postbox::store::connect::establish(url)));
    let manager = AsyncDieselConnectionManager::new_with_config(url, config);
    Ok(bb8::Pool::builder().max_size(8).build(manager).await?)
}

/// The business write and its message, atomically, on a pooled connection.
async fn place_order(pool: &Pool, customer: &str, total_cents: i64) -> anyhow::Result<i64> {
    use diesel_async::RunQueryDsl;
    let mut conn = pool.get().await?;
    let order_id = conn
        .transaction::<_, anyhow::Error, _>(async |conn| {
            let order: Id = diesel::sql_query(
                "INSERT INTO shop_orders (customer, total_cents) VALUES ($1, $2) RETURNING id",
            )
            .bind::<Text, _>(customer)
            .bind::<BigInt, _>(total_cents)
            .get_result(conn)
            .await?;
            let msg = Message::new("order.created")
                .key(customer) // the customer's orders are handled one at a time, in order
                .ordered()
                .payload(&OrderCreated {
                    order_id: order.id,
                    customer: customer.to_owned(),
                    total_cents,
                });
            postbox::enqueue_async(conn, &msg).await?;
            Ok(order.id)
        })
        .await?;
    Ok(order_id)
}

/// Sends the confirmation (here: counts it). `?` works on any error: it becomes a retry.
async fn confirm(job: Job<OrderCreated>, sent: Arc<AtomicUsize>) -> Result<(), HandlerError> {
    if job.payload.total_cents < 0 {
        return Err(HandlerError::dead("negative total")); // retrying cannot fix it
    }
    let _body = serde_json::to_string(&job.payload).map_err(anyhow::Error::from)?;
    sent.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| "postgres://postgres@localhost/shop".into());
    let pool = pool(&url).await?;
    postbox::migrate_pool(&pool).await?;
    pool.get()
        .await?
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS shop_orders \
             (id bigserial PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
        )
        .await?;

    let sent = Arc::new(AtomicUsize::new(0));
    let s = sent.clone();
    let handlers = Handlers::new().on("order.created", move |job| confirm(job, s.clone()));
    let engine = Engine::builder(&url)
        .pool(pool.clone())
        .handlers(handlers)
        .build()
        .await?;
    // SIGTERM or Ctrl-C stops it gracefully (a second one at once); this demo also stops it
    // itself once every confirmation is sent.
    let stop = postbox::engine::stop_on_signals();
    let worker = tokio::spawn(engine.run_until(stop.shutdown.clone(), stop.hard_stop.clone()));

    let n = 200;
    let started = Instant::now();
    for i in 0..n {
        place_order(&pool, &format!("customer-{}", i % 20), 100 + i).await?;
    }
    while sent.load(Ordering::Relaxed) < n as usize {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "only {} of {n} confirmations sent after a minute",
            sent.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.shutdown.cancel();
    let report = worker.await??;
    println!(
        "placed {n} orders, sent {} confirmations in {:.2?} ({report:?})",
        sent.load(Ordering::Relaxed),
        started.elapsed()
    );
    Ok(())
}
