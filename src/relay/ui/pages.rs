//! The console's pages: the overview, the lists of messages and dead letters, a message.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::json;

use super::html::{self, FilterText, esc, parse_filter};
use super::{ACT_MAX, Csrf, PAGE_DEFAULT, Shared, answer, database_error, refuse};
use crate::store::browse::{Filter, PAGE_MAX};

/// The pause that holds `topic`: its own name if it is paused by name, else the first pattern
/// that matches it (the claims' own rule).
fn paused_by<'a>(paused: &'a [String], topic: &str) -> Option<&'a String> {
    paused.iter().find(|p| p.as_str() == topic).or_else(|| {
        paused
            .iter()
            .find(|p| crate::store::Topics::only([p.as_str()]).matches(topic))
    })
}

pub(super) async fn overview(State(ui): Shared, headers: HeaderMap) -> Response {
    let csrf = Csrf::of(&headers);
    let slot = async {
        match &ui.relay.stream_slot {
            Some(name) => ui.store.stream_status(Some(name)).await,
            None => Ok(Vec::new()),
        }
    };
    let (stats, paused, violations, stalled, slots) = match tokio::try_join!(
        ui.store.stats(),
        ui.store.paused(),
        ui.store.check(100),
        ui.store.stalled_keys(20),
        slot
    ) {
        Ok(x) => x,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let rates = ui
        .relay
        .metrics
        .as_ref()
        .map(|m| ui.rates.topics(m))
        .unwrap_or_default();
    let p = esc(&ui.settings.path_prefix);
    let mut body = String::new();
    body += &format!(
        "<p>{} {}</p>",
        if violations.is_empty() {
            "State model check: no violation."
        } else {
            "State model check:"
        },
        if stats.estimated {
            "<span class=\"muted\">(counts above 50,000 rows are estimates)</span>"
        } else {
            ""
        }
    );
    for v in &violations {
        body += &html::error(&format!(
            "{}: {} {} {}",
            v.kind,
            v.topic.as_deref().unwrap_or(""),
            v.key.as_deref().unwrap_or(""),
            v.detail
        ));
    }
    body += &stream_slots(&slots);
    body += "<table><thead><tr><th>topic</th><th>available</th><th>scheduled</th><th>running</th>\
             <th>waiting</th><th>dead</th><th>oldest available</th>\
             <th title=\"this relay, last minute\">delivered/min</th><th>retried/min</th><th>dead/min</th>\
             <th>last hour</th><th>sink</th><th></th></tr></thead><tbody>";
    // The same rule the claims apply to the pauses.
    let paused_topics = crate::store::Topics::only(&paused);
    let mut rows_json = Vec::new();
    // Topics this relay delivered that have nothing queued now are shown too, for their rates.
    let mut topics = stats.topics.clone();
    for name in rates.keys() {
        if !topics.iter().any(|t| &t.topic == name) {
            topics.push(crate::store::TopicStats {
                topic: name.clone(),
                ..Default::default()
            });
        }
    }
    for t in &topics {
        let is_paused = paused_topics.matches(&t.topic);
        let sink = ui.relay.metrics.as_ref().and_then(|m| m.sink_of(&t.topic));
        let r = rates.get(&t.topic).cloned().unwrap_or_default();
        let action = if !ui.settings.actions {
            String::new()
        } else if t.topic.contains('*') {
            // A pause is a pattern: a `*` in the name would pause other topics too.
            format!(
                "<span class=\"muted\">a * in its name: pause by pattern</span> \
                 <a href=\"{p}/topics/cancel?topic={q}\">Cancel all…</a>",
                q = esc(&html::url_value(&t.topic)),
            )
        } else {
            // A paused topic resumes by the pause that holds it: its name, or the pattern.
            let (verb, label, name) = match paused_by(&paused, &t.topic) {
                Some(pattern) if pattern == &t.topic => ("resume", "Resume".to_owned(), pattern),
                Some(pattern) => ("resume", format!("Resume {pattern}"), pattern),
                None => ("pause", "Pause".to_owned(), &t.topic),
            };
            format!(
                "<form method=\"post\" action=\"{p}/topics/{verb}\"><input type=\"hidden\" name=\"topic\" value=\"{t}\">\
                 <input type=\"hidden\" name=\"csrf\" value=\"{c}\"><button>{label}</button></form> \
                 <a href=\"{p}/topics/cancel?topic={q}\">Cancel all…</a>",
                t = esc(name),
                label = esc(&label),
                c = esc(&csrf.value),
                q = esc(&html::url_value(&t.topic)),
            )
        };
        body += &format!(
            "<tr><td><a href=\"{p}/messages?exact={q}\">{t}</a>{paused}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\"><a href=\"{p}/dead?exact={q}\">{}</a></td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{chart}</td><td class=\"act\">{sink}</td><td class=\"act\">{action}</td></tr>",
            t.available,
            t.scheduled,
            t.running,
            t.waiting,
            t.dead,
            t.oldest_available_secs
                .map(|s| format!("{s:.0} s"))
                .unwrap_or_default(),
            r.last_minute.delivered,
            r.last_minute.retried,
            r.last_minute.dead,
            chart = super::rates::chart(&r),
            sink = match &sink {
                Some((name, true)) => format!("{} <span class=\"up\">up</span>", esc(name)),
                Some((name, false)) => format!("{} <span class=\"down\">down</span>", esc(name)),
                None => "<span class=\"muted\">not routed here</span>".into(),
            },
            q = esc(&html::url_value(&t.topic)),
            t = esc(&t.topic),
            paused = if is_paused {
                " <span class=\"paused\">paused</span>"
            } else {
                ""
            },
        );
        let mut row = serde_json::to_value(t).unwrap_or_default();
        if let Some(o) = row.as_object_mut() {
            o.insert("paused".into(), json!(is_paused));
            o.insert("per_minute".into(), json!(r.last_minute));
            o.insert("last_hour".into(), json!(r.hour));
            o.insert(
                "sink".into(),
                json!(sink.as_ref().map(|(n, up)| json!({"name": n, "up": up}))),
            );
        }
        rows_json.push(row);
    }
    body += "</tbody></table>";
    // Every pause, with its own Resume, and a pause by name: a topic (or pattern) the table does
    // not list (a large table's counts are sampled, and a small topic can be missed) is paused and
    // resumed all the same.
    if ui.settings.actions {
        body += "<h2>Pauses</h2>";
        if paused.is_empty() {
            body += "<p class=\"muted\">Nothing is paused.</p>";
        } else {
            body += "<ul>";
            for pattern in &paused {
                body += &format!(
                    "<li><code>{t}</code> <form method=\"post\" action=\"{p}/topics/resume\"><input type=\"hidden\" name=\"topic\" value=\"{t}\">\
                     <input type=\"hidden\" name=\"csrf\" value=\"{c}\"><button>Resume</button></form></li>",
                    t = esc(pattern),
                    c = esc(&csrf.value),
                );
            }
            body += "</ul>";
        }
        body += &format!(
            "<form method=\"post\" action=\"{p}/topics/pause\"><label>Topic or pattern <input name=\"topic\" required></label>\
             <input type=\"hidden\" name=\"csrf\" value=\"{c}\"><button>Pause</button></form>",
            c = esc(&csrf.value),
        );
    }
    if !stalled.is_empty() {
        body += "<h2>Stalled keys</h2><table><thead><tr><th>topic</th><th>key</th><th>head</th><th>attempts</th><th>behind</th><th>last error</th></tr></thead><tbody>";
        for s in &stalled {
            body += &format!(
                "<tr><td>{}</td><td>{}</td><td><a href=\"{p}/messages/{id}\">{id}</a></td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td></tr>",
                esc(&s.topic),
                esc(&s.key),
                s.attempts,
                s.waiting,
                esc(s.last_error.as_deref().unwrap_or("")),
                id = s.id
            );
        }
        body += "</tbody></table>";
    }
    let value = json!({ "topics": rows_json, "estimated": stats.estimated, "paused": paused,
        "violations": violations.iter().map(|v| json!({"kind": v.kind, "topic": v.topic, "key": v.key, "detail": v.detail})).collect::<Vec<_>>(),
        "stalled_keys": stalled, "stream_slots": slots });
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        "Overview",
        body,
        value,
    )
}

