//! The console's pages: server-rendered HTML, every value escaped, no script, one stylesheet
//! inline (nothing is fetched from anywhere else).

use std::fmt::Write;

use crate::store::browse::{Browsed, Filter, MessageRow, STATES};

/// `text` for an element's content (`<pre>`, `<td>`): `&`, `<` and `>` escaped, quotes left as
/// they are (they need escaping in attributes only), so that a value of quotes does not grow six
/// times on the page.
pub fn esc_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` safe in HTML text and attribute values.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` as a query-string value.
pub fn url_value(text: &str) -> String {
    let mut out = String::new();
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~*".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330}
header{background:#1d2330;color:#fff;padding:.6em 1.2em;display:flex;gap:1.5em;align-items:center}
header a{color:#cfe0ff;text-decoration:none}header strong{font-size:1.1em}
main{padding:1em 1.2em}table{border-collapse:collapse;width:100%;margin:.5em 0}
th,td{border-bottom:1px solid #dde;padding:.3em .5em;text-align:left;vertical-align:top}
th{background:#f3f5fa}td.n{text-align:right;font-variant-numeric:tabular-nums}
form.filter{display:flex;flex-wrap:wrap;gap:.5em;align-items:end;margin:.5em 0}
form.filter label{display:flex;flex-direction:column;font-size:.85em}
input,select,button{font:inherit;padding:.2em .4em}button{cursor:pointer}
.error{background:#fde8e8;border:1px solid #e0a0a0;padding:.5em;margin:.5em 0}
.notice{background:#e8f4e8;border:1px solid #a0d0a0;padding:.5em;margin:.5em 0}
pre{background:#f6f7f9;padding:.5em;overflow:auto;max-height:30em}.paused{color:#b15c00;font-weight:bold}
.actions{display:flex;gap:1em;margin:.5em 0}.muted{color:#667}
.up{color:#1a7f37}.down{color:#c62828;font-weight:bold}td.full{color:#b15c00;font-weight:bold}
svg.chart rect.d{fill:#4a78c2}svg.chart rect.r{fill:#d9a300}svg.chart rect.x{fill:#c62828}
svg.chart{background:#f6f7f9}td.act{white-space:nowrap}td.act form{display:inline}textarea{font:12px monospace}";

/// A whole page: the header's navigation, then `body`.
pub fn page(prefix: &str, title: &str, notice: Option<&str>, body: &str) -> String {
    let notice = notice
        .map(|n| format!("<p class=\"notice\" role=\"status\">{}</p>", esc(n)))
        .unwrap_or_default();
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{t} · postbox</title><style>{STYLE}</style></head><body>\
         <header><strong>postbox</strong><nav aria-label=\"pages\">\
         <a href=\"{h}\">Overview</a> · <a href=\"{p}/messages\">Messages</a> · \
         <a href=\"{p}/dead\">Dead letters</a> · <a href=\"{p}/schedules\">Schedules</a> · \
         <a href=\"{p}/limits\">Limits</a> · <a href=\"{p}/enqueue\">Enqueue</a></nav></header>\
         <main><h1>{t}</h1>{notice}{body}</main></body></html>",
        t = esc(title),
        p = esc(prefix),
        h = esc(&home(prefix)),
    )
}

/// The overview's URL: `/`, or the prefix itself.
pub fn home(prefix: &str) -> String {
    if prefix.is_empty() {
        "/".to_owned()
    } else {
        prefix.to_owned()
    }
}

/// An ordered message's place in its key, in words.
pub fn position(id: i64, p: &crate::store::position::KeyPosition) -> String {
    match p.head {
        Some(head) if head == id => {
            "The head of its key: the next of the key to be delivered.".into()
        }
        Some(head) => format!(
            "Waiting behind {}{} of its key; the head is <a href=\"{head}\">{head}</a>.",
            if p.capped { "more than " } else { "" },
            p.ahead
        ),
        None => format!(
            "Waiting behind {}{} of its key; the key has no head right now (being promoted).",
            if p.capped { "more than " } else { "" },
            p.ahead
        ),
    }
}

/// An error page's body.
pub fn error(message: &str) -> String {
    format!("<p class=\"error\" role=\"alert\">{}</p>", esc(message))
}

/// A labelled text field of a form.
pub fn input(name: &str, label: &str, value: &str, hint: &str) -> String {
    format!(
        "<label>{label}<input name=\"{name}\" value=\"{}\" placeholder=\"{}\"></label>",
        esc(value),
        esc(hint)
    )
}

/// The filter form of a list page.
pub fn filter_form(action: &str, f: &FilterText, with_state: bool) -> String {
    let mut out = format!(
        "<form class=\"filter\" method=\"get\" action=\"{}\">",
        esc(action)
    );
    out += &input("topic", "Topics", &f.topic, "orders.*, emails");
    if !f.exact.is_empty() {
        out += &format!(
            "<label>Topic (exactly)<input name=\"exact\" value=\"{}\"></label>",
            esc(&f.exact)
        );
    }
    if with_state {
        out += "<label>State<select name=\"state\"><option value=\"\">any</option>";
        for s in STATES {
            let sel = if f.state == s { " selected" } else { "" };
            let _ = write!(out, "<option{sel}>{s}</option>");
        }
        out += "</select></label>";
    }
    out += &input("key", "Key", &f.key, "");
    out += &input("min_id", "From id", &f.min_id, "");
    out += &input("max_id", "To id", &f.max_id, "");
    out += &input("older_than", "Older than", &f.older_than, "10m");
    out += &input(
        "payload",
        "Payload contains (JSON)",
        &f.payload,
        "{\"customer\": \"c-42\"}",
    );
    out += &input(
        "headers",
        "Headers contain (JSON)",
        &f.headers,
        "{\"type\": \"x\"}",
    );
    out += "<button type=\"submit\">Filter</button></form>";
    out
}

/// A filter as the user typed it (to show it again, and to carry it in links and forms).
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(default)]
pub struct FilterText {
    /// Topic names or globs, separated by commas.
    pub topic: String,
    /// One topic name, exactly (the console's own links: a `*` or a `,` is part of it).
    pub exact: String,
    /// A state.
    pub state: String,
    /// A key.
    pub key: String,
    /// The lowest id.
    pub min_id: String,
    /// The highest id.
    pub max_id: String,
    /// An age (`10m`).
    pub older_than: String,
    /// JSON the payload contains.
    pub payload: String,
    /// JSON the headers contain.
    pub headers: String,
}

impl FilterText {
    /// The filter as a query string (`topic=...&key=...`), empty fields left out.
    pub fn query(&self) -> String {
        let pairs = [
            ("topic", &self.topic),
            ("exact", &self.exact),
            ("state", &self.state),
            ("key", &self.key),
            ("min_id", &self.min_id),
            ("max_id", &self.max_id),
            ("older_than", &self.older_than),
            ("payload", &self.payload),
            ("headers", &self.headers),
        ];
        pairs
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!("{k}={}", url_value(v)))
            .collect::<Vec<_>>()
            .join("&")
    }

    /// The filter as hidden fields of a form.
    pub fn hidden(&self) -> String {
        self.query()
            .split('&')
            .filter(|p| !p.is_empty())
            .filter_map(|p| p.split_once('='))
            .map(|(k, _)| {
                let v = match k {
                    "topic" => &self.topic,
                    "exact" => &self.exact,
                    "state" => &self.state,
                    "key" => &self.key,
                    "min_id" => &self.min_id,
                    "max_id" => &self.max_id,
                    "older_than" => &self.older_than,
                    "payload" => &self.payload,
                    _ => &self.headers,
                };
                format!("<input type=\"hidden\" name=\"{k}\" value=\"{}\">", esc(v))
            })
            .collect()
    }
}

/// The table of a list page, and the link to the next page.
///
/// With `pick`, each row has a checkbox of the form `pick` (a hand-picked selection).
pub fn rows(
    prefix: &str,
    path: &str,
    page: &Browsed<MessageRow>,
    f: &FilterText,
    pick: bool,
) -> String {
    let mut out = String::from(if pick {
        "<table><thead><tr><th><span class=\"muted\">pick</span></th>"
    } else {
        "<table><thead><tr>"
    });
    out.push_str(
        "<th>id</th><th>topic</th><th>key</th><th>state</th>\
         <th>attempts</th><th>created</th><th>at</th><th>error</th><th>payload</th></tr></thead><tbody>",
    );
    for m in &page.rows {
        let payload = match (&m.payload, &m.payload_preview, m.payload_bytes) {
            (Some(p), _, _) => esc_text(&truncate(&p.to_string(), 120)),
            (None, Some(p), _) => esc_text(&truncate(p, 120)),
            (None, None, Some(bytes)) => {
                format!("<span class=\"muted\">{bytes} bytes: on its page</span>")
            }
            (None, None, None) => "<span class=\"muted\">hidden</span>".into(),
        };
        out += "<tr>";
        if pick {
            let _ = write!(
                out,
                "<td><input type=\"checkbox\" name=\"id\" value=\"{id}\" form=\"pick\" aria-label=\"pick {id}\"></td>",
                id = m.id
            );
        }
        let _ = write!(
            out,
            "<td class=\"n\"><a href=\"{p}/messages/{id}\">{id}</a></td><td>{topic}</td><td>{key}{ord}</td>\
             <td>{state}</td><td class=\"n\">{a}/{ma}</td><td>{created}</td><td>{at}</td><td>{err}</td><td><code>{payload}</code></td></tr>",
            p = esc(prefix),
            id = m.id,
            topic = esc(&m.topic),
            key = esc_text(&truncate(m.key.as_deref().unwrap_or(""), 120)),
            ord = if m.ordered {
                " <span class=\"muted\">(ordered)</span>"
            } else {
                ""
            },
            state = esc(&m.state),
            a = m.attempts,
            ma = m.max_attempts,
            created = m.created_at.format("%Y-%m-%d %H:%M:%S"),
            at = m.at.format("%Y-%m-%d %H:%M:%S"),
            err = esc_text(&truncate(m.error.as_deref().unwrap_or(""), 120)),
        );
    }
    out += "</tbody></table>";
    if page.rows.is_empty() {
        out += "<p>Nothing matches.</p>";
    }
    if let Some(low) = page.searched_down_to {
        let _ = write!(
            out,
            "<p class=\"muted\">Searched every message from the top of this page down to id {low}; more may match below.</p>"
        );
    }
    if let Some(next) = page.next {
        let q = f.query();
        let sep = if q.is_empty() { "" } else { "&" };
        let _ = write!(
            out,
            "<p><a rel=\"next\" href=\"{}{}?{}{sep}before={next}\">Older →</a></p>",
            esc(prefix),
            esc(path),
            esc(&q)
        );
    }
    out
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let cut: String = s.chars().take(max).collect();
        format!("{cut}…")
    }
}

/// A `Filter` read from what the user typed, or the field that is wrong and why.
/// Topics or patterns one filter may name.
pub const FILTER_TOPICS_MAX: usize = 20;
/// Bytes one field of a filter may hold.
pub const FILTER_FIELD_MAX: usize = 4096;

pub fn parse_filter(f: &FilterText) -> Result<Filter, String> {
    let id = |name: &str, v: &str| -> Result<Option<i64>, String> {
        if v.trim().is_empty() {
            return Ok(None);
        }
        v.trim()
            .parse::<i64>()
            .map(Some)
            .map_err(|_| format!("{name}: {v:?} is not a message id"))
    };
    let json = |name: &str, v: &str| -> Result<Option<serde_json::Value>, String> {
        if v.trim().is_empty() {
            return Ok(None);
        }
        serde_json::from_str(v)
            .map(Some)
            .map_err(|e| format!("{name}: not valid JSON ({e})"))
    };
    // A JSON field's `\u0000` is a NUL too; a plain field's is just text.
    let no_nul = |name: &str, v: &str| -> Result<(), String> {
        let json_field = name == "payload" || name == "headers";
        if v.contains('\0') || (json_field && v.contains("\\u0000")) {
            Err(format!(
                "{name}: contains a NUL character, which PostgreSQL cannot store"
            ))
        } else {
            Ok(())
        }
    };
    for (name, v) in [
        ("topic", &f.topic),
        ("exact", &f.exact),
        ("key", &f.key),
        ("payload", &f.payload),
        ("headers", &f.headers),
    ] {
        no_nul(name, v)?;
        if v.len() > FILTER_FIELD_MAX {
            return Err(format!("{name}: at most {FILTER_FIELD_MAX} bytes"));
        }
    }
    // Names as stored: a topic may begin or end with a space (only empty names between commas are
    // dropped).
    let topics: Vec<String> = f
        .topic
        .split(',')
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect();
    if topics.len() > FILTER_TOPICS_MAX {
        return Err(format!(
            "topic: at most {FILTER_TOPICS_MAX} topics or patterns (each costs a pass over the rows a page reads)"
        ));
    }
    let filter = Filter {
        topics,
        exact_topics: Some(f.exact.clone())
            .filter(|t| !t.is_empty())
            .into_iter()
            .collect(),
        state: Some(f.state.trim().to_owned()).filter(|s| !s.is_empty()),
        key: Some(f.key.clone()).filter(|s| !s.is_empty()),
        min_id: id("min_id", &f.min_id)?,
        max_id: id("max_id", &f.max_id)?,
        older_than: if f.older_than.trim().is_empty() {
            None
        } else {
            let d = crate::config::parse_duration(f.older_than.trim())
                .map_err(|e| format!("older_than: {e}"))?;
            if d > std::time::Duration::from_secs(100 * 365 * 86_400) {
                return Err("older_than: at most 100 years".into());
            }
            Some(d)
        },
        payload: json("payload", &f.payload)?,
        headers: json("headers", &f.headers)?,
    };
    filter.validate().map_err(|e| e.to_string())?;
    Ok(filter)
}
