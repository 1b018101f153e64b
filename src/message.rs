//! The message an app writes: a builder that validates before any SQL runs.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::error::InvalidMessage;

/// Longest topic, in bytes. Topics become Kafka topic names (limit 249) and metric labels.
pub const MAX_TOPIC_BYTES: usize = 255;
/// Longest key or dedup key, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;
/// Largest payload, in bytes of serialized JSON (1 MiB, Kafka's default `message.max.bytes`).
/// Larger documents belong in object storage, with a reference in the message.
pub const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// Attempts a message gets unless it says otherwise (the column default in the migration).
/// Header names the relay sets on every Kafka record (`postbox-id`, ...): refused in a message's
/// own headers, compared without regard to case as Kafka consumers often do.
pub const RESERVED_HEADER_PREFIX: &str = "postbox-";

/// True for a header name that starts with [`RESERVED_HEADER_PREFIX`], in any case.
pub fn is_reserved_header(name: &str) -> bool {
    name.len() >= RESERVED_HEADER_PREFIX.len()
        && name.as_bytes()[..RESERVED_HEADER_PREFIX.len()]
            .eq_ignore_ascii_case(RESERVED_HEADER_PREFIX.as_bytes())
}

/// Attempts before a message is dead-lettered, when it does not say ([`Message::max_attempts`]).
pub const DEFAULT_MAX_ATTEMPTS: i32 = 25;

/// Headers named `ce_<attribute>` carry CloudEvents attributes (the Kafka binding's own naming):
/// a route with `format = "cloudevents"` sends them as the event's extension attributes (and
/// `ce_subject`, `ce_dataschema` as those optional attributes); other formats pass them on as they
/// are.
pub const CLOUDEVENTS_HEADER_PREFIX: &str = "ce_";

/// Header holding a message's event type: Debezium's `eventType` header and CloudEvents' `type`.
pub const EVENT_TYPE_HEADER: &str = "type";

/// CloudEvents attributes the relay sets itself (`type` comes from the [`EVENT_TYPE_HEADER`]).
const CLOUDEVENTS_RELAY_ATTRIBUTES: [&str; 8] = [
    "specversion",
    "id",
    "source",
    "time",
    "type",
    "datacontenttype",
    "data",
    "partitionkey",
];

/// For a header name: `Ok(None)` when it is no CloudEvents attribute (no `ce_` prefix),
/// `Ok(Some(attribute))` for a valid one, `Err` (why) for a `ce_` header the binding cannot carry:
/// attribute names are 1 to 20 lowercase letters or digits, and a few are the relay's own.
pub fn cloudevents_attribute(header: &str) -> Result<Option<&str>, String> {
    let prefix = CLOUDEVENTS_HEADER_PREFIX.len();
    if header.len() < prefix || !header.as_bytes()[..prefix].eq_ignore_ascii_case(b"ce_") {
        return Ok(None);
    }
    let name = &header[prefix..];
    if name.is_empty()
        || name.len() > 20
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        || !header.starts_with(CLOUDEVENTS_HEADER_PREFIX)
    {
        return Err(format!(
            "{header:?}: a header starting with \"ce_\" is a CloudEvents attribute, and its name \
             must be \"ce_\" and 1 to 20 lowercase letters or digits"
        ));
    }
    if CLOUDEVENTS_RELAY_ATTRIBUTES.contains(&name) {
        let hint = if name == "type" {
            format!(" (give the event type as header {EVENT_TYPE_HEADER:?})")
        } else {
            String::new()
        };
        return Err(format!(
            "{header:?}: the CloudEvents attribute {name:?} is set by the relay{hint}"
        ));
    }
    Ok(Some(name))
}

/// Identifier of a message: its `postbox.messages.id`, also its position in the queue.
pub type MessageId = i64;

