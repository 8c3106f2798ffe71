//! A hostile plugin for Warden's containment tests: its config picks the attack.
//!
//! In `preprocess`: `loop` spins forever, `bomb` allocates without bound, `recurse` recurses
//! without bound, `trap` panics, `huge` returns a 64 MiB prompt, `big` an 8 MiB one and `big40` a 40 MiB
//! one (they fit the guest's memory; the host must refuse them before tokenizing), `many` 50,000 messages, `sleep`
//! sleeps 20 s and `sleep-forever` as long as it can (on the host's clock, if it could),
//! `encode-huge` asks the tokenizer to encode 16 MiB, `encode-loop` encodes 64 KiB over and over,
//! `decode-loop` decodes 64 Ki tokens over and over, `log-loop` logs 1 KiB lines over and over.
//! `flood` (in its output calls) turns every chunk into 2 MiB of text, `swell` into 8 KiB.
//! `constrain-nothing` answers each token with a constraint that allows no next token, and
//! `constrain-outside` with one naming a token id outside the vocabulary.
//!
//! In the first `postprocess` (while the sequence is live), against the `kv` capabilities: `kv` reports its own pages
//! (`[kv pages=N written=W] [epochs E1,E2,...]`, appended to the output); `forge-page:N` and `forge-seq:N` call the
//! host with handle number N that the host never gave it; `keep` stores its first page handle
//! in a static and, if a static from an earlier request were still there, uses that instead
//! (appending `[kept handle N]` or `[reused handle N: ...]`).
//!
//! `print-in-init` writes to stdout in `init`; `print-and-spin:N` does too (so `init` cannot be
//! pre-initialised and runs for every request), then spins N million times (as near its fuel
//! limit as N puts it).
//!
//! Anything else passes the request on. Like a real attacker, it behaves in the server's smoke
//! call (metadata `endpoint` = `upload-check`), which its configuration must pass: the attacks
//! come in live traffic, where the runtime's limits are what stop them.

use std::sync::atomic::{AtomicU32, Ordering};

use warden_guest::{
    Capabilities, Chunk, Finish, Input, Message, Plugin, PluginError, Request, Token, TokenAction, TokenConstraint, kv,
    log, tokenizer,
};

struct Adversary;

static CONFIG: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());
static KEPT: AtomicU32 = AtomicU32::new(0);
static STRUCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn config() -> String {
    CONFIG.lock().map(|c| c.clone()).unwrap_or_default()
}

fn own_pages() -> Result<Vec<kv::KvPage>, String> {
    kv::current().ok_or("no sequence yet")?.pages()
}

#[inline(never)]
#[allow(unconditional_recursion)]
fn recurse(n: u64, sink: &mut [u64; 16]) -> u64 {
    sink[(n % 16) as usize] = n;
    let mut local = [n; 16];
    local[0] = recurse(n + 1, &mut local);
    local[0] ^ sink[0]
}

