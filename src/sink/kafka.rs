//! The Kafka sink: a whole batch is handed to librdkafka, its delivery reports awaited, and each
//! message's outcome classified.
//!
//! Each route's [`RecordLayout`] makes the records (topic template and format: postbox's own,
//! Debezium's outbox event router's, or CloudEvents; see [`super::record`]). Producer defaults: idempotence on,
//! `acks=all`, `message.timeout.ms=10000` (an outage is noticed in seconds, well inside the lease),
//! the Java client's `murmur2_random` partitioner;
//! every librdkafka property can be set from the configuration.
//!
//! Outcomes: delivered; a permanent per-message error (message too large, invalid or unknown
//! topic, not authorized) → dead letter with the broker's reason; a broker or transport outage
//! (every message of the batch failed with a transport error or timed out) → the sink is
//! unavailable, the batch is handed back without using attempts; anything else → retry.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, join_all};
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::kafka_context::QuietContext;
use super::record::{Record, RecordLayout};
use super::{Outcome, Sink, Unavailable};

/// The producer type: librdkafka's reports go through [`QuietContext`].
type QuietProducer = FutureProducer<QuietContext>;
use crate::store::{ClaimedMessage, Topics};

/// Properties the sink sets unless the configuration says otherwise. `murmur2_random` is the Java
/// client's partitioner: a key lands on the partition where Kafka Connect, Debezium and Java
/// producers put it (librdkafka's own default hashes keys with CRC32).
pub const PRODUCER_DEFAULTS: [(&str, &str); 5] = [
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("message.timeout.ms", "10000"),
    ("linger.ms", "5"),
    ("partitioner", "murmur2_random"),
];

/// One producer, shared by every Kafka route, made anew if librdkafka reports it fatally broken
/// (an idempotent producer can be fenced after an outage; it never recovers by itself).
pub struct SharedProducer {
    config: ClientConfig,
    current: std::sync::Mutex<Arc<QuietProducer>>,
}

impl SharedProducer {
    fn get(&self) -> Result<Arc<QuietProducer>, Unavailable> {
        let mut p = self.current.lock().expect("producer lock");
        if let Some((code, reason)) = p.client().fatal_error() {
            tracing::warn!(
                ?code,
                reason,
                "kafka producer failed fatally; creating a new one"
            );
            *p = self.create()?;
        }
        Ok(p.clone())
    }

    fn create(&self) -> Result<Arc<QuietProducer>, Unavailable> {
        self.config
            .create_with_context::<_, QuietProducer>(QuietContext::default())
            .map(Arc::new)
            .map_err(|e| Unavailable::new(format!("kafka: cannot create the producer: {e}")))
    }

    /// Replaces `failed` (if it is still the current producer) by a new one with a new producer id.
    fn replace(&self, failed: &Arc<QuietProducer>) {
        let mut p = self.current.lock().expect("producer lock");
        if Arc::ptr_eq(&p, failed) {
            match self.create() {
                Ok(new) => {
                    tracing::warn!(
                        "kafka producer lost its idempotence state (fenced); created a new one"
                    );
                    *p = new;
                }
                Err(e) => tracing::warn!(error = %e.0, "kafka producer could not be replaced"),
            }
        }
    }
}

/// Errors that mean the producer's idempotence state is gone: only a new producer id helps.
fn producer_state_lost(e: &KafkaError) -> bool {
    use RDKafkaErrorCode::*;
    matches!(
        e,
        KafkaError::MessageProduction(
            ProducerFenced
                | InvalidProducerEpoch
                | UnknownProducerId
                | OutOfOrderSequenceNumber
                | Fatal
        )
    )
}

/// One producer for `brokers` with the defaults above, overridden by `properties`.
pub fn producer(
    brokers: &str,
    properties: &BTreeMap<String, String>,
) -> Result<Arc<SharedProducer>, String> {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (k, v) in PRODUCER_DEFAULTS {
        config.set(k, v);
    }
    for (k, v) in properties {
        config.set(k, v);
    }
    let first = config
        .create_with_context::<_, QuietProducer>(QuietContext::default())
        .map_err(|e| {
            // librdkafka quotes the value of a property it refuses: never a secret's.
            crate::redact::redact_values(
                &format!("sinks.kafka: cannot create the producer: {e}"),
                properties,
            )
        })?;
    Ok(Arc::new(SharedProducer {
        config,
        current: std::sync::Mutex::new(Arc::new(first)),
    }))
}

/// Sends the messages of one route to Kafka.
pub struct KafkaSink {
    producer: Arc<SharedProducer>,
    topics: Topics,
    /// The Kafka topic and the record of each message.
    layout: RecordLayout,
    /// The name in metrics and health (`kafka`, or `kafka[N]` when several routes use Kafka).
    name: String,
}

