//! Who may act in the console: the token (a bearer token, or the password of basic auth, compared
//! in constant time and never logged) and, for a browser's form, a CSRF token that a page of the
//! console set (a cookie and the same value in the form: a page of another site can send the
//! cookie but cannot read it).

use axum::http::{HeaderMap, StatusCode, header};

/// The cookie that carries the CSRF token.
pub const CSRF_COOKIE: &str = "postbox_csrf";

/// Why an action was refused: the status and what the page says.
pub type Refusal = (StatusCode, String);

/// Whether `a` and `b` are equal, in a time that depends on their lengths only.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A fresh CSRF token: 32 random bytes from the kernel, in hex.
pub fn new_csrf_token() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("the kernel's random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The CSRF token of the request's cookie, if any.
pub fn csrf_cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(name, _)| *name == CSRF_COOKIE)
        .map(|(_, v)| v.trim().to_owned())
        // An empty cookie is none: the page sets a fresh one rather than a token no form can match.
        .filter(|v| !v.is_empty())
}

/// How the request authenticates: `Bearer` (a script: no CSRF token needed, a browser never sends
/// one by itself) or `Basic` (a person: the browser resends it to every page, so a form needs
/// the CSRF token too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    /// `Authorization: Bearer <token>`.
    Bearer,
    /// `Authorization: Basic <user:token>`.
    Basic,
}

/// Checks the request's credential against `token`.
pub fn authenticate(headers: &HeaderMap, token: &str) -> Result<Credential, Refusal> {
    let unauthorized = || {
        (
            StatusCode::UNAUTHORIZED,
            "this action needs the console's token (basic auth: any user name, the token as password; or Authorization: Bearer)".to_owned(),
        )
    };
    let value = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(unauthorized)?;
    // The scheme's name is case-insensitive (RFC 7235).
    let (scheme, rest) = value.split_once(' ').ok_or_else(unauthorized)?;
    let bearer = scheme.eq_ignore_ascii_case("bearer").then_some(rest);
    let basic = scheme.eq_ignore_ascii_case("basic").then_some(rest);
    if let Some(given) = bearer {
        return if same(given.trim().as_bytes(), token.as_bytes()) {
            Ok(Credential::Bearer)
        } else {
            Err(unauthorized())
        };
    }
    if let Some(encoded) = basic {
        let decoded = base64_decode(encoded.trim()).ok_or_else(unauthorized)?;
        let password = decoded
            .splitn(2, |&b| b == b':')
            .nth(1)
            .ok_or_else(unauthorized)?;
        return if same(password, token.as_bytes()) {
            Ok(Credential::Basic)
        } else {
            Err(unauthorized())
        };
    }
    Err(unauthorized())
}

/// Refuses a request another site made: the browser says so (`Sec-Fetch-Site`), or its `Origin`
/// is not this host; and, for a browser's credential, a form without the CSRF token of its cookie.
pub fn same_site(
    headers: &HeaderMap,
    credential: Credential,
    form_token: Option<&str>,
) -> Result<(), Refusal> {
    let forbidden = |why: &str| (StatusCode::FORBIDDEN, why.to_owned());
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && site.trim().eq_ignore_ascii_case("cross-site")
    {
        return Err(forbidden("refused: the request came from another site"));
    }
    if let (Some(origin), Some(host)) = (
        headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()),
        headers.get(header::HOST).and_then(|v| v.to_str().ok()),
    ) {
        let origin_host = origin.split("://").nth(1).unwrap_or(origin);
        if origin != "null" && origin_host != host {
            return Err(forbidden("refused: the request came from another origin"));
        }
        if origin == "null" {
            return Err(forbidden("refused: the request came from an opaque origin"));
        }
    }
    if credential == Credential::Basic {
        let cookie = csrf_cookie(headers);
        match (cookie, form_token) {
            (Some(c), Some(f)) if same(c.as_bytes(), f.as_bytes()) => {}
            _ => {
                return Err(forbidden(
                    "refused: the form's CSRF token is missing or stale (reload the page)",
                ));
            }
        }
    }
    Ok(())
}

/// Standard base64 (with or without padding); `None` when it is not.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = ALPHABET.iter().position(|&a| a == c)? as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_auth_takes_the_token_as_password() {
        let mut h = HeaderMap::new();
        // "anyone:a-token-of-16-chars"
        h.insert(
            header::AUTHORIZATION,
            "Basic YW55b25lOmEtdG9rZW4tb2YtMTYtY2hhcnM="
                .parse()
                .unwrap(),
        );
        assert_eq!(
            authenticate(&h, "a-token-of-16-chars"),
            Ok(Credential::Basic)
        );
        assert!(authenticate(&h, "another-token-16ch").is_err());
        h.insert(
            header::AUTHORIZATION,
            "Bearer a-token-of-16-chars".parse().unwrap(),
        );
        assert_eq!(
            authenticate(&h, "a-token-of-16-chars"),
            Ok(Credential::Bearer)
        );
        assert!(authenticate(&HeaderMap::new(), "a-token-of-16-chars").is_err());
    }

    #[test]
    fn a_browser_form_needs_the_cookie_s_token_and_the_same_origin() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "127.0.0.1:9465".parse().unwrap());
        h.insert(header::COOKIE, "a=b; postbox_csrf=abc123".parse().unwrap());
        assert!(same_site(&h, Credential::Basic, Some("abc123")).is_ok());
        assert!(same_site(&h, Credential::Basic, Some("abc124")).is_err());
        assert!(same_site(&h, Credential::Basic, None).is_err());
        assert!(same_site(&h, Credential::Bearer, None).is_ok());
        h.insert(header::ORIGIN, "http://evil.example".parse().unwrap());
        assert!(same_site(&h, Credential::Basic, Some("abc123")).is_err());
        h.insert(header::ORIGIN, "http://127.0.0.1:9465".parse().unwrap());
        h.insert("sec-fetch-site", "cross-site".parse().unwrap());
        assert!(same_site(&h, Credential::Basic, Some("abc123")).is_err());
        h.insert("sec-fetch-site", "Cross-Site".parse().unwrap());
        assert!(same_site(&h, Credential::Bearer, None).is_err());
        h.insert("sec-fetch-site", "same-origin".parse().unwrap());
        assert!(same_site(&h, Credential::Bearer, None).is_ok());
        // An empty cookie is no token.
        h.insert(header::COOKIE, "postbox_csrf=".parse().unwrap());
        assert_eq!(csrf_cookie(&h), None);
        assert!(same_site(&h, Credential::Basic, Some("")).is_err());
    }
}
