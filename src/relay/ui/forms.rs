//! The console's forms that change the queue beyond the dead letters: cancel every live message
//! of a topic (confirmed by typing its name), run a schedule now, enqueue one message. Each needs
//! what every action needs (see `actions::may_act`) and is audit-logged.

use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::json;

use super::actions::audit;
use super::actions::may_act;
use super::html::{self, esc};
use super::{Csrf, Shared, Ui, answer, database_error, refuse};
use crate::store::CancelSelector;

/// The topic of a cancel, and (in the POST) the name typed again to confirm it.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
pub(super) struct CancelForm {
    topic: String,
    confirm: String,
    csrf: String,
}

/// `GET /topics/cancel?topic=T`: what a cancel would do, and the form that confirms it.
pub(super) async fn cancel_form(
    State(ui): Shared,
    headers: HeaderMap,
    Query(f): Query<CancelForm>,
) -> Response {
    let csrf = Csrf::of(&headers);
    if f.topic.trim().is_empty() || f.topic.contains('\0') {
        return refuse(&ui, &headers, bad("topic: name the topic to cancel"));
    }
    let stats = match ui.store.stats().await {
        Ok(s) => s,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let live = stats
        .topics
        .iter()
        .find(|t| t.topic == f.topic)
        .map(|t| t.available + t.scheduled + t.running + t.waiting)
        .unwrap_or(0);
    let about = if stats.estimated { "about " } else { "" };
    let mut body = format!(
        "<p>Cancel every live message of <strong>{t}</strong>: {about}{live}. Those not running go to the \
         dead letters with reason <code>cancelled</code> (they can be replayed); running ones finish \
         their attempt and are not retried.</p>",
        t = esc(&f.topic)
    );
    if ui.settings.actions {
        body += &format!(
            "<form method=\"post\" action=\"{p}/topics/cancel\"><input type=\"hidden\" name=\"topic\" value=\"{t}\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{c}\">\
             <label>Type the topic's name to confirm <input name=\"confirm\" autocomplete=\"off\"></label> \
             <button>Cancel all of {t}</button></form>",
            p = esc(&ui.settings.path_prefix),
            t = esc(&f.topic),
            c = esc(&csrf.value)
        );
    }
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        "Cancel a topic",
        body,
        json!({ "topic": f.topic, "live": live, "estimated": stats.estimated }),
    )
}

/// `POST /topics/cancel`: cancels every live message of the topic, if `confirm` is its name.
pub(super) async fn cancel(
    State(ui): Shared,
    headers: HeaderMap,
    Form(f): Form<CancelForm>,
) -> Response {
    let csrf = Csrf::of(&headers);
    let who = match may_act(&ui, &headers, &f.csrf) {
        Ok(w) => w,
        Err(r) => return refuse(&ui, &headers, r),
    };
    if f.topic.contains('\0') {
        return refuse(
            &ui,
            &headers,
            bad("topic: contains a NUL character, which no topic can hold"),
        );
    }
    if f.topic.is_empty() || f.confirm != f.topic {
        return refuse(
            &ui,
            &headers,
            bad("confirm: type the topic's name exactly to cancel all of it"),
        );
    }
    let done = match ui.act.cancel(&CancelSelector::Topic(f.topic.clone())).await {
        Ok(d) => d,
        Err(e) => return database_error(&ui, &headers, e),
    };
    audit!(who, "cancelled", topic = ?f.topic, dead = done.dead, running = done.running);
    super::done(
        &ui,
        &headers,
        &csrf,
        &format!(
            "cancelled {}: {} to the dead letters, {} running will not be retried",
            f.topic, done.dead, done.running
        ),
        (&html::home(&ui.settings.path_prefix), "Overview"),
        json!({ "cancelled": done.dead, "running": done.running }),
    )
}

/// The schedule to run now.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
pub(super) struct RunForm {
    name: String,
    csrf: String,
}

/// `POST /schedules/run`: enqueues one message of a schedule this relay runs, now, with a dedup key
/// of its own (the ticks' keys are left alone: the next tick still fires).
pub(super) async fn run_schedule(
    State(ui): Shared,
    headers: HeaderMap,
    Form(f): Form<RunForm>,
) -> Response {
    let csrf = Csrf::of(&headers);
    let who = match may_act(&ui, &headers, &f.csrf) {
        Ok(w) => w,
        Err(r) => return refuse(&ui, &headers, r),
    };
    let Some(schedule) = ui.relay.schedules.iter().find(|s| s.name() == f.name) else {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::NOT_FOUND,
                format!("name: this relay runs no schedule {:?}", f.name),
            ),
        );
    };
    let now = chrono::Utc::now();
    let msg = schedule.message_for(now).dedup_key(format!(
        "schedule:{}:run-now:{}",
        schedule.name(),
        &super::guard::new_csrf_token()[..16]
    ));
    let id = match ui.act.enqueue(&msg).await {
        Ok(crate::Enqueued::New(id)) => id,
        Ok(crate::Enqueued::Duplicate { .. }) => {
            return refuse(
                &ui,
                &headers,
                (
                    StatusCode::CONFLICT,
                    "a message with this run's dedup key exists; run it again".into(),
                ),
            );
        }
        Err(e) => return database_error(&ui, &headers, e),
    };
    audit!(who, "ran schedule", schedule = ?schedule.name(), id);
    super::done(
        &ui,
        &headers,
        &csrf,
        &format!("enqueued message {id} of schedule {}", schedule.name()),
        (&html::home(&ui.settings.path_prefix), "Overview"),
        json!({ "enqueued": id, "schedule": schedule.name() }),
    )
}