/// The stream slot's line of the overview: active or not, its lag, its WAL status.
fn stream_slots(slots: &[crate::store::StreamSlot]) -> String {
    let mut out = String::new();
    for s in slots {
        let state = if !s.exists {
            "<span class=\"down\">missing</span>".to_owned()
        } else if s.is_lost() {
            "<span class=\"down\">lost</span>".to_owned()
        } else if !s.publication_exists {
            "<span class=\"down\">publication missing</span>".to_owned()
        } else if s.active {
            "<span class=\"up\">streaming</span>".to_owned()
        } else {
            "<span class=\"paused\">inactive</span>".to_owned()
        };
        out += &format!(
            "<p class=\"slot\">Stream slot <strong>{}</strong>: {state}; lag {}; WAL status {}.</p>",
            esc(&s.slot_name),
            s.lag_bytes
                .map(|b| format!("{b} bytes"))
                .unwrap_or_else(|| "unknown".into()),
            esc(s.wal_status.as_deref().unwrap_or("-")),
        );
    }
    out
}

/// The query of a list page: the filter, the cursor and the page size.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct ListQuery {
    #[serde(flatten)]
    filter: FilterText,
    #[serde(default)]
    before: String,
    #[serde(default)]
    limit: String,
}

impl ListQuery {
    fn parse(&self) -> std::result::Result<(Filter, Option<i64>, usize), String> {
        let filter = parse_filter(&self.filter)?;
        let before = match self.before.trim() {
            "" => None,
            b => Some(
                b.parse::<i64>()
                    .map_err(|_| format!("before: {b:?} is not a message id"))?,
            ),
        };
        let limit = match self.limit.trim() {
            "" => PAGE_DEFAULT,
            l => l
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=PAGE_MAX).contains(n))
                .ok_or_else(|| format!("limit: {l:?} is not a number from 1 to {PAGE_MAX}"))?,
        };
        Ok((filter, before, limit))
    }
}

