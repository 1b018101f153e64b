use super::durations::format_duration;
use super::*;

const CONTRACT: &str = r#"
database_url = "postgres://postgres@localhost/postbox"

[relay]
batch_size = 500
concurrency = 64
lease = "30s"
poll_interval = "5s"
shutdown_deadline = "25s"

[metrics]
listen = "0.0.0.0:9464"

[sinks.kafka]
brokers = "localhost:9092"
properties = { "compression.type" = "lz4" }   # any librdkafka property

[[routes]]
topics = ["orders.*"]
sink = "kafka"
kafka_topic = "orders"                        # optional rename

[[routes]]
topics = ["*"]
sink = "log"
"#;

#[test]
fn the_contract_file_is_accepted_as_it_is() {
    let s = Config::from_toml(CONTRACT)
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
    assert_eq!(s.engine.batch_size, 500);
    assert_eq!(s.engine.concurrency, 64);
    assert_eq!(s.engine.lease, Duration::from_secs(30));
    assert_eq!(s.engine.schedule_interval, Duration::from_millis(100));
    let tuned = Config::from_toml("[relay]\nschedule_interval = \"250ms\"\n")
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
    assert_eq!(tuned.engine.schedule_interval, Duration::from_millis(250));
    assert_eq!(s.engine.delivery_timeout, Duration::from_secs(60));
    let timed = Config::from_toml(
        "[relay]\ndelivery_timeout = \"10s\"\ntopic_timeouts = { \"reports.*\" = \"1h\", \"reports.big\" = \"2h\" }\n",
    )
    .unwrap()
    .resolve(Overrides::default())
    .unwrap();
    assert_eq!(timed.engine.timeout_for("orders"), Duration::from_secs(10));
    assert_eq!(
        timed.engine.timeout_for("reports.x"),
        Duration::from_secs(3600)
    );
    assert_eq!(
        timed.engine.timeout_for("reports.big"),
        Duration::from_secs(7200)
    );
    let e = Config::from_toml("[relay]\ntopic_timeouts = { \"a\" = \"soon\" }\n").unwrap_err();
    assert!(e.to_string().contains("topic_timeouts"), "{e}");
    assert_eq!(s.engine.hold_limit, Duration::from_secs(1));
    let leasing = Config::from_toml("[relay]\nhold_limit = \"0s\"\n")
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
    assert!(leasing.engine.hold_limit.is_zero());
    let e = Config::from_toml("[relay]\nhold_limit = \"2m\"\n")
        .unwrap()
        .resolve(Overrides::default())
        .unwrap_err();
    assert!(e.to_string().contains("relay.hold_limit"), "{e}");
    assert_eq!(s.routes.len(), 2);
    assert_eq!(s.kafka.unwrap().properties["compression.type"], "lz4");
}

#[test]
fn unknown_keys_are_named() {
    let e = Config::from_toml("[relay]\nbatchsize = 5\n").unwrap_err();
    assert_eq!(e.field, "relay.batchsize", "{e}");
    assert!(e.problem.contains("unknown field"), "{e}");
    let e = Config::from_toml("databse_url = \"x\"\n").unwrap_err();
    assert_eq!(e.field, "databse_url", "{e}");
    let e =
        Config::from_toml("[metrics]\nlisten = \"a\"\n[relay]\nlease = \"soon\"\n").unwrap_err();
    assert_eq!(e.field, "relay.lease", "{e}");
    assert!(e.problem.contains("line 4"), "{e}");
}

