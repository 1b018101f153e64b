//! Cron schedules against a real PostgreSQL: one message per tick however many engines run the
//! schedule, one catch-up message for any number of ticks missed while every relay was down, a
//! schedule that starts at its next tick, and a redefinition that starts again.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{TestDb, eventually};
use postbox::engine::Engine;
use postbox::sink::handlers::{Handlers, Job};
use postbox::{CronSchedule, Message};
use tokio_util::sync::CancellationToken;

fn every_second(topic: &str) -> CronSchedule {
    CronSchedule::new(
        "tick",
        "* * * * * *",
        Message::new(topic).payload(&serde_json::json!({"kind": "tick"})),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_engines_running_one_schedule_enqueue_one_message_per_tick() {
    let db = TestDb::migrated();
    let ticks: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    let stop = CancellationToken::new();
    let mut engines = Vec::new();
    for _ in 0..3 {
        let ticks = ticks.clone();
        let handlers = Handlers::new().on("cron.tick", move |job: Job<serde_json::Value>| {
            let ticks = ticks.clone();
            async move {
                assert_eq!(job.payload["kind"], "tick");
                assert_eq!(job.headers["cron-schedule"], "tick");
                ticks
                    .lock()
                    .unwrap()
                    .push((job.headers["cron-tick"].clone(), job.id));
                Ok(())
            }
        });
        let e = Engine::builder(db.url.clone())
            .handlers(handlers)
            .schedule(every_second("cron.tick"))
            .build()
            .await
            .unwrap();
        engines.push(tokio::spawn(e.run(stop.clone())));
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            ticks.lock().unwrap().len() >= 5
        })
        .await,
        "five ticks delivered within 30 s"
    );
    stop.cancel();
    for e in engines {
        e.await.unwrap().unwrap();
    }
    let mut ticks = ticks.lock().unwrap().clone();
    ticks.sort();
    let mut distinct: Vec<&str> = ticks.iter().map(|(t, _)| t.as_str()).collect();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        ticks.len(),
        "every tick delivered once: {ticks:?}"
    );
    // Whole seconds, the schedule's own ticks; the row names the latest.
    for (t, _) in &ticks {
        let at = DateTime::parse_from_rfc3339(t).unwrap();
        assert_eq!(at.timestamp_subsec_nanos(), 0, "{t}");
    }
    let store = db.store().await;
    let rows = store.schedules().await.unwrap();
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(
        (row.name.as_str(), row.cron.as_str()),
        ("tick", "* * * * * *")
    );
    assert!(row.next_tick > row.last_tick.unwrap());
    let last = ticks.last().unwrap();
    assert!(
        row.last_tick.unwrap() >= DateTime::parse_from_rfc3339(&last.0).unwrap(),
        "the row's last tick is at least the last delivered"
    );
    // Ticks fired as the engines stopped are still queued: none of them repeats a delivered one.
    let queued = db.scalar(
        "SELECT count(*) AS v FROM postbox.messages WHERE topic = 'cron.tick'
         AND headers->>'cron-tick' = ANY(SELECT headers->>'cron-tick' FROM postbox.messages
                                         WHERE topic = 'cron.tick' GROUP BY 1 HAVING count(*) > 1)",
    );
    assert_eq!(queued, 0);
    for (t, _) in &ticks {
        assert_eq!(
            db.scalar(&format!(
                "SELECT count(*) AS v FROM postbox.messages WHERE headers->>'cron-tick' = '{t}'"
            )),
            0,
            "{t} was delivered and is not queued again"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_fires_of_a_due_tick_enqueue_it_once() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let s = CronSchedule::new("minutely", "* * * * *", Message::new("m")).unwrap();
    let first = store.fire(&s).await.unwrap();
    assert_eq!(first.fired, None, "a new schedule starts at its next tick");
    assert!(first.next_tick > first.now);
    // Make its tick due now, then fire from eight connections at once: the messages table is
    // locked against inserts until all eight are waiting, so every fire is in flight together.
    db.exec("UPDATE postbox.schedules SET next_tick = now() - interval '1 second'");
    let mut locker = db.conn();
    diesel::connection::SimpleConnection::batch_execute(
        &mut locker,
        "BEGIN; LOCK TABLE postbox.messages IN SHARE ROW EXCLUSIVE MODE",
    )
    .unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (store, s) = (store.clone(), s.clone());
            tokio::spawn(async move { store.fire(&s).await })
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(20), || async {
            db.scalar(&format!(
                "SELECT count(*) AS v FROM pg_stat_activity
                 WHERE datname = '{}' AND wait_event_type = 'Lock'",
                db.name
            )) == 8
        })
        .await,
        "eight fires waiting"
    );
    diesel::connection::SimpleConnection::batch_execute(&mut locker, "COMMIT").unwrap();
    let mut fires = Vec::new();
    for t in tasks {
        fires.push(t.await.unwrap());
    }
    let fired: Vec<_> = fires
        .iter()
        .map(|f| f.as_ref().unwrap())
        .filter_map(|f| f.fired)
        .collect();
    assert_eq!(fired.len(), 1, "{fires:?}");
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'm'"),
        1
    );
    let (tick, id) = fired[0];
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND dedup_key = 'schedule:minutely:{}'",
            id.unwrap(),
            tick.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        )),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ticks_missed_while_every_relay_was_down_give_one_catch_up_message() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let s = CronSchedule::new("minutely", "* * * * *", Message::new("m").key("k")).unwrap();
    store.fire(&s).await.unwrap();
    // Every relay down for three hours: 180 ticks missed.
    db.exec(
        "UPDATE postbox.schedules SET next_tick = date_trunc('minute', now()) - interval '3 hours'",
    );
    let f = store.fire(&s).await.unwrap();
    let (tick, _) = f.fired.expect("one catch-up tick");
    assert!(
        f.now - tick < chrono::Duration::minutes(1),
        "the latest tick missed: {tick}"
    );
    assert_eq!(tick.timestamp() % 60, 0);
    assert!(f.next_tick > f.now);
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'm'"),
        1,
        "one message, not a flood"
    );
    let again = store.fire(&s).await.unwrap();
    assert_eq!(again.fired, None);
    assert_eq!(again.last_tick, Some(tick));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redefined_schedule_starts_again_at_its_next_tick() {
    let db = TestDb::migrated();
    let store = db.store().await;
    let hourly = CronSchedule::new("report", "0 * * * *", Message::new("r")).unwrap();
    store.fire(&hourly).await.unwrap();
    db.exec("UPDATE postbox.schedules SET next_tick = now() - interval '1 minute'");
    // Before the due tick fires, a relay brings a new definition: it starts from its own next tick.
    let daily = CronSchedule::new("report", "0 3 * * *", Message::new("r"))
        .unwrap()
        .timezone("Europe/Berlin")
        .unwrap();
    let f = store.fire(&daily).await.unwrap();
    assert_eq!(f.fired, None);
    assert_eq!(Some(f.next_tick), daily.next_after(f.now));
    let rows = store.schedules().await.unwrap();
    assert_eq!(
        (rows[0].cron.as_str(), rows[0].timezone.as_str()),
        ("0 3 * * *", "Europe/Berlin")
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS v FROM postbox.messages WHERE topic = 'r'"),
        0
    );
    let _: Option<DateTime<Utc>> = rows[0].last_tick;
}

#[tokio::test]
async fn two_schedules_of_one_name_in_one_engine_are_refused() {
    let db = TestDb::migrated();
    let r = Engine::builder(db.url.clone())
        .handlers(Handlers::new().on("x", |_: Job<serde_json::Value>| async { Ok(()) }))
        .schedule(every_second("x"))
        .schedule(every_second("y"))
        .build()
        .await;
    match r {
        Err(postbox::Error::InvalidArgument {
            field: "schedules", ..
        }) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    }
}
