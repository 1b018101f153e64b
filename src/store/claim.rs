//! Claiming: pending → running, one statement per batch.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::pg::Pg;
use diesel::sql_types::{
    Array, BigInt, Bool, Double, Integer, Jsonb, Nullable, SmallInt, Text, Timestamptz,
};
use diesel_async::RunQueryDsl;

use super::lenient::{LenientJson, LenientText};
use super::{Lease, Store};
use crate::error::{Error, Result};
use crate::message::MessageId;

/// Which topics an engine serves. Several engines can share one table by serving different
/// topics; a message whose topic no engine serves stays pending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    pub(super) all: bool,
    pub(super) exact: Vec<String>,
    pub(super) like: Vec<String>,
    /// Never these, even if they match (a relay's earlier routes took them).
    pub(super) not_exact: Vec<String>,
    pub(super) not_like: Vec<String>,
}

impl Topics {
    fn none() -> Self {
        Topics {
            all: false,
            exact: Vec::new(),
            like: Vec::new(),
            not_exact: Vec::new(),
            not_like: Vec::new(),
        }
    }

    /// This filter minus everything `other` lets through (routes: first match wins).
    pub fn excluding(mut self, other: &Topics) -> Self {
        if other.all {
            return Topics::none();
        }
        self.not_exact.extend(other.exact.iter().cloned());
        self.not_like.extend(other.like.iter().cloned());
        self
    }

    /// Every topic.
    pub fn all() -> Self {
        Topics {
            all: true,
            ..Topics::none()
        }
    }

    /// These topics; a `*` in a name matches any run of characters (`orders.*`), and `*` alone
    /// matches everything.
    pub fn only<I, S>(patterns: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut t = Topics::none();
        for p in patterns {
            let p = p.as_ref();
            if p == "*" {
                t.all = true;
            } else if p.contains('*') {
                let escaped = p
                    .replace('\\', "\\\\")
                    .replace('%', "\\%")
                    .replace('_', "\\_");
                t.like.push(escaped.replace('*', "%"));
            } else {
                t.exact.push(p.to_owned());
            }
        }
        t
    }

    /// True if this filter lets `topic` through (the same rule the claim query applies).
    pub fn matches(&self, topic: &str) -> bool {
        fn glob(pattern: &str, s: &str) -> bool {
            // pattern here is the LIKE form; undo the escaping for the in-memory match.
            let parts: Vec<String> = split_like(pattern);
            let mut rest = s;
            for (i, part) in parts.iter().enumerate() {
                if i == 0 {
                    match rest.strip_prefix(part.as_str()) {
                        Some(r) => rest = r,
                        None => return false,
                    }
                } else if i == parts.len() - 1 {
                    return rest.len() >= part.len() && rest.ends_with(part.as_str());
                } else {
                    match rest.find(part.as_str()) {
                        Some(pos) => rest = &rest[pos + part.len()..],
                        None => return false,
                    }
                }
            }
            parts.len() > 1 || rest.is_empty()
        }
        let excluded = self.not_exact.iter().any(|t| t == topic)
            || self.not_like.iter().any(|p| glob(p, topic));
        !excluded
            && (self.all
                || self.exact.iter().any(|t| t == topic)
                || self.like.iter().any(|p| glob(p, topic)))
    }