#[test]
fn invalid_values_name_the_field() {
    let bad = |toml: &str| {
        Config::from_toml(toml)
            .and_then(|c| c.resolve(Overrides::default()))
            .unwrap_err()
            .field
    };
    assert_eq!(bad("[relay]\nbatch_size = 0\n"), "relay.batch_size");
    assert_eq!(
        bad("[relay]\nschedule_interval = \"1ms\"\n"),
        "relay.schedule_interval"
    );
    assert_eq!(bad("[relay]\nlease = \"30 parsecs\"\n"), "relay.lease");
    assert_eq!(
        bad("[relay]\npayload_budget = \"lots\"\n"),
        "relay.payload_budget"
    );
    assert_eq!(bad("[metrics]\nmax_topics = -1\n"), "metrics.max_topics");
    assert_eq!(bad("[metrics]\nlisten = \"nowhere\"\n"), "metrics.listen");
    assert_eq!(
        bad("[[routes]]\ntopics = [\"*\"]\nsink = \"kafka\"\n"),
        "routes[0].sink"
    );
    assert_eq!(
        bad("[[routes]]\ntopics = [\"*\"]\nsink = \"s3\"\n"),
        "routes[0].sink"
    );
    assert_eq!(bad("database_url = \"mysql://x\"\n"), "database_url");
    let schedule = |fields: &str| format!("[[schedules]]\nname = \"a\"\n{fields}\n");
    assert_eq!(
        bad(&schedule("cron = \"* * * *\"\ntopic = \"t\"")),
        "schedules.0.cron"
    );
    assert_eq!(
        bad(&schedule("cron = \"* * * * *\"\ntopic = \"\"")),
        "schedules.0.topic"
    );
    assert_eq!(
        bad(&format!(
            "{}{}",
            schedule("cron = \"* * * * *\"\ntopic = \"t\""),
            schedule("cron = \"* * * * *\"\ntopic = \"u\"")
        )),
        "schedules.1.name"
    );
    let ok = Config::from_toml(&schedule(
        "cron = \"0 3 * * *\"\ntimezone = \"Europe/Berlin\"\ntopic = \"r\"\npayload = { kind = \"nightly\" }",
    ))
    .unwrap()
    .resolve(Overrides::default())
    .unwrap();
    let s = &ok.cron_schedules()[0];
    assert_eq!((s.name(), s.timezone_name()), ("a", "Europe/Berlin"));
    // config check prints them back.
    assert!(ok.to_redacted_toml().contains("[[schedules]]"));
    assert_eq!(
        bad("[[limits]]\ntopics = [\"a\"]\nmax_running = 0\n"),
        "limits.0.max_running"
    );
    assert_eq!(
        bad(
            "[[limits]]\ntopics = [\"a\"]\nmax_running = 1\n[[limits]]\ntopics = []\nmax_running = 1\n"
        ),
        "limits.1.topics"
    );
    let ok =
        Config::from_toml("[[limits]]\ntopics = [\"emails.*\"]\nmax_running = 5\nper_key = true\n")
            .unwrap()
            .resolve(Overrides::default())
            .unwrap();
    let l = &ok.running_limits()[0];
    assert_eq!((l.max_running(), l.is_per_key()), (5, true));
    assert!(ok.to_redacted_toml().contains("[[limits]]"));
    assert_eq!(
        bad("[retention]\nkeep_completed = \"10s\"\n"),
        "retention.keep_completed"
    );
    let kept = Config::from_toml("[retention]\nkeep_completed = \"24h\"\n")
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
    assert_eq!(
        kept.engine.keep_completed,
        Some(Duration::from_secs(24 * 3600))
    );
    assert!(
        kept.to_redacted_toml()
            .contains("keep_completed = \"1day\"")
    );
}

