//! The official OpenAI Python client against the real server over TLS, trusting the generated
//! certificate: chat (streamed and not), completions (with legacy `logprobs` and `echo`), models,
//! logprobs, `n`, `logit_bias`, the penalties, `response_format` (JSON validated against its
//! schema), tools (a call, its result sent back, an answer), fields the server does not know, and its error types. Greedy chat output must equal `warden generate --chat` for the same message.

mod common;

use std::process::Command;

use common::{MODEL, Server, root, warden_bin};
use warden::gguf::Gguf;
use warden::tokenizer::Tokenizer;

const QUESTION: &str = "What is the capital of France?";
const PROMPT: &str = "The capital of France is";

/// `warden generate`'s greedy output for `args`.
fn generate(args: &[&str]) -> String {
    let out = Command::new(warden_bin())
        .arg("generate")
        .args(args)
        .arg("--model")
        .arg(common::model())
        .output()
        .expect("warden generate");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

/// The id of the one token `text` is.
fn one_token(tok: &Tokenizer, text: &str) -> u32 {
    match tok.encode(text, false)[..] {
        [id] => id,
        ref ids => panic!("{text:?} is tokens {ids:?}, not one token"),
    }
}

#[test]
fn the_official_openai_client_works_unmodified() {
    let python = root().join(".venv-e2e/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/e2e-venv.sh (the README's test command does)",
        python.display()
    );
    let tok = Tokenizer::from_gguf(&Gguf::open(common::model()).expect("model")).expect("tokenizer");
    // The completion's greedy first token, and another one to force.
    let first = generate(&["--max-tokens", "1", "--prompt", PROMPT]);
    let greedy = one_token(&tok, &first);
    let force = one_token(&tok, " London");
    assert_ne!(greedy, force);
    let s = Server::start("openai", "");
    let out = Command::new(&python)
        .arg(root().join("tests/openai_client.py"))
        .env("WARDEN_URL", &s.url)
        .env("WARDEN_KEY", s.key())
        .env("WARDEN_CERT", &s.cert)
        .env("WARDEN_MODEL", MODEL)
        .env("WARDEN_QUESTION", QUESTION)
        .env("WARDEN_PROMPT", PROMPT)
        .env("WARDEN_GREEDY", greedy.to_string())
        .env("WARDEN_FORCE", force.to_string())
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "the client failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the script prints JSON");

    let generated = generate(&["--chat", "--max-tokens", "24", "--prompt", QUESTION]);

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
    // Legacy logprobs: four parallel lists, the tokens spelling the text, greedy's token first
    // among the alternatives, offsets where each token's text starts.
    let lp = &v["completion_logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 8);
    assert_eq!(tokens.concat(), v["completion"].as_str().unwrap());
    assert_eq!(tokens[0], first);
    let mut at = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], at);
        at += t.chars().count();
        let top = lp["top"][i].as_array().unwrap();
        assert_eq!(top.len(), 2, "{lp}");
        assert_eq!(top[0][0], *t);
        assert_eq!(top[0][1], lp["token_logprobs"][i]);
    }
    assert_eq!(v["completion_stream_tokens"], lp["tokens"]);
    let echoed = format!("{PROMPT}{}", v["completion"].as_str().unwrap());
    assert_eq!(
        (v["echo"].as_str(), v["echo_stream"].as_str()),
        (Some(&*echoed), Some(&*echoed))
    );
    // logit_bias, both ways.
    assert_ne!(v["banned_first"], first.as_str(), "-100 on the greedy token moves it");
    let force_text = v["force_text"].as_str().unwrap();
    let force_text = force_text.strip_prefix(" London").expect("echo of the forced token");
    assert_eq!(force_text, " London");
    assert_eq!(v["forced"], " London".repeat(3), "+100 forces the token at every step");
    assert!(v["penalized"].as_str().is_some_and(|t| !t.is_empty()));
    assert_eq!(
        v["bad_penalty"],
        serde_json::json!([400, "invalid_parameter", "frequency_penalty"])
    );
    // Structured output (the script validated each against its schema with jsonschema).
    let structured = v["structured"].as_array().unwrap();
    assert_eq!(structured.len(), 4);
    for s in structured {
        assert_eq!(s[1], "stop", "{s}: the JSON ends, then the generation");
    }
    assert_eq!(structured[0][0], structured[1][0], "streamed as not");
    assert_eq!(v["json_object"], serde_json::json!(["dict", "stop"]));
    assert_eq!(
        v["bad_schema"],
        serde_json::json!([400, "invalid_parameter", "response_format"])
    );
    assert_eq!(v["bad_format"][0], 400);
    // Tools (the script validated each call's arguments against the function's parameters).
    assert_eq!(
        v["tool_call"],
        serde_json::json!([["get_weather"], "tool_calls", "call_", null])
    );
    let answered = v["tool_answer"].as_str().unwrap();
    assert!(["stop", "length", "tool_calls"].contains(&answered), "{answered}");
    let text = &v["tool_answer_text"];
    assert!(text[0].as_str().is_some_and(|t| !t.is_empty()), "{text}");
    assert!(text[1].is_null() && text[2] != "tool_calls", "{text}");
    assert_eq!(v["tool_stream"], serde_json::json!([["get_weather"], "tool_calls"]));
    assert_eq!(
        v["bad_tool"],
        serde_json::json!([400, "invalid_parameter", "tools[0].function.name"])
    );
    assert_eq!(
        v["bad_tool_choice"],
        serde_json::json!([400, "invalid_parameter", "tool_choice.function.name"])
    );
    // Unknown fields are served, and named.
    assert_eq!(v["ignored_served"], "length");
    assert_eq!(v["ignored_header"], "metadata, store, vendor_knob, messages[1].refusal");
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