    /// Exactly these topic names (no patterns: a `*` is a literal character here).
    pub fn exact<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut exact: Vec<String> = names.into_iter().map(|s| s.as_ref().to_owned()).collect();
        exact.sort_unstable();
        Topics {
            exact,
            ..Topics::none()
        }
    }

    /// The patterns of this filter (`*` for all) followed by `more` (exclusions are not kept).
    pub fn patterns_and<S: AsRef<str>>(&self, more: &[S]) -> Vec<String> {
        let mut out = if self.all {
            vec!["*".to_owned()]
        } else {
            self.exact.clone()
        };
        out.extend(self.like.iter().map(|p| split_like(p).join("*")));
        out.extend(more.iter().map(|m| m.as_ref().to_owned()));
        out
    }

    /// The one topic this filter lets through, when it names exactly one (and does not exclude it).
    pub(super) fn single(&self) -> Option<&str> {
        match (self.all, self.exact.as_slice(), self.like.is_empty()) {
            (false, [one], true) if self.matches(one) => Some(one),
            _ => None,
        }
    }

    /// The key under which the store keeps the floors of this filter: no topic's name (a topic
    /// holds no NUL).
    pub(super) fn floors_key(&self) -> String {
        format!(
            "\0{}\0{:?}\0{:?}\0{:?}\0{:?}",
            self.all, self.exact, self.like, self.not_exact, self.not_like
        )
    }

    /// The topics this filter lets through when it names up to 16 exactly and has no pattern
    /// (exclusions applied): they are claimed from the floors of each (see the migration
    /// `ready_sets`).
    pub(super) fn named(&self) -> Option<Vec<&str>> {
        if self.all || !self.like.is_empty() || self.exact.len() > 16 {
            return None;
        }
        Some(
            self.exact
                .iter()
                .map(String::as_str)
                .filter(|t| self.matches(t))
                .collect(),
        )
    }

    /// True if nothing can match.
    pub fn is_empty(&self) -> bool {
        !self.all && self.exact.is_empty() && self.like.is_empty()
    }
}

/// Splits a LIKE pattern on its unescaped `%`, unescaping the pieces.
fn split_like(pattern: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    parts.last_mut().expect("non-empty").push(n);
                }
            }
            '%' => parts.push(String::new()),
            c => parts.last_mut().expect("non-empty").push(c),
        }
    }
    parts
}

/// A message claimed by this process: its content, and the lease that names this claim.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedMessage {
    /// The message's id.
    pub id: MessageId,
    /// Its topic.
    pub topic: String,
    /// Its key, if any.
    pub key: Option<String>,
    /// Whether it is delivered in its key's order.
    pub ordered: bool,
    /// Its payload.
    pub payload: serde_json::Value,
    /// Its headers.
    pub headers: BTreeMap<String, String>,
    /// Its priority (lower is claimed first).
    pub priority: i16,
    /// When it became (or becomes) claimable.
    pub run_at: DateTime<Utc>,
    /// Attempts used, including this one (1 on the first delivery).
    pub attempts: i32,
    /// Attempts before it is dead-lettered.
    pub max_attempts: i32,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// The lease ends here unless extended.
    pub locked_until: DateTime<Utc>,
    /// The token of this claim: every settle names the message by id and token.
    pub lease_token: i64,
    /// The error of the previous failed attempt, if any.
    pub last_error: Option<String>,
    /// Its dedup key, if any.
    pub dedup_key: Option<String>,
    /// Why this row cannot be delivered as read, if it cannot: a payload nested deeper than
    /// serde_json reads, a topic or key that is not UTF-8 (a `SQL_ASCII` database). The engine
    /// dead-letters such a message with this reason instead of handing it to a sink; its fields
    /// hold what could be read (`Null` payload, lossy text).
    pub undecodable: Option<String>,
    /// Set for a message read from the WAL (stream mode, see [`crate::stream`]): its stable id,
    /// the commit position of its transaction and its index in it (`<commit LSN, 16 hex
    /// digits>-<index, 8 hex digits>`), the same on every redelivery. Sinks send it as
    /// `postbox-id`; `id` is 0 then, and there is no lease.
    pub stream_id: Option<String>,
}

/// A row of the claim of every topic, and the floors its session keeps after it (the same on
/// every row), for the store's other connections.
struct ClaimedReady {
    message: ClaimedMessage,
    floors: Option<String>,
}

impl QueryableByName<Pg> for ClaimedReady {
    fn build<'a>(row: &impl diesel::row::NamedRow<'a, Pg>) -> diesel::deserialize::Result<Self> {
        Ok(ClaimedReady {
            message: ClaimedMessage::build(row)?,
            floors: diesel::row::NamedRow::get::<Nullable<Text>, Option<String>>(row, "floors")?,
        })
    }
}

