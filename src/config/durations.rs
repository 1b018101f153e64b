//! Durations in the configuration, read and written as humantime does (`250ms`, `30s`, `1h 30m`).

use std::time::Duration;

/// Parses a duration as humantime does: `30s`, `250ms`, `1.5s`, `5m`, `1h 30m`, `2d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("{s:?} is not a duration like 30s, 250ms or 1h 30m ({e})"))
}

pub(super) fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

pub(super) mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&super::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let s = Option::<String>::deserialize(d)?;
        s.map(|s| super::parse_duration(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

pub(super) mod duration_map {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        m: &BTreeMap<String, Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(m.iter().map(|(k, d)| (k, super::format_duration(*d))))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, Duration>, D::Error> {
        BTreeMap::<String, String>::deserialize(d)?
            .into_iter()
            .map(|(k, v)| {
                super::parse_duration(&v)
                    .map(|d| (k.clone(), d))
                    .map_err(|e| serde::de::Error::custom(format!("{k:?}: {e}")))
            })
            .collect()
    }
}