pub(super) async fn messages(
    State(ui): Shared,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Response {
    let csrf = Csrf::of(&headers);
    let (filter, before, limit) = match q.parse() {
        Ok(x) => x,
        Err(e) => return refuse(&ui, &headers, (StatusCode::BAD_REQUEST, e)),
    };
    if let Some(r) = hidden_payload_filter(&ui, &filter) {
        return refuse(&ui, &headers, r);
    }
    let page = match ui
        .store
        .browse_messages(&filter, before, limit, ui.settings.show_payloads)
        .await
    {
        Ok(p) => p,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let p = &ui.settings.path_prefix;
    let body = html::filter_form(&format!("{p}/messages"), &q.filter, true)
        + &html::rows(p, "/messages", &page, &q.filter, false);
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        "Messages",
        body,
        json!(page),
    )
}

/// The longest payload (bytes of JSON text) a message's page carries.
pub(super) const MESSAGE_PAYLOAD_MAX: usize = 1024 * 1024;

pub(super) async fn message(
    State(ui): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let csrf = Csrf::of(&headers);
    let Some(id) = id.parse::<i64>().ok().filter(|&i| i > 0) else {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::BAD_REQUEST,
                format!("{id:?} is not a message id"),
            ),
        );
    };
    let (shown, omitted) = match ui.store.show_bounded(id, Some(MESSAGE_PAYLOAD_MAX)).await {
        Ok(Some(s)) => s,
        Ok(None) => {
            return refuse(
                &ui,
                &headers,
                (
                    StatusCode::NOT_FOUND,
                    format!(
                        "no message {id}: never enqueued, or delivered and not kept (retention is off or it expired)"
                    ),
                ),
            );
        }
        Err(e) => return database_error(&ui, &headers, e),
    };
    let mut value = serde_json::to_value(&shown).unwrap_or_default();
    if let Some(o) = value.as_object_mut() {
        if !ui.settings.show_payloads {
            o.insert("payload".into(), json!(null));
        } else if let Some(bytes) = omitted.payload {
            // Too large to carry here: its size, and where to read it whole.
            o.insert("payload".into(), json!(null));
            o.insert("payload_omitted_bytes".into(), json!(bytes));
        }
        if let Some(bytes) = omitted.headers {
            o.insert("headers".into(), json!(null));
            o.insert("headers_omitted_bytes".into(), json!(bytes));
        }
    }
    let mut body = String::from("<table><tbody>");
    let too_large = |bytes: Option<i64>| {
        format!(
            "<span class=\"muted\">{} bytes: larger than the console shows; <code>postbox show {id}</code> prints it</span>",
            bytes.unwrap_or_default()
        )
    };
    if let Some(o) = value.as_object() {
        for (k, v) in o {
            let shown = match v {
                serde_json::Value::String(s) => esc(s),
                serde_json::Value::Null if k == "payload" && !ui.settings.show_payloads => {
                    "<span class=\"muted\">hidden</span>".into()
                }
                serde_json::Value::Null if k == "payload" && omitted.payload.is_some() => {
                    too_large(omitted.payload)
                }
                serde_json::Value::Null if k == "headers" && omitted.headers.is_some() => {
                    too_large(omitted.headers)
                }
                // As compact JSON, escaped for element content only: a page is at most a few
                // times the value's size, however it is nested or quoted.
                v if v.is_object() || v.is_array() => {
                    format!("<pre>{}</pre>", html::esc_text(&v.to_string()))
                }
                v => esc(&v.to_string()),
            };
            body += &format!("<tr><th>{}</th><td>{shown}</td></tr>", esc(k));
        }
    }
    body += "</tbody></table>";
    match &shown {
        crate::store::Shown::Queued { .. } => {
            let position = match ui.store.key_position(id).await {
                Ok(p) => p,
                Err(e) => return database_error(&ui, &headers, e),
            };
            if let Some(pos) = position {
                body += &format!("<p class=\"position\">{}</p>", html::position(id, &pos));
                if let Some(o) = value.as_object_mut() {
                    o.insert("key_position".into(), json!(pos));
                }
            }
        }
        crate::store::Shown::Dead { .. } if ui.settings.actions => {
            body += &format!(
                "<form class=\"actions\" method=\"post\" action=\"{}/dead/pick\">\
                 <input type=\"hidden\" name=\"id\" value=\"{id}\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
                 <button name=\"action\" value=\"replay\">Replay this message</button>\
                 <button name=\"action\" value=\"purge\">Purge this message</button></form>",
                esc(&ui.settings.path_prefix),
                esc(&csrf.value)
            );
        }
        _ => {}
    }
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        &format!("Message {id}"),
        body,
        value,
    )
}

