//! Per-tenant policies through the real server: every limit refused before the work it limits,
//! with its code (and `Retry-After` for rates and usage); hot reload of good and bad files; usage
//! that a tenant sees for itself only and that survives a restart and a `kill -9`.

mod common;

use std::time::{Duration, Instant};

use hyper::Method;
use serde_json::{Value, json};
use warden::serve::client::{Client, Reply};

use common::{MODEL, Server, chat_body, rt};

async fn chat(c: &Client, key: &str, content: &str, max_tokens: Option<usize>) -> Reply {
    let mut v = json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0});
    if let Some(m) = max_tokens {
        v["max_tokens"] = json!(m);
    }
    c.request(
        Method::POST,
        "/v1/chat/completions",
        Some(key),
        Some(v.to_string().into_bytes()),
    )
    .await
    .expect("request")
}

fn code(r: &Reply) -> String {
    r.json()
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_default()
}

fn retry_after(r: &Reply) -> u64 {
    r.headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After on {} {}", r.status, r.text()))
}

async fn usage(c: &Client, key: &str) -> Value {
    let r = c
        .request(Method::GET, "/v1/usage", Some(key), None)
        .await
        .expect("usage");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json().unwrap()
}

const POLICIES: &[(&str, &str)] = &[
    ("default.toml", "max_tokens = 64\n"),
    ("tenants/rpm.toml", "requests_per_minute = 2\n"),
    ("tenants/tpm.toml", "tokens_per_minute = 300\nmax_tokens = 500\n"),
    ("tenants/daily.toml", "tokens_per_day = 100\n"),
    ("tenants/conc.toml", "concurrent_requests = 1\n"),
    (
        "tenants/strict.toml",
        "max_tokens = 8\nmax_context = 45\nallowed_plugins = [\"none-of-these\"]\n",
    ),
    ("tenants/nomodel.toml", "allowed_models = []\n"),
    ("tenants/kv.toml", "[kv]\nmax_pages = 3\nprefix_cache = \"off\"\n"),
    ("tenants/open.toml", "tokens_per_minute = 60\n"),
];

