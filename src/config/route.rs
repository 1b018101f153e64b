//! `[[routes]]`: which topics go to which sink, and for Kafka, to which Kafka topic in which record
//! format.

use serde::{Deserialize, Serialize};

use crate::sink::record::{Format, RecordLayout, TopicTemplate};

/// `[[routes]]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Exact names or globs (`orders.*`, `*`).
    pub topics: Vec<String>,
    /// `kafka` or `log`.
    pub sink: String,
    /// The Kafka topic: a name, or a template of `{topic}`, `{topic[N]}` (a dot-separated segment,
    /// from 0; negative from the end) and `{header:NAME}`. Default: the message's topic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka_topic: Option<String>,
    /// `postbox` (default), `debezium` or `cloudevents`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// debezium: the payload as JSON instead of a JSON string of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expand_payload: Option<bool>,
    /// postbox, debezium: a `null` or `""` payload is sent as a tombstone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tombstone_on_empty: Option<bool>,
    /// cloudevents: the `source` attribute (a URI-reference), required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// cloudevents: `binary` (default) or `structured`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_mode: Option<String>,
}

/// The record formats a Kafka route may name.
pub const FORMAT_NAMES: [&str; 3] = ["postbox", "debezium", "cloudevents"];

impl Route {
    /// The route's Kafka topic template and record format, or the field that is wrong and why.
    pub fn layout(&self) -> Result<RecordLayout, (&'static str, String)> {
        let topic = match &self.kafka_topic {
            None => TopicTemplate::default(),
            Some(t) => TopicTemplate::parse(t).map_err(|e| ("kafka_topic", e))?,
        };
        let format_name = self.format.as_deref().unwrap_or("postbox");
        let only_for = |field: &'static str, set: bool, format: &str| {
            if set && format_name != format {
                Err((field, format!("applies to format = \"{format}\" only")))
            } else {
                Ok(())
            }
        };
        only_for("expand_payload", self.expand_payload.is_some(), "debezium")?;
        only_for("source", self.source.is_some(), "cloudevents")?;
        only_for("content_mode", self.content_mode.is_some(), "cloudevents")?;
        if self.tombstone_on_empty.is_some() && format_name == "cloudevents" {
            return Err((
                "tombstone_on_empty",
                "a CloudEvent always has its attributes: no tombstones with format = \"cloudevents\""
                    .into(),
            ));
        }
        let tombstone_on_empty = self.tombstone_on_empty.unwrap_or(false);
        let format = match format_name {
            "postbox" => Format::Postbox { tombstone_on_empty },
            "debezium" => Format::Debezium {
                expand_payload: self.expand_payload.unwrap_or(false),
                tombstone_on_empty,
            },
            "cloudevents" => {
                let source = self.source.clone().unwrap_or_default();
                if source.trim().is_empty() {
                    return Err((
                        "source",
                        "format = \"cloudevents\" needs the events' source (a URI-reference, \
                         such as \"/shop/orders\" or \"urn:shop:orders\")"
                            .into(),
                    ));
                }
                if source.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return Err((
                        "source",
                        format!("{source:?} is not a URI-reference (no spaces)"),
                    ));
                }
                let structured = match self.content_mode.as_deref().unwrap_or("binary") {
                    "binary" => false,
                    "structured" => true,
                    other => {
                        return Err((
                            "content_mode",
                            format!("unknown content mode {other:?} (binary or structured)"),
                        ));
                    }
                };
                Format::CloudEvents { source, structured }
            }
            other => {
                return Err((
                    "format",
                    format!("unknown format {other:?} (expected one of {FORMAT_NAMES:?})"),
                ));
            }
        };
        // Topics the route names exactly: the template must give each a valid Kafka topic now,
        // not at its first message (headers are only known then).
        if !topic.uses_headers() {
            for t in self.topics.iter().filter(|t| !t.contains('*')) {
                topic
                    .render_for(t, &Default::default())
                    .map_err(|e| ("kafka_topic", e))?;
            }
        }
        Ok(RecordLayout { topic, format })
    }

    /// True when the route sets anything only a Kafka route can use.
    pub fn has_kafka_settings(&self) -> Option<&'static str> {
        [
            ("kafka_topic", self.kafka_topic.is_some()),
            ("format", self.format.is_some()),
            ("expand_payload", self.expand_payload.is_some()),
            ("tombstone_on_empty", self.tombstone_on_empty.is_some()),
            ("source", self.source.is_some()),
            ("content_mode", self.content_mode.is_some()),
        ]
        .into_iter()
        .find(|(_, set)| *set)
        .map(|(field, _)| field)
    }
}
