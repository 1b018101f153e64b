//! A TCP proxy to the test server that can make connections go silent.

use std::sync::{Arc, Mutex};

use super::TestDb;

/// A TCP proxy to the test server that can go silent on the connections that LISTEN (as a NAT
/// that dropped them without a reset): nothing more is forwarded either way, nothing is closed.
pub struct FreezingProxy {
    port: u16,
    conns: Arc<Mutex<Vec<Arc<ProxiedConn>>>>,
}

#[derive(Default)]
struct ProxiedConn {
    listener: std::sync::atomic::AtomicBool,
    frozen: std::sync::atomic::AtomicBool,
}

impl FreezingProxy {
    pub fn start() -> FreezingProxy {
        Self::start_to(super::server_url(), b"LISTEN postbox")
    }

    /// A proxy to the server of `server_url` whose connections are marked (to be frozen) once
    /// their client sends `marker`.
    pub fn start_to(server_url: String, marker: &'static [u8]) -> FreezingProxy {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering::SeqCst;
        let upstream = server_url.rsplit('@').next().unwrap().to_owned();
        let upstream = upstream.split('/').next().unwrap().to_owned();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let conns: Arc<Mutex<Vec<Arc<ProxiedConn>>>> = Default::default();
        let all = conns.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(&upstream) else {
                    continue;
                };
                let conn = Arc::new(ProxiedConn::default());
                all.lock().unwrap().push(conn.clone());
                for (mut from, mut to, up) in [
                    (
                        client.try_clone().unwrap(),
                        server.try_clone().unwrap(),
                        true,
                    ),
                    (server, client, false),
                ] {
                    let conn = conn.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if up && buf[..n].windows(marker.len()).any(|w| w == marker) {
                                conn.listener.store(true, SeqCst);
                            }
                            if conn.frozen.load(SeqCst) {
                                continue; // silent: swallowed, never answered, never closed
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        FreezingProxy { port, conns }
    }

    /// `url` (of the proxied server) through the proxy.
    pub fn route(&self, url: &str) -> String {
        let (user, rest) = url.rsplit_once('@').unwrap();
        let path = rest.split_once('/').map_or("", |(_, p)| p);
        format!("{user}@127.0.0.1:{}/{path}", self.port)
    }

    /// The URL of `db` through the proxy.
    pub fn url(&self, db: &TestDb) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{}", self.port, db.name)
    }

    /// Freezes every connection that has LISTENed so far; returns how many.
    pub fn freeze_listeners(&self) -> usize {
        use std::sync::atomic::Ordering::SeqCst;
        let conns = self.conns.lock().unwrap();
        let mut n = 0;
        for c in conns.iter().filter(|c| c.listener.load(SeqCst)) {
            c.frozen.store(true, SeqCst);
            n += 1;
        }
        n
    }

    pub fn listeners(&self) -> usize {
        use std::sync::atomic::Ordering::SeqCst;
        let conns = self.conns.lock().unwrap();
        conns.iter().filter(|c| c.listener.load(SeqCst)).count()
    }
}
