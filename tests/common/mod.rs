//! The harness: starts the real `warden serve` binary on a fresh data dir and a free port, and
//! talks to it over TLS with the generated certificate.

#![allow(dead_code)]

pub mod netns;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hyper::Method;
use warden::serve::client::{Client, Reply};

/// An example plugin of `guest-sdk/`, as the test command builds it.
pub fn example(name: &str) -> Vec<u8> {
    let p = root()
        .join("guest-sdk/target/wasm32-wasip2/release/examples")
        .join(format!("{name}.wasm"));
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e} (the test command builds the examples)", p.display()))
}

/// A two-thread runtime for a test's client side.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The checkout's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("host/ is in the checkout")
        .to_path_buf()
}

/// The `warden` binary of this build.
pub fn warden_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_warden"))
}

/// The default model, which the tests need.
pub fn model() -> PathBuf {
    let m = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(m.exists(), "model missing: run scripts/fetch-model.sh");
    m
}

/// A tiny committed model (llama architecture, Q8_0, a 257-token ASCII vocabulary, 64 tokens of
/// context, no chat template): a second model for servers of several.
pub fn tiny_model() -> PathBuf {
    root().join("host/tests/fixtures/tiny/llama-Q8_0.gguf")
}

/// The `model = ...` line of a config, unless `extra` lists `[[models]]` of its own.
fn model_line(extra: &str) -> String {
    if extra.contains("[[models]]") {
        String::new()
    } else {
        format!("model = {:?}\n", model())
    }
}

/// `dir/policies/default.toml`, empty: the built-in defaults, said explicitly (a server refuses
/// a policy directory that is missing or holds no policy).
pub fn write_default_policy(dir: &Path) {
    let p = dir.join("policies");
    std::fs::create_dir_all(&p).expect("policy dir");
    std::fs::write(p.join("default.toml"), "# The built-in defaults.\n").expect("write policy");
}

