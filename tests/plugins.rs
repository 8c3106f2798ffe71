//! Tenant plugins through the real server: upload and validation, running a request's plugin
//! (preprocess, postprocess while streaming, on-token), hot swap, rollback, restarts, the CLI,
//! and adversarial plugins that fail only their own requests. The components are the SDK's
//! examples, built for wasm32-wasip2 by the test command.

mod common;

use hyper::Method;
use serde_json::{Value, json};
use sha2::Digest;
use warden::serve::client::{Client, Proto, Reply};

use common::{MODEL, Server, content, example, root, rt, sse_content};

/// A component whose one function keeps thousands of values live at once: seconds of register
/// allocation for a few hundred KB (quadratic in `n`).
fn slow_to_compile(n: usize) -> Vec<u8> {
    let mut body = String::new();
    for i in 2..n {
        body.push_str(&format!(
            "(local.set {i} (i64.mul (local.get {}) (local.get {})))",
            i - 1,
            i - 2
        ));
    }
    body.push_str("(loop $l ");
    for i in 0..n {
        body.push_str(&format!("(local.set 0 (i64.add (local.get 0) (local.get {i})))"));
    }
    body.push_str("(br_if $l (i64.eqz (local.get 0))))");
    let wat = format!(
        "(component (core module (func (param i64 i64) (result i64) (local {}) {body} (local.get 0))))",
        "i64 ".repeat(n)
    );
    wat::parse_str(&wat).expect("valid WAT")
}

fn sha(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

async fn call(c: &Client, method: Method, path: &str, key: &str, body: Option<Vec<u8>>) -> Reply {
    c.request(method, path, Some(key), body).await.expect("request")
}

async fn upload(c: &Client, key: &str, name: &str, bytes: Vec<u8>) -> Reply {
    call(c, Method::PUT, &format!("/v1/plugins/{name}"), key, Some(bytes)).await
}

fn chat(messages: Value, plugin: Option<&str>, max_tokens: usize, stream: bool) -> Vec<u8> {
    let mut v = json!({
        "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": stream,
    });
    if let Some(p) = plugin {
        v["plugin"] = json!(p);
    }
    v.to_string().into_bytes()
}

fn code(r: &Reply) -> String {
    r.json()
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_default()
}

const CONTACTS: &str = "Contact list:\nJohn Smith, john.smith@example.com, +1 555 123 4567\nJohn Smith,";

#[test]
fn plugins_upload_run_swap_roll_back_and_survive_a_restart() {
    let mut s = Server::start("plugins", "");
    let data_dir = s.data_dir.clone();
    let config = s.config.clone();
    let key = s.key().to_string();
    let sp = example("system_prompt");
    let pii = example("pii_redactor");
    let system = "You are a pirate. Answer in one short sentence.";
    let user = json!([{"role": "user", "content": "Where is the treasure?"}]);
    let with_system =
        json!([{"role": "system", "content": system}, {"role": "user", "content": "Where is the treasure?"}]);
    rt().block_on(async {
        let c = s.client();
        // Upload: 201 with the version's SHA-256; the same bytes again change nothing.
        let r = upload(&c, &key, "style", sp.clone()).await;
        assert_eq!(r.status, 201, "{}", r.text());
        let v = r.json().unwrap();
        assert_eq!(v["version"], json!(sha(&sp)));
        assert_eq!(v["plugin"]["active"], json!(sha(&sp)));
        let r = upload(&c, &key, "style", sp.clone()).await;
        assert_eq!((r.status, r.json().unwrap()["new"].clone()), (200, json!(false)));
        // Without a config the plugin refuses, with its own code.
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &key,
            Some(chat(user.clone(), Some("style"), 12, false)),
        )
        .await;
        assert_eq!((r.status, code(&r).as_str()), (400, "plugin_refused"), "{}", r.text());
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/style/config",
            &key,
            Some(system.as_bytes().to_vec()),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        // Preprocess: the plugin's system prompt gives exactly the answer an explicit one gives.
        let expected = content(
            &call(
                &c,
                Method::POST,
                "/v1/chat/completions",
                &key,
                Some(chat(with_system.clone(), None, 16, false)),
            )
            .await,
        );
        let plain = content(
            &call(
                &c,
                Method::POST,
                "/v1/chat/completions",
                &key,
                Some(chat(user.clone(), None, 16, false)),
            )
            .await,
        );
        assert_ne!(
            expected, plain,
            "the system prompt changes the answer, so the check below means something"
        );
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &key,
            Some(chat(user.clone(), Some("style"), 16, false)),
        )
        .await;
        assert_eq!(content(&r), expected, "{}", r.text());
        // As the tenant's default, it runs for requests that name no plugin; streamed too.
        let r = call(&c, Method::PUT, "/v1/plugins/style/default", &key, None).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &key,
            Some(chat(user.clone(), None, 16, true)),
        )
        .await;
        assert_eq!(sse_content(&r.text()), expected);
        // Hot swap: a new version (here the redactor) runs from the next request on.
        let r = upload(&c, &key, "style", pii.clone()).await;
        assert_eq!(r.status, 201, "{}", r.text());
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &key,
            Some(chat(user.clone(), None, 16, false)),
        )
        .await;
        assert_eq!(content(&r), plain, "the redactor leaves a reply without PII alone");
        // Rollback returns to the system-prompt version.
        let r = call(&c, Method::POST, "/v1/plugins/style/rollback", &key, None).await;
        assert_eq!(r.json().unwrap()["active"], json!(sha(&sp)), "{}", r.text());
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &key,
            Some(chat(user.clone(), None, 16, false)),
        )
        .await;
        assert_eq!(content(&r), expected);
        // The configuration is versioned with the component: one more rollback returns to the
        // system-prompt version as it was before its config was set, and it refuses again.
        let r = call(&c, Method::POST, "/v1/plugins/style/rollback", &key, None).await;
        let v = r.json().unwrap();
        assert_eq!((&v["active"], &v["config_bytes"]), (&json!(sha(&sp)), &json!(0)), "{v}");
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &key,
            Some(chat(user.clone(), None, 16, false)),
        )
        .await;
        assert_eq!((r.status, code(&r).as_str()), (400, "plugin_refused"), "{}", r.text());
        let r = call(&c, Method::POST, "/v1/plugins/style/rollback", &key, None).await;
        assert_eq!((r.status, code(&r).as_str()), (409, "nothing_to_roll_back"));
        // A configuration the active version refuses in its smoke call is refused, naming the
        // plugin's own code, and changes nothing.
        let r = call(&c, Method::PUT, "/v1/plugins/style/config", &key, Some(b"  ".to_vec())).await;
        assert_eq!(
            (r.status, code(&r).as_str()),
            (400, "plugin_config_rejected"),
            "{}",
            r.text()
        );
        assert!(
            r.text().contains("(plugin_config): system_prompt needs"),
            "{}",
            r.text()
        );
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/style/config",
            &key,
            Some(system.as_bytes().to_vec()),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        // Activate by prefix; the active version cannot be deleted, an inactive one can.
        let body = json!({"version": &sha(&pii)[..12]}).to_string().into_bytes();
        let r = call(&c, Method::POST, "/v1/plugins/style/activate", &key, Some(body)).await;
        assert_eq!(r.json().unwrap()["active"], json!(sha(&pii)), "{}", r.text());
        let r = call(
            &c,
            Method::DELETE,
            &format!("/v1/plugins/style/versions/{}", sha(&pii)),
            &key,
            None,
        )
        .await;
        assert_eq!((r.status, code(&r).as_str()), (409, "version_active"));
        let body = json!({"version": sha(&sp)}).to_string().into_bytes();
        call(&c, Method::POST, "/v1/plugins/style/activate", &key, Some(body)).await;
        let r = call(
            &c,
            Method::DELETE,
            &format!("/v1/plugins/style/versions/{}", sha(&pii)),
            &key,
            None,
        )
        .await;
        assert_eq!(
            r.json().unwrap()["versions"].as_array().map(Vec::len),
            Some(1),
            "{}",
            r.text()
        );
        // Another tenant sees none of it, and cannot name it.
        let other = s.tenant_with_key("other").await;
        let r = call(&c, Method::GET, "/v1/plugins", &other, None).await;
        assert_eq!(r.json().unwrap()["data"], json!([]));
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &other,
            Some(chat(user.clone(), Some("style"), 4, false)),
        )
        .await;
        assert_eq!((r.status, code(&r).as_str()), (404, "plugin_not_found"));
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &other,
            Some(chat(user.clone(), None, 16, false)),
        )
        .await;
        assert_eq!(content(&r), plain, "the other tenant's requests run no plugin");
    });
    assert!(s.stop(), "clean shutdown");
    // A tampered compile in the cache (a version's, or a pre-initialised one's) is not loaded:
    // it is recompiled from the stored bytes.
    let cache = data_dir.join("data/plugin-cache");
    let mut tampered = 0;
    let mut dirs = vec![cache];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).expect("the plugin cache exists") {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
                continue;
            }
            let mut b = std::fs::read(&p).unwrap();
            let n = b.len();
            b[n - 100] ^= 0xff;
            std::fs::write(&p, b).unwrap();
            tampered += 1;
        }
    }
    assert!(tampered >= 1);
    let s = Server::start_with(data_dir, config);
    rt().block_on(async {
        let c = s.client();
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &key,
            Some(chat(user.clone(), None, 16, false)),
        )
        .await;
        let expected = content(
            &call(
                &c,
                Method::POST,
                "/v1/chat/completions",
                &key,
                Some(chat(with_system, Some("style"), 16, false)),
            )
            .await,
        );
        assert_eq!(
            content(&r),
            expected,
            "the default plugin and its config survive the restart: {}",
            r.text()
        );
    });
}

