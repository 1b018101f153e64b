//! Browsing the queue and the dead letters for an operator (the console, scripts): filtered,
//! newest-first pages that stay fast on a table of millions.
//!
//! A page never counts the table and never skips with OFFSET: it reads the rows below a cursor (an
//! id, exclusive) in id order, at most [`WINDOW`] of them, and keeps those that match the filter —
//! topic names or globs, state, key, id range, age, and JSON containment on payload and headers
//! (`{"customer": "c-42"}`, PostgreSQL's `@>`). So a page costs at most a window's rows whatever
//! the filter; when the window ends before the page is full, the page says how far it searched
//! ([`Browsed::searched_down_to`]) and its cursor goes on from there.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Double, Jsonb, Nullable, Text, Timestamptz};
use diesel_async::RunQueryDsl;

use super::Store;
use super::lenient::LenientOptText;
use crate::error::{Error, Result};

/// Rows a page reads at most, below its cursor.
pub const WINDOW: i64 = 50_000;
/// Rows a page returns at most.
pub const PAGE_MAX: usize = 500;
/// Characters of a payload, headers, a key or an error a page carries at most: a preview, cut in
/// SQL, so that a page of large messages costs the relay a few kilobytes a row whatever they hold.
pub const PREVIEW_CHARS: usize = 1024;
/// A payload stored larger than this (compressed bytes) gets no preview on a page: making one
/// would render the whole value in the database first.
pub const PREVIEW_SOURCE_MAX: i32 = 64 * 1024;

/// Which messages (or dead letters) a page shows. Empty: all.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filter {
    /// Topic names, or globs with `*` (`orders.*`); any of them.
    pub topics: Vec<String>,
    /// Topic names taken exactly as they are (a `*` or a `,` in one is part of the name); any of
    /// them, besides `topics`.
    pub exact_topics: Vec<String>,
    /// `available`, `scheduled`, `running` or `waiting` (messages only).
    pub state: Option<String>,
    /// The key, exactly.
    pub key: Option<String>,
    /// Ids from this one (inclusive).
    pub min_id: Option<i64>,
    /// Ids up to this one (inclusive).
    pub max_id: Option<i64>,
    /// Enqueued at least this long ago.
    pub older_than: Option<Duration>,
    /// The payload contains this JSON (`@>`).
    pub payload: Option<serde_json::Value>,
    /// The headers contain this JSON object (`@>`).
    pub headers: Option<serde_json::Value>,
}

/// The states a message filter may name.
pub const STATES: [&str; 4] = ["available", "scheduled", "running", "waiting"];

impl Filter {
    /// Refuses what cannot match anything by mistake: an unknown state, a headers filter that is
    /// not an object, an id range upside down.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, problem: &str| Error::InvalidArgument {
            field,
            problem: problem.to_owned(),
        };
        if let Some(s) = &self.state
            && !STATES.contains(&s.as_str())
        {
            return Err(bad(
                "state",
                "must be available, scheduled, running or waiting",
            ));
        }
        if self.headers.as_ref().is_some_and(|h| !h.is_object()) {
            return Err(bad("headers", "must be a JSON object of strings"));
        }
        if let (Some(lo), Some(hi)) = (self.min_id, self.max_id)
            && lo > hi
        {
            return Err(bad("min_id", "is above max_id"));
        }
        if self
            .topics
            .iter()
            .chain(&self.exact_topics)
            .any(|t| t.is_empty())
        {
            return Err(bad("topic", "must not be empty"));
        }
        Ok(())
    }

    /// The topic filter as `LIKE` patterns (`*` → `%`, `%`, `_` and `\` escaped).
    fn like_patterns(&self) -> Vec<String> {
        let pattern = |t: &str, glob: bool| {
            let mut p = String::with_capacity(t.len());
            for c in t.chars() {
                match c {
                    '%' | '_' | '\\' => {
                        p.push('\\');
                        p.push(c);
                    }
                    '*' if glob => p.push('%'),
                    c => p.push(c),
                }
            }
            p
        };
        self.topics
            .iter()
            .map(|t| pattern(t, true))
            .chain(self.exact_topics.iter().map(|t| pattern(t, false)))
            .collect()
    }
}

