//! A relay process (`postbox run`) with stream mode on, for the stream tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{free_port, hermetic, http_get};

/// Three times: once the writer committed 500 more messages (`committed` counts them), kills
/// the newest relay with SIGKILL and starts another (`start`).
pub fn kill_while_writing(
    relays: &mut Vec<Relay>,
    committed: impl Fn() -> usize,
    start: impl Fn() -> Relay,
) {
    for _ in 0..3 {
        let before = committed();
        assert!(wait(Duration::from_secs(20), || committed() > before + 500));
        relays.last_mut().unwrap().kill();
        relays.push(start());
    }
}

/// What the test does with a relay's standard output (its log sink's lines).
enum Stdout {
    Read,
    Unread,
    Closed,
}

/// A relay process (`postbox run`) whose log sink's lines are collected.
pub struct Relay {
    child: Child,
    /// Standard output held open and never read (a sink that hangs), when asked for.
    _unread: Option<std::process::ChildStdout>,
    lines: Arc<Mutex<Vec<serde_json::Value>>>,
    pub metrics_port: u16,
    stderr: std::path::PathBuf,
}

impl Relay {
    /// Starts `postbox run` on `url` with `[stream]` and `extra` TOML appended.
    pub fn start(url: &str, extra: &str) -> Relay {
        Self::spawn(url, extra, Stdout::Read)
    }

    /// [`Relay::start`] with standard output never read: the log sink hangs once the pipe is
    /// full.
    pub fn start_unread(url: &str, extra: &str) -> Relay {
        Self::spawn(url, extra, Stdout::Unread)
    }

    /// [`Relay::start`] with standard output closed: the log sink's writes fail (EPIPE).
    pub fn start_closed(url: &str, extra: &str) -> Relay {
        Self::spawn(url, extra, Stdout::Closed)
    }

    fn spawn(url: &str, extra: &str, stdout: Stdout) -> Relay {
        let dir = std::env::temp_dir().join(format!("postbox-stream-{}", free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let metrics_port = free_port();
        let config = dir.join("relay.toml");
        std::fs::write(
            &config,
            format!(
                "database_url = \"{url}\"\n[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\nsample_interval = \"200ms\"\n[stream]\nstatus_interval = \"200ms\"\ntakeover_interval = \"200ms\"\n{extra}\n"
            ),
        )
        .unwrap();
        let stderr = dir.join("stderr");
        let mut child = hermetic(env!("CARGO_BIN_EXE_postbox"))
            .args(["run", "--config", config.to_str().unwrap()])
            .env("RUST_LOG", "postbox=info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let lines: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
        let (out, l) = (child.stdout.take().unwrap(), lines.clone());
        let mut unread = None;
        match stdout {
            Stdout::Read => {
                std::thread::spawn(move || {
                    for line in BufReader::new(out).lines().map_while(Result::ok) {
                        if let Ok(v) = serde_json::from_str(&line) {
                            l.lock().unwrap().push(v);
                        }
                    }
                });
            }
            Stdout::Unread => unread = Some(out),
            Stdout::Closed => drop(out),
        }
        Relay {
            child,
            _unread: unread,
            lines,
            metrics_port,
            stderr,
        }
    }

    pub fn lines(&self) -> Vec<serde_json::Value> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits until `n` lines arrived (false after `deadline`).
    pub fn wait_lines(&self, n: usize, deadline: Duration) -> bool {
        wait(deadline, || self.lines.lock().unwrap().len() >= n)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = http_get(self.metrics_port, "/metrics")?;
        body.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM; whether the process exited within `deadline`.
    pub fn terminate_within(&mut self, deadline: Duration) -> bool {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        wait(deadline, || matches!(self.child.try_wait(), Ok(Some(_))))
    }

    pub fn terminate(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn wait(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}