#[test]
fn the_redactor_holds_pii_back_across_stream_chunks_and_the_guard_stops_generation() {
    let s = Server::start("plugout", "");
    let key = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        assert_eq!(upload(&c, &key, "pii", example("pii_redactor")).await.status, 201);
        assert_eq!(upload(&c, &key, "json", example("json_guard")).await.status, 201);
        let completion = |plugin: Option<&str>, stream: bool, max_tokens: usize| {
            let mut v = json!({"model": MODEL, "prompt": CONTACTS, "temperature": 0, "max_tokens": max_tokens, "stream": stream});
            if let Some(p) = plugin {
                v["plugin"] = json!(p);
            }
            v.to_string().into_bytes()
        };
        let text = |r: &Reply| r.json().unwrap()["choices"][0]["text"].as_str().unwrap_or_default().to_string();
        let plain = text(&call(&c, Method::POST, "/v1/completions", &key, Some(completion(None, false, 48))).await);
        assert!(plain.contains("@example.com") && plain.contains("555 123 4567"), "the model repeats the PII: {plain:?}");
        let r = call(&c, Method::POST, "/v1/completions", &key, Some(completion(Some("pii"), false, 48))).await;
        let redacted = text(&r);
        assert!(redacted.contains("[EMAIL]") && redacted.contains("[PHONE]"), "{redacted:?}");
        assert!(!redacted.contains("@example.com") && !redacted.contains("555 123"), "{redacted:?}");
        // Streamed: no chunk, and no prefix of the stream, carries a fragment of the PII.
        let r = call(&c, Method::POST, "/v1/completions", &key, Some(completion(Some("pii"), true, 48))).await;
        let sse = r.text();
        let mut so_far = String::new();
        let mut chunks = 0;
        for d in sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
            let v: Value = serde_json::from_str(d).unwrap();
            so_far.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
            chunks += 1;
            for frag in ["@example", "555 1", "123 4567", "smith@"] {
                assert!(!so_far.contains(frag), "{so_far:?}");
            }
        }
        assert!(chunks >= 2, "{sse}");
        assert_eq!(so_far, redacted, "streamed and whole replies agree");
        // What the redactor logged reaches the tenant's plugin log, one line per call.
        let r = call(&c, Method::GET, "/v1/plugins/pii/logs", &key, None).await;
        let lines = r.json().unwrap()["data"].clone();
        let lines: Vec<&str> = lines
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|l| l.as_str())
            .filter(|l| !l.contains(" init "))
            .collect();
        assert_eq!(lines.len(), 2, "one line per redacting request: {lines:?}");
        // As many items as the reply held (the same in both: streamed and whole replies agree),
        // and at least the email and the phone number.
        let counts: Vec<usize> = lines
            .iter()
            .filter(|l| l.contains(" pii@"))
            .filter_map(|l| l.strip_suffix(" items")?.rsplit_once("info: redacted ")?.1.parse().ok())
            .collect();
        assert!(counts.len() == 2 && counts[0] == counts[1] && counts[0] >= 2, "{lines:?}");
        // The JSON guard (0.2.0) steers: every token, the first included, keeps the reply the
        // start of a JSON object (its config says object), and it stops once the object is
        // complete, even to a question that asks for none.
        let r = call(&c, Method::PUT, "/v1/plugins/json/config", &key, Some(b"object".to_vec())).await;
        assert_eq!(r.status, 200, "{}", r.text());
        for stream in [false, true] {
            let body = chat(json!([{"role": "user", "content": "Say hello."}]), Some("json"), 64, stream);
            let r = call(&c, Method::POST, "/v1/chat/completions", &key, Some(body)).await;
            assert_eq!(r.status, 200, "{}", r.text());
            let (reply, finish) = if stream {
                let finish = r
                    .text()
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                    .find_map(|v| v["choices"][0]["finish_reason"].as_str().map(String::from));
                (sse_content(&r.text()), finish.unwrap_or_default())
            } else {
                let v = r.json().unwrap();
                let finish = v["choices"][0]["finish_reason"].as_str().unwrap_or_default().to_string();
                (content(&r), finish)
            };
            assert!(reply.trim_start().starts_with('{'), "{reply:?}");
            if finish == "stop" {
                let v: Value = serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{reply:?}: {e}"));
                assert!(v.is_object(), "{reply:?}");
            } else {
                assert_eq!(finish, "length", "{reply:?}");
            }
        }
        // Its pages went back: nothing is left running.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert_eq!(s.metric("warden_running_sequences").await, 0.0);
        assert_eq!(s.metric("warden_kv_pages{state=\"used\"}").await, 0.0);
    });
}