/// A fresh directory under the target dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = root()
        .join("target/e2e")
        .join(format!("{tag}-{}-{}", std::process::id(), rand::random::<u32>()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create temp dir");
    d
}

/// A running server.
pub struct Server {
    child: Option<Child>,
    /// Its data dir.
    pub data_dir: PathBuf,
    /// Its config file.
    pub config: PathBuf,
    /// Base URL.
    pub url: String,
    /// The generated certificate.
    pub cert: PathBuf,
    /// The `default` tenant's key, when this start created it.
    pub default_key: Option<String>,
    /// The admin token.
    pub admin: String,
    /// Everything it printed so far is collected here.
    pub output: mpsc::Receiver<String>,
}

impl Server {
    /// Starts a server on a new data dir with `extra` TOML appended to its config.
    pub fn start(tag: &str, extra: &str) -> Server {
        Self::start_with_policies(tag, extra, &[])
    }

    /// Starts a server whose policy directory holds `policies` (path under it, contents).
    pub fn start_with_policies(tag: &str, extra: &str, policies: &[(&str, &str)]) -> Server {
        Self::start_with_env(tag, extra, policies, &[])
    }

    /// [`start_with_policies`](Self::start_with_policies), with environment `env`.
    pub fn start_with_env(tag: &str, extra: &str, policies: &[(&str, &str)], env: &[(&str, &str)]) -> Server {
        let data_dir = temp_dir(tag);
        write_default_policy(&data_dir);
        for (name, text) in policies {
            let p = data_dir.join("policies").join(name);
            std::fs::create_dir_all(p.parent().expect("a parent")).expect("policy dir");
            std::fs::write(p, text).expect("write policy");
        }
        let config = data_dir.join("warden.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:0\"\ndata_dir = {:?}\n{}policies = {:?}\n{extra}\n",
                data_dir.join("data"),
                model_line(extra),
                data_dir.join("policies")
            ),
        )
        .expect("write config");
        Self::start_as(data_dir, config, "all", env)
    }

    /// Starts a server on an existing data dir and config (a restart).
    pub fn start_with(data_dir: PathBuf, config: PathBuf) -> Server {
        Self::start_as(data_dir, config, "all", &[])
    }

    /// Starts a router dispatching to `prefill` and `decode` nodes, with `extra` TOML and
    /// environment `env`.
    pub fn start_router(tag: &str, extra: &str, prefill: &[&Node], decode: &[&Node], env: &[(&str, &str)]) -> Server {
        let data_dir = temp_dir(tag);
        write_default_policy(&data_dir);
        let config = data_dir.join("warden.toml");
        let list = |nodes: &[&Node]| {
            nodes
                .iter()
                .map(|n| format!("\"{}\"", n.addr))
                .collect::<Vec<_>>()
                .join(", ")
        };
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:0\"\ndata_dir = {:?}\n{}policies = {:?}\n{extra}\n[cluster]\nprefill = [{}]\ndecode = [{}]\nconnect_timeout_s = 60\n",
                data_dir.join("data"),
                model_line(extra),
                data_dir.join("policies"),
                list(prefill),
                list(decode),
            ),
        )
        .expect("write config");
        Self::start_as(data_dir, config, "router", env)
    }

    /// Starts `warden serve --role role` on a data dir and config, with environment `env`.
    pub fn start_as(data_dir: PathBuf, config: PathBuf, role: &str, env: &[(&str, &str)]) -> Server {
        Self::start_in(data_dir, config, role, env, None)
    }

    /// [`start_as`](Self::start_as), in network namespace `netns` if one is given.
    pub fn start_in(
        data_dir: PathBuf,
        config: PathBuf,
        role: &str,
        env: &[(&str, &str)],
        netns: Option<&str>,
    ) -> Server {
        let data = data_dir.join("data");
        let _ = std::fs::remove_file(data.join("server.json"));
        let first = !data.join("admin-token").exists();
        let (child, rx, url, mut lines) = spawn(&config, role, env, netns, |l| {
            // The log line `... INFO warden::serve: serving <models> on <url>`, or its JSON.
            l.split_once("serving ")
                .and_then(|(_, r)| r.split(" on ").nth(1))
                .and_then(|url| url.split('"').next())
                .map(|url| url.trim().to_string())
        });
        let key_in = |l: &str| l.split("API key (shown only now): ").nth(1).map(str::to_string);
        // A first start prints the key (stdout) before it logs that it serves (stderr), but the
        // two pipes are read apart: the key may come just after.
        if first && !lines.iter().any(|l| key_in(l).is_some()) {
            while let Ok(l) = rx.recv_timeout(Duration::from_secs(10)) {
                let found = key_in(&l).is_some();
                lines.push(l);
                if found {
                    break;
                }
            }
        }
        let default_key = lines.iter().find_map(|l| key_in(l));
        let admin = std::fs::read_to_string(data.join("admin-token"))
            .expect("admin token file")
            .trim()
            .to_string();
        Server {
            child: Some(child),
            cert: data.join("tls/cert.pem"),
            data_dir,
            config,
            url,
            default_key,
            admin,
            output: rx,
        }
    }

    /// A client trusting the server's certificate.
    pub fn client(&self) -> Client {
        Client::new(&self.url, Some(&self.cert)).expect("client")
    }

    /// The default tenant's key.
    pub fn key(&self) -> &str {
        self.default_key
            .as_deref()
            .expect("this start created the default tenant")
    }

    /// Creates a tenant and a key through the admin API; returns the key.
    pub async fn tenant_with_key(&self, name: &str) -> String {
        let c = self.client();
        let body = serde_json::json!({"name": name}).to_string().into_bytes();
        let r = c
            .request(Method::POST, "/admin/v1/tenants", Some(&self.admin), Some(body))
            .await
            .expect("create tenant");
        assert_eq!(r.status, 201, "{}", r.text());
        let r = c
            .request(
                Method::POST,
                &format!("/admin/v1/tenants/{name}/keys"),
                Some(&self.admin),
                None,
            )
            .await
            .expect("create key");
        assert_eq!(r.status, 201, "{}", r.text());
        r.json().expect("json")["key"].as_str().expect("key").to_string()
    }

    /// `GET /metrics`.
    pub async fn metrics(&self) -> String {
        let r = self
            .client()
            .request(Method::GET, "/metrics", Some(&self.admin), None)
            .await
            .expect("metrics");
        assert_eq!(r.status, 200);
        r.text()
    }

    /// One metric's value: see [`metric_value`].
    pub async fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics().await, series)
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Kills the process with SIGKILL (`kill -9`: no shutdown path runs) and waits for it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits for the process to exit; returns its exit status success.
    pub fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Starts `warden serve --role role --config config` and waits for the line `ready` finds
/// something in: the child, its output (the lines after that one), what `ready` found, and the
/// lines before it.
fn spawn(
    config: &Path,
    role: &str,
    env: &[(&str, &str)],
    netns: Option<&str>,
    ready: impl Fn(&str) -> Option<String>,
) -> (Child, mpsc::Receiver<String>, String, Vec<String>) {
    // In a network namespace, through `ip netns exec` (which execs warden: the child is it).
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(warden_bin());
            c
        }
        None => Command::new(warden_bin()),
    };
    let mut child = cmd
        .args(["serve", "--role", role, "--config"])
        .arg(config)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warden serve");
    let (tx, rx) = mpsc::channel();
    for pipe in [
        Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().expect("stderr")),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut lines = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                if let Some(found) = ready(&l) {
                    return (child, rx, found, lines);
                }
                lines.push(l);
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "warden serve --role {role} did not start; it printed:\n{}",
                    lines.join("\n")
                );
            }
        }
    }
}

/// A prefill or decode node.
pub struct Node {
    child: Option<Child>,
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    /// How the test reaches it (plain on loopback, or with a cluster certificate).
    pub transport: warden::cluster::link::Transport,
    /// Its data dir.
    pub data_dir: PathBuf,
    /// What it printed after it started.
    pub output: mpsc::Receiver<String>,
    /// What it printed before.
    pub startup: Vec<String>,
}