/// A message to enqueue, built with chained setters.
///
/// ```
/// use postbox::Message;
/// let msg = Message::new("order.created")
///     .payload(&serde_json::json!({"order_id": 42}))
///     .key("order-42")
///     .ordered()
///     .header("trace-id", "abc123")
///     .max_attempts(5)
///     .dedup_key("order-42-created");
/// assert!(msg.validate().is_ok());
/// ```
#[derive(Debug, Clone)]
pub struct Message {
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    pub(crate) ordered: bool,
    pub(crate) payload: Result<serde_json::Value, String>,
    pub(crate) headers: Result<BTreeMap<String, String>, String>,
    pub(crate) priority: i16,
    pub(crate) run_at: Option<DateTime<Utc>>,
    pub(crate) delay: Option<Duration>,
    pub(crate) max_attempts: Option<i32>,
    pub(crate) dedup_key: Option<String>,
}

impl Message {
    /// A message for `topic` with an empty object as payload.
    pub fn new(topic: impl Into<String>) -> Self {
        Message {
            topic: topic.into(),
            key: None,
            ordered: false,
            payload: Ok(serde_json::Value::Object(Default::default())),
            headers: Ok(BTreeMap::new()),
            priority: 0,
            run_at: None,
            delay: None,
            max_attempts: None,
            dedup_key: None,
        }
    }

    /// The payload, serialized to JSON now; a failure is reported by `validate` and `enqueue`.
    pub fn payload<T: Serialize + ?Sized>(mut self, payload: &T) -> Self {
        self.payload = serde_json::to_value(payload).map_err(|e| e.to_string());
        self
    }

    /// The key: the Kafka message key (partition), and the unit of order for ordered messages.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Deliver this message only after every earlier ordered message with the same topic and key
    /// has left the queue (delivered or dead-lettered). Needs a key.
    pub fn ordered(mut self) -> Self {
        self.ordered = true;
        self
    }

