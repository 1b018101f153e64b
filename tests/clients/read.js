// Reads Kafka topics with kafkajs (a client independent of librdkafka) and prints every record
// as JSON: {topic: [{partition, offset, key, value, headers, timestamp}]}, each partition in order.
// Usage: node read.js BROKERS TOPIC=N [TOPIC=N ...]
const { Kafka, logLevel } = require("kafkajs");

async function main() {
  const [brokers, ...specs] = process.argv.slice(2);
  const expect = Object.fromEntries(specs.map((s) => {
    const i = s.lastIndexOf("=");
    return [s.slice(0, i), Number(s.slice(i + 1))];
  }));
  const kafka = new Kafka({ clientId: "postbox-test", brokers: brokers.split(","), logLevel: logLevel.NOTHING });
  const consumer = kafka.consumer({ groupId: `kafkajs-${Date.now()}-${process.pid}` });
  const records = Object.fromEntries(Object.keys(expect).map((t) => [t, []]));
  const done = () => Object.entries(expect).every(([t, n]) => records[t].length >= n);
  const text = (b) => (b === null || b === undefined ? null : b.toString("utf8"));
  await consumer.connect();
  await consumer.subscribe({ topics: Object.keys(expect), fromBeginning: true });
  let finish;
  const finished = new Promise((resolve) => (finish = resolve));
  await consumer.run({
    eachMessage: async ({ topic, partition, message }) => {
      const headers = Object.entries(message.headers || {}).map(([k, v]) => [k, text(v)]);
      records[topic].push({
        partition,
        offset: Number(message.offset),
        key: text(message.key),
        value: text(message.value),
        headers,
        timestamp: Number(message.timestamp),
      });
      if (done()) finish();
    },
  });
  const timeout = setTimeout(finish, 60000);
  await finished;
  clearTimeout(timeout);
  await consumer.disconnect();
  process.stdout.write(JSON.stringify(records));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