/// A message to enqueue, as typed in the form.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
pub(super) struct EnqueueForm {
    topic: String,
    key: String,
    ordered: String,
    headers: String,
    payload: String,
    delay: String,
    csrf: String,
}

/// `GET /enqueue`: the form.
pub(super) async fn enqueue_form(State(ui): Shared, headers: HeaderMap) -> Response {
    let csrf = Csrf::of(&headers);
    let body = enqueue_body(&ui, &csrf, &EnqueueForm::default());
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        "Enqueue",
        body,
        json!({ "fields": ["topic", "key", "ordered", "headers", "payload", "delay"] }),
    )
}

fn enqueue_body(ui: &Ui, csrf: &Csrf, f: &EnqueueForm) -> String {
    if !ui.settings.actions {
        return "<p>The console is read-only ([ui] actions = false).</p>".into();
    }
    let mut out = format!(
        "<form class=\"filter enqueue\" method=\"post\" action=\"{}/enqueue\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">",
        esc(&ui.settings.path_prefix),
        esc(&csrf.value)
    );
    out += &html::input("topic", "Topic", &f.topic, "orders.created");
    out += &html::input("key", "Key", &f.key, "");
    out += &format!(
        "<label>Ordered<input type=\"checkbox\" name=\"ordered\" value=\"on\"{}></label>",
        if f.ordered.is_empty() { "" } else { " checked" }
    );
    out += &html::input("delay", "Delay", &f.delay, "30s");
    out += &format!(
        "<label>Headers (JSON object of strings)<textarea name=\"headers\" rows=\"3\" cols=\"40\" placeholder=\"{{&quot;type&quot;: &quot;x&quot;}}\">{}</textarea></label>",
        esc(&f.headers)
    );
    out += &format!(
        "<label>Payload (JSON)<textarea name=\"payload\" rows=\"6\" cols=\"60\" placeholder=\"{{&quot;customer&quot;: &quot;c-42&quot;}}\">{}</textarea></label>",
        esc(&f.payload)
    );
    out += "<button type=\"submit\">Enqueue</button></form>";
    out
}

/// The message the form describes, validated as the API validates it; or the field and why not.
fn message_of(f: &EnqueueForm) -> Result<crate::Message, String> {
    let payload: serde_json::Value = match f.payload.trim() {
        "" => serde_json::Value::Null,
        p => serde_json::from_str(p).map_err(|e| format!("payload: not valid JSON ({e})"))?,
    };
    let mut msg = crate::Message::new(f.topic.trim()).payload(&payload);
    if !f.key.is_empty() {
        msg = msg.key(f.key.clone());
    }
    if !f.ordered.is_empty() {
        msg = msg.ordered();
    }
    if !f.headers.trim().is_empty() {
        let h: serde_json::Value = serde_json::from_str(f.headers.trim())
            .map_err(|e| format!("headers: not valid JSON ({e})"))?;
        msg = msg.headers_json(h);
    }
    if !f.delay.trim().is_empty() {
        let d = crate::config::parse_duration(f.delay.trim()).map_err(|e| format!("delay: {e}"))?;
        if d > std::time::Duration::from_secs(100 * 365 * 86_400) {
            return Err("delay: at most 100 years".into());
        }
        msg = msg.delay(d);
    }
    msg.validate().map_err(|e| e.to_string())?;
    Ok(msg)
}

/// `POST /enqueue`: enqueues the form's message; a mistake shows the form again with the reason.
pub(super) async fn enqueue(
    State(ui): Shared,
    headers: HeaderMap,
    Form(f): Form<EnqueueForm>,
) -> Response {
    let csrf = Csrf::of(&headers);
    let who = match may_act(&ui, &headers, &f.csrf) {
        Ok(w) => w,
        Err(r) => return refuse(&ui, &headers, r),
    };
    let msg = match message_of(&f) {
        Ok(m) => m,
        Err(e) => {
            let body = html::error(&e) + &enqueue_body(&ui, &csrf, &f);
            return answer(
                &ui,
                &headers,
                &csrf,
                StatusCode::BAD_REQUEST,
                "Enqueue",
                body,
                json!({ "error": e }),
            );
        }
    };
    let id = match ui.act.enqueue(&msg).await {
        Ok(crate::Enqueued::New(id)) => id,
        Ok(crate::Enqueued::Duplicate { existing }) => {
            return refuse(
                &ui,
                &headers,
                (
                    StatusCode::CONFLICT,
                    format!("a live message holds this dedup key: {existing:?}"),
                ),
            );
        }
        Err(e) => return database_error(&ui, &headers, e),
    };
    audit!(who, "enqueued", topic = ?msg.topic_name(), id);
    let p = esc(&ui.settings.path_prefix);
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        "Enqueued",
        format!(
            "<p class=\"notice\" role=\"status\">enqueued message <a href=\"{p}/messages/{id}\">{id}</a></p>{}",
            enqueue_body(&ui, &csrf, &EnqueueForm::default())
        ),
        json!({ "enqueued": id }),
    )
}

fn bad(message: &str) -> super::guard::Refusal {
    (StatusCode::BAD_REQUEST, message.to_owned())
}
