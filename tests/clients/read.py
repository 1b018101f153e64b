"""Reads Kafka topics with confluent-kafka the way consumers written for other producers do, and
prints what they saw as one JSON document (tests/formats.rs asserts on it).

- every record, raw: partition, offset, key, value, headers, timestamp and its type;
- `--debezium TOPIC:string|expanded`: as the Debezium outbox example consumer reads it: the event
  id from header `id` (an id seen before is a duplicate and skipped), the type from `eventType`,
  the aggregate id from the key, the payload parsed from the string (or taken as JSON, expanded);
- `--cloudevents TOPIC`: each record parsed by the CloudEvents SDK's Kafka binding
  (`from_structured` when content-type is application/cloudevents+json, else `from_binary`),
  which validates the event; its attributes and data.
"""

import argparse
import json
import sys
import time

from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer


def text(b):
    return None if b is None else b.decode("utf-8")


def raw(m):
    ts_type, ts = m.timestamp()
    return {
        "partition": m.partition(),
        "offset": m.offset(),
        "key": text(m.key()),
        "value": text(m.value()),
        "headers": [[k, text(v)] for k, v in (m.headers() or [])],
        "timestamp": ts,
        "create_time": ts_type == TIMESTAMP_CREATE_TIME,
    }


def debezium(records, mode):
    seen, events, duplicates = set(), [], 0
    for m in records:
        headers = dict(m.headers() or [])
        event_id = text(headers["id"])
        if event_id in seen:
            duplicates += 1
            continue
        seen.add(event_id)
        value = m.value()
        if value is None:
            payload = None
        elif mode == "string":
            as_string = json.loads(value)
            if not isinstance(as_string, str):
                raise SystemExit(f"debezium string payload expected, got {value!r}")
            payload = json.loads(as_string)
        else:
            payload = json.loads(value)
        events.append(
            {
                "id": event_id,
                "eventType": text(headers.get("eventType")),
                "aggregateid": text(m.key()),
                "payload": payload,
                "tombstone": value is None,
            }
        )
    return {"events": events, "duplicates": duplicates}


def cloudevents(records):
    out = []
    for m in records:
        headers = {k: v for k, v in (m.headers() or [])}
        message = ce_kafka.KafkaMessage(headers=headers, key=m.key(), value=m.value())
        if headers.get("content-type") == b"application/cloudevents+json":
            event, mode = ce_kafka.from_structured(message, JSONFormat()), "structured"
        else:
            event, mode = ce_kafka.from_binary(message, JSONFormat()), "binary"
        attributes = {
            k: (v.isoformat() if hasattr(v, "isoformat") else v)
            for k, v in event.get_attributes().items()
        }
        out.append(
            {
                "mode": mode,
                "attributes": attributes,
                "time_epoch_us": round(event.get_time().timestamp() * 1_000_000),
                "data": event.get_data(),
            }
        )
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--brokers", required=True)
    p.add_argument("--expect", action="append", default=[], help="TOPIC=N records")
    p.add_argument("--debezium", action="append", default=[], help="TOPIC:string|expanded")
    p.add_argument("--cloudevents", action="append", default=[], help="TOPIC")
    p.add_argument("--timeout", type=float, default=60)
    a = p.parse_args()
    expect = {t: int(n) for t, n in (e.rsplit("=", 1) for e in a.expect)}
    consumer = Consumer(
        {
            "bootstrap.servers": a.brokers,
            "group.id": f"python-{time.time_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe(list(expect))
    records = {t: [] for t in expect}
    deadline = time.time() + a.timeout
    while time.time() < deadline and any(len(records[t]) < n for t, n in expect.items()):
        m = consumer.poll(0.2)
        if m is None:
            continue
        if m.error():
            raise SystemExit(f"consumer error: {m.error()}")
        records[m.topic()].append(m)
    consumer.close()
    out = {"raw": {t: [raw(m) for m in ms] for t, ms in records.items()}}
    out["debezium"] = {}
    for spec in a.debezium:
        topic, mode = spec.rsplit(":", 1)
        out["debezium"][topic] = debezium(records[topic], mode)
    out["cloudevents"] = {t: cloudevents(records[t]) for t in a.cloudevents}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