/// The row as read, every field that can fail to decode read leniently.
#[derive(QueryableByName)]
struct RawClaimed {
    #[diesel(sql_type = BigInt)]
    id: MessageId,
    #[diesel(sql_type = Text)]
    topic: LenientText,
    #[diesel(sql_type = Nullable<Text>)]
    key: Option<LenientText>,
    #[diesel(sql_type = Bool)]
    ordered: bool,
    #[diesel(sql_type = Jsonb)]
    payload: LenientJson,
    #[diesel(sql_type = Jsonb)]
    headers: LenientJson,
    #[diesel(sql_type = SmallInt)]
    priority: i16,
    #[diesel(sql_type = Timestamptz)]
    run_at: DateTime<Utc>,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Integer)]
    max_attempts: i32,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    locked_until: DateTime<Utc>,
    #[diesel(sql_type = BigInt)]
    lease_token: i64,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<LenientText>,
    #[diesel(sql_type = Nullable<Text>)]
    dedup_key: Option<LenientText>,
}

impl From<RawClaimed> for ClaimedMessage {
    fn from(r: RawClaimed) -> Self {
        let problems: Vec<String> = [
            r.topic.problem.as_ref().map(|p| format!("topic {p}")),
            r.key
                .as_ref()
                .and_then(|k| k.problem.as_ref())
                .map(|p| format!("key {p}")),
            r.payload.problem.as_ref().map(|p| format!("payload {p}")),
            r.headers.problem.as_ref().map(|p| format!("headers {p}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        ClaimedMessage {
            id: r.id,
            topic: r.topic.value,
            key: r.key.map(String::from),
            ordered: r.ordered,
            payload: r.payload.value,
            headers: headers_map(r.headers.value),
            priority: r.priority,
            run_at: r.run_at,
            attempts: r.attempts,
            max_attempts: r.max_attempts,
            created_at: r.created_at,
            locked_until: r.locked_until,
            lease_token: r.lease_token,
            last_error: r.last_error.map(String::from),
            dedup_key: r.dedup_key.map(String::from),
            undecodable: (!problems.is_empty())
                .then(|| format!("undecodable: {}", problems.join("; "))),
            stream_id: None,
        }
    }
}

impl QueryableByName<Pg> for ClaimedMessage {
    fn build<'a>(row: &impl diesel::row::NamedRow<'a, Pg>) -> diesel::deserialize::Result<Self> {
        RawClaimed::build(row).map(ClaimedMessage::from)
    }
}

impl ClaimedMessage {
    /// The lease of this claim, to settle the message with.
    pub fn lease(&self) -> Lease {
        Lease {
            id: self.id,
            token: self.lease_token,
        }
    }

