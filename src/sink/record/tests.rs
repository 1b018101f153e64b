use std::collections::BTreeMap;

use super::*;

fn message(topic: &str, headers: &[(&str, &str)], payload: Value) -> ClaimedMessage {
    let at = chrono::DateTime::parse_from_rfc3339("2026-12-03T07:00:00.123456Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    ClaimedMessage {
        id: 42,
        topic: topic.into(),
        key: Some("order-7".into()),
        ordered: false,
        payload,
        headers: headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        priority: 0,
        run_at: at,
        attempts: 1,
        max_attempts: 25,
        created_at: at,
        locked_until: at,
        lease_token: 1,
        last_error: None,
        dedup_key: None,
        undecodable: None,
        stream_id: None,
    }
}

fn headers(r: &Record) -> BTreeMap<&str, &str> {
    r.headers
        .iter()
        .map(|(k, v)| (k.as_ref(), v.as_str()))
        .collect()
}

fn layout(format: Format) -> RecordLayout {
    RecordLayout {
        topic: TopicTemplate::default(),
        format,
    }
}

#[test]
fn templates_refuse_what_cannot_name_a_kafka_topic() {
    for (t, why) in [
        ("outbox.event.{topic", "without its '}'"),
        ("outbox}", "without its '{'"),
        ("outbox/{topic}", "'/'"),
        ("{aggregate}", "unknown placeholder {aggregate}"),
        ("{topic[x]}", "whole number"),
        ("{header:}", "name the header"),
        ("..", "cannot be a Kafka topic name"),
        ("", "empty"),
    ] {
        let e = TopicTemplate::parse(t).unwrap_err();
        assert!(e.contains(why), "{t:?}: {e}");
    }
    let long = "x".repeat(250);
    assert!(TopicTemplate::parse(&long).unwrap_err().contains("249"));
    assert!(TopicTemplate::parse(&format!("{long}{{topic}}")).is_err());
    assert_eq!(
        TopicTemplate::parse("orders-v2").unwrap().constant(),
        Some("orders-v2")
    );
}

#[test]
fn templates_render_topics_segments_and_headers_and_refuse_what_they_cannot() {
    let t = TopicTemplate::parse("outbox.event.{topic[-1]}").unwrap();
    let none = BTreeMap::new();
    assert_eq!(
        t.render_for("shop.order", &none).unwrap(),
        "outbox.event.order"
    );
    let t = TopicTemplate::parse("{topic[0]}-{header:region}.{topic}").unwrap();
    assert!(t.uses_headers() && t.constant().is_none());
    let h: BTreeMap<String, String> = [("region".to_owned(), "eu".to_owned())].into();
    assert_eq!(
        t.render_for("shop.order", &h).unwrap(),
        "shop-eu.shop.order"
    );
    let e = t.render_for("shop.order", &none).unwrap_err();
    assert!(e.contains("header \"region\" is missing"), "{e}");
    let bad: BTreeMap<String, String> = [("region".to_owned(), "eu/west".to_owned())].into();
    let e = t.render_for("shop.order", &bad).unwrap_err();
    assert!(
        e.contains("\"shop-eu/west.shop.order\"") && e.contains("'/'"),
        "{e}"
    );
    let e = TopicTemplate::default()
        .render_for("orders/eu", &none)
        .unwrap_err();
    assert!(
        e.starts_with("topic \"orders/eu\" cannot be a Kafka topic"),
        "{e}"
    );
    let e = TopicTemplate::parse("x.{topic[3]}")
        .unwrap()
        .render_for("a.b", &none)
        .unwrap_err();
    assert!(e.contains("no segment [3]"), "{e}");
}

