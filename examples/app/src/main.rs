//! An orders app: each order and its `order.created` message are written in one diesel-async
//! transaction on the app's bb8 pool, and an embedded worker (postbox's engine) handles the
//! messages. Least privilege, with two pools: the app's transactions run as a writer role
//! (`shop_app`: its own tables, and enqueue), the engine as a relay role (`shop_worker`: claims,
//! settles, upkeep); the owner's URL only migrates and grants.
//!
//! cargo run --manifest-path examples/app/Cargo.toml -- postgres://postgres@localhost/shop
//! (the database must exist; the owner's URL. `APP_DATABASE_URL` and `WORKER_DATABASE_URL` name
//! the two roles' URLs; without them, this demo creates the roles as the owner and logs in as them
//! with the owner's URL otherwise, as a server with trust or peer authentication allows)

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
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

/// The app's pool: plain diesel-async connections of the app's writer role.
async fn pool(url: &str) -> anyhow::Result<Pool> {
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(url);
    Ok(bb8::Pool::builder().max_size(8).build(manager).await?)
}

/// The URL of `role`: from the environment, or the owner's with the role as user (the demo).
fn role_url(owner_url: &str, var: &str, role: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        let (scheme, rest) = owner_url
            .split_once("://")
            .unwrap_or(("postgres", owner_url));
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{role}@{host}")
    })
}

/// As the owner: postbox's schema, the app's table, and the two roles' rights (what
/// `postbox grant --writer shop_app --relay shop_worker` does, plus the app's own table).
async fn set_up(owner_url: &str) -> anyhow::Result<()> {
    use postbox::store::grant::RoleKind;
    let owner = AsyncPgConnection::establish(owner_url).await?;
    let (_, mut owner) = postbox::migrate_async(owner).await?;
    owner
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS shop_orders \
             (id bigserial PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
        )
        .await?;
    if std::env::var("APP_DATABASE_URL").is_err() {
        let store = postbox::Store::connect(owner_url, 1).await?;
        store.grant(RoleKind::Writer, "shop_app").await?;
        store.grant(RoleKind::Relay, "shop_worker").await?;
        owner
            .batch_execute(
                "ALTER ROLE shop_app LOGIN; ALTER ROLE shop_worker LOGIN;
                 GRANT SELECT, INSERT ON shop_orders TO shop_app;
                 GRANT USAGE ON SEQUENCE shop_orders_id_seq TO shop_app",
            )
            .await?;
    }
    Ok(())
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
    set_up(&url).await?;
    let app_url = role_url(&url, "APP_DATABASE_URL", "shop_app");
    let worker_url = role_url(&url, "WORKER_DATABASE_URL", "shop_worker");
    let pool = pool(&app_url).await?;
    // The app's writer, migrating at start as apps do: nothing pending, so nothing to do.
    postbox::migrate_pool(&pool).await?;

    let sent = Arc::new(AtomicUsize::new(0));
    let s = sent.clone();
    let handlers = Handlers::new().on("order.created", move |job| confirm(job, s.clone()));
    // The engine's own pool, as the relay role (`build()` checks its rights).
    let engine = Engine::builder(&worker_url)
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
