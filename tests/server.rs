//! The server as clients see it: errors, isolation between tenants, restarts, disconnects, the
//! CLI beside a running server. Each test starts its own `warden serve` process.

mod common;

use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::Method;
use serde_json::json;
use warden::serve::client::Proto;

use common::{MODEL, Server, chat_body, content, rt, sse_content};

/// (name, method, path, bearer, body, status, error code).
type Case<'a> = (&'a str, Method, &'a str, Option<&'a str>, Vec<u8>, u16, &'a str);

#[test]
fn bad_requests_get_their_status_and_code_while_good_ones_keep_working() {
    // Strict about unknown fields here; the official client's test has the default (ignore).
    let s = Server::start(
        "bad",
        "[limits]\nbody_bytes = 65536\nmax_context = 2048\nunknown_fields = \"refuse\"\n",
    );
    rt().block_on(async {
        let c = s.client();
        let key = s.key().to_string();
        // The token the server made for scrapers, beside its admin token.
        let metrics_token = std::fs::read_to_string(s.data_dir.join("data").join("metrics-token"))
            .expect("the metrics token file")
            .trim()
            .to_string();
        let chat = "/v1/chat/completions";
        let long_ids: Vec<u32> = (0..3000).map(|i| 100 + i % 1000).collect();
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        let cases: Vec<Case<'_>> = vec![
            (
                "no key",
                Method::POST,
                chat,
                None,
                chat_body(MODEL, "hi", 4, false),
                401,
                "missing_api_key",
            ),
            (
                "wrong key",
                Method::POST,
                chat,
                Some("wdn-0123456789abcdef-nope"),
                chat_body(MODEL, "hi", 4, false),
                401,
                "invalid_api_key",
            ),
            (
                "admin token is not an API key",
                Method::POST,
                chat,
                Some(&s.admin),
                chat_body(MODEL, "hi", 4, false),
                401,
                "invalid_api_key",
            ),
            (
                "invalid JSON",
                Method::POST,
                chat,
                Some(&key),
                b"{\"model\": ".to_vec(),
                400,
                "invalid_json",
            ),
            (
                "not an object",
                Method::POST,
                chat,
                Some(&key),
                b"[1,2]".to_vec(),
                400,
                "invalid_request",
            ),
            (
                "too deep",
                Method::POST,
                chat,
                Some(&key),
                deep.into_bytes(),
                400,
                "invalid_json",
            ),
            (
                "unknown field",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL, "messages": [], "colour": "red"})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_parameter",
            ),
            (
                "a presence penalty out of range",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_parameter",
            ),
            (
                "a logit bias on a token outside the vocabulary",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"49152": 1}})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_parameter",
            ),
            (
                "wrong type",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_parameter",
            ),
            (
                "missing messages",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL}).to_string().into_bytes(),
                400,
                "invalid_request",
            ),
            (
                "bad role",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_parameter",
            ),
            (
                "n too large",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 100})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_parameter",
            ),
            (
                "temperature out of range",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 9})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_parameter",
            ),
            (
                "max_tokens 0",
                Method::POST,
                chat,
                Some(&key),
                json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_parameter",
            ),
            (
                "unknown model",
                Method::POST,
                chat,
                Some(&key),
                chat_body("gpt-9", "hi", 4, false),
                404,
                "model_not_found",
            ),
            (
                "over-length prompt",
                Method::POST,
                "/v1/completions",
                Some(&key),
                json!({"model": MODEL, "prompt": long_ids, "max_tokens": 8})
                    .to_string()
                    .into_bytes(),
                400,
                "context_length_exceeded",
            ),
            (
                "over-length stream",
                Method::POST,
                "/v1/completions",
                Some(&key),
                json!({"model": MODEL, "prompt": long_ids, "max_tokens": 8, "stream": true})
                    .to_string()
                    .into_bytes(),
                400,
                "context_length_exceeded",
            ),
            (
                "token id outside the vocabulary",
                Method::POST,
                "/v1/completions",
                Some(&key),
                json!({"model": MODEL, "prompt": [1, 999999], "max_tokens": 2})
                    .to_string()
                    .into_bytes(),
                400,
                "invalid_token",
            ),
            (
                "body too large",
                Method::POST,
                chat,
                Some(&key),
                vec![b' '; 70_000],
                413,
                "body_too_large",
            ),
            (
                "no route",
                Method::GET,
                "/v2/anything",
                Some(&key),
                vec![],
                404,
                "not_found",
            ),
            (
                "wrong method",
                Method::GET,
                chat,
                Some(&key),
                vec![],
                405,
                "method_not_allowed",
            ),
            (
                "metrics need the metrics or admin token",
                Method::GET,
                "/metrics",
                Some(&key),
                vec![],
                401,
                "invalid_metrics_token",
            ),
            (
                "the metrics token opens nothing else",
                Method::GET,
                "/admin/v1/tenants",
                Some(&metrics_token),
                vec![],
                401,
                "invalid_admin_token",
            ),
            (
                "nor is it a tenant's key",
                Method::POST,
                chat,
                Some(&metrics_token),
                chat_body(MODEL, "hi", 4, false),
                401,
                "invalid_api_key",
            ),
            (
                "admin needs the admin token",
                Method::GET,
                "/admin/v1/tenants",
                Some(&key),
                vec![],
                401,
                "invalid_admin_token",
            ),
        ];
        let good = || {
            c.request(
                Method::POST,
                chat,
                Some(&key),
                Some(chat_body(MODEL, "Say hi", 4, false)),
            )
        };
        let baseline = good().await.expect("good request");
        assert_eq!(baseline.status, 200, "{}", baseline.text());
        for (name, method, path, auth, body, status, code) in cases {
            let body = if body.is_empty() { None } else { Some(body) };
            // The server answers 413 without reading the body. Over HTTP/1.1 the client may
            // still be writing when the connection closes (a reset that races the response);
            // HTTP/2 ends just the stream, so the answer always arrives.
            let proto = if status == 413 { Proto::Http2 } else { Proto::Http1 };
            let r = c.request_proto(proto, method, path, auth, body).await.expect(name);
            assert_eq!(r.status, status, "{name}: {}", r.text());
            let v = r.json().expect(name);
            assert_eq!(v["error"]["code"], code, "{name}: {v}");
            assert!(
                v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{name}: {v}"
            );
            let again = good().await.expect("good request");
            assert_eq!(
                (again.status, content(&again)),
                (200, content(&baseline)),
                "after {name}"
            );
        }
        // Field errors name the field.
        let r = c
            .request(
                Method::POST,
                chat,
                Some(&key),
                Some(
                    json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"})
                        .to_string()
                        .into_bytes(),
                ),
            )
            .await
            .unwrap();
        let v = r.json().unwrap();
        assert_eq!(v["error"]["param"], "temperature");
        assert!(v["error"]["message"].as_str().unwrap().contains("temperature"), "{v}");
        // The scraper's token reads the metrics.
        let r = c
            .request(Method::GET, "/metrics", Some(&metrics_token), None)
            .await
            .unwrap();
        assert!(
            r.status == 200 && r.text().contains("# TYPE warden_requests_total counter"),
            "{}",
            r.text()
        );
        // Rejections are counted by reason, and nothing was allocated for them.
        let m = s.metrics().await;
        assert!(
            m.contains("warden_rejections_total{tenant=\"default\",reason=\"context_length_exceeded\"} 2"),
            "{m}"
        );
        assert_eq!(s.metric("warden_kv_pages{state=\"used\"}").await, 0.0);
    });
}

