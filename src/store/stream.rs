//! Stream mode's slots (see the migration `stream`): setting up, reading and dropping the logical
//! replication slots a relay streams published messages from, and dead-lettering a stream message.

use diesel::sql_types::{BigInt, Bool, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::RunQueryDsl;

use super::{Store, storable};
use crate::error::{Error, Result};

/// A stream slot as the server sees it.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct StreamSlot {
    /// The slot's name.
    #[diesel(sql_type = Text)]
    pub slot_name: String,
    /// The publication the relay names when it streams.
    #[diesel(sql_type = Text)]
    pub publication: String,
    /// Whether the server still has the slot (false: it was dropped behind postbox's back).
    #[diesel(sql_type = Bool)]
    pub exists: bool,
    /// Whether a relay streams from it now.
    #[diesel(sql_type = Bool)]
    pub active: bool,
    /// The server process that streams it, if any.
    #[diesel(sql_type = Nullable<Integer>)]
    pub active_pid: Option<i32>,
    /// `reserved`, `extended`, `unreserved` or `lost` (the WAL it needed is gone).
    #[diesel(sql_type = Nullable<Text>)]
    pub wal_status: Option<String>,
    /// Bytes of WAL that can still be written before the slot is lost
    /// (`max_slot_wal_keep_size`); none when unlimited.
    #[diesel(sql_type = Nullable<BigInt>)]
    pub safe_wal_size: Option<i64>,
    /// The position the relay confirmed: everything committed before it was delivered.
    #[diesel(sql_type = Nullable<Text>)]
    pub confirmed_lsn: Option<String>,
    /// The server's WAL position now.
    #[diesel(sql_type = Text)]
    pub current_lsn: String,
    /// Bytes of WAL between the confirmed position and the server's position: what a relay has
    /// still to read (most of it, when idle, is other work's WAL it will skip).
    #[diesel(sql_type = Nullable<BigInt>)]
    pub lag_bytes: Option<i64>,
    /// Bytes of WAL the slot keeps on the server's disk.
    #[diesel(sql_type = Nullable<BigInt>)]
    pub retained_bytes: Option<i64>,
    /// The name is held on this server by another database's slot or a physical slot (slot
    /// names are the server's): this database's slot cannot exist under it.
    #[diesel(sql_type = Bool)]
    pub name_taken: bool,
    /// Whether the publication exists (without it the server ends every session at the first
    /// table change it decodes: nothing is delivered).
    #[diesel(sql_type = Bool)]
    pub publication_exists: bool,
    /// A range of the WAL that may never have been streamed: the slot was found confirmed past
    /// the limit postbox's relays recorded (created again by hand under the same name, advanced
    /// by hand, or streamed by another program). Reported until `postbox stream setup`.
    #[diesel(sql_type = Nullable<Text>)]
    pub gap: Option<String>,
    /// The bytes of WAL in [`gap`](Self::gap).
    #[diesel(sql_type = Nullable<BigInt>)]
    pub gap_bytes: Option<i64>,
}

impl StreamSlot {
    /// Whether the slot can no longer be streamed: lost (`wal_status = lost`) or dropped.
    pub fn is_lost(&self) -> bool {
        !self.exists || self.wal_status.as_deref() == Some("lost")
    }

    /// Whether no relay can stream it: lost, dropped, or its publication is missing.
    pub fn is_broken(&self) -> bool {
        self.is_lost() || !self.publication_exists
    }
}