impl Node {
    /// Starts a `role` node on a free loopback port with `extra` TOML in its config.
    pub fn start(tag: &str, role: &str, extra: &str) -> Node {
        Self::start_on(tag, role, extra, "127.0.0.1:0")
    }

    /// [`start`](Self::start), with environment `env`.
    pub fn start_with_env(tag: &str, role: &str, extra: &str, env: &[(&str, &str)]) -> Node {
        Self::start_env_on(tag, role, extra, "127.0.0.1:0", env)
    }

    /// Starts a `role` node listening on `listen`.
    pub fn start_on(tag: &str, role: &str, extra: &str, listen: &str) -> Node {
        Self::start_env_on(tag, role, extra, listen, &[])
    }

    fn start_env_on(tag: &str, role: &str, extra: &str, listen: &str, env: &[(&str, &str)]) -> Node {
        Self::start_in(
            tag,
            role,
            extra,
            listen,
            env,
            None,
            warden::cluster::link::Transport::plain(),
        )
    }

    /// Starts a `role` node listening on `listen`, in network namespace `netns` if one is
    /// given; the test reaches it through `transport`.
    pub fn start_in(
        tag: &str,
        role: &str,
        extra: &str,
        listen: &str,
        env: &[(&str, &str)],
        netns: Option<&str>,
        transport: warden::cluster::link::Transport,
    ) -> Node {
        let dir = temp_dir(tag);
        let config = dir.join("node.toml");
        // `extra` may open tables of its own; [cluster] comes last, with listen first in it.
        let (extra, cluster) = match extra.split_once("[cluster]\n") {
            Some((before, after)) => (before, after),
            None => (extra, ""),
        };
        std::fs::write(
            &config,
            format!(
                "data_dir = {:?}\n{}{extra}\n[cluster]\nlisten = \"{listen}\"\n{cluster}",
                dir.join("data"),
                model_line(extra)
            ),
        )
        .expect("write config");
        let (child, output, addr, startup) = spawn(&config, role, env, netns, |l| {
            l.contains(" node serving ")
                .then(|| l.split(" on ").nth(1)?.split(' ').next().map(str::to_string))
                .flatten()
        });
        Node {
            child: Some(child),
            addr: addr.parse().expect("a node prints its address"),
            transport,
            data_dir: dir.join("data"),
            output,
            startup,
        }
    }

    /// Its metrics, over the cluster protocol.
    pub async fn metrics(&self) -> String {
        match self
            .transport
            .call(&self.addr.into(), &warden::cluster::link::Msg::Metrics)
            .await
        {
            Ok(warden::cluster::link::Msg::MetricsText { text }) => text,
            other => panic!("node {} answered {other:?}", self.addr),
        }
    }

    /// One metric's value: see [`metric_value`].
    pub async fn metric(&self, series: &str) -> f64 {
        metric_value(&self.metrics().await, series)
    }

    /// Waits (up to 20 s) until no page of its pool is in use; false if some still are then.
    pub async fn pages_return(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let used = self.metric("warden_kv_pages{state=\"used\"}").await;
            if used == 0.0 {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills it with SIGKILL and waits for it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The sum of the series of `series` (`name` or `name{k="v",...}`) in a Prometheus text whose
/// labels include the given ones: `warden_kv_pages{state="used"}` adds every model's used pages.
/// Panics when the text has no such metric at all (a renamed metric must fail the test, not read
/// as 0); 0 when it has the metric but no matching series yet.
pub fn metric_value(text: &str, series: &str) -> f64 {
    let (name, wanted) = match series.split_once('{') {
        Some((n, rest)) => (n, rest.trim_end_matches('}')),
        None => (series, ""),
    };
    let wanted: Vec<&str> = wanted
        .split("\",")
        .filter(|w| !w.is_empty())
        .map(|w| w.trim_end_matches('"'))
        .collect();
    let family = ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    assert!(
        text.lines()
            .any(|l| [name, family].iter().any(|n| l.starts_with(&format!("# TYPE {n} ")))),
        "no metric {name} in\n{text}"
    );
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (s, v) = l.rsplit_once(' ')?;
            let (n, labels) = match s.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (s, ""),
            };
            let have: Vec<&str> = labels.split("\",").map(|w| w.trim_end_matches('"')).collect();
            (n == name && wanted.iter().all(|w| have.contains(w))).then(|| v.parse::<f64>().ok())?
        })
        .sum()
}

/// A chat request body.
pub fn chat_body(model: &str, content: &str, max_tokens: usize, stream: bool) -> Vec<u8> {
    serde_json::json!({
        "model": model, "messages": [{"role": "user", "content": content}],
        "temperature": 0, "max_tokens": max_tokens, "stream": stream,
    })
    .to_string()
    .into_bytes()
}

/// The model id the server serves.
pub const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// The text of a non-streamed chat reply.
pub fn content(r: &Reply) -> String {
    let v = r.json().expect("json");
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The text a chat SSE stream carries: every chunk's `delta.content`, in order.
pub fn sse_content(sse: &str) -> String {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect()
}
