//! Trace context across the queue (feature `otel`): an enqueue records the current OpenTelemetry
//! context as W3C `traceparent` / `tracestate` headers, unless the message already has them; the
//! handlers sink runs each handler inside a span that continues that trace (first attempt) or
//! links to it (retries, which start a trace of their own, as OpenTelemetry's messaging
//! conventions advise for redeliveries). The Kafka sink forwards the headers as they are, so a
//! Kafka consumer continues the trace the same way.
//!
//! The current context is `opentelemetry::Context::current()`: with `tracing` and
//! `tracing-opentelemetry`, attach the span's context (`span.context().attach()`) around the
//! enqueue.

use std::collections::{BTreeMap, HashMap};

use opentelemetry::Context;
#[cfg(feature = "engine")]
use opentelemetry::propagation::Extractor;
use opentelemetry::propagation::TextMapPropagator;
#[cfg(feature = "engine")]
use opentelemetry::trace::{Link, SpanKind, TraceContextExt, Tracer};
#[cfg(feature = "engine")]
use opentelemetry::{KeyValue, global};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The headers that carry the trace context.
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// Adds the current context's `traceparent` (and `tracestate`) to `headers`, unless the message
/// names either already or there is no current span.
pub(crate) fn inject(headers: &mut BTreeMap<String, String>) {
    if TRACE_HEADERS.iter().any(|h| headers.contains_key(*h)) {
        return;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&Context::current(), &mut carrier);
    headers.extend(carrier);
}

#[cfg(feature = "engine")]
struct Headers<'a>(&'a BTreeMap<String, String>);

#[cfg(feature = "engine")]
impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

#[cfg(feature = "engine")]
/// The context a handler runs in: a new consumer span, child of the enqueuer's context on the
/// first attempt, a new trace linked to it on later ones. Attributes: topic, id, attempt.
pub(crate) fn handler_context(
    topic: &str,
    id: i64,
    attempt: i32,
    headers: &BTreeMap<String, String>,
) -> Context {
    let sent = TraceContextPropagator::new().extract(&Headers(headers));
    let sent_span = sent.span().span_context().clone();
    let tracer = global::tracer("postbox");
    let mut builder = tracer
        .span_builder(format!("{topic} process"))
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("messaging.system", "postbox"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.destination.name", topic.to_owned()),
            KeyValue::new("messaging.message.id", id.to_string()),
            KeyValue::new("postbox.attempt", i64::from(attempt)),
        ]);
    let parent = if attempt <= 1 || !sent_span.is_valid() {
        sent
    } else {
        builder = builder.with_links(vec![Link::with_context(sent_span)]);
        Context::new()
    };
    let span = builder.start_with_context(&tracer, &parent);
    parent.with_span(span)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_trace_header_is_kept_and_no_span_adds_nothing() {
        let mut h = BTreeMap::from([("traceparent".to_owned(), "mine".to_owned())]);
        inject(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["traceparent"], "mine");
        let mut empty = BTreeMap::new();
        inject(&mut empty);
        assert!(empty.is_empty(), "no current span: {empty:?}");
    }
}