const STATUS: &str = "
SELECT r.slot_name, r.publication, s.slot_name IS NOT NULL AS exists,
       coalesce(s.active, false) AS active, s.active_pid, s.wal_status::text AS wal_status,
       s.safe_wal_size, s.confirmed_flush_lsn::text AS confirmed_lsn,
       pg_current_wal_lsn()::text AS current_lsn,
       (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint AS lag_bytes,
       (pg_current_wal_lsn() - s.restart_lsn)::bigint AS retained_bytes,
       EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots o
               WHERE o.slot_name = r.slot_name
                 AND (o.database IS DISTINCT FROM current_database() OR o.slot_type <> 'logical'))
           AS name_taken,
       EXISTS (SELECT 1 FROM pg_catalog.pg_publication p WHERE p.pubname = r.publication)
           AS publication_exists,
       r.gap_from::text || '..' || r.gap_to::text || ' (found '
           || to_char(r.gap_found_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || ' UTC)' AS gap,
       (r.gap_to - r.gap_from)::bigint AS gap_bytes
FROM postbox.stream_slots r
LEFT JOIN pg_catalog.pg_replication_slots s
       ON s.slot_name = r.slot_name AND s.database = current_database()
WHERE $1::text IS NULL OR r.slot_name = $1
ORDER BY r.slot_name";

/// What `stream_setup` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamSetup {
    /// The publication was created (it did not exist).
    pub created_publication: bool,
    /// The slot was created (it did not exist, or it was lost and was replaced).
    pub created_slot: bool,
    /// The slot replaced was lost: what was published after its confirmed position, up to this
    /// setup, was never delivered (the range, `from..to`).
    pub replaced_lost: Option<String>,
    /// A range a relay reported as possibly never streamed (the slot was found confirmed past
    /// postbox's record: created again by hand), acknowledged by this setup: no longer reported.
    pub acknowledged_gap: Option<String>,
}

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Bool)]
    flag: bool,
}

#[derive(QueryableByName)]
struct Setting {
    #[diesel(sql_type = Text)]
    value: String,
}

/// A name PostgreSQL accepts for a replication slot (and postbox for a publication): lower-case
/// letters, digits and underscores, at most 63 bytes.
pub fn check_slot_name(field: &'static str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            field,
            problem: format!(
                "{name:?}: use 1 to 63 lower-case letters, digits and underscores (a replication slot name)"
            ),
        })
    }
}

impl Store {
    /// What this server and role lack for stream mode, each as a sentence naming the setting or
    /// privilege (empty when nothing is missing).
    pub async fn stream_prerequisites(&self) -> Result<Vec<String>> {
        self.stream_prerequisites_for(None).await
    }