pub(super) async fn dead(
    State(ui): Shared,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Response {
    let csrf = Csrf::of(&headers);
    let (filter, before, limit) = match q.parse() {
        Ok(x) => x,
        Err(e) => return refuse(&ui, &headers, (StatusCode::BAD_REQUEST, e)),
    };
    if let Some(r) = dead_refusal(&ui, &filter) {
        return refuse(&ui, &headers, r);
    }
    let page = match ui
        .store
        .browse_dead(&filter, before, limit, ui.settings.show_payloads)
        .await
    {
        Ok(p) => p,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let p = &ui.settings.path_prefix;
    let mut body = html::filter_form(&format!("{p}/dead"), &q.filter, false);
    if ui.settings.actions && !page.rows.is_empty() {
        // Counting everything a filter matches can read the whole table: it is the action's
        // own step (the confirmation page), never the list's.
        let query = q.filter.query();
        let sep = if query.is_empty() { "" } else { "&" };
        body += "<p class=\"actions\">";
        for (verb, label) in [("replay", "Replay"), ("purge", "Purge")] {
            body += &format!(
                "<a href=\"{}/dead/confirm?{}{sep}action={verb}\">{label} all matching…</a>",
                esc(p),
                esc(&query)
            );
        }
        body += "</p>";
    }
    let pick = ui.settings.actions && !page.rows.is_empty();
    if pick {
        body += &format!(
            "<form id=\"pick\" class=\"actions\" method=\"post\" action=\"{}/dead/pick\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <button name=\"action\" value=\"replay\">Replay picked</button>\
             <button name=\"action\" value=\"purge\">Purge picked</button></form>",
            esc(p),
            esc(&csrf.value)
        );
    }
    body += &html::rows(p, "/dead", &page, &q.filter, pick);
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        "Dead letters",
        body,
        json!(page),
    )
}

/// The query of the confirmation of a dead-letter action: the filter and the action.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct ConfirmQuery {
    #[serde(flatten)]
    filter: FilterText,
    #[serde(default)]
    action: String,
}

