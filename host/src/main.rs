//! The `warden` binary: a thin command line over the library.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

use warden::bench::{self, BenchConfig};
use warden::boot::{ServeOptions, serve};
use warden::chat::ChatMessage;
use warden::config::Role;
use warden::config::ServeConfig;
use warden::engine::request::{GenerateRequest, Outcome};
use warden::engine::sampling::SamplingParams;
use warden::engine::{Engine, EngineConfig, Event};
use warden::loaded::LoadedModel;
use warden::serve::manage::{self, Op, PluginOp};
use warden::tenant::TenantId;
use warden::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(
    name = "warden",
    version,
    about = "Multi-tenant LLM serving with a tagged, paged KV pool"
)]
struct Cli {
    /// Log lines on stderr as `text` or `json` (one object a line); `RUST_LOG` filters them
    /// (default `info`).
    #[arg(long, global = true, env = "WARDEN_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for one prompt: the text on stdout, throughput on stderr.
    Generate {
        /// GGUF model file.
        #[arg(long, default_value = warden::DEFAULT_MODEL)]
        model: PathBuf,
        /// The prompt.
        #[arg(long)]
        prompt: String,
        /// Render the prompt as one user message with the model's chat template.
        #[arg(long)]
        chat: bool,
        /// Most tokens to generate.
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Nucleus sampling threshold.
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Keep only the k most likely tokens (0: all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Drop tokens less likely than this fraction of the most likely.
        #[arg(long, default_value_t = 0.0)]
        min_p: f32,
        /// Penalty on tokens already seen (1: none).
        #[arg(long, default_value_t = 1.0)]
        repeat_penalty: f32,
        /// RNG seed (random when absent).
        #[arg(long)]
        seed: Option<u64>,
        /// Stop at this string (repeatable).
        #[arg(long)]
        stop: Vec<String>,
    },
    /// Measure prefill and decode throughput, with tag checks on and off; prints one JSON object.
    Bench {
        /// GGUF model file.
        #[arg(long, default_value = warden::DEFAULT_MODEL)]
        model: PathBuf,
        /// Prompt tokens for the prefill figure.
        #[arg(long, default_value_t = 512)]
        prefill_tokens: usize,
        /// Tokens per sequence for the decode figures.
        #[arg(long, default_value_t = 128)]
        decode_tokens: usize,
        /// Concurrent sequences for the decode figures.
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        batches: Vec<usize>,
        /// Runs of each configuration (the best counts).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Also time decode with every sequence's output under this JSON schema (a file), as
        /// `response_format` puts it, against the same decode unconstrained.
        #[arg(long)]
        json_schema: Option<PathBuf>,
    },
    /// Serve the OpenAI-compatible API over HTTPS until SIGTERM or SIGINT.
    Serve {
        /// Configuration file (TOML; see warden.example.toml). Defaults apply without one.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Serve plain HTTP instead of HTTPS (for a TLS-terminating proxy in front).
        #[arg(long)]
        insecure_http: bool,
        /// What this process is: `all` (API, engine and pool in one process), or one role of a
        /// disaggregated cluster: `prefill` and `decode` nodes (each with its own pool,
        /// listening on cluster.listen), and the `router` (the API; dispatches to the nodes in
        /// cluster.prefill and cluster.decode).
        #[arg(long, value_enum, default_value_t = Role::All)]
        role: Role,
        /// Address to listen on (over the file's `listen` and WARDEN_LISTEN).
        #[arg(long)]
        listen: Option<String>,
        /// The GGUF model file to serve (over the file's `model` and WARDEN_MODEL).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Directory for the state store, certificate and admin token (over the file's
        /// `data_dir` and WARDEN_DATA_DIR).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The id clients name the model by (over the file's `served_model_name`; default the
        /// model file's stem). For one model: several are named in `[[models]]`.
        #[arg(long)]
        served_model_name: Option<String>,
        /// Threads of the compute pool, 0 for one per CPU the process may use (over the file's
        /// `threads` and WARDEN_THREADS).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Check a configuration file as `warden serve` reads it (with the WARDEN_ environment
    /// over it), without starting anything: exits non-zero with the server's message.
    Config {
        #[command(subcommand)]
        op: ConfigOp,
    },
    /// The cluster's mutual TLS: make its CA and node certificates.
    Cluster {
        #[command(subcommand)]
        op: ClusterOp,
    },
    /// Check a policy directory as `warden serve` loads it, against the pools and tokenizers of
    /// the models a configuration serves: exits non-zero with the server's message.
    Policies {
        #[command(subcommand)]
        op: PoliciesOp,
    },
    /// Compile a plugin component read from stdin, writing the artefact to stdout: the server
    /// runs this in a child process under resource limits for every upload.
    #[command(name = "compile-plugin", hide = true)]
    CompilePlugin,
    /// Check that a structured-output format read from stdin compiles, printing what memory it
    /// took: the server runs this in a child process under resource limits for every format a
    /// tenant sends, so a compile that would not end can be stopped.
    #[command(name = "check-grammar", hide = true)]
    CheckGrammar,
    /// Manage tenants (directly, or through a running server's admin API).
    Tenant {
        #[command(subcommand)]
        op: TenantOp,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Manage API keys (directly, or through a running server's admin API).
    Key {
        #[command(subcommand)]
        op: KeyOp,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Manage a tenant's plugins (directly, or through a running server's admin API).
    Plugin {
        #[command(subcommand)]
        op: PluginCmd,
        /// The tenant whose plugins these are.
        #[arg(long, global = true, default_value = "default")]
        tenant: String,
        #[command(flatten)]
        store: StoreArgs,
    },
}

#[derive(Subcommand)]
enum PluginCmd {
    /// Validate a component and store it as a new version (active unless --no-activate).
    Upload {
        /// Plugin name: lowercase letters, digits, '-' and '_'.
        name: String,
        /// The component (.wasm, built for wasm32-wasip2 against wit/plugin.wit).
        file: PathBuf,
        /// Keep the active version as it is.
        #[arg(long)]
        no_activate: bool,
    },
    /// List the tenant's plugins and versions.
    List {
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the last lines the plugin wrote to its tenant's log (at most 200), times in
    /// RFC 3339.
    Logs {
        /// Plugin name.
        name: String,
        /// Keep printing new lines as they are written (every second) until interrupted.
        #[arg(long)]
        follow: bool,
    },
    /// Show one plugin.
    Show {
        /// Plugin name.
        name: String,
    },
    /// Make a version active (hot: the next request runs it).
    Activate {
        /// Plugin name.
        name: String,
        /// Its SHA-256, or at least 8 leading hex digits.
        version: String,
    },
    /// Return to the version active before the current one.
    Rollback {
        /// Plugin name.
        name: String,
    },
    /// Delete a plugin with all its versions, or with --version one inactive version.
    Delete {
        /// Plugin name.
        name: String,
        /// Only this version.
        #[arg(long)]
        version: Option<String>,
    },
    /// Set the configuration every version of the plugin is given, from a file.
    Config {
        /// Plugin name.
        name: String,
        /// A text file (often JSON).
        file: PathBuf,
    },
    /// Run a component on this machine on one request, as the server would, printing every
    /// stage: capabilities, the request preprocess gets and returns, each token with on-token's
    /// action, each output piece with postprocess's, the plugin's log lines and the finish. No
    /// server or store is involved; the model and the plugin limits are those `warden serve
    /// --config` would use (its first model).
    Test {
        /// The component (.wasm).
        component: PathBuf,
        /// A JSON request body for /v1/chat/completions (with "messages") or /v1/completions.
        #[arg(long)]
        request: PathBuf,
        /// The model file to run (over the configuration's and WARDEN_MODEL).
        #[arg(long)]
        model: Option<PathBuf>,
        /// A file whose text is the plugin's configuration (what `init` is given).
        #[arg(long)]
        plugin_config: Option<PathBuf>,
    },
    /// Start a plugin: write a crate (the SDK by path, a typed configuration, a request to try)
    /// that builds with `cargo build --release` and runs with `warden plugin test` as printed.
    New {
        /// Its name: lowercase letters, digits, '-' and '_', starting with a letter.
        name: String,
        /// Where to write it (default: a directory named NAME here).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The SDK (`guest-sdk` of Warden's repository); default: the one this binary was
        /// built from.
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
    /// Make the plugin the tenant's default (run when a request names none); --clear undoes it.
    Default {
        /// Plugin name.
        name: String,
        /// Stop it being the default.
        #[arg(long)]
        clear: bool,
    },
}

#[derive(clap::Args)]
struct StoreArgs {
    /// The server's configuration file (its data_dir holds the store; `plugin test` runs its
    /// model under its plugin limits).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// The data dir, overriding the configuration's.
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
}

impl StoreArgs {
    fn data_dir(&self) -> anyhow::Result<PathBuf> {
        if let Some(d) = &self.data_dir {
            return Ok(d.clone());
        }
        Ok(config(self.config.as_deref())?.data_dir)
    }
}

#[derive(Subcommand)]
enum ConfigOp {
    /// Check FILE: its keys, types and ranges, that each model file it names is there, the
    /// metrics token file's token, and the cluster's certificates and key.
    Check {
        /// The configuration file.
        file: PathBuf,
    },
}

#[derive(Subcommand)]
enum ClusterOp {
    /// Make a cluster CA (ca.pem, ca.key; one already in DIR signs instead) and, for each NAME,
    /// NAME.pem and NAME.key: a certificate for server and client use, valid for the name
    /// warden-cluster, NAME and any HOSTs (names or IP addresses). Set [cluster] ca, cert and
    /// key on every node and the router to use them. Keys are written mode 0600; keep ca.key
    /// off the nodes.
    Certs {
        /// Where to write the files.
        #[arg(long)]
        out: PathBuf,
        /// A node or router: NAME, or NAME=HOST,HOST... (letters, digits, -_. in NAME).
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Subcommand)]
enum PoliciesOp {
    /// Check DIR (default.toml and tenants/*.toml): each file's keys and ranges, the KV pages
    /// and pins against the smallest pool, and the public prefixes tokenized by each model.
    Check {
        /// The policy directory.
        dir: PathBuf,
        /// The server's configuration (its models and KV pool); defaults apply without one.
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum TenantOp {
    /// Create a tenant.
    Create {
        /// Its name: lowercase letters, digits, '-' and '_'.
        name: String,
    },
    /// List tenants.
    List {
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete a tenant and its keys.
    Delete {
        /// Its name.
        name: String,
    },
}

#[derive(Subcommand)]
enum KeyOp {
    /// Create an API key for a tenant; prints it once.
    Create {
        /// The tenant.
        tenant: String,
    },
    /// Revoke a key.
    Revoke {
        /// The key's id (or the whole key).
        id: String,
    },
    /// List keys (never the keys themselves).
    List {
        /// Only this tenant's.
        tenant: Option<String>,
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
}

/// The configuration at `path` (none: the defaults) with the WARDEN_ environment over it.
fn config(path: Option<&Path>) -> anyhow::Result<ServeConfig> {
    Ok(ServeConfig::load_layered(path, std::env::vars(), &[])?)
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let log = match cli.log_format.parse().and_then(warden::log::init) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("warden: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = run(cli.command);
    // What the log still has queued goes out before the last word.
    drop(log);
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("warden: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Generate {
            model,
            prompt,
            chat,
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            repeat_penalty,
            seed,
            stop,
        } => {
            let l = LoadedModel::open(&model)?;
            let prompt_tokens = if chat {
                let t = l
                    .chat
                    .as_ref()
                    .context("the model has no chat template (tokenizer.chat_template)")?;
                let text = t.render(&[ChatMessage::new("user", prompt)], true)?;
                l.tokenizer.encode_chat(&text)
            } else {
                l.tokenizer.encode(&prompt, true)
            };
            let sampling = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty: repeat_penalty,
                seed,
                ..SamplingParams::default()
            };
            // The command line's one-off generation is the only tenant of its own engine.
            const CLI_TENANT: TenantId = match TenantId::new(1) {
                Some(t) => t,
                None => panic!("1 is a tenant id"),
            };
            let req = GenerateRequest {
                owner: CLI_TENANT,
                prompt: prompt_tokens,
                sampling,
                max_tokens,
                open_ended: false,
                stop,
                ignore_eos: false,
                logprobs: None,
                request_id: String::new(),
            };
            generate(&l, req)
        }
        Command::Bench {
            model,
            prefill_tokens,
            decode_tokens,
            batches,
            repeats,
            json_schema,
        } => {
            if prefill_tokens == 0 || decode_tokens < 2 || batches.is_empty() || batches.contains(&0) {
                bail!("bench needs --prefill-tokens ≥ 1, --decode-tokens ≥ 2 and positive --batches");
            }
            let l = LoadedModel::open(&model)?;
            let constraint = match json_schema {
                None => None,
                Some(path) => {
                    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
                    let schema: serde_json::Value =
                        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
                    let limits = warden::grammar::GrammarLimits {
                        max_schema_bytes: usize::MAX,
                        compile_ms: u64::MAX,
                        memory_bytes: u64::MAX,
                    };
                    let g = warden::grammar::Grammars::new(l.tokenizer.clone(), limits);
                    g.compile(&warden::grammar::Format::JsonSchema(schema))
                        .with_context(|| format!("compiling {}", path.display()))?
                }
            };
            let cfg = BenchConfig {
                prefill_prompt: bench_prompt(&l.tokenizer, prefill_tokens),
                decode_batches: batches,
                decode_tokens,
                repeats,
                constraint,
            };
            let report = bench::run(l.model, l.tokenizer.clone(), &model.display().to_string(), &cfg)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Command::Serve {
            config: path,
            insecure_http,
            role,
            listen,
            model,
            data_dir,
            served_model_name,
            threads,
        } => {
            let path_value = |p: PathBuf| toml::Value::String(p.to_string_lossy().into_owned());
            let mut flags = Vec::new();
            if let Some(n) = served_model_name {
                flags.push(("served_model_name", toml::Value::String(n)));
            }
            if let Some(t) = threads {
                let t = i64::try_from(t).context("--threads: too large")?;
                flags.push(("threads", toml::Value::Integer(t)));
            }
            if let Some(l) = listen {
                flags.push(("listen", toml::Value::String(l)));
            }
            if let Some(m) = model {
                flags.push(("model", path_value(m)));
            }
            if let Some(d) = data_dir {
                flags.push(("data_dir", path_value(d)));
            }
            let cfg = ServeConfig::load_layered(path.as_deref(), std::env::vars(), &flags)?;
            Ok(serve(cfg, ServeOptions { insecure_http, role })?)
        }
        Command::Cluster {
            op: ClusterOp::Certs { out, names },
        } => {
            let mut nodes = Vec::new();
            for n in &names {
                let (name, hosts) = n.split_once('=').unwrap_or((n, ""));
                if !warden::cluster::tls::valid_cert_name(name) {
                    bail!(
                        "{name:?} is not a certificate name: use letters, digits and -_. (at most 64, not starting with .)"
                    );
                }
                let hosts: Vec<String> = hosts.split(',').filter(|h| !h.is_empty()).map(str::to_string).collect();
                nodes.push((name.to_string(), hosts));
            }
            let made = warden::cluster::tls::make_certs(&out, &nodes)?;
            println!(
                "{} CA {} (its key {} stays off the nodes)",
                if made.new_ca { "made" } else { "used the" },
                out.join("ca.pem").display(),
                out.join("ca.key").display()
            );
            for c in &made.certs {
                println!("made {} and its key", c.display());
            }
            Ok(())
        }
        Command::Policies {
            op: PoliciesOp::Check { dir, config: path },
        } => {
            let cfg = config(path.as_deref())?;
            // The models' pools and tokenizers as the server makes them.
            let (mut pools, mut tokenizers, mut engines) = (Vec::new(), Vec::new(), Vec::new());
            for s in cfg.served() {
                let loaded = LoadedModel::open(&s.path)?;
                let engine = warden::runner::start_engine(&cfg, &s, &loaded)?;
                pools.push((engine.kv_counters().pages_total, engine.pinnable_pages()));
                tokenizers.push(loaded.tokenizer.clone());
                engines.push((s.name, engine));
            }
            let bounds = warden::policy::Bounds::of_pools(&pools, cfg.kv.page_size);
            let tokenize = |text: &str| tokenizers.iter().map(|tk| tk.encode(text, true)).collect();
            let set = warden::policy::PolicySet::load(&dir, bounds, &tokenize)
                .context("loading the tenants' policies (see `policies` in the config)")?;
            // Its public prefixes computed and pinned in each pool, as the server does at start.
            for (i, (name, engine)) in engines.iter_mut().enumerate() {
                engine
                    .set_public_prefixes(&set.public_prefixes(i))
                    .with_context(|| format!("computing the public prefixes of the policies (public_prefixes in default.toml) on model {name}"))?;
            }
            println!("{}: ok (version {})", dir.display(), set.version);
            Ok(())
        }
        Command::Config {
            op: ConfigOp::Check { file },
        } => {
            let cfg = ServeConfig::load_layered(Some(&file), std::env::vars(), &[])?;
            for m in cfg.served() {
                if !m.path.exists() {
                    bail!(warden::loaded::LoadError::NotFound(m.path.clone()));
                }
            }
            cfg.metrics.token()?;
            // The cluster's certificates, read as a node or the router reads them.
            warden::cluster::link::Transport::new(&cfg.cluster)?;
            let names: Vec<String> = cfg.served().into_iter().map(|m| m.name).collect();
            println!(
                "{}: ok (listen {}, data_dir {}, serving {})",
                file.display(),
                cfg.listen,
                cfg.data_dir.display(),
                names.join(", ")
            );
            Ok(())
        }
        Command::Tenant { op, store } => {
            let op = match op {
                TenantOp::Create { name } => Op::TenantCreate(name),
                TenantOp::List { json } => Op::TenantList(json),
                TenantOp::Delete { name } => Op::TenantDelete(name),
            };
            println!("{}", manage::run(&store.data_dir()?, op)?);
            Ok(())
        }
        Command::Key { op, store } => {
            let op = match op {
                KeyOp::Create { tenant } => Op::KeyCreate(tenant),
                KeyOp::Revoke { id } => Op::KeyRevoke(id),
                KeyOp::List { tenant, json } => Op::KeyList(tenant, json),
            };
            println!("{}", manage::run(&store.data_dir()?, op)?);
            Ok(())
        }
        // Its exit status is its protocol with the server.
        Command::CompilePlugin => std::process::exit(warden::plugin::compile::precompile_main()),
        Command::CheckGrammar => std::process::exit(warden::grammar::check::check_main()),
        Command::Plugin {
            op:
                PluginCmd::Test {
                    component,
                    request,
                    model,
                    plugin_config,
                },
            store,
            ..
        } => {
            let config = match &plugin_config {
                Some(p) => std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
                None => String::new(),
            };
            // The model as `warden serve` finds it: the flag, else the configuration's first.
            let flags: Vec<(&str, toml::Value)> = model
                .map(|m| ("model", toml::Value::String(m.to_string_lossy().into_owned())))
                .into_iter()
                .collect();
            let cfg = ServeConfig::load_layered(store.config.as_deref(), std::env::vars(), &flags)?;
            let run = warden::serve::plugins::local::LocalRun {
                component,
                config,
                request,
                model: cfg.served().remove(0).path,
                plugins: cfg.plugins.clone(),
            };
            let mut out = std::io::stdout().lock();
            warden::serve::plugins::local::run(&run, &mut out)?;
            Ok(())
        }
        Command::Plugin {
            op: PluginCmd::New { name, dir, sdk },
            store,
            ..
        } => {
            use warden::serve::plugins::scaffold;
            // The model `plugin test` runs: the one `warden serve` would, from here.
            let cfg = config(store.config.as_deref())?;
            let model = cfg.served().remove(0).path;
            let new = scaffold::NewPlugin {
                dir: dir.unwrap_or_else(|| PathBuf::from(&name)),
                name,
                sdk: sdk.unwrap_or_else(scaffold::built_with_sdk),
                model: model.canonicalize().ok(),
                data_dir: store
                    .data_dir
                    .clone()
                    .unwrap_or_else(|| cfg.data_dir.clone())
                    .canonicalize()
                    .ok(),
            };
            let made = scaffold::create(&new)?;
            println!("wrote {} in {}", made.join(", "), new.dir.display());
            println!("build it, try it, upload it and configure it:");
            for l in scaffold::next_steps(&new).lines() {
                println!("  {l}");
            }
            Ok(())
        }
        Command::Plugin {
            op: PluginCmd::Logs { name, follow },
            tenant,
            store,
        } => {
            let cfg = config(store.config.as_deref())?;
            let data_dir = store.data_dir.clone().unwrap_or_else(|| cfg.data_dir.clone());
            let mut last: Option<String> = None;
            loop {
                let mut lines = manage::plugin_logs(&data_dir, &tenant, &name)?;
                // What came after the last line shown (all of it when that line has left the
                // window).
                if let Some(i) = last.as_ref().and_then(|l| lines.iter().rposition(|x| x == l)) {
                    lines.drain(..=i);
                }
                let mut out = std::io::stdout().lock();
                for l in &lines {
                    writeln!(out, "{l}")?;
                }
                out.flush()?;
                if let Some(l) = lines.pop() {
                    last = Some(l);
                }
                if !follow {
                    return Ok(());
                }
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
        Command::Plugin { op, tenant, store } => {
            let list_json = matches!(op, PluginCmd::List { json: true });
            let listing = matches!(op, PluginCmd::List { .. });
            let op = match op {
                PluginCmd::Upload {
                    name,
                    file,
                    no_activate,
                } => PluginOp::Upload {
                    name,
                    file,
                    activate: !no_activate,
                },
                PluginCmd::List { .. } => PluginOp::List,
                PluginCmd::Show { name } => PluginOp::Show(name),
                PluginCmd::Activate { name, version } => PluginOp::Activate { name, version },
                PluginCmd::Rollback { name } => PluginOp::Rollback(name),
                PluginCmd::Delete {
                    name,
                    version: Some(version),
                } => PluginOp::DeleteVersion { name, version },
                PluginCmd::Delete { name, version: None } => PluginOp::Delete(name),
                PluginCmd::Config { name, file } => PluginOp::Config { name, file },
                PluginCmd::Default { name, clear: false } => PluginOp::Default(name),
                PluginCmd::Default { name, clear: true } => PluginOp::ClearDefault(name),
                PluginCmd::Test { .. } | PluginCmd::Logs { .. } | PluginCmd::New { .. } => {
                    unreachable!("handled above")
                }
            };
            let cfg = config(store.config.as_deref())?;
            let data_dir = store.data_dir.clone().unwrap_or_else(|| cfg.data_dir.clone());
            let v = manage::plugin(&cfg, &data_dir, &tenant, op)?;
            if listing && !list_json {
                println!("{}", manage::plugin_lines(&v));
            } else {
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
            Ok(())
        }
    }
}

/// `n` tokens of ordinary English text.
fn bench_prompt(tok: &Tokenizer, n: usize) -> Vec<u32> {
    const TEXT: &str = "The history of the city begins on an island in the river, where a small settlement \
        of fishermen and traders grew over centuries into a capital of art, science and government. ";
    let one = tok.encode(TEXT, false);
    one.iter().copied().cycle().take(n).collect()
}

fn generate(l: &LoadedModel, req: GenerateRequest) -> anyhow::Result<()> {
    let prompt_tokens = req.prompt.len();
    // One request: the pool need only hold it, not the model's whole trained context.
    let mut cfg = EngineConfig::for_model(&l.model);
    let need = (prompt_tokens + req.max_tokens).next_multiple_of(cfg.page_size);
    cfg.max_context = cfg.max_context.min(need.max(cfg.page_size));
    let mut engine = Engine::new(l.model.clone(), l.tokenizer.clone(), cfg)?;
    let t0 = Instant::now();
    req.validate(&engine.limits())
        .and_then(|req| engine.submit(req))
        .map_err(|r| anyhow::anyhow!("{} ({})", r.reason, r.reason.code()))?;
    let mut first_token_at = None;
    let mut out = std::io::stdout().lock();
    loop {
        for ev in engine.step() {
            match ev {
                Event::Token { text, .. } => {
                    first_token_at.get_or_insert_with(Instant::now);
                    out.write_all(text.as_bytes())?;
                    out.flush()?;
                }
                Event::Done {
                    outcome, text, usage, ..
                } => {
                    out.write_all(text.as_bytes())?;
                    writeln!(out)?;
                    out.flush()?;
                    let end = Instant::now();
                    let first = first_token_at.unwrap_or(end);
                    let prefill_s = (first - t0).as_secs_f64();
                    let decode_s = (end - first).as_secs_f64();
                    let decoded = usage.completion_tokens.saturating_sub(1);
                    eprintln!(
                        "prefill: {prompt_tokens} tokens in {:.1} ms, {:.1} tok/s; decode: {decoded} tokens in {:.1} ms, {:.1} tok/s",
                        prefill_s * 1e3,
                        prompt_tokens as f64 / prefill_s,
                        decode_s * 1e3,
                        if decode_s > 0.0 { decoded as f64 / decode_s } else { 0.0 },
                    );
                    return match outcome {
                        Outcome::Finished(_) => Ok(()),
                        Outcome::Aborted(why) => bail!("generation aborted: {why}"),
                    };
                }
                // Only disaggregated halves end so or wait so; this submits a whole request.
                Event::Prefilled { .. } => bail!("the request ended as prefill-only"),
                Event::Opened { .. } => bail!("the request waits for a transfer"),
            }
        }
    }
}
