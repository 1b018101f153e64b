//! The operator console (`[ui]`): the queue's overview (with this relay's rates, sinks and stream
//! slot), messages and dead letters with filters, a message's page, schedules and limits, and —
//! with `[ui] actions = true` and the token — pause, resume, cancel a topic, replay and purge
//! (one, a hand-picked selection, or everything a filter matches), run a schedule now, enqueue.
//! Every page answers JSON too (`Accept: application/json`), for scripts.

mod actions;
mod budget;
mod forms;
mod guard;
mod html;
mod pages;
mod rates;
mod relay_pages;

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use self::guard::{CSRF_COOKIE, Refusal};
use self::html::page;
use super::{RelayError, Result};
use crate::config::UiSettings;
use crate::store::Store;

/// Dead letters a "replay / purge everything matching" counts and acts on at most, in one go.
pub const ACT_MAX: i64 = 100_000;
/// Rows a page shows unless it asks for another number.
pub(super) const PAGE_DEFAULT: usize = 50;

pub(super) struct Ui {
    /// The pages' connections: the console's own (`[ui] pool_size`), each statement ended after
    /// `[ui] statement_timeout`.
    store: Store,
    /// The actions' connection (one; a statement may run a minute): taken only by a request that
    /// showed the token.
    act: Store,
    /// The bytes of pages in flight.
    pages: budget::PageBudget,
    settings: UiSettings,
    relay: RelayView,
    rates: Arc<rates::Rates>,
}

/// What the console shows of the relay that serves it, beyond the database: its metrics (rates,
/// sinks), its schedules (to run one now), its limits, its stream slot.
#[derive(Default)]
pub struct RelayView {
    /// This relay's metrics (`None`: no rates, no sinks shown).
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
    /// The schedules this relay runs.
    pub schedules: Vec<crate::CronSchedule>,
    /// The running limits this relay applies.
    pub limits: Vec<crate::store::Limit>,
    /// The stream mode slot, when stream mode is on.
    pub stream_slot: Option<String>,
}

pub(super) type Shared = State<Arc<Ui>>;

/// How long a page waits for one of the console's connections before it answers 503.
const CHECKOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// The limit on one statement of an action (replay or purge of up to [`ACT_MAX`]).
const ACTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Serves the console on `settings.listen` until `stop`, on a runtime and a thread of its own
/// (what its pages cost in CPU is never taken from the delivery's runtime), with connections of
/// its own to `database_url` (`[ui] pool_size` for the pages, one for the actions): whatever its
/// clients ask, it never takes the delivery's.
pub async fn serve_ui(
    settings: UiSettings,
    database_url: &str,
    relay: RelayView,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>> {
    let addr = settings.listen;
    let listener = std::net::TcpListener::bind(addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| RelayError::Usage(format!("ui.listen: cannot listen on {addr}: {e}")))?;
    let url = database_url.to_owned();
    let (ready, started) = tokio::sync::oneshot::channel::<Result<()>>();
    let thread = std::thread::Builder::new()
        .name("postbox-console".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("postbox-console")
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready.send(Err(anyhow::anyhow!("console runtime: {e}").into()));
                    return;
                }
            };
            runtime.block_on(async move {
                match console(settings, &url, relay, listener, stop.clone()).await {
                    Ok(app) => {
                        let _ = ready.send(Ok(()));
                        let listener = match tokio::net::TcpListener::from_std(app.1) {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::error!(error = %e, "console listener");
                                return;
                            }
                        };
                        super::serve::serve(listener, app.0, stop).await;
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                    }
                }
            });
        })
        .map_err(|e| anyhow::anyhow!("console thread: {e}"))?;
    started
        .await
        .map_err(|_| anyhow::anyhow!("the console's thread ended before it started"))??;
    Ok(tokio::task::spawn_blocking(move || {
        let _ = thread.join();
    }))
}

