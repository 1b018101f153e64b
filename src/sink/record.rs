//! What a Kafka route sends for one message: the topic (from the route's template) and the record
//! in the format its consumers already parse.
//!
//! - `postbox` (the default): value = the payload's JSON; headers = the message's headers plus
//!   `postbox-id`, `postbox-topic`, `postbox-created-at`.
//! - `debezium`: what Debezium's outbox event router sends with its defaults. Key = the message key
//!   (Debezium's `aggregateid`); header `id` = the message id (the stream id for stream messages);
//!   value = the payload's JSON text as a JSON string (`expand_payload`: the JSON itself, as
//!   `table.expand.json.payload`); header `eventType` = the message's header `type` when it has
//!   one; timestamp = the message's creation time; the message's other headers as they are.
//! - `cloudevents`: the CloudEvents 1.0 Kafka protocol binding, binary content mode (attributes in
//!   `ce_` headers, value = the payload, `content-type: application/json`) or structured
//!   (`content-type: application/cloudevents+json`, value = the event's JSON envelope). `id` as
//!   above, `source` from the route, `type` = header `type` or else the postbox topic, `time` = the
//!   creation time, `subject` = header `ce_subject` when there is one; other `ce_<name>` headers
//!   are extension attributes. The key is the record key (the SDKs read it as `partitionkey`).
//!
//! A message whose record cannot be made (a header the template needs is missing, the topic it
//! gives is no valid Kafka topic name, a `ce_` header the binding cannot carry) is refused with the
//! reason: the sink dead-letters it.

use std::borrow::Cow;

use chrono::SecondsFormat;
use serde_json::Value;

use crate::message::{CLOUDEVENTS_HEADER_PREFIX, EVENT_TYPE_HEADER, cloudevents_attribute};
use crate::store::ClaimedMessage;

/// Longest Kafka topic name.
pub const MAX_KAFKA_TOPIC_LEN: usize = 249;

/// The record format of a route (`format = ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// postbox's own.
    Postbox {
        /// A `null` or `""` payload is sent as a tombstone (a record with no value).
        tombstone_on_empty: bool,
    },
    /// Debezium's outbox event router.
    Debezium {
        /// The payload as JSON, not as a JSON string of it (`table.expand.json.payload`).
        expand_payload: bool,
        /// As `route.tombstone.on.empty.payload`.
        tombstone_on_empty: bool,
    },
    /// CloudEvents 1.0, Kafka protocol binding.
    CloudEvents {
        /// The `source` attribute (a URI-reference, from the route).
        source: String,
        /// Structured content mode instead of binary.
        structured: bool,
    },
}

impl Default for Format {
    fn default() -> Self {
        Format::Postbox {
            tombstone_on_empty: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Topic,
    /// A dot-separated segment of the topic, from 0; negative counts from the end (-1: the last).
    Segment(i32),
    Header(String),
}

/// A route's `kafka_topic`: literal text and `{topic}`, `{topic[N]}`, `{header:NAME}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicTemplate {
    parts: Vec<Part>,
}

impl Default for TopicTemplate {
    /// The message's own topic.
    fn default() -> Self {
        TopicTemplate {
            parts: vec![Part::Topic],
        }
    }
}

/// `Err` (why) unless `name` is a valid Kafka topic name.
pub fn check_kafka_topic(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("a Kafka topic name cannot be empty".into());
    }
    if name == "." || name == ".." {
        return Err(format!("{name:?} cannot be a Kafka topic name"));
    }
    if name.len() > MAX_KAFKA_TOPIC_LEN {
        return Err(format!(
            "a Kafka topic name has at most {MAX_KAFKA_TOPIC_LEN} characters, not {}",
            name.len()
        ));
    }
    if let Some(c) = name.chars().find(|c| !valid_topic_char(*c)) {
        return Err(format!(
            "{c:?} cannot be in a Kafka topic name (letters, digits, '.', '_' and '-' only)"
        ));
    }
    Ok(())
}

fn valid_topic_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

