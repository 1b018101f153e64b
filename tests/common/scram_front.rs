//! A SASL front for a Kafka-protocol broker that has none: it answers the client's
//! SaslHandshake and SaslAuthenticate requests itself (SCRAM-SHA-512, RFC 5802/7677, with one
//! user), refuses every other request before the client is authenticated, and then passes the
//! connection through to the broker byte for byte. With socat terminating TLS in front of it,
//! a client meets SASL_SSL with SCRAM exactly as a secured Kafka cluster presents it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha512};

const API_VERSIONS: i16 = 18;
const SASL_HANDSHAKE: i16 = 17;
const SASL_AUTHENTICATE: i16 = 36;
const SASL_AUTHENTICATION_FAILED: i16 = 58;
const UNSUPPORTED_SASL_MECHANISM: i16 = 33;
const ITERATIONS: u32 = 4096;

/// Listens on a free port of 127.0.0.1 in front of `broker` (host:port); returns the port.
pub fn start(broker: String, user: &'static str, password: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let broker = broker.clone();
            std::thread::spawn(move || {
                let _ = serve(client, &broker, user, password);
            });
        }
    });
    port
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body)?;
    Ok(body)
}

fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(body);
    s.write_all(&out)
}

/// The request header (v1: api key, version, correlation id, client id); returns the offset of
/// the body. SaslHandshake v0–1 and SaslAuthenticate v0–1 are not flexible (no tagged fields).
fn header(frame: &[u8]) -> (i16, i16, i32, usize) {
    let key = i16::from_be_bytes([frame[0], frame[1]]);
    let version = i16::from_be_bytes([frame[2], frame[3]]);
    let correlation = i32::from_be_bytes([frame[4], frame[5], frame[6], frame[7]]);
    let client_len = i16::from_be_bytes([frame[8], frame[9]]);
    (key, version, correlation, 10 + client_len.max(0) as usize)
}

fn string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as i16).to_be_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut m = <Hmac<Sha512> as KeyInit>::new_from_slice(key).unwrap();
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// PBKDF2-HMAC-SHA-512 with one block: SCRAM's Hi().
fn hi(password: &[u8], salt: &[u8], iterations: u32) -> Vec<u8> {
    let mut first = salt.to_vec();
    first.extend_from_slice(&1u32.to_be_bytes());
    let mut u = hmac(password, &first);
    let mut out = u.clone();
    for _ in 1..iterations {
        u = hmac(password, &u);
        for (o, b) in out.iter_mut().zip(&u) {
            *o ^= b;
        }
    }
    out
}

fn attribute<'a>(message: &'a str, name: &str) -> Option<&'a str> {
    message
        .split(',')
        .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
}

fn serve(mut client: TcpStream, broker: &str, user: &str, password: &str) -> std::io::Result<()> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut upstream = TcpStream::connect(broker)?;
    let salt: Vec<u8> = (0..16).map(|_| fastrand::u8(..)).collect();
    let server_nonce: String = (0..24).map(|_| fastrand::alphanumeric()).collect();
    let mut client_first_bare = String::new();
    let mut server_first = String::new();
    loop {
        let frame = read_frame(&mut client)?;
        let (key, version, correlation, body) = header(&frame);
        let mut response = correlation.to_be_bytes().to_vec();
        match key {
            API_VERSIONS => {
                write_frame(&mut upstream, &frame)?;
                let answer = read_frame(&mut upstream)?;
                write_frame(&mut client, &answer)?;
                continue;
            }
            SASL_HANDSHAKE => {
                let len = i16::from_be_bytes([frame[body], frame[body + 1]]) as usize;
                let mechanism = std::str::from_utf8(&frame[body + 2..body + 2 + len]).unwrap();
                let error = if mechanism == "SCRAM-SHA-512" {
                    0
                } else {
                    UNSUPPORTED_SASL_MECHANISM
                };
                response.extend_from_slice(&error.to_be_bytes());
                response.extend_from_slice(&1i32.to_be_bytes());
                response.extend_from_slice(&string("SCRAM-SHA-512"));
                write_frame(&mut client, &response)?;
                if error != 0 {
                    return Ok(());
                }
            }
            SASL_AUTHENTICATE if version <= 1 => {
                let len = i32::from_be_bytes(frame[body..body + 4].try_into().unwrap()) as usize;
                let message =
                    String::from_utf8_lossy(&frame[body + 4..body + 4 + len]).into_owned();
                let (reply, failed) = if client_first_bare.is_empty() {
                    // client-first: n,,n=user,r=nonce
                    client_first_bare = message.splitn(3, ',').nth(2).unwrap_or("").to_owned();
                    let nonce = attribute(&client_first_bare, "r").unwrap_or("");
                    let known = attribute(&client_first_bare, "n") == Some(user);
                    server_first = format!(
                        "r={nonce}{server_nonce},s={},i={ITERATIONS}",
                        b64.encode(&salt)
                    );
                    (server_first.clone(), !known)
                } else {
                    // client-final: c=biws,r=nonce,p=proof
                    let without_proof = message.rsplit_once(",p=").map_or("", |(w, _)| w);
                    let proof = b64
                        .decode(attribute(&message, "p").unwrap_or(""))
                        .unwrap_or_default();
                    let salted = hi(password.as_bytes(), &salt, ITERATIONS);
                    let client_key = hmac(&salted, b"Client Key");
                    let stored_key = Sha512::digest(&client_key).to_vec();
                    let auth = format!("{client_first_bare},{server_first},{without_proof}");
                    let signature = hmac(&stored_key, auth.as_bytes());
                    let expected: Vec<u8> = client_key
                        .iter()
                        .zip(&signature)
                        .map(|(a, b)| a ^ b)
                        .collect();
                    let server_key = hmac(&salted, b"Server Key");
                    let verifier = b64.encode(hmac(&server_key, auth.as_bytes()));
                    (format!("v={verifier}"), proof != expected)
                };
                let error = if failed {
                    SASL_AUTHENTICATION_FAILED
                } else {
                    0
                };
                response.extend_from_slice(&error.to_be_bytes());
                if failed {
                    response.extend_from_slice(&string("Authentication failed"));
                    response.extend_from_slice(&0i32.to_be_bytes());
                } else {
                    response.extend_from_slice(&(-1i16).to_be_bytes());
                    response.extend_from_slice(&(reply.len() as i32).to_be_bytes());
                    response.extend_from_slice(reply.as_bytes());
                }
                if version >= 1 {
                    response.extend_from_slice(&0i64.to_be_bytes());
                }
                write_frame(&mut client, &response)?;
                if failed {
                    return Ok(());
                }
                if reply.starts_with("v=") {
                    break; // authenticated
                }
            }
            // Anything else before authentication: the connection is closed, as a broker does.
            _ => return Ok(()),
        }
    }
    // Authenticated: pass everything through.
    let (mut c2, mut u2) = (client.try_clone()?, upstream.try_clone()?);
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut u2, &mut c2);
        let _ = c2.shutdown(std::net::Shutdown::Both);
    });
    let _ = std::io::copy(&mut client, &mut upstream);
    let _ = upstream.shutdown(std::net::Shutdown::Both);
    Ok(())
}
