//! The deployment recipes agree with the server: `kubectl kustomize deploy/kubernetes` renders,
//! and what the manifests give each container (arguments, ports, probes, volumes, the config and
//! policies in their ConfigMaps, the grace period) is what `warden serve` accepts and listens on;
//! and the Dockerfile's final image holds the binary alone, run as a non-root user.
//!
//! The ConfigMaps' configs are checked with `warden config check` and the policies with `warden
//! policies check`, with every absolute path they name moved under a scratch root that holds
//! what the volumes would: the model, certificates `warden cluster certs` makes, a token.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// The base's objects, rendered by kubectl and read by PyYAML (the e2e venv's).
fn render() -> Vec<Value> {
    let root = common::root();
    let out = Command::new("kubectl")
        .args(["kustomize"])
        .arg(root.join("deploy/kubernetes"))
        .output()
        .expect("running kubectl (the test needs kubectl on PATH)");
    assert!(
        out.status.success(),
        "kubectl kustomize: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let python = root.join(".venv-e2e/bin/python");
    let mut child = Command::new(&python)
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/e2e-venv.sh)", python.display()));
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&out.stdout)
        .expect("write YAML");
    let json = child.wait_with_output().expect("PyYAML");
    assert!(json.status.success(), "PyYAML could not read the rendered manifests");
    serde_json::from_slice(&json.stdout).expect("JSON")
}

/// The object of `kind` whose name is `name` or starts with `name-` (a generated ConfigMap's
/// hash suffix).
fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| {
            o["kind"] == kind
                && o["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n == name || n.strip_prefix(name).is_some_and(|r| r.starts_with('-')))
        })
        .unwrap_or_else(|| panic!("no {kind} {name} in the rendered base"))
}

/// `warden` with `args`: whether it succeeded, and what it said.
fn warden(args: &[&str]) -> (bool, String) {
    let out = Command::new(common::warden_bin()).args(args).output().expect("warden");
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

fn port_of(addr: &str) -> u64 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("host:port")
}

/// One workload's container, checked against the config it runs: what it reads is mounted,
/// what it listens on is a named container port, its probes ask /healthz and /readyz there, and
/// its grace period covers the preStop delay and the server's shutdown time.
struct Workload<'a> {
    what: String,
    pod: &'a Value,
    container: &'a Value,
}

impl<'a> Workload<'a> {
    fn of(objects: &'a [Value], kind: &str, name: &str) -> Self {
        let pod = &object(objects, kind, name)["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        Workload {
            what: format!("{kind} {name}"),
            pod,
            container,
        }
    }

