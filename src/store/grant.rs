//! Least privilege: the rights of the three roles `postbox grant` gives, as SQL an operator can
//! also run by hand (`postbox grant --sql`).
//!
//! - A **writer** enqueues (sync, async, plain SQL) and publishes, and nothing else: INSERT on the
//!   message columns an app sets, SELECT on the three columns an insert returns (id, topic,
//!   dedup key; never a payload), the relays listening for a wake-up, and the stream's slot list
//!   that `postbox.publish` checks; the same for `postbox.intake`, whose ids it draws from the
//!   messages' sequence (USAGE: `nextval`, nothing else). What its insert runs besides (a key's order, the commit
//!   check) runs as the schema's owner (migration `least_privilege`).
//! - A **relay** reads and writes every postbox table, runs every postbox function (the
//!   retention upkeep's included), and changes no schema.
//! - An **operator** reads everything and pauses, resumes, cancels, replays, purges and enqueues;
//!   it runs no retention upkeep and changes no schema.
//!
//! Every table of the schema is named in [`TABLES`] with what each role may do with it, so a
//! table a migration adds cannot be forgotten (a test compares the list with the schema).

use diesel::QueryableByName;
use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};

use super::Store;
use crate::error::{Error, Result};

/// One of the three roles `postbox grant` gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleKind {
    /// Enqueues and publishes; reads no message.
    Writer,
    /// Runs the relay and its upkeep.
    Relay,
    /// Pauses, resumes, cancels, replays, purges, enqueues; reads everything.
    Operator,
}

impl RoleKind {
    /// Every kind, in the order `postbox grant` applies them.
    pub const ALL: [RoleKind; 3] = [RoleKind::Writer, RoleKind::Relay, RoleKind::Operator];

