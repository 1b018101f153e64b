//! The effective configuration as `postbox config check` prints it, secrets redacted (the
//! redaction itself: [`crate::redact`]).

pub use crate::redact::{is_secret, redact_url, redact_values};

use super::{
    Config, KafkaSink, MetricsSection, RelaySection, RetentionSection, Settings, SinksSection,
};

impl Settings {
    /// The effective configuration as TOML, secrets redacted (what `postbox config check` prints).
    pub fn to_redacted_toml(&self) -> String {
        let file = Config {
            database_url: Some(redact_url(&self.database_url)),
            relay: RelaySection {
                batch_size: Some(self.engine.batch_size),
                concurrency: Some(self.engine.concurrency),
                lease: Some(self.engine.lease),
                poll_interval: Some(self.engine.poll_interval),
                schedule_interval: Some(self.engine.schedule_interval),
                shutdown_deadline: Some(self.engine.shutdown_deadline),
                delivery_timeout: Some(self.engine.delivery_timeout),
                topic_timeouts: self.engine.topic_timeouts.iter().cloned().collect(),
                hold_limit: Some(self.engine.hold_limit),
                payload_budget: Some(self.engine.payload_budget),
            },
            stream: self.stream.as_ref().map(|s| super::StreamSection {
                slot: Some(s.slot.clone()),
                publication: Some(s.publication.clone()),
                create_slot: Some(s.create_slot),
                status_interval: Some(s.status_interval),
                batch_size: Some(s.batch_size),
                takeover_interval: Some(s.takeover_interval),
                liveness_interval: Some(s.liveness_interval),
            }),
            metrics: MetricsSection {
                listen: Some(
                    self.metrics_listen
                        .map_or_else(|| "off".to_owned(), |a| a.to_string()),
                ),
                sample_interval: Some(self.sample_interval),
                max_topics: Some(self.metrics_max_topics),
            },
            sinks: SinksSection {
                kafka: self.kafka.as_ref().map(|k| KafkaSink {
                    brokers: k.brokers.clone(),
                    properties: k
                        .properties
                        .iter()
                        .map(|(key, v)| {
                            (
                                key.clone(),
                                if is_secret(key) {
                                    "<redacted>".to_owned()
                                } else {
                                    v.clone()
                                },
                            )
                        })
                        .collect(),
                }),
            },
            routes: self.routes.clone(),
            retention: RetentionSection {
                keep_completed: self.engine.keep_completed,
            },
            schedules: self.schedules.clone(),
            limits: self.limits.clone(),
            ui: self.ui.as_ref().map(|u| super::UiSection {
                enabled: Some(true),
                listen: Some(u.listen.to_string()),
                path_prefix: Some(u.path_prefix.clone()),
                actions: Some(u.actions),
                token: u.token.as_ref().map(|_| "<redacted>".to_owned()),
                show_payloads: Some(u.show_payloads),
                allowed_hosts: Some(if u.allowed_hosts.is_empty() {
                    vec!["*".to_owned()]
                } else {
                    u.allowed_hosts.clone()
                }),
                pool_size: Some(u.pool_size),
                statement_timeout: Some(super::durations::format_duration(u.statement_timeout)),
            }),
        };
        toml::to_string(&file).expect("the configuration serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_password_in_a_url_is_hidden() {
        for (url, shown) in [
            (
                "postgres://app:pa?ss@db:5432/x",
                "postgres://app:<redacted>@db:5432/x",
            ),
            (
                "postgres://app:pa/ss@db/x",
                "postgres://app:<redacted>@db/x",
            ),
            ("postgres://app:p@ss@db/x", "postgres://app:<redacted>@db/x"),
            (
                "postgres://db/x?user=a&password=s1&x=1&password=s2",
                "postgres://db/x?user=a&password=<redacted>&x=1&password=<redacted>",
            ),
            (
                "postgres://db/x?pass%77ord=s1",
                "postgres://db/x?pass%77ord=<redacted>",
            ),
            (
                "postgres://db/x?sslpassword=s1",
                "postgres://db/x?sslpassword=<redacted>",
            ),
            (
                "host=db password=s1 user=a",
                "host=db password=<redacted> user=a",
            ),
            ("postgres://app@db/x", "postgres://app@db/x"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn secret_values_are_hidden_in_errors() {
        let props: std::collections::BTreeMap<String, String> = [
            ("ssl.keystore.password", "KSPW"),
            ("sasl.oauthbearer.client.secret", "CS"),
            ("ssl.key.password", "KP"),
            ("client.id", "relay"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(
            redact_values("bad ssl.keystore.password KSPW, KP and CS; relay", &props),
            "bad ssl.keystore.password <redacted>, <redacted> and <redacted>; relay"
        );
    }
}
