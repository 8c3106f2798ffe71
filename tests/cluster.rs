//! Disaggregated serving through real processes on loopback: a prefill node, a decode node and a
//! router (`warden serve --role ...`), against the single-process server.

mod common;

use std::time::Duration;

use http_body_util::BodyExt;
use hyper::Method;
use warden::serve::client::Proto;

use common::{MODEL, Node, Server, chat_body, content, rt, sse_content};

const NODE: &str = "[kv]\nmemory_mib = 64\n[limits]\nmax_context = 2048\n";

#[test]
fn a_cluster_serves_what_one_process_serves_and_its_pages_return() {
    let prefill = Node::start("c-prefill", "prefill", NODE);
    let decode = Node::start(
        "c-decode",
        "decode",
        &format!("{NODE}[cluster]\nops_listen = \"127.0.0.1:0\"\n"),
    );
    let router = Server::start_router("c-router", "", &[&prefill], &[&decode], &[]);
    let one = Server::start("c-all", NODE);
    rt().block_on(async {
        let ask = "What is the capital of France? Answer in one word.";
        let mut answers = Vec::new();
        for s in [&router, &one] {
            let r = s
                .client()
                .request(
                    Method::POST,
                    "/v1/chat/completions",
                    Some(s.key()),
                    Some(chat_body(MODEL, ask, 12, false)),
                )
                .await
                .expect("request");
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json().expect("json");
            answers.push((content(&r), v["usage"].clone()));
            // Streamed as well.
            let r = s
                .client()
                .request(
                    Method::POST,
                    "/v1/chat/completions",
                    Some(s.key()),
                    Some(chat_body(MODEL, ask, 12, true)),
                )
                .await
                .expect("request");
            assert_eq!(r.status, 200, "{}", r.text());
            assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
            assert!(sse_content(&r.text()).contains("Paris"), "{}", r.text());
        }
        let ((cluster, cu), (single, su)) = (&answers[0], &answers[1]);
        assert!(
            cluster.contains("Paris") && single.contains("Paris"),
            "{cluster:?} / {single:?}"
        );
        assert_eq!(cu["prompt_tokens"], su["prompt_tokens"], "{cu} / {su}");
        assert!(cu["completion_tokens"].as_u64().unwrap_or(0) > 0, "{cu}");
        // Rejected at the router: never dispatched, so no node saw it.
        let long = "word ".repeat(3000);
        let r = router
            .client()
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(router.key()),
                Some(chat_body(MODEL, &long, 8, false)),
            )
            .await
            .expect("request");
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json().expect("json")["error"]["code"], "context_length_exceeded");
        // Every page went back on both nodes, and the decode node counted its requests.
        assert!(prefill.pages_return().await, "{}", prefill.metrics().await);
        assert!(decode.pages_return().await, "{}", decode.metrics().await);
        let m = decode.metrics().await;
        assert!(
            m.contains("outcome=\"length\"} 2") || m.contains("outcome=\"stop\"}"),
            "{m}"
        );
        // The router's metrics count the requests by tenant.
        assert!(
            router
                .metric("warden_requests_total{tenant=\"default\",outcome=\"rejected\"}")
                .await
                >= 1.0
        );
        // A request's id reaches both nodes' lines for it.
        let r = router
            .client()
            .with_header("x-request-id", "trace-me-42")
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(router.key()),
                Some(chat_body(MODEL, ask, 4, false)),
            )
            .await
            .expect("request");
        assert_eq!(r.status, 200, "{}", r.text());
        for n in [&prefill, &decode] {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let mut seen = Vec::new();
            while !seen.iter().any(|l: &String| l.contains("trace-me-42")) {
                assert!(std::time::Instant::now() < deadline, "no line names the request: {seen:#?}");
                std::thread::sleep(Duration::from_millis(50));
                seen.extend(n.output.try_iter());
            }
            let line = seen.iter().find(|l| l.contains("trace-me-42")).expect("a line");
            assert!(line.contains("warden::cluster::request") && line.contains("outcome="), "{line}");
        }
        // The decode node's probes and metrics, over plain HTTP: the metrics need its token.
        let ops = decode
            .startup
            .iter()
            .find_map(|l| l.split("probes and metrics on ").nth(1))
            .map(|u| u.split_whitespace().next().unwrap_or(u).trim_end_matches('"').to_string())
            .expect("the decode node says where its probes are");
        let c = warden::serve::client::Client::new(&ops, None).expect("a client");
        for (path, status) in [("/healthz", 200), ("/readyz", 200), ("/metrics", 401), ("/v1/models", 404)] {
            let r = c.request(Method::GET, path, None, None).await.expect("an answer");
            assert_eq!(r.status, status, "{path}: {}", r.text());
        }
        let token = std::fs::read_to_string(decode.data_dir.join("metrics-token")).expect("its metrics token");
        let r = c.request(Method::GET, "/metrics", Some(token.trim()), None).await.expect("an answer");
        assert!(r.status == 200 && r.text().contains("warden_kv_pool_pages"), "{}", r.text());
        // A light router: it reads the model file's tokenizer, template and digest, never its
        // weights. One that repacked them peaked at about 250 MB on this 93 MB file (a node
        // holds about 680 MB); this one at about 68 MB: the bound leaves twice that.
        let peak = peak_rss_kib(router.pid());
        assert!(peak > 0 && peak < 150 << 10, "the router peaked at {peak} KiB");
        // Output under a constraint and under a plugin's steering: the router compiles the
        // format (refusing a bad one before it dispatches anything), the decode node compiles
        // and applies it, and the plugin's verdicts cross to the decode node token by token.
        // Greedy, so the cluster's answers are the single process's, token for token.
        let schema = r#"{"type":"object","properties":{"capital":{"type":"string","maxLength":24},"population":{"type":"integer","minimum":0,"maximum":99999999}},"required":["capital","population"],"additionalProperties":false}"#;
        let tools = r#""tools":[{"type":"function","function":{"name":"lookup","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;
        for s in [&router, &one] {
            let c = s.client();
            let up = c
                .request(Method::PUT, "/v1/plugins/json", Some(s.key()), Some(common::example("json_guard")))
                .await
                .expect("upload");
            assert_eq!(up.status, 201, "{}", up.text());
            let r = c
                .request(Method::PUT, "/v1/plugins/json/config", Some(s.key()), Some(b"object".to_vec()))
                .await
                .expect("config");
            assert_eq!(r.status, 200, "{}", r.text());
        }
        let cases = [
            (
                "schema",
                format!(
                    r#""response_format":{{"type":"json_schema","json_schema":{{"name":"city","strict":true,"schema":{schema}}}}}"#
                ),
            ),
            ("required tool", format!(r#"{tools},"tool_choice":"required""#)),
            ("plugin", r#""plugin":"json""#.to_string()),
        ];
        for (what, extra) in &cases {
            for stream in [false, true] {
                let body = format!(
                    r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{ask}"}}],"max_tokens":80,"temperature":0,"stream":{stream},{extra}}}"#
                );
                let mut replies = Vec::new();
                for s in [&router, &one] {
                    let r = s
                        .client()
                        .request(Method::POST, "/v1/chat/completions", Some(s.key()), Some(body.clone().into_bytes()))
                        .await
                        .expect("request");
                    assert_eq!(r.status, 200, "{what}: {}", r.text());
                    // The text, then each call's name and arguments (their ids are random).
                    replies.push(if stream {
                        sse_content(&r.text()) + &tool_args(&r.text())
                    } else {
                        let v = r.json().expect("json");
                        let m = &v["choices"][0]["message"];
                        let calls = m["tool_calls"].as_array().cloned().unwrap_or_default();
                        m["content"].as_str().unwrap_or_default().to_string() + &calls.iter().map(call).collect::<String>()
                    });
                }
                assert_eq!(replies[0], replies[1], "{what} (stream {stream}): the router's and one process's");
                match *what {
                    "schema" => {
                        let v: serde_json::Value = serde_json::from_str(&replies[0]).expect("the schema's JSON");
                        assert!(v["capital"].is_string() && v["population"].is_u64(), "{v}");
                    }
                    "required tool" => assert!(replies[0].contains("lookup"), "{}", replies[0]),
                    _ => assert!(replies[0].trim_start().starts_with('{'), "{}", replies[0]),
                }
            }
        }
        // A format the compiler refuses is a 400 from the router, naming it.
        let bad = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"response_format":{{"type":"json_schema","json_schema":{{"name":"x","schema":{{"type":"frog"}}}}}}}}"#
        );
        let r = router
            .client()
            .request(Method::POST, "/v1/chat/completions", Some(router.key()), Some(bad.into_bytes()))
            .await
            .expect("request");
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json().expect("json")["error"]["param"], "response_format", "{}", r.text());
        assert!(decode.pages_return().await, "{}", decode.metrics().await);
    });
}