#[test]
fn the_postbox_format_is_unchanged_and_may_send_tombstones() {
    let m = message("orders", &[("trace", "t1")], serde_json::json!({"n": 1}));
    let r = layout(Format::default()).record(&m).unwrap();
    assert_eq!(r.topic, "orders");
    assert_eq!(r.key.as_deref(), Some("order-7"));
    assert_eq!(r.value.as_deref(), Some(&br#"{"n":1}"#[..]));
    assert_eq!(r.timestamp_ms, None);
    let h = headers(&r);
    assert_eq!(h["postbox-id"], "42");
    assert_eq!(h["postbox-topic"], "orders");
    assert_eq!(h["trace"], "t1");
    let null = message("orders", &[], Value::Null);
    let plain = layout(Format::default()).record(&null).unwrap();
    assert_eq!(plain.value.as_deref(), Some(&b"null"[..]));
    let tomb = layout(Format::Postbox {
        tombstone_on_empty: true,
    })
    .record(&null)
    .unwrap();
    assert_eq!(tomb.value, None);
}

#[test]
fn the_debezium_format_is_what_the_outbox_event_router_sends() {
    let m = message(
        "order",
        &[("type", "OrderCreated"), ("trace", "t1"), ("id", "spoof")],
        serde_json::json!({"n": 1}),
    );
    let d = |expand_payload, tombstone_on_empty| {
        layout(Format::Debezium {
            expand_payload,
            tombstone_on_empty,
        })
    };
    let r = d(false, false).record(&m).unwrap();
    assert_eq!(r.value.as_deref(), Some(&br#""{\"n\":1}""#[..]));
    assert_eq!(r.key.as_deref(), Some("order-7"));
    assert_eq!(
        r.timestamp_ms,
        Some(m.created_at.timestamp_millis()),
        "the creation time"
    );
    assert_eq!(
        r.headers,
        [
            ("id".into(), "42".to_owned()),
            ("eventType".into(), "OrderCreated".to_owned()),
            ("trace".into(), "t1".to_owned()),
        ]
    );
    let r = d(true, false).record(&m).unwrap();
    assert_eq!(r.value.as_deref(), Some(&br#"{"n":1}"#[..]));
    let mut streamed = message("order", &[], Value::String(String::new()));
    streamed.stream_id = Some("0/16B3748-0".into());
    let r = d(false, true).record(&streamed).unwrap();
    assert_eq!(r.value, None, "an empty payload is a tombstone");
    assert_eq!(headers(&r)["id"], "0/16B3748-0");
    assert!(!headers(&r).contains_key("eventType"));
}

#[test]
fn cloudevents_records_carry_every_required_attribute_in_either_mode() {
    let m = message(
        "shop.order",
        &[
            ("type", "com.example.order.created"),
            ("ce_region", "eu"),
            ("traceparent", "00-abc-def-01"),
            ("content-type", "text/plain"),
        ],
        serde_json::json!({"n": 1}),
    );
    let ce = |structured| {
        layout(Format::CloudEvents {
            source: "/shop/orders".into(),
            structured,
        })
    };
    let r = ce(false).record(&m).unwrap();
    let h = headers(&r);
    assert_eq!(h["ce_specversion"], "1.0");
    assert_eq!(h["ce_id"], "42");
    assert_eq!(h["ce_source"], "/shop/orders");
    assert_eq!(h["ce_type"], "com.example.order.created");
    assert_eq!(h["ce_time"], "2026-12-03T07:00:00.123456Z");
    assert!(
        !h.contains_key("ce_subject"),
        "no ce_subject header, no subject"
    );
    assert_eq!(r.key.as_deref(), Some("order-7"));
    assert_eq!(h["ce_region"], "eu");
    assert_eq!(h["content-type"], "application/json");
    assert_eq!(h["traceparent"], "00-abc-def-01");
    assert!(!h.contains_key("type"));
    assert_eq!(
        r.headers
            .iter()
            .filter(|(k, _)| k == "content-type")
            .count(),
        1,
        "the relay's content-type only"
    );
    assert_eq!(r.value.as_deref(), Some(&br#"{"n":1}"#[..]));

    let r = ce(true).record(&m).unwrap();
    let h = headers(&r);
    assert_eq!(h["content-type"], "application/cloudevents+json");
    assert!(!h.keys().any(|k| k.starts_with("ce_")));
    let envelope: Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
    assert_eq!(
        envelope,
        serde_json::json!({
            "specversion": "1.0", "id": "42", "source": "/shop/orders",
            "type": "com.example.order.created", "time": "2026-12-03T07:00:00.123456Z",
            "region": "eu",
            "datacontenttype": "application/json", "data": {"n": 1}
        })
    );

    // No type header: the topic is the type; ce_subject is the subject.
    let m = message("shop.order", &[("ce_subject", "s-1")], Value::Null);
    let h = ce(false).record(&m).unwrap();
    assert_eq!(headers(&h)["ce_type"], "shop.order");
    assert_eq!(headers(&h)["ce_subject"], "s-1");
    // A header the binding cannot carry (inserted by plain SQL, past enqueue's check).
    let m = message("shop.order", &[("ce_Bad-Name", "x")], Value::Null);
    let e = ce(false).record(&m).unwrap_err();
    assert!(e.contains("ce_Bad-Name"), "{e}");
}
