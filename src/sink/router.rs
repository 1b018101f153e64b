//! Routes: topic patterns → sinks, first match wins. The relay runs one engine over a router.

use std::sync::Arc;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, join_all};

use super::{Outcome, Sink, Unavailable};
use crate::store::{ClaimedMessage, Topics};

/// One route: the topics it takes and where they go.
pub struct RouteTo {
    pub topics: Topics,
    pub sink: Arc<dyn Sink>,
}

/// Sends each message to the sink of the first route that matches its topic.
///
/// If one sink is unavailable, the whole batch is handed back (the Sink contract has no per-message
/// "not attempted"): routes to a healthy sink wait for the back-off too.
pub struct Router {
    routes: Vec<RouteTo>,
    topics: Topics,
    max_batch: usize,
}

impl Router {
    /// A router over `routes`, in order.
    pub fn new(routes: Vec<RouteTo>) -> Self {
        let mut patterns = Vec::new();
        for r in &routes {
            patterns.extend(r.topics.patterns());
        }
        let max_batch = routes.iter().map(|r| r.sink.max_batch()).min().unwrap_or(1);
        Router {
            topics: Topics::only(patterns),
            routes,
            max_batch,
        }
    }

    fn route_of(&self, topic: &str) -> Option<usize> {
        self.routes.iter().position(|r| r.topics.matches(topic))
    }
}

impl Sink for Router {
    fn name(&self) -> &str {
        if self.routes.len() == 1 {
            self.routes[0].sink.name()
        } else {
            "router"
        }
    }

    fn topics(&self) -> Topics {
        self.topics.clone()
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn sink_for(&self, topic: &str) -> &str {
        self.route_of(topic)
            .map_or(self.name(), |r| self.routes[r].sink.sink_for(topic))
    }

    fn deliver(
        &self,
        batch: Vec<ClaimedMessage>,
    ) -> BoxFuture<'_, Result<Vec<Outcome>, Unavailable>> {
        async move {
            let n = batch.len();
            let mut parts: Vec<(Vec<usize>, Vec<ClaimedMessage>)> = (0..self.routes.len())
                .map(|_| (Vec::new(), Vec::new()))
                .collect();
            let mut out: Vec<Option<Outcome>> = vec![None; n];
            for (i, m) in batch.into_iter().enumerate() {
                match self.route_of(&m.topic) {
                    Some(r) => {
                        parts[r].0.push(i);
                        parts[r].1.push(m);
                    }
                    None => {
                        out[i] = Some(Outcome::Retry {
                            reason: format!("no route for topic {:?}", m.topic),
                            delay: None,
                        })
                    }
                }
            }
            let calls = parts
                .into_iter()
                .enumerate()
                .filter(|(_, (idx, _))| !idx.is_empty())
                .map(|(r, (idx, msgs))| {
                    let sink = self.routes[r].sink.clone();
                    async move {
                        let name = sink.name().to_owned();
                        (idx, sink.deliver(msgs).await.map_err(|u| u.of_sink(name)))
                    }
                });
            for (idx, result) in join_all(calls).await {
                let outcomes = result?;
                for (i, o) in idx.into_iter().zip(outcomes) {
                    out[i] = Some(o);
                }
            }
            Ok(out
                .into_iter()
                .map(|o| {
                    o.unwrap_or(Outcome::Retry {
                        reason: "sink returned too few outcomes".into(),
                        delay: None,
                    })
                })
                .collect())
        }
        .boxed()
    }
}
