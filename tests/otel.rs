//! Trace context across the queue (feature `otel`), against a real PostgreSQL and an in-memory
//! span exporter: the enqueuer's trace continues in the handler on the first attempt, a retry
//! starts its own trace linked to it, and a message that carries its own traceparent keeps it.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestDb, enqueue};
use opentelemetry::trace::{SpanId, TraceContextExt, Tracer, TracerProvider as _};
use opentelemetry::{Context, KeyValue, Value, global};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use postbox::Message;
use postbox::engine::Engine;
use postbox::sink::handlers::{HandlerError, Handlers, Job};
use tokio_util::sync::CancellationToken;

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv: &&KeyValue| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_started_at_enqueue_continues_in_the_handler_and_retries_link_to_it() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    global::set_tracer_provider(provider.clone());
    let db = TestDb::migrated();

    // The request that writes the messages, with a span of its own.
    let tracer = provider.tracer("app");
    let request = tracer.start("POST /orders");
    let request_cx = Context::current_with_span(request);
    let sent = request_cx.span().span_context().clone();
    let theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let ids = {
        let _attached = request_cx.clone().attach();
        enqueue(
            &db,
            vec![
                Message::new("orders").payload(&"once"),
                Message::new("orders").payload(&"twice"),
                Message::new("orders")
                    .payload(&"theirs")
                    .header("traceparent", theirs),
            ],
        )
    };
    request_cx.span().end();
    common::move_intake(&db);
    let headers = |id: i64| {
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {id} AND headers->>'traceparent' = '00-{}-{}-01'",
            sent.trace_id(),
            sent.span_id()
        ))
    };
    assert_eq!(
        headers(ids[0]),
        1,
        "the enqueue records the current context"
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) AS v FROM postbox.messages WHERE id = {} AND headers->>'traceparent' = '{theirs}'",
            ids[2]
        )),
        1,
        "a traceparent the app set is kept"
    );

    // Handlers: "twice" fails its first attempt; each attempt notes the trace it runs in.
    let seen: Arc<Mutex<Vec<(String, i32, String)>>> = Default::default();
    let s = seen.clone();
    let handlers = Handlers::new().on("orders", move |job: Job<String>| {
        let s = s.clone();
        async move {
            let cx = Context::current();
            let trace = cx.span().span_context().trace_id().to_string();
            s.lock()
                .unwrap()
                .push((job.payload.clone(), job.attempt, trace));
            if job.payload == "twice" && job.attempt == 1 {
                Err(HandlerError::retry_after("not yet", Duration::ZERO))
            } else {
                Ok(())
            }
        }
    });
    let engine = Engine::builder(db.url.clone())
        .handlers(handlers)
        .drain(true)
        .build()
        .await
        .unwrap();
    let report = engine.run(CancellationToken::new()).await.unwrap();
    assert_eq!(report.delivered, 3, "{report:?}");

    let spans = exporter.get_finished_spans().unwrap();
    let process: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == "orders process")
        .collect();
    assert_eq!(process.len(), 4, "one span per attempt: {spans:#?}");
    let of = |id: i64, attempt: i64| {
        *process
            .iter()
            .find(|s| {
                attribute(s, "messaging.message.id") == Some(&Value::from(id.to_string()))
                    && attribute(s, "postbox.attempt") == Some(&Value::I64(attempt))
            })
            .unwrap_or_else(|| panic!("no span for message {id} attempt {attempt}"))
    };
    // First attempts: children of the request's span, in its trace.
    for id in [ids[0], ids[1]] {
        let s = of(id, 1);
        assert_eq!(s.span_context.trace_id(), sent.trace_id());
        assert_eq!(s.parent_span_id, sent.span_id());
        assert_eq!(
            attribute(s, "messaging.destination.name"),
            Some(&Value::from("orders"))
        );
    }
    // The retry: a trace of its own, linked to the request's span.
    let retry = of(ids[1], 2);
    assert_ne!(retry.span_context.trace_id(), sent.trace_id());
    assert_eq!(retry.parent_span_id, SpanId::INVALID);
    assert!(
        retry
            .links
            .iter()
            .any(|l| l.span_context.span_id() == sent.span_id()),
        "{retry:#?}"
    );
    // The app's own traceparent is the parent of its message's span.
    let own = of(ids[2], 1);
    assert_eq!(
        own.span_context.trace_id().to_string(),
        "0af7651916cd43dd8448eb211c80319c"
    );
    // The handler itself ran inside its span's context.
    let seen = seen.lock().unwrap();
    let once = seen.iter().find(|(p, _, _)| p == "once").unwrap();
    assert_eq!(once.2, sent.trace_id().to_string());
}
