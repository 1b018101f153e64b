//! The console's pages about what the relay runs: its schedules (last and next tick, run now)
//! and its running limits (what runs now against each).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::json;

use super::html::esc;
use super::{Csrf, Shared, answer, database_error};

/// `GET /schedules`: every schedule the database knows; "Run now" for those this relay runs.
pub(super) async fn schedules(State(ui): Shared, headers: HeaderMap) -> Response {
    let csrf = Csrf::of(&headers);
    let rows = match ui.store.schedules().await {
        Ok(r) => r,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let p = esc(&ui.settings.path_prefix);
    let mut body = String::from(
        "<table><thead><tr><th>name</th><th>cron</th><th>time zone</th><th>topic</th>\
         <th>last tick</th><th>its message</th><th>next tick</th><th></th></tr></thead><tbody>",
    );
    let mut value = Vec::new();
    for r in &rows {
        let here = ui.relay.schedules.iter().any(|s| s.name() == r.name);
        let run = if ui.settings.actions && here {
            format!(
                "<form method=\"post\" action=\"{p}/schedules/run\"><input type=\"hidden\" name=\"name\" value=\"{n}\">\
                 <input type=\"hidden\" name=\"csrf\" value=\"{c}\"><button>Run now</button></form>",
                n = esc(&r.name),
                c = esc(&csrf.value)
            )
        } else if !here {
            "<span class=\"muted\">another relay's</span>".into()
        } else {
            String::new()
        };
        body += &format!(
            "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td><a href=\"{p}/messages?exact={q}\">{t}</a></td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{run}</td></tr>",
            esc(&r.name),
            esc(&r.cron),
            esc(&r.timezone),
            r.last_tick
                .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
                .unwrap_or_else(|| "never".into()),
            r.last_message_id
                .map(|id| format!("<a href=\"{p}/messages/{id}\">{id}</a>"))
                .unwrap_or_default(),
            r.next_tick.format("%Y-%m-%d %H:%M:%S UTC"),
            q = esc(&super::html::url_value(&r.topic)),
            t = esc(&r.topic),
        );
        let mut v = serde_json::to_value(r).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert("this_relay".into(), json!(here));
        }
        value.push(v);
    }
    body += "</tbody></table>";
    if rows.is_empty() {
        body += "<p>No schedule has run yet ([[schedules]] in the relay's configuration).</p>";
    }
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        "Schedules",
        body,
        json!({ "schedules": value }),
    )
}

/// `GET /limits`: each running limit of this relay, and what runs now against it (every relay).
pub(super) async fn limits(State(ui): Shared, headers: HeaderMap) -> Response {
    let csrf = Csrf::of(&headers);
    let mut body = String::from(
        "<table><thead><tr><th>limit</th><th>topics</th><th>per key</th><th>running now</th>\
         <th>at most</th></tr></thead><tbody>",
    );
    let mut value = Vec::new();
    for l in &ui.relay.limits {
        let running = match ui.store.limit_running(l).await {
            Ok(n) => n,
            Err(e) => return database_error(&ui, &headers, e),
        };
        let full = running >= i64::from(l.max_running());
        body += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"n{}\">{running}</td><td class=\"n\">{}</td></tr>",
            esc(l.name()),
            esc(&l.patterns().join(", ")),
            if l.is_per_key() {
                "yes (the busiest key)"
            } else {
                "no"
            },
            if full { " full" } else { "" },
            l.max_running()
        );
        value.push(
            json!({ "name": l.name(), "topics": l.patterns(), "per_key": l.is_per_key(),
            "running": running, "max_running": l.max_running() }),
        );
    }
    body += "</tbody></table>";
    if ui.relay.limits.is_empty() {
        body += "<p>This relay applies no running limit ([[limits]] in its configuration).</p>";
    }
    answer(
        &ui,
        &headers,
        &csrf,
        StatusCode::OK,
        "Limits",
        body,
        json!({ "limits": value }),
    )
}
