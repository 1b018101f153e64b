//! What PostgreSQL can store: a stream message comes from the WAL as bytes any writer chose, so
//! before it is written to the database (a dead letter) its values are made storable. `text` and
//! `jsonb` refuse the NUL character (jsonb's `\u0000`); a value past an index's row limit is
//! refused too, which only the last resort below avoids.

use std::borrow::Cow;

/// What a NUL character becomes in a stored value.
pub const NUL_STAND_IN: char = '\u{FFFD}';

/// `s` with every NUL replaced by [`NUL_STAND_IN`]; borrowed when there was none.
pub fn text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// `v` with every NUL in a string or a name replaced by [`NUL_STAND_IN`]; `None` when there was
/// none (the value stores as it is).
pub fn json(v: &serde_json::Value) -> Option<serde_json::Value> {
    fn has_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(a) => a.iter().any(has_nul),
            serde_json::Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
            _ => false,
        }
    }
    fn clean(v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::String(s) => serde_json::Value::String(text(s).into_owned()),
            serde_json::Value::Array(a) => a.iter().map(clean).collect(),
            serde_json::Value::Object(o) => o
                .iter()
                .map(|(k, v)| (text(k).into_owned(), clean(v)))
                .collect(),
            other => other.clone(),
        }
    }
    has_nul(v).then(|| clean(v))
}

/// The last resort: `s` as printable ASCII (whatever the server's encoding, and no NUL), at most
/// `max` bytes (at least 40), saying how much was cut.
pub fn ascii(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max));
    for c in s.chars() {
        if out.len() + 40 > max {
            out.push_str(&format!(" ... ({} bytes in all)", s.len()));
            break;
        }
        match c {
            ' '..='~' => out.push(c),
            '\n' | '\t' => out.push(c),
            other => out.push_str(&format!("\\u{{{:x}}}", other as u32)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nul_becomes_the_replacement_character_everywhere_and_nothing_else_changes() {
        assert!(matches!(text("plain"), Cow::Borrowed("plain")));
        assert_eq!(text("a\0b"), "a\u{FFFD}b");
        let v = serde_json::json!({"a\u{0}": ["x\u{0}", 1, {"k": "\u{0}"}], "b": "ok"});
        assert_eq!(
            json(&v).unwrap(),
            serde_json::json!({"a\u{FFFD}": ["x\u{FFFD}", 1, {"k": "\u{FFFD}"}], "b": "ok"})
        );
        assert_eq!(json(&serde_json::json!({"b": "ok"})), None);
    }

    #[test]
    fn the_last_resort_is_printable_ascii_and_bounded() {
        assert_eq!(ascii("a\0é", 100), "a\\u{0}\\u{e9}");
        let long = "x".repeat(1000);
        let cut = ascii(&long, 100);
        assert!(cut.len() <= 100, "{cut}");
        assert!(cut.ends_with("(1000 bytes in all)"), "{cut}");
    }
}