#[test]
fn adversarial_plugins_fail_only_their_own_requests() {
    let s = Server::start(
        "plugadv",
        "[plugins]\ncall_timeout_ms = 250\nmemory_mib = 32\ncompile_timeout_s = 1\nuploads_per_minute = 5\n",
    );
    let key = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        let mallory = s.tenant_with_key("mallory").await;
        // Bad uploads are refused with what was wrong.
        for (bytes, why) in [
            (b"not wasm".to_vec(), "garbage"),
            (b"\0asm\x01\0\0\0".to_vec(), "a core module, not a component"),
        ] {
            let r = upload(&c, &mallory, "bad", bytes).await;
            assert_eq!(
                (r.status, code(&r).as_str()),
                (400, "plugin_invalid"),
                "{why}: {}",
                r.text()
            );
        }
        let r = upload(&c, &mallory, "BadName", example("adversary")).await;
        assert_eq!(r.status, 400);
        assert_eq!(upload(&c, &mallory, "adv", example("adversary")).await.status, 201);
        // Compiling is bounded: a component slow to compile is stopped at the limit (1 s here).
        let t0 = std::time::Instant::now();
        let r = upload(&c, &mallory, "slow", slow_to_compile(12_000)).await;
        assert_eq!(
            (r.status, code(&r).as_str()),
            (400, "component_compile_timeout"),
            "{}",
            r.text()
        );
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{:?}", t0.elapsed());
        // One component may not take the instance slots of many.
        let memories = wat::parse_str(
            "(component (core module $m (memory 1) (memory 1) (memory 1)) (core instance (instantiate $m)))",
        )
        .unwrap();
        let r = upload(&c, &mallory, "greedy", memories).await;
        assert_eq!(
            (r.status, code(&r).as_str()),
            (400, "component_over_limits"),
            "{}",
            r.text()
        );
        assert!(r.text().contains("memories count of 3"), "{}", r.text());
        // Five new versions a minute here (the two refused at compile counted): the sixth waits.
        let r = upload(&c, &mallory, "another", example("system_prompt")).await;
        assert_eq!(
            (r.status, code(&r).as_str()),
            (429, "upload_rate_limit"),
            "{}",
            r.text()
        );
        assert!(r.headers.get("retry-after").is_some());
        // A version it has already uploaded costs no compile and passes.
        assert_eq!(upload(&c, &mallory, "adv", example("adversary")).await.status, 200);
        let user = json!([{"role": "user", "content": "Write a poem about the sea."}]);
        let baseline = content(
            &call(
                &c,
                Method::POST,
                "/v1/chat/completions",
                &key,
                Some(chat(user.clone(), None, 24, false)),
            )
            .await,
        );
        let attacks = [
            ("loop", "plugin_timeout"),
            ("bomb", "plugin_out_of_memory"),
            ("recurse", "plugin_trap"),
            ("trap", "plugin_trap"),
            ("huge", "plugin_out_of_memory"),
            // What the guest returns is bounded before the host tokenizes or sends it.
            ("big", "plugin_output_too_large"),
            ("many", "plugin_output_too_large"),
            ("flood", "plugin_output_too_large"),
            // Host calls: over their input limit, or charged until the fuel runs out.
            ("encode-huge", "plugin_host_call_too_large"),
            ("encode-loop", "plugin_fuel_exhausted"),
            // Steering: a constraint that leaves no token, or names one outside the vocabulary.
            ("constrain-nothing", "plugin_constraint_allows_no_token"),
            ("constrain-outside", "plugin_constraint_invalid"),
        ];
        for (attack, expected) in attacks {
            let r = call(
                &c,
                Method::PUT,
                "/v1/plugins/adv/config",
                &mallory,
                Some(attack.as_bytes().to_vec()),
            )
            .await;
            assert_eq!(r.status, 200);
            // The attack and an innocent tenant's stream run at the same time.
            let bad = call(
                &c,
                Method::POST,
                "/v1/chat/completions",
                &mallory,
                Some(chat(user.clone(), Some("adv"), 8, false)),
            );
            let good = c.request_proto(
                Proto::Http2,
                Method::POST,
                "/v1/chat/completions",
                Some(&key),
                Some(chat(user.clone(), None, 24, true)),
            );
            let (bad, good) = tokio::join!(bad, good);
            let good = good.expect("good request");
            assert!(bad.status >= 500, "{attack}: {}", bad.text());
            let got = code(&bad);
            assert!(
                got == expected || (attack == "loop" && got == "plugin_fuel_exhausted"),
                "{attack}: {got} ({})",
                bad.text()
            );
            assert_eq!(
                sse_content(&good.text()),
                baseline,
                "{attack}: the other tenant's output is unchanged"
            );
        }
        // Sleeping on the host's clock holds nothing: the clock is frozen and the sleep returns.
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/adv/config",
            &mallory,
            Some(b"sleep-forever".to_vec()),
        )
        .await;
        assert_eq!(r.status, 200);
        let t0 = std::time::Instant::now();
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &mallory,
            Some(chat(user.clone(), Some("adv"), 8, false)),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "{:?}", t0.elapsed());
        let m = s.metrics().await;
        for code in ["plugin_out_of_memory", "plugin_trap"] {
            assert!(
                m.contains(&format!(
                    "warden_plugin_failures_total{{tenant=\"mallory\",code=\"{code}\"}}"
                )),
                "{code} counted:\n{m}"
            );
        }
        assert_eq!(s.metric("warden_isolation_violations_total").await, 0.0);
        // And the tenant's own plugin works again once its config is benign.
        call(
            &c,
            Method::PUT,
            "/v1/plugins/adv/config",
            &mallory,
            Some(b"pass".to_vec()),
        )
        .await;
        let r = call(
            &c,
            Method::POST,
            "/v1/chat/completions",
            &mallory,
            Some(chat(user.clone(), Some("adv"), 24, false)),
        )
        .await;
        assert_eq!(content(&r), baseline, "{}", r.text());
    });
}