/// One page, newest first.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Browsed<T> {
    /// The rows that matched, at most the page size.
    pub rows: Vec<T>,
    /// The cursor of the next page (pass it as `before`), or `None` when nothing is left below.
    pub next: Option<i64>,
    /// Set when the window ended before the page was full: every row from the cursor down to
    /// this id was searched, and more may match below it (follow `next`).
    pub searched_down_to: Option<i64>,
}

/// A message as a page shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MessageRow {
    /// Its id.
    pub id: i64,
    /// Its topic.
    pub topic: String,
    /// Its key, if any (cut to [`PREVIEW_CHARS`] characters, marked `…`).
    pub key: Option<String>,
    /// Whether it is delivered in its key's order.
    pub ordered: bool,
    /// Its state (for a dead letter: `dead`).
    pub state: String,
    /// Attempts used.
    pub attempts: i32,
    /// Attempts allowed.
    pub max_attempts: i32,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// When it is (was) claimable; for a dead letter, when it died.
    pub at: DateTime<Utc>,
    /// Its last error; for a dead letter, why it died (cut to [`PREVIEW_CHARS`] characters).
    pub error: Option<String>,
    /// Its payload, when it is at most [`PREVIEW_CHARS`] characters as JSON text (`None` when
    /// payloads are hidden, or it is larger: see `payload_preview`; the message's own page shows
    /// it whole).
    pub payload: Option<serde_json::Value>,
    /// The first [`PREVIEW_CHARS`] characters of a larger payload's JSON text (`None` when it is
    /// whole in `payload`, hidden, or stored larger than [`PREVIEW_SOURCE_MAX`]).
    pub payload_preview: Option<String>,
    /// The payload's stored size in bytes (compressed as PostgreSQL keeps it; `None` when
    /// payloads are hidden).
    pub payload_bytes: Option<i64>,
    /// Its headers; a larger object as the first [`PREVIEW_CHARS`] characters of its JSON text
    /// (a string), or `null` if stored larger than [`PREVIEW_SOURCE_MAX`].
    pub headers: serde_json::Value,
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Nullable<BigInt>)]
    low: Option<i64>,
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    id: Option<i64>,
    #[diesel(sql_type = Nullable<Text>, deserialize_as = LenientOptText)]
    topic: Option<String>,
    #[diesel(sql_type = Nullable<Text>, deserialize_as = LenientOptText)]
    key: Option<String>,
    #[diesel(sql_type = Nullable<Bool>)]
    ordered: Option<bool>,
    #[diesel(sql_type = Nullable<Text>)]
    state: Option<String>,
    #[diesel(sql_type = Nullable<diesel::sql_types::Integer>)]
    attempts: Option<i32>,
    #[diesel(sql_type = Nullable<diesel::sql_types::Integer>)]
    max_attempts: Option<i32>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    created_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>, deserialize_as = LenientOptText)]
    error: Option<String>,
    #[diesel(sql_type = Nullable<Text>, deserialize_as = LenientOptText)]
    payload: Option<String>,
    #[diesel(sql_type = Nullable<diesel::sql_types::Integer>)]
    payload_bytes: Option<i32>,
    #[diesel(sql_type = Nullable<Text>, deserialize_as = LenientOptText)]
    headers: Option<String>,
}

/// The live messages as a page reads them: `postbox.messages` and what writers committed to
/// `postbox.intake` that no relay has moved yet (available, or scheduled, never attempted).
const LIVE_MESSAGES: &str = "(SELECT id, topic, key, ordered, state, attempts, max_attempts, created_at, run_at,
        last_error, payload, headers FROM postbox.messages
    UNION ALL
    SELECT id, topic, key, false, CASE WHEN run_at > now() THEN 'scheduled' ELSE 'available' END::postbox.message_state,
        0, max_attempts, created_at, run_at, NULL::text, payload, headers FROM postbox.intake)";