/// `GET /dead/confirm?…&action=replay|purge`: counts the dead letters the filter matches (up to
/// [`ACT_MAX`]), and the form that acts on exactly those (their count and a digest of their ids).
pub(super) async fn dead_confirm(
    State(ui): Shared,
    headers: HeaderMap,
    Query(q): Query<ConfirmQuery>,
) -> Response {
    if !ui.settings.actions {
        // It counts what an action would act on: no actions, nothing to count.
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::NOT_FOUND,
                "actions are off here ([ui] actions = false)".into(),
            ),
        );
    }
    let csrf = Csrf::of(&headers);
    let (verb, label) = match super::actions::is_replay(&q.action) {
        Ok(true) => ("replay", "Replay"),
        Ok(false) => ("purge", "Purge"),
        Err(r) => return refuse(&ui, &headers, r),
    };
    let filter = match parse_filter(&q.filter) {
        Ok(f) => f,
        Err(e) => return refuse(&ui, &headers, (StatusCode::BAD_REQUEST, e)),
    };
    if let Some(r) = dead_refusal(&ui, &filter) {
        return refuse(&ui, &headers, r);
    }
    let ids = match ui.store.dead_ids(&filter, None, ACT_MAX + 1).await {
        Ok(ids) => ids,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let matching = ids.len() as i64;
    let selection = super::actions::selection(&ids);
    let p = &ui.settings.path_prefix;
    let shown = q.filter.query();
    let mut body = format!(
        "<p>Filter: <code>{}</code></p>",
        esc(if shown.is_empty() {
            "(none: every dead letter)"
        } else {
            &shown
        })
    );
    if matching > ACT_MAX {
        body += &html::error(&format!(
            "More than {ACT_MAX} dead letters match: narrow the filter (by topic, id range or age)."
        ));
    } else {
        body += &format!("<p>{matching} dead letters match.</p>");
    }
    if ui.settings.actions && matching > 0 && matching <= ACT_MAX {
        body += &format!(
            "<form class=\"actions\" method=\"post\" action=\"{}/dead/{verb}\">{}\
             <input type=\"hidden\" name=\"expected\" value=\"{matching}\"><input type=\"hidden\" name=\"selection\" value=\"{selection}\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <button>{label} all {matching} matching</button></form>",
            esc(p),
            q.filter.hidden(),
            esc(&csrf.value)
        );
    }
    body += &format!(
        "<p><a href=\"{}/dead?{}\">Back to the dead letters</a></p>",
        esc(p),
        esc(&shown)
    );
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        &format!("{label} dead letters"),
        body,
        json!({ "action": verb, "matching": matching, "selection": selection }),
    )
}

/// Why a filter cannot apply to dead letters: a state (they have none), or a payload filter while
/// payloads are hidden.
pub(super) fn dead_refusal(ui: &super::Ui, filter: &Filter) -> Option<super::guard::Refusal> {
    if filter.state.is_some() {
        return Some((
            StatusCode::BAD_REQUEST,
            "state: dead letters have no state to filter on".into(),
        ));
    }
    hidden_payload_filter(ui, filter)
}

/// With payloads hidden, a payload filter would tell them one guess at a time: refused.
pub(super) fn hidden_payload_filter(
    ui: &super::Ui,
    filter: &Filter,
) -> Option<super::guard::Refusal> {
    (!ui.settings.show_payloads && filter.payload.is_some()).then(|| {
        (
            StatusCode::BAD_REQUEST,
            "payload: payloads are hidden here ([ui] show_payloads = false), so they cannot be filtered on".into(),
        )
    })
}
