//! Who holds the xmin horizon back: the oldest transaction of the database (a session idle in a
//! transaction, a long report, `pg_dump`, a prepared transaction), named, and the replication
//! slots that keep an xmin. Set from the metrics sample; one series for the oldest holder.

use prometheus::{GaugeVec, Registry};

use super::gauge_vec;
use crate::store::SampleRow;

pub(super) struct Horizon {
    holder: GaugeVec,
    slot_xmin: GaugeVec,
}

impl Horizon {
    pub(super) fn register(r: &Registry) -> Self {
        Horizon {
            holder: gauge_vec(
                r,
                "postbox_xmin_horizon_holder_age_seconds",
                "Age of the oldest transaction of the database, with who holds it (pid, application_name, state: a prepared transaction's gid as application_name): it keeps vacuum from cleaning the queue.",
                &["pid", "application_name", "state"],
            ),
            slot_xmin: gauge_vec(
                r,
                "postbox_replication_slot_xmin_age",
                "Transactions since the xmin a replication slot keeps (a standby's hot_standby_feedback): it keeps vacuum from cleaning the queue.",
                &["slot"],
            ),
        }
    }

    /// From a sample's `horizon` rows (label `pid|application_name|state`, the oldest session's
    /// and the oldest prepared transaction's) and `slot_xmin` rows.
    pub(super) fn apply(&self, rows: &[SampleRow]) {
        self.holder.reset();
        self.slot_xmin.reset();
        let oldest = rows
            .iter()
            .filter(|r| r.metric == "horizon")
            .max_by(|a, b| a.value.total_cmp(&b.value));
        if let Some(r) = oldest {
            let mut parts = r.label.splitn(3, '|');
            let (pid, name, state) = (
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default(),
            );
            self.holder
                .with_label_values(&[pid, name, state])
                .set(r.value);
        }
        for r in rows.iter().filter(|r| r.metric == "slot_xmin") {
            self.slot_xmin.with_label_values(&[&r.label]).set(r.value);
        }
    }
}