/// The page query of `table` (a table of schema postbox, or a subquery): the window below the
/// cursor, the filter on it, the page.
fn page_sql(table: &str, state: &str, at: &str, error: &str) -> String {
    let table = if table.starts_with('(') {
        format!("{table} AS live")
    } else {
        format!("postbox.{table}")
    };
    // One pass over the window for the page (the primary key backwards, the filter on each row)
    // and one over its ids alone (an index-only scan) for how far it reached. Payloads and
    // headers leave the database as previews: one character more than shown tells a cut one.
    let source_max = PREVIEW_SOURCE_MAX;
    let cut = PREVIEW_CHARS + 1;
    format!(
        "SELECT edge.low, edge.n, r.* FROM (
            SELECT min(id) AS low, count(*)::bigint AS n FROM (
                SELECT id FROM {table} WHERE id < $1 ORDER BY id DESC LIMIT $2) w
         ) edge LEFT JOIN LATERAL (
            SELECT t.id, t.topic, left(t.key, {cut}) AS key, t.ordered, {state} AS state, t.attempts,
                   t.max_attempts, t.created_at, {at} AS at, left({error}, {cut}) AS error,
                   CASE WHEN $3 AND pg_column_size(t.payload) <= {source_max}
                        THEN left(t.payload::text, {cut}) END AS payload,
                   CASE WHEN $3 THEN pg_column_size(t.payload) END AS payload_bytes,
                   CASE WHEN pg_column_size(t.headers) <= {source_max}
                        THEN left(t.headers::text, {cut}) END AS headers
            FROM (SELECT * FROM {table} WHERE id < $1 ORDER BY id DESC LIMIT $2) t
            WHERE ($4::bigint IS NULL OR t.id >= $4)
              AND ($5::bigint IS NULL OR t.id <= $5)
              AND (cardinality($6::text[]) = 0 OR t.topic LIKE ANY ($6::text[]))
              AND ($7::text IS NULL OR {state} = $7)
              AND ($8::text IS NULL OR t.key = $8)
              AND ($9::float8 IS NULL OR t.created_at <= now() - make_interval(secs => $9))
              AND ($10::jsonb IS NULL OR t.payload @> $10)
              AND ($11::jsonb IS NULL OR t.headers @> $11)
            ORDER BY t.id DESC
            LIMIT $12
         ) r ON true"
    )
}

impl Store {
    /// A page of live messages matching `filter`, newest first, below `before` (an id; `None`:
    /// from the newest), at most `limit` (up to [`PAGE_MAX`]); payloads left out unless
    /// `with_payloads`.
    pub async fn browse_messages(
        &self,
        filter: &Filter,
        before: Option<i64>,
        limit: usize,
        with_payloads: bool,
    ) -> Result<Browsed<MessageRow>> {
        let sql = page_sql(LIVE_MESSAGES, "t.state::text", "t.run_at", "t.last_error");
        self.browse(&sql, filter, before, limit, with_payloads)
            .await
    }

    /// A page of dead letters matching `filter` (whose `state` must not be set), newest first, as
    /// [`Store::browse_messages`].
    pub async fn browse_dead(
        &self,
        filter: &Filter,
        before: Option<i64>,
        limit: usize,
        with_payloads: bool,
    ) -> Result<Browsed<MessageRow>> {
        let sql = page_sql("dead_letters", "'dead'::text", "t.dead_at", "t.reason");
        self.browse(&sql, filter, before, limit, with_payloads)
            .await
    }

    async fn browse(
        &self,
        sql: &str,
        filter: &Filter,
        before: Option<i64>,
        limit: usize,
        with_payloads: bool,
    ) -> Result<Browsed<MessageRow>> {
        filter.validate()?;
        let limit = limit.clamp(1, PAGE_MAX);
        // Nothing above the filter's highest id can match: start there.
        let before = match (before, filter.max_id) {
            (b, Some(hi)) => Some(b.unwrap_or(i64::MAX).min(hi.saturating_add(1))),
            (b, None) => b,
        };
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = diesel::sql_query(sql)
            .bind::<BigInt, _>(before.unwrap_or(i64::MAX))
            .bind::<BigInt, _>(WINDOW)
            .bind::<Bool, _>(with_payloads)
            .bind::<Nullable<BigInt>, _>(filter.min_id)
            .bind::<Nullable<BigInt>, _>(filter.max_id)
            .bind::<Array<Text>, _>(filter.like_patterns())
            .bind::<Nullable<Text>, _>(filter.state.as_deref())
            .bind::<Nullable<Text>, _>(filter.key.as_deref())
            .bind::<Nullable<Double>, _>(filter.older_than.map(|d| d.as_secs_f64()))
            .bind::<Nullable<Jsonb>, _>(filter.payload.as_ref())
            .bind::<Nullable<Jsonb>, _>(filter.headers.as_ref())
            .bind::<BigInt, _>(i64::try_from(limit + 1).unwrap_or(i64::MAX))
            .load(&mut conn)
            .await?;
        let (low, searched) = <[Row]>::first(&rows)
            .map(|r| (r.low, r.n))
            .unwrap_or((None, 0));
        let mut out: Vec<MessageRow> = rows.into_iter().filter_map(message_row).collect();
        let full = out.len() > limit;
        out.truncate(limit);
        // Below the lowest id of the filter's range, nothing can match.
        let floor = filter.min_id.unwrap_or(i64::MIN);
        let (next, searched_down_to) = if full {
            (out.last().map(|m| m.id), None)
        } else if searched == WINDOW {
            // The window ended first: go on below it.
            (low.filter(|&l| l > floor), low)
        } else {
            (None, None)
        };
        Ok(Browsed {
            rows: out,
            next,
            searched_down_to,
        })
    }

