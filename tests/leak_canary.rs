//! The leak-canary suite: many tenants' requests, each carrying a unique random canary and
//! asking the model to repeat it, through the single-process server and through a
//! disaggregated cluster with every transfer fault injected. It tries to make Warden show one
//! tenant's text to another the ways the 2026 engine did (over-length prompts near the pool's
//! capacity, chunked prefills, cancellations at random points, broken transfers) and asserts:
//!
//! - no response body, SSE chunk or error message carries a canary other than its own;
//! - no log line of any process and no metric of any process carries a canary at all;
//! - no over-length or faulted request succeeds;
//! - at the end every page of every pool is free again.
//!
//! `WARDEN_CANARY_REQUESTS` sets the requests per mode (default 1000).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::Method;
use rand::{Rng, SeedableRng};
use warden::serve::client::{Client, Proto};
use warden::tokenizer::Tokenizer;

use common::{MODEL, Node, Server, rt};

const TENANTS: usize = 8;
const MAX_CONTEXT: usize = 512;
const MAX_TOKENS: usize = 12;
/// A pool of about four maximum contexts, prefill chunks of 64 tokens, no prefix cache (so "every
/// page free" is exact).
const ENGINE: &str =
    "[kv]\nmemory_mib = 24\nprefix_cache = false\n[limits]\nmax_context = 512\nmax_batch_tokens = 64\nqueue = 1024\n";
const CONCURRENCY: usize = 12;

/// The faults the cluster's tenants get (tenant 0 none; `delay` must still succeed).
const FAULTS: [&str; TENANTS] = [
    "",
    "drop",
    "truncate",
    "corrupt",
    "duplicate",
    "reorder",
    "delay",
    "retag",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A short chat asking to repeat the canary, streamed or not.
    Chat { stream: bool },
    /// A completion prompt a few tokens under the max context (chunked prefill, a full pool).
    NearCapacity,
    /// A completion prompt a few tokens over the max context.
    OverLength,
    /// A stream the client drops after `after` ms.
    Cancel { after: u64 },
}

struct Req {
    tenant: usize,
    canary: String,
    kind: Kind,
    body: Vec<u8>,
    path: &'static str,
}

/// What came back.
#[derive(Debug, Default)]
struct Seen {
    status: u16,
    text: String,
    cancelled: bool,
}

fn canary(rng: &mut impl Rng) -> String {
    format!("CANARY{:012x}", rng.random::<u64>() & 0xffff_ffff_ffff)
}

/// Every canary-shaped string in `text`.
fn canaries(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("CANARY") {
        let tail = &rest[i..];
        let hex = tail[6..].chars().take_while(|c| c.is_ascii_hexdigit()).count();
        if hex >= 12 {
            out.push(&tail[..18]);
        }
        rest = &tail[6..];
    }
    out
}

/// `head` then filler words, as long as fits in `tokens` tokens.
fn padded(tok: &Tokenizer, head: &str, tokens: usize) -> String {
    const WORDS: [&str; 8] = [
        "river", "stone", "lantern", "orchard", "copper", "meadow", "harbor", "violet",
    ];
    let mut words = 8 * tokens;
    loop {
        let text = format!(
            "{head} {}",
            (0..words).map(|i| WORDS[i % WORDS.len()]).collect::<Vec<_>>().join(" ")
        );
        let n = tok.encode(&text, true).len();
        if n <= tokens {
            return text;
        }
        words = words.saturating_sub((n - tokens).div_ceil(2).max(1));
    }
}

