//! The log sink: one JSON line per message on standard output (id, topic, key, headers, payload).
//! The relay's own logs go to standard error, so standard output carries only messages.

use std::io::Write;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;

use super::{Outcome, Sink, Unavailable};
use crate::store::{ClaimedMessage, Topics};

/// Writes messages to standard output; a write error (closed pipe) makes the sink unavailable.
#[derive(Debug, Clone)]
pub struct LogSink {
    topics: Topics,
}

impl LogSink {
    /// A log sink for `topics`.
    pub fn new(topics: Topics) -> Self {
        LogSink { topics }
    }
}

/// One message as a JSON line.
pub fn line(m: &ClaimedMessage) -> String {
    serde_json::json!({
        "id": m.id,
        "topic": m.topic,
        "key": m.key,
        "headers": m.headers,
        "payload": m.payload,
    })
    .to_string()
}

impl Sink for LogSink {
    fn name(&self) -> &str {
        "log"
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
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())
                .and_then(|_| out.flush())
                .map_err(|e| Unavailable::new(format!("standard output: {e}")))?;
            Ok(vec![Outcome::Delivered; batch.len()])
        }
        .boxed()
    }
}