#[test]
fn precedence_is_env_over_file_over_default() {
    let c = Config::from_toml("database_url = \"postgres://file/db\"\n[relay]\nbatch_size = 7\n")
        .unwrap();
    let s = c.clone().resolve(Overrides::default()).unwrap();
    assert_eq!(
        (
            s.database_url.as_str(),
            s.engine.batch_size,
            s.engine.concurrency
        ),
        ("postgres://file/db", 7, 100)
    );
    let env = Overrides {
        database_url: Some("postgres://env/db".into()),
        batch_size: Some("9".into()),
        ..Default::default()
    };
    let s = c.resolve(env).unwrap();
    assert_eq!(
        (s.database_url.as_str(), s.engine.batch_size),
        ("postgres://env/db", 9)
    );
    // DATABASE_URL, which every diesel user has exported, does not beat the file...
    let generic = Overrides {
        database_url_fallback: Some("postgres://other/app".into()),
        ..Default::default()
    };
    let s = Config::from_toml("database_url = \"postgres://file/db\"\n")
        .unwrap()
        .resolve(generic.clone())
        .unwrap();
    assert_eq!(s.database_url, "postgres://file/db");
    // ...it is the fallback when the file has none (the chart passes it so)...
    let s = Config::default().resolve(generic.clone()).unwrap();
    assert_eq!(s.database_url, "postgres://other/app");
    // ...and POSTBOX_DATABASE_URL (or --database-url) beats both.
    let s = Config::from_toml("database_url = \"postgres://file/db\"\n")
        .unwrap()
        .resolve(Overrides {
            database_url: Some("postgres://postbox/db".into()),
            ..generic
        })
        .unwrap();
    assert_eq!(s.database_url, "postgres://postbox/db");
    let e = Config::default()
        .resolve(Overrides {
            lease: Some("soon".into()),
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.field, "relay.lease (POSTBOX_LEASE)");
}

#[test]
fn kafka_properties_come_from_the_environment_too() {
    let c = Config::from_toml("[sinks.kafka]\nbrokers = \"b:9092\"\n").unwrap();
    let env = Overrides {
        kafka_properties: [("sasl.password".to_owned(), "pw".to_owned())].into(),
        ..Default::default()
    };
    let s = c.resolve(env).unwrap();
    assert_eq!(s.kafka.as_ref().unwrap().properties["sasl.password"], "pw");
    assert!(!s.to_redacted_toml().contains("\"pw\""));
}

#[test]
fn secrets_are_redacted() {
    assert_eq!(
        redact_url("postgres://u:hunter2@h:5432/db?sslmode=require"),
        "postgres://u:<redacted>@h:5432/db?sslmode=require"
    );
    assert_eq!(
        redact_url("postgres://u@h/db?password=hunter2&x=1"),
        "postgres://u@h/db?password=<redacted>&x=1"
    );
    let c = Config::from_toml(
        "database_url = \"postgres://u:pw@h/db\"\n[sinks.kafka]\nbrokers = \"b:9092\"\nproperties = { \"sasl.password\" = \"pw\", \"sasl.username\" = \"u\" }\n",
    )
    .unwrap();
    let out = c.resolve(Overrides::default()).unwrap().to_redacted_toml();
    assert!(!out.contains("pw\""), "{out}");
    assert!(
        out.contains("sasl.username") && out.contains("<redacted>"),
        "{out}"
    );
    // What is printed is itself a valid config.
    Config::from_toml(&out).unwrap();
}

#[test]
fn durations() {
    assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
    assert_eq!(
        parse_duration("7d").unwrap(),
        Duration::from_secs(7 * 86400)
    );
    assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400));
    assert!(parse_duration("5").is_err());
    assert!(parse_duration("5 fortnights").is_err());
    assert_eq!(format_duration(Duration::from_millis(1500)), "1s 500ms");
}

#[test]
fn payload_budget_and_max_topics_are_read_with_units() {
    let s = Config::from_toml("[relay]\npayload_budget = \"512KiB\"\n[metrics]\nmax_topics = 7\n")
        .and_then(|c| c.resolve(Overrides::default()))
        .unwrap();
    assert_eq!(
        (s.engine.payload_budget, s.metrics_max_topics),
        (512 << 10, 7)
    );
    let s = Config::from_toml("[relay]\npayload_budget = 1000\n")
        .and_then(|c| c.resolve(Overrides::default()))
        .unwrap();
    assert_eq!(s.engine.payload_budget, 1000);
    let s = Config::from_toml("")
        .and_then(|c| c.resolve(Overrides::default()))
        .unwrap();
    assert_eq!(
        (s.engine.payload_budget, s.metrics_max_topics),
        (64 << 20, 50)
    );
}

#[test]
fn the_stream_section_fills_its_defaults_and_names_a_bad_field() {
    let s = Config::from_toml("[stream]\n")
        .unwrap()
        .resolve(Overrides::default())
        .unwrap()
        .stream
        .expect("[stream] turns stream mode on");
    assert_eq!(
        (s.slot.as_str(), s.publication.as_str()),
        ("postbox", "postbox_stream")
    );
    assert!(s.create_slot);
    assert_eq!(s.status_interval, Duration::from_secs(1));
    assert_eq!(s.batch_size, 5000);
    let none = Config::from_toml("")
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
    assert!(none.stream.is_none());
    for (toml, field) in [
        ("[stream]\nslot = \"Bad-Name\"", "stream.slot"),
        ("[stream]\npublication = \"\"", "stream.publication"),
        ("[stream]\nbatch_size = 0", "stream.batch_size"),
        (
            "[stream]\nstatus_interval = \"10ms\"",
            "stream.status_interval",
        ),
        (
            "[stream]\nliveness_interval = \"100ms\"",
            "stream.liveness_interval",
        ),
        ("[stream]\nslots = \"x\"", "stream"),
    ] {
        let e = Config::from_toml(toml)
            .and_then(|c| c.resolve(Overrides::default()))
            .unwrap_err();
        assert!(e.field.starts_with(field), "{toml}: {e}");
    }
    // The redacted configuration shows it, and reads back the same.
    let settings = Config::from_toml("[stream]\nslot = \"s1\"")
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
    let again = Config::from_toml(&settings.to_redacted_toml())
        .unwrap()
        .resolve(Overrides::default())
        .unwrap();
    assert_eq!(again.stream, settings.stream);
}