impl TopicTemplate {
    /// Parses a template; the error says what is wrong with it. A template without placeholders
    /// must be a valid topic name, and literal text must hold only what topic names may.
    pub fn parse(template: &str) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            let open = rest.find('{').unwrap_or(rest.len());
            let text = &rest[..open];
            if text.contains('}') {
                return Err("a '}' without its '{'".into());
            }
            if let Some(c) = text.chars().find(|c| !valid_topic_char(*c)) {
                return Err(format!(
                    "{c:?} cannot be in a Kafka topic name (letters, digits, '.', '_' and '-' only)"
                ));
            }
            if !text.is_empty() {
                parts.push(Part::Text(text.to_owned()));
            }
            rest = &rest[open..];
            if rest.is_empty() {
                break;
            }
            let close = rest
                .find('}')
                .ok_or_else(|| "a '{' without its '}'".to_owned())?;
            parts.push(placeholder(&rest[1..close])?);
            rest = &rest[close + 1..];
        }
        let literal: usize = parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.len(),
                _ => 0,
            })
            .sum();
        if literal > MAX_KAFKA_TOPIC_LEN {
            return Err(format!(
                "its text alone is longer than a Kafka topic name may be ({MAX_KAFKA_TOPIC_LEN})"
            ));
        }
        let t = TopicTemplate { parts };
        if t.parts.is_empty() {
            return Err("a Kafka topic name cannot be empty".into());
        }
        if let Some(name) = t.constant() {
            check_kafka_topic(name)?;
        }
        Ok(t)
    }

    /// The one topic every message goes to, when the template has no placeholder.
    pub fn constant(&self) -> Option<&str> {
        match self.parts.as_slice() {
            [Part::Text(t)] => Some(t),
            _ => None,
        }
    }

    /// True if the topic depends on a message's headers (not only on its topic).
    pub fn uses_headers(&self) -> bool {
        self.parts.iter().any(|p| matches!(p, Part::Header(_)))
    }

    /// The Kafka topic of a message of `topic` with `headers`, or why there is none.
    pub fn render_for(
        &self,
        topic: &str,
        headers: &std::collections::BTreeMap<String, String>,
    ) -> Result<String, String> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Topic => out.push_str(topic),
                Part::Segment(n) => {
                    let segments: Vec<&str> = topic.split('.').collect();
                    let i = if *n < 0 {
                        segments.len().checked_sub(n.unsigned_abs() as usize)
                    } else {
                        Some(*n as usize)
                    };
                    match i.and_then(|i| segments.get(i)) {
                        Some(s) => out.push_str(s),
                        None => {
                            return Err(format!(
                                "topic {topic:?} has no segment [{n}] for the route's kafka_topic"
                            ));
                        }
                    }
                }
                Part::Header(h) => match headers.get(h) {
                    Some(v) => out.push_str(v),
                    None => {
                        return Err(format!(
                            "header {h:?} is missing: the route's kafka_topic needs it"
                        ));
                    }
                },
            }
        }
        check_kafka_topic(&out).map_err(|e| {
            if self.parts == [Part::Topic] {
                format!("topic {out:?} cannot be a Kafka topic: {e}")
            } else {
                format!("kafka topic {out:?} from the route's kafka_topic: {e}")
            }
        })?;
        Ok(out)
    }
}

fn placeholder(inner: &str) -> Result<Part, String> {
    if inner == "topic" {
        return Ok(Part::Topic);
    }
    if let Some(n) = inner
        .strip_prefix("topic[")
        .and_then(|r| r.strip_suffix(']'))
    {
        return n
            .parse()
            .map(Part::Segment)
            .map_err(|_| format!("{{{inner}}}: the segment must be a whole number"));
    }
    if let Some(h) = inner.strip_prefix("header:") {
        if h.is_empty() {
            return Err("{header:}: name the header".into());
        }
        return Ok(Part::Header(h.to_owned()));
    }
    Err(format!(
        "unknown placeholder {{{inner}}} (expected {{topic}}, {{topic[N]}} or {{header:NAME}})"
    ))
}

/// A header name: the relay's own are static, a message's are its own.
pub type HeaderName = Cow<'static, str>;

/// One Kafka record, ready to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The Kafka topic.
    pub topic: String,
    /// The record key (`None`: no key).
    pub key: Option<String>,
    /// `None`: a tombstone.
    pub value: Option<Vec<u8>>,
    /// The record headers, in order.
    pub headers: Vec<(HeaderName, String)>,
    /// Milliseconds since the epoch; `None`: the producer's clock.
    pub timestamp_ms: Option<i64>,
}

/// How a route turns messages into records: its topic template and its format.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordLayout {
    /// Where each record goes.
    pub topic: TopicTemplate,
    /// What each record holds.
    pub format: Format,
}

fn empty(payload: &Value) -> bool {
    matches!(payload, Value::Null) || payload.as_str() == Some("")
}

fn json(value: &Value) -> Vec<u8> {
    serde_json::to_vec(value).expect("a JSON value serializes")
}

/// The message's own headers a format passes on: never the relay's `postbox-` names, nor those
/// the format sets itself (`skip`).
fn passed_on<'a>(
    m: &'a ClaimedMessage,
    skip: &'a [&'a str],
) -> impl Iterator<Item = (HeaderName, String)> + 'a {
    m.headers
        .iter()
        .filter(move |(k, _)| {
            !crate::message::is_reserved_header(k)
                && !skip.iter().any(|s| k.eq_ignore_ascii_case(s))
        })
        .map(|(k, v)| (Cow::Owned(k.clone()), v.clone()))
}

