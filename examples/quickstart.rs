//! The smallest round trip: an order and its message written in one diesel transaction, then
//! claimed and acknowledged through the store.
//!
//! cargo run --release --example quickstart [-- DATABASE_URL]
//! (default postgres://postgres@localhost/postbox; the database is created if missing)

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use postbox::{Message, Store, Topics};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| "postgres://postgres@localhost/postbox".into());
    ensure_database(&url)?;

    let mut conn = PgConnection::establish(&url)?;
    postbox::migrate(&mut conn)?;
    conn.batch_execute(
        "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, total_cents bigint NOT NULL)",
    )?;

    // The business write and the message commit together, or not at all.
    let enqueued = conn.transaction(|conn| {
        conn.batch_execute("INSERT INTO orders (total_cents) VALUES (4200)")?;
        postbox::enqueue(
            conn,
            &Message::new("order.created")
                .payload(&serde_json::json!({"total_cents": 4200}))
                .key("customer-7"),
        )
    })?;
    println!("enqueued: {enqueued:?}");

    let store = Store::connect(&url, 4).await?;
    let claimed = store
        .claim(100, Duration::from_secs(30), &Topics::all())
        .await?;
    for m in &claimed {
        println!(
            "claimed #{} {} {} (attempt {})",
            m.id, m.topic, m.payload, m.attempts
        );
    }
    let leases: Vec<_> = claimed.iter().map(|m| m.lease()).collect();
    let done = store.complete(&leases).await?;
    println!(
        "acknowledged {} message(s); queue: {:?}",
        done.done.len(),
        store.stats().await?.topics
    );
    Ok(())
}

/// Creates the database named in `url` if it does not exist yet.
fn ensure_database(url: &str) -> Result<(), Box<dyn std::error::Error>> {
    if PgConnection::establish(url).is_ok() {
        return Ok(());
    }
    let (server, name) = url
        .rsplit_once('/')
        .ok_or("database URL has no database name")?;
    let name = name.split('?').next().unwrap_or(name);
    let mut admin = PgConnection::establish(&format!("{server}/postgres"))?;
    admin.batch_execute(&format!(
        "CREATE DATABASE \"{}\"",
        name.replace('"', "\"\"")
    ))?;
    Ok(())
}
