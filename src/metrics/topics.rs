//! Which topics get series of their own. Every per-topic metric costs its series once per topic
//! (about 30 with the latency histogram): with thousands of topics that is a scrape of hundreds of
//! thousands of series on every replica. Only the largest `max` topics are named; every other
//! topic is counted under [`OTHER`], so sums over the label stay exact.

use std::collections::{HashMap, HashSet};

/// The label value of every topic that has no series of its own.
pub const OTHER: &str = "(other)";

/// How many topics get series of their own unless configured (`metrics.max_topics`).
pub const DEFAULT_MAX_TOPICS: usize = 50;

/// The named topics, and what ranks them.
#[derive(Debug)]
pub(super) struct TopicLabels {
    max: usize,
    named: HashSet<String>,
    /// Messages settled per topic since the last ranking (this relay's traffic).
    traffic: HashMap<String, u64>,
}

impl TopicLabels {
    pub(super) fn new(max: usize) -> Self {
        TopicLabels {
            max,
            named: HashSet::new(),
            traffic: HashMap::new(),
        }
    }

    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// The label of `topic` for a message settled now. A topic not ranked yet is named while
    /// there is room, so that a relay's first topics show before the first sample.
    pub(super) fn settled<'a>(&mut self, topic: &'a str) -> &'a str {
        match self.traffic.get_mut(topic) {
            Some(n) => *n += 1,
            None => {
                self.traffic.insert(topic.to_owned(), 1);
            }
        }
        self.label(topic)
    }

    /// The label of `topic` as ranked now (a topic not ranked yet is named while there is room).
    pub(super) fn label<'a>(&mut self, topic: &'a str) -> &'a str {
        if self.named.contains(topic) {
            return topic;
        }
        if self.named.len() < self.max {
            self.named.insert(topic.to_owned());
            return topic;
        }
        OTHER
    }

    /// Ranks the topics again: the largest `max` by `sizes` (messages in the table and in the
    /// dead letters, from the sample every replica shares) plus the traffic since the last
    /// ranking; a named topic counts double, so that topics of about the same size do not take
    /// turns. Ties go by name. Returns the topics that lost their series.
    pub(super) fn rank(&mut self, sizes: &HashMap<&str, f64>) -> Vec<String> {
        let mut scores: HashMap<&str, f64> = sizes.clone();
        for (t, n) in &self.traffic {
            *scores.entry(t.as_str()).or_default() += *n as f64;
        }
        for t in &self.named {
            scores.entry(t.as_str()).or_default();
        }
        let mut ranked: Vec<(&str, f64)> = scores
            .into_iter()
            .map(|(t, s)| {
                let named = self.named.contains(t);
                (t, if named { s * 2.0 + 1.0 } else { s })
            })
            .filter(|(_, s)| *s > 0.0)
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let next: HashSet<String> = ranked
            .into_iter()
            .take(self.max)
            .map(|(t, _)| t.to_owned())
            .collect();
        let gone: Vec<String> = self.named.difference(&next).cloned().collect();
        self.named = next;
        self.traffic.clear();
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_topics_are_named_and_the_rest_are_other() {
        let mut l = TopicLabels::new(2);
        assert_eq!(l.settled("a"), "a");
        assert_eq!(l.settled("b"), "b");
        assert_eq!(l.settled("c"), OTHER, "no room left");
        let sizes = HashMap::from([("c", 100.0), ("d", 50.0), ("a", 1.0)]);
        let mut gone = l.rank(&sizes);
        gone.sort();
        // a: (1 + 1) × 2 + 1 = 5, b: 1 × 2 + 1 = 3, c: 100 + 1, d: 50.
        assert_eq!(gone, ["a", "b"]);
        assert_eq!(
            (l.label("c"), l.label("d"), l.label("a")),
            ("c", "d", OTHER)
        );
        // A named topic keeps its place against one a little larger.
        let sizes = HashMap::from([("c", 100.0), ("d", 50.0), ("e", 90.0)]);
        assert!(l.rank(&sizes).is_empty());
        // Ties go by name, whatever the order they come in.
        let mut l = TopicLabels::new(1);
        let sizes = HashMap::from([("y", 5.0), ("x", 5.0)]);
        l.rank(&sizes);
        assert_eq!(l.label("x"), "x");
    }
}
