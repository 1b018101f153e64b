//! The console's actions (`[ui] actions = true`, the token, a form of the console's own pages):
//! pause and resume a topic, replay or purge every dead letter a filter matches.

use std::sync::Arc;

use axum::extract::{Form, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::json;

use super::guard::{self, Credential, Refusal};
use super::html::{FilterText, parse_filter};
use super::{ACT_MAX, Csrf, Shared, Ui, database_error, refuse};
use crate::store::DeadSelector;

/// The form of a dead-letter action: the filter it applies to, the count and the selection (a
/// digest of the ids) the user was shown, the CSRF token.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct ActionForm {
    #[serde(flatten)]
    filter: FilterText,
    #[serde(default)]
    expected: String,
    #[serde(default)]
    selection: String,
    #[serde(default)]
    csrf: String,
}

/// The form of a topic's action: the topic (or pattern) and the CSRF token.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct TopicForm {
    #[serde(default)]
    topic: String,
    #[serde(default)]
    csrf: String,
}

/// A digest of a selection of ids (sorted), shown with its count: an action acts only on the very
/// dead letters the user saw, not on others that came to match meanwhile.
pub(super) fn selection(ids: &[i64]) -> String {
    // FNV-1a: the same in every replica of a version, and enough to tell two selections apart.
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in sorted {
        for b in id.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Whether the request may act: actions on, the token, the same site. Returns who acts, for the
/// audit log.
pub(super) fn may_act(
    ui: &Ui,
    headers: &HeaderMap,
    csrf: &str,
) -> std::result::Result<Actor, Refusal> {
    if !ui.settings.actions {
        return Err((
            StatusCode::FORBIDDEN,
            "the console is read-only ([ui] actions = false)".into(),
        ));
    }
    let token = ui.settings.token.as_deref().unwrap_or_default();
    let credential = guard::authenticate(headers, token)?;
    guard::same_site(headers, credential, Some(csrf).filter(|c| !c.is_empty()))?;
    let forwarded = headers
        .get("x-forwarded-for")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    Ok(Actor {
        credential: match credential {
            Credential::Bearer => "bearer token",
            Credential::Basic => "basic auth",
        },
        forwarded,
    })
}

/// Who acts, for the audit log: how they showed the token, and the `X-Forwarded-For` their
/// request carried (the client's to write: logged escaped, as every value a client sent is, so no
/// line of the log can be forged).
pub(super) struct Actor {
    credential: &'static str,
    forwarded: Option<String>,
}

/// An audit line: `who` (the credential), `from` (the client's `X-Forwarded-For`, escaped), the
/// action and its fields. Every value a client sent is logged with `?` (quoted, escaped).
macro_rules! audit {
    ($actor:expr, $action:expr $(, $($field:tt)*)?) => {
        tracing::info!(
            target: "postbox::ui::audit",
            who = $actor.credential(),
            from = ?$actor.forwarded(),
            action = $action,
            $($($field)*,)?
            "console action"
        )
    };
}
pub(super) use audit;

impl Actor {
    pub(super) fn credential(&self) -> &'static str {
        self.credential
    }
    pub(super) fn forwarded(&self) -> Option<&str> {
        self.forwarded.as_deref()
    }
}

pub(super) async fn dead_replay(
    State(ui): Shared,
    headers: HeaderMap,
    Form(f): Form<ActionForm>,
) -> Response {
    dead_act(ui, headers, f, true).await
}

pub(super) async fn dead_purge(
    State(ui): Shared,
    headers: HeaderMap,
    Form(f): Form<ActionForm>,
) -> Response {
    dead_act(ui, headers, f, false).await
}

async fn dead_act(ui: Arc<Ui>, headers: HeaderMap, f: ActionForm, replay: bool) -> Response {
    let csrf = Csrf::of(&headers);
    let who = match may_act(&ui, &headers, &f.csrf) {
        Ok(w) => w,
        Err(r) => return refuse(&ui, &headers, r),
    };
    let filter = match parse_filter(&f.filter) {
        Ok(x) => x,
        Err(e) => return refuse(&ui, &headers, (StatusCode::BAD_REQUEST, e)),
    };
    if let Some(r) = super::pages::dead_refusal(&ui, &filter) {
        return refuse(&ui, &headers, r);
    }
    let Ok(expected) = f.expected.trim().parse::<i64>() else {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::BAD_REQUEST,
                "expected: the count you confirmed is missing".into(),
            ),
        );
    };
    let ids = match ui.act.dead_ids(&filter, None, ACT_MAX + 1).await {
        Ok(ids) => ids,
        Err(e) => return database_error(&ui, &headers, e),
    };
    if expected > ACT_MAX || ids.len() as i64 > ACT_MAX {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::BAD_REQUEST,
                format!("more than {ACT_MAX} dead letters match: narrow the filter"),
            ),
        );
    }
    if ids.len() as i64 != expected || f.selection.trim() != selection(&ids) {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::CONFLICT,
                format!(
                    "the selection changed: {} dead letters match now, you confirmed {expected}; review it and confirm again",
                    ids.len()
                ),
            ),
        );
    }
    let (done, skipped) = match act_on(&ui, &ids, replay).await {
        Ok(x) => x,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let verb = if replay { "replayed" } else { "purged" };
    audit!(who, verb, filter = ?f.filter.query(), done, skipped);
    let message = format!(
        "{verb} {done} dead letters{}",
        if skipped > 0 {
            format!(" ({skipped} skipped: still dead, see postbox dead list)")
        } else {
            String::new()
        }
    );
    let dead = format!("{}/dead", ui.settings.path_prefix);
    super::done(
        &ui,
        &headers,
        &csrf,
        &message,
        (&dead, "Dead letters"),
        json!({ verb: done, "skipped": skipped }),
    )
}