/// The console's router (on its own runtime), and the listener handed back.
async fn console(
    settings: UiSettings,
    database_url: &str,
    relay: RelayView,
    listener: std::net::TcpListener,
    stop: CancellationToken,
) -> Result<(axum::Router, std::net::TcpListener)> {
    let store = Store::connect_bounded(
        database_url,
        settings.pool_size,
        settings.statement_timeout,
        CHECKOUT,
        "postbox console",
    )
    .await?;
    let act = Store::connect_bounded(
        database_url,
        1,
        ACTION_TIMEOUT,
        CHECKOUT,
        "postbox console action",
    )
    .await?;
    let addr = settings.listen;
    let prefix = settings.path_prefix.clone();
    let rates = Arc::new(rates::Rates::default());
    if let Some(m) = &relay.metrics {
        rates::spawn(rates.clone(), m.clone(), stop.clone());
    }
    let state = Arc::new(Ui {
        store,
        act,
        pages: budget::PageBudget::new(),
        settings,
        relay,
        rates,
    });
    let state_for_hosts = state.clone();
    let pages = axum::Router::new()
        .route("/", get(pages::overview))
        .route("/messages", get(pages::messages))
        .route("/messages/{id}", get(pages::message))
        .route("/dead", get(pages::dead))
        .route("/dead/confirm", get(pages::dead_confirm))
        .route("/dead/replay", post(actions::dead_replay))
        .route("/dead/purge", post(actions::dead_purge))
        .route("/topics/pause", post(actions::pause))
        .route("/topics/resume", post(actions::resume))
        .route(
            "/topics/cancel",
            get(forms::cancel_form).post(forms::cancel),
        )
        .route("/dead/pick", post(actions::dead_pick))
        .route("/schedules", get(relay_pages::schedules))
        .route("/schedules/run", post(forms::run_schedule))
        .route("/limits", get(relay_pages::limits))
        .route("/enqueue", get(forms::enqueue_form).post(forms::enqueue))
        .fallback(|| async { (StatusCode::NOT_FOUND, "no such page\n") })
        .with_state(state);
    // A form's body is read only from a client that showed the token, within a deadline.
    let pages = pages.layer(axum::middleware::from_fn_with_state(
        state_for_hosts.clone(),
        guard_body,
    ));
    // Against DNS rebinding: a page of another site whose name resolves to this address names
    // its own host, which is not one of ours.
    let pages = pages.layer(axum::middleware::from_fn_with_state(
        state_for_hosts,
        check_host,
    ));
    let app = if prefix.is_empty() {
        pages
    } else {
        axum::Router::new().nest(&prefix, pages)
    };
    // A request's work runs to its end in a task of its own, even when its client goes: a
    // statement it started keeps its pooled connection until the server has ended it (by its
    // statement timeout at most), so the console never holds more sessions than its pool.
    let app = app.layer(axum::middleware::from_fn(detach));
    tracing::info!(%addr, prefix = %prefix, "console listening");
    Ok((app, listener))
}

/// Runs the rest of the request in a task of its own (see [`console`]).
async fn detach(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match tokio::spawn(next.run(request)).await {
        Ok(r) => r,
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "the page failed\n").into_response(),
    }
}

/// The most a form's body may hold.
pub const BODY_MAX: usize = 64 * 1024;
/// The longest a client may take to send a form's body (a trickled body is cut off).
pub const BODY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// Before a form's body is read: actions must be on and the request must carry the token (a
/// client without it never holds a connection open by trickling a body); then the body is read
/// within [`BODY_DEADLINE`] and [`BODY_MAX`]. The handler checks the rest (the same site, the
/// CSRF token) as before.
async fn guard_body(
    State(ui): State<Arc<Ui>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if request.method() != axum::http::Method::POST {
        return next.run(request).await;
    }
    let headers = request.headers().clone();
    if !ui.settings.actions {
        return refuse(
            &ui,
            &headers,
            (
                StatusCode::FORBIDDEN,
                "the console is read-only ([ui] actions = false)".into(),
            ),
        );
    }
    let token = ui.settings.token.as_deref().unwrap_or_default();
    if let Err(r) = guard::authenticate(&headers, token) {
        return refuse(&ui, &headers, r);
    }
    let (parts, body) = request.into_parts();
    let bytes =
        match tokio::time::timeout(BODY_DEADLINE, axum::body::to_bytes(body, BODY_MAX)).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => {
                return refuse(
                    &ui,
                    &headers,
                    (
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("a form's body holds at most {BODY_MAX} bytes"),
                    ),
                );
            }
            Err(_) => {
                return refuse(
                    &ui,
                    &headers,
                    (
                        StatusCode::REQUEST_TIMEOUT,
                        format!("the form's body took longer than {BODY_DEADLINE:?} to arrive"),
                    ),
                );
            }
        };
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// Refuses (421) a request whose `Host` is not one of `[ui] allowed_hosts`.
async fn check_host(
    State(ui): State<Arc<Ui>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    // One Host header; an absolute-form target's authority must be allowed too (it governs).
    let hosts: Vec<&str> = request
        .headers()
        .get_all(header::HOST)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let authority = request.uri().authority().map(|a| a.as_str().to_owned());
    let host = hosts.first().map(|h| (*h).to_owned());
    let allowed = hosts.len() <= 1
        && ui.settings.host_allowed(host.as_deref())
        && authority
            .as_deref()
            .is_none_or(|a| ui.settings.host_allowed(Some(a)));
    if allowed {
        return next.run(request).await;
    }
    let message = format!(
        "host {:?} is not one this console answers to ([ui] allowed_hosts)",
        host.unwrap_or_default()
    );
    (StatusCode::MISDIRECTED_REQUEST, message + "\n").into_response()
}