    /// The name recorded in `postbox.grants` and used by the CLI.
    pub fn name(self) -> &'static str {
        match self {
            RoleKind::Writer => "writer",
            RoleKind::Relay => "relay",
            RoleKind::Operator => "operator",
        }
    }

    /// The kind named `name`, if any.
    pub fn parse(name: &str) -> Option<RoleKind> {
        RoleKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// What a role may do with one table (`None`: nothing).
#[derive(Clone, Copy, Debug)]
pub struct TableAccess {
    /// The table, in schema `postbox`.
    pub table: &'static str,
    /// The relay's privileges.
    pub relay: Option<&'static str>,
    /// The operator's privileges.
    pub operator: Option<&'static str>,
}

const ALL_DML: Option<&str> = Some("SELECT, INSERT, UPDATE, DELETE");
const READ: Option<&str> = Some("SELECT");

/// Every table of schema `postbox` and what the relay and the operator may do with it (a writer's
/// rights are column by column, in [`grant_sql`]).
pub const TABLES: &[TableAccess] = &[
    TableAccess {
        table: "messages",
        relay: ALL_DML,
        operator: ALL_DML,
    },
    // Unordered messages as their writers committed them (migration `intake`); the relay moves
    // them into messages, an operator may cancel one there.
    TableAccess {
        table: "intake",
        relay: ALL_DML,
        operator: ALL_DML,
    },
    TableAccess {
        table: "dead_letters",
        relay: ALL_DML,
        operator: ALL_DML,
    },
    TableAccess {
        table: "behind",
        relay: ALL_DML,
        operator: ALL_DML,
    },
    TableAccess {
        table: "holds",
        relay: ALL_DML,
        operator: READ,
    },
    TableAccess {
        table: "pauses",
        relay: ALL_DML,
        operator: ALL_DML,
    },
    TableAccess {
        table: "schedules",
        relay: ALL_DML,
        operator: ALL_DML,
    },
    TableAccess {
        table: "listeners",
        relay: ALL_DML,
        operator: READ,
    },
    TableAccess {
        table: "samples",
        relay: ALL_DML,
        operator: READ,
    },
    TableAccess {
        table: "completed",
        relay: ALL_DML,
        operator: READ,
    },
    TableAccess {
        table: "turns",
        relay: ALL_DML,
        operator: READ,
    },
    TableAccess {
        table: "stream_slots",
        relay: ALL_DML,
        operator: ALL_DML,
    },
    // Who was granted what: for the schema's owner (`postbox grant`, `postbox migrate`) alone.
    TableAccess {
        table: "grants",
        relay: None,
        operator: None,
    },
    // Handlers' transactions record their completions (through `postbox.complete_in_tx`, which
    // runs as the owner); the relay's upkeep drops those of messages gone.
    TableAccess {
        table: "completed_in_tx",
        relay: ALL_DML,
        operator: READ,
    },
    // The token of the server's run, read and made through `postbox.boot_token()` (owner's rights).
    TableAccess {
        table: "boot",
        relay: None,
        operator: None,
    },
    // The migrations applied: readable by PUBLIC (a role with nothing to apply sees so), written
    // by the owner's `postbox migrate`.
    TableAccess {
        table: "schema_migrations",
        relay: None,
        operator: None,
    },
];

/// The columns of `postbox.messages` an app sets when it enqueues.
const WRITER_INSERT: &str =
    "topic, key, ordered, payload, headers, priority, run_at, max_attempts, dedup_key";
/// The columns of `postbox.intake` an app sets when it enqueues.
const INTAKE_INSERT: &str = "topic, key, payload, headers, priority, run_at, max_attempts";
/// The columns an enqueue reads back (RETURNING, and a dedup key's live holder).
const WRITER_SELECT: &str = "id, topic, dedup_key";
/// Functions that run as the schema's owner and are for the relay alone.
const RELAY_ONLY_FUNCTIONS: &[&str] = &[
    "postbox.completed_partitions(interval)",
    "postbox.drop_expired_completed(timestamptz)",
];
/// Trigger functions that run as the schema's owner: for postbox.messages' own triggers, which
/// run them without EXECUTE, and for no role to attach to a table of its own.
const OWNER_TRIGGERS: &[&str] = &[
    "postbox.messages_before_insert()",
    "postbox.messages_check_head()",
    "postbox.messages_after_replay()",
];

/// `role` as an SQL identifier.
pub fn quote_ident(role: &str) -> String {
    format!("\"{}\"", role.replace('"', "\"\""))
}

/// The statements that give `role` the rights of `kind`. Each can run again without harm.
pub fn grant_sql(kind: RoleKind, role: &str) -> Vec<String> {
    let r = quote_ident(role);
    let mut sql = vec![format!("GRANT USAGE ON SCHEMA postbox TO {r}")];
    match kind {
        RoleKind::Writer => {
            sql.push(format!(
                "GRANT INSERT ({WRITER_INSERT}) ON postbox.messages TO {r}"
            ));
            sql.push(format!(
                "GRANT SELECT ({WRITER_SELECT}) ON postbox.messages TO {r}"
            ));
            // The intake (unordered messages without a dedup key): the same columns, and the ids
            // its rows draw from the messages' sequence.
            sql.push(format!(
                "GRANT INSERT ({INTAKE_INSERT}) ON postbox.intake TO {r}"
            ));
            sql.push(format!("GRANT SELECT (id, topic) ON postbox.intake TO {r}"));
            sql.push(format!(
                "GRANT USAGE ON SEQUENCE postbox.messages_id_seq TO {r}"
            ));
            // What the insert's wake-up and `postbox.publish` look at: no message in either.
            sql.push(format!("GRANT SELECT ON postbox.listeners TO {r}"));
            sql.push(format!("GRANT SELECT ON postbox.stream_slots TO {r}"));
            // A handler's transaction records its completion (`Job::complete_in`), for the
            // delivery its lease token names.
            sql.push(format!(
                "GRANT EXECUTE ON FUNCTION postbox.complete_in_tx(bigint, bigint) TO {r}"
            ));
            sql.push(format!(
                "GRANT EXECUTE ON FUNCTION postbox.publish(text[]) TO {r}"
            ));
        }
        RoleKind::Relay | RoleKind::Operator => {
            for t in TABLES {
                let privileges = if kind == RoleKind::Relay {
                    t.relay
                } else {
                    t.operator
                };
                if let Some(p) = privileges {
                    sql.push(format!("GRANT {p} ON postbox.{} TO {r}", t.table));
                }
            }
            sql.push(format!(
                "GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA postbox TO {r}"
            ));
            // Every function but the owner's triggers (and for an operator, the relay's upkeep),
            // which PUBLIC cannot run either.
            sql.push(format!(
                "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA postbox TO {r}"
            ));
            let relay_only = if kind == RoleKind::Operator {
                RELAY_ONLY_FUNCTIONS
            } else {
                &[]
            };
            for f in OWNER_TRIGGERS.iter().chain(relay_only) {
                sql.push(format!("REVOKE EXECUTE ON FUNCTION {f} FROM {r}"));
            }
        }
    }
    sql
}

/// The statements that take back every right on schema `postbox` from `role` (what PUBLIC has,
/// it keeps).
pub fn revoke_sql(role: &str) -> Vec<String> {
    let r = quote_ident(role);
    vec![
        format!("REVOKE ALL ON ALL TABLES IN SCHEMA postbox FROM {r}"),
        format!("REVOKE ALL ON ALL SEQUENCES IN SCHEMA postbox FROM {r}"),
        format!("REVOKE ALL ON ALL FUNCTIONS IN SCHEMA postbox FROM {r}"),
        format!("REVOKE USAGE ON SCHEMA postbox FROM {r}"),
    ]
}

/// What [`Store::grant`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    /// The role did not exist and was created (NOLOGIN: grant it to the roles that log in).
    pub created: bool,
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Text)]
    role: String,
    #[diesel(sql_type = Text)]
    kind: String,
}