/// Replays or purges `ids` (those that are dead letters), a thousand at a time: how many were
/// done, and how many a replay skipped.
async fn act_on(ui: &Ui, ids: &[i64], replay: bool) -> crate::Result<(usize, usize)> {
    let (mut done, mut skipped) = (0usize, 0usize);
    for chunk in ids.chunks(1000) {
        let selector = DeadSelector::Ids(chunk.to_vec());
        if replay {
            let r = ui.act.dead_replay(&selector).await?;
            done += r.replayed.len();
            skipped += r.skipped.len();
        } else {
            done += ui.act.dead_purge(&selector).await?;
        }
    }
    Ok((done, skipped))
}

/// A dead-letter action's name: `replay` (true) or `purge` (false).
pub(super) fn is_replay(action: &str) -> std::result::Result<bool, Refusal> {
    match action {
        "replay" => Ok(true),
        "purge" => Ok(false),
        other => Err((
            StatusCode::BAD_REQUEST,
            format!("action: {other:?} is neither replay nor purge"),
        )),
    }
}

/// Dead letters picked one by one (a message's page, the checkboxes of the list) a form acts on
/// at most.
pub const PICK_MAX: usize = 1000;

/// `POST /dead/pick`: replay (`action=replay`) or purge (`action=purge`) the dead letters whose
/// ids the form names (`id=…`, repeated): one from a message's page, or those ticked in the list.
pub(super) async fn dead_pick(
    State(ui): Shared,
    headers: HeaderMap,
    Form(pairs): Form<Vec<(String, String)>>,
) -> Response {
    let csrf = Csrf::of(&headers);
    let field = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or_default()
    };
    let who = match may_act(&ui, &headers, field("csrf")) {
        Ok(w) => w,
        Err(r) => return refuse(&ui, &headers, r),
    };
    let once = |name: &str| pairs.iter().filter(|(k, _)| k == name).count() <= 1;
    if !once("action") || !once("csrf") {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::BAD_REQUEST,
                "action: give one action and one csrf token".into(),
            ),
        );
    }
    let replay = match is_replay(field("action")) {
        Ok(r) => r,
        Err(r) => return refuse(&ui, &headers, r),
    };
    let mut ids = Vec::new();
    for (_, v) in pairs.iter().filter(|(k, _)| k == "id") {
        match v.trim().parse::<i64>() {
            Ok(id) if id > 0 => ids.push(id),
            _ => {
                return refuse(
                    &ui,
                    &headers,
                    (
                        StatusCode::BAD_REQUEST,
                        format!("id: {v:?} is not a message id"),
                    ),
                );
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() || ids.len() > PICK_MAX {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::BAD_REQUEST,
                format!(
                    "id: pick from 1 to {PICK_MAX} dead letters (picked {})",
                    ids.len()
                ),
            ),
        );
    }
    let (done, skipped) = match act_on(&ui, &ids, replay).await {
        Ok(x) => x,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let verb = if replay { "replayed" } else { "purged" };
    audit!(who, verb, ids = ?ids, done, skipped);
    let gone = ids.len().saturating_sub(done + skipped);
    let message = format!(
        "{verb} {done} of {} picked dead letters{}{}",
        ids.len(),
        if skipped > 0 {
            format!(" ({skipped} skipped: still dead)")
        } else {
            String::new()
        },
        if gone > 0 {
            format!(" ({gone} were no longer dead letters)")
        } else {
            String::new()
        }
    );
    let dead = format!("{}/dead", ui.settings.path_prefix);
    super::done(
        &ui,
        &headers,
        &csrf,
        &message,
        (&dead, "Dead letters"),
        json!({ verb: done, "skipped": skipped, "picked": ids.len() }),
    )
}

pub(super) async fn pause(
    State(ui): Shared,
    headers: HeaderMap,
    Form(f): Form<TopicForm>,
) -> Response {
    topic_act(ui, headers, f, true).await
}

pub(super) async fn resume(
    State(ui): Shared,
    headers: HeaderMap,
    Form(f): Form<TopicForm>,
) -> Response {
    topic_act(ui, headers, f, false).await
}

async fn topic_act(ui: Arc<Ui>, headers: HeaderMap, f: TopicForm, pause: bool) -> Response {
    let csrf = Csrf::of(&headers);
    let who = match may_act(&ui, &headers, &f.csrf) {
        Ok(w) => w,
        Err(r) => return refuse(&ui, &headers, r),
    };
    // The name exactly as posted: a topic may begin or end with a space, and `" ws.t"` is not
    // `"ws.t"`.
    if f.topic.is_empty() {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::BAD_REQUEST,
                "topic: a topic or pattern is needed".into(),
            ),
        );
    }
    let topics = vec![f.topic.clone()];
    let r = if pause {
        ui.act.pause(&topics).await
    } else {
        ui.act.resume(&topics).await
    };
    let n = match r {
        Ok(n) => n,
        Err(e) => return database_error(&ui, &headers, e),
    };
    let verb = if pause { "paused" } else { "resumed" };
    audit!(who, verb, topic = ?f.topic);
    let message = format!(
        "{verb} {}{}",
        f.topic,
        if n == 0 { " (nothing changed)" } else { "" }
    );
    super::done(
        &ui,
        &headers,
        &csrf,
        &message,
        (&super::html::home(&ui.settings.path_prefix), "Overview"),
        json!({ verb: n }),
    )
}
