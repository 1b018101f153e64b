//! Reading columns that may hold what this process cannot decode, without failing the statement.
//!
//! PostgreSQL stores what serde cannot read back: a `jsonb` nested deeper than serde_json's 128
//! levels (the server takes any depth), or, in a `SQL_ASCII` database, text that is not UTF-8. A
//! strict decoder fails the whole batch on one such row, and the batch is claimed again and fails
//! again: one row stops its route. These types keep the row and say what is wrong with it, so the
//! caller can dead-letter that row and go on with the rest.

use diesel::deserialize::{self, FromSql, Queryable};
use diesel::pg::{Pg, PgValue};
use diesel::sql_types::{Jsonb, Nullable, Text};

/// A `text` column: its value (lossy if it was not UTF-8), and the problem if there was one.
#[derive(Debug, Clone)]
pub struct LenientText {
    pub(crate) value: String,
    pub(crate) problem: Option<String>,
}

impl FromSql<Text, Pg> for LenientText {
    fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
        let raw = bytes.as_bytes();
        Ok(match std::str::from_utf8(raw) {
            Ok(s) => LenientText {
                value: s.to_owned(),
                problem: None,
            },
            Err(e) => LenientText {
                value: String::from_utf8_lossy(raw).into_owned(),
                problem: Some(format!("not UTF-8 ({e})")),
            },
        })
    }
}

impl Queryable<Text, Pg> for LenientText {
    type Row = Self;
    fn build(row: Self) -> deserialize::Result<Self> {
        Ok(row)
    }
}

impl From<LenientText> for String {
    fn from(t: LenientText) -> Self {
        t.value
    }
}

/// A nullable `text` column read lossily (for display: dead letters, `show`).
#[derive(Debug, Clone)]
pub struct LenientOptText(pub(crate) Option<String>);

impl FromSql<Nullable<Text>, Pg> for LenientOptText {
    fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
        Ok(LenientOptText(Some(
            String::from_utf8_lossy(bytes.as_bytes()).into_owned(),
        )))
    }

    fn from_nullable_sql(bytes: Option<PgValue<'_>>) -> deserialize::Result<Self> {
        match bytes {
            Some(b) => Self::from_sql(b),
            None => Ok(LenientOptText(None)),
        }
    }
}

impl Queryable<Nullable<Text>, Pg> for LenientOptText {
    type Row = Self;
    fn build(row: Self) -> deserialize::Result<Self> {
        Ok(row)
    }
}

impl From<LenientOptText> for Option<String> {
    fn from(t: LenientOptText) -> Self {
        t.0
    }
}

/// A `jsonb` column: the parsed value (`Null` if it could not be parsed), its JSON text when
/// parsing failed, and the problem.
#[derive(Debug, Clone)]
pub struct LenientJson {
    pub(crate) value: serde_json::Value,
    pub(crate) text: Option<String>,
    pub(crate) problem: Option<String>,
}

impl FromSql<Jsonb, Pg> for LenientJson {
    fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
        let raw = bytes.as_bytes();
        // The binary jsonb format: a version byte (1), then the JSON text.
        let Some((1, body)) = raw.split_first().map(|(v, b)| (*v, b)) else {
            return Err("unsupported jsonb encoding version".into());
        };
        Ok(match serde_json::from_slice(body) {
            Ok(value) => LenientJson {
                value,
                text: None,
                problem: None,
            },
            Err(e) => LenientJson {
                value: serde_json::Value::Null,
                text: Some(String::from_utf8_lossy(body).into_owned()),
                problem: Some(if e.to_string().contains("recursion limit") {
                    format!("nested deeper than the 128 levels serde_json reads ({e})")
                } else {
                    e.to_string()
                }),
            },
        })
    }
}

impl Queryable<Jsonb, Pg> for LenientJson {
    type Row = Self;
    fn build(row: Self) -> deserialize::Result<Self> {
        Ok(row)
    }
}

/// For display (dead letters, `show`): a JSON value this process cannot parse is given as its
/// JSON text, a string.
impl From<LenientJson> for serde_json::Value {
    fn from(j: LenientJson) -> Self {
        match j.text {
            Some(text) => serde_json::Value::String(text),
            None => j.value,
        }
    }
}
