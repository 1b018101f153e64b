//! librdkafka's own reports (its error and log callbacks). During a broker outage librdkafka
//! reports the same failure on every reconnect, from both callbacks: here each kind of report is
//! logged when it first appears, then at most once a minute with how many were left out.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;

/// How often a report that keeps coming is logged again.
const SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// The producer's context: rdkafka's default, with its reports rate-limited per kind.
pub struct QuietContext {
    every: Duration,
    seen: Mutex<HashMap<String, (Instant, u64)>>,
}

impl Default for QuietContext {
    fn default() -> Self {
        QuietContext::every(SUMMARY_EVERY)
    }
}

impl QuietContext {
    fn every(every: Duration) -> Self {
        QuietContext {
            every,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// `Some(left_out)` when a report of `kind` is to be logged now (with how many of the kind
    /// were left out since the last line), `None` when it is left out.
    fn admit(&self, kind: &str, now: Instant) -> Option<u64> {
        let mut seen = self.seen.lock().expect("kafka report lock");
        match seen.get_mut(kind) {
            Some((last, left_out)) if now.duration_since(*last) < self.every => {
                *left_out += 1;
                None
            }
            Some((last, left_out)) => {
                *last = now;
                Some(std::mem::take(left_out))
            }
            None => {
                seen.insert(kind.to_owned(), (now, 0));
                Some(0)
            }
        }
    }
}

impl ClientContext for QuietContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        use RDKafkaLogLevel::*;
        match level {
            Emerg | Alert | Critical | Error | Warning => {
                if let Some(left_out) = self.admit(&format!("log:{fac}"), Instant::now()) {
                    tracing::warn!(facility = fac, left_out, "librdkafka: {message}");
                }
            }
            Notice | Info => tracing::info!(facility = fac, "librdkafka: {message}"),
            Debug => tracing::debug!(facility = fac, "librdkafka: {message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let kind = match error.rdkafka_error_code() {
            Some(code) => format!("error:{code:?}"),
            None => format!("error:{error}"),
        };
        if let Some(left_out) = self.admit(&kind, Instant::now()) {
            tracing::warn!(left_out, "kafka: {error}: {reason}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_that_keeps_coming_is_logged_once_then_summarised() {
        let c = QuietContext::every(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(c.admit("error:AllBrokersDown", t0), Some(0));
        for i in 1..=100 {
            let t = t0 + Duration::from_millis(500 * i);
            assert_eq!(c.admit("error:AllBrokersDown", t), None, "{i}");
        }
        // Another kind of report (a change of state) is logged at once.
        assert_eq!(
            c.admit("error:Resolve", t0 + Duration::from_secs(1)),
            Some(0)
        );
        // A minute on: one line, with the count of what was left out.
        assert_eq!(
            c.admit("error:AllBrokersDown", t0 + Duration::from_secs(61)),
            Some(100)
        );
        assert_eq!(
            c.admit("error:AllBrokersDown", t0 + Duration::from_secs(62)),
            None
        );
    }
}
