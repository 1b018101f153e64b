//! Secrets out of what is printed and logged: librdkafka credentials and URL passwords, and the
//! effective configuration as `postbox config check` prints it.

use super::{
    Config, KafkaSink, MetricsSection, RelaySection, RetentionSection, Settings, SinksSection,
};

/// True for librdkafka properties that hold credentials.
pub fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "sasl.jaas",
        "sasl.oauthbearer.config",
        "ssl.key.pem",
        "ssl_key",
        "token",
    ]
    .iter()
    .any(|s| k.contains(s))
}

/// The URL with its password (and any `password=` parameter) replaced by `<redacted>`.
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest_start = scheme_end + 3;
        let authority_end = out[rest_start..]
            .find(['/', '?'])
            .map_or(out.len(), |i| rest_start + i);
        if let Some(at) = out[rest_start..authority_end].rfind('@') {
            let userinfo = &out[rest_start..rest_start + at];
            if let Some(colon) = userinfo.find(':') {
                let start = rest_start + colon + 1;
                out.replace_range(start..rest_start + at, "<redacted>");
            }
        }
    }
    if let Some(q) = out.find("password=") {
        let end = out[q..].find('&').map_or(out.len(), |i| q + i);
        out.replace_range(q + "password=".len()..end, "<redacted>");
    }
    out
}

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
            },
            metrics: MetricsSection {
                listen: Some(self.metrics_listen.to_string()),
                sample_interval: Some(self.sample_interval),
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
        };
        toml::to_string(&file).expect("the configuration serializes")
    }
}