    /// The ids of the dead letters matching `filter`, newest first, below `before`, at most
    /// `limit` (for replaying or purging everything a filter matches, a batch at a time).
    pub async fn dead_ids(
        &self,
        filter: &Filter,
        before: Option<i64>,
        limit: i64,
    ) -> Result<Vec<i64>> {
        #[derive(QueryableByName)]
        struct Id {
            #[diesel(sql_type = BigInt)]
            id: i64,
        }
        let mut conn = self.conn().await?;
        let ids: Vec<Id> = diesel::sql_query(
            "SELECT t.id FROM postbox.dead_letters t
             WHERE t.id < $1
               AND ($2::bigint IS NULL OR t.id >= $2)
               AND ($3::bigint IS NULL OR t.id <= $3)
               AND (cardinality($4::text[]) = 0 OR t.topic LIKE ANY ($4::text[]))
               AND ($5::text IS NULL OR t.key = $5)
               AND ($6::float8 IS NULL OR t.created_at <= now() - make_interval(secs => $6))
               AND ($7::jsonb IS NULL OR t.payload @> $7)
               AND ($8::jsonb IS NULL OR t.headers @> $8)
             ORDER BY t.id DESC LIMIT $9",
        )
        .bind::<BigInt, _>(before.unwrap_or(i64::MAX))
        .bind::<Nullable<BigInt>, _>(filter.min_id)
        .bind::<Nullable<BigInt>, _>(filter.max_id)
        .bind::<Array<Text>, _>(filter.like_patterns())
        .bind::<Nullable<Text>, _>(filter.key.as_deref())
        .bind::<Nullable<Double>, _>(filter.older_than.map(|d| d.as_secs_f64()))
        .bind::<Nullable<Jsonb>, _>(filter.payload.as_ref())
        .bind::<Nullable<Jsonb>, _>(filter.headers.as_ref())
        .bind::<BigInt, _>(limit)
        .load(&mut conn)
        .await?;
        Ok(ids.into_iter().map(|i| i.id).collect())
    }
}

fn message_row(r: Row) -> Option<MessageRow> {
    Some(MessageRow {
        id: r.id?,
        topic: r.topic.unwrap_or_default(),
        key: r.key.map(cut),
        ordered: r.ordered.unwrap_or(false),
        state: r.state.unwrap_or_default(),
        attempts: r.attempts.unwrap_or(0),
        max_attempts: r.max_attempts.unwrap_or(0),
        created_at: r.created_at?,
        at: r.at?,
        error: r.error.map(cut),
        payload: r.payload.as_deref().filter(|p| whole(p)).map(lenient_json),
        payload_preview: r.payload.filter(|p| !whole(p)).map(cut),
        payload_bytes: r.payload_bytes.map(i64::from),
        headers: match r.headers {
            Some(h) if whole(&h) => lenient_json(&h),
            Some(h) => serde_json::Value::String(cut(h)),
            None => serde_json::Value::Null,
        },
    })
}

/// Whether a preview is the whole text (it was read one character longer than shown).
fn whole(text: &str) -> bool {
    text.chars().nth(PREVIEW_CHARS).is_none()
}

/// A preview cut to [`PREVIEW_CHARS`] characters, marked with `…`.
fn cut(mut text: String) -> String {
    if let Some((at, _)) = text.char_indices().nth(PREVIEW_CHARS) {
        text.truncate(at);
        text.push('…');
    }
    text
}

/// The JSON of a stored value, or its text as a string when this process cannot parse it (nested
/// deeper than serde_json reads): one hostile message never fails a page.
fn lenient_json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_owned()))
}