/// The tool calls' arguments in an SSE stream's deltas, joined.
fn tool_args(sse: &str) -> String {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["tool_calls"].as_array().cloned())
        .flatten()
        .map(|c| call(&c))
        .collect()
}

/// A tool call's name and arguments.
fn call(c: &serde_json::Value) -> String {
    let f = &c["function"];
    format!(
        "{}{}",
        f["name"].as_str().unwrap_or_default(),
        f["arguments"].as_str().unwrap_or_default()
    )
}

#[test]
fn a_client_that_goes_away_mid_stream_frees_pages_on_both_nodes() {
    let prefill = Node::start("d-prefill", "prefill", NODE);
    let decode = Node::start("d-decode", "decode", NODE);
    let router = Server::start_router("d-router", "", &[&prefill], &[&decode], &[]);
    rt().block_on(async {
        let body = serde_json::json!({
            "model": MODEL, "messages": [{"role": "user", "content": "Write a very long essay about the history of Rome."}],
            "max_tokens": 400, "stream": true, "temperature": 0,
        });
        let r = router
            .client()
            .send(
                Proto::Http1,
                Method::POST,
                "/v1/chat/completions",
                Some(router.key()),
                Some(body.to_string().into_bytes()),
            )
            .await
            .expect("request");
        assert_eq!(r.status(), 200);
        let mut b = r.into_body();
        // A first token arrives: the transfer is done and decode is running.
        let mut seen = String::new();
        while !seen.contains("\"content\"") {
            let f = tokio::time::timeout(Duration::from_secs(30), b.frame())
                .await
                .expect("a chunk in time")
                .expect("a frame")
                .expect("bytes");
            if let Some(d) = f.data_ref() {
                seen.push_str(&String::from_utf8_lossy(d));
            }
        }
        assert!(decode.metric("warden_kv_pages{state=\"used\"}").await > 0.0);
        drop(b);
        assert!(decode.pages_return().await, "{}", decode.metrics().await);
        assert!(prefill.pages_return().await, "{}", prefill.metrics().await);
        let m = decode.metrics().await;
        assert!(m.contains("outcome=\"cancelled\"} 1"), "{m}");
    });
}

