//! A Kafka-protocol broker for the tests: tansu with memory storage, on a port of its own.

use std::collections::{BTreeMap, HashMap};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message as _};

/// A tansu broker on a port of its own, killed on drop.
pub struct Broker {
    child: Child,
    pub port: u16,
}

pub fn tansu_bin() -> String {
    if let Ok(b) = std::env::var("POSTBOX_TANSU_BIN") {
        return b;
    }
    let out = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/ensure-tansu.sh"
        ))
        .stderr(Stdio::null())
        .output()
        .expect("run scripts/ensure-tansu.sh");
    assert!(
        out.status.success(),
        "scripts/ensure-tansu.sh failed: no Kafka-protocol broker for the tests"
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

impl Broker {
    pub fn start_on(port: u16) -> Broker {
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(tansu_bin())
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        let end = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < end, "tansu did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        Broker { child, port }
    }

    pub fn start() -> Broker {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Broker::start_on(port)
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    pub fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub async fn create_topic(&self, name: &str, partitions: i32) {
        self.create_topic_with(name, partitions, &[]).await
    }

    /// Creates `name` with topic configuration `config` (`cleanup.policy` = `compact`, ...).
    pub async fn create_topic_with(&self, name: &str, partitions: i32, config: &[(&str, &str)]) {
        let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        for (k, v) in config {
            topic = topic.set(k, v);
        }
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .create()
            .unwrap();
        let r = admin
            .create_topics(&[topic], &AdminOptions::new())
            .await
            .unwrap();
        for t in r {
            t.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
        }
    }

    /// Reads `topic` until `n` distinct `postbox-id`s were seen and nothing more came for a second
    /// (or the deadline passed): each id with how many times it was there.
    pub fn consume_ids(&self, topic: &str, n: usize) -> HashMap<i64, u32> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .set("group.id", format!("test-{}", fastrand::u64(..)))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        consumer.subscribe(&[topic]).unwrap();
        let mut seen: HashMap<i64, u32> = HashMap::new();
        let end = Instant::now() + Duration::from_secs(60);
        let mut quiet_since = Instant::now();
        while Instant::now() < end
            && (seen.len() < n || quiet_since.elapsed() < Duration::from_secs(1))
        {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                quiet_since = Instant::now();
                let id = m
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == "postbox-id"))
                    .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse().ok())
                    .expect("a postbox-id header");
                *seen.entry(id).or_default() += 1;
            }
        }
        seen
    }

    /// Reads `n` messages of `topic` (or what arrived before the deadline).
    pub fn consume(&self, topic: &str, n: usize) -> Vec<Consumed> {
        self.consume_until(topic, |got| got.len() >= n, Duration::ZERO)
    }

    /// Reads `topic` from its start until `done` holds of what was read and then nothing more
    /// came for `quiet` (or a minute passed), in each partition's order.
    pub fn consume_until(
        &self,
        topic: &str,
        mut done: impl FnMut(&[Consumed]) -> bool,
        quiet: Duration,
    ) -> Vec<Consumed> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .set("group.id", format!("test-{}", fastrand::u64(..)))
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "6000")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        consumer.subscribe(&[topic]).unwrap();
        let mut out = Vec::new();
        let end = Instant::now() + Duration::from_secs(60);
        let mut finished: Option<Instant> = None;
        while Instant::now() < end {
            if finished.is_none() && done(&out) {
                finished = Some(Instant::now());
            }
            if finished.is_some_and(|at| at.elapsed() >= quiet) {
                break;
            }
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                if finished.is_some() {
                    finished = Some(Instant::now());
                }
                let mut headers = BTreeMap::new();
                if let Some(h) = m.headers() {
                    for hd in h.iter() {
                        headers.insert(
                            hd.key.to_owned(),
                            String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                        );
                    }
                }
                out.push(Consumed {
                    key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    payload: serde_json::from_slice(m.payload().unwrap_or_default()).unwrap(),
                    headers,
                    partition: m.partition(),
                    offset: m.offset(),
                });
            }
        }
        out
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug, Clone)]
pub struct Consumed {
    pub key: Option<String>,
    pub payload: serde_json::Value,
    pub headers: BTreeMap<String, String>,
    pub partition: i32,
    pub offset: i64,
}