#[test]
fn every_limit_is_refused_before_its_work_with_its_code() {
    let s = Server::start_with_policies("policy-limits", "", POLICIES);
    rt().block_on(async {
        let c = s.client();
        let mut keys = std::collections::HashMap::new();
        for t in ["rpm", "tpm", "daily", "conc", "strict", "nomodel", "kv", "open"] {
            keys.insert(t, s.tenant_with_key(t).await);
        }
        let free = s.key().to_string();
        let q = "Name a color.";

        // Requests per minute: two, then 429 with the wait until the bucket has room.
        for _ in 0..2 {
            assert_eq!(chat(&c, &keys["rpm"], q, Some(2)).await.status, 200);
        }
        let r = chat(&c, &keys["rpm"], q, Some(2)).await;
        assert_eq!((r.status, code(&r).as_str()), (429, "rate_limit_requests"), "{}", r.text());
        assert!((1..=30).contains(&retry_after(&r)), "{}", retry_after(&r));
        assert_eq!(chat(&c, &free, q, Some(2)).await.status, 200, "other tenants are unaffected");

        // Tokens per minute: a request reserves its prompt (34 tokens) + max_tokens and gets back
        // what it did not use (its reply is about 22 tokens); one that could never fit is a
        // 400, one that would fit later a 429.
        let r = chat(&c, &keys["tpm"], q, Some(300)).await;
        assert_eq!((r.status, code(&r).as_str()), (400, "request_over_token_rate"), "{}", r.text());
        let r = chat(&c, &keys["tpm"], q, Some(150)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let r = chat(&c, &keys["tpm"], q, Some(150)).await;
        assert_eq!(r.status, 200, "without the first request's refund, 2 x 184 > 300: {}", r.text());
        let mut refused = None;
        for _ in 0..4 {
            let r = chat(&c, &keys["tpm"], q, Some(150)).await;
            if r.status != 200 {
                refused = Some(r);
                break;
            }
        }
        let r = refused.expect("the minute's tokens run out");
        assert_eq!((r.status, code(&r).as_str()), (429, "rate_limit_tokens"), "{}", r.text());
        assert!((1..=60).contains(&retry_after(&r)));

        // Tokens per day: the book counts what requests used, and refuses what would pass it,
        // with the time to the next UTC day.
        let mut last = None;
        for _ in 0..6 {
            let r = chat(&c, &keys["daily"], q, Some(8)).await;
            if r.status != 200 {
                last = Some(r);
                break;
            }
        }
        let r = last.expect("the day's tokens run out");
        assert_eq!((r.status, code(&r).as_str()), (429, "quota_tokens_day"), "{}", r.text());
        assert!(retry_after(&r) <= 86_400);
        let used = usage(&c, &keys["daily"]).await["day"]["tokens"].as_u64().unwrap();
        assert!(used <= 100 && used > 50, "{used}");

        // Concurrency: one request in flight; a second waits for it.
        let body = chat_body(MODEL, "Write a long story about a dragon.", 64, true);
        let long = c
            .send(common_proto(), Method::POST, "/v1/chat/completions", Some(&keys["conc"]), Some(body))
            .await
            .unwrap();
        assert_eq!(long.status().as_u16(), 200);
        let r = chat(&c, &keys["conc"], q, Some(2)).await;
        assert_eq!((r.status, code(&r).as_str()), (429, "concurrency_limit"), "{}", r.text());
        assert_eq!(retry_after(&r), 1);
        drop(long);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = chat(&c, &keys["conc"], q, Some(2)).await;
            if r.status == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "the slot never came back: {}", r.text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Each choice is a sequence in flight: two choices never fit a limit of one.
        let two = json!({"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 2, "n": 2});
        let r = c
            .request(Method::POST, "/v1/chat/completions", Some(&keys["conc"]), Some(two.to_string().into_bytes()))
            .await
            .expect("request");
        assert_eq!((r.status, code(&r).as_str()), (400, "n_over_concurrency"), "{}", r.text());

        // Static limits: 400 or 403, naming the limit.
        let r = chat(&c, &keys["strict"], q, Some(9)).await;
        assert_eq!((r.status, code(&r).as_str()), (400, "max_tokens_over_policy"), "{}", r.text());
        let r = chat(&c, &keys["strict"], q, None).await;
        assert_eq!(r.status, 200, "no max_tokens: the policy's applies");
        assert!(r.json().unwrap()["usage"]["completion_tokens"].as_u64().unwrap() <= 8);
        let long_q = "Tell me everything about the history of the Roman Empire, from its founding to its fall.";
        let r = chat(&c, &keys["strict"], long_q, Some(8)).await;
        assert_eq!((r.status, code(&r).as_str()), (400, "context_over_policy"), "{}", r.text());
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 2, "plugin": "anything"});
        let r = c
            .request(Method::POST, "/v1/chat/completions", Some(&keys["strict"]), Some(body.to_string().into_bytes()))
            .await
            .unwrap();
        assert_eq!((r.status, code(&r).as_str()), (403, "plugin_not_allowed"), "{}", r.text());
        let r = chat(&c, &keys["nomodel"], q, Some(2)).await;
        assert_eq!((r.status, code(&r).as_str()), (403, "model_not_allowed"), "{}", r.text());
        let r = chat(&c, &free, q, Some(65)).await;
        assert_eq!(code(&r), "max_tokens_over_policy", "default.toml applies to tenants without a file");

        // KV: a cap of 3 pages (48 tokens) refuses a request that could never fit, before any
        // page is allocated; with the prefix cache off, nothing is reused.
        let r = chat(&c, &keys["kv"], q, Some(40)).await;
        assert_eq!((r.status, code(&r).as_str()), (400, "kv_budget_exceeded"), "{}", r.text());
        for _ in 0..2 {
            let r = chat(&c, &keys["kv"], q, Some(4)).await;
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        }

        // A request that names no max_tokens runs to the end of its context, or to what its
        // tenant may have: it is admitted when its prompt fits its KV cap, and ends with
        // `length` where its pages would outgrow it (48 positions; the token sampled from the
        // last is the 49th), or where its tokens per minute end.
        let story = "Write a long story about a dragon.";
        for (tenant, most) in [("kv", 49), ("open", 60)] {
            let r = chat(&c, &keys[tenant], story, None).await;
            assert_eq!(r.status, 200, "{tenant}: {}", r.text());
            let v = r.json().unwrap();
            assert_eq!(v["choices"][0]["finish_reason"], "length", "{tenant}: {v}");
            let (p, n) = (v["usage"]["prompt_tokens"].as_u64().unwrap(), v["usage"]["completion_tokens"].as_u64().unwrap());
            assert_eq!(p + n, most, "{tenant}: {v}");
        }

        // Usage: each tenant sees its own counters, rejections by code; the admin sees all.
        let u = usage(&c, &keys["rpm"]).await;
        assert_eq!(u["tenant"], "rpm");
        assert_eq!(u["requests"], 2);
        assert_eq!(u["rejections"]["rate_limit_requests"], 1);
        let u = usage(&c, &keys["strict"]).await;
        for code in ["max_tokens_over_policy", "context_over_policy", "plugin_not_allowed"] {
            assert_eq!(u["rejections"][code], 1, "{code}: {u}");
        }
        assert!(u["prompt_tokens"].as_u64().unwrap() > 0 && u.get("rpm").is_none());
        let r = c.request(Method::GET, "/admin/v1/usage", Some(&s.admin), None).await.unwrap();
        let all = r.json().unwrap()["data"].clone();
        for t in ["rpm", "tpm", "daily", "conc", "strict", "nomodel", "kv", "open", "default"] {
            assert!(all.get(t).is_some(), "{t} in {all}");
        }
        let r = c.request(Method::GET, "/admin/v1/usage", Some(&free), None).await.unwrap();
        assert_eq!(r.status, 401, "a tenant key is not the admin");
        assert_eq!(s.metric("warden_kv_pages{state=\"used\"}").await, 0.0);
    });
}

fn common_proto() -> warden::serve::client::Proto {
    warden::serve::client::Proto::Http1
}

fn write(s: &Server, name: &str, text: &str) {
    let p = s.data_dir.join("policies").join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    // Write then rename, as editors and config management do: the reload never sees half a file.
    let tmp = p.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
}

async fn version(s: &Server) -> String {
    let m = s.metrics().await;
    m.lines()
        .find_map(|l| {
            l.strip_prefix("warden_policy_info{version=\"")
                .and_then(|r| r.split('"').next())
        })
        .expect("warden_policy_info")
        .to_string()
}

async fn wait_for_version_change(s: &Server, from: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = version(s).await;
        if v != from {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "the policy version never changed from {from}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn policies_reload_on_change_and_a_bad_file_leaves_the_last_good_set() {
    let s = Server::start_with_policies("policy-reload", "", &[("tenants/default.toml", "max_tokens = 4\n")]);
    let key = s.key().to_string();
    rt().block_on(async {
        let c = s.client();
        let v1 = version(&s).await;
        assert_eq!(code(&chat(&c, &key, "Hi.", Some(5)).await), "max_tokens_over_policy");
        write(&s, "tenants/default.toml", "max_tokens = 8\n");
        let v2 = wait_for_version_change(&s, &v1).await;
        assert_eq!(
            chat(&c, &key, "Hi.", Some(5)).await.status,
            200,
            "the new file is in force"
        );
        // A bad file: refused with file, line and key; the previous set stays.
        write(&s, "tenants/default.toml", "max_tokens = 2\nmax_tokenz = 3\n");
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.metric("warden_policy_reload_failures_total").await < 1.0 {
            assert!(Instant::now() < deadline, "the bad file was never reported");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let said: Vec<String> = s.output.try_iter().collect();
        let line = said
            .iter()
            .find(|l| l.contains("policies: refused"))
            .unwrap_or_else(|| panic!("{said:?}"));
        assert!(
            line.contains("tenants/default.toml:2") && line.contains("max_tokenz") && line.contains(&v2),
            "{line}"
        );
        assert_eq!(version(&s).await, v2);
        assert_eq!(chat(&c, &key, "Hi.", Some(5)).await.status, 200, "max_tokens = 8 still");
        // A good file again, picked up at once on SIGHUP.
        write(&s, "tenants/default.toml", "max_tokens = 3\n");
        let _ = std::process::Command::new("kill")
            .args(["-HUP", &s.pid().to_string()])
            .status();
        wait_for_version_change(&s, &v2).await;
        assert_eq!(code(&chat(&c, &key, "Hi.", Some(5)).await), "max_tokens_over_policy");
        assert_eq!(
            s.metric("warden_policy_reload_failures_total").await,
            1.0,
            "one bad file, counted once"
        );
    });
}

const SYSTEM: &str = "You are the support assistant of Example Corp. Answer questions about orders, shipping and returns briefly and politely, and never discuss other customers.";

#[test]
fn a_public_prefix_is_shared_only_with_tenants_whose_policy_allows_it() {
    // The operator marks the rendered system turn public; tenant "open" may read it, tenant
    // "closed" keeps the default private cache.
    let default = format!("[public_prefixes]\nsupport = \"<|im_start|>system\\n{SYSTEM}<|im_end|>\\n\"\n");
    let s = Server::start_with_policies(
        "policy-public",
        "",
        &[
            ("default.toml", &default),
            ("tenants/open.toml", "[kv]\nprefix_cache = \"public\"\n"),
        ],
    );
    rt().block_on(async {
        let c = s.client();
        assert!(
            s.metric("warden_kv_pinned_pages").await >= 2.0,
            "the server pinned the prefix"
        );
        let ask = |key: String| {
            let c = c.clone();
            async move {
                let body = json!({"model": MODEL, "temperature": 0, "max_tokens": 8, "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Where is my order?"}]});
                let r = c
                    .request(
                        Method::POST,
                        "/v1/chat/completions",
                        Some(&key),
                        Some(body.to_string().into_bytes()),
                    )
                    .await
                    .expect("request");
                assert_eq!(r.status, 200, "{}", r.text());
                let v = r.json().unwrap();
                (
                    v["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
                    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
                )
            }
        };
        let open = s.tenant_with_key("open").await;
        let closed = s.tenant_with_key("closed").await;
        // The first request of "open" already starts from the public pages; "closed" computes
        // its whole prompt, and gets the same answer.
        let (a, cached) = ask(open).await;
        assert!(cached >= 32, "open's first request adopted {cached} public tokens");
        let (b, cached) = ask(closed).await;
        assert_eq!(cached, 0, "a private tenant never reads the public prefix");
        assert_eq!(a, b, "the same greedy answer from shared and computed KV");
    });
}

#[test]
fn usage_survives_a_restart_and_a_kill_9() {
    let mut s = Server::start("policy-usage", "");
    let key = s.key().to_string();
    let (data_dir, config) = (s.data_dir.clone(), s.config.clone());
    let before = rt().block_on(async {
        let c = s.client();
        for _ in 0..3 {
            assert_eq!(chat(&c, &key, "Name a fruit.", Some(4)).await.status, 200);
        }
        assert_eq!(chat(&c, &key, "x", Some(0)).await.status, 400);
        usage(&c, &key).await
    });
    assert_eq!(before["requests"], 3);
    assert_eq!(before["rejections"]["invalid_parameter"], 1);
    assert!(s.stop(), "graceful stop");
    let mut s = Server::start_with(data_dir.clone(), config.clone());
    let after_kill = rt().block_on(async {
        let c = s.client();
        assert_eq!(usage(&c, &key).await, before, "a graceful restart keeps every counter");
        for _ in 0..2 {
            assert_eq!(chat(&c, &key, "Name a fruit.", Some(4)).await.status, 200);
        }
        let u = usage(&c, &key).await;
        // The documented loss window is 1 s: wait it out, then kill without any shutdown.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        u
    });
    s.kill9();
    let s = Server::start_with(data_dir, config);
    rt().block_on(async {
        let c = s.client();
        let u = usage(&c, &key).await;
        assert_eq!(u, after_kill, "kill -9 lost nothing older than the loss window");
        assert_eq!(u["requests"], 5);
    });
}

/// `warden policies check DIR` loads a policy directory as the server does, against the pools
/// and tokenizers of the configuration's models, and exits non-zero with the server's message.
#[test]
fn policies_check_says_what_the_server_would() {
    let dir = common::temp_dir("polcheck");
    let cfg = dir.join("w.toml");
    std::fs::write(&cfg, format!("model = {:?}\n[kv]\nmemory_mib = 64\n", common::model())).unwrap();
    let check = |files: &[(&str, &str)]| {
        let p = dir.join(format!("p{}", rand::random::<u32>()));
        for (name, text) in files {
            let f = p.join(name);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(f, text).unwrap();
        }
        let out = std::process::Command::new(common::warden_bin())
            .args(["policies", "check"])
            .arg(&p)
            .arg("--config")
            .arg(&cfg)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), said)
    };
    let (ok, said) = check(&[
        ("default.toml", "max_tokens = 64\n"),
        ("tenants/acme.toml", "tokens_per_minute = 300\n"),
    ]);
    assert!(ok && said.contains(": ok (version "), "{said}");
    // The pool's sizing, as the server logs it at start.
    assert!(
        said.contains("KV pool of ") && said.contains("sequences at full context fit at once"),
        "{said}"
    );
    let (ok, said) = check(&[("tenants/acme.toml", "max_tokens = 2\nmax_tokenz = 3\n")]);
    assert!(
        !ok && said.contains("tenants/acme.toml:2") && said.contains("max_tokenz"),
        "{said}"
    );
    let (ok, said) = check(&[("tenants/big.toml", "[kv]\nmax_pages = 10000000\n")]);
    assert!(
        !ok && said.contains("tenants/big.toml") && said.contains("max_pages"),
        "{said}"
    );
    // A directory that is not there, or holds no policy, is refused: never a silent "no
    // limits".
    let (ok, said) = check(&[]);
    assert!(!ok && said.contains("no such directory"), "{said}");
    let (ok, said) = check(&[("notes.txt", "not a policy\n")]);
    assert!(!ok && said.contains("holds no policy"), "{said}");
}
