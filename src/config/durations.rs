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

/// Parses a size like `64MiB`, `512 KiB`, `1GiB`, `100MB` or a number of bytes.
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: usize = n
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 64MiB, 512KiB or 1GiB"))?;
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (B, KiB, MiB, GiB, kB, MB, GB)"
            ));
        }
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// An optional size: a string with a unit, or a number of bytes.
pub(super) mod opt_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(usize),
        Text(String),
    }

    pub fn serialize<S: Serializer>(b: &Option<usize>, s: S) -> Result<S::Ok, S::Error> {
        match b {
            Some(b) if b % (1 << 20) == 0 => s.serialize_str(&format!("{}MiB", b >> 20)),
            Some(b) => s.serialize_u64(*b as u64),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
        match Option::<Size>::deserialize(d)? {
            None => Ok(None),
            Some(Size::Bytes(n)) => Ok(Some(n)),
            Some(Size::Text(t)) => super::parse_bytes(&t)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}