impl KafkaSink {
    /// A sink for `topics` over `producer`, making records as `layout` says
    /// (`RecordLayout::default()`: postbox's format, to the message's own topic).
    pub fn new(producer: Arc<SharedProducer>, topics: Topics, layout: RecordLayout) -> Self {
        KafkaSink {
            producer,
            topics,
            layout,
            name: "kafka".to_owned(),
        }
    }

    /// Names this sink in metrics and health: one route's outage must not hide behind another's
    /// good health when several routes send to Kafka.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Waits for messages still queued in the producer (shutdown).
    pub fn flush(&self, timeout: Duration) {
        if let Ok(p) = self.producer.get() {
            let _ = p.flush(timeout);
        }
    }
}

/// What a failed delivery means for its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// The broker or the network is away.
    Outage,
    /// Something about the route, not the message: the topic is missing, not authorized, or (when
    /// the route names its Kafka topic) invalid. Every message of the route would fail alike, so
    /// the route is paused as in an outage (the operator fixes it; nothing is dead-lettered), as
    /// Kafka Connect stops a task.
    Route,
    /// This message can never be delivered as it is.
    Permanent,
    /// Worth another attempt.
    Transient,
}

/// `renamed`: the route sends every message to one Kafka topic of its configuration (otherwise the
/// Kafka topic is the message's own, and an invalid name is the message's fault).
fn classify(e: &KafkaError, renamed: bool) -> Failure {
    use RDKafkaErrorCode::*;
    let code = match e {
        KafkaError::MessageProduction(c) => *c,
        _ => return Failure::Transient,
    };
    match code {
        InvalidTopic if renamed => Failure::Route,
        UnknownTopic
        | UnknownTopicOrPartition
        | TopicAuthorizationFailed
        | ClusterAuthorizationFailed
        | TransactionalIdAuthorizationFailed => Failure::Route,
        MessageSizeTooLarge | InvalidMessageSize | InvalidTopic | InvalidRecord
        | InvalidMessage | BadMessage => Failure::Permanent,
        // The broker or the link is away, or the producer's idempotence state was lost with it.
        BrokerTransportFailure
        | AllBrokersDown
        | Resolve
        | MessageTimedOut
        | TimedOutQueue
        | NetworkException
        | ProducerFenced
        | InvalidProducerEpoch
        | OutOfOrderSequenceNumber
        | UnknownProducerId
        | Fatal
        | PurgeInflight
        | PurgeQueue => Failure::Outage,
        _ => Failure::Transient,
    }
}

fn owned_headers(r: &Record) -> OwnedHeaders {
    r.headers.iter().fold(
        OwnedHeaders::new_with_capacity(r.headers.len()),
        |h, (k, v)| {
            h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            })
        },
    )
}

/// One message's fate in a batch: sent (with librdkafka's report) or refused before sending.
enum Report {
    Sent(Result<(), KafkaError>),
    /// No record can be made of it: the reason.
    Refused(String),
}