#[test]
fn killing_the_decode_node_fails_its_requests_and_the_prefill_pool_recovers() {
    let prefill = Node::start("k-prefill", "prefill", NODE);
    let mut decode = Node::start("k-decode", "decode", NODE);
    let router = Server::start_router("k-router", "", &[&prefill], &[&decode], &[]);
    rt().block_on(async {
        let client = router.client();
        let key = router.key().to_string();
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (client, key) = (client.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                let ask = format!("Request {i}: {}", "tell me a long story about the sea. ".repeat(40));
                client
                    .request(
                        Method::POST,
                        "/v1/chat/completions",
                        Some(&key),
                        Some(chat_body(MODEL, &ask, 300, true)),
                    )
                    .await
            }));
        }
        // Kill the decode node while the requests are in flight (their prompts prefill first).
        tokio::time::sleep(Duration::from_millis(700)).await;
        decode.kill9();
        for t in tasks {
            let r = t.await.expect("task").expect("a reply");
            let text = r.text();
            let failed = r.status != 200 || text.contains("\"error\"");
            assert!(failed, "a request whose decode node died must not succeed: {text}");
            assert!(!text.contains("data: [DONE]") || text.contains("\"error\""), "{text}");
        }
        // The prefill node let every page go: finished transfers were acknowledged, the rest
        // ended with their connection.
        assert!(prefill.pages_return().await, "{}", prefill.metrics().await);
    });
}