#[test]
fn two_tenants_streaming_concurrently_never_see_each_others_canaries() {
    let s = Server::start("canary", "");
    rt().block_on(async {
        let a = s.key().to_string();
        let b = s.tenant_with_key("beta").await;
        let c = s.client();
        let mut tasks = Vec::new();
        for round in 0..3 {
            for (who, key) in [("a", a.clone()), ("b", b.clone())] {
                let c = c.clone();
                // The model mangles prefixes but repeats hex digits: the hex is the canary.
                let canary = format!("{:08x}", rand::random::<u32>() | 0x1000_0000);
                tasks.push(tokio::spawn(async move {
                    let body = json!({
                        "model": MODEL, "temperature": 0, "max_tokens": 24, "stream": true,
                        "messages": [{"role": "user", "content": format!("Repeat this code exactly: {who}{canary} {who}{canary}")}],
                    });
                    let r = c
                        .send(if round % 2 == 0 { Proto::Http1 } else { Proto::Http2 }, Method::POST, "/v1/chat/completions", Some(&key), Some(body.to_string().into_bytes()))
                        .await
                        .expect("stream");
                    assert_eq!(r.status().as_u16(), 200);
                    let text = String::from_utf8_lossy(&r.into_body().collect().await.expect("body").to_bytes()).into_owned();
                    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
                    (canary, text)
                }));
            }
        }
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.expect("task"));
        }
        for (i, (_, sse)) in results.iter().enumerate() {
            let text = sse_content(sse);
            for (j, (other, _)) in results.iter().enumerate() {
                if i != j {
                    assert!(
                        !sse.contains(other.as_str()) && !text.contains(other.as_str()),
                        "response {i} holds canary {other} of {j}: {text:?}"
                    );
                }
            }
        }
        // The model does repeat its own prompt's code, so the check is not vacuous.
        let own = results.iter().filter(|(c, sse)| sse_content(sse).contains(c.as_str())).count();
        assert!(own > 0, "no response repeated its own canary; the test would prove nothing");
        assert_eq!(s.metric("warden_isolation_violations_total").await, 0.0);
    });
}

#[test]
fn tenants_and_keys_survive_a_restart_and_revoked_keys_stay_revoked() {
    let mut s = Server::start("restart", "");
    let (key, revoked, beta) = rt().block_on(async {
        let c = s.client();
        let beta = s.tenant_with_key("beta").await;
        let r = c
            .request(Method::POST, "/admin/v1/tenants/beta/keys", Some(&s.admin), None)
            .await
            .unwrap();
        let revoked = r.json().unwrap()["key"].as_str().unwrap().to_string();
        let id = &revoked[4..20];
        let r = c
            .request(Method::DELETE, &format!("/admin/v1/keys/{id}"), Some(&s.admin), None)
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        (s.key().to_string(), revoked, beta)
    });
    assert!(s.stop(), "graceful shutdown exits 0");
    let s2 = Server::start_with(s.data_dir.clone(), s.config.clone());
    assert!(s2.default_key.is_none(), "a restart creates no new default tenant");
    rt().block_on(async {
        let c = s2.client();
        for (k, status) in [(&key, 200), (&beta, 200), (&revoked, 401)] {
            let r = c.request(Method::GET, "/v1/models", Some(k), None).await.unwrap();
            assert_eq!(r.status, status, "{k}: {}", r.text());
        }
        let mut wrong = key.clone();
        wrong.replace_range(key.len() - 3.., "AAA");
        let r = c.request(Method::GET, "/v1/models", Some(&wrong), None).await.unwrap();
        assert_eq!(r.status, 401);
        let r = c
            .request(Method::GET, "/admin/v1/tenants", Some(&s2.admin), None)
            .await
            .unwrap();
        let names: Vec<String> = r.json().unwrap()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["beta", "default"]);
    });
}

#[test]
fn a_client_that_disconnects_mid_stream_is_cancelled_and_its_pages_return() {
    let s = Server::start("disconnect", "");
    rt().block_on(async {
        let c = s.client();
        let total = s.metric("warden_kv_pool_pages").await;
        assert!(total > 0.0);
        let body = chat_body(MODEL, "Write a long story about a dragon.", 400, true);
        let r = c
            .send(
                Proto::Http1,
                Method::POST,
                "/v1/chat/completions",
                Some(s.key()),
                Some(body),
            )
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let mut b = r.into_body();
        let first = b.frame().await.expect("a first chunk").expect("no error");
        assert!(first.data_ref().is_some_and(|d| d.starts_with(b"data: ")));
        assert!(
            s.metric("warden_kv_pages{state=\"used\"}").await > 0.0,
            "the stream holds pages"
        );
        drop(b);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let m = s.metrics().await;
            let val = |series: &str| common::metric_value(&m, series);
            // Back to the pool: free, or kept in the tenant's prefix cache (whose idle pages are
            // free to take).
            if val("warden_kv_pages{state=\"used\"}") == 0.0
                && val("warden_requests_total{tenant=\"default\",outcome=\"cancelled\"}") == 1.0
            {
                assert_eq!(
                    val("warden_kv_pages{state=\"free\"}") + val("warden_kv_pages{state=\"cached\"}"),
                    total
                );
                assert_eq!(val("warden_kv_pinned_pages"), 0.0);
                break;
            }
            assert!(Instant::now() < deadline, "pages did not return:\n{m}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

#[test]
fn the_cli_manages_tenants_through_a_running_server_and_health_endpoints_answer() {
    let s = Server::start("cli", "");
    let data = s.data_dir.join("data");
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(common::warden_bin())
            .args(args)
            .arg("--data-dir")
            .arg(&data)
            .output()
            .expect("run warden");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, out) = cli(&["tenant", "create", "gamma"]);
    assert!(ok, "{out}");
    let (ok, out) = cli(&["key", "create", "gamma"]);
    assert!(ok, "{out}");
    let key = out
        .lines()
        .find(|l| l.starts_with("wdn-"))
        .expect("the key is printed")
        .to_string();
    let (ok, out) = cli(&["tenant", "create", "Bad Name"]);
    assert!(!ok && out.contains("invalid tenant name"), "{out}");
    // A command run where no server keeps its state makes no store of its own.
    let nowhere = s.data_dir.join("not-a-data-dir");
    let out = std::process::Command::new(common::warden_bin())
        .args(["plugin", "list", "--data-dir"])
        .arg(&nowhere)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("no state store in"), "{said}");
    assert!(!nowhere.join("state").exists());
    // Lists for people (times in RFC 3339) and for programs (--json).
    let (ok, out) = cli(&["tenant", "list"]);
    let gamma = out
        .lines()
        .find(|l| l.starts_with("gamma\t"))
        .unwrap_or_else(|| panic!("{out}"));
    let at = gamma.rsplit("created ").next().unwrap();
    assert!(
        ok && at.len() == 20 && at.ends_with('Z') && at.as_bytes()[10] == b'T',
        "{gamma}"
    );
    let (ok, out) = cli(&["key", "list", "gamma", "--json"]);
    let keys: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(
        ok && keys[0]["tenant"] == "gamma" && keys[0]["created"].is_u64(),
        "{out}"
    );
    rt().block_on(async {
        let c = s.client();
        let r = c.request(Method::GET, "/v1/models", Some(&key), None).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json().unwrap()["data"][0]["id"], MODEL);
        for path in ["/healthz", "/readyz"] {
            assert_eq!(c.request(Method::GET, path, None, None).await.unwrap().status, 200);
        }
        // HTTP/2 by ALPN.
        let r = c
            .send(Proto::Http2, Method::GET, "/v1/models", Some(&key), None)
            .await
            .unwrap();
        assert_eq!((r.status().as_u16(), r.version()), (200, hyper::Version::HTTP_2));
    });
    let (ok, out) = cli(&["key", "revoke", &key[4..20]]);
    assert!(ok, "{out}");
    rt().block_on(async {
        let r = s
            .client()
            .request(Method::GET, "/v1/models", Some(&key), None)
            .await
            .unwrap();
        assert_eq!(r.status, 401);
    });
}

#[test]
fn a_full_queue_answers_503_with_retry_after_and_no_unbounded_buffering() {
    let s = Server::start("queue", "[limits]\nqueue = 1\nmax_running = 1\n");
    rt().block_on(async {
        let c = s.client();
        let mut tasks = Vec::new();
        for i in 0..8 {
            let (c, key) = (c.clone(), s.key().to_string());
            tasks.push(tokio::spawn(async move {
                let body = chat_body(MODEL, &format!("Count to {}", 10 + i), 24, false);
                c.request(Method::POST, "/v1/chat/completions", Some(&key), Some(body))
                    .await
                    .expect("request")
            }));
        }
        let (mut ok, mut busy) = (0, 0);
        for t in tasks {
            let r = t.await.unwrap();
            match r.status {
                200 => ok += 1,
                503 => {
                    busy += 1;
                    assert_eq!(r.json().unwrap()["error"]["code"], "queue_full", "{}", r.text());
                    assert!(r.headers.contains_key("retry-after"));
                }
                other => panic!("unexpected {other}: {}", r.text()),
            }
        }
        assert!(ok >= 1 && busy >= 1, "{ok} served, {busy} refused");
        // Once the queue drains, requests are served again.
        let r = c
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(s.key()),
                Some(chat_body(MODEL, "hi", 4, false)),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200);
    });
}