fn plan(n: usize, tok: &Tokenizer, seed: u64) -> Vec<Req> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let tenant = i % TENANTS;
            let canary = canary(&mut rng);
            let kind = match rng.random_range(0..100) {
                0..35 => Kind::Chat { stream: false },
                35..70 => Kind::Chat { stream: true },
                70..80 => Kind::NearCapacity,
                80..90 => Kind::OverLength,
                _ => Kind::Cancel {
                    after: rng.random_range(0..400),
                },
            };
            let ask = format!("Repeat this code exactly, nothing else: {canary}. The code is {canary}.");
            let chat = |stream| {
                serde_json::json!({
                    "model": MODEL, "messages": [{"role": "user", "content": ask}],
                    "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream,
                })
            };
            let completion = |tokens| {
                let prompt = padded(tok, &format!("Code {canary}. Repeat the code {canary}:"), tokens);
                serde_json::json!({"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS})
            };
            let (path, body) = match kind {
                Kind::Chat { stream } => ("/v1/chat/completions", chat(stream)),
                Kind::Cancel { .. } => ("/v1/chat/completions", chat(true)),
                Kind::NearCapacity => ("/v1/completions", completion(MAX_CONTEXT - MAX_TOKENS - 4)),
                Kind::OverLength => {
                    let over = rng.random_range(1..24);
                    let mut p = completion(MAX_CONTEXT + over + 8);
                    // Padding stops at or under the target: make sure it is over the limit.
                    let prompt = p["prompt"].as_str().unwrap_or_default().to_string();
                    p["prompt"] = format!("{prompt} {}", "harbor ".repeat(16)).into();
                    ("/v1/completions", p)
                }
            };
            Req {
                tenant,
                canary,
                kind,
                body: body.to_string().into_bytes(),
                path,
            }
        })
        .collect()
}

async fn send(client: &Client, key: &str, r: &Req) -> Seen {
    let resp = match client
        .send(Proto::Http1, Method::POST, r.path, Some(key), Some(r.body.clone()))
        .await
    {
        Ok(resp) => resp,
        Err(e) => panic!("request failed at the transport: {e}"),
    };
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut text = Vec::new();
    let deadline = match r.kind {
        Kind::Cancel { after } => Some(tokio::time::Instant::now() + Duration::from_millis(after)),
        _ => None,
    };
    loop {
        let frame = match deadline {
            Some(d) => match tokio::time::timeout_at(d, body.frame()).await {
                Ok(f) => f,
                Err(_) => {
                    // The client goes away mid-response.
                    return Seen {
                        status,
                        text: String::from_utf8_lossy(&text).into_owned(),
                        cancelled: true,
                    };
                }
            },
            None => body.frame().await,
        };
        match frame {
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    text.extend_from_slice(d);
                }
            }
            Some(Err(e)) => panic!("reading a response: {e}"),
            None => break,
        }
    }
    Seen {
        status,
        text: String::from_utf8_lossy(&text).into_owned(),
        cancelled: false,
    }
}

/// Whether a response is a success: a 200 whose body carries no error.
fn succeeded(s: &Seen) -> bool {
    s.status == 200 && !s.text.contains("\"error\"") && !s.cancelled
}

/// Runs the plan against `server`; returns the counts by outcome.
async fn run(mode: &str, server: &Server, reqs: Vec<Req>, faults: &[&'static str; TENANTS]) -> BTreeMap<String, usize> {
    let mut keys = Vec::new();
    for t in 0..TENANTS {
        keys.push(server.tenant_with_key(&format!("canary-{t}")).await);
    }
    let all: Arc<HashSet<String>> = Arc::new(reqs.iter().map(|r| r.canary.clone()).collect());
    assert_eq!(all.len(), reqs.len(), "canaries are unique");
    let client = server.client();
    let sem = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    let mut tasks = Vec::new();
    for r in reqs {
        let (client, key, sem, all) = (client.clone(), keys[r.tenant].clone(), sem.clone(), all.clone());
        let fault = faults[r.tenant];
        let mode = mode.to_string();
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore");
            let seen = send(&client, &key, &r).await;
            for c in canaries(&seen.text) {
                assert!(
                    c == r.canary || !all.contains(c),
                    "{mode}: tenant {}'s response carries another request's canary {c}: {}",
                    r.tenant,
                    seen.text
                );
            }
            let ok = succeeded(&seen);
            if r.kind == Kind::OverLength {
                assert!(
                    !ok && seen.status == 400,
                    "{mode}: an over-length request: {} {}",
                    seen.status,
                    seen.text
                );
                assert!(seen.text.contains("context_length_exceeded"), "{}", seen.text);
            }
            let faulted = !fault.is_empty() && fault != "delay" && r.kind != Kind::OverLength;
            if faulted && !seen.cancelled {
                assert!(
                    !ok,
                    "{mode}: a request whose transfer was {fault}ed succeeded: {}",
                    seen.text
                );
                assert!(
                    seen.text.contains("kv_transfer_failed"),
                    "{mode}: {fault}: {}",
                    seen.text
                );
            }
            match () {
                _ if seen.cancelled => "cancelled by the client".to_string(),
                _ if ok => "succeeded".to_string(),
                _ => {
                    let code = seen
                        .text
                        .split("\"code\":\"")
                        .nth(1)
                        .and_then(|t| t.split('"').next())
                        .unwrap_or("?");
                    format!("failed: {} {code}", seen.status)
                }
            }
        }));
    }
    let mut counts = BTreeMap::new();
    for t in tasks {
        *counts.entry(t.await.expect("a request task")).or_insert(0) += 1;
    }
    counts
}