#[test]
fn a_router_refuses_nodes_that_disagree_and_a_node_refuses_a_pool_below_its_context() {
    let prefill = Node::start("r-prefill", "prefill", NODE);
    let decode = Node::start(
        "r-decode",
        "decode",
        "[kv]\nmemory_mib = 64\npage_size = 32\n[limits]\nmax_context = 2048\n",
    );
    let dir = common::temp_dir("r-router");
    let config = dir.join("warden.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\ndata_dir = {:?}\nmodel = {:?}\n[cluster]\nprefill = [\"{}\"]\ndecode = [\"{}\"]\n",
            dir.join("data"),
            common::model(),
            prefill.addr,
            decode.addr
        ),
    )
    .expect("config");
    let out = std::process::Command::new(common::warden_bin())
        .args(["serve", "--role", "router", "--config"])
        .arg(&config)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("disagree") && err.contains("page size 16") && err.contains("page size 32"),
        "{err}"
    );
    // Invariant 4, per role: a decode node whose pool cannot hold the max context does not start.
    let dir = common::temp_dir("r-small");
    let config = dir.join("node.toml");
    std::fs::write(
        &config,
        format!(
            "model = {:?}\n[kv]\nmemory_mib = 1\n[limits]\nmax_context = 8192\n[cluster]\nlisten = \"127.0.0.1:0\"\n",
            common::model()
        ),
    )
    .expect("config");
    let out = std::process::Command::new(common::warden_bin())
        .args(["serve", "--role", "decode", "--config"])
        .arg(&config)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("8192"), "{err}");
    // A node refuses what is not its role's work, with the reason.
    rt().block_on(async {
        let m = warden::cluster::link::Msg::PublicPrefixes { prefixes: vec![] };
        let e = warden::cluster::link::Transport::plain()
            .call(&decode.addr.into(), &m)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, warden::cluster::link::CallError::Refused { message, .. }
                if message.contains("a decode node does not take public_prefixes")),
            "{e}"
        );
    });
}