/// Whether the client asked for JSON.
pub(super) fn wants_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/json"))
}

/// The CSRF token of a page's forms: the cookie's, or a new one the page sets.
pub(super) struct Csrf {
    value: String,
    fresh: bool,
}

impl Csrf {
    pub(super) fn of(headers: &HeaderMap) -> Csrf {
        match guard::csrf_cookie(headers) {
            Some(value) => Csrf {
                value,
                fresh: false,
            },
            None => Csrf {
                value: guard::new_csrf_token(),
                fresh: true,
            },
        }
    }
}

/// The answer: JSON for a script, the page for a person (setting the CSRF cookie when it is new).
pub(super) fn answer(
    ui: &Ui,
    headers: &HeaderMap,
    csrf: &Csrf,
    status: StatusCode,
    title: &str,
    body: String,
    value: serde_json::Value,
) -> Response {
    let (bytes, content_type) = if wants_json(headers) {
        (
            serde_json::to_vec(&value).unwrap_or_default(),
            "application/json",
        )
    } else {
        (
            page(&ui.settings.path_prefix, title, None, &body).into_bytes(),
            "text/html; charset=utf-8",
        )
    };
    let length = bytes.len();
    let body = match ui.pages.body(bytes) {
        Ok(b) => b,
        Err((status, message)) => {
            let text = if wants_json(headers) {
                json!({ "error": message }).to_string()
            } else {
                message + "\n"
            };
            return (status, text).into_response();
        }
    };
    let mut response = (
        status,
        [
            (header::CONTENT_TYPE, content_type.to_owned()),
            (header::CONTENT_LENGTH, length.to_string()),
        ],
        body,
    )
        .into_response();
    if csrf.fresh {
        let path = if ui.settings.path_prefix.is_empty() {
            "/"
        } else {
            &ui.settings.path_prefix
        };
        // Behind a proxy that terminated TLS, the cookie is for HTTPS only. (No `__Host-`
        // prefix: it needs `Path=/`, which a console under a path prefix cannot set.)
        let secure = headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("https"));
        let cookie = format!(
            "{CSRF_COOKIE}={}; Path={path}; HttpOnly; SameSite=Strict{}",
            csrf.value,
            if secure { "; Secure" } else { "" }
        );
        if let Ok(v) = cookie.parse() {
            response.headers_mut().insert(header::SET_COOKIE, v);
        }
    }
    response
}

/// The page after an action: what it did, and a link on (`(href, label)`).
pub(super) fn done(
    ui: &Ui,
    headers: &HeaderMap,
    csrf: &Csrf,
    message: &str,
    (href, label): (&str, &str),
    value: serde_json::Value,
) -> Response {
    answer(
        ui,
        headers,
        csrf,
        StatusCode::OK,
        "Done",
        format!(
            "<p class=\"notice\" role=\"status\">{}</p><p><a href=\"{}\">{}</a></p>",
            html::esc(message),
            html::esc(href),
            html::esc(label)
        ),
        value,
    )
}

/// A refusal or a bad request, as a page or as JSON; never a 500 for what the user typed.
pub(super) fn refuse(ui: &Ui, headers: &HeaderMap, (status, message): Refusal) -> Response {
    let mut r = answer(
        ui,
        headers,
        &Csrf::of(headers),
        status,
        "Refused",
        html::error(&message),
        json!({ "error": message }),
    );
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Basic realm=\"postbox\""),
        );
    }
    r
}

pub(super) fn database_error(ui: &Ui, headers: &HeaderMap, e: crate::Error) -> Response {
    match e {
        crate::Error::InvalidArgument { .. } => {
            refuse(ui, headers, (StatusCode::BAD_REQUEST, e.to_string()))
        }
        crate::Error::Pool(_) => refuse(
            ui,
            headers,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the console is busy: its {} database connections are in use ([ui] pool_size); try again",
                    ui.settings.pool_size
                ),
            ),
        ),
        e => {
            tracing::warn!(error = %e, "console: the database failed");
            refuse(
                ui,
                headers,
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the database failed: {e}"),
                ),
            )
        }
    }
}
