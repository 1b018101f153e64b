//! An app that creates orders and their `order.created` messages in one diesel transaction, with
//! an embedded worker (the engine with in-process handlers) that handles them.
//!
//! cargo run --release --example orders [-- DATABASE_URL]
//! (default postgres://postgres@localhost/postbox; the database is created if missing)

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use postbox::Message;
use postbox::engine::Engine;
use postbox::sink::handlers::{HandlerError, Handlers, Job};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

diesel::table! {
    shop_orders (id) {
        id -> Int8,
        customer -> Text,
        total_cents -> Int8,
    }
}

#[derive(Serialize, Deserialize, Debug)]
struct OrderCreated {
    order_id: i64,
    customer: String,
    total_cents: i64,
}

/// The business write and its message, atomically.
fn create_order(
    conn: &mut PgConnection,
    customer: &str,
    total_cents: i64,
) -> Result<i64, postbox::Error> {
    conn.transaction(|conn| {
        let order_id: i64 = diesel::insert_into(shop_orders::table)
            .values((
                shop_orders::customer.eq(customer),
                shop_orders::total_cents.eq(total_cents),
            ))
            .returning(shop_orders::id)
            .get_result(conn)?;
        let event = OrderCreated {
            order_id,
            customer: customer.to_owned(),
            total_cents,
        };
        postbox::enqueue(
            conn,
            &Message::new("order.created")
                .payload(&event)
                .key(customer) // one customer's orders are handled in order
                .ordered()
                .header("source", "examples/orders"),
        )?;
        Ok(order_id)
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| "postgres://postgres@localhost/postbox".into());
    ensure_database(&url)?;
    let mut conn = PgConnection::establish(&url)?;
    postbox::migrate(&mut conn)?;
    conn.batch_execute(
        "CREATE TABLE IF NOT EXISTS shop_orders (id bigserial PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
    )?;

    // The embedded worker.
    let handled = Arc::new(AtomicUsize::new(0));
    let h = handled.clone();
    let handlers = Handlers::new().on("order.created", move |job: Job<OrderCreated>| {
        let h = h.clone();
        async move {
            if job.payload.total_cents < 0 {
                return Err(HandlerError::dead("negative total")); // retrying cannot fix it
            }
            // ... send the confirmation e-mail, update the search index ...
            h.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    });
    let engine = Engine::builder(&url).handlers(handlers).build().await?;
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(engine.run(shutdown.clone()));

    let n = 1_000;
    let started = Instant::now();
    let writer = tokio::task::spawn_blocking(move || -> Result<(), postbox::Error> {
        for i in 0..n {
            create_order(&mut conn, &format!("customer-{}", i % 50), 100 + i)?;
        }
        Ok(())
    });
    writer.await??;
    while handled.load(Ordering::Relaxed) < n as usize
        && started.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    let report = worker.await??;
    println!(
        "created {n} orders and handled {} order.created messages in {:.2?} ({report:?})",
        handled.load(Ordering::Relaxed),
        started.elapsed()
    );
    Ok(())
}

fn ensure_database(url: &str) -> Result<(), Box<dyn std::error::Error>> {
    if PgConnection::establish(url).is_ok() {
        return Ok(());
    }
    let (server, name) = url
        .rsplit_once('/')
        .ok_or("database URL has no database name")?;
    let mut admin = PgConnection::establish(&format!("{server}/postgres"))?;
    admin.batch_execute(&format!(
        "CREATE DATABASE \"{}\"",
        name.replace('"', "\"\"")
    ))?;
    Ok(())
}