/// No canary in any line of `lines`.
fn clean(what: &str, lines: &[String]) {
    for l in lines {
        assert!(canaries(l).is_empty(), "{what} carries a canary: {l}");
    }
}

fn drain(rx: &std::sync::mpsc::Receiver<String>) -> Vec<String> {
    rx.try_iter().collect()
}

fn requests() -> usize {
    std::env::var("WARDEN_CANARY_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// Every process logs at its most verbose level, every crate's events included: none may carry
/// a canary.
const VERBOSE: &[(&str, &str)] = &[("RUST_LOG", "trace")];

fn tokenizer() -> Tokenizer {
    let g = warden::gguf::Gguf::open(common::model()).expect("model");
    Tokenizer::from_gguf(&g).expect("tokenizer")
}

#[test]
fn no_canary_crosses_tenants_in_one_process() {
    let tok = tokenizer();
    let server = Server::start_with_env("canary-all", ENGINE, &[], VERBOSE);
    let reqs = plan(requests(), &tok, 1);
    rt().block_on(async {
        let counts = run("all", &server, reqs, &[""; TENANTS]).await;
        println!("all mode, by outcome: {counts:#?}");
        assert!(counts.get("succeeded").copied().unwrap_or(0) > 0, "{counts:?}");
        let free = server.metric("warden_kv_pages{state=\"free\"}").await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let mut free_now = free;
        while free_now != server.metric("warden_kv_pool_pages").await && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            free_now = server.metric("warden_kv_pages{state=\"free\"}").await;
        }
        assert_eq!(
            free_now,
            server.metric("warden_kv_pool_pages").await,
            "{}",
            server.metrics().await
        );
        clean("the metrics", &[server.metrics().await]);
    });
    clean("the server's log", &drain(&server.output));
}

#[test]
#[cfg_attr(
    not(feature = "transfer-faults"),
    ignore = "injects transfer faults: needs --all-features (or --features transfer-faults), as the README's test command has"
)]
fn no_canary_crosses_tenants_in_a_cluster_with_every_transfer_fault() {
    let tok = tokenizer();
    let prefill = Node::start_with_env("canary-prefill", "prefill", ENGINE, VERBOSE);
    let decode = Node::start_with_env("canary-decode", "decode", ENGINE, VERBOSE);
    let faults: String = (0..TENANTS)
        .filter(|t| !FAULTS[*t].is_empty())
        .map(|t| format!("canary-{t}={}", FAULTS[t]))
        .collect::<Vec<_>>()
        .join(",");
    let router = Server::start_router(
        "canary-router",
        ENGINE,
        &[&prefill],
        &[&decode],
        &[("WARDEN_TRANSFER_FAULTS", &faults), VERBOSE[0]],
    );
    let reqs = plan(requests(), &tok, 2);
    rt().block_on(async {
        let counts = run("disaggregated", &router, reqs, &FAULTS).await;
        println!("disaggregated mode, by outcome: {counts:#?}");
        assert!(counts.get("succeeded").copied().unwrap_or(0) > 0, "{counts:?}");
        assert!(counts.keys().any(|k| k.contains("kv_transfer_failed")), "{counts:?}");
        for n in [&prefill, &decode] {
            assert!(n.pages_return().await, "{}", n.metrics().await);
            let m = n.metrics().await;
            let free = common::metric_value(&m, "warden_kv_pages{state=\"free\"}");
            let total = common::metric_value(&m, "warden_kv_pool_pages");
            assert!(total > 0.0 && free == total, "{m}");
            clean("a node's metrics", &[m]);
        }
        clean("the router's metrics", &[router.metrics().await]);
    });
    clean("the router's log", &drain(&router.output));
    clean("the prefill node's log", &drain(&prefill.output));
    clean("the decode node's log", &drain(&decode.output));
}

