//! Secrets out of what is printed and logged: database passwords (URL or `key=value` connection
//! strings) and librdkafka credentials. Below every part that prints a connection's error (the
//! configuration, the relay, the Kafka sink, stream mode), so none of them depends on another for
//! it.

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

/// The URL (or `key=value` connection string) with its password and every password parameter
/// replaced by `<redacted>`. In a URL, the user info is taken up to the last `@`, so a password
/// holding `?`, `/` or `@` is hidden whole, and parameter names are compared percent-decoded
/// (`pass%77ord=`). A `key=value` string is read as libpq reads it: spaces around `=`, values in
/// single quotes with backslash escapes (`password = 'two words'` is hidden whole). Every
/// parameter whose name holds `password` is redacted, not only the first. Errs on the side of
/// hiding: text that is neither (an error message quoting one) is scanned for both forms.
pub fn redact_url(url: &str) -> String {
    // From the first `scheme://` on, the text is read as a URL (a password may hold any
    // character, quotes and spaces included, up to the last `@`); what comes before it as a
    // connection string.
    let Some(sep) = url.find("://") else {
        return redact_conninfo(url);
    };
    let start = url[..sep]
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
        .map_or(0, |i| i + 1);
    redact_conninfo(&url[..start]) + &redact_one_url(&url[start..])
}

/// One URL: the password of its user info (up to the last `@`) and its password parameters.
fn redact_one_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest_start = scheme_end + 3;
        if let Some(at) = out[rest_start..].rfind('@') {
            let userinfo = &out[rest_start..rest_start + at];
            if let Some(colon) = userinfo.find(':') {
                let start = rest_start + colon + 1;
                out.replace_range(start..rest_start + at, "<redacted>");
            }
        }
    }
    redact_params(&out)
}

/// Every `…password…=value` parameter of a URL's query, value redacted.
fn redact_params(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut segment = String::new();
    for c in s.chars() {
        if matches!(c, '&' | '?' | ' ' | ';') {
            out.push_str(&redact_segment(&segment));
            out.push(c);
            segment.clear();
        } else {
            segment.push(c);
        }
    }
    out.push_str(&redact_segment(&segment));
    out
}

fn redact_segment(segment: &str) -> String {
    match segment.split_once('=') {
        Some((key, _))
            if percent_decoded(key)
                .to_ascii_lowercase()
                .contains("password") =>
        {
            format!("{key}=<redacted>")
        }
        _ => segment.to_owned(),
    }
}

/// Every `key = value` of a libpq connection string whose key holds `password`, value redacted:
/// spaces may stand on either side of `=`; a value is a run of non-space characters, or single
/// quoted with `\'` and `\\` escapes (an unterminated quote runs to the end: all of it hidden).
fn redact_conninfo(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        // A keyword: a run of word characters, then optional spaces, then `=`.
        if chars[i].is_alphanumeric() || chars[i] == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let key: String = chars[start..i].iter().collect();
            out.push_str(&key);
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            if j >= chars.len() || chars[j] != '=' {
                continue;
            }
            // `key =`: copy the spacing and `=`, then the value (or its redaction).
            out.extend(&chars[i..=j]);
            i = j + 1;
            while i < chars.len() && chars[i].is_whitespace() {
                out.push(chars[i]);
                i += 1;
            }
            let value_start = i;
            if i < chars.len() && chars[i] == '\'' {
                i += 1;
                while i < chars.len() && chars[i] != '\'' {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i = (i + 1).min(chars.len());
            } else {
                while i < chars.len() && !chars[i].is_whitespace() {
                    i += 1;
                }
            }
            if key.to_ascii_lowercase().contains("password") {
                out.push_str("<redacted>");
            } else {
                out.extend(&chars[value_start..i]);
            }
            continue;
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

fn percent_decoded(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `text` with the value of every secret property of `properties` replaced by `<redacted>` (an
/// error of librdkafka that quotes the value it refused).
pub fn redact_values<'a>(
    text: &str,
    properties: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> String {
    let mut out = text.to_owned();
    for (k, v) in properties {
        if is_secret(k) && !v.is_empty() {
            out = out.replace(v.as_str(), "<redacted>");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn a_url_password_and_password_parameters_are_hidden() {
        assert_eq!(
            redact_url("postgres://u:hunter2@h:5432/db?sslmode=require"),
            "postgres://u:<redacted>@h:5432/db?sslmode=require"
        );
        assert_eq!(
            redact_url("postgres://u@h/db?password=hunter2&x=1"),
            "postgres://u@h/db?password=<redacted>&x=1"
        );
        assert_eq!(
            redact_url("postgres://u:p%40ss@h/db?pass%77ord=x"),
            "postgres://u:<redacted>@h/db?pass%77ord=<redacted>"
        );
    }

    #[test]
    fn a_key_value_password_is_hidden_however_it_is_written() {
        for (given, want) in [
            (
                "host=db user=app password = hunter2-secret dbname=x",
                "host=db user=app password = <redacted> dbname=x",
            ),
            (
                "host=db user=app password='hunter2 secret' dbname=x",
                "host=db user=app password=<redacted> dbname=x",
            ),
            (
                "host=db password ='it\\'s secret' dbname=x",
                "host=db password =<redacted> dbname=x",
            ),
            ("password= 'never closed", "password= <redacted>"),
            ("sslpassword=abc host=h", "sslpassword=<redacted> host=h"),
            ("host=db user=app dbname=x", "host=db user=app dbname=x"),
        ] {
            let got = redact_url(given);
            assert_eq!(got, want, "{given}");
            assert!(!got.contains("secret") && !got.contains("abc"), "{got}");
        }
        // Inside an error that quotes it.
        let e = redact_url("\"host=db password = hunter2\" is not a postgres:// URL");
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn a_url_password_holding_quotes_or_spaces_is_hidden_whole() {
        for pw in ["s3cr'et-pw", "hun\"ter2", "s3cret`pw", "hun ter2"] {
            for text in [
                format!("postgres://postgres:{pw}@db:5432/app"),
                format!("cannot reach the server of postgres://postgres:{pw}@db/app: refused"),
                format!("database=postgres://u:{pw}@db/app relay running"),
            ] {
                let got = redact_url(&text);
                assert!(!got.contains(pw), "{text} -> {got}");
                assert!(got.contains("<redacted>"), "{got}");
            }
        }
    }
}