impl Plugin for Adversary {
    fn init(config: String) -> Result<(), PluginError> {
        // Writes to stdout while it is initialised: a snapshot of it must not keep the stream.
        if config == "print-in-init" {
            println!("initialising");
        }
        if let Some(n) = config.strip_prefix("print-and-spin:") {
            println!("initialising");
            let n: u64 = n.trim().parse().unwrap_or(0);
            let mut x = 0u64;
            for _ in 0..n * 1_000_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        Ok(())
    }

    fn capabilities() -> Capabilities {
        Capabilities {
            on_token: config().starts_with("constrain-"),
        }
    }

    fn on_token(_token: Token) -> TokenAction {
        let only = |ids: Vec<u32>| {
            TokenAction::Constrain(TokenConstraint {
                allowed: Some(ids),
                bias: vec![],
            })
        };
        match config().as_str() {
            "constrain-nothing" => only(vec![]),
            "constrain-outside" => only(vec![u32::MAX]),
            _ => TokenAction::Continue,
        }
    }

    fn preprocess(mut req: Request) -> Result<Request, PluginError> {
        let checked = req.metadata.iter().any(|(k, v)| k == "endpoint" && v == "upload-check");
        let attack = if checked { "" } else { req.config.trim() };
        if let Ok(mut c) = CONFIG.lock() {
            *c = attack.to_string();
        }
        match attack {
            "loop" => {
                let mut x = 0u64;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            "bomb" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "recurse" => {
                let mut sink = [0u64; 16];
                let _ = std::hint::black_box(recurse(0, &mut sink));
            }
            "trap" => panic!("the adversary traps"),
            "huge" => req.input = Input::Prompt("x".repeat(64 << 20)),
            "big" => req.input = Input::Prompt("x ".repeat(4 << 20)),
            "big40" => req.input = Input::Prompt("x ".repeat(20 << 20)),
            "many" => {
                req.input = Input::Chat(
                    (0..50_000)
                        .map(|_| Message {
                            role: "user".into(),
                            content: String::new(),
                        })
                        .collect(),
                )
            }
            "sleep" => std::thread::sleep(std::time::Duration::from_secs(20)),
            "sleep-forever" => std::thread::sleep(std::time::Duration::MAX),
            "encode-huge" => {
                std::hint::black_box(tokenizer::encode(&"hello ".repeat((16 << 20) / 6)));
            }
            "encode-loop" => {
                let text = "hello world ".repeat((64 << 10) / 12);
                loop {
                    std::hint::black_box(tokenizer::encode(&text));
                }
            }
            "decode-loop" => {
                let ids = vec![1u32; 64 << 10];
                loop {
                    std::hint::black_box(tokenizer::decode(&ids));
                }
            }
            "print" => {
                println!("to stdout\x1b[2J");
                print!("no newline");
                let _ = std::io::Write::flush(&mut std::io::stdout());
                eprintln!("to stderr");
            }
            "print-flood" => loop {
                println!();
                eprint!("{}", "e".repeat(4096));
            },
            "log-loop" => {
                let line = "y".repeat(1024);
                loop {
                    log::log(log::Level::Info, &line);
                }
            }
            _ => {}
        }
        Ok(req)
    }

    fn postprocess(mut chunk: Chunk, end: Option<Finish>) -> Result<Chunk, PluginError> {
        match config().as_str() {
            "flood" => {
                return Ok(Chunk {
                    text: "z".repeat(2 << 20),
                });
            }
            "swell" => {
                return Ok(Chunk {
                    text: "z".repeat(8 << 10),
                });
            }
            _ => {}
        }
        if end.is_some() || STRUCK.swap(true, Ordering::SeqCst) {
            return Ok(chunk);
        }
        let cfg = config();
        let number = |p: &str| cfg.strip_prefix(p).and_then(|n| n.parse::<u32>().ok());
        let note = if cfg == "kv" {
            match own_pages() {
                Ok(pages) => {
                    let (mut written, mut epochs) = (0, Vec::new());
                    for p in &pages {
                        if let Ok(i) = p.info() {
                            written += i.written;
                            epochs.push(i.epoch.to_string());
                        }
                    }
                    format!(
                        " [kv pages={} written={written}] [epochs {}]",
                        pages.len(),
                        epochs.join(",")
                    )
                }
                Err(e) => format!(" [kv error: {e}]"),
            }
        } else if let Some(n) = number("forge-page:") {
            // SAFETY (guest side): deliberately wrong; the host must refuse the number.
            let page = unsafe { kv::KvPage::from_handle(n) };
            format!(" [forged page {n}: {:?}]", page.info())
        } else if let Some(n) = number("forge-seq:") {
            // SAFETY (guest side): deliberately wrong; the host must refuse the number.
            let seq = unsafe { kv::Sequence::from_handle(n) };
            format!(" [forged sequence {n}: {:?}]", seq.pages().map(|p| p.len()))
        } else if cfg == "keep" {
            match KEPT.load(Ordering::SeqCst) {
                0 => match own_pages() {
                    Ok(mut pages) if !pages.is_empty() => {
                        let n = pages.remove(0).take_handle();
                        KEPT.store(n, Ordering::SeqCst);
                        format!(" [kept handle {n}]")
                    }
                    other => format!(" [keep failed: {:?}]", other.map(|p| p.len())),
                },
                n => {
                    // SAFETY (guest side): a handle from an earlier request, if one survived.
                    let page = unsafe { kv::KvPage::from_handle(n) };
                    format!(" [reused handle {n}: {:?}]", page.info())
                }
            }
        } else {
            String::new()
        };
        chunk.text.push_str(&note);
        Ok(chunk)
    }
}

warden_guest::plugin!(Adversary);