    /// True if a failure now would dead-letter the message instead of retrying it.
    pub fn is_last_attempt(&self) -> bool {
        self.attempts >= self.max_attempts
    }
}

/// Headers column → string map (the migration's CHECK guarantees string values).
fn headers_map(h: serde_json::Value) -> BTreeMap<String, String> {
    match h {
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// The claim of every topic (`$1` NULL) or of one topic named exactly, from the newest floors
/// the store has seen when its connection has none or older ones; each row carries the floors
/// the session keeps after it.
const CLAIM_READY: &str = concat!(
    r#"
SELECT id, topic, key, ordered, payload, headers, priority, run_at, attempts, max_attempts,
       created_at, locked_until, lease_token, last_error, dedup_key,
       CASE WHEN row_number() OVER () = 1
            THEN postbox.boot_token() || '|' || current_setting(postbox.claim_floors_setting($1), true)
            END AS floors
FROM postbox.claim_ready($1, $2, $3, $4, $5, "#,
    floors_in!("$6"),
    ")"
);

/// The claim of up to 16 topics named exactly (`$1`): `postbox.take_set` from the newest floors the
/// store has seen of each (`$6`, in the order of `$1`); the first row carries the floors the
/// session keeps of each after it (in that order).
const CLAIM_SET: &str = concat!(
    r#"
SELECT id, topic, key, ordered, payload, headers, priority, run_at, attempts, max_attempts,
       created_at, locked_until, lease_token, last_error, dedup_key,
       CASE WHEN row_number() OVER () = 1 THEN "#,
    floors_set_out!("$1"),
    r#" END AS floors
FROM postbox.take_set($1, $2, $3, $4, $5, "#,
    floors_set_in!("$6"),
    ")"
);

/// The claim of a filter with patterns or exclusions (`$1`–`$5`): `postbox.take_matching` from the
/// newest floors the store has seen of the filter (`$10`); the first row carries the floors the
/// session keeps of it after it (see the migration `filter_floors`).
const CLAIM_MATCHING: &str = concat!(
    r#"
SELECT id, topic, key, ordered, payload, headers, priority, run_at, attempts, max_attempts,
       created_at, locked_until, lease_token, last_error, dedup_key,
       CASE WHEN row_number() OVER () = 1
            THEN postbox.boot_token() || '|' || current_setting(postbox.filter_floors_setting($1, $2, $3, $4, $5), true)
            END AS floors
FROM postbox.take_matching($1, $2, $3, $4, $5, $6, $7, $8, $9, "#,
    floors_in!("$10"),
    ")"
);

/// A row of [`CLAIM_SET`]: the first carries the floors of each topic.
struct ClaimedSet {
    message: ClaimedMessage,
    floors: Option<Vec<Option<String>>>,
}

impl QueryableByName<Pg> for ClaimedSet {
    fn build<'a>(row: &impl diesel::row::NamedRow<'a, Pg>) -> diesel::deserialize::Result<Self> {
        Ok(ClaimedSet {
            message: ClaimedMessage::build(row)?,
            floors: diesel::row::NamedRow::get::<
                Nullable<Array<Nullable<Text>>>,
                Option<Vec<Option<String>>>,
            >(row, "floors")?,
        })
    }
}

impl Store {
    /// The floors to claim from for each of `topics` (see [`Store::floors_of`]), in their order.
    pub(super) fn floors_of_each(&self, topics: &[&str]) -> Vec<Option<String>> {
        topics
            .iter()
            .map(|t| self.floors_of(&Some((*t).to_owned())))
            .collect()
    }

    /// Keeps the floors a claim of `topics` returned (in their order), as [`Store::keep_floors`].
    pub(super) fn keep_floors_of_each(&self, topics: &[&str], floors: Vec<Option<String>>) {
        for (topic, state) in topics.iter().zip(floors) {
            if let Some(state) = state {
                self.keep_floors(Some((*topic).to_owned()), state);
            }
        }
    }

    /// The floors to claim from for every topic (`None`) or `topic`: the newest this store saw.
    pub(super) fn floors_of(&self, topic: &Option<String>) -> Option<String> {
        let all = self.floors.lock().ok()?;
        all.get(topic).cloned()
    }

    /// Makes the token of the server's run if there is none (`postbox.boot_start()`), in a
    /// transaction of its own: until there is one, the floors a claim leaves stay in its session
    /// and are not handed to the store's other connections (see the migration `ready_takes`). The upkeep
    /// calls it on each tick; after a crash or a promotion the first tick makes a new one.
    pub async fn start_run(&self) -> Result<()> {
        let mut conn = self.conn().await?;
        diesel::sql_query("SELECT postbox.boot_start()")
            .execute(&mut conn)
            .await?;
        Ok(())
    }

    /// Keeps `state`, the floors a claim left, for the store's other connections. They are
    /// stamped with the server run's token (`floors_in!` passes them only to the same run): a
    /// server reinitialised after a crash that lost asynchronous commits, or a standby promoted,
    /// may hand out again transaction ids the floors are past.
    pub(super) fn keep_floors(&self, topic: Option<String>, state: String) {
        if let Ok(mut all) = self.floors.lock() {
            all.insert(topic, state);
        }
    }
}

impl Store {
    /// Leases up to `batch` claimable messages of `topics` for `lease`, in (priority, id) order.
    /// Each claim uses one attempt.
    pub async fn claim(
        &self,
        batch: usize,
        lease: Duration,
        topics: &Topics,
    ) -> Result<Vec<ClaimedMessage>> {
        if batch == 0 || topics.is_empty() {
            return Ok(Vec::new());
        }
        if lease.is_zero() {
            return Err(Error::InvalidArgument {
                field: "lease",
                problem: "must be greater than zero".into(),
            });
        }
        self.finish_before_claim().await;
        let mut conn = self.conn().await?;
        let batch = i32::try_from(batch).unwrap_or(i32::MAX);
        let token = super::new_token();
        let plain = topics.all && topics.not_exact.is_empty() && topics.not_like.is_empty();
        let single = topics.single();
        if plain || single.is_some() {
            // From the floors this store kept for it (see the migration `ready_positions`).
            let which = single.map(str::to_owned);
            let floors = self.floors_of(&which);
            let got: Vec<ClaimedReady> = diesel::sql_query(CLAIM_READY)
                .bind::<Nullable<Text>, _>(&which)
                .bind::<Integer, _>(batch)
                .bind::<Double, _>(lease.as_secs_f64())
                .bind::<BigInt, _>(token)
                .bind::<Text, _>(&*self.owner)
                .bind::<Nullable<Text>, _>(floors)
                .load(&mut conn)
                .await?;
            if let Some(newest) = got.iter().find_map(|r| r.floors.clone()) {
                self.keep_floors(which, newest);
            }
            let mut rows: Vec<ClaimedMessage> = got.into_iter().map(|r| r.message).collect();
            rows.sort_unstable_by_key(|m| (m.priority, m.id));
            return Ok(rows);
        }
        if let Some(named) = topics.named() {
            if named.is_empty() {
                return Ok(Vec::new());
            }
            let floors = self.floors_of_each(&named);
            let got: Vec<ClaimedSet> = diesel::sql_query(CLAIM_SET)
                .bind::<Array<Text>, _>(&named)
                .bind::<Integer, _>(batch)
                .bind::<Double, _>(lease.as_secs_f64())
                .bind::<BigInt, _>(token)
                .bind::<Text, _>(&*self.owner)
                .bind::<Array<Nullable<Text>>, _>(&floors)
                .load(&mut conn)
                .await?;
            if let Some(newest) = got.iter().find_map(|r| r.floors.clone()) {
                self.keep_floors_of_each(&named, newest);
            }
            let mut rows: Vec<ClaimedMessage> = got.into_iter().map(|r| r.message).collect();
            rows.sort_unstable_by_key(|m| (m.priority, m.id));
            return Ok(rows);
        }
        // Patterns or exclusions: from the floors of the filter (see the migration `filter_floors`).
        let key = Some(topics.floors_key());
        let floors = self.floors_of(&key);
        let got: Vec<ClaimedReady> = diesel::sql_query(CLAIM_MATCHING)
            .bind::<Bool, _>(topics.all)
            .bind::<Array<Text>, _>(&topics.exact)
            .bind::<Array<Text>, _>(&topics.like)
            .bind::<Array<Text>, _>(&topics.not_exact)
            .bind::<Array<Text>, _>(&topics.not_like)
            .bind::<Integer, _>(batch)
            .bind::<Double, _>(lease.as_secs_f64())
            .bind::<BigInt, _>(token)
            .bind::<Text, _>(&*self.owner)
            .bind::<Nullable<Text>, _>(floors)
            .load(&mut conn)
            .await?;
        if let Some(newest) = got.iter().find_map(|r| r.floors.clone()) {
            self.keep_floors(key, newest);
        }
        let mut rows: Vec<ClaimedMessage> = got.into_iter().map(|r| r.message).collect();
        rows.sort_unstable_by_key(|m| (m.priority, m.id));
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns() {
        let t = Topics::only(["orders.*", "audit", "a_b%*"]);
        assert!(t.matches("orders.created"));
        assert!(t.matches("orders."));
        assert!(!t.matches("order.created"));
        assert!(t.matches("audit"));
        assert!(!t.matches("audit2"));
        assert!(t.matches("a_b%x"));
        assert!(!t.matches("aXb%x"));
        assert!(Topics::only(["*"]).matches("anything"));
        assert!(Topics::only(Vec::<String>::new()).is_empty());
        let rest = Topics::all().excluding(&Topics::only(["orders.*", "audit"]));
        assert!(
            rest.matches("payments.x") && !rest.matches("orders.created") && !rest.matches("audit")
        );
        assert!(Topics::only(["x"]).excluding(&Topics::all()).is_empty());
        let mid = Topics::only(["a*b*c"]);
        assert!(mid.matches("abc") && mid.matches("a-b-c") && !mid.matches("a-c-b"));
    }
}
