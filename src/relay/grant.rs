//! `postbox grant --writer ROLE --relay ROLE --operator ROLE` and `postbox grant --revoke ROLE`:
//! least-privilege roles on this database's postbox schema.

use clap::Args;

use super::{RelayError, Result};
use crate::config::Settings;
use crate::store::grant::{RoleKind, grant_sql, revoke_sql};

#[derive(Args)]
#[command(group(clap::ArgGroup::new("what").required(true).multiple(true)))]
pub struct GrantArgs {
    /// Role that enqueues and publishes (an app), and reads no message.
    #[arg(long, value_name = "ROLE", group = "what")]
    pub writer: Vec<String>,
    /// Role that runs the relay and its upkeep, without changing the schema.
    #[arg(long, value_name = "ROLE", group = "what")]
    pub relay: Vec<String>,
    /// Role that pauses, resumes, cancels, replays, purges and enqueues (and reads everything).
    #[arg(long, value_name = "ROLE", group = "what")]
    pub operator: Vec<String>,
    /// Role to take every postbox right back from.
    #[arg(long, value_name = "ROLE", group = "what", conflicts_with_all = ["writer", "relay", "operator"])]
    pub revoke: Vec<String>,
    /// Print the SQL instead of running it (for teams that manage grants elsewhere).
    #[arg(long)]
    pub sql: bool,
}

impl GrantArgs {
    fn each(&self) -> Vec<(RoleKind, &str)> {
        let mut out = Vec::new();
        for (kind, roles) in [
            (RoleKind::Writer, &self.writer),
            (RoleKind::Relay, &self.relay),
            (RoleKind::Operator, &self.operator),
        ] {
            out.extend(roles.iter().map(|r| (kind, r.as_str())));
        }
        out
    }
}

/// Runs `postbox grant`.
pub async fn run(settings: &Settings, a: GrantArgs) -> Result<()> {
    if let Some(empty) = a
        .each()
        .iter()
        .map(|(_, r)| *r)
        .chain(a.revoke.iter().map(String::as_str))
        .find(|r| r.is_empty())
    {
        return Err(RelayError::Usage(format!(
            "grant: role name {empty:?} is empty"
        )));
    }
    if a.sql {
        for (kind, role) in a.each() {
            println!("-- {} {role}", kind.name());
            for s in grant_sql(kind, role) {
                println!("{s};");
            }
        }
        for role in &a.revoke {
            println!("-- revoke {role}");
            for s in revoke_sql(role) {
                println!("{s};");
            }
        }
        return Ok(());
    }
    let store = super::admin_store(settings).await?;
    for role in &a.revoke {
        let had = store.revoke(role).await.map_err(|e| denied(e, "revoke"))?;
        let names: Vec<&str> = had.iter().map(|k| k.name()).collect();
        println!(
            "revoked every postbox right from {role} (granted as: {})",
            if names.is_empty() {
                "nothing recorded".to_owned()
            } else {
                names.join(", ")
            }
        );
    }
    for (kind, role) in a.each() {
        let g = store
            .grant(kind, role)
            .await
            .map_err(|e| denied(e, "grant"))?;
        if g.created {
            println!(
                "created role {role} (NOLOGIN; give it to the roles that log in: GRANT {} TO app_user)",
                crate::store::grant::quote_ident(role)
            );
        }
        println!("granted {role} the {} rights", kind.name());
    }
    Ok(())
}

/// A refused grant says which privilege `postbox grant` needs.
fn denied(e: crate::Error, what: &str) -> RelayError {
    let text = e.to_string();
    if text.contains("permission denied") || text.contains("must be owner") {
        RelayError::Runtime(anyhow::anyhow!(
            "{what}: {text}\npostbox grant runs as the owner of schema postbox (the role that ran \
             `postbox migrate`), with CREATEROLE to create a role that does not exist yet"
        ))
    } else {
        RelayError::Runtime(e.into())
    }
}