#[test]
fn sigterm_lets_an_inflight_stream_finish_then_exits_cleanly() {
    let mut s = Server::start("shutdown", "[timeouts]\nshutdown_s = 60\nheader_read_s = 1\n");
    let (body, idle_closed) = rt().block_on(async {
        let c = s.client();
        // An idle connection is closed once the header-read timeout passes.
        let mut idle = c.connect_idle().await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let idle_closed = !idle.is_open();
        let r = c
            .send(
                Proto::Http1,
                Method::POST,
                "/v1/chat/completions",
                Some(s.key()),
                Some(chat_body(MODEL, "Tell me a story.", 48, true)),
            )
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let mut b = r.into_body();
        let first = b.frame().await.unwrap().unwrap().into_data().unwrap();
        let pid = s.pid();
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let rest = b.collect().await.expect("the stream completes").to_bytes();
        (
            String::from_utf8_lossy(&[first.to_vec(), rest.to_vec()].concat()).into_owned(),
            idle_closed,
        )
    });
    assert!(idle_closed, "the idle connection outlived header_read_s");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(sse_content(&body).len() > 10);
    assert!(s.stop(), "exit status 0 after a graceful shutdown");
}

#[test]
fn bad_configurations_refuse_to_start_and_say_why() {
    let dir = common::temp_dir("badcfg");
    let run = |toml: &str| {
        let cfg = dir.join("w.toml");
        let model = if toml.contains("model =") || toml.contains("[[models]]") {
            String::new()
        } else {
            format!("model = {:?}\n", common::model())
        };
        std::fs::write(&cfg, format!("data_dir = {:?}\n{model}{toml}", dir.join("data"))).unwrap();
        let out = std::process::Command::new(common::warden_bin())
            .args(["serve", "--config"])
            .arg(&cfg)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // Invariant 4: a max context the pool cannot hold is refused, naming both numbers.
    let (ok, err) = run("listen = \"127.0.0.1:0\"\n[kv]\nmemory_mib = 8\n[limits]\nmax_context = 8192\n");
    assert!(!ok && err.contains("8192"), "{err}");
    let (ok, err) = run("listen = \"127.0.0.1:0\"\n[limits]\nqueue_size = 3\n");
    assert!(!ok && err.contains("queue_size") && err.contains("line 5"), "{err}");
    let (ok, err) = run("listen = \"127.0.0.1:0\"\nmodel = \"nowhere.gguf\"\n");
    assert!(
        !ok && err.contains("nowhere.gguf") && err.contains("not found"),
        "{err}"
    );
    // Invariant 4 per model: each model's share of the budget holds its own max context.
    let models = format!(
        "listen = \"127.0.0.1:0\"\n[kv]\nmemory_mib = 8\n[[models]]\npath = {:?}\n[[models]]\npath = {:?}\nname = \"tiny\"\nkv_share = 0.003\n[models.limits]\nmax_context = 64\n",
        common::model(),
        common::tiny_model()
    );
    let (ok, err) = run(&models);
    assert!(!ok && err.contains("model tiny") && err.contains("64"), "{err}");
    let (ok, err) = run(&format!("model = {:?}\n{}", common::model(), models));
    assert!(!ok && err.contains("not both"), "{err}");
    // A first start refused late (its policies, its port) makes no tenant and prints no key:
    // the start that succeeds prints it.
    let first = dir.join("first");
    std::fs::create_dir_all(first.join("policies")).unwrap();
    std::fs::write(first.join("policies/default.toml"), "requests_per_minut = 5\n").unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let start = |listen: &str| {
        std::fs::write(
            first.join("w.toml"),
            // Relative paths: the file's directory's, wherever the server starts.
            format!(
                "listen = {listen:?}\nmodel = {:?}\ndata_dir = \"data\"\npolicies = \"policies\"\n",
                common::model()
            ),
        )
        .unwrap();
        let mut child = std::process::Command::new(common::warden_bin())
            .args(["serve", "--config"])
            .arg(first.join("w.toml"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait().unwrap().is_none() && !first.join("data/server.json").exists() {
            assert!(Instant::now() < deadline, "the server neither started nor stopped");
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    let said = start(&taken.local_addr().unwrap().to_string());
    assert!(
        said.contains("requests_per_minut") && !said.contains("shown only now"),
        "{said}"
    );
    common::write_default_policy(&first);
    let said = start(&taken.local_addr().unwrap().to_string());
    assert!(
        said.contains("listening on") && !said.contains("shown only now"),
        "{said}"
    );
    let said = start("127.0.0.1:0");
    assert!(said.contains("its API key (shown only now)"), "{said}");
    // A data directory given relative to where the server starts: server.json names the
    // certificate so that a CLI run from anywhere finds it.
    let _ = std::fs::remove_file(first.join("data/server.json"));
    let mut child = std::process::Command::new(common::warden_bin())
        .args(["serve", "--config", "w.toml", "--data-dir", "data"])
        .current_dir(&first)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !first.join("data/server.json").exists() {
        assert!(Instant::now() < deadline, "the server did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = std::process::Command::new(common::warden_bin())
        .args(["tenant", "list", "--data-dir"])
        .arg(first.join("data"))
        .current_dir("/")
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.starts_with("default\tid 1"), "{said}");
}

/// `[[models]]`: each model has its own engine, pool and limits; `/v1/models` lists what the
/// tenant may use; a request's `model` picks one, under the tenant's `allowed_models`; metrics
/// carry the model.
#[test]
fn one_server_serves_several_models_each_with_its_own_pool_limits_and_metrics() {
    let extra = format!(
        "[kv]\nmemory_mib = 64\n\
         [[models]]\npath = {:?}\nname = \"smol\"\nkv_share = 0.75\n\
         [[models]]\npath = {:?}\nname = \"tiny/llama\"\n[models.limits]\nmax_context = 48\ndefault_max_tokens = 4\n",
        common::model(),
        common::tiny_model()
    );
    let s = Server::start_with_policies(
        "models",
        &extra,
        &[("tenants/narrow.toml", "allowed_models = [\"tiny/llama\"]\n")],
    );
    rt().block_on(async {
        let c = s.client();
        let key = s.key().to_string();
        let narrow = s.tenant_with_key("narrow").await;
        let listed = |v: serde_json::Value| -> Vec<(String, u64)> {
            v["data"]
                .as_array()
                .expect("a list")
                .iter()
                .map(|m| {
                    (
                        m["id"].as_str().expect("id").to_string(),
                        m["max_model_len"].as_u64().expect("len"),
                    )
                })
                .collect()
        };
        let r = c
            .request(Method::GET, "/v1/models", Some(&key), None)
            .await
            .expect("models");
        let all = listed(r.json().expect("json"));
        assert_eq!(
            all.iter().map(|m| m.0.as_str()).collect::<Vec<_>>(),
            ["smol", "tiny/llama"]
        );
        assert_eq!(all[1].1, 48, "the model's own max_context");
        assert!(all[0].1 > 48);
        let r = c
            .request(Method::GET, "/v1/models", Some(&narrow), None)
            .await
            .expect("models");
        assert_eq!(listed(r.json().expect("json")), [("tiny/llama".to_string(), 48)]);
        let r = c
            .request(Method::GET, "/v1/models/tiny/llama", Some(&key), None)
            .await
            .expect("model");
        assert_eq!(
            (r.status, r.json().expect("json")["id"].clone()),
            (200, json!("tiny/llama"))
        );
        let r = c
            .request(Method::GET, "/v1/models/smol", Some(&narrow), None)
            .await
            .expect("model");
        assert_eq!(
            r.status,
            404,
            "a model the tenant may not use is not shown: {}",
            r.text()
        );

        let post = |path: &'static str, key: String, body: serde_json::Value| {
            let c = c.clone();
            async move {
                c.request(Method::POST, path, Some(&key), Some(body.to_string().into_bytes()))
                    .await
                    .expect("request")
            }
        };
        let r = post(
            "/v1/chat/completions",
            key.clone(),
            serde_json::from_slice(&chat_body("smol", "Hi", 4, false)).expect("body"),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json().expect("json")["model"], "smol");
        let prompt = [39, 68, 75, 75, 78];
        let tiny = |extra: serde_json::Value| {
            let mut b = json!({"model": "tiny/llama", "prompt": prompt, "temperature": 0});
            b.as_object_mut()
                .expect("object")
                .extend(extra.as_object().expect("object").clone());
            b
        };
        let r = post("/v1/completions", key.clone(), tiny(json!({"max_tokens": 8}))).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json().expect("json");
        assert_eq!(v["model"], "tiny/llama");
        assert_eq!(v["usage"]["prompt_tokens"], 5);
        let done = v["usage"]["completion_tokens"].as_u64().expect("count");
        assert!((1..=8).contains(&done), "{v}");
        // Its own default_max_tokens, its own max_context.
        let r = post("/v1/completions", narrow.clone(), tiny(json!({}))).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            r.json().expect("json")["usage"]["completion_tokens"]
                .as_u64()
                .expect("count")
                <= 4
        );
        let r = post("/v1/completions", key.clone(), tiny(json!({"max_tokens": 44}))).await;
        assert_eq!(
            r.status,
            400,
            "5 + 44 tokens is more than this model's 48: {}",
            r.text()
        );
        assert_eq!(r.json().expect("json")["error"]["code"], "context_length_exceeded");
        let r = post(
            "/v1/chat/completions",
            key.clone(),
            serde_json::from_slice(&chat_body("tiny/llama", "Hi", 4, false)).expect("body"),
        )
        .await;
        assert_eq!(
            (r.status, r.json().expect("json")["error"]["code"].clone()),
            (400, json!("no_chat_template"))
        );
        // The tenant's allowed_models, and a model no one serves.
        let r = post(
            "/v1/chat/completions",
            narrow.clone(),
            serde_json::from_slice(&chat_body("smol", "Hi", 4, false)).expect("body"),
        )
        .await;
        assert_eq!(
            (r.status, r.json().expect("json")["error"]["code"].clone()),
            (403, json!("model_not_allowed"))
        );
        let r = post(
            "/v1/chat/completions",
            key.clone(),
            serde_json::from_slice(&chat_body("large", "Hi", 4, false)).expect("body"),
        )
        .await;
        assert_eq!(
            (r.status, r.json().expect("json")["error"]["code"].clone()),
            (404, json!("model_not_found"))
        );

        // Each model's pool and requests in its own series.
        let m = s.metrics().await;
        let v = |series: &str| common::metric_value(&m, series);
        for model in ["smol", "tiny/llama"] {
            assert!(v(&format!("warden_kv_pool_pages{{model=\"{model}\"}}")) > 0.0, "{m}");
            assert_eq!(
                v(&format!("warden_kv_pages{{model=\"{model}\",state=\"used\"}}")),
                0.0,
                "{m}"
            );
            assert_eq!(
                v(&format!("warden_isolation_violations_total{{model=\"{model}\"}}")),
                0.0,
                "{m}"
            );
            assert_eq!(
                v(&format!(
                    "warden_time_to_first_token_seconds_count{{model=\"{model}\"}}"
                )),
                if model == "smol" { 1.0 } else { 2.0 },
                "{m}"
            );
        }
        assert_eq!(
            v("warden_requests_total{tenant=\"default\",model=\"smol\"}"),
            1.0,
            "{m}"
        );
        assert_eq!(
            v("warden_requests_total{tenant=\"default\",model=\"tiny/llama\",outcome=\"rejected\"}"),
            1.0,
            "{m}"
        );
        assert_eq!(
            v("warden_requests_total{tenant=\"narrow\",model=\"smol\",outcome=\"rejected\"}"),
            1.0,
            "{m}"
        );
        assert_eq!(
            v("warden_completion_tokens_total{tenant=\"default\",model=\"tiny/llama\"}"),
            done as f64,
            "{m}"
        );
    });
}

/// With `--log-format json` (here `WARDEN_LOG_FORMAT`), one JSON access line per request when it
/// ends: the client's `x-request-id` is kept and returned (one that is not plain is replaced),
/// and the line names the tenant, model, route, status, error code, token counts, time to first
/// token, duration and finish reason; a refused request's line carries its code. No line
/// carries the prompt or the completion.
#[test]
fn each_request_gets_an_access_line_and_its_id_back() {
    let s = Server::start_with_env("access", "", &[], &[("WARDEN_LOG_FORMAT", "json")]);
    rt().block_on(async {
        let c = s.client().with_header("x-request-id", "client-id_42.a:b");
        let secret = "purple-giraffe-7731";
        let body = json!({"model": MODEL, "temperature": 0, "max_tokens": 8, "stream": true,
            "messages": [{"role": "user", "content": format!("Say {secret}.")}]});
        let r = c
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(s.key()),
                Some(body.to_string().into_bytes()),
            )
            .await
            .expect("request");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.headers["x-request-id"], "client-id_42.a:b");
        let bad = s.client().with_header("x-request-id", &"x".repeat(200));
        let r = bad
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(s.key()),
                Some(chat_body("nope", "Hi", 4, false)),
            )
            .await
            .expect("request");
        assert_eq!(r.status, 404);
        let made = r.headers["x-request-id"].to_str().expect("ascii").to_string();
        assert!(made.starts_with("req_") && made.len() == 28, "{made}");
        let r = s
            .client()
            .request(Method::GET, "/healthz", None, None)
            .await
            .expect("healthz");
        assert!(r.headers["x-request-id"].to_str().expect("ascii").starts_with("req_"));
        // The names other servers answer, without a key.
        let r = s
            .client()
            .request(Method::GET, "/health", None, None)
            .await
            .expect("health");
        assert_eq!(
            (r.status, r.json().expect("json")["status"].clone()),
            (200, json!("ok"))
        );
        let r = s
            .client()
            .request(Method::GET, "/version", None, None)
            .await
            .expect("version");
        assert_eq!(r.json().expect("json")["version"], env!("CARGO_PKG_VERSION"));
        // The lines arrive when each request ends.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut lines: Vec<serde_json::Value> = Vec::new();
        let mut all = String::new();
        while lines.len() < 3 && Instant::now() < deadline {
            if let Ok(l) = s.output.recv_timeout(Duration::from_millis(100)) {
                all.push_str(&l);
                all.push('\n');
                let v: serde_json::Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{l}: {e}"));
                if v["target"] == "warden::access" {
                    lines.push(v);
                }
            }
        }
        assert!(!all.contains(secret), "a log line carries the prompt: {all}");
        let by = |id: &str| {
            lines
                .iter()
                .find(|v| v["request_id"] == id)
                .unwrap_or_else(|| panic!("{id}: {lines:?}"))
        };
        let ok = by("client-id_42.a:b");
        eprintln!("the access line: {ok}");
        assert_eq!(
            (
                &ok["level"],
                &ok["tenant"],
                &ok["model"],
                &ok["route"],
                &ok["status"],
                &ok["code"]
            ),
            (
                &json!("INFO"),
                &json!("default"),
                &json!(MODEL),
                &json!("/v1/chat/completions"),
                &json!(200),
                &json!("-")
            ),
            "{ok}"
        );
        assert!(
            ok["prompt_tokens"].as_u64() > Some(0) && ok["completion_tokens"].as_u64() > Some(0),
            "{ok}"
        );
        assert!(
            ["stop", "length"].contains(&ok["finish_reason"].as_str().unwrap_or_default()),
            "{ok}"
        );
        let (ttft, took) = (
            ok["ttft_ms"].as_f64().unwrap_or(-1.0),
            ok["duration_ms"].as_f64().unwrap_or(-1.0),
        );
        assert!(ttft > 0.0 && took >= ttft, "{ok}");
        let refused = by(&made);
        assert_eq!(
            (&refused["status"], &refused["code"]),
            (&json!(404), &json!("model_not_found")),
            "{refused}"
        );
    });
}

/// `GET /metrics` with the operator's metrics token (`[metrics] token_file`); latencies by
/// tenant and model; and every metric the Grafana dashboard and the vLLM-name rules query is one
/// the server exposes.
#[test]
fn metrics_are_per_tenant_have_their_own_token_and_cover_the_dashboard() {
    let dir = common::temp_dir("metrics-token");
    let token_file = dir.join("token");
    let token = "scraper-0123456789abcdefghij";
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let s = Server::start("metrics", &format!("[metrics]\ntoken_file = {token_file:?}\n"));
    rt().block_on(async {
        let c = s.client();
        let a = s.key().to_string();
        let b = s.tenant_with_key("beta").await;
        for (key, n) in [(&a, 6), (&b, 3)] {
            let r = c
                .request(
                    Method::POST,
                    "/v1/chat/completions",
                    Some(key),
                    Some(chat_body(MODEL, "Count to ten", n, true)),
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
        let r = c.request(Method::GET, "/metrics", Some(token), None).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let m = r.text();
        let v = |series: &str| common::metric_value(&m, series);
        for (tenant, n) in [("default", 6.0), ("beta", 3.0)] {
            let of = |name: &str| v(&format!("{name}{{tenant=\"{tenant}\",model=\"{MODEL}\"}}"));
            assert_eq!(of("warden_queue_time_seconds_count"), 1.0, "{tenant}: {m}");
            assert_eq!(of("warden_time_to_first_token_seconds_count"), 1.0, "{tenant}: {m}");
            assert_eq!(of("warden_inter_token_latency_seconds_count"), n - 1.0, "{tenant}: {m}");
            assert_eq!(of("warden_request_duration_seconds_count"), 1.0, "{tenant}: {m}");
            assert_eq!(of("warden_completion_tokens_total"), n, "{tenant}: {m}");
            assert_eq!(of("warden_request_completion_tokens_sum"), n, "{tenant}: {m}");
            assert_eq!(of("warden_request_prompt_tokens_count"), 1.0, "{tenant}: {m}");
            // A request's end comes after its first token, which comes after its admission.
            let sum = |name: &str| of(&format!("{name}_sum"));
            assert!(
                sum("warden_queue_time_seconds") <= sum("warden_time_to_first_token_seconds")
                    && sum("warden_time_to_first_token_seconds") <= sum("warden_request_duration_seconds"),
                "{tenant}: {m}"
            );
        }
        assert_eq!(
            v(&format!("warden_kv_usage_ratio{{model=\"{MODEL}\"}}")),
            0.0,
            "idle: {m}"
        );
        // The process and the build, under the names scrapers know.
        assert!(v("process_resident_memory_bytes") > 50e6, "{m}");
        assert!(
            v("process_open_fds") > 3.0 && v("process_cpu_seconds_total") > 0.0,
            "{m}"
        );
        assert!(
            m.contains(&format!("warden_build_info{{version=\"{}\"", env!("CARGO_PKG_VERSION"))),
            "{m}"
        );
        // The admin token still reads them; a wrong token does not.
        assert!(s.metrics().await.contains("warden_kv_usage_ratio"));
        let r = c
            .request(Method::GET, "/metrics", Some("scraper-0123456789abcdefghiJ"), None)
            .await
            .unwrap();
        assert_eq!(r.status, 401);

        // The names the dashboard's and the rules' queries use.
        let families: std::collections::BTreeSet<&str> = m
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        let root = common::root();
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(root.join("deploy/grafana/warden.json")).unwrap()).unwrap();
        let mut exprs = Vec::new();
        collect_exprs(&dashboard, &mut exprs);
        assert!(exprs.len() >= 20, "the dashboard's queries: {exprs:?}");
        let rules = std::fs::read_to_string(root.join("deploy/prometheus/vllm-names.rules.yml")).unwrap();
        // Each rule's `expr:` block: its text up to the next rule, without comment lines.
        let rule_exprs: Vec<String> = rules
            .split("- record:")
            .skip(1)
            .filter_map(|rule| rule.split_once("expr:"))
            .map(|(_, e)| {
                e.lines()
                    .filter(|l| !l.trim_start().starts_with('#'))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .collect();
        assert!(rule_exprs.len() >= 15, "the rules' expressions: {rule_exprs:?}");
        let mut queried = std::collections::BTreeSet::new();
        for e in exprs.iter().chain(&rule_exprs) {
            let names = metric_names(e);
            assert!(!names.is_empty(), "{e:?} queries no warden_ metric");
            queried.extend(names);
        }
        for name in &queried {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| families.contains(f)))
                .unwrap_or(name);
            assert!(
                families.contains(family),
                "{name} is queried but /metrics has no such metric"
            );
        }
        assert!(queried.len() >= 20, "{queried:?}");
    });
    // A token file that holds too short a token is refused before the server starts.
    std::fs::write(&token_file, "short\n").unwrap();
    let cfg = dir.join("w.toml");
    std::fs::write(
        &cfg,
        format!(
            "model = {:?}\n[metrics]\ntoken_file = {token_file:?}\n",
            common::model()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(common::warden_bin())
        .args(["config", "check"])
        .arg(&cfg)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("metrics.token_file"), "{said}");
}

/// Every `expr` string in a Grafana dashboard (panels' targets and template variables' queries).
fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                match (k.as_str(), x) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    ("query", serde_json::Value::Object(q)) => {
                        if let Some(serde_json::Value::String(e)) = q.get("query") {
                            out.push(e.clone());
                        }
                    }
                    _ => collect_exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_exprs(x, out)),
        _ => {}
    }
}