#[test]
fn kafka_routes_take_a_format_and_a_topic_template_and_name_what_is_wrong() {
    let kafka = "[sinks.kafka]\nbrokers = \"b:9092\"\n";
    let route = |fields: &str| {
        format!(
            "{kafka}[[routes]]\ntopics = [\"shop.order\", \"shop.*\"]\nsink = \"kafka\"\n{fields}\n"
        )
    };
    let resolve =
        |toml: &str| Config::from_toml(toml).and_then(|c| c.resolve(Overrides::default()));
    let ok = |fields: &str| {
        resolve(&route(fields))
            .unwrap_or_else(|e| panic!("{fields}: {e}"))
            .routes[0]
            .layout()
            .unwrap()
    };
    assert_eq!(ok(""), crate::sink::record::RecordLayout::default());
    let d = ok(
        "format = \"debezium\"\nexpand_payload = true\ntombstone_on_empty = true\nkafka_topic = \"outbox.event.{topic[-1]}\"",
    );
    assert_eq!(
        d.format,
        crate::sink::record::Format::Debezium {
            expand_payload: true,
            tombstone_on_empty: true
        }
    );
    assert_eq!(
        ok("format = \"cloudevents\"\nsource = \"/shop\"\ncontent_mode = \"structured\"").format,
        crate::sink::record::Format::CloudEvents {
            source: "/shop".into(),
            structured: true
        }
    );
    ok("kafka_topic = \"{topic[0]}.{header:region}\"");
    for (fields, field, why) in [
        ("format = \"avro\"", "format", "unknown format \"avro\""),
        ("expand_payload = true", "expand_payload", "debezium"),
        (
            "format = \"cloudevents\"",
            "source",
            "needs the events' source",
        ),
        (
            "format = \"cloudevents\"\nsource = \"my source\"",
            "source",
            "URI-reference",
        ),
        (
            "format = \"cloudevents\"\nsource = \"/s\"\ncontent_mode = \"batch\"",
            "content_mode",
            "batch",
        ),
        (
            "format = \"cloudevents\"\nsource = \"/s\"\ntombstone_on_empty = true",
            "tombstone_on_empty",
            "tombstones",
        ),
        ("source = \"/s\"", "source", "cloudevents"),
        ("kafka_topic = \"outbox/{topic}\"", "kafka_topic", "'/'"),
        (
            "kafka_topic = \"outbox.{aggregate}\"",
            "kafka_topic",
            "unknown placeholder",
        ),
        // shop.order has no segment 2: known from the exact name, before any message.
        (
            "kafka_topic = \"x.{topic[2]}\"",
            "kafka_topic",
            "no segment [2]",
        ),
    ] {
        let e = resolve(&route(fields)).unwrap_err();
        assert_eq!(e.field, format!("routes[0].{field}"), "{fields}: {e}");
        assert!(e.problem.contains(why), "{fields}: {e}");
    }
    let log = "[[routes]]\ntopics = [\"*\"]\nsink = \"log\"\nformat = \"debezium\"\n";
    let e = resolve(log).unwrap_err();
    assert_eq!(e.field, "routes[0].format", "{e}");
    assert!(e.problem.contains("kafka route only"), "{e}");
}

#[test]
fn errors_speak_of_tables_and_name_the_variable_a_bad_value_came_from() {
    let e = Config::from_toml("relay = 5\n").unwrap_err();
    assert_eq!(e.field, "relay", "{e}");
    assert!(e.problem.contains("expected a table"), "{e}");
    assert!(!e.problem.contains("Section"), "{e}");
    let e = Config::default()
        .resolve(Overrides {
            lease: Some("0s".into()),
            ..Overrides::default()
        })
        .unwrap_err();
    assert_eq!(e.field, "relay.lease (POSTBOX_LEASE)", "{e}");
    let e = Config::default()
        .resolve(Overrides {
            database_url_fallback: Some("mysql://x".into()),
            ..Overrides::default()
        })
        .unwrap_err();
    assert_eq!(e.field, "database_url (DATABASE_URL)", "{e}");
    // The same value from the file is named by its key alone.
    let e = Config::from_toml("[relay]\nlease = \"0s\"\n")
        .unwrap()
        .resolve(Overrides::default())
        .unwrap_err();
    assert_eq!(e.field, "relay.lease", "{e}");
}