impl Sink for KafkaSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn topics(&self) -> Topics {
        self.topics.clone()
    }

    fn max_batch(&self) -> usize {
        usize::MAX
    }

    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let producer = self.producer.get()?;
            // Hand the whole batch to librdkafka first, then await every report together.
            let mut pending = Vec::with_capacity(batch.len());
            let mut topics = Vec::with_capacity(batch.len());
            for m in &batch {
                let r = match self.layout.record(m) {
                    Ok(r) => r,
                    Err(reason) => {
                        pending.push(Err(reason));
                        topics.push(String::new());
                        continue;
                    }
                };
                let mut record = FutureRecord::to(&r.topic).headers(owned_headers(&r));
                if let Some(v) = &r.value {
                    record = record.payload(v);
                }
                if let Some(k) = &r.key {
                    record = record.key(k.as_str());
                }
                if let Some(ts) = r.timestamp_ms {
                    record = record.timestamp(ts);
                }
                let future = loop {
                    match producer.send_result(record) {
                        Ok(f) => break Ok(f),
                        // The local queue is full: let librdkafka send, then try again.
                        Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                            record = back;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        Err((e, _)) => break Err(e),
                    }
                };
                pending.push(Ok(future));
                topics.push(r.topic);
            }
            let reports = join_all(pending.into_iter().map(|f| async move {
                match f {
                    Err(reason) => Report::Refused(reason),
                    Ok(Ok(delivery)) => Report::Sent(match delivery.await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err((e, _))) => Err(e),
                        Err(_) => Err(KafkaError::Canceled),
                    }),
                    Ok(Err(e)) => Report::Sent(Err(e)),
                }
            }))
            .await;
            let sent_errors = || {
                reports.iter().filter_map(|r| match r {
                    Report::Sent(Err(e)) => Some(e),
                    _ => None,
                })
            };
            if sent_errors().any(producer_state_lost) {
                self.producer.replace(&producer);
            }
            // One Kafka topic for the whole route: what Kafka says of it, it says of the route.
            let renamed = self.layout.topic.constant().is_some();
            let sent = reports
                .iter()
                .filter(|r| matches!(r, Report::Sent(_)))
                .count();
            let failures: Vec<Failure> = sent_errors().map(|e| classify(e, renamed)).collect();
            let all_sent_failed_with =
                |f: Failure| sent > 0 && failures.len() == sent && failures.iter().all(|x| *x == f);
            // A route that names its Kafka topic, refused on all of it: the route is down.
            if renamed && all_sent_failed_with(Failure::Route) {
                let e = sent_errors().next().expect("at least one failure");
                return Err(Unavailable::new(format!(
                    "kafka: the route cannot deliver to its topic: {e}"
                )));
            }
            if all_sent_failed_with(Failure::Outage) {
                let e = sent_errors().next().expect("at least one failure");
                return Err(Unavailable::new(format!("kafka: {e}")));
            }
            Ok(reports
                .into_iter()
                .zip(topics)
                .map(|(r, topic)| match r {
                    Report::Refused(reason) => Outcome::Dead {
                        reason: format!("kafka: {reason}"),
                    },
                    Report::Sent(Ok(())) => Outcome::Delivered,
                    Report::Sent(Err(e)) => match classify(&e, renamed) {
                        Failure::Permanent => Outcome::Dead {
                            reason: format!("kafka: {e}"),
                        },
                        // The broker went away while part of the batch was delivered: the rest
                        // goes back without using an attempt, as a wholly failed batch does.
                        Failure::Outage => Outcome::Release {
                            reason: format!("kafka: {e}"),
                        },
                        // Kafka refuses this message's topic (missing, not authorized): what
                        // Kafka stored stays delivered, this topic is held back, the rest flows.
                        Failure::Route => Outcome::TopicUnavailable {
                            reason: format!("kafka: topic {topic}: {e}"),
                        },
                        Failure::Transient => Outcome::Retry {
                            reason: format!("kafka: {e}"),
                            delay: None,
                        },
                    },
                })
                .collect())
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relays_own_headers_win_over_reserved_names_inserted_by_plain_sql() {
        use rdkafka::message::Headers;
        let now = chrono::Utc::now();
        let m = ClaimedMessage {
            id: 42,
            topic: "t".into(),
            key: None,
            ordered: false,
            payload: serde_json::Value::Null,
            headers: [("POSTBOX-ID", "999"), ("postbox-id", "998"), ("trace", "x")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            priority: 0,
            run_at: now,
            attempts: 1,
            max_attempts: 25,
            created_at: now,
            locked_until: now,
            lease_token: 1,
            last_error: None,
            dedup_key: None,
            undecodable: None,
            stream_id: None,
        };
        let h = owned_headers(&RecordLayout::default().record(&m).unwrap());
        let all: Vec<(String, String)> = h
            .iter()
            .map(|h| {
                let v = String::from_utf8(h.value.unwrap_or_default().to_vec()).unwrap();
                (h.key.to_owned(), v)
            })
            .collect();
        let ids: Vec<&(String, String)> = all
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("postbox-id"))
            .collect();
        assert_eq!(
            ids,
            [&("postbox-id".to_owned(), "42".to_owned())],
            "{all:?}"
        );
        assert!(all.contains(&("trace".to_owned(), "x".to_owned())));
    }

    #[test]
    fn errors_about_the_route_pause_it_and_errors_about_a_message_dead_letter_it() {
        use RDKafkaErrorCode::*;
        let c = |code, renamed| classify(&KafkaError::MessageProduction(code), renamed);
        for code in [
            UnknownTopic,
            UnknownTopicOrPartition,
            TopicAuthorizationFailed,
            ClusterAuthorizationFailed,
        ] {
            assert_eq!(c(code, false), Failure::Route, "{code:?}");
        }
        assert_eq!(c(InvalidTopic, true), Failure::Route);
        assert_eq!(c(InvalidTopic, false), Failure::Permanent);
        assert_eq!(c(MessageSizeTooLarge, true), Failure::Permanent);
        assert_eq!(c(AllBrokersDown, false), Failure::Outage);
    }
}
