//! What the operator console reads of this relay's metrics: the outcome counters per topic (the
//! console keeps a history of them to draw rates), and which sink serves a topic and whether it
//! is up.

use std::collections::BTreeMap;

use prometheus::core::Collector;

use super::Metrics;

/// Delivered, retried and dead-lettered messages of one topic since the relay started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Outcomes {
    /// Delivered by a sink.
    pub delivered: u64,
    /// Failed and scheduled again.
    pub retried: u64,
    /// Moved to the dead letters.
    pub dead: u64,
}

impl Outcomes {
    /// `self - earlier`, never below 0.
    pub fn since(&self, earlier: &Outcomes) -> Outcomes {
        Outcomes {
            delivered: self.delivered.saturating_sub(earlier.delivered),
            retried: self.retried.saturating_sub(earlier.retried),
            dead: self.dead.saturating_sub(earlier.dead),
        }
    }
}

impl Metrics {
    /// The outcome counters of every topic that has one, summed over sinks (topics past
    /// `metrics.max_topics` count under their shared label).
    pub fn outcomes(&self) -> BTreeMap<String, Outcomes> {
        let mut out: BTreeMap<String, Outcomes> = BTreeMap::new();
        for (which, vec) in [
            (0, &self.delivered),
            (1, &self.retried),
            (2, &self.dead_lettered),
        ] {
            for family in vec.collect() {
                for m in family.get_metric() {
                    let Some(topic) = m
                        .get_label()
                        .iter()
                        .find(|l| l.name() == "topic")
                        .map(|l| l.value().to_owned())
                    else {
                        continue;
                    };
                    let n = m.get_counter().get_value() as u64;
                    let o = out.entry(topic).or_default();
                    match which {
                        0 => o.delivered += n,
                        1 => o.retried += n,
                        _ => o.dead += n,
                    }
                }
            }
        }
        out
    }

    /// The sink of the first route whose topics match `topic` (the one that claims it), and
    /// whether its last delivery went through.
    pub fn sink_of(&self, topic: &str) -> Option<(String, bool)> {
        let routes = self.routes.lock().expect("routes lock");
        let (sink, _) = routes.iter().find(|(_, t)| t.matches(topic))?;
        let up = self
            .sink_up
            .get_metric_with_label_values(&[sink])
            .map(|g| g.get() > 0.5)
            .unwrap_or(true);
        Some((sink.clone(), up))
    }
}