/// The CloudEvents attributes the relay sets, with their binary-mode header names.
const CE_REQUIRED: [(&str, &str); 5] = [
    ("specversion", "ce_specversion"),
    ("id", "ce_id"),
    ("source", "ce_source"),
    ("type", "ce_type"),
    ("time", "ce_time"),
];

/// A structured-mode CloudEvent, written straight from the message (no copy of its payload).
struct Envelope<'a> {
    required: [&'a str; 5],
    subject: Option<&'a str>,
    extensions: &'a [(&'a str, &'a str)],
    data: &'a Value,
}

impl serde::Serialize for Envelope<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for ((name, _), v) in CE_REQUIRED.iter().zip(self.required) {
            map.serialize_entry(name, v)?;
        }
        if let Some(subject) = self.subject {
            map.serialize_entry("subject", subject)?;
        }
        for (name, v) in self.extensions {
            map.serialize_entry(name, v)?;
        }
        map.serialize_entry("datacontenttype", "application/json")?;
        map.serialize_entry("data", self.data)?;
        map.end()
    }
}

impl RecordLayout {
    /// The record for `m`, or why it cannot have one (the message goes to the dead letters).
    pub fn record(&self, m: &ClaimedMessage) -> Result<Record, String> {
        let topic = self.topic.render_for(&m.topic, &m.headers)?;
        let id = m.stream_id.clone().unwrap_or_else(|| m.id.to_string());
        let mut record = Record {
            topic,
            key: m.key.clone(),
            value: None,
            headers: Vec::new(),
            timestamp_ms: None,
        };
        match &self.format {
            Format::Postbox { tombstone_on_empty } => {
                if !(*tombstone_on_empty && empty(&m.payload)) {
                    record.value = Some(json(&m.payload));
                }
                record.headers = Vec::with_capacity(m.headers.len() + 3);
                record.headers.extend(passed_on(m, &[]));
                record.headers.extend([
                    ("postbox-id".into(), id),
                    ("postbox-topic".into(), m.topic.clone()),
                    ("postbox-created-at".into(), m.created_at.to_rfc3339()),
                ]);
            }
            Format::Debezium {
                expand_payload,
                tombstone_on_empty,
            } => {
                if !(*tombstone_on_empty && empty(&m.payload)) {
                    record.value = Some(if *expand_payload {
                        json(&m.payload)
                    } else {
                        json(&Value::String(
                            serde_json::to_string(&m.payload).expect("a JSON value serializes"),
                        ))
                    });
                }
                record.timestamp_ms = Some(m.created_at.timestamp_millis());
                record.headers = Vec::with_capacity(m.headers.len() + 1);
                record.headers.push(("id".into(), id));
                if let Some(t) = m.headers.get(EVENT_TYPE_HEADER) {
                    record.headers.push(("eventType".into(), t.clone()));
                }
                record
                    .headers
                    .extend(passed_on(m, &["id", "eventType", EVENT_TYPE_HEADER]));
            }
            Format::CloudEvents { source, structured } => {
                let event_type = m
                    .headers
                    .get(EVENT_TYPE_HEADER)
                    .map_or(m.topic.as_str(), String::as_str);
                let time = m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true);
                let mut subject: Option<&str> = None;
                let mut extensions: Vec<(&str, &str)> = Vec::new();
                for (k, v) in &m.headers {
                    match cloudevents_attribute(k)? {
                        Some("subject") => subject = Some(v),
                        Some(name) => extensions.push((name, v)),
                        None => {}
                    }
                }
                let required = ["1.0", id.as_str(), source, event_type, time.as_str()];
                let others = passed_on(m, &[EVENT_TYPE_HEADER, "content-type"])
                    .filter(|(k, _)| !k.starts_with(CLOUDEVENTS_HEADER_PREFIX));
                if *structured {
                    let envelope = Envelope {
                        required,
                        subject,
                        extensions: &extensions,
                        data: &m.payload,
                    };
                    record.value =
                        Some(serde_json::to_vec(&envelope).expect("an envelope serializes"));
                    record
                        .headers
                        .push(("content-type".into(), "application/cloudevents+json".into()));
                } else {
                    record.value = Some(json(&m.payload));
                    record.headers = Vec::with_capacity(m.headers.len() + 7);
                    for ((_, header), v) in CE_REQUIRED.iter().zip(required) {
                        record.headers.push(((*header).into(), v.to_owned()));
                    }
                    if let Some(s) = subject {
                        record.headers.push(("ce_subject".into(), s.to_owned()));
                    }
                    for (name, v) in extensions {
                        record.headers.push((
                            format!("{CLOUDEVENTS_HEADER_PREFIX}{name}").into(),
                            v.into(),
                        ));
                    }
                    record
                        .headers
                        .push(("content-type".into(), "application/json".into()));
                }
                record.headers.extend(others);
            }
        }
        Ok(record)
    }
}

#[cfg(test)]
mod tests;
