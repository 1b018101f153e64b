//! The stream encoding: what `publish` writes into the WAL, and what the relay reads back.
//!
//! A published message is a transactional logical-decoding message with prefix [`PREFIX`] whose
//! content is one JSON object, version 1:
//!
//! ```json
//! {"v": 1, "topic": "order.created", "key": "order-42", "headers": {"trace": "abc"},
//!  "payload": {"order_id": 42}, "created_at": "2026-12-02T21:00:00.123456Z"}
//! ```
//!
//! - `v` (required): the version, 1. A relay dead-letters a version it does not know.
//! - `topic` (required): a non-empty string.
//! - `key`: a string or null; the Kafka record key.
//! - `headers`: an object of string values (default empty); names starting with `postbox-` are
//!   the relay's own and are not forwarded.
//! - `payload`: any JSON value (default `{}`).
//! - `created_at`: an RFC 3339 time on the writer's clock; without it, the transaction's commit
//!   time is used.
//!
//! Unknown fields are ignored, so a later version 1 writer may add optional ones. A writer in
//! another language publishes with `SELECT postbox.publish(ARRAY['{"v":1,"topic":"t"}'])` (checks
//! that a stream slot exists) or plainly with
//! `SELECT pg_logical_emit_message(true, 'postbox', '{"v":1,"topic":"t"}')`. A message emitted
//! with `transactional = false` is dead-lettered, never delivered: PostgreSQL streams it at once,
//! even when its transaction rolls back. Content PostgreSQL cannot store in a dead letter (a NUL)
//! is stored with U+FFFD in its place.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// The prefix of postbox's logical-decoding messages; messages with other prefixes are not ours.
pub const PREFIX: &str = "postbox";

/// The encoding version this build writes and reads.
pub const VERSION: u32 = 1;

/// One message as encoded in the WAL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Encoded {
    /// The encoding version ([`VERSION`]).
    pub v: u32,
    /// Where it goes.
    pub topic: String,
    /// The Kafka record key, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Headers (string values).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The payload.
    #[serde(default = "empty_object")]
    pub payload: serde_json::Value,
    /// When the writer published it, on the writer's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// Why a stream message's content cannot be read; the relay dead-letters it with this reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not a JSON object of the expected shape.
    #[error("not a postbox stream message: {0}")]
    Malformed(String),
    /// A version this relay does not read.
    #[error("stream encoding version {0} is not known to this relay (it reads version {VERSION})")]
    Version(u64),
    /// The topic is empty.
    #[error("topic: must not be empty")]
    EmptyTopic,
}

impl Encoded {
    /// The content to emit.
    pub fn to_content(&self) -> String {
        serde_json::to_string(self).expect("a message of JSON values serializes")
    }

    /// Reads a content in one pass; only when that fails is the version read on its own, so a
    /// later version's shape gets the version error.
    pub fn decode(content: &[u8]) -> Result<Encoded, DecodeError> {
        match serde_json::from_slice::<Encoded>(content) {
            Ok(m) if m.v != VERSION => Err(DecodeError::Version(u64::from(m.v))),
            Ok(m) if m.topic.is_empty() => Err(DecodeError::EmptyTopic),
            Ok(m) => Ok(m),
            Err(e) => {
                #[derive(Deserialize)]
                struct Version {
                    v: Option<serde_json::Value>,
                }
                Err(
                    match serde_json::from_slice::<Version>(content).map(|v| v.v) {
                        Ok(Some(serde_json::Value::Number(n)))
                            if n.as_u64().is_some_and(|v| v != u64::from(VERSION)) =>
                        {
                            DecodeError::Version(n.as_u64().unwrap_or_default())
                        }
                        Ok(Some(serde_json::Value::Number(_))) => {
                            DecodeError::Malformed(e.to_string())
                        }
                        Ok(Some(other)) => DecodeError::Malformed(format!(
                            "v: must be the version number, got {other}"
                        )),
                        Ok(None) => DecodeError::Malformed("v: missing".into()),
                        Err(e) => DecodeError::Malformed(e.to_string()),
                    },
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_sql_writer_needs_only_the_version_and_a_topic() {
        let m = Encoded::decode(br#"{"v":1,"topic":"t"}"#).unwrap();
        assert_eq!(m.topic, "t");
        assert_eq!(m.payload, serde_json::json!({}));
        assert!(m.key.is_none() && m.headers.is_empty() && m.created_at.is_none());
        let m = Encoded::decode(
            br#"{"v":1,"topic":"t","key":"k","headers":{"a":"b"},"payload":[1],"created_at":"2026-12-02T21:00:00Z","later":true}"#,
        )
        .unwrap();
        assert_eq!(m.key.as_deref(), Some("k"));
        assert_eq!(m.headers["a"], "b");
        assert_eq!(m.payload, serde_json::json!([1]));
        assert_eq!(Encoded::decode(m.to_content().as_bytes()).unwrap(), m);
    }

    #[test]
    fn what_cannot_be_read_says_why() {
        for (content, why) in [
            (&br#"{"v":2,"topic":"t","shape":"new"}"#[..], "version 2"),
            (br#"{"topic":"t"}"#, "v: missing"),
            (br#"{"v":"1","topic":"t"}"#, "v: must be"),
            (br#"{"v":1,"topic":""}"#, "topic"),
            (br#"{"v":1,"topic":"t","headers":{"a":1}}"#, "invalid type"),
            (b"not json", "not a postbox"),
        ] {
            let e = Encoded::decode(content).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }
}
