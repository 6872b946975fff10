//! Hostile input against every decoder of the protocol module: valid messages with one value
//! swapped for a wrong type or range (or removed), arbitrary topics, arbitrary duration text,
//! arbitrary chunk sequences and arbitrary FL result objects. Every case must end in a typed
//! value or an error that says what is wrong; none may panic.

use proptest::collection::vec as pvec;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::tests::props::{inbound, json_value};
use super::*;

/// One step into a JSON document: an object key or an array index.
#[derive(Debug, Clone)]
enum Step {
    Key(String),
    Index(usize),
}

/// Every place in `value` that holds a value, outermost first.
fn paths(value: &Value, prefix: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                prefix.push(Step::Key(k.clone()));
                out.push(prefix.clone());
                paths(v, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                prefix.push(Step::Index(i));
                out.push(prefix.clone());
                paths(v, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

/// Replaces (or, with `None`, removes) the value at `path`.
fn mutate(root: &mut Value, path: &[Step], with: Option<Value>) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut at = root;
    for step in parents {
        let next = match (step, at) {
            (Step::Key(k), Value::Object(m)) => m.get_mut(k),
            (Step::Index(i), Value::Array(a)) => a.get_mut(*i),
            _ => None,
        };
        match next {
            Some(v) => at = v,
            None => return,
        }
    }
    match (last, at, with) {
        (Step::Key(k), Value::Object(m), Some(v)) => {
            m.insert(k.clone(), v);
        }
        (Step::Key(k), Value::Object(m), None) => {
            m.remove(k);
        }
        (Step::Index(i), Value::Array(a), Some(v)) => {
            if let Some(slot) = a.get_mut(*i) {
                *slot = v;
            }
        }
        (Step::Index(i), Value::Array(a), None) if *i < a.len() => {
            a.remove(*i);
        }
        _ => {}
    }
}

/// Values of the wrong type or out of range for some key of the protocol.
fn wrong_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => prop::sample::select(vec![
            Value::Null,
            json!(true),
            json!(false),
            json!(0),
            json!(-1),
            json!(i64::MIN),
            json!(i64::MAX),
            json!(u64::MAX),
            json!(4_294_967_296u64),
            json!(1e300),
            json!(-1e300),
            json!(-0.5),
            json!(0.000_000_1),
            json!(""),
            json!(" "),
            json!("\u{0}"),
            json!("+/#"),
            json!("not base64 !!"),
            json!("AGFzbQ="),
            json!("-1s"),
            json!("99999999999999999999h"),
            json!("1e309"),
            json!("NaN"),
            json!("9999-99-99T99:99:99Z"),
            json!([]),
            json!([null]),
            json!([1, "a", {}, []]),
            json!({}),
            json!({"secs_since_epoch": u64::MAX, "nanos_since_epoch": u64::MAX}),
            json!({"secs_since_epoch": -1, "nanos_since_epoch": 1}),
            json!({"update_envelope": {"round_id": []}}),
            json!({"interval": "0s", "history_size": -1}),
        ]),
        1 => json_value(),
        1 => "\\PC{0,24}".prop_map(Value::String),
    ]
}

/// Where a decode error points, by its first level (`monitoring_profile.interval` and
/// `inputs[2]` both start at a top-level key).
fn top_level(key: &str) -> &str {
    key.split(['.', '[']).next().unwrap_or(key)
}

fn all_kinds() -> Vec<TopicKind> {
    let mut kinds = TopicKind::FIXED.to_vec();
    let segment = |s: &str| TopicSegment::new(s, "id").map_err(|e| e.to_string());
    if let (Ok(round_id), Ok(proplet_id)) = (segment("r"), segment("p")) {
        kinds.push(TopicKind::FlUpdate {
            round_id,
            proplet_id,
        });
    }
    kinds
}

