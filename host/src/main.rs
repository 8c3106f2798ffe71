//! The `warden` binary: a thin command line over the library.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

use warden::bench::{self, BenchConfig};
use warden::chat::{ChatMessage, ChatTemplate};
use warden::engine::request::{GenerateRequest, Outcome};
use warden::engine::sampling::SamplingParams;
use warden::engine::text::Detokenizer;
use warden::engine::{Engine, EngineConfig, Event};
use warden::gguf::Gguf;
use warden::model::Model;
use warden::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(
    name = "warden",
    version,
    about = "Multi-tenant LLM serving with a tagged, paged KV pool"
)]
struct Cli {
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
    },
}

struct Loaded {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
}

fn load(path: &PathBuf) -> anyhow::Result<Loaded> {
    if !path.exists() {
        bail!(
            "model file {} not found (run scripts/fetch-model.sh for the default model)",
            path.display()
        );
    }
    let g = Gguf::open(path).with_context(|| format!("reading {}", path.display()))?;
    let model = Model::from_gguf(&g).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&g).with_context(|| format!("tokenizer of {}", path.display()))?;
    let chat = ChatTemplate::from_gguf(&g).with_context(|| format!("chat template of {}", path.display()))?;
    Ok(Loaded {
        model: Arc::new(model),
        tokenizer: Arc::new(tokenizer),
        chat,
    })
}

struct TokenizerDetok(Arc<Tokenizer>);

impl Detokenizer for TokenizerDetok {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.0.token_bytes(id)
    }
    fn is_eog(&self, id: u32) -> bool {
        self.0.is_eog(id)
    }
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("warden: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
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
            let l = load(&model)?;
            let text = if chat {
                let t = l
                    .chat
                    .as_ref()
                    .context("the model has no chat template (tokenizer.chat_template)")?;
                t.render(
                    &[ChatMessage {
                        role: "user".into(),
                        content: prompt,
                    }],
                    true,
                )?
            } else {
                prompt
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
            let req = GenerateRequest {
                owner: 1,
                prompt: l.tokenizer.encode(&text, true),
                sampling,
                max_tokens,
                stop,
                ignore_eos: false,
            };
            generate(&l, req)
        }
        Command::Bench {
            model,
            prefill_tokens,
            decode_tokens,
            batches,
            repeats,
        } => {
            if prefill_tokens == 0 || decode_tokens < 2 || batches.is_empty() || batches.contains(&0) {
                bail!("bench needs --prefill-tokens ≥ 1, --decode-tokens ≥ 2 and positive --batches");
            }
            let l = load(&model)?;
            let cfg = BenchConfig {
                prefill_prompt: bench_prompt(&l.tokenizer, prefill_tokens),
                decode_batches: batches,
                decode_tokens,
                repeats,
            };
            let report = bench::run(
                l.model,
                Arc::new(TokenizerDetok(l.tokenizer)),
                &model.display().to_string(),
                &cfg,
            )?;
            println!("{}", serde_json::to_string_pretty(&report)?);
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

fn generate(l: &Loaded, req: GenerateRequest) -> anyhow::Result<()> {
    let prompt_tokens = req.prompt.len();
    let mut engine = Engine::new(
        l.model.clone(),
        Arc::new(TokenizerDetok(l.tokenizer.clone())),
        EngineConfig::for_model(&l.model),
    )?;
    let t0 = Instant::now();
    engine
        .submit(req)
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
            }
        }
    }
}