    /// [`Store::stream_prerequisites`], where `slot` (if given) may exist already: it needs no
    /// free slot then.
    async fn stream_prerequisites_for(&self, slot: Option<&str>) -> Result<Vec<String>> {
        let mut conn = self.conn().await?;
        let mut missing = Vec::new();
        let level: Setting = diesel::sql_query("SELECT current_setting('wal_level') AS value")
            .get_result(&mut *conn)
            .await?;
        if level.value != "logical" {
            missing.push(format!(
                "wal_level is {}, stream mode needs logical (set it and restart the server; RDS and Aurora: rds.logical_replication = 1, Cloud SQL: cloudsql.logical_decoding = on, Azure: wal_level = logical in the server parameters)",
                level.value
            ));
        }
        let replication: Flag = diesel::sql_query(
            "SELECT rolreplication OR rolsuper OR EXISTS (
                 SELECT 1 FROM pg_catalog.pg_roles g
                 WHERE g.rolname = 'rds_replication' AND pg_has_role(current_user, g.oid, 'member'))
             AS flag FROM pg_catalog.pg_roles WHERE rolname = current_user",
        )
        .get_result(&mut *conn)
        .await?;
        if !replication.flag {
            missing.push(
                "the role has no REPLICATION attribute (ALTER ROLE ... REPLICATION; RDS: GRANT rds_replication)"
                    .into(),
            );
        }
        let slots: Flag = diesel::sql_query(
            "SELECT current_setting('max_replication_slots')::int > (SELECT count(*) FROM pg_catalog.pg_replication_slots)
                 OR EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = $1) AS flag",
        )
        .bind::<Nullable<Text>, _>(slot)
        .get_result(&mut *conn)
        .await?;
        if !slots.flag {
            missing.push(
                "max_replication_slots is reached: no slot is free for postbox (raise it and restart the server)"
                    .into(),
            );
        }
        Ok(missing)
    }

    /// The stream slots registered in this database (or only `slot`), with the server's view of
    /// each: active, WAL status, lag.
    pub async fn stream_status(&self, slot: Option<&str>) -> Result<Vec<StreamSlot>> {
        Ok(diesel::sql_query(STATUS)
            .bind::<Nullable<Text>, _>(slot)
            .load(&mut *self.conn().await?)
            .await?)
    }

    /// Sets up stream mode in this database: the publication (empty: only logical-decoding
    /// messages are streamed) and the slot, registered so that `publish` accepts messages. Safe
    /// to run again. A slot that was lost (or dropped behind postbox's back) is replaced, and
    /// the report says which range of the WAL was never delivered: this is the explicit operator
    /// command a lost slot waits for. A range a relay reported as possibly never streamed (the
    /// slot was created again by hand) is acknowledged: no longer reported.
    pub async fn stream_setup(&self, slot: &str, publication: &str) -> Result<StreamSetup> {
        check_slot_name("stream.slot", slot)?;
        check_slot_name("stream.publication", publication)?;
        let missing = self.stream_prerequisites_for(Some(slot)).await?;
        if !missing.is_empty() {
            return Err(Error::InvalidArgument {
                field: "stream",
                problem: missing.join("; "),
            });
        }
        let mut conn = self.conn().await?;
        let mut report = StreamSetup::default();
        let has_publication: Flag = diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1) AS flag",
        )
        .bind::<Text, _>(publication)
        .get_result(&mut *conn)
        .await?;
        if !has_publication.flag {
            // Names are checked above: plain identifiers, safe to splice.
            diesel::sql_query(format!("CREATE PUBLICATION {publication}"))
                .execute(&mut *conn)
                .await?;
            report.created_publication = true;
        }
        // One setup or drop at a time in this database (a session lock: slot creation cannot
        // run in a transaction that wrote).
        diesel::sql_query("SELECT pg_advisory_lock(1886352247, 21)")
            .execute(&mut *conn)
            .await?;
        let result = setup_slot(&mut conn, slot, publication, &mut report).await;
        diesel::sql_query("SELECT pg_advisory_unlock(1886352247, 21)")
            .execute(&mut *conn)
            .await?;
        result?;
        Ok(report)
    }

    /// Drops the slot (if the server has it) and forgets it: `publish` refuses messages from then
    /// on unless another slot is set up. Refused while a relay streams it (stop the relays with
    /// `[stream]` first). The publication is dropped too when no other slot names it. Returns the
    /// slot as it was (its confirmed position: what was published after it was never delivered),
    /// or `None` if it was not set up.
    pub async fn stream_drop(&self, slot: &str) -> Result<Option<StreamSlot>> {
        check_slot_name("stream.slot", slot)?;
        let mut conn = self.conn().await?;
        diesel::sql_query("SELECT pg_advisory_lock(1886352247, 21)")
            .execute(&mut *conn)
            .await?;
        let result = drop_slot(&mut conn, slot).await;
        diesel::sql_query("SELECT pg_advisory_unlock(1886352247, 21)")
            .execute(&mut *conn)
            .await?;
        result
    }

    /// Whether the publication a relay names when it streams exists in this database (the
    /// server ends a session at the first table change it decodes without it).
    pub async fn stream_publication_exists(&self, publication: &str) -> Result<bool> {
        let mut conn = self.conn().await?;
        let there: Flag = diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1) AS flag",
        )
        .bind::<Text, _>(publication)
        .get_result(&mut *conn)
        .await?;
        Ok(there.flag)
    }

    /// Dead-letters a stream message (one the sink refused for good, or one that cannot be read)
    /// with `reason`, unless a dead letter of the same stream id exists (a redelivery after a
    /// restart). `dead replay` puts it into the table queue like any dead letter. What
    /// PostgreSQL cannot store (a NUL in text or JSON) is replaced with U+FFFD, and the reason says
    /// so; when the database still refuses the message as it is, see
    /// [`Store::stream_dead_letter_in_part`].
    #[allow(clippy::too_many_arguments)]
    pub async fn stream_dead_letter(
        &self,
        stream_id: &str,
        topic: &str,
        key: Option<&str>,
        payload: &serde_json::Value,
        headers: &serde_json::Value,
        created_at: chrono::DateTime<chrono::Utc>,
        reason: &str,
    ) -> Result<bool> {
        let (topic, key) = (storable::text(topic), key.map(storable::text));
        let (payload_clean, headers_clean) = (storable::json(payload), storable::json(headers));
        let reason = if payload_clean.is_some()
            || headers_clean.is_some()
            || matches!(topic, std::borrow::Cow::Owned(_))
            || matches!(key, Some(std::borrow::Cow::Owned(_)))
        {
            std::borrow::Cow::Owned(format!(
                "{}; NUL characters, which PostgreSQL cannot store, were replaced with U+FFFD",
                storable::text(reason)
            ))
        } else {
            storable::text(reason)
        };
        self.insert_stream_dead(
            stream_id,
            &topic,
            key.as_deref(),
            payload_clean.as_ref().unwrap_or(payload),
            headers_clean.as_ref().unwrap_or(headers),
            created_at,
            &reason,
        )
        .await
    }

    /// The last resort for a stream message the database refused to store as it was (a value
    /// past a limit of PostgreSQL's): a dead letter with the topic cut to 255 bytes, no key or
    /// headers, and as payload a JSON string of the message's first 64 KiB, in printable ASCII;
    /// `refused` (the database's answer) joins the reason. Made of values any PostgreSQL stores,
    /// so its failure means the database is away, not the message.
    pub async fn stream_dead_letter_in_part(
        &self,
        stream_id: &str,
        topic: &str,
        content: &str,
        created_at: chrono::DateTime<chrono::Utc>,
        reason: &str,
        refused: &str,
    ) -> Result<bool> {
        let reason = storable::ascii(
            &format!(
                "{reason}; stored in part (topic cut to 255 bytes, no key or headers, the payload is the message's first 64 KiB as text): the database refused it as it was: {refused}"
            ),
            8 * 1024,
        );
        self.insert_stream_dead(
            &storable::ascii(stream_id, 255),
            &storable::ascii(topic, 255),
            None,
            &serde_json::Value::String(storable::ascii(content, 64 * 1024)),
            &serde_json::json!({}),
            created_at,
            &reason,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn insert_stream_dead(
        &self,
        stream_id: &str,
        topic: &str,
        key: Option<&str>,
        payload: &serde_json::Value,
        headers: &serde_json::Value,
        created_at: chrono::DateTime<chrono::Utc>,
        reason: &str,
    ) -> Result<bool> {
        use diesel_async::AsyncConnection;
        let mut conn = self.conn().await?;
        // Committed durably before the stream's position passes the message (the store's
        // sessions commit asynchronously: a lost completion there only leaves a message pending,
        // a lost stream dead letter would be gone for good).
        let n = conn
            .transaction::<_, Error, _>(async |c| {
                diesel::sql_query("SET LOCAL synchronous_commit = on")
                    .execute(c)
                    .await?;
                Ok(diesel::sql_query(
                    "INSERT INTO postbox.dead_letters
                         (id, topic, key, ordered, payload, headers, priority, attempts,
                          max_attempts, created_at, first_error, last_error, reason, stream_id)
                     VALUES (nextval(pg_get_serial_sequence('postbox.messages', 'id')), $1, $2,
                             false, $3, $4 || jsonb_build_object('postbox-stream-id', $5::text),
                             0, 1, 1, $6, $7, $7, $7, $5)
                     ON CONFLICT (stream_id) WHERE stream_id IS NOT NULL DO NOTHING",
                )
                .bind::<Text, _>(topic)
                .bind::<Nullable<Text>, _>(key)
                .bind::<Jsonb, _>(payload)
                .bind::<Jsonb, _>(headers)
                .bind::<Text, _>(stream_id)
                .bind::<Timestamptz, _>(created_at)
                .bind::<Text, _>(reason)
                .execute(c)
                .await?)
            })
            .await?;
        Ok(n == 1)
    }
}

/// Whether the server has a replication session named `application_name` (the streamer's own
/// name for its session), asked over a connection of its own, so that a pool connection stuck on
/// the same dead link cannot hold the answer up.
pub async fn stream_session_alive(url: &str, application_name: &str) -> Result<bool> {
    let mut conn = super::connect::open(url).await?;
    let there: Flag = diesel::sql_query(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_replication WHERE application_name = $1) AS flag",
    )
    .bind::<Text, _>(application_name)
    .get_result(&mut conn)
    .await?;
    Ok(there.flag)
}