/// Requests a node finished (its `warden_requests_total` by tenant, outcome stop or length).
fn finished(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("warden_requests_total{")
                && (l.contains("outcome=\"stop\"") || l.contains("outcome=\"length\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_router_routes_around_a_dead_or_disagreeing_decode_node_and_takes_it_back() {
    let prefill = Node::start("h-prefill", "prefill", NODE);
    let a = Node::start("h-decode-a", "decode", NODE);
    let mut b = Node::start("h-decode-b", "decode", NODE);
    let b_addr = b.addr.to_string();
    let router = Server::start_router("h-router", "", &[&prefill], &[&a, &b], &[]);
    let up = format!("warden_cluster_node_up{{role=\"decode\",node=\"{b_addr}\"}}");
    rt().block_on(async {
        let ask = |n: usize| {
            let (c, key) = (router.client(), router.key().to_string());
            async move {
                for i in 0..n {
                    let r = c
                        .request(
                            Method::POST,
                            "/v1/chat/completions",
                            Some(&key),
                            Some(chat_body(MODEL, &format!("Say hello {i}."), 4, false)),
                        )
                        .await
                        .expect("request");
                    assert_eq!(r.status, 200, "request {i}: {}", r.text());
                }
            }
        };
        ask(2).await;
        assert!(
            finished(&b.metrics().await) >= 1.0,
            "round-robin reaches both decode nodes"
        );
        assert!(router.metrics().await.contains(&format!("{up} 1")));

        // A dead decode node: no request fails, the router tries the next one, and says so.
        b.kill9();
        ask(4).await;
        assert!(router.metrics().await.contains(&format!("{up} 0")));

        // Back on the same address but serving another max context: the probe keeps it out.
        let other = Node::start_on(
            "h-decode-b2",
            "decode",
            "[kv]\nmemory_mib = 64\n[limits]\nmax_context = 1024\n",
            &b_addr,
        );
        tokio::time::sleep(3 * warden::cluster::health::PROBE_EVERY).await;
        ask(4).await;
        assert_eq!(finished(&other.metrics().await), 0.0, "a disagreeing node gets no work");
        assert!(router.metrics().await.contains(&format!("{up} 0")));
        drop(other);

        // Back as it was: the probe takes it back and it serves again.
        let again = Node::start_on("h-decode-b3", "decode", NODE, &b_addr);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !router.metrics().await.contains(&format!("{up} 1")) {
            assert!(std::time::Instant::now() < deadline, "{}", router.metrics().await);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        ask(4).await;
        assert!(finished(&again.metrics().await) >= 1.0, "{}", again.metrics().await);
    });
}

/// `warden serve --role ...` with `toml` as its whole config: it must refuse to start; what it
/// printed on stderr.
fn refused(tag: &str, role: &str, toml: &str) -> String {
    let dir = common::temp_dir(tag);
    let config = dir.join("warden.toml");
    std::fs::write(&config, format!("data_dir = {:?}\n{toml}", dir.join("data"))).expect("config");
    let out = std::process::Command::new(common::warden_bin())
        .args(["serve", "--role", role, "--config"])
        .arg(&config)
        .output()
        .expect("run");
    assert!(!out.status.success(), "{role} started with\n{toml}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Several models in a cluster: a node serves one; the router gives each of its models the
/// nodes that serve that model's file, refuses to start while one has none, and sends each
/// request to its model's nodes.
#[test]
fn a_router_serves_each_model_on_the_nodes_that_serve_its_file() {
    let tiny = format!(
        "[kv]\nmemory_mib = 16\n[[models]]\npath = {:?}\nname = \"tiny\"\n",
        common::tiny_model()
    );
    let smol = format!("[[models]]\npath = {:?}\nname = \"smol\"\n", common::model());
    let err = refused(
        "m-two",
        "decode",
        &format!("{tiny}{smol}[cluster]\nlisten = \"127.0.0.1:0\"\n"),
    );
    assert!(
        err.contains("a decode node serves one model") && err.contains("names 2"),
        "{err}"
    );
    let p_smol = Node::start("m-prefill-smol", "prefill", NODE);
    let d_smol = Node::start("m-decode-smol", "decode", NODE);
    let p_tiny = Node::start("m-prefill-tiny", "prefill", &tiny);
    let d_tiny = Node::start("m-decode-tiny", "decode", &tiny);
    let nodes = format!(
        "[cluster]\nprefill = [\"{}\", \"{}\"]\ndecode = [\"{}\", \"{}\"]\nconnect_timeout_s = 30\n",
        p_smol.addr, p_tiny.addr, d_smol.addr, d_tiny.addr
    );
    // A model whose file no node serves: the router does not start, and names it.
    let other = common::root().join("host/tests/fixtures/tiny/llama-Q4_0.gguf");
    let err = refused(
        "m-unserved",
        "router",
        &format!("listen = \"127.0.0.1:0\"\n{smol}{tiny}[[models]]\npath = {other:?}\nname = \"tiny-q4\"\n{nodes}"),
    );
    assert!(err.contains("no prefill node serves model tiny-q4"), "{err}");
    // A node whose file is none of the router's models': refused too.
    let err = refused("m-other", "router", &format!("listen = \"127.0.0.1:0\"\n{smol}{nodes}"));
    assert!(err.contains("none of the router's"), "{err}");

    let router = Server::start_router(
        "m-router",
        &format!("{smol}{tiny}"),
        &[&p_smol, &p_tiny],
        &[&d_smol, &d_tiny],
        &[],
    );
    rt().block_on(async {
        let c = router.client();
        let r = c
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(router.key()),
                Some(chat_body("smol", "What is the capital of France? One word.", 8, false)),
            )
            .await
            .expect("request");
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(content(&r).contains("Paris"), "{}", r.text());
        let body =
            serde_json::json!({"model": "tiny", "prompt": [39, 68, 75, 75, 78], "max_tokens": 6, "temperature": 0});
        let r = c
            .request(
                Method::POST,
                "/v1/completions",
                Some(router.key()),
                Some(body.to_string().into_bytes()),
            )
            .await
            .expect("request");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json().expect("json")["model"], "tiny");
        let r = c
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(router.key()),
                Some(chat_body(MODEL, "Hi", 4, false)),
            )
            .await
            .expect("request");
        assert_eq!(r.status, 404, "the router serves smol and tiny only: {}", r.text());
        // Each request ran on its own model's decode node (which names its model as its own
        // configuration does: the smol nodes by the file's stem), and every page went back.
        let served =
            |m: &str, model: &str| common::metric_value(m, &format!("warden_requests_total{{model=\"{model}\"}}"));
        let (ms, mt) = (d_smol.metrics().await, d_tiny.metrics().await);
        assert_eq!((served(&ms, MODEL), served(&ms, "tiny")), (1.0, 0.0), "{ms}");
        assert_eq!((served(&mt, "tiny"), served(&mt, MODEL)), (1.0, 0.0), "{mt}");
        for n in [&p_smol, &d_smol, &p_tiny, &d_tiny] {
            assert!(n.pages_return().await, "{}", n.metrics().await);
        }
    });
}

/// A process's peak resident memory (`VmHWM`), KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process's status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status")
}