    /// The config file its arguments name, and the role.
    fn args(&self) -> (String, String) {
        let args: Vec<&str> = self.container["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(args[0], "serve", "{}: {args:?}", self.what);
        let after = |flag: &str| {
            args.iter()
                .position(|a| *a == flag)
                .and_then(|i| args.get(i + 1))
                .unwrap_or_else(|| panic!("{}: no {flag} in {args:?}", self.what))
                .to_string()
        };
        (after("--config"), after("--role"))
    }

    /// The volume mounted at the longest mount path `path` lies under, and the file's name in
    /// it: `(volume, key)`.
    fn mounted(&self, path: &str) -> (&'a Value, String) {
        let mount = self.container["volumeMounts"]
            .as_array()
            .expect("volumeMounts")
            .iter()
            .filter(|m| {
                let at = m["mountPath"].as_str().unwrap_or("/nowhere");
                path.strip_prefix(at).is_some_and(|r| r.starts_with('/'))
            })
            .max_by_key(|m| m["mountPath"].as_str().map_or(0, str::len))
            .unwrap_or_else(|| panic!("{}: nothing is mounted where {path} is", self.what));
        let name = mount["name"].as_str().expect("a mount's volume");
        let volume = self.pod["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("{}: no volume {name}", self.what));
        let rest = &path[mount["mountPath"].as_str().expect("mountPath").len() + 1..];
        (volume, rest.to_string())
    }

    /// The container port named `name`.
    fn port(&self, name: &str) -> u64 {
        self.container["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("{}: no container port {name}", self.what))
    }

    fn probes(&self, port: &str, scheme: &str) {
        for (probe, path) in [
            ("livenessProbe", "/healthz"),
            ("readinessProbe", "/readyz"),
            ("startupProbe", "/healthz"),
        ] {
            let get = &self.container[probe]["httpGet"];
            assert_eq!(
                (
                    get["path"].as_str(),
                    get["port"].as_str(),
                    get["scheme"].as_str().unwrap_or("HTTP")
                ),
                (Some(path), Some(port), scheme),
                "{}: {probe}",
                self.what
            );
        }
    }

    fn grace_covers(&self, shutdown_s: u64) {
        let grace = self.pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("a grace period");
        let delay = self.container["lifecycle"]["preStop"]["sleep"]["seconds"]
            .as_u64()
            .expect("a preStop delay");
        assert!(
            delay >= 1 && grace >= delay + shutdown_s,
            "{}: a grace period of {grace} s does not cover the preStop delay ({delay} s) and shutdown_s ({shutdown_s} s)",
            self.what
        );
        assert_eq!(self.pod["securityContext"]["runAsNonRoot"], true, "{}", self.what);
    }
}

/// `text` with every absolute path in a string value moved under `root`.
fn rooted(text: &str, root: &Path) -> String {
    text.replace("= \"/", &format!("= \"{}/", root.display()))
}

/// The files a config names, as its volumes would hold them, under `root`: the model, the
/// cluster's and the API's certificates, the metrics token.
fn populate(root: &Path, config: &toml::Table) {
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    let model = at(config["model"].as_str().expect("model"));
    std::fs::create_dir_all(model.parent().expect("a dir")).expect("mkdir");
    if !model.exists() {
        std::os::unix::fs::symlink(common::model(), &model).expect("link the model");
    }
    let cluster = config["cluster"].as_table().expect("[cluster]");
    let dir = at(cluster["ca"].as_str().expect("cluster.ca"))
        .parent()
        .expect("a dir")
        .to_path_buf();
    if !dir.join("ca.pem").exists() {
        let (ok, said) = warden(&["cluster", "certs", "--out", dir.to_str().expect("utf-8"), "node"]);
        assert!(ok, "{said}");
    }
    if let Some(tls) = config.get("tls").and_then(|t| t.as_table()) {
        let (cert, key) = (
            at(tls["cert"].as_str().expect("tls.cert")),
            at(tls["key"].as_str().expect("tls.key")),
        );
        std::fs::create_dir_all(cert.parent().expect("a dir")).expect("mkdir");
        std::fs::copy(dir.join("node.pem"), cert).expect("cert");
        std::fs::copy(dir.join("node.key"), key).expect("key");
    }
    let token = at(config["metrics"]["token_file"].as_str().expect("metrics.token_file"));
    std::fs::create_dir_all(token.parent().expect("a dir")).expect("mkdir");
    std::fs::write(token, "a-scrapers-token-of-32-characters\n").expect("token");
}

#[test]
fn the_kubernetes_base_renders_and_agrees_with_what_warden_serve_accepts() {
    let objects = render();
    let configs = object(&objects, "ConfigMap", "warden-config");
    let policies = object(&objects, "ConfigMap", "warden-policies");
    let scratch = common::temp_dir("deploy");
    let mut parsed: BTreeMap<String, toml::Table> = BTreeMap::new();

    for (kind, name, role) in [
        ("Deployment", "warden-router", "router"),
        ("StatefulSet", "warden-prefill", "prefill"),
        ("StatefulSet", "warden-decode", "decode"),
    ] {
        let w = Workload::of(&objects, kind, name);
        let (config_path, given_role) = w.args();
        assert_eq!(given_role, role, "{}", w.what);
        // Its config is a key of the config ConfigMap, mounted where --config points.
        let (volume, key) = w.mounted(&config_path);
        assert_eq!(
            volume["configMap"]["name"], configs["metadata"]["name"],
            "{}: {config_path}",
            w.what
        );
        let text = configs["data"][&key]
            .as_str()
            .unwrap_or_else(|| panic!("{}: the ConfigMap has no {key}", w.what));
        let config: toml::Table = toml::from_str(text).expect("TOML");
        // `warden config check` on it, its paths under the scratch root with what the volumes
        // hold there.
        populate(&scratch, &config);
        let file = scratch.join(format!("{role}.toml"));
        std::fs::write(&file, rooted(text, &scratch)).expect("write config");
        let (ok, said) = warden(&["config", "check", file.to_str().expect("utf-8")]);
        assert!(ok, "{}: {key}: {said}", w.what);
        // Every file it reads is on a volume: Secrets' files are their keys.
        let cluster = config["cluster"].as_table().expect("[cluster]");
        let mut files: Vec<&str> = ["ca", "cert", "key"]
            .iter()
            .map(|k| cluster[*k].as_str().expect("a cluster TLS file"))
            .collect();
        files.push(config["model"].as_str().expect("model"));
        files.push(config["metrics"]["token_file"].as_str().expect("token_file"));
        if let Some(tls) = config.get("tls").and_then(|t| t.as_table()) {
            files.extend(["cert", "key"].iter().map(|k| tls[*k].as_str().expect("tls")));
        }
        for f in files {
            let (volume, key) = w.mounted(f);
            if volume.get("secret").is_some() {
                assert!(!key.contains('/'), "{}: {f} is in a Secret's subdirectory", w.what);
            }
        }
        // The data dir is writable: a volume not mounted read-only.
        let data = config["data_dir"].as_str().expect("data_dir");
        let mounts = w.container["volumeMounts"].as_array().expect("mounts");
        assert!(
            mounts.iter().any(|m| m["mountPath"] == data && m["readOnly"] != true),
            "{}: data_dir {data} is not a writable volume",
            w.what
        );
        let shutdown = config["timeouts"]["shutdown_s"].as_integer().expect("shutdown_s") as u64;
        w.grace_covers(shutdown);
        if role == "router" {
            // It listens, on every address, where its port and probes are, and its policies are
            // the ConfigMap's.
            let listen = config["listen"].as_str().expect("listen");
            assert!(
                listen.starts_with("0.0.0.0:") || listen.starts_with("[::]:"),
                "{listen}"
            );
            assert_eq!(port_of(listen), w.port("https"));
            // Its startup probe waits longer than it waits for the nodes.
            let startup = &w.container["startupProbe"];
            let window = startup["periodSeconds"].as_u64().expect("period")
                * startup["failureThreshold"].as_u64().expect("threshold");
            let connect = cluster["connect_timeout_s"].as_integer().expect("connect_timeout_s") as u64;
            assert!(
                window > connect,
                "a startup window of {window} s under connect_timeout_s {connect}"
            );
            w.probes("https", "HTTPS");
            let (volume, _) = w.mounted(&format!(
                "{}/default.toml",
                config["policies"].as_str().expect("policies")
            ));
            assert_eq!(volume["configMap"]["name"], policies["metadata"]["name"]);
            let svc = object(&objects, "Service", "warden");
            assert_eq!(svc["spec"]["ports"][0]["targetPort"], "https");
            assert_eq!(
                svc["spec"]["selector"],
                object(&objects, kind, name)["spec"]["selector"]["matchLabels"]
            );
        } else {
            for (key, port) in [("listen", "cluster"), ("ops_listen", "ops")] {
                let at = cluster[key].as_str().expect("an address");
                assert!(
                    at.starts_with("0.0.0.0:") || at.starts_with("[::]:"),
                    "cluster.{key} = {at}"
                );
                assert_eq!(port_of(at), w.port(port), "cluster.{key}");
            }
            // Its cluster port lets in the pods that call it: the router, and for a prefill node
            // the decode nodes.
            let policy = object(&objects, "NetworkPolicy", name);
            let callers: Vec<&str> = if role == "prefill" {
                vec!["warden-router", "warden-decode"]
            } else {
                vec!["warden-router"]
            };
            let rules = policy["spec"]["ingress"].as_array().expect("ingress");
            let port = w.port("cluster");
            let rule = rules
                .iter()
                .find(|r| {
                    r["ports"]
                        .as_array()
                        .is_some_and(|p| p.iter().any(|p| p["port"].as_u64() == Some(port)))
                })
                .expect("a rule for the cluster port");
            let allowed = serde_json::to_string(&rule["from"]).expect("json");
            for c in callers {
                assert!(allowed.contains(c), "{name}'s policy does not let {c} in: {allowed}");
            }
            w.probes("ops", "HTTP");
            let set = object(&objects, kind, name);
            let svc = object(
                &objects,
                "Service",
                set["spec"]["serviceName"].as_str().expect("serviceName"),
            );
            assert_eq!(svc["spec"]["clusterIP"], "None", "a headless Service names the pods");
            assert!(
                svc["spec"]["ports"]
                    .as_array()
                    .expect("ports")
                    .iter()
                    .any(|p| p["targetPort"] == "cluster")
            );
        }
        parsed.insert(role.to_string(), config);
    }

    // The router names every node pod by its stable name, at its cluster port.
    let router = parsed["router"]["cluster"].as_table().expect("[cluster]");
    for role in ["prefill", "decode"] {
        let set = object(&objects, "StatefulSet", &format!("warden-{role}"));
        let replicas = set["spec"]["replicas"].as_u64().expect("replicas");
        let service = set["spec"]["serviceName"].as_str().expect("serviceName");
        let port = port_of(parsed[role]["cluster"]["listen"].as_str().expect("listen"));
        let want: Vec<String> = (0..replicas)
            .map(|i| format!("warden-{role}-{i}.{service}:{port}"))
            .collect();
        let named: Vec<String> = router[role]
            .as_array()
            .expect("nodes")
            .iter()
            .map(|v| v.as_str().expect("an address").to_string())
            .collect();
        assert_eq!(named, want, "the router's cluster.{role}");
    }

    // The policies the ConfigMap carries load as the router would load them.
    let dir = scratch.join("policies");
    std::fs::create_dir_all(&dir).expect("mkdir");
    for (file, text) in policies["data"].as_object().expect("policy files") {
        std::fs::write(dir.join(file), text.as_str().expect("text")).expect("write policy");
    }
    let router_file = scratch.join("router.toml");
    let (ok, said) = warden(&[
        "policies",
        "check",
        dir.to_str().expect("utf-8"),
        "--config",
        router_file.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{said}");
}

/// The Dockerfile's last stage copies the built binary (stripped) and nothing else, runs as a
/// user that is not root, and run bare prints the usage.
#[test]
fn the_image_holds_the_binary_alone_and_runs_as_non_root() {
    let text = std::fs::read_to_string(common::root().join("Dockerfile")).expect("Dockerfile");
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let stages: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].starts_with("FROM ")).collect();
    assert!(stages.len() >= 2, "a multi-stage build: {lines:?}");
    let last: &[&str] = &lines[*stages.last().expect("a stage")..];
    let copies: Vec<&&str> = last
        .iter()
        .filter(|l| l.starts_with("COPY") || l.starts_with("ADD"))
        .collect();
    assert_eq!(copies.len(), 1, "the final stage copies one thing: {copies:?}");
    assert!(
        copies[0].starts_with("COPY --from=build /warden "),
        "the final stage copies the built binary: {copies:?}"
    );
    assert!(
        !last.iter().any(|l| l.starts_with("RUN")),
        "the final stage runs nothing: {last:?}"
    );
    let user = last
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER in the final stage");
    assert!(!["root", "0", "0:0"].contains(&user.trim()), "runs as {user}");
    // The build stage builds this checkout's binary, locked, in release.
    let build: &[&str] = &lines[..*stages.last().expect("a stage")];
    assert!(
        build
            .iter()
            .any(|l| l.contains("cargo build --release --locked --bin warden")),
        "{build:?}"
    );
    // Stripped: no symbols or debug information in the image's binary.
    assert!(
        build.iter().any(|l| l.contains("CARGO_PROFILE_RELEASE_STRIP=symbols")),
        "{build:?}"
    );
    // A bare `docker run` prints the usage, not an error about a missing configuration.
    let cmd = last.iter().rev().find_map(|l| l.strip_prefix("CMD ")).expect("a CMD");
    assert_eq!(cmd.trim(), r#"["--help"]"#, "a bare run's command");
}
