//! The log sink: one JSON line per message on standard output (id, topic, key, headers, payload).
//! The relay's own logs go to standard error, so standard output carries only messages.

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;

use super::{Outcome, Sink, Unavailable};
use crate::store::{ClaimedMessage, Topics};

/// Writes messages to standard output from a thread of its own: a reader of standard output that
/// stalls (a full pipe) blocks that thread, never the runtime's workers (delivery timeouts,
/// heartbeats, health and shutdown go on). While a write is stuck the sink is unavailable: batches
/// go back without using attempts. A write error (closed pipe) makes it unavailable too.
#[derive(Clone)]
pub struct LogSink {
    topics: Topics,
    writer: Arc<Writer>,
    name: String,
}

impl std::fmt::Debug for LogSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogSink")
            .field("topics", &self.topics)
            .finish_non_exhaustive()
    }
}

/// One batch's text and where to answer.
type Write = (String, Arc<AtomicU8>, oneshot::Sender<std::io::Result<()>>);

/// Where a batch is: waiting for the writer thread, being written, or given up before it was.
const QUEUED: u8 = 0;
const WRITING: u8 = 1;
const CANCELLED: u8 = 2;

struct Writer {
    /// Room for one batch: a second one while the first is still being written is refused.
    tx: std::sync::mpsc::SyncSender<Write>,
}

/// How long a batch waits for standard output before the sink calls itself unavailable.
const STDOUT_STALL: Duration = Duration::from_secs(5);

impl LogSink {
    /// A log sink for `topics`.
    pub fn new(topics: Topics) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Write>(1);
        std::thread::Builder::new()
            .name("postbox-log-sink".into())
            .spawn(move || {
                for (text, state, answer) in rx {
                    // Given up while it waited: its messages were handed back, nothing written.
                    if state
                        .compare_exchange(QUEUED, WRITING, Ordering::AcqRel, Ordering::Acquire)
                        .is_err()
                    {
                        continue;
                    }
                    let mut out = std::io::stdout().lock();
                    let r = out.write_all(text.as_bytes()).and_then(|_| out.flush());
                    let _ = answer.send(r);
                }
            })
            .expect("spawn the log sink's writer thread");
        LogSink {
            topics,
            writer: Arc::new(Writer { tx }),
            name: "log".to_owned(),
        }
    }

    /// Names this sink in metrics and health (`log[N]` when several routes use the log sink).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

/// Header names whose values are credentials: printed as `<redacted>`.
fn is_secret_header(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n == "authorization"
        || n == "proxy-authorization"
        || n == "cookie"
        || n == "set-cookie"
        || ["token", "secret", "password", "api-key", "apikey"]
            .iter()
            .any(|s| n.contains(s))
}

/// One message as a JSON line (credential headers redacted).
pub fn line(m: &ClaimedMessage) -> String {
    let headers: serde_json::Map<String, serde_json::Value> = m
        .headers
        .iter()
        .map(|(k, v)| {
            let v = if is_secret_header(k) {
                "<redacted>"
            } else {
                v.as_str()
            };
            (k.clone(), serde_json::Value::from(v))
        })
        .collect();
    let id = match &m.stream_id {
        Some(s) => serde_json::Value::from(s.as_str()),
        None => serde_json::Value::from(m.id),
    };
    serde_json::json!({
        "id": id,
        "topic": m.topic,
        "key": m.key,
        "headers": headers,
        "payload": m.payload,
    })
    .to_string()
}

impl Sink for LogSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn topics(&self) -> Topics {
        self.topics.clone()
    }

    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let mut text = String::with_capacity(batch.len() * 128);
            for m in &batch {
                text.push_str(&line(m));
                text.push('\n');
            }
            let (answer, mut written) = oneshot::channel();
            let state = Arc::new(AtomicU8::new(QUEUED));
            self.writer
                .tx
                .try_send((text, state.clone(), answer))
                .map_err(|_| {
                    Unavailable::new("standard output: the previous batch is still being written (is anything reading it?)")
                })?;
            let result = match tokio::time::timeout(STDOUT_STALL, &mut written).await {
                Ok(r) => r,
                // Not started yet: given up, so it is never written (no duplicate).
                Err(_)
                    if state
                        .compare_exchange(QUEUED, CANCELLED, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok() =>
                {
                    return Err(Unavailable::new(format!(
                        "standard output: not read for {STDOUT_STALL:?}"
                    )));
                }
                // Part of it is in the pipe already: it is finished, not abandoned (the engine's
                // delivery timeout still bounds the wait).
                Err(_) => written.await,
            };
            match result {
                Ok(Ok(())) => Ok(vec![Outcome::Delivered; batch.len()]),
                Ok(Err(e)) => Err(Unavailable::new(format!("standard output: {e}"))),
                Err(_) => Err(Unavailable::new("standard output: the writer thread ended")),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn credential_headers_are_not_printed() {
        let now = chrono::Utc::now();
        let m = crate::store::ClaimedMessage {
            id: 1,
            topic: "t".into(),
            key: None,
            ordered: false,
            payload: serde_json::Value::Null,
            headers: [
                ("Authorization", "Bearer abc"),
                ("x-api-token", "t"),
                ("trace", "x"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
            priority: 0,
            run_at: now,
            attempts: 1,
            max_attempts: 1,
            created_at: now,
            locked_until: now,
            lease_token: 1,
            last_error: None,
            dedup_key: None,
            undecodable: None,
            stream_id: None,
        };
        let l = super::line(&m);
        assert!(!l.contains("abc"), "{l}");
        assert!(l.contains(r#""x-api-token":"<redacted>""#), "{l}");
        assert!(l.contains(r#""trace":"x""#), "{l}");
    }
}