impl Store {
    /// Gives `role` the rights of `kind` on this database's postbox schema, creating the role
    /// (NOLOGIN) when it does not exist, and records it so that `postbox migrate` gives it again
    /// on what later migrations create. Needs the schema's owner (and CREATEROLE to create).
    pub async fn grant(&self, kind: RoleKind, role: &str) -> Result<Granted> {
        let mut conn = self.conn().await?;
        conn.transaction::<_, Error, _>(async |conn| {
            #[derive(QueryableByName)]
            struct Exists {
                #[diesel(sql_type = diesel::sql_types::Bool)]
                exists: bool,
            }
            let e: Exists = diesel::sql_query(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $1) AS exists",
            )
            .bind::<Text, _>(role)
            .get_result(conn)
            .await?;
            if !e.exists {
                conn.batch_execute(&format!("CREATE ROLE {} NOLOGIN", quote_ident(role)))
                    .await?;
            }
            conn.batch_execute(&grant_sql(kind, role).join(";\n"))
                .await?;
            diesel::sql_query(
                "INSERT INTO postbox.grants (role, kind) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            )
            .bind::<Text, _>(role)
            .bind::<Text, _>(kind.name())
            .execute(conn)
            .await?;
            Ok(Granted { created: !e.exists })
        })
        .await
    }

    /// Takes back from `role` every right on the postbox schema and forgets its grants; returns
    /// the kinds it had been granted.
    pub async fn revoke(&self, role: &str) -> Result<Vec<RoleKind>> {
        let mut conn = self.conn().await?;
        conn.transaction::<_, Error, _>(async |conn| {
            conn.batch_execute(&revoke_sql(role).join(";\n")).await?;
            let rows: Vec<Row> = diesel::sql_query(
                "DELETE FROM postbox.grants WHERE role = $1 RETURNING role, kind",
            )
            .bind::<Text, _>(role)
            .load(conn)
            .await?;
            Ok(rows
                .iter()
                .filter_map(|r| RoleKind::parse(&r.kind))
                .collect())
        })
        .await
    }