/// A decoded message must encode to something the decoder takes back.
fn re_decodes(kind: &TopicKind, msg: &Inbound) -> Result<(), TestCaseError> {
    match decode(kind, &msg.encode()) {
        Ok(_) => Ok(()),
        Err(e) => Err(TestCaseError::fail(format!(
            "accepted {msg:?} but refused its own encoding: {e}"
        ))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// One value of a valid message replaced by a wrong one (or removed): the decoder accepts
    /// it (tolerant keys, ignored extras) or refuses it naming a key at the level changed.
    #[test]
    fn one_wrong_value_in_a_valid_message_is_named(
        msg in inbound(),
        pick in any::<prop::sample::Index>(),
        replacement in prop::option::weighted(0.85, wrong_value()),
    ) {
        let kind = msg.kind();
        let mut doc: Value = match serde_json::from_slice(&msg.encode()) {
            Ok(v) => v,
            Err(e) => return Err(TestCaseError::fail(format!("encoder wrote bad JSON: {e}"))),
        };
        let mut all = Vec::new();
        paths(&doc, &mut Vec::new(), &mut all);
        prop_assume!(!all.is_empty());
        let path = &all[pick.index(all.len())];
        mutate(&mut doc, path, replacement);
        let payload = doc.to_string();
        match decode(&kind, payload.as_bytes()) {
            Ok(decoded) => re_decodes(&kind, &decoded)?,
            Err(e) => {
                prop_assert!(!e.to_string().is_empty());
                let Some(key) = e.key() else {
                    return Err(TestCaseError::fail(format!("error without a key: {e}")));
                };
                let Some(Step::Key(changed)) = path.first() else {
                    return Err(TestCaseError::fail("top-level step is not a key"));
                };
                // Changing `broadcast` or `status` can make another key required.
                let related = matches!(changed.as_str(), "broadcast" | "status");
                prop_assert!(
                    related || top_level(key) == changed,
                    "changed `{}` but the error names `{}`: {}\n{}", changed, key, e, payload
                );
            }
        }
    }

    /// Any JSON object at all (protocol keys, arbitrary values) on every topic kind.
    #[test]
    fn any_json_on_any_kind_is_decoded_or_refused_with_a_message(value in json_value()) {
        let payload = value.to_string();
        for kind in all_kinds() {
            match decode(&kind, payload.as_bytes()) {
                Ok(decoded) => re_decodes(&kind, &decoded)?,
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }

    /// Arbitrary bytes, including invalid UTF-8 and payloads above a small limit.
    #[test]
    fn arbitrary_bytes_are_refused_with_a_message(
        bytes in pvec(any::<u8>(), 0..512),
        limit in 0usize..600,
    ) {
        let decoder = Decoder::new(limit);
        for kind in all_kinds() {
            match decoder.decode(&kind, &bytes) {
                Ok(decoded) => re_decodes(&kind, &decoded)?,
                Err(DecodeError::TooLarge { size, max }) => {
                    prop_assert!(size > max && max == limit);
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }

    /// Topic parsing: arbitrary text, and topics built from protocol levels mixed with empty
    /// levels, wildcards and control characters.
    #[test]
    fn any_topic_is_classified_or_ignored(
        text in "\\PC{0,64}",
        levels in pvec(prop_oneof![
            prop::sample::select(vec![
                "m", "c", "fl", "rounds", "updates", "control", "proplet", "manager",
                "registry", "server", "alive", "create", "results", "start", "", "+", "#",
                "\u{0}", "a/b",
            ]).prop_map(str::to_owned),
            "\\PC{0,6}",
        ], 0..9),
    ) {
        let _ = classify(&text);
        let topic = levels.join("/");
        // A classified topic never has a wildcard or empty level in its ids.
        if let Some((Some(c), kind)) = classify(&topic) {
            for id in [c.domain, c.channel] {
                prop_assert!(TopicSegment::new(id, "id").is_ok(), "{topic}");
            }
            let rebuilt = Channel::new(c.domain, c.channel)
                .map(|ch| ch.topic(&kind))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&rebuilt, &topic);
        }
        if let Ok(channel) = Channel::new("d", "c") {
            let _ = channel.classify(&topic);
            let _ = channel.classify(&text);
        }
    }

    /// Ids: refused exactly when empty or holding `/`, `+`, `#` or NUL, with a message.
    #[test]
    fn topic_ids_are_checked(text in "\\PC{0,12}|[a/+#\u{0}]{0,4}") {
        let bad = text.is_empty() || text.contains(['/', '+', '#', '\0']);
        match Channel::new(text.clone(), "c") {
            Ok(_) => prop_assert!(!bad, "{text:?} accepted"),
            Err(e) => {
                prop_assert!(bad, "{text:?} refused: {e}");
                prop_assert!(e.to_string().contains("domain"), "{e}");
            }
        }
    }

    /// Duration text as settings and intervals carry it.
    #[test]
    fn duration_text_is_parsed_or_refused_with_a_message(
        text in "\\PC{0,16}|[0-9.e+-]{0,24}[hmsuµn]{0,2}([0-9.]{0,4}[hms]){0,3}",
    ) {
        if let Err(e) = parse_duration(&text) {
            prop_assert!(!e.is_empty());
        }
        if let Err(e) = parse_setting_duration(&text) {
            prop_assert!(!e.is_empty());
        }
    }

    /// Any order, total, index, app name and size of chunks: the assembler never holds more
    /// than its cap, completes only with every index, and then refuses everything.
    #[test]
    fn chunk_assembler_survives_any_sequence(
        chunks in pvec((
            prop::sample::select(vec!["img", "other", ""]),
            prop_oneof![0u32..5, Just(u32::MAX)],
            prop_oneof![0u32..6, Just(u32::MAX - 1), Just(u32::MAX)],
            pvec(any::<u8>(), 0..16),
        ), 0..24),
        cap in 0usize..64,
    ) {
        let mut assembler = ChunkAssembler::new("img", cap);
        let mut accepted_bytes = 0usize;
        let mut completed = false;
        for (app, total, idx, data) in chunks {
            let len = data.len();
            let pushed = assembler.push(RegistryChunk {
                app_name: app.to_owned(),
                chunk_idx: idx,
                total_chunks: total,
                data,
            });
            match pushed {
                Ok(ChunkProgress::Pending { received, total }) => {
                    accepted_bytes += len;
                    prop_assert!(received < total);
                    prop_assert!(assembler.bytes() <= cap);
                }
                Ok(ChunkProgress::Complete(binary)) => {
                    accepted_bytes += len;
                    prop_assert!(!completed);
                    prop_assert_eq!(binary.len(), accepted_bytes);
                    completed = true;
                }
                Err(e) => {
                    prop_assert!(!e.to_string().is_empty());
                    if completed {
                        prop_assert_eq!(e, ChunkError::AlreadyComplete);
                    }
                }
            }
        }
        prop_assert_eq!(assembler.is_complete(), completed);
    }

    /// Result objects the operator searches for FL update envelopes.
    #[test]
    fn fl_envelopes_in_results_are_decoded_or_refused(
        value in json_value(),
        wrapper in 0usize..3,
    ) {
        let object = match wrapper {
            0 => json!({ "update_envelope": value }),
            1 => json!({ "results": { "update_envelope": value } }),
            _ => match value {
                Value::Object(mut m) => {
                    m.insert("round_id".into(), json!("r"));
                    Value::Object(m)
                }
                other => json!({ "round_id": other }),
            },
        };
        if let Some(Err(e)) = ResultValue::Json(object).fl_update() {
            prop_assert!(e.key().is_some_and(|k| k.starts_with("results")), "{e}");
        }
    }
}

/// A fixed set of wrong values on every key of one complete start request, so the most
/// complex decoder is covered key by key whatever the random cases pick.
#[test]
fn every_key_of_a_start_request_rejects_wrong_types_by_name() {
    let base = json!({
        "id": "t1", "name": "add", "state": 0, "image_url": "", "file": "AGFzbQ==",
        "inputs": ["1", "2"], "cli_args": ["-x"], "daemon": false, "latent": false,
        "broadcast": false, "proplet_id": "p1", "env": {"A": "b"}, "encrypted": false,
        "monitoring_profile": {"enabled": true, "interval": 10, "history_size": 5},
        "priority": 3, "metadata": {"k": 1}, "parent_results": {"a": "1"},
    });
    let Value::Object(map) = base else {
        panic!("the base request is an object");
    };
    let Ok(start) = decode(
        &TopicKind::Start,
        Value::Object(map.clone()).to_string().as_bytes(),
    ) else {
        panic!("the base start request decodes");
    };
    assert!(matches!(start, Inbound::Start(_)));
    let wrong = [json!([1]), json!({"x": []}), json!(-1.5), json!(u64::MAX)];
    let mut refusals = 0;
    for key in map.keys() {
        for value in &wrong {
            let mut changed: Map<String, Value> = map.clone();
            changed.insert(key.clone(), value.clone());
            match decode(
                &TopicKind::Start,
                Value::Object(changed).to_string().as_bytes(),
            ) {
                Ok(_) => {}
                Err(e) => {
                    refusals += 1;
                    assert_eq!(
                        e.key().map(top_level),
                        Some(key.as_str()),
                        "{key}={value}: {e}"
                    );
                }
            }
        }
    }
    // Metadata and parent results are free-form objects; every other key refuses something.
    assert!(refusals >= (map.len() - 2) * 2, "only {refusals} refusals");
}
