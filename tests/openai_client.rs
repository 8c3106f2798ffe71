//! The official OpenAI Python client against the real server over TLS, trusting the generated
//! certificate: chat (streamed and not), completions, models, logprobs, `n`, and its error types.
//! Greedy chat output must equal `warden generate --chat` for the same message.

mod common;

use std::process::Command;

use common::{MODEL, Server, root, warden_bin};

const QUESTION: &str = "What is the capital of France?";

#[test]
fn the_official_openai_client_works_unmodified() {
    let python = root().join(".venv-e2e/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/e2e-venv.sh (the README's test command does)",
        python.display()
    );
    let s = Server::start("openai", "");
    let out = Command::new(&python)
        .arg(root().join("tests/openai_client.py"))
        .env("WARDEN_URL", &s.url)
        .env("WARDEN_KEY", s.key())
        .env("WARDEN_CERT", &s.cert)
        .env("WARDEN_MODEL", MODEL)
        .env("WARDEN_QUESTION", QUESTION)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "the client failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the script prints JSON");

    let generated = Command::new(warden_bin())
        .args([
            "generate",
            "--chat",
            "--max-tokens",
            "24",
            "--prompt",
            QUESTION,
            "--model",
        ])
        .arg(common::model())
        .output()
        .expect("warden generate");
    assert!(generated.status.success());
    let generated = String::from_utf8_lossy(&generated.stdout);
    let generated = generated.strip_suffix('\n').unwrap_or(&generated);

    assert_eq!(v["models"], serde_json::json!([MODEL]));
    assert_eq!(v["chat"], generated, "greedy chat equals warden generate --chat");
    assert_eq!(v["chat_stream"], generated, "the stream carries the same text");
    assert_eq!(v["stream_finishes"], serde_json::json!([v["chat_finish"]]));
    let u = &v["chat_usage"];
    let prompt = u["prompt_tokens"].as_u64().unwrap();
    assert_eq!(u["total_tokens"], prompt + u["completion_tokens"].as_u64().unwrap());
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    // The stream repeats the chat's prompt: the tenant's prefix cache serves its whole pages (all
    // but the last token's page), and the client reads that in the usage it expects.
    let mut stream_usage = v["stream_usage"].clone();
    assert_eq!(
        stream_usage["prompt_tokens_details"]["cached_tokens"],
        (prompt - 1) / 16 * 16
    );
    stream_usage["prompt_tokens_details"]["cached_tokens"] = 0.into();
    assert_eq!(stream_usage, v["chat_usage"]);
    assert!(v["completion"].as_str().is_some_and(|t| !t.is_empty()));
    assert_eq!(v["completion"], v["completion_stream"]);
    assert_eq!(v["completion_finish"], "length");
    let lp = v["logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), 4);
    for t in lp {
        let top = t["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0][0], t["token"], "{t}");
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
    }
    assert_eq!(v["n"], serde_json::json!([0, 1]));
    assert_eq!(v["over_length"], serde_json::json!([400, "context_length_exceeded"]));
    assert_eq!(v["bad_key"], serde_json::json!([401, "invalid_api_key"]));
}