#[derive(QueryableByName)]
struct Number {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The server's slot of a name, whichever database it belongs to.
#[derive(QueryableByName)]
struct ServerSlot {
    #[diesel(sql_type = Bool)]
    here: bool,
    #[diesel(sql_type = Nullable<Text>)]
    database: Option<String>,
    #[diesel(sql_type = Text)]
    slot_type: String,
    #[diesel(sql_type = Nullable<Text>)]
    plugin: Option<String>,
    #[diesel(sql_type = Bool)]
    lost: bool,
    #[diesel(sql_type = Nullable<Text>)]
    confirmed_lsn: Option<String>,
    #[diesel(sql_type = Text)]
    current_lsn: String,
}

/// The slot part of `stream_setup`, under its advisory lock: refuses a name another database or
/// a physical slot holds, replaces a lost or dropped slot (unregistered meanwhile, so `publish`
/// refuses rather than writing into a slot that is being replaced), creates a missing one, and
/// registers it.
async fn setup_slot(
    conn: &mut diesel_async::AsyncPgConnection,
    slot: &str,
    publication: &str,
    report: &mut StreamSetup,
) -> Result<()> {
    use diesel_async::AsyncConnection;
    let found: Option<ServerSlot> = diesel::sql_query(
        "SELECT database IS NOT DISTINCT FROM current_database() AS here, database::text AS database,
                slot_type, plugin::text AS plugin, wal_status IS NOT DISTINCT FROM 'lost' AS lost,
                confirmed_flush_lsn::text AS confirmed_lsn, pg_current_wal_lsn()::text AS current_lsn
         FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
    )
    .bind::<Text, _>(slot)
    .get_result(&mut *conn)
    .await
    .optional()?;
    if let Some(f) = &found {
        let taken = if f.slot_type != "logical" {
            Some("a physical replication slot (a standby server's)".to_owned())
        } else if !f.here {
            Some(format!(
                "a slot of database {:?}",
                f.database.as_deref().unwrap_or("?")
            ))
        } else if f.plugin.as_deref() != Some("pgoutput") {
            Some(format!(
                "a slot of output plugin {:?}",
                f.plugin.as_deref().unwrap_or("?")
            ))
        } else {
            None
        };
        if let Some(taken) = taken {
            return Err(Error::InvalidArgument {
                field: "stream.slot",
                problem: format!(
                    "the name {slot:?} is taken on this server by {taken}: slot names are the server's, choose another stream.slot"
                ),
            });
        }
    }
    let registered: Vec<StreamSlot> = diesel::sql_query(STATUS)
        .bind::<Nullable<Text>, _>(Some(slot))
        .load(&mut *conn)
        .await?;
    let registered = <[StreamSlot]>::first(&registered);
    let lost = found.as_ref().is_some_and(|f| f.lost) || (registered.is_some() && found.is_none());
    report.acknowledged_gap = registered.and_then(|r| r.gap.clone());
    if lost {
        let from = found
            .as_ref()
            .and_then(|f| f.confirmed_lsn.clone())
            .or_else(|| registered.and_then(|r| r.confirmed_lsn.clone()))
            .unwrap_or_else(|| "its last confirmed position".into());
        let to = found
            .as_ref()
            .map(|f| f.current_lsn.clone())
            .or_else(|| registered.map(|r| r.current_lsn.clone()))
            .unwrap_or_default();
        report.replaced_lost = Some(format!("{from}..{to}"));
        diesel::sql_query("DELETE FROM postbox.stream_slots WHERE slot_name = $1")
            .bind::<Text, _>(slot)
            .execute(&mut *conn)
            .await?;
        if found.is_some() {
            diesel::sql_query("SELECT pg_catalog.pg_drop_replication_slot($1)")
                .bind::<Text, _>(slot)
                .execute(&mut *conn)
                .await?;
        }
    }
    if found.is_none() || lost {
        // Creating a slot waits for the transactions open now to end: no statement timeout.
        let slot = slot.to_owned();
        conn.transaction::<_, Error, _>(async |c| {
            diesel::sql_query("SET LOCAL statement_timeout = 0")
                .execute(c)
                .await?;
            // PostgreSQL 17 and later: a failover slot, which a standby configured for it
            // (`sync_replication_slots`) keeps in step, so the stream survives a promotion.
            let version: Number = diesel::sql_query(
                "SELECT current_setting('server_version_num')::bigint AS n",
            )
            .get_result(c)
            .await?;
            diesel::sql_query(if version.n >= 170_000 {
                "SELECT 1 FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput', failover => true)"
            } else {
                "SELECT 1 FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')"
            })
            .bind::<Text, _>(&slot)
            .execute(c)
            .await?;
            Ok(())
        })
        .await?;
        report.created_slot = true;
    }
    diesel::sql_query(
        "INSERT INTO postbox.stream_slots (slot_name, publication) VALUES ($1, $2)
         ON CONFLICT (slot_name) DO UPDATE
             SET publication = EXCLUDED.publication,
                 gap_from = NULL, gap_to = NULL, gap_found_at = NULL",
    )
    .bind::<Text, _>(slot)
    .bind::<Text, _>(publication)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn drop_slot(
    conn: &mut diesel_async::AsyncPgConnection,
    slot: &str,
) -> Result<Option<StreamSlot>> {
    let registered: Vec<StreamSlot> = diesel::sql_query(STATUS)
        .bind::<Nullable<Text>, _>(Some(slot))
        .load(&mut *conn)
        .await?;
    let Some(r) = registered.into_iter().next() else {
        return Ok(None);
    };
    if r.active {
        return Err(Error::InvalidArgument {
            field: "stream.slot",
            problem: format!(
                "slot {slot:?} is being streamed (server pid {}): stop the relays with [stream] first (or they set it up again)",
                r.active_pid.unwrap_or_default()
            ),
        });
    }
    // The slot first: if that fails the registration stays, and from the moment it is gone
    // `publish` finds no slot to join and refuses.
    diesel::sql_query(
        "SELECT pg_catalog.pg_drop_replication_slot(slot_name) FROM pg_catalog.pg_replication_slots
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind::<Text, _>(slot)
    .execute(&mut *conn)
    .await?;
    diesel::sql_query("DELETE FROM postbox.stream_slots WHERE slot_name = $1")
        .bind::<Text, _>(slot)
        .execute(&mut *conn)
        .await?;
    let still_named: Flag = diesel::sql_query(
        "SELECT EXISTS (SELECT 1 FROM postbox.stream_slots WHERE publication = $1) AS flag",
    )
    .bind::<Text, _>(&r.publication)
    .get_result(&mut *conn)
    .await?;
    if !still_named.flag {
        diesel::sql_query(format!("DROP PUBLICATION IF EXISTS {}", r.publication))
            .execute(&mut *conn)
            .await?;
    }
    Ok(Some(r))
}