/// `warden plugin test` runs a component on one request with the real model and prints every
/// stage; a plugin that fails says where and how, with a failing exit status.
#[test]
fn plugin_test_runs_a_component_locally_and_prints_each_stage() {
    let dir = std::env::temp_dir().join(format!("warden-plugin-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let request = dir.join("request.json");
    std::fs::write(
        &request,
        r#"{"model":"m","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":6,"temperature":0}"#,
    )
    .unwrap();
    let run = |plugin: &str, config: Option<&str>| {
        let wasm = root().join(format!("guest-sdk/target/wasm32-wasip2/release/examples/{plugin}.wasm"));
        let mut cmd = std::process::Command::new(common::warden_bin());
        cmd.args(["plugin", "test"])
            .arg(&wasm)
            .arg("--request")
            .arg(&request)
            .arg("--model")
            .arg(common::model());
        if let Some(c) = config {
            let f = dir.join(format!("{plugin}.cfg"));
            std::fs::write(&f, c).unwrap();
            cmd.arg("--plugin-config").arg(f);
        }
        let out = cmd.output().expect("run warden plugin test");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = run("system_prompt", Some("Answer in French."));
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[..3],
        [
            "world: warden:plugin@0.2.0",
            "init: pre-initialised: requests start from its state",
            "capabilities: on-token=false"
        ]
    );
    assert!(
        lines[3].starts_with("preprocess <- ") && !lines[3].contains("Answer in French.\"}"),
        "{out}"
    );
    assert!(
        lines[4].contains(r#"{"role":"system","content":"Answer in French."}"#),
        "the rewritten request shows the plugin's system prompt: {out}"
    );
    assert_eq!(lines.iter().filter(|l| l.starts_with("token ")).count(), 6, "{out}");
    assert!(
        out.contains("finish: length, ") && out.contains("\noutput: \""),
        "{out}"
    );
    // on-token's actions: the JSON guard constrains the first token and each next one.
    let (ok, out, err) = run("json_guard", Some("object"));
    assert!(ok, "{err}");
    assert!(
        out.contains("capabilities: on-token=true") && out.contains("first token: constrain (allowed: "),
        "{out}"
    );
    assert!(out.contains("-> constrain (allowed: "), "{out}");
    // An init that keeps its stdout stream cannot be captured: it says why, and runs as before.
    let (ok, out, err) = run("adversary", Some("print-in-init"));
    assert!(ok, "{err}");
    assert!(out.contains("log: stdout: initialising\n"), "{out}");
    assert!(
        out.contains("init: runs on every request: init kept a host resource"),
        "{out}"
    );
    // A 0.1.0 component runs as it did.
    let (ok, out, err) = run("legacy_v0_1", Some("Answer in French."));
    assert!(ok, "{err}");
    assert!(out.starts_with("world: warden:plugin@0.1.0\n"), "{out}");
    let output = out.lines().find_map(|l| l.strip_prefix("output: ")).unwrap_or_default();
    assert!(output.len() > 2 && output == output.to_uppercase(), "{out}");
    // What the plugin prints is in the report; a failure names its stage and code.
    let (ok, out, _) = run("adversary", Some("print"));
    assert!(
        ok && out.contains("log: stdout: to stdout") && out.contains("log: stderr: to stderr"),
        "{out}"
    );
    let (ok, _, err) = run("adversary", Some("trap"));
    assert!(!ok, "a trapping plugin fails the run");
    assert!(err.contains("the plugin failed in preprocess (plugin_trap)"), "{err}");
    // The model as `warden serve --config` finds it, from any working directory; a missing
    // one is said once.
    let _ = std::fs::remove_file(dir.join("m.gguf"));
    std::os::unix::fs::symlink(common::model(), dir.join("m.gguf")).unwrap();
    std::fs::write(dir.join("w.toml"), "model = \"m.gguf\"\n").unwrap();
    let wasm = root().join("guest-sdk/target/wasm32-wasip2/release/examples/system_prompt.wasm");
    let from_root = |extra: &[&str]| {
        std::process::Command::new(common::warden_bin())
            .args(["plugin", "test"])
            .arg(&wasm)
            .arg("--request")
            .arg(&request)
            .arg("--config")
            .arg(dir.join("w.toml"))
            .arg("--plugin-config")
            .arg(dir.join("system_prompt.cfg"))
            .args(extra)
            .current_dir("/")
            .output()
            .expect("run warden plugin test")
    };
    let out = from_root(&[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = from_root(&["--model", "/nowhere/m.gguf"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.matches("/nowhere/m.gguf").count() == 1,
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_cli_manages_plugins_beside_a_running_server() {
    let s = Server::start("plugcli", "");
    let file = root().join("guest-sdk/target/wasm32-wasip2/release/examples/system_prompt.wasm");
    let text = |args: &[&str]| {
        let out = std::process::Command::new(common::warden_bin())
            .args(["plugin"])
            .args(args)
            .arg("--config")
            .arg(&s.config)
            .output()
            .expect("run warden plugin");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let cli = |args: &[&str]| serde_json::from_str::<Value>(&text(args)).expect("json");
    let v = cli(&["upload", "greeter", file.to_str().unwrap()]);
    assert_eq!(v["version"], json!(sha(&example("system_prompt"))));
    let v = cli(&["list", "--json"]);
    assert_eq!(v["data"][0]["name"], json!("greeter"));
    // For people: a line a plugin, times in RFC 3339.
    let listed = text(&["list"]);
    assert!(
        listed.starts_with("greeter\tactive ") && listed.contains("(uploaded 20") && listed.contains("Z)\t1 version"),
        "{listed}"
    );
    // A plugin's log lines, through the running server.
    let adv = root().join("guest-sdk/target/wasm32-wasip2/release/examples/adversary.wasm");
    cli(&["upload", "adv", adv.to_str().unwrap()]);
    std::fs::write(s.data_dir.join("adv.txt"), "print").unwrap();
    cli(&["config", "adv", s.data_dir.join("adv.txt").to_str().unwrap()]);
    // A completion through it: its request id.
    let through_adv = || {
        rt().block_on(async {
            let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "plugin": "adv"});
            let r = s
                .client()
                .request(
                    Method::POST,
                    "/v1/completions",
                    Some(s.key()),
                    Some(body.to_string().into_bytes()),
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            r.headers["x-request-id"].to_str().unwrap().to_string()
        })
    };
    through_adv();
    let logs = text(&["logs", "adv"]);
    let line = logs
        .lines()
        .find(|l| l.contains("to stdout"))
        .unwrap_or_else(|| panic!("{logs}"));
    // `2026-12-07T04:56:53Z adv@<version> <request id> stdout: to stdout...`
    let at = line.split(' ').next().unwrap();
    assert!(
        at.len() == 20 && at.ends_with('Z') && at.as_bytes()[10] == b'T',
        "{line}"
    );
    assert!(line.split(' ').nth(1).unwrap().starts_with("adv@"), "{line}");
    assert!(text(&["logs", "greeter"]).trim().is_empty(), "another plugin's lines");
    // --follow prints what is there, then each new line as it comes.
    let mut follow = std::process::Command::new(common::warden_bin())
        .args(["plugin", "logs", "adv", "--follow", "--config"])
        .arg(&s.config)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = follow.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let first = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the lines already there");
    assert!(first.contains(" adv@"), "{first}");
    while rx.recv_timeout(std::time::Duration::from_millis(500)).is_ok() {}
    let id = through_adv();
    let new = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("a new line, followed");
    assert!(new.contains(&id), "the new request's line: {new}");
    let _ = follow.kill();
    let _ = follow.wait();
    cli(&["delete", "adv"]);
    let cfg = s.data_dir.join("greeter.txt");
    std::fs::write(&cfg, "Be brief.").unwrap();
    assert_eq!(
        cli(&["config", "greeter", cfg.to_str().unwrap()])["config_bytes"],
        json!(9)
    );
    assert_eq!(cli(&["default", "greeter"])["default"], json!("greeter"));
    assert_eq!(cli(&["delete", "greeter"])["deleted"], json!("greeter"));
    assert_eq!(cli(&["list", "--json"])["data"], json!([]));
}

#[test]
fn kv_handles_show_a_plugin_only_its_own_pages_and_forged_ones_trap() {
    let s = Server::start("plugkv", "");
    let key = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        let mallory = s.tenant_with_key("mallory").await;
        assert_eq!(upload(&c, &mallory, "adv", example("adversary")).await.status, 201);
        let set = |cfg: &str| call(&c, Method::PUT, "/v1/plugins/adv/config", &mallory, Some(cfg.as_bytes().to_vec()));
        let completion = |plugin: Option<&str>| {
            let mut v = json!({"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. Once upon a time", "temperature": 0, "max_tokens": 12});
            if let Some(p) = plugin {
                v["plugin"] = json!(p);
            }
            v.to_string().into_bytes()
        };
        let text = |r: &Reply| r.json().unwrap()["choices"][0]["text"].as_str().unwrap_or_default().to_string();
        let baseline = text(&call(&c, Method::POST, "/v1/completions", &key, Some(completion(None))).await);
        // Its own pages: as many as its written tokens need, and no fewer tokens than its prompt.
        assert_eq!(set("kv").await.status, 200);
        let r = call(&c, Method::POST, "/v1/completions", &mallory, Some(completion(Some("adv")))).await;
        let v = r.json().unwrap();
        let t = text(&r);
        let report = t.split("[kv pages=").nth(1).unwrap_or_else(|| panic!("{t:?}"));
        let report = report.split(']').next().unwrap_or_default();
        let (pages, written) = report.split_once(" written=").expect("report");
        let (pages, written): (u64, u64) = (pages.parse().unwrap(), written.parse().unwrap());
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let total = prompt + v["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(written >= prompt && written <= total, "{t:?} prompt {prompt} total {total}");
        eprintln!("own KV as the plugin saw it: {report}; prompt {prompt}, total {total}");
        // Epochs are the request's own numbering: nothing of the pages' earlier lives (other
        // tenants' included) shows through.
        let epochs = t.split("[epochs ").nth(1).and_then(|e| e.split(']').next()).unwrap_or_default();
        let expected: Vec<String> = (1..=pages).map(|e| e.to_string()).collect();
        assert_eq!(epochs, expected.join(","), "{t:?}");
        assert!(
            pages >= written.div_ceil(16) && pages <= total.div_ceil(16),
            "{t:?}: {pages} pages"
        );
        // Forged handle numbers trap, whatever the number; the innocent tenant is unaffected.
        for forged in ["forge-page:0", "forge-page:1", "forge-page:2", "forge-page:4294967295", "forge-seq:1", "forge-seq:3"] {
            assert_eq!(set(forged).await.status, 200);
            let bad = call(&c, Method::POST, "/v1/completions", &mallory, Some(completion(Some("adv"))));
            let good = call(&c, Method::POST, "/v1/completions", &key, Some(completion(None)));
            let (bad, good) = tokio::join!(bad, good);
            assert_eq!((bad.status, code(&bad).as_str()), (500, "plugin_trap"), "{forged}: {}", bad.text());
            assert!(bad.text().contains("handle"), "{forged}: the trap names the handle: {}", bad.text());
            assert_eq!(text(&good), baseline, "{forged}");
        }
        // A handle kept in a static does not survive into the next request.
        assert_eq!(set("keep").await.status, 200);
        for _ in 0..2 {
            let r = call(&c, Method::POST, "/v1/completions", &mallory, Some(completion(Some("adv")))).await;
            let t = text(&r);
            assert!(t.contains("[kept handle ") && !t.contains("reused"), "{t:?}");
        }
        assert_eq!(s.metric("warden_isolation_violations_total").await, 0.0);
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert_eq!(s.metric("warden_kv_pages{state=\"used\"}").await, 0.0);
    });
}

#[test]
fn one_tenant_cannot_take_the_plugin_instances_or_the_request_threads_of_others() {
    // Four instances in all, two per tenant.
    let s = Server::start("plugshare", "[plugins]\ninstances = 4\ntenant_instances = 2\n");
    let key = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        let mallory = s.tenant_with_key("mallory").await;
        for k in [&key, &mallory] {
            assert_eq!(upload(&c, k, "adv", example("adversary")).await.status, 201);
            let r = call(&c, Method::PUT, "/v1/plugins/adv/config", k, Some(b"pass".to_vec())).await;
            assert_eq!(r.status, 200);
        }
        // Pre-initialising each plugin (once with the upload's config, once with this one)
        // holds one of its own tenant's instances for a moment: let it finish first.
        for k in [&key, &mallory] {
            wait_for_init_lines(&c, k, "adv", 2).await;
        }
        let user = json!([{"role": "user", "content": "Write a poem about the sea."}]);
        let with_n = |n: usize| {
            let mut v: Value = serde_json::from_slice(&chat(user.clone(), Some("adv"), 32, false)).unwrap();
            v["n"] = json!(n);
            v["temperature"] = json!(1);
            v.to_string().into_bytes()
        };
        // One request over the tenant's share: 429, with Retry-After.
        let r = call(&c, Method::POST, "/v1/chat/completions", &mallory, Some(with_n(3))).await;
        assert_eq!(
            (r.status, code(&r).as_str()),
            (429, "plugin_instances_limit"),
            "{}",
            r.text()
        );
        // Mallory floods with requests of two choices each; the other tenant's requests, each
        // needing two instances too, always find them.
        let flood: Vec<_> = (0..8)
            .map(|_| {
                let (c, k, body) = (c.clone(), mallory.clone(), with_n(2));
                tokio::spawn(async move { call(&c, Method::POST, "/v1/chat/completions", &k, Some(body)).await })
            })
            .collect();
        for _ in 0..4 {
            let r = call(&c, Method::POST, "/v1/chat/completions", &key, Some(with_n(2))).await;
            assert_eq!(r.status, 200, "the other tenant is never refused: {}", r.text());
        }
        let mut refused = 0;
        for f in flood {
            let r = f.await.unwrap();
            match r.status {
                200 => {}
                429 => {
                    assert_eq!(code(&r), "plugin_instances_limit", "{}", r.text());
                    refused += 1;
                }
                other => panic!("mallory got {other}: {}", r.text()),
            }
        }
        assert!(refused > 0, "mallory's flood went past its share");
        // Tokenizer calls run off the request threads: while mallory's plugins tokenize as hard as
        // they can, another tenant's health check and requests are answered promptly.
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/adv/config",
            &mallory,
            Some(b"encode-loop".to_vec()),
        )
        .await;
        assert_eq!(r.status, 200);
        let attack: Vec<_> = (0..2)
            .map(|_| {
                let (c, k, body) = (c.clone(), mallory.clone(), with_n(1));
                tokio::spawn(async move {
                    for _ in 0..5 {
                        let r = call(&c, Method::POST, "/v1/chat/completions", &k, Some(body.clone())).await;
                        assert_eq!(code(&r), "plugin_fuel_exhausted", "{}", r.text());
                    }
                })
            })
            .collect();
        let mut worst = std::time::Duration::ZERO;
        for _ in 0..10 {
            let t0 = std::time::Instant::now();
            let r = c.request(Method::GET, "/healthz", None, None).await.expect("healthz");
            assert_eq!(r.status, 200);
            worst = worst.max(t0.elapsed());
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        for a in attack {
            a.await.unwrap();
        }
        eprintln!("slowest /healthz under the tokenizer attack: {worst:?}");
        assert!(worst < std::time::Duration::from_secs(1), "{worst:?}");
        // Every instance came back.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let r = call(&c, Method::POST, "/v1/chat/completions", &mallory, Some(with_n(2))).await;
        assert_eq!(code(&r), "plugin_fuel_exhausted", "{}", r.text());
    });
}

/// A long shared system prompt: several KV pages of tokens.
const ASSISTANT: &str = "You are the support assistant of Northwind Outfitters, a shop for hiking, camping and climbing gear. \
Answer in one short sentence. Be friendly and precise. Never promise delivery dates, prices or discounts; point the \
customer to the order page for those. If a question is about safety in the mountains, remind the customer to check \
the weather forecast and to tell someone where they are going. Do not discuss competitors.";

#[test]
fn the_prefix_pinning_plugin_pins_its_tenants_prompt_and_only_that_tenant_hits_it() {
    let s = Server::start("plugpin", "");
    let key = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        let other = s.tenant_with_key("other").await;
        for k in [&key, &other] {
            assert_eq!(upload(&c, k, "pin", example("prefix_pin")).await.status, 201);
            let r = call(
                &c,
                Method::PUT,
                "/v1/plugins/pin/config",
                k,
                Some(ASSISTANT.as_bytes().to_vec()),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
        let ask = |k: String, q: &str| {
            let body = chat(json!([{"role": "user", "content": q}]), Some("pin"), 8, false);
            let c = c.clone();
            async move {
                let r = call(&c, Method::POST, "/v1/chat/completions", &k, Some(body)).await;
                assert_eq!(r.status, 200, "{}", r.text());
                let v = r.json().unwrap();
                (
                    content(&r),
                    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
                )
            }
        };
        let logs = |k: String| {
            let c = c.clone();
            async move {
                let r = call(&c, Method::GET, "/v1/plugins/pin/logs", &k, None).await;
                // What the plugin logged on requests (pre-initialising it logs under "init").
                r.json().unwrap()["data"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|l| l.as_str().unwrap().to_string())
                    .filter(|l| !l.contains(" init "))
                    .collect::<Vec<_>>()
            }
        };
        let (_, cached) = ask(key.clone(), "Do you sell tents?").await;
        assert_eq!(cached, 0, "nothing is cached yet");
        let pinned_line = logs(key.clone()).await.pop().unwrap_or_default();
        let pinned: u64 = pinned_line
            .rsplit("pinned ")
            .next()
            .and_then(|r| r.strip_suffix(" tokens"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("the plugin logs what it pinned: {pinned_line:?}"));
        assert!(pinned >= 64 && pinned.is_multiple_of(16), "{pinned}");
        assert_eq!(s.metric("warden_kv_pinned_pages").await, (pinned / 16) as f64);
        // The tenant's next request starts with the pinned prompt and skips computing it.
        let (warm, cached) = ask(key.clone(), "Where is my order?").await;
        assert!(cached >= pinned, "{cached} cached tokens, {pinned} pinned");
        // Another tenant with the same plugin, config and question shares nothing (invariant 5):
        // it computes everything itself, and gets the same answer.
        let (cold, cached) = ask(other.clone(), "Where is my order?").await;
        assert_eq!(cached, 0, "another tenant's prefix cache is never read");
        assert_eq!(cold, warm, "cached KV gives the same greedy output");
        assert_eq!(s.metric("warden_kv_pinned_pages").await, (2 * pinned / 16) as f64);
        assert!(s.metric("warden_prefix_cache_hit_tokens_total").await >= pinned as f64);
        // The unpin config releases the tenant's pin, and only its own.
        let unpin = format!("#unpin\n{ASSISTANT}");
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/pin/config",
            &key,
            Some(unpin.into_bytes()),
        )
        .await;
        assert_eq!(r.status, 200);
        ask(key.clone(), "Do you sell ropes?").await;
        let line = logs(key.clone()).await.pop().unwrap_or_default();
        assert!(
            line.ends_with(&format!("info: unpinned {} pages", pinned / 16)),
            "{line:?}"
        );
        assert_eq!(s.metric("warden_kv_pinned_pages").await, (pinned / 16) as f64);
        // Deleting a tenant drops its prefix cache, pins included.
        let r = c
            .request(Method::DELETE, "/admin/v1/tenants/other", Some(&s.admin), None)
            .await
            .expect("delete");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(s.metric("warden_kv_pinned_pages").await, 0.0);
        assert_eq!(s.metric("warden_isolation_violations_total").await, 0.0);
    });
}

#[test]
fn a_tenants_policy_sets_its_plugin_limits_and_usage_counts_plugin_fuel() {
    let s = Server::start_with_policies(
        "plugpolicy",
        "",
        &[("tenants/tight.toml", "[plugins]\nfuel_per_call = 2000\n")],
    );
    let key = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        let tight = s.tenant_with_key("tight").await;
        for k in [&key, &tight] {
            assert_eq!(upload(&c, k, "sp", example("system_prompt")).await.status, 201);
            let r = call(
                &c,
                Method::PUT,
                "/v1/plugins/sp/config",
                k,
                Some(b"Answer briefly.".to_vec()),
            )
            .await;
            assert_eq!(r.status, 200);
        }
        let body = chat(json!([{"role": "user", "content": "Hi."}]), Some("sp"), 4, false);
        let r = call(&c, Method::POST, "/v1/chat/completions", &tight, Some(body.clone())).await;
        assert_eq!(
            (r.status, code(&r).as_str()),
            (500, "plugin_fuel_exhausted"),
            "{}",
            r.text()
        );
        assert!(r.text().contains("2000"), "names the tenant's limit: {}", r.text());
        let r = call(&c, Method::POST, "/v1/chat/completions", &key, Some(body)).await;
        assert_eq!(r.status, 200, "the server's limits apply to the others: {}", r.text());
        let u = call(&c, Method::GET, "/v1/usage", &key, None).await.json().unwrap();
        assert!(u["plugin_fuel"].as_u64().unwrap() > 2000, "{u}");
        assert_eq!(u["requests"], 1);
        let u = call(&c, Method::GET, "/v1/usage", &tight, None).await.json().unwrap();
        assert_eq!(u["rejections"]["plugin_fuel_exhausted"], 1, "{u}");
    });
}

/// The lines of plugin `name`'s log that pre-initialising it wrote (request `init`).
async fn init_lines(c: &Client, key: &str, name: &str) -> Vec<String> {
    let r = call(c, Method::GET, &format!("/v1/plugins/{name}/logs"), key, None).await;
    r.json().unwrap()["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str())
        .filter(|l| l.contains(" init "))
        .map(str::to_string)
        .collect()
}

/// Waits (up to two minutes: two compiles on a loaded machine) until plugin `name`'s log has
/// `n` lines from pre-initialising it, and returns them.
async fn wait_for_init_lines(c: &Client, key: &str, name: &str, n: usize) -> Vec<String> {
    for _ in 0..1200 {
        let lines = init_lines(c, key, name).await;
        if lines.len() >= n {
            return lines;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!(
        "no pre-initialisation of {name} logged: {:?}",
        init_lines(c, key, name).await
    );
}

#[test]
fn a_plugin_is_initialised_once_per_configuration_and_requests_start_from_there() {
    let s = Server::start("plugsnap", "");
    let key = s.key().to_string();
    let ask = |word: &str| {
        chat(
            json!([{"role": "user", "content": format!("Is {word} a word?")}]),
            Some("filter"),
            4,
            false,
        )
    };
    rt().block_on(async {
        let c = s.client();
        assert_eq!(upload(&c, &key, "filter", example("regex_filter")).await.status, 201);
        // The upload's empty configuration is one the filter runs with: it is pre-initialised.
        let lines = wait_for_init_lines(&c, &key, "filter", 1).await;
        assert!(lines[0].ends_with("requests start from init's state"), "{lines:?}");
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/filter/config",
            &key,
            Some(b"deny: banana".to_vec()),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        // From the next request on the new configuration holds: first while its snapshot is
        // (most likely) being built, so requests run init; then once it is ready.
        for _ in 0..2 {
            let r = call(&c, Method::POST, "/v1/chat/completions", &key, Some(ask("banana"))).await;
            assert_eq!((r.status, code(&r).as_str()), (400, "plugin_refused"), "{}", r.text());
            let r = call(&c, Method::POST, "/v1/chat/completions", &key, Some(ask("cherry"))).await;
            assert_eq!(r.status, 200, "{}", r.text());
            wait_for_init_lines(&c, &key, "filter", 2).await;
        }
        // Another configuration gets its own snapshot: never the last one's state.
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/filter/config",
            &key,
            Some(b"deny: cherry".to_vec()),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let lines = wait_for_init_lines(&c, &key, "filter", 3).await;
        assert!(lines[2].ends_with("requests start from init's state"), "{lines:?}");
        let r = call(&c, Method::POST, "/v1/chat/completions", &key, Some(ask("banana"))).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let r = call(&c, Method::POST, "/v1/chat/completions", &key, Some(ask("cherry"))).await;
        assert_eq!((r.status, code(&r).as_str()), (400, "plugin_refused"), "{}", r.text());
        // One snapshot per plugin is kept on disk.
        let dirs: Vec<_> = std::fs::read_dir(s.data_dir.join("data/plugin-cache/snapshots"))
            .unwrap()
            .map(|e| e.unwrap().path().join("filter"))
            .collect();
        assert_eq!(dirs.len(), 1, "{dirs:?}");
        assert_eq!(std::fs::read_dir(&dirs[0]).unwrap().count(), 1);
        // A plugin whose init keeps a stream open cannot be captured: it says so, and runs
        // init on every request.
        assert_eq!(upload(&c, &key, "printer", example("adversary")).await.status, 201);
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/printer/config",
            &key,
            Some(b"print-in-init".to_vec()),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let lines = wait_for_init_lines(&c, &key, "printer", 2).await;
        assert!(
            lines
                .iter()
                .any(|l| l.contains("init runs on every request: init kept a host resource")),
            "{lines:?}"
        );
        let printer = chat(json!([{"role": "user", "content": "hi"}]), Some("printer"), 4, false);
        let r = call(&c, Method::POST, "/v1/chat/completions", &key, Some(printer)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        // Deleting the plugin drops its snapshot.
        let r = call(&c, Method::DELETE, "/v1/plugins/filter", &key, None).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(!dirs[0].exists());
        // A plugin deleted while its snapshot is built does not get it back: the tenant's
        // builds run in turn, so once a later plugin's is done, the deleted one's has ended.
        let tenant_dir = dirs[0].parent().unwrap().to_path_buf();
        assert_eq!(upload(&c, &key, "gone", example("regex_filter")).await.status, 201);
        let r = call(&c, Method::DELETE, "/v1/plugins/gone", &key, None).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(upload(&c, &key, "after", example("system_prompt")).await.status, 201);
        wait_for_init_lines(&c, &key, "after", 1).await;
        assert!(tenant_dir.join("after").exists());
        assert!(
            !tenant_dir.join("gone").exists(),
            "a deleted plugin's snapshot came back"
        );
        // Deleting the tenant drops all of its plugins' compiles.
        let r = c
            .request(Method::DELETE, "/admin/v1/tenants/default", Some(&s.admin), None)
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(!tenant_dir.exists());
    });
}

#[test]
fn the_compiler_child_is_held_to_its_time_and_memory() {
    use warden::plugin::Runtime;
    use warden::plugin::compile::{CompileLimits, compile_isolated};
    let runtime = Runtime::new(4, 64 << 20).expect("runtime");
    let exe = common::warden_bin();
    let limits = |timeout_s: u64, memory_mib: u64| CompileLimits {
        timeout: std::time::Duration::from_secs(timeout_s),
        memory_bytes: memory_mib << 20,
    };
    rt().block_on(async {
        let regex = example("regex_filter");
        // Within its bounds: an artefact the server's runtime loads.
        assert!(compile_isolated(&exe, &runtime, &regex, limits(30, 2048)).await.is_ok());
        // Too little memory for it: refused, named as memory.
        let e = compile_isolated(&exe, &runtime, &regex, limits(30, 48))
            .await
            .err()
            .expect("refused");
        assert_eq!(e.code(), "component_compile_memory", "{e}");
        // Too slow: the child is killed at the limit.
        let t0 = std::time::Instant::now();
        let e = compile_isolated(&exe, &runtime, &slow_to_compile(12_000), limits(1, 2048))
            .await
            .err()
            .expect("refused");
        assert_eq!(e.code(), "component_compile_timeout", "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(3), "{:?}", t0.elapsed());
        // Not a component: the child's reason, once.
        let e = compile_isolated(&exe, &runtime, b"not wasm", limits(30, 2048))
            .await
            .err()
            .expect("refused");
        assert_eq!(e.code(), "plugin_invalid", "{e}");
        assert!(!e.to_string().contains("invalid plugin: invalid plugin"), "{e}");
    });
}

#[test]
fn tenants_take_turns_at_the_compiler_within_their_compile_budgets() {
    // Each compile may take 4 s; mallory may compile for 6 s a minute (its policy), the other
    // tenant for the server's 60.
    let s = Server::start_with_policies(
        "compileturns",
        "[plugins]\ncompile_timeout_s = 4\ncompile_seconds_per_minute = 60\nuploads_per_minute = 100\n",
        &[("tenants/mallory.toml", "[plugins]\ncompile_seconds_per_minute = 6\n")],
    );
    let key = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        let mallory = s.tenant_with_key("mallory").await;
        // Mallory queues three uploads that each run into the compile timeout...
        let slow: Vec<_> = (0..3)
            .map(|i| {
                let (c, k) = (c.clone(), mallory.clone());
                tokio::spawn(async move { upload(&c, &k, &format!("slow{i}"), slow_to_compile(20_000 + i)).await })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        // ...and the other tenant's upload waits for at most the one under way, not all three.
        let t0 = std::time::Instant::now();
        let r = upload(&c, &key, "filter", example("regex_filter")).await;
        let waited = t0.elapsed();
        assert_eq!(r.status, 201, "{}", r.text());
        let mut codes = Vec::new();
        for f in slow {
            let r = f.await.unwrap();
            codes.push((r.status, code(&r)));
        }
        eprintln!("the victim's upload took {waited:?}; mallory's uploads ended {codes:?}");
        // Behind all three it would wait more than 11.7 s before its own compile began.
        assert!(waited < std::time::Duration::from_secs(10), "{waited:?}: {codes:?}");
        // Mallory's first two timed out and were charged 4 s each: the third found its budget
        // spent when its turn came.
        codes.sort();
        assert_eq!(
            codes,
            vec![
                (400, "component_compile_timeout".to_string()),
                (400, "component_compile_timeout".to_string()),
                (429, "compile_budget_exceeded".to_string()),
            ],
        );
        // In debt, an upload is refused at once, with the time until the budget is paid back.
        let t0 = std::time::Instant::now();
        let r = upload(&c, &mallory, "again", example("regex_filter")).await;
        assert_eq!(
            (r.status, code(&r).as_str()),
            (429, "compile_budget_exceeded"),
            "{}",
            r.text()
        );
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        let after: u64 = r
            .headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .expect("Retry-After");
        assert!((1..=60).contains(&after), "{after}");
        // The other tenant's budget is its own.
        let r = upload(&c, &key, "filter2", example("json_guard")).await;
        assert_eq!(r.status, 201, "{}", r.text());
    });
}

/// Who calls, in the auth matrix.
#[derive(Clone, Copy, Debug)]
enum Who {
    Nobody,
    WrongKey,
    A,
    B,
    Admin,
}

/// A route of the auth matrix: method, path, body, and the status each of `Who`'s callers gets
/// (in the order `Nobody, WrongKey, A, B, Admin`; 0 where not tried).
type Route = (Method, String, Option<Vec<u8>>, [u16; 5]);

#[test]
fn every_route_answers_each_caller_as_its_rights_say() {
    let s = Server::start("plugauth", "");
    let a = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        let b = s.tenant_with_key("beta").await;
        // A owns plugin `pa` (with a config), B owns `pb`; each has used the API once.
        assert_eq!(upload(&c, &a, "pa", example("system_prompt")).await.status, 201);
        assert_eq!(upload(&c, &b, "pb", example("system_prompt")).await.status, 201);
        let r = call(
            &c,
            Method::PUT,
            "/v1/plugins/pa/config",
            &a,
            Some(b"A's secret prompt".to_vec()),
        )
        .await;
        assert_eq!(r.status, 200);
        let one = chat(json!([{"role": "user", "content": "Hi"}]), None, 1, false);
        for k in [&a, &b] {
            assert_eq!(
                call(&c, Method::POST, "/v1/chat/completions", k, Some(one.clone()))
                    .await
                    .status,
                200
            );
        }
        let keys = c
            .request(Method::GET, "/admin/v1/tenants/beta/keys", Some(&s.admin), None)
            .await
            .unwrap()
            .json()
            .unwrap();
        let b_key_id = keys["data"][0]["id"].as_str().expect("B's key id").to_string();
        let who = |w: Who| -> Option<String> {
            match w {
                Who::Nobody => None,
                Who::WrongKey => Some("wdn-0000000000000000000000000000000000000000000000000000000000000000".into()),
                Who::A => Some(a.clone()),
                Who::B => Some(b.clone()),
                Who::Admin => Some(s.admin.clone()),
            }
        };
        let t = 401; // not authenticated for this route
        let all = [Who::Nobody, Who::WrongKey, Who::A, Who::B, Who::Admin];
        let routes: Vec<Route> = vec![
            (Method::GET, "/healthz".into(), None, [200, 200, 200, 200, 200]),
            (Method::GET, "/readyz".into(), None, [200, 200, 200, 200, 200]),
            (Method::GET, "/metrics".into(), None, [t, t, t, t, 200]),
            (Method::GET, "/v1/models".into(), None, [t, t, 200, 200, t]),
            (
                Method::GET,
                format!("/v1/models/{}", common::MODEL),
                None,
                [t, t, 200, 200, t],
            ),
            (
                Method::POST,
                "/v1/chat/completions".into(),
                Some(one.clone()),
                [t, t, 200, 200, t],
            ),
            (
                Method::POST,
                "/v1/completions".into(),
                Some(
                    json!({"model": common::MODEL, "prompt": "Hi", "max_tokens": 1})
                        .to_string()
                        .into_bytes(),
                ),
                [t, t, 200, 200, t],
            ),
            (Method::GET, "/v1/usage".into(), None, [t, t, 200, 200, t]),
            (Method::GET, "/v1/plugins".into(), None, [t, t, 200, 200, t]),
            // A's plugin: B is told it does not exist, exactly as for a name nobody has.
            (Method::GET, "/v1/plugins/pa".into(), None, [t, t, 200, 404, t]),
            (Method::GET, "/v1/plugins/pa/logs".into(), None, [t, t, 200, 404, t]),
            (
                Method::PUT,
                "/v1/plugins/pa/config".into(),
                Some(b"B was here".to_vec()),
                [t, t, 0, 404, t],
            ),
            // A's config change is in its history: rollback restores the config before it.
            (
                Method::POST,
                "/v1/plugins/pa/rollback".into(),
                None,
                [t, t, 200, 404, t],
            ),
            (
                Method::POST,
                "/v1/plugins/pa/activate".into(),
                Some(br#"{"version": "0123456789abcdef"}"#.to_vec()),
                [t, t, 404, 404, t],
            ),
            (Method::PUT, "/v1/plugins/pa/default".into(), None, [t, t, 200, 404, t]),
            (
                Method::DELETE,
                "/v1/plugins/pa/default".into(),
                None,
                [t, t, 200, 404, t],
            ),
            (
                Method::DELETE,
                "/v1/plugins/pa/versions/0123456789abcdef".into(),
                None,
                [t, t, 404, 404, t],
            ),
            (Method::GET, "/admin/v1/tenants".into(), None, [t, t, t, t, 200]),
            (Method::GET, "/admin/v1/usage".into(), None, [t, t, t, t, 200]),
            (Method::GET, "/admin/v1/policies".into(), None, [t, t, t, t, 200]),
            (Method::GET, "/admin/v1/keys".into(), None, [t, t, t, t, 200]),
            (
                Method::GET,
                "/admin/v1/tenants/default/keys".into(),
                None,
                [t, t, t, t, 200],
            ),
            (
                Method::POST,
                "/admin/v1/tenants/default/keys".into(),
                None,
                [t, t, t, t, 0],
            ),
            (
                Method::GET,
                "/admin/v1/tenants/default/plugins".into(),
                None,
                [t, t, t, t, 200],
            ),
            (
                Method::GET,
                "/admin/v1/tenants/default/plugins/pa/logs".into(),
                None,
                [t, t, t, t, 200],
            ),
            (
                Method::POST,
                "/admin/v1/tenants".into(),
                Some(br#"{"name": "gamma"}"#.to_vec()),
                [t, t, t, t, 201],
            ),
            (
                Method::DELETE,
                "/admin/v1/tenants/gamma".into(),
                None,
                [t, t, t, t, 200],
            ),
            (
                Method::DELETE,
                format!("/admin/v1/keys/{b_key_id}"),
                None,
                [t, t, t, t, 0],
            ),
            (Method::DELETE, "/v1/plugins/pa".into(), None, [t, t, 200, 404, t]),
        ];
        for (method, path, body, expected) in routes {
            for (w, want) in all.iter().zip(expected) {
                if want == 0 {
                    continue;
                }
                let r = c
                    .request(method.clone(), &path, who(*w).as_deref(), body.clone())
                    .await
                    .expect("request");
                assert_eq!(r.status, want, "{method} {path} as {w:?}: {}", r.text());
                // Nothing another tenant owns shows in what a tenant is answered (generated text
                // aside, which is the model's).
                let text = r.text();
                let generated = path.ends_with("completions");
                match w {
                    Who::A if !generated => {
                        assert!(
                            !text.contains("\"pb\"") && !text.contains("beta"),
                            "{path} as A: {text}"
                        )
                    }
                    Who::B if !generated => assert!(
                        !text.contains("\"pa\"")
                            && !text.contains("A's secret")
                            && !text.contains("\"tenant\":\"default\""),
                        "{method} {path} as B: {text}"
                    ),
                    _ => {}
                }
                if want == t && !matches!(w, Who::Nobody) {
                    assert!(code(&r).starts_with("invalid_"), "{path} as {w:?}: {}", r.text());
                }
            }
        }
        // Names are per tenant: B may have a `pa` of its own, and it is nothing of A's.
        assert_eq!(upload(&c, &b, "pa", example("pii_redactor")).await.status, 201);
        let v = call(&c, Method::GET, "/v1/plugins/pa", &b, None).await.json().unwrap();
        assert_eq!(v["config_bytes"], json!(0), "{v}");
        let v = call(&c, Method::GET, "/v1/usage", &a, None).await.json().unwrap();
        assert_eq!(v["tenant"], json!("default"), "{v}");
    });
}