/// One completion of `max_tokens` through `client`: its status and error code (`-` for none).
async fn complete(client: &Client, key: &str, prompt: &str, max_tokens: usize) -> (u16, String) {
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let r = client
        .request(
            Method::POST,
            "/v1/completions",
            Some(key),
            Some(body.to_string().into_bytes()),
        )
        .await
        .expect("a response");
    let code = r
        .json()
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
        .unwrap_or_else(|| "-".into());
    (r.status, code)
}

/// A router, a prefill node and two decode nodes, each in a network namespace of its own on a
/// bridge, talking mutual TLS under a cluster CA that `warden cluster certs` made: the canary
/// load crosses them with no leak; a peer with a certificate from another CA, or with none, is
/// refused before anything it sends is read; and cutting one decode node's link mid-request
/// fails only that node's requests (502 `node_failed`), frees their pages on every side, and
/// the router sends it nothing until its link is back.
#[test]
fn a_cluster_across_network_namespaces_talks_mutual_tls_and_survives_a_cut_link() {
    use common::netns::Netns;
    use warden::cluster::link::{Msg, Transport};
    use warden::cluster::tls::ClusterTls;

    let net = Netns::new(&["prefill", "decode1", "decode2", "router"]);
    let dir = common::temp_dir("mtls");
    let (certs, foreign) = (dir.join("certs"), dir.join("foreign"));
    let made = |out: &std::path::Path, names: &[String]| {
        let o = std::process::Command::new(common::warden_bin())
            .args(["cluster", "certs", "--out"])
            .arg(out)
            .args(names)
            .output()
            .expect("warden cluster certs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    made(
        &certs,
        &[
            "prefill".into(),
            "decode1".into(),
            "decode2".into(),
            format!("router={}", net.addr("router")),
            "tester".into(),
        ],
    );
    made(&foreign, &["intruder".into()]);
    let tls = |name: &str| {
        format!(
            "ca = {:?}\ncert = {:?}\nkey = {:?}\npeer_timeout_s = 3\n",
            certs.join("ca.pem"),
            certs.join(format!("{name}.pem")),
            certs.join(format!("{name}.key"))
        )
    };
    let peer_timeout = Duration::from_secs(3);
    let transport = |ca: &std::path::Path, d: &std::path::Path, name: &str| {
        let t = ClusterTls::load(
            &ca.join("ca.pem"),
            &d.join(format!("{name}.pem")),
            &d.join(format!("{name}.key")),
        )
        .expect("certificates");
        Transport::mutual_tls(t, peer_timeout)
    };
    let tester = transport(&certs, &certs, "tester");
    let node = |host: &str, role: &str| {
        Node::start_in(
            &format!("mtls-{host}"),
            role,
            &format!("{ENGINE}[cluster]\n{}", tls(host)),
            &format!("{}:9100", net.addr(host)),
            VERBOSE,
            Some(&net.ns(host)),
            tester.clone(),
        )
    };
    let prefill = node("prefill", "prefill");
    let d1 = node("decode1", "decode");
    let d2 = node("decode2", "decode");
    let rdir = common::temp_dir("mtls-router");
    common::write_default_policy(&rdir);
    let config = rdir.join("warden.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"{}:0\"\ndata_dir = {:?}\nmodel = {:?}\npolicies = {:?}\n{ENGINE}\n[tls]\ncert = {:?}\nkey = {:?}\n\
             [cluster]\nprefill = [\"{}\"]\ndecode = [\"{}\", \"{}\"]\nconnect_timeout_s = 60\n{}",
            net.addr("router"),
            rdir.join("data"),
            common::model(),
            rdir.join("policies"),
            certs.join("router.pem"),
            certs.join("router.key"),
            prefill.addr,
            d1.addr,
            d2.addr,
            tls("router"),
        ),
    )
    .expect("write config");
    let mut router = Server::start_in(rdir, config, "router", VERBOSE, Some(&net.ns("router")));
    // The router's API certificate is the cluster CA's too (it names the router's address).
    router.cert = certs.join("ca.pem");
    let tok = tokenizer();
    let reqs = plan(requests() / 4, &tok, 3);
    rt().block_on(async {
        // The canary load, across the namespaces.
        let counts = run("mutual TLS", &router, reqs, &[""; TENANTS]).await;
        println!("across namespaces, by outcome: {counts:#?}");
        assert!(counts.get("succeeded").copied().unwrap_or(0) > 0, "{counts:?}");
        for n in [&prefill, &d1, &d2] {
            assert!(n.pages_return().await, "{}", n.metrics().await);
            clean("a node's metrics", &[n.metrics().await]);
        }
        let served = |m: &str| common::metric_value(m, "warden_requests_total");
        assert!(served(&d1.metrics().await) > 0.0 && served(&d2.metrics().await) > 0.0);

        // A certificate from another CA, and no certificate at all, are refused at the
        // handshake: no answer, and the node says so.
        let refused = |m: &str| common::metric_value(m, "warden_cluster_refused_connections_total");
        let refused_before = refused(&prefill.metrics().await);
        let intruder = transport(&certs, &foreign, "intruder");
        let e = intruder
            .call(&prefill.addr.into(), &Msg::Describe)
            .await
            .expect_err("a foreign certificate");
        println!("a foreign certificate: {e}");
        let mut plain = tokio::net::TcpStream::connect(prefill.addr).await.expect("tcp");
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let hello = warden::cluster::link::encode_msg(&Msg::Hello {
            version: warden::cluster::link::VERSION,
        });
        let describe = warden::cluster::link::encode_msg(&Msg::Describe);
        let _ = plain.write_all(&[hello, describe].concat()).await;
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut answer)).await;
        assert!(
            read.is_ok() && !answer.windows(4).any(|w| w == b"role"),
            "a peer without TLS got an answer: {answer:?}"
        );
        // Both counted (their log lines are limited to one a second, so not counted here).
        assert!(refused(&prefill.metrics().await) >= refused_before + 2.0);
        assert!(
            tester.call(&prefill.addr.into(), &Msg::Describe).await.is_ok(),
            "the cluster's own certificate"
        );

        // Long completions on both decode nodes; decode1's link is cut while it decodes.
        let key = router.key().to_string();
        let client = router.client();
        let count: String = (1..=30).map(|i| format!("{i}, ")).collect();
        let running = |m: &str| common::metric_value(m, "warden_running_sequences");
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let (c, k, p) = (client.clone(), key.clone(), count.clone());
            tasks.push(tokio::spawn(async move { complete(&c, &k, &p, 400).await }));
        }
        // Cut while decode1 decodes: its requests are running and their tokens flow.
        let tokens = |m: &str| common::metric_value(m, "warden_inter_token_latency_seconds_count");
        let before = tokens(&d1.metrics().await);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let m = d1.metrics().await;
            if running(&m) >= 1.0 && tokens(&m) >= before + 8.0 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "decode1 never decoded: {m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let d2_before = served(&d2.metrics().await);
        net.cut("decode1");
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.expect("a request task"));
        }
        println!("with decode1 cut mid-request: {outcomes:?}");
        assert!(
            outcomes
                .iter()
                .all(|(s, c)| (*s, c.as_str()) == (200, "-") || (*s, c.as_str()) == (502, "node_failed")),
            "{outcomes:?}"
        );
        let failed = outcomes.iter().filter(|(s, _)| *s == 502).count();
        assert!(failed >= 1 && failed < outcomes.len(), "{outcomes:?}");
        // Every success came from decode2, once decode1 was cut.
        let up = |node: std::net::SocketAddr| format!("warden_cluster_node_up{{role=\"decode\",node=\"{node}\"}}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while router.metric(&up(d1.addr)).await != 0.0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the router still counts decode1 up"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // While it is cut, the router sends its work elsewhere: every request succeeds.
        for _ in 0..4 {
            assert_eq!(complete(&client, &key, &count, 4).await, (200, "-".into()));
        }
        assert!(served(&d2.metrics().await) >= d2_before + 4.0);
        // Back: the router probes it up again and sends it work; its pages, and the prefill
        // node's, all came back.
        net.restore("decode1");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while router.metric(&up(d1.addr)).await != 1.0 {
            assert!(tokio::time::Instant::now() < deadline, "decode1 never came back");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for n in [&prefill, &d1, &d2] {
            assert!(n.pages_return().await, "{}", n.metrics().await);
        }
        let d1_before = served(&d1.metrics().await);
        for _ in 0..4 {
            assert_eq!(complete(&client, &key, &count, 4).await, (200, "-".into()));
        }
        assert!(served(&d1.metrics().await) > d1_before, "decode1 gets work again");
        clean("the router's metrics", &[router.metrics().await]);
    });
    clean("the router's log", &drain(&router.output));
    for n in [&prefill, &d1, &d2] {
        clean("a node's log", &drain(&n.output));
    }
}
