//! A headless Chromium driven over WebDriver (Debian's `chromium` and `chromium-driver`, which the
//! test command installs): what a person does in a browser, from a test.

use std::io::{Read, Write};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A browser session; the driver is stopped when dropped.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium at 1280×800.
    pub fn start() -> Browser {
        let port = super::free_port();
        let driver = std::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (Debian's chromium-driver; scripts/test installs it)");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut b = Browser {
            driver,
            port,
            session: String::new(),
        };
        let binary = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("Debian's chromium");
        let v = b.call(
            "POST",
            "/session",
            Some(json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": binary, "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--window-size=1280,800"]}
            }}})),
        );
        b.session = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {v}"))
            .to_owned();
        b
    }

    fn raw(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.port,
            body.len()
        )
        .unwrap();
        // Read the head, then exactly the body it announces (the driver keeps the connection).
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "webdriver {method} {path}: the connection closed");
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        let rest = match length {
            Some(len) => {
                while buf.len() < head_end + len {
                    let n = s.read(&mut chunk).unwrap();
                    assert!(n > 0, "webdriver {method} {path}: the body was cut short");
                    buf.extend_from_slice(&chunk[..n]);
                }
                String::from_utf8_lossy(&buf[head_end..head_end + len]).into_owned()
            }
            None => {
                s.read_to_end(&mut buf).unwrap();
                dechunk(&String::from_utf8_lossy(&buf[head_end..]))
            }
        };
        serde_json::from_str(&rest).unwrap_or_else(|e| panic!("{path}: {e}: {rest}"))
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let v = self.raw(method, path, body);
        if let Some(err) = v["value"]["error"].as_str() {
            panic!(
                "webdriver {method} {path}: {err}: {}",
                v["value"]["message"]
            );
        }
        v
    }

    fn session_call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let p = format!("/session/{}{path}", self.session);
        self.call(method, &p, body)
    }

    /// Sends this header with every request the page makes (a person who gave the browser the
    /// console's basic-auth credentials).
    pub fn always_send(&self, name: &str, value: &str) {
        self.session_call(
            "POST",
            "/goog/cdp/execute",
            Some(json!({"cmd": "Network.enable", "params": {}})),
        );
        self.session_call(
            "POST",
            "/goog/cdp/execute",
            Some(
                json!({"cmd": "Network.setExtraHTTPHeaders", "params": {"headers": {name: value}}}),
            ),
        );
    }

    /// Opens `url` and waits for the page.
    pub fn goto(&self, url: &str) {
        self.session_call("POST", "/url", Some(json!({ "url": url })));
    }

    /// The page's URL.
    pub fn url(&self) -> String {
        self.session_call("GET", "/url", None)["value"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// The page's visible text (empty while a page is being replaced).
    pub fn text(&self) -> String {
        let p = format!("/session/{}/execute/sync", self.session);
        let v = self.raw(
            "POST",
            &p,
            Some(json!({"script": "return document.body ? document.body.innerText : '';", "args": []})),
        );
        v["value"].as_str().unwrap_or_default().to_owned()
    }

    /// The first element `css` selects (panics when there is none).
    pub fn find(&self, css: &str) -> String {
        let v = self.session_call(
            "POST",
            "/element",
            Some(json!({"using": "css selector", "value": css})),
        );
        v["value"][ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("{css}: {v}"))
            .to_owned()
    }

    /// Clicks the first element `css` selects.
    pub fn click(&self, css: &str) {
        let e = self.find(css);
        self.session_call("POST", &format!("/element/{e}/click"), Some(json!({})));
    }

    /// Types `text` into the field `css` selects (after clearing it).
    pub fn fill(&self, css: &str, text: &str) {
        let e = self.find(css);
        self.session_call("POST", &format!("/element/{e}/clear"), Some(json!({})));
        self.session_call(
            "POST",
            &format!("/element/{e}/value"),
            Some(json!({ "text": text })),
        );
    }

    /// Waits until the page's text contains `needle` (a click's navigation has arrived); the
    /// text then.
    pub fn wait_for(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = self.text();
            if text.contains(needle) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "the page never said {needle:?}: {text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the page's URL contains `needle`.
    pub fn wait_url(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.url().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "never reached a URL with {needle:?}: {}",
                self.url()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Saves a screenshot of the window as a PNG.
    pub fn screenshot(&self, path: &std::path::Path) {
        let v = self.session_call("GET", "/screenshot", None);
        let png = base64_decode(v["value"].as_str().unwrap());
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let p = format!("/session/{}", self.session);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.call("DELETE", &p, None)
            }));
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n.min(rest.len())]);
        s = rest.get(n + 2..).unwrap_or("");
    }
    out
}

fn base64_decode(text: &str) -> Vec<u8> {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let (mut acc, mut bits, mut out) = (0u32, 0u32, Vec::new());
    for c in text
        .bytes()
        .filter(|&c| c != b'=' && !c.is_ascii_whitespace())
    {
        acc = (acc << 6) | A.iter().position(|&a| a == c).unwrap() as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}
