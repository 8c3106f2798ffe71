//! First-position logprobs of a model, for the numerics study (`scripts/numerics.py`): reads
//! `{"prompts": [[token ids], ...], "ids": [[token ids], ...]}` on stdin and prints, for each
//! prompt, the log-probabilities of its `ids` at the position after it, as JSON on stdout.
//!
//! `cargo run --release -p warden --example numerics -- --model FILE < request.json`

use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use warden::engine::TokenLogprobs;
use warden::kv::{KvPool, SeqId};
use warden::model::{Forward, Model, Scratch, StepSeq};
use warden::tenant::TenantId;
use warden_kernels::tag::TagCheck;

#[derive(Parser)]
struct Args {
    /// The GGUF model.
    #[arg(long)]
    model: PathBuf,
}

#[derive(serde::Deserialize)]
struct Request {
    prompts: Vec<Vec<u32>>,
    ids: Vec<Vec<u32>>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let m = Model::load(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input)?;
    let req: Request = serde_json::from_str(&input).context("the request JSON")?;
    let owner = TenantId::new(1).context("tenant 1")?;
    let mut out = Vec::new();
    for (prompt, ids) in req.prompts.iter().zip(&req.ids) {
        let mut pool = KvPool::new(m.config().attn_shape(16), m.config().n_layers, 256 << 20)?;
        pool.open(SeqId(1), owner, pool.pages_for(prompt.len()), &[])?;
        pool.ensure(SeqId(1), prompt.len())?;
        pool.commit_slots(SeqId(1), prompt.len())?;
        let step = [StepSeq {
            seq: SeqId(1),
            tokens: prompt,
            pos0: 0,
            want_logits: true,
            prompt: true,
        }];
        let logits = m
            .forward(&mut pool, &step, TagCheck::Enforce, &mut Scratch::default())
            .remove(0)?
            .context("logits")?;
        let lps: Vec<f32> = ids
            .iter()
            .map(|&id| TokenLogprobs::of(&logits, id, 0).logprob)
            .collect();
        out.push(lps);
    }
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