    /// Adds one header (a string value; Kafka headers are bytes, postbox keeps them text).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        if let Ok(h) = &mut self.headers {
            h.insert(name.into(), value.into());
        }
        self
    }

    /// Replaces all headers with a JSON object whose values must be strings.
    pub fn headers_json(mut self, headers: serde_json::Value) -> Self {
        self.headers = match headers {
            serde_json::Value::Object(map) => map
                .into_iter()
                .map(|(k, v)| match v {
                    serde_json::Value::String(s) => Ok((k, s)),
                    other => Err(format!("value of {k:?} is {other}, not a string")),
                })
                .collect(),
            other => Err(format!("must be a JSON object, got {other}")),
        };
        self
    }

    /// Lower runs first (default 0). Priority orders claims; it never preempts running work.
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = priority;
        self
    }

    /// Not claimed before this instant.
    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self.delay = None;
        self
    }

    /// Not claimed before `delay` from now (measured on the app's clock at enqueue time).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self.run_at = None;
        self
    }

    /// Deliveries tried before the message is dead-lettered (default [`DEFAULT_MAX_ATTEMPTS`]).
    pub fn max_attempts(mut self, max_attempts: i32) -> Self {
        self.max_attempts = Some(max_attempts);
        self
    }

    /// While a live message of the same topic holds this key, enqueueing another is a no-op that
    /// reports the existing message.
    pub fn dedup_key(mut self, dedup_key: impl Into<String>) -> Self {
        self.dedup_key = Some(dedup_key.into());
        self
    }

    /// The topic this message goes to.
    pub fn topic_name(&self) -> &str {
        &self.topic
    }

    /// When the message becomes claimable, as of `now` (`None`: at once). Refuses a delay or time
    /// that cannot be represented or lies after the year 9999.
    pub(crate) fn resolved_run_at(
        &self,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, InvalidMessage> {
        let latest = DateTime::<Utc>::from_naive_utc_and_offset(
            chrono::NaiveDate::from_ymd_opt(9999, 12, 31)
                .and_then(|d| d.and_hms_opt(23, 59, 59))
                .expect("a valid date"),
            Utc,
        );
        let (field, at) = match (self.run_at, self.delay) {
            (Some(at), _) => ("run_at", Some(at)),
            (None, Some(d)) => (
                "delay",
                chrono::Duration::from_std(d)
                    .ok()
                    .and_then(|d| now.checked_add_signed(d)),
            ),
            (None, None) => return Ok(None),
        };
        match at {
            Some(at) if at <= latest => Ok(Some(at)),
            _ => Err(InvalidMessage::RunAt {
                field,
                problem: format!("must not be later than {latest}"),
            }),
        }
    }

    /// Checks every field against the limits; `enqueue` calls this before any SQL. Header names
    /// starting with [`RESERVED_HEADER_PREFIX`] are refused: the Kafka sink sets its own.
    pub fn validate(&self) -> Result<(), InvalidMessage> {
        if self.topic.contains('\0') {
            return Err(InvalidMessage::Nul { field: "topic" });
        }
        for (field, value) in [("key", &self.key), ("dedup_key", &self.dedup_key)] {
            if value.as_deref().is_some_and(|v| v.contains('\0')) {
                return Err(InvalidMessage::Nul { field });
            }
        }
        if let Ok(headers) = &self.headers
            && headers
                .iter()
                .any(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(InvalidMessage::Nul { field: "headers" });
        }
        if let Ok(payload) = &self.payload
            && json_has_nul(payload)
        {
            return Err(InvalidMessage::Nul { field: "payload" });
        }
        self.resolved_run_at(Utc::now())?;
        if self.topic.is_empty() {
            return Err(InvalidMessage::EmptyTopic);
        }
        if self.topic.len() > MAX_TOPIC_BYTES {
            return Err(InvalidMessage::TopicTooLong {
                len: self.topic.len(),
                limit: MAX_TOPIC_BYTES,
            });
        }
        for (field, value) in [("key", &self.key), ("dedup_key", &self.dedup_key)] {
            if let Some(v) = value
                && v.len() > MAX_KEY_BYTES
            {
                return Err(InvalidMessage::TooLong {
                    field,
                    len: v.len(),
                    limit: MAX_KEY_BYTES,
                });
            }
        }
        if self.ordered && self.key.is_none() {
            return Err(InvalidMessage::OrderedWithoutKey);
        }
        if let Some(n) = self.max_attempts
            && n < 1
        {
            return Err(InvalidMessage::MaxAttempts(n));
        }
        if let Err(e) = &self.headers {
            return Err(InvalidMessage::BadHeaders(e.clone()));
        }
        if let Ok(headers) = &self.headers
            && let Some(name) = headers.keys().find(|k| is_reserved_header(k))
        {
            return Err(InvalidMessage::BadHeaders(format!(
                "{name:?}: names starting with {RESERVED_HEADER_PREFIX:?} are the relay's own (postbox-id, postbox-topic, postbox-created-at)"
            )));
        }
        if let Ok(headers) = &self.headers
            && let Some(Err(e)) = headers
                .keys()
                .map(|k| cloudevents_attribute(k))
                .find(Result::is_err)
        {
            return Err(InvalidMessage::BadHeaders(e));
        }
        match &self.payload {
            Err(e) => Err(InvalidMessage::PayloadNotJson(e.clone())),
            Ok(value) => {
                let len = json_len(value);
                if len > MAX_PAYLOAD_BYTES {
                    Err(InvalidMessage::PayloadTooLarge {
                        len,
                        limit: MAX_PAYLOAD_BYTES,
                    })
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// True if a string or an object key anywhere in `value` holds a NUL character (`jsonb` refuses
/// `\u0000`).
fn json_has_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(a) => a.iter().any(json_has_nul),
        serde_json::Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || json_has_nul(v)),
        _ => false,
    }
}

/// Serialized length of a JSON value, without allocating the text.
fn json_len(value: &serde_json::Value) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Counter(0);
    serde_json::to_writer(&mut c, value).expect("a serde_json::Value always serializes");
    c.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_input_by_field() {
        assert_eq!(Message::new("").validate(), Err(InvalidMessage::EmptyTopic));
        assert!(matches!(
            Message::new("t".repeat(256)).validate(),
            Err(InvalidMessage::TopicTooLong { len: 256, .. })
        ));
        assert!(Message::new("t".repeat(255)).validate().is_ok());
        assert_eq!(
            Message::new("t").ordered().validate(),
            Err(InvalidMessage::OrderedWithoutKey)
        );
        assert_eq!(
            Message::new("t").max_attempts(0).validate(),
            Err(InvalidMessage::MaxAttempts(0))
        );
        let e = Message::new("t")
            .headers_json(serde_json::json!({"a": "x", "b": 1}))
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("\"b\""), "{e}");
        for name in ["postbox-id", "Postbox-Topic", "POSTBOX-x"] {
            let e = Message::new("t").header(name, "1").validate().unwrap_err();
            assert!(
                matches!(&e, InvalidMessage::BadHeaders(m) if m.contains(name)),
                "{e}"
            );
        }
        assert!(Message::new("t").header("postbox", "1").validate().is_ok());
        assert!(
            Message::new("t")
                .header("x-postbox-id", "1")
                .validate()
                .is_ok()
        );
        for name in [
            "ce_Region",
            "CE_region",
            "ce_",
            "ce_a-b",
            "ce_id",
            "ce_type",
            "ce_specversion",
        ] {
            let e = Message::new("t").header(name, "1").validate().unwrap_err();
            assert!(
                matches!(&e, InvalidMessage::BadHeaders(m) if m.contains(name)),
                "{e}"
            );
        }
        let e = Message::new("t")
            .header("ce_type", "x")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("header \"type\""), "{e}");
        for name in [
            "ce_region",
            "ce_subject",
            "ce_dataschema",
            "ce_traceparent",
            "cex",
            "type",
        ] {
            assert!(
                Message::new("t").header(name, "1").validate().is_ok(),
                "{name}"
            );
        }
        let big = "x".repeat(MAX_PAYLOAD_BYTES);
        assert!(matches!(
            Message::new("t").payload(&big).validate(),
            Err(InvalidMessage::PayloadTooLarge { .. })
        ));
        let map: BTreeMap<Vec<u8>, i32> = [(vec![1u8], 1)].into();
        assert!(matches!(
            Message::new("t").payload(&map).validate(),
            Err(InvalidMessage::PayloadNotJson(_))
        ));
    }

    #[test]
    fn refuses_nul_characters_and_unrepresentable_run_times() {
        let nul = |m: Message| match m.validate() {
            Err(InvalidMessage::Nul { field }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(nul(Message::new("a\0b")), "topic");
        assert_eq!(nul(Message::new("t").key("k\0")), "key");
        assert_eq!(nul(Message::new("t").dedup_key("\0")), "dedup_key");
        assert_eq!(nul(Message::new("t").header("h", "v\0")), "headers");
        assert_eq!(
            nul(Message::new("t").payload(&serde_json::json!({"a": [1, {"b\0": 2}]}))),
            "payload"
        );
        assert_eq!(nul(Message::new("t").payload("x\0y")), "payload");
        for m in [
            Message::new("t").delay(Duration::MAX),
            Message::new("t").delay(Duration::from_secs(100_000_000 * 86_400)),
            Message::new("t").run_at(DateTime::<Utc>::MAX_UTC),
        ] {
            assert!(
                matches!(m.validate(), Err(InvalidMessage::RunAt { .. })),
                "{:?}",
                m.validate()
            );
        }
        assert!(
            Message::new("t")
                .delay(Duration::from_secs(365 * 86_400))
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn json_len_matches_serialized_text() {
        let v = serde_json::json!({"a": [1, 2, "é"], "b": null});
        assert_eq!(json_len(&v), serde_json::to_string(&v).unwrap().len());
    }
}