/// The `warden_…` metric names a PromQL expression names.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("warden_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        // Not the tail of a longer identifier (a label named like one).
        let preceded = rest[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        if !preceded {
            names.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

/// `warden config check` reads a file as `warden serve` does, the WARDEN_ environment over it,
/// and exits non-zero with the server's message; `serve`'s `--listen` and `--data-dir` win over
/// both.
#[test]
fn config_check_says_what_serve_would_and_flags_override_the_file() {
    let dir = common::temp_dir("cfgcheck");
    let check = |toml: &str, env: &[(&str, &str)]| {
        let cfg = dir.join("w.toml");
        std::fs::write(&cfg, format!("model = {:?}\n{toml}", common::model())).unwrap();
        let out = std::process::Command::new(common::warden_bin())
            .args(["config", "check"])
            .arg(&cfg)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), said)
    };
    let (ok, said) = check("listen = \"127.0.0.1:0\"\n", &[("WARDEN_KV__MEMORY_MIB", "96")]);
    assert!(ok && said.contains(": ok (listen 127.0.0.1:0"), "{said}");
    let (ok, said) = check("[kv]\nmemory_mb = 96\n", &[]);
    assert!(!ok && said.contains("memory_mb") && said.contains("line 3"), "{said}");
    let (ok, said) = check("", &[("WARDEN_LIMITS__QUEUE", "0")]);
    assert!(!ok && said.contains("limits.queue = 0"), "{said}");
    let (ok, said) = check("", &[("WARDEN_LISTN", "0.0.0.0:1")]);
    assert!(
        ok && said.contains("WARDEN_LISTN names no configuration key") && said.contains("ignored"),
        "{said}"
    );
    let (ok, said) = check("", &[("WARDEN_KV__MEMORY_MB", "96")]);
    assert!(
        !ok && said.contains("memory_mb") && said.contains("WARDEN_KV__MEMORY_MB"),
        "{said}"
    );
    let (ok, said) = check("[[models]]\npath = \"nowhere.gguf\"\n", &[]);
    assert!(!ok && said.contains("set model (one model) or [[models]]"), "{said}");
    std::fs::write(dir.join("m.toml"), "model = \"nowhere.gguf\"\n").unwrap();
    let out = std::process::Command::new(common::warden_bin())
        .args(["config", "check"])
        .arg(dir.join("m.toml"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("nowhere.gguf") && said.contains("not found"),
        "{said}"
    );
    // A file's relative paths are its directory's: the same answer from any working directory.
    std::os::unix::fs::symlink(common::model(), dir.join("rel.gguf")).unwrap();
    std::fs::write(dir.join("rel.toml"), "model = \"rel.gguf\"\ndata_dir = \"d\"\n").unwrap();
    for cwd in [dir.clone(), std::path::PathBuf::from("/")] {
        let out = std::process::Command::new(common::warden_bin())
            .args(["config", "check"])
            .arg(dir.join("rel.toml"))
            .current_dir(&cwd)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        let expected = format!("data_dir {}, serving rel", dir.join("d").display());
        assert!(out.status.success() && said.contains(&expected), "from {cwd:?}: {said}");
    }
    // --log-format is a choice, refused by name.
    let out = std::process::Command::new(common::warden_bin())
        .args(["--log-format", "yaml", "config", "check"])
        .arg(dir.join("m.toml"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("possible values: text, json"),
        "{said}"
    );
    // Flags over the file: the server listens where --listen says and keeps its state where
    // --data-dir says.
    let data = dir.join("elsewhere");
    common::write_default_policy(&dir);
    std::fs::write(
        dir.join("f.toml"),
        format!(
            "listen = \"127.0.0.1:1\"\nmodel = {:?}\npolicies = {:?}\n",
            common::model(),
            dir.join("policies")
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(common::warden_bin())
        .args(["serve", "--config"])
        .arg(dir.join("f.toml"))
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .args(["--served-model-name", "org/chat-1", "--threads", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its log, up to the line that says it serves (written after server.json).
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut log = String::new();
    for line in std::io::BufRead::lines(stderr).map_while(Result::ok) {
        log.push_str(&line);
        log.push('\n');
        if line.contains("serving ") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let info = std::fs::read_to_string(data.join("server.json"))
        .unwrap_or_else(|e| panic!("the server wrote no state under --data-dir ({e}): {log}"));
    assert!(info.contains("127.0.0.1:") && !info.contains("127.0.0.1:1\""), "{info}");
    // --served-model-name names the model; --threads sizes the compute pool.
    assert!(
        log.contains("serving org/chat-1 on") && log.contains("compute pool: 1 threads"),
        "{log}"
    );
    let (ok, said) = check("served_model_name = \"bad name\"\n", &[]);
    assert!(!ok && said.contains("set served_model_name"), "{said}");
}

/// A replaced TLS certificate and key take effect for new connections within a second or two
/// (and at once on SIGHUP), while a stream open on the old one runs to its end.
#[test]
fn a_rotated_certificate_is_served_without_dropping_open_connections() {
    let s = Server::start("tlsrotate", "");
    rt().block_on(async {
        let c = s.client();
        let body = chat_body(MODEL, "Write a long story about a dragon.", 48, true);
        let open = c
            .send(
                Proto::Http1,
                Method::POST,
                "/v1/chat/completions",
                Some(s.key()),
                Some(body),
            )
            .await
            .expect("stream");
        assert_eq!(open.status().as_u16(), 200);
        // Rotate: write the new pair beside the old and rename, as certificate managers do.
        let dir = s.cert.parent().expect("tls dir").to_path_buf();
        let next = rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("certificate");
        std::fs::write(dir.join("key.pem.new"), next.key_pair.serialize_pem()).unwrap();
        std::fs::write(dir.join("cert.pem.new"), next.cert.pem()).unwrap();
        let old_cert = dir.join("old.pem");
        std::fs::copy(&s.cert, &old_cert).unwrap();
        std::fs::rename(dir.join("key.pem.new"), dir.join("key.pem")).unwrap();
        std::fs::rename(dir.join("cert.pem.new"), &s.cert).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // A client that trusts only the new certificate gets through once it is served.
            let fresh = warden::serve::client::Client::new(&s.url, Some(&s.cert)).expect("client");
            if let Ok(r) = fresh.request(Method::GET, "/healthz", None, None).await {
                assert_eq!(r.status, 200);
                break;
            }
            assert!(Instant::now() < deadline, "the new certificate was never served");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let stale = warden::serve::client::Client::new(&s.url, Some(&old_cert)).expect("client");
        assert!(
            stale.request(Method::GET, "/healthz", None, None).await.is_err(),
            "the old certificate is gone"
        );
        // The stream opened before goes on to its end.
        let text = String::from_utf8_lossy(&open.into_body().collect().await.expect("body").to_bytes()).into_owned();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        let said: Vec<String> = s.output.try_iter().collect();
        assert!(said.iter().any(|l| l.contains("TLS certificate reloaded")), "{said:?}");
    });
}

/// Resident memory of process `pid`, MiB.
fn rss_mib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        >> 10
}

/// Waits up to two seconds for no `check-grammar` child of `pid` to be left (a stopped one is
/// killed and reaped as its answer goes out, not necessarily before); how many are left.
fn checking_children_left(pid: u32) -> usize {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let n = checking_children(pid);
        if n == 0 || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Children of `pid` running `warden check-grammar`.
fn checking_children(pid: u32) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    dir.filter_map(|e| e.ok())
        .filter(|e| {
            let p = e.path();
            let parent = std::fs::read_to_string(p.join("stat")).ok().and_then(|s| {
                s.rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().nth(1))
                    .map(str::to_string)
            });
            let cmd = std::fs::read(p.join("cmdline")).unwrap_or_default();
            parent.as_deref() == Some(pid.to_string().as_str())
                && String::from_utf8_lossy(&cmd).contains("check-grammar")
        })
        .count()
}

#[test]
fn schema_compiles_are_stopped_at_their_limits_kept_per_tenant_and_taken_in_turns() {
    // One compile at a time, over all tenants, each stopped at 600 ms.
    let s = Server::start("schemas", "[limits]\nschema_compile_ms = 600\nschema_compiles = 1\n");
    let key = s.key().to_string();
    let pid = s.pid();
    let with_schema = |schema: serde_json::Value| {
        json!({
            "model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "A number, please."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        })
        .to_string()
        .into_bytes()
    };
    // Forty divisors of four digits: each compiles into a 9,973-state automaton, seconds of
    // work in all, in a 1.6 KB schema.
    let slow = |salt: u64| {
        let props: serde_json::Map<String, serde_json::Value> = (0..40)
            .map(|i| {
                (
                    format!("p{i}"),
                    json!({"type": "integer", "multipleOf": 9973 - 2 * i - 100 * salt}),
                )
            })
            .collect();
        json!({"type": "object", "properties": props, "required": ["p0"]})
    };
    rt().block_on(async {
        let c = s.client();
        let mallory = s.tenant_with_key("mallory").await;
        let post = |k: String, body: Vec<u8>| {
            let c = c.clone();
            async move {
                let t0 = Instant::now();
                let r = c
                    .request(Method::POST, "/v1/chat/completions", Some(&k), Some(body))
                    .await
                    .expect("request");
                (r, t0.elapsed())
            }
        };
        // A divisor whose automaton alone is seconds and hundreds of MiB is refused by name,
        // before anything compiles.
        let (r, took) = post(
            key.clone(),
            with_schema(json!({"type": "integer", "multipleOf": 999983})),
        )
        .await;
        assert_eq!(r.status, 400, "{}", r.text());
        let e = &r.json().unwrap()["error"];
        assert_eq!(
            (e["code"].as_str(), e["param"].as_str()),
            (Some("invalid_parameter"), Some("response_format"))
        );
        assert!(r.text().contains("multipleOf 999983"), "{}", r.text());
        assert!(took < Duration::from_millis(500), "{took:?}");
        // A compile that runs past its time is stopped: the work ends (no checking process is
        // left) and its memory goes with it.
        let before = rss_mib(pid);
        let (r, took) = post(mallory.clone(), with_schema(slow(0))).await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.text().contains("took longer than 600 ms"), "{}", r.text());
        assert!(took < Duration::from_millis(1500), "{took:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(checking_children_left(pid), 0, "a stopped compile left its process");
        let after = rss_mib(pid);
        assert!(after < before + 32, "the server grew from {before} to {after} MiB");
        // The same schema again is answered from what the tenant compiled before, at once.
        let (r, took) = post(mallory.clone(), with_schema(slow(0))).await;
        assert!(r.text().contains("took longer than 600 ms"), "{}", r.text());
        assert!(took < Duration::from_millis(200), "{took:?}");
        // Mallory sends four more at once; the other tenant's schema waits for at most the one
        // of hers under way, not all four.
        let flood: Vec<_> = (1..5)
            .map(|i| tokio::spawn(post(mallory.clone(), with_schema(slow(i)))))
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let number =
            json!({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]});
        let (r, took) = post(key.clone(), with_schema(number)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let mut mallorys = Vec::new();
        for f in flood {
            let (r, t) = f.await.unwrap();
            assert_eq!(r.status, 400, "{}", r.text());
            mallorys.push(t);
        }
        eprintln!("the other tenant's structured request took {took:?}; mallory's: {mallorys:?}");
        // Behind all four it would wait at least 2.4 s.
        assert!(took < Duration::from_millis(1800), "{took:?}");
        assert_eq!(checking_children_left(pid), 0);
    });
}

/// Whatever the server answers before (or without) reading a request's whole body, an HTTP/2
/// client gets all of it: 200 of each early answer, each with its status and its JSON. The
/// client is curl (the README's examples use it), which found the fault: it gives up a
/// response, with "stream error in the HTTP/2 framing layer", when the stream is reset while it
/// is still sending the body. Each body is larger than HTTP/2's first flow-control window
/// (64 KiB), so it is still arriving when the answer goes out.
#[test]
fn every_early_answer_reaches_an_http2_client_whole() {
    let s = Server::start_with_policies(
        "early",
        "[plugins]\nmax_component_bytes = 1048576\n",
        &[("tenants/slow.toml", "requests_per_minute = 1\n")],
    );
    let dir = s.data_dir.join("early");
    std::fs::create_dir_all(&dir).expect("a directory for the bodies");
    // A valid chat request, padded (JSON allows trailing whitespace) past the window; and one
    // past the body limits (1 MiB).
    let mut big = chat_body(MODEL, "hi", 1, false);
    big.resize(256 << 10, b' ');
    let mut over = big.clone();
    over.resize(2 << 20, b' ');
    let (big_file, over_file) = (dir.join("big.json"), dir.join("over.json"));
    std::fs::write(&big_file, &big).expect("write a body");
    std::fs::write(&over_file, &over).expect("write a body");
    let key = s.key().to_string();
    let slow = rt().block_on(async {
        let slow = s.tenant_with_key("slow").await;
        // The slow tenant's one request a minute, used.
        let r = s
            .client()
            .request(Method::POST, "/v1/chat/completions", Some(&slow), Some(big.clone()))
            .await
            .expect("reply");
        assert_eq!(r.status, 200, "{}", r.text());
        slow
    });
    let chat = "/v1/chat/completions";
    let cases = [
        (
            "a wrong key",
            "POST",
            chat,
            "wdn-0123456789abcdef-nope",
            &big_file,
            401,
            "invalid_api_key",
        ),
        (
            "an unknown path",
            "POST",
            "/v1/nothing",
            &key,
            &big_file,
            404,
            "not_found",
        ),
        (
            "a wrong method",
            "POST",
            "/v1/models",
            &key,
            &big_file,
            405,
            "method_not_allowed",
        ),
        (
            "a body over its limit",
            "POST",
            chat,
            &key,
            &over_file,
            413,
            "body_too_large",
        ),
        (
            "a rate limit",
            "POST",
            chat,
            &slow,
            &big_file,
            429,
            "rate_limit_requests",
        ),
        (
            "an upload over its limit",
            "PUT",
            "/v1/plugins/p",
            &key,
            &over_file,
            413,
            "component_too_large",
        ),
    ];
    for (k, (name, method, path, bearer, body, status, code)) in cases.into_iter().enumerate() {
        let out = dir.join(format!("case{k}"));
        std::fs::create_dir_all(&out).expect("a directory for the answers");
        // 200 requests, 8 at a time, each on its own stream and the answers in files.
        let run = std::process::Command::new("curl")
            .args(["--silent", "--http2", "--parallel", "--parallel-max", "8", "--cacert"])
            .arg(&s.cert)
            .args(["-X", method, "-H", &format!("authorization: Bearer {bearer}")])
            .args(["-H", "content-type: application/json", "--data-binary"])
            .arg(format!("@{}", body.display()))
            .arg("--output")
            .arg(out.join("#1"))
            .args(["--write-out", "%{http_code} %{exitcode}\\n"])
            .arg(format!("{}{path}?n=[1-200]", s.url))
            .output()
            .expect("this test drives curl, the HTTP/2 client that found the fault: install curl");
        // Each answer's status and curl's exit code: an answer lost is `000 92`. (curl stops
        // sending a body over its limit once the answer arrives, and may then report the
        // stream's end as an error though the answer came whole: the status and the JSON
        // are what must arrive.)
        let lines = String::from_utf8_lossy(&run.stdout).into_owned();
        let lost: Vec<&str> = lines
            .lines()
            .filter(|l| !l.starts_with(&format!("{status} ")))
            .collect();
        assert_eq!(lines.lines().count(), 200, "{name}: {lines}");
        assert!(
            lost.is_empty(),
            "{name}: {} of 200 answers lost: {:?}",
            lost.len(),
            &lost[..lost.len().min(3)]
        );
        for n in 1..=200 {
            let answer = std::fs::read(out.join(n.to_string())).expect("an answer");
            let v: serde_json::Value = serde_json::from_slice(&answer).expect("JSON");
            assert_eq!(v["error"]["code"], code, "{name}: {v}");
        }
    }
}

/// The CLI reaches its server as deployed: listening on every address (the container case),
/// and serving an operator's certificate, issued by the operator's CA for a public name (not
/// for loopback). `server.json` names a loopback URL, and the CLI trusts the certificate the
/// server serves from its file, whatever names it carries.
#[test]
fn the_cli_reaches_a_server_on_every_address_and_with_an_operators_certificate() {
    for operator in [false, true] {
        let dir = common::temp_dir(if operator { "cli-operator" } else { "cli-any" });
        let mut tls = String::new();
        if operator {
            // A CA and a certificate for api.example.test, by the project's own command.
            let certs = dir.join("certs");
            let o = std::process::Command::new(common::warden_bin())
                .args(["cluster", "certs", "--out"])
                .arg(&certs)
                .arg("api.example.test")
                .output()
                .expect("warden cluster certs");
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            tls = format!(
                "[tls]\ncert = {:?}\nkey = {:?}\n",
                certs.join("api.example.test.pem"),
                certs.join("api.example.test.key")
            );
        }
        common::write_default_policy(&dir);
        let config = dir.join("warden.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"0.0.0.0:0\"\ndata_dir = {:?}\nmodel = {:?}\npolicies = {:?}\n{tls}",
                dir.join("data"),
                common::model(),
                dir.join("policies")
            ),
        )
        .expect("write config");
        let _s = Server::start_with(dir.clone(), config);
        let info: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("data/server.json")).expect("server.json")).expect("json");
        let url = info["url"].as_str().expect("url");
        assert!(url.starts_with("https://127.0.0.1:"), "{info}");
        let out = std::process::Command::new(common::warden_bin())
            .args(["tenant", "create", "zeta", "--data-dir"])
            .arg(dir.join("data"))
            .output()
            .expect("run warden");
        assert!(
            out.status.success(),
            "operator certificate {operator}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `POST /tokenize` and `/detokenize` in vLLM's shape: a prompt's ids are those a completion
/// counts, a conversation's those a chat counts, and the ids come back as the text; each is a
/// request of its tenant (a key, its requests per minute), and bad input is named.
#[test]
fn tokenize_and_detokenize_answer_in_vllms_shape_as_requests_of_their_tenant() {
    let s = Server::start_with_policies("tokenize", "", &[("default.toml", "requests_per_minute = 12\n")]);
    rt().block_on(async {
        let c = s.client();
        let post = |path: &'static str, body: serde_json::Value, key: Option<&str>| {
            let (c, key) = (c.clone(), key.map(str::to_string));
            async move {
                c.request(Method::POST, path, key.as_deref(), Some(body.to_string().into_bytes()))
                    .await
                    .expect("request")
            }
        };
        let key = Some(s.key());
        let text = "The quick brown fox jumps over the lazy dog.";
        let r = post(
            "/tokenize",
            json!({"model": MODEL, "prompt": text, "return_token_strs": true}),
            key,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json().unwrap();
        let tokens: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
        assert_eq!(v["count"], tokens.len());
        assert!(v["max_model_len"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(v["token_strs"].as_array().unwrap().len(), tokens.len());
        let r = post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": text, "max_tokens": 1}),
            key,
        )
        .await;
        assert_eq!(
            r.json().unwrap()["usage"]["prompt_tokens"],
            tokens.len(),
            "a completion counts as many"
        );
        // The model may be left out where the server serves one.
        let r = post("/detokenize", json!({"tokens": tokens}), key).await;
        assert_eq!((r.status, r.json().unwrap()["prompt"].clone()), (200, json!(text)));
        let messages = json!([{"role": "user", "content": "Hi there"}]);
        let r = post("/tokenize", json!({"model": MODEL, "messages": messages}), key).await;
        let chat_count = r.json().unwrap()["count"].clone();
        let r = post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": messages, "max_tokens": 1}),
            key,
        )
        .await;
        assert_eq!(r.json().unwrap()["usage"]["prompt_tokens"], chat_count);
        let r = post(
            "/tokenize",
            json!({"messages": messages, "add_generation_prompt": false}),
            key,
        )
        .await;
        assert!(
            r.json().unwrap()["count"].as_u64() < chat_count.as_u64(),
            "no assistant turn opened"
        );
        // Bad input, named.
        let r = post("/detokenize", json!({"tokens": [1, 99_999_999]}), key).await;
        assert_eq!(r.status, 400);
        assert_eq!(r.json().unwrap()["error"]["param"], "tokens[1]");
        let r = post("/tokenize", json!({"prompt": "a", "messages": messages}), key).await;
        assert_eq!(r.status, 400, "{}", r.text());
        let r = post("/tokenize", json!({"prompt": "a", "add_generation_prompt": true}), key).await;
        assert_eq!(r.json().unwrap()["error"]["param"], "add_generation_prompt");
        let r = post("/tokenize", json!({"prompt": "a", "temperature": 1}), key).await;
        assert_eq!(r.status, 400, "{}", r.text());
        let r = post("/tokenize", json!({"model": "nope", "prompt": "a"}), key).await;
        assert_eq!(r.status, 404);
        let r = post("/tokenize", json!({"prompt": "a"}), None).await;
        assert_eq!(r.status, 401);
        // Each admitted one counts against the tenant's requests per minute: 12, 7 spent above
        // (a body refused before its model is known is not admitted).
        let mut statuses = Vec::new();
        for _ in 0..6 {
            statuses.push(post("/tokenize", json!({"prompt": "a"}), key).await.status);
        }
        assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);
    });
}

/// What browsers, proxies and OpenAI's clients look for: CORS for the configured origins (the
/// preflight answered before any key, another origin refused), `x-ratelimit-*` headers from
/// the tenant's policy (on a refusal too), the limits and what is left in `/v1/usage`, and the
/// client's address (from `X-Forwarded-For` only through a trusted proxy) and user agent in the
/// access line.
#[test]
fn browsers_proxies_and_rate_limit_readers_get_what_they_look_for() {
    let s = Server::start_with_env(
        "cors",
        "[http]\nallowed_origins = [\"https://app.example.com\"]\ntrusted_proxies = [\"127.0.0.0/8\"]\n",
        &[(
            "default.toml",
            "requests_per_minute = 3\ntokens_per_minute = 5000\ntokens_per_day = 90000\nconcurrent_requests = 4\n",
        )],
        &[("WARDEN_LOG_FORMAT", "json")],
    );
    rt().block_on(async {
        let origin = "https://app.example.com";
        let preflight = s
            .client()
            .with_header("origin", origin)
            .with_header("access-control-request-method", "POST")
            .with_header(
                "access-control-request-headers",
                "authorization, content-type, x-stainless-os",
            )
            .request(Method::OPTIONS, "/v1/chat/completions", None, None)
            .await
            .unwrap();
        assert_eq!(preflight.status, 204, "{}", preflight.text());
        let h = &preflight.headers;
        assert_eq!(h["access-control-allow-origin"], origin);
        assert!(h["access-control-allow-methods"].to_str().unwrap().contains("POST"));
        assert!(
            h["access-control-allow-headers"]
                .to_str()
                .unwrap()
                .contains("x-stainless-os")
        );
        assert_eq!(h.get_all("vary").iter().count(), 1, "{h:?}");
        let refused = s
            .client()
            .with_header("origin", "https://evil.example")
            .with_header("access-control-request-method", "POST")
            .request(Method::OPTIONS, "/v1/chat/completions", None, None)
            .await
            .unwrap();
        assert_eq!(refused.status, 403);
        assert_eq!(refused.json().unwrap()["error"]["code"], "origin_not_allowed");
        assert!(!refused.headers.contains_key("access-control-allow-origin"));
        // A page's request, through a trusted proxy (loopback here) that names its client.
        let c = s
            .client()
            .with_header("origin", origin)
            .with_header("x-forwarded-for", "203.0.113.9")
            .with_header("user-agent", "OpenAI/JS\tbad é");
        let r = c
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(s.key()),
                Some(chat_body(MODEL, "Hi", 4, false)),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let h = &r.headers;
        assert_eq!(h["access-control-allow-origin"], origin);
        assert!(
            h["access-control-expose-headers"]
                .to_str()
                .unwrap()
                .contains("x-ratelimit-remaining-requests")
        );
        assert_eq!(h["x-ratelimit-limit-requests"], "3");
        assert_eq!(h["x-ratelimit-remaining-requests"], "2");
        assert!(h["x-ratelimit-reset-requests"].to_str().unwrap().ends_with('s'));
        assert_eq!(h["x-ratelimit-limit-tokens"], "5000");
        let left: u64 = h["x-ratelimit-remaining-tokens"].to_str().unwrap().parse().unwrap();
        assert!(left < 5000, "the request's tokens are spent: {left}");
        // Another origin's request gets no CORS headers (the browser keeps its answer from it).
        let r = s
            .client()
            .with_header("origin", "https://evil.example")
            .request(Method::GET, "/v1/models", Some(s.key()), None)
            .await
            .unwrap();
        assert!(r.status == 200 && !r.headers.contains_key("access-control-allow-origin"));
        let usage = s
            .client()
            .request(Method::GET, "/v1/usage", Some(s.key()), None)
            .await
            .unwrap();
        let limits = usage.json().unwrap()["limits"].clone();
        assert_eq!(limits["requests_per_minute"]["limit"], 3);
        assert_eq!(
            limits["requests_per_minute"]["remaining"], 2,
            "only generation counts: {limits}"
        );
        assert_eq!(limits["tokens_per_day"]["limit"], 90000);
        assert_eq!(
            limits["tokens_per_day"]["remaining"].as_u64().unwrap()
                + limits["tokens_per_day"]["used"].as_u64().unwrap(),
            90000,
            "{limits}"
        );
        assert_eq!(limits["concurrent_requests"]["limit"], 4);
        assert!(limits["tokens_per_month"].is_null(), "a limit the policy does not set");
        // The refusal carries them too.
        for _ in 0..2 {
            let body = json!({"prompt": "Hi"}).to_string().into_bytes();
            let r = s
                .client()
                .request(Method::POST, "/tokenize", Some(s.key()), Some(body))
                .await
                .unwrap();
            assert_eq!(r.status, 200);
        }
        let r = s
            .client()
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(s.key()),
                Some(chat_body(MODEL, "Hi", 4, false)),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.headers["x-ratelimit-remaining-requests"], "0");
    });
    // The access line: the forwarded client, the user agent made plain.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut line = None;
    while line.is_none() && Instant::now() < deadline {
        if let Ok(l) = s.output.recv_timeout(Duration::from_millis(100))
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&l)
            && v["target"] == "warden::access"
            && v["route"] == "/v1/chat/completions"
            && v["method"] == "POST"
        {
            line = Some(v);
        }
    }
    let line = line.expect("an access line for the chat");
    assert_eq!(line["client"], "203.0.113.9", "{line}");
    assert_eq!(line["user_agent"], "OpenAI/JS?bad ??", "{line}");
}
