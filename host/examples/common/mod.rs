//! What the benchmark programs share: starting `warden serve` processes from the release build
//! and talking to them.

#![allow(dead_code)] // each example uses what it needs

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};
use warden::serve::client::Client;

/// The `warden` binary beside this example's release build (`cargo build --release` first).
pub fn warden_bin() -> anyhow::Result<PathBuf> {
    let bin = std::env::current_exe()?
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("warden"))
        .context("the binary's folder")?;
    if !bin.exists() {
        bail!("{} is missing: run `cargo build --release` first", bin.display());
    }
    Ok(bin)
}

/// A `warden serve` process, killed on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `warden serve --role role` with `config`, and returns it with what `ready` found in
/// the first line it recognises.
pub fn start(
    bin: &Path,
    role: &str,
    config: &Path,
    ready: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<(Proc, String)> {
    let mut child = Command::new(bin)
        .args(["serve", "--role", role, "--config"])
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    // The key comes on stdout, the log (with the ready line) on stderr: both are read, and kept
    // draining so the server never blocks on a full pipe.
    let (tx, rx) = std::sync::mpsc::channel::<(bool, String)>();
    let out = child.stdout.take().context("stdout")?;
    let err = child.stderr.take().context("stderr")?;
    for (is_log, pipe) in [
        (false, Box::new(out) as Box<dyn std::io::Read + Send>),
        (true, Box::new(err)),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(pipe).lines().map_while(Result::ok) {
                if is_log {
                    eprintln!("{l}");
                }
                let _ = tx.send((is_log, l));
            }
        });
    }
    drop(tx);
    let proc = Proc(child);
    let (mut key, mut found) = (None, None);
    while let Ok((_, l)) = rx.recv() {
        if let Some(k) = l.split("API key (shown only now): ").nth(1) {
            key = Some(k.to_string());
        }
        if found.is_none() {
            found = ready(&l);
        }
        // A new data dir prints its key before the server is ready: wait for it a moment.
        if let Some(f) = &found {
            if key.is_none()
                && let Ok((_, l)) = rx.recv_timeout(std::time::Duration::from_secs(1))
                && let Some(k) = l.split("API key (shown only now): ").nth(1)
            {
                key = Some(k.to_string());
            }
            let f = match &key {
                Some(k) => format!("{f} {k}"),
                None => f.clone(),
            };
            std::thread::spawn(move || for _ in rx {});
            return Ok((proc, f));
        }
    }
    bail!("warden serve --role {role} exited before it was ready")
}

/// A server (`all` or `router`): the process, a client and its default tenant's key.
pub fn server(bin: &Path, dir: &Path, role: &str, model: &Path, extra: &str) -> anyhow::Result<(Proc, Client, String)> {
    let data = dir.join(format!("{role}-data"));
    let config = dir.join(format!("{role}.toml"));
    std::fs::write(
        &config,
        format!("listen = \"127.0.0.1:0\"\ndata_dir = {data:?}\nmodel = {model:?}\n{extra}\n"),
    )?;
    let (p, found) = start(bin, role, &config, |l| {
        l.split_once(": serving ")
            .and_then(|(_, r)| r.split(" on ").nth(1))
            .map(str::to_string)
    })?;
    let (url, key) = found.split_once(' ').context("a new data dir prints the default key")?;
    let client = Client::new(url, Some(&data.join("tls/cert.pem")))?;
    Ok((p, client, key.to_string()))
}

/// The admin token a server with its data in `dir/{role}-data` wrote at its first start.
pub fn admin_token(dir: &Path, role: &str) -> anyhow::Result<String> {
    let path = warden::serve::admin_token_path(&dir.join(format!("{role}-data")));
    Ok(std::fs::read_to_string(&path)
        .with_context(|| format!("reading {}", path.display()))?
        .trim()
        .to_string())
}

/// The async runtime the bench clients run on: two workers, like the server's.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// The model file, absolute, and the id the server serves it as (its file stem).
pub fn model(path: &Path) -> anyhow::Result<(PathBuf, String)> {
    let model = std::fs::canonicalize(path).with_context(|| format!("model {}", path.display()))?;
    let id = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok((model, id))
}

/// An SDK example plugin, built for wasm32-wasip2.
pub fn example(name: &str) -> anyhow::Result<Vec<u8>> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../guest-sdk/target/wasm32-wasip2/release/examples")
        .join(format!("{name}.wasm"));
    std::fs::read(&p).with_context(|| format!("{}: build the guest examples first", p.display()))
}

/// Resident memory of process `pid`, MiB.
pub fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

/// Files process `pid` has open.
pub fn open_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The value of the first line of a Prometheus exposition that starts with `name`.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok()))
        .unwrap_or(0.0)
}