    /// The roles `postbox grant` gave rights to, and which.
    pub async fn grants(&self) -> Result<Vec<(String, RoleKind)>> {
        let mut conn = self.conn().await?;
        let rows: Vec<Row> =
            diesel::sql_query("SELECT role, kind FROM postbox.grants ORDER BY role, kind")
                .load(&mut conn)
                .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| RoleKind::parse(&r.kind).map(|k| (r.role, k)))
            .collect())
    }

    /// Gives every recorded grant again (after migrations, on the objects they created). A role
    /// that no longer exists is skipped; each one's outcome comes back.
    pub async fn regrant(&self) -> Result<Vec<(String, RoleKind, Result<()>)>> {
        let mut out = Vec::new();
        for (role, kind) in self.grants().await? {
            let mut conn = self.conn().await?;
            let done = conn
                .batch_execute(&grant_sql(kind, &role).join(";\n"))
                .await
                .map_err(Error::from);
            out.push((role, kind, done));
        }
        Ok(out)
    }
}

#[derive(QueryableByName)]
struct Missing {
    #[diesel(sql_type = Text)]
    what: String,
}

impl Store {
    /// True if this store's role owns schema `postbox` (directly or through a role it is a
    /// member of): it may run migrations and give grants.
    pub async fn owns_schema(&self) -> Result<bool> {
        #[derive(QueryableByName)]
        struct Owns {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            owns: bool,
        }
        let rows: Vec<Owns> = diesel::sql_query(
            "SELECT pg_has_role(nspowner, 'USAGE') AS owns FROM pg_catalog.pg_namespace
             WHERE nspname = 'postbox'",
        )
        .load(&mut *self.conn().await?)
        .await?;
        Ok(rows.iter().any(|r| r.owns))
    }

    /// The privileges an engine (embedded, or a relay's) needs that this store's role lacks, each
    /// as `PRIVILEGE on OBJECT` (empty when it has them all): what [`grant_sql`] gives
    /// [`RoleKind::Relay`], but for the stream's slot list (the streamer checks its own).
    pub async fn missing_relay_privileges(&self) -> Result<Vec<String>> {
        let mut checks = vec!["SELECT 'USAGE on schema postbox' AS what WHERE NOT has_schema_privilege('postbox', 'USAGE')".to_owned()];
        for t in TABLES.iter().filter(|t| t.table != "stream_slots") {
            if let Some(privileges) = t.relay {
                for p in privileges.split(", ") {
                    checks.push(format!(
                        "SELECT '{p} on postbox.{t}' AS what WHERE to_regclass('postbox.{t}') IS NOT NULL AND NOT has_table_privilege('postbox.{t}', '{p}')",
                        t = t.table
                    ));
                }
            }
        }
        checks.push(
            "SELECT 'USAGE on sequence ' || c.oid::regclass::text AS what FROM pg_catalog.pg_class c
             WHERE c.relnamespace = 'postbox'::regnamespace
               AND CASE WHEN c.relkind = 'S' THEN NOT has_sequence_privilege(c.oid, 'USAGE') END"
                .to_owned(),
        );
        let owner_only: Vec<String> = OWNER_TRIGGERS.iter().map(|f| format!("'{f}'")).collect();
        checks.push(format!(
            "SELECT 'EXECUTE on function ' || p.oid::regprocedure::text AS what FROM pg_catalog.pg_proc p
             WHERE p.pronamespace = 'postbox'::regnamespace
               AND p.oid::regprocedure::text NOT IN ({})
               AND NOT has_function_privilege(p.oid, 'EXECUTE')",
            owner_only.join(", ")
        ));
        let rows: Vec<Missing> = diesel::sql_query(checks.join("\nUNION ALL\n"))
            .load(&mut *self.conn().await?)
            .await?;
        Ok(rows.into_iter().map(|m| m.what).collect())
    }
}
