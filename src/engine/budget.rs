//! The payload budget: how many bytes of claimed messages a relay keeps in memory at once. A
//! count of messages does not bound memory (500 messages of 500 KB are 250 MB); claims and holds
//! take fewer messages when messages are large, so that what is in flight stays within the
//! budget. One budget is shared by every engine (route) of a relay.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

use crate::store::ClaimedMessage;

/// Bytes of claimed messages in flight per relay unless configured (`relay.payload_budget`).
pub const DEFAULT_PAYLOAD_BUDGET: usize = 64 << 20;

/// Before any message was claimed, a claim takes at most this many (each assumed to weigh this
/// share of the budget): the first claim learns what messages weigh, and the estimate then
/// follows what claims bring.
const FIRST_CLAIM: usize = 1;

/// The bytes in flight, and what the next messages are expected to weigh.
#[derive(Debug)]
pub struct PayloadBudget {
    limit: usize,
    in_flight: AtomicUsize,
    /// The largest message of the last claim, or seven eighths of the previous estimate if that
    /// is more: a burst of large messages is taken for one, and the estimate comes down over a
    /// few claims after it.
    estimate: AtomicUsize,
    /// Whether a claim brought messages yet (the first estimate is a guess, replaced outright).
    learned: std::sync::atomic::AtomicBool,
    freed: Notify,
}

/// Bytes held by a batch in flight; given back to the budget when dropped (the batch is settled).
#[derive(Debug)]
pub struct Charge {
    budget: Arc<PayloadBudget>,
    bytes: usize,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget
            .in_flight
            .fetch_sub(self.bytes, Ordering::AcqRel);
        self.budget.freed.notify_waiters();
    }
}

impl PayloadBudget {
    /// A budget of `limit` bytes; 0: no limit.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(PayloadBudget {
            limit,
            in_flight: AtomicUsize::new(0),
            estimate: AtomicUsize::new((limit / FIRST_CLAIM).max(1)),
            learned: std::sync::atomic::AtomicBool::new(false),
            freed: Notify::new(),
        })
    }

    /// The budget in bytes (0: none).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes of claimed messages in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// How many of `want` messages a claim may take now: as many as the room left holds at the
    /// current estimate; at least one when nothing is in flight (a message larger than the
    /// budget is still delivered, alone); 0 when the budget is spent.
    pub fn room(&self, want: usize) -> usize {
        if self.limit == 0 {
            return want;
        }
        let in_flight = self.in_flight();
        let left = self.limit.saturating_sub(in_flight);
        let each = self.estimate.load(Ordering::Acquire).max(1);
        let n = (left / each).min(want);
        if n == 0 && in_flight == 0 {
            want.min(1)
        } else {
            n
        }
    }

    /// Waits until some of the budget is given back.
    pub async fn freed(&self) {
        let notified = self.freed.notified();
        if self.room(1) > 0 {
            return;
        }
        notified.await;
    }

    /// Charges `messages` (just claimed) to the budget, and learns their size for the next
    /// claims.
    pub fn charge(self: &Arc<Self>, messages: &[ClaimedMessage]) -> Charge {
        let sizes = messages.iter().map(approx_bytes);
        let (bytes, largest) = sizes.fold((0, 0), |(sum, max), b| (sum + b, max.max(b)));
        if largest > 0 {
            let previous = if self.learned.swap(true, Ordering::AcqRel) {
                self.estimate.load(Ordering::Acquire)
            } else {
                0
            };
            self.estimate
                .store(largest.max(previous - previous / 8), Ordering::Release);
        }
        self.in_flight.fetch_add(bytes, Ordering::AcqRel);
        Charge {
            budget: self.clone(),
            bytes,
        }
    }
}

/// What a payload costs a relay while it delivers it, in copies of its decoded size: the row as
/// read from the database, the decoded tree, what the sink makes of it (a log line, a Kafka
/// record), and what the allocator keeps of them between claims. Measured draining 2,000
/// messages of 500 KB (15 MB base): counting the decoded tree once, a budget of 64 MiB peaked at
/// 214 MB; three times, 120–153 MB; six times, within the budget plus the base.
const COPIES: usize = 6;

/// What a claimed message weighs in memory, about: `COPIES` (6) copies of its text and decoded payload.
pub fn approx_bytes(m: &ClaimedMessage) -> usize {
    let headers: usize = m.headers.iter().map(|(k, v)| k.len() + v.len() + 48).sum();
    256 + COPIES
        * (m.topic.len()
            + m.key.as_ref().map_or(0, String::len)
            + m.last_error.as_ref().map_or(0, String::len)
            + headers
            + json_bytes(&m.payload))
}

fn json_bytes(v: &serde_json::Value) -> usize {
    use serde_json::Value;
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => 32,
        Value::String(s) => 32 + s.len(),
        Value::Array(items) => 32 + items.iter().map(json_bytes).sum::<usize>(),
        Value::Object(map) => {
            32 + map
                .iter()
                .map(|(k, v)| 48 + k.len() + json_bytes(v))
                .sum::<usize>()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload_len: usize) -> ClaimedMessage {
        ClaimedMessage {
            id: 1,
            topic: "t".into(),
            key: None,
            ordered: false,
            payload: serde_json::json!({ "blob": "x".repeat(payload_len) }),
            headers: Default::default(),
            priority: 0,
            run_at: chrono::Utc::now(),
            attempts: 1,
            max_attempts: 25,
            created_at: chrono::Utc::now(),
            locked_until: chrono::Utc::now(),
            lease_token: 1,
            last_error: None,
            dedup_key: None,
            undecodable: None,
            stream_id: None,
        }
    }

    #[test]
    fn claims_take_fewer_messages_as_they_grow_and_the_budget_fills() {
        let budget = PayloadBudget::new(60 << 20);
        // Before any claim: one message, to learn their size.
        assert_eq!(budget.room(500), 1);
        let big = budget.charge(&[message(500_000), message(500_000)]);
        // 6 MB in flight (500 KB messages weigh 3 MB), 3 MB a message expected: 18 more fit.
        assert_eq!(budget.room(500), 18);
        let more: Vec<ClaimedMessage> = (0..18).map(|_| message(500_000)).collect();
        let full = budget.charge(&more);
        assert_eq!(budget.room(500), 0, "spent");
        drop(full);
        assert_eq!(budget.room(500), 18, "given back when settled");
        drop(big);
        // Small messages again: the estimate comes down by an eighth a claim.
        let small = budget.charge(&[message(10)]);
        assert_eq!(budget.room(500), 23, "{budget:?}");
        drop(small);
        // Nothing in flight: one message at least, whatever its size.
        let huge = PayloadBudget::new(1000);
        let c = huge.charge(&[message(100_000)]);
        assert_eq!(huge.room(10), 0);
        drop(c);
        assert_eq!(huge.room(10), 1);
        assert_eq!(PayloadBudget::new(0).room(10), 10, "no budget");
    }
}
