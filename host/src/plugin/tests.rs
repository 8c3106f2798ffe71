//! The runtime against real components built from `guest-sdk/examples` (the test command builds
//! them for wasm32-wasip2).

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::*;
use crate::kv::PageHandle;

fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| Runtime::new(32, 64 << 20).expect("runtime"))
}

fn example(name: &str) -> Plugin {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../guest-sdk/target/wasm32-wasip2/release/examples")
        .join(format!("{name}.wasm"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; build the examples with `cargo build --manifest-path guest-sdk/Cargo.toml --target wasm32-wasip2 --release --examples`",
            path.display()
        )
    });
    runtime().compile(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
}

async fn instance(p: &Plugin, limits: PluginLimits) -> Instance {
    configured(p, limits, "").await.expect("instantiate")
}

/// An instance `init` got `config` (0.2.0).
async fn configured(p: &Plugin, limits: PluginLimits, config: &str) -> Result<Instance, PluginFailure> {
    p.instantiate(
        limits,
        crate::testutil::tokenizer(),
        7,
        RequestTime::new(limits.request_time),
        config,
    )
    .await
}

/// How a choice ended, for a last `postprocess`.
fn end() -> Finish {
    Finish {
        reason: "stop".into(),
        prompt_tokens: 3,
        completion_tokens: 4,
    }
}

/// `p` is the system-prompt example: with config "S" it puts a system message "S" first.
async fn assert_injects_system_prompt(p: &Plugin) {
    let out = instance(p, PluginLimits::default())
        .await
        .preprocess(&chat("S", &[("user", "x")]))
        .await
        .unwrap();
    let Input::Chat(m) = out.input else { panic!() };
    assert_eq!(m[0].content, "S");
}

fn chat(config: &str, messages: &[(&str, &str)]) -> Request {
    Request {
        input: Input::Chat(
            messages
                .iter()
                .map(|(r, c)| Message {
                    role: r.to_string(),
                    content: c.to_string(),
                })
                .collect(),
        ),
        sampling: Sampling {
            temperature: 0.0,
            ..neutral_sampling(16)
        },
        config: config.into(),
        metadata: vec![],
        first_token: None,
    }
}

#[tokio::test]
async fn system_prompt_injects_once_and_refuses_without_config() {
    let p = example("system_prompt");
    let mut i = instance(&p, PluginLimits::default()).await;
    assert!(!i.capabilities().await.unwrap().on_token);
    let out = i.preprocess(&chat("Be brief.", &[("user", "hi")])).await.unwrap();
    let Input::Chat(m) = out.input else {
        panic!("chat stays chat")
    };
    assert_eq!((m[0].role.as_str(), m[0].content.as_str()), ("system", "Be brief."));
    assert_eq!(m[1].content, "hi");
    let out = i
        .preprocess(&chat("Be brief.", &[("system", "mine"), ("user", "hi")]))
        .await
        .unwrap();
    let Input::Chat(m) = out.input else { panic!() };
    assert_eq!(m.len(), 2);
    match i.preprocess(&chat("", &[("user", "hi")])).await {
        Err(PluginFailure::Refused { code, .. }) => assert_eq!(code, "plugin_config"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn the_redactor_catches_pii_split_across_chunks() {
    let p = example("pii_redactor");
    let text = "Mail me at jane.doe@example.com or call +1 555 123 4567; card 4111 1111 1111 1111 ok.";
    for cut in [5usize, 13, 17, 31, 40] {
        let mut i = instance(&p, PluginLimits::default()).await;
        let mut out = String::new();
        let bytes: Vec<char> = text.chars().collect();
        for piece in bytes.chunks(cut) {
            out.push_str(&i.postprocess(&piece.iter().collect::<String>(), None).await.unwrap());
            // Nothing emitted so far holds a fragment of the PII.
            for frag in ["jane.doe@", "@example", "555 123", "4111 1111"] {
                assert!(!out.contains(frag), "cut {cut}: {out:?}");
            }
        }
        out.push_str(&i.postprocess("", Some(&end())).await.unwrap());
        assert_eq!(out, "Mail me at [EMAIL] or call [PHONE]; card [CARD] ok.", "cut {cut}");
    }
}

/// The JSON guard (0.2.0) reads the vocabulary in `init`, constrains the first token in
/// `preprocess`, and after each token the next to those that keep the output the start of a JSON
/// value, then stops once the value is complete.
#[tokio::test]
async fn the_json_guard_constrains_each_token_to_json_and_stops_when_complete() {
    let p = example("json_guard");
    let tk = crate::testutil::tokenizer();
    let limits = PluginLimits {
        call_timeout: Duration::from_secs(5),
        ..PluginLimits::default()
    };
    let mut i = instance(&p, limits).await;
    assert_eq!(i.world(), "0.2.0");
    assert!(i.capabilities().await.unwrap().on_token);
    let one = |text: &str| match tk.encode(text, false)[..] {
        [id] => id,
        ref ids => panic!("{text:?} is {ids:?}"),
    };
    let out = i.preprocess(&chat("", &[("user", "x")])).await.unwrap();
    let first = out
        .first_token
        .and_then(|c| c.allowed)
        .expect("the first token is constrained");
    assert!(first.contains(&one("{")) && !first.contains(&one("Hello")));
    let ids: Vec<u32> = tk.encode("{\"a\": [1, true]}", false);
    let mut outside = false;
    for (n, &id) in ids.iter().enumerate() {
        let tok = Token {
            id,
            text: String::new(),
            index: n as u32 + 1,
        };
        match (i.on_token(&tok).await.unwrap(), ids.get(n + 1)) {
            (TokenAction::Constrain(c), Some(next)) => {
                let allowed = c.allowed.expect("an allowed set");
                assert!(
                    allowed.contains(next),
                    "token {n}: the text's own next token is allowed"
                );
                // Outside a string (after `{"a": [1, true`, say) a bare word may not follow.
                if tk.decode(&ids[..=n]).ends_with("true") {
                    assert!(!allowed.contains(&one("Hello")) && allowed.contains(&one("]")));
                    outside = true;
                }
            }
            (TokenAction::Stop, None) => {}
            (a, next) => panic!("token {n} ({next:?} next): {a:?}"),
        }
    }
    assert!(outside, "the check after `true` ran");
}

#[tokio::test]
async fn each_request_gets_a_fresh_instance() {
    let p = example("pii_redactor");
    let mut a = instance(&p, PluginLimits::default()).await;
    assert_eq!(a.postprocess("held back: jane@exa", None).await.unwrap(), "");
    // A new instance has no held text from the old one.
    let mut b = instance(&p, PluginLimits::default()).await;
    assert_eq!(b.postprocess("", Some(&end())).await.unwrap(), "");
    assert_eq!(
        a.postprocess("mple.com", Some(&end())).await.unwrap(),
        "held back: [EMAIL]"
    );
}

#[tokio::test]
async fn adversarial_guests_are_contained_with_their_own_errors() {
    let p = example("adversary");
    let limits = PluginLimits {
        fuel_per_call: 200_000_000,
        memory_bytes: 32 << 20,
        call_timeout: std::time::Duration::from_millis(100),
        ..PluginLimits::default()
    };
    let run = async |attack: &str, limits: PluginLimits| {
        instance(&p, limits)
            .await
            .preprocess(&chat(attack, &[("user", "x")]))
            .await
    };
    let t0 = Instant::now();
    assert!(matches!(
        run("loop", limits).await,
        Err(PluginFailure::FuelExhausted(_) | PluginFailure::Timeout(_))
    ));
    assert!(t0.elapsed().as_secs() < 5, "the loop was stopped promptly");
    // With ample fuel, the wall-clock deadline stops it.
    let no_fuel_cap = PluginLimits {
        fuel_per_call: u64::MAX / 2,
        ..limits
    };
    assert!(matches!(run("loop", no_fuel_cap).await, Err(PluginFailure::Timeout(_))));
    assert_eq!(run("bomb", limits).await.unwrap_err().code(), "plugin_out_of_memory");
    assert_eq!(run("trap", limits).await.unwrap_err().code(), "plugin_trap");
    assert_eq!(run("recurse", limits).await.unwrap_err().code(), "plugin_trap");
    assert_eq!(run("huge", limits).await.unwrap_err().code(), "plugin_out_of_memory");
    // Meanwhile another plugin works, with unchanged output.
    let ok = example("system_prompt");
    assert_injects_system_prompt(&ok).await;
    assert!(run("pass", limits).await.is_ok());
}

#[test]
fn bytes_that_are_not_a_component_are_invalid() {
    for bytes in [&b""[..], b"\0asm\x01\0\0\0", b"not wasm at all"] {
        let e = runtime().compile(bytes).err().expect("refused");
        assert_eq!(e.code(), "plugin_invalid");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_busy_guest_yields_to_other_tasks_on_the_same_thread() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let p = example("adversary");
    let ticks = Arc::new(AtomicU32::new(0));
    let counter = ticks.clone();
    let ticker = tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    let limits = PluginLimits {
        fuel_per_call: u64::MAX / 2,
        call_timeout: std::time::Duration::from_millis(100),
        ..PluginLimits::default()
    };
    let r = instance(&p, limits)
        .await
        .preprocess(&chat("loop", &[("user", "x")]))
        .await;
    assert!(matches!(r, Err(PluginFailure::Timeout(_))), "{r:?}");
    ticker.abort();
    // One thread, a guest spinning for 100 ms: the ticker still ran, because the guest yielded
    // (a guest that held the thread would leave it at 0 or 1; a loaded machine may wake it
    // fewer than the 50 times its sleeps allow, so the bound is loose).
    assert!(
        ticks.load(Ordering::SeqCst) >= 4,
        "ticker ran {} times",
        ticks.load(Ordering::SeqCst)
    );
}

#[tokio::test]
async fn the_regex_filter_denies_and_rewrites_by_its_config() {
    let p = example("regex_filter");
    let config = "# rules\ndeny: (?i)\\bpassword\\b\nreplace: \\bACME-\\d{4}\\b => [ticket]";
    let limits = PluginLimits::default();
    let mut i = configured(&p, limits, config).await.unwrap();
    match i.preprocess(&chat(config, &[("user", "my PASSWORD is x")])).await {
        Err(PluginFailure::Refused { code, .. }) => assert_eq!(code, "denied"),
        other => panic!("{other:?}"),
    }
    let mut i = configured(&p, limits, config).await.unwrap();
    i.preprocess(&chat(config, &[("user", "status of ACME-1234?")]))
        .await
        .unwrap();
    assert_eq!(i.postprocess("Ticket ACME-12", None).await.unwrap(), "");
    assert_eq!(
        i.postprocess("34 is open.", Some(&end())).await.unwrap(),
        "Ticket [ticket] is open."
    );
    // A rule that does not parse is refused by `init`, before any request.
    match configured(&p, limits, "replace: ( => x").await {
        Err(PluginFailure::Refused { code, message }) => {
            assert_eq!(code, "plugin_config");
            assert!(message.contains("line 1"), "{message}");
        }
        Ok(_) => panic!("a bad rule was accepted"),
        Err(other) => panic!("{other:?}"),
    }
}

#[test]
fn components_importing_outside_the_world_are_refused_at_compile() {
    // A component that wants a host interface Warden does not provide.
    let sneaky = wat::parse_str(
        r#"(component
            (import "wasi:sockets/tcp@0.2.0" (instance))
            (import "warden:plugin/secrets@0.1.0" (instance (export "steal" (func (result u32)))))
        )"#,
    )
    .expect("valid WAT");
    let e = runtime().compile(&sneaky).err().expect("refused");
    assert_eq!(e.code(), "plugin_invalid");
    assert!(e.to_string().contains("warden:plugin/secrets"), "{e}");
    // A component that imports nothing but exports nothing of the world is refused too.
    let empty = wat::parse_str("(component)").expect("valid WAT");
    let e = runtime().compile(&empty).err().expect("refused");
    assert_eq!(e.code(), "plugin_invalid", "{e}");
}

/// Config `attack` for the adversary, as a chat request.
fn attack(attack: &str) -> Request {
    chat(attack, &[("user", "x")])
}

#[tokio::test]
async fn a_guest_cannot_sleep_on_the_hosts_clock() {
    let p = example("adversary");
    let limits = PluginLimits {
        call_timeout: Duration::from_millis(100),
        ..PluginLimits::default()
    };
    for a in ["sleep", "sleep-forever"] {
        let t0 = Instant::now();
        let r = instance(&p, limits).await.preprocess(&attack(a)).await;
        // The clock is frozen: the sleep returns at once, and the call goes on.
        assert!(r.is_ok(), "{a}: {r:?}");
        assert!(
            t0.elapsed() < Duration::from_millis(100),
            "{a}: took {:?}",
            t0.elapsed()
        );
    }
}

#[tokio::test]
async fn tokenizer_and_log_calls_are_bounded_and_charged_in_fuel() {
    let p = example("adversary");
    let limits = PluginLimits {
        call_timeout: Duration::from_secs(5),
        ..PluginLimits::default()
    };
    // Over the input limit: refused before any tokenizing.
    let t0 = Instant::now();
    let e = instance(&p, limits)
        .await
        .preprocess(&attack("encode-huge"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), "plugin_host_call_too_large", "{e}");
    assert!(e.to_string().contains("tokenizer.encode"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(1), "took {:?}", t0.elapsed());
    // Within it, but over and over: the host's work uses up the call's fuel long before its time.
    for a in ["encode-loop", "decode-loop", "log-loop"] {
        let t0 = Instant::now();
        let mut i = instance(&p, limits).await;
        let e = i.preprocess(&attack(a)).await.unwrap_err();
        assert_eq!(e.code(), "plugin_fuel_exhausted", "{a}: {e}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{a}: took {:?}", t0.elapsed());
        // And the tenant's usage counts that fuel.
        assert!(i.take_fuel() >= limits.fuel_per_call, "{a}");
    }
}

/// What a guest prints, and its panic message, reach its log as lines under the log's caps;
/// printing without end never fails the guest's writes, and the host keeps a log's worth.
#[tokio::test]
async fn a_guests_stdout_stderr_and_panics_become_capped_log_lines() {
    let p = example("adversary");
    let limits = PluginLimits {
        call_timeout: Duration::from_secs(5),
        ..PluginLimits::default()
    };
    let mut i = instance(&p, limits).await;
    i.preprocess(&attack("print")).await.unwrap();
    assert_eq!(
        i.take_logs(),
        ["stdout: to stdout\\u{1b}[2J", "stdout: no newline", "stderr: to stderr"]
    );
    let mut i = instance(&p, limits).await;
    let e = i.preprocess(&attack("trap")).await.unwrap_err();
    assert_eq!(e.code(), "plugin_trap", "{e}");
    let logs = i.take_logs();
    assert!(
        logs.iter()
            .any(|l| l.starts_with("stderr: ") && l.contains("the adversary traps")),
        "{logs:?}"
    );
    let mut i = instance(&p, limits).await;
    let e = i.preprocess(&attack("print-flood")).await.unwrap_err();
    assert_eq!(e.code(), "plugin_fuel_exhausted", "{e}");
    let logs = i.take_logs();
    assert_eq!(logs.len(), 65, "64 lines and the note that the rest were dropped");
    assert!(logs.iter().all(|l| l.len() <= 1024 + 16), "lines are cut at 1 KiB");
}

#[tokio::test]
async fn a_requests_calls_share_one_time_budget() {
    let p = example("adversary");
    let limits = PluginLimits {
        fuel_per_call: u64::MAX / 2,
        call_timeout: Duration::from_millis(100),
        request_time: Duration::from_millis(150),
        ..PluginLimits::default()
    };
    let time = RequestTime::new(limits.request_time);
    let make = || p.instantiate(limits, crate::testutil::tokenizer(), 7, time.clone(), "");
    // The first call takes its whole 100 ms, the second (another choice) the 50 ms left.
    let e = make().await.unwrap().preprocess(&attack("loop")).await.unwrap_err();
    assert_eq!(e.code(), "plugin_timeout", "{e}");
    let t0 = Instant::now();
    let mut second = make().await.unwrap();
    let e = second.preprocess(&attack("loop")).await.unwrap_err();
    assert_eq!(e.code(), "plugin_request_time_exceeded", "{e}");
    assert!(t0.elapsed() < Duration::from_millis(100), "took {:?}", t0.elapsed());
    // Nothing is left: the next instance fails at once.
    let e = make().await.err().expect("no time left");
    assert_eq!(e.code(), "plugin_request_time_exceeded", "{e}");
    assert!(time.spent() >= limits.request_time);
}

#[tokio::test]
async fn postprocess_output_is_bounded_by_its_input() {
    let p = example("adversary");
    // 2 MiB from a 5-byte chunk: over the per-call cap.
    let mut i = instance(&p, PluginLimits::default()).await;
    i.preprocess(&attack("flood")).await.unwrap();
    let e = i.postprocess("hello", None).await.unwrap_err();
    assert_eq!(e.code(), "plugin_output_too_large", "{e}");
    // 8 KiB per 5-byte chunk: within the cap, over the ratio once the slack is spent.
    let mut i = instance(&p, PluginLimits::default()).await;
    i.preprocess(&attack("swell")).await.unwrap();
    let e = i.postprocess("hello", None).await.unwrap_err();
    assert_eq!(e.code(), "plugin_output_too_large", "{e}");
    // A plugin that returns what it is given, or adds a little, is untouched.
    let mut i = instance(&p, PluginLimits::default()).await;
    i.preprocess(&attack("pass")).await.unwrap();
    for _ in 0..100 {
        assert_eq!(i.postprocess("hello", None).await.unwrap(), "hello");
    }
}

/// A request's KV as an engine would show it: pages whose pool epochs are large, as after other
/// tenants used them many times.
struct ChurnedKv;

/// The pages [`ChurnedKv`] shows: (page, pool epoch).
const CHURNED: [(u32, u32); 2] = [(5, 7_741), (9, 120_003)];

impl KvAccess for ChurnedKv {
    fn started(&self) -> bool {
        true
    }
    fn pages(&self) -> BoxFuture<Option<Vec<PageHandle>>> {
        Box::pin(async {
            Some(
                CHURNED
                    .iter()
                    .map(|&(page, epoch)| PageHandle::for_test(page, epoch))
                    .collect(),
            )
        })
    }
    fn info(&self, h: PageHandle) -> BoxFuture<Result<crate::kv::PageInfo, KvAccessError>> {
        let (_, epoch) = CHURNED
            .into_iter()
            .find(|&(page, epoch)| PageHandle::for_test(page, epoch) == h)
            .expect("a page this fake showed");
        Box::pin(async move {
            Ok(crate::kv::PageInfo {
                written: 16,
                epoch,
                checksum: 1,
            })
        })
    }
    fn pin(&self, _: usize) -> BoxFuture<Result<usize, KvAccessError>> {
        Box::pin(async { Err(KvAccessError::Remote("no".into())) })
    }
    fn unpin(&self) -> BoxFuture<Result<usize, KvAccessError>> {
        Box::pin(async { Err(KvAccessError::Remote("no".into())) })
    }
}

#[tokio::test]
async fn page_epochs_say_nothing_of_the_pools_history() {
    let p = example("adversary");
    let mut i = instance(&p, PluginLimits::default()).await;
    i.preprocess(&attack("kv")).await.unwrap();
    i.attach_kv(Arc::new(ChurnedKv));
    let out = i.postprocess("text", None).await.unwrap();
    assert!(out.ends_with("[kv pages=2 written=32] [epochs 1,2]"), "{out}");
}

#[test]
fn components_over_the_per_component_limits_are_refused_naming_the_limit() {
    let memories = wat::parse_str(
        r#"(component
            (core module $m (memory 1) (memory 1) (memory 1))
            (core instance (instantiate $m))
        )"#,
    )
    .expect("valid WAT");
    let e = runtime().compile(&memories).err().expect("refused");
    assert_eq!(e.code(), "component_over_limits", "{e}");
    assert!(e.to_string().contains("memories count of 3"), "{e}");
    let instances = wat::parse_str(format!(
        "(component (core module $m) {})",
        "(core instance (instantiate $m))".repeat(9)
    ))
    .expect("valid WAT");
    let e = runtime().compile(&instances).err().expect("refused");
    assert_eq!(e.code(), "component_over_limits", "{e}");
    assert!(e.to_string().contains("9 core module instances"), "{e}");
    let tables = wat::parse_str(
        r#"(component
            (core module $m (table 200000 funcref))
            (core instance (instantiate $m))
        )"#,
    )
    .expect("valid WAT");
    let e = runtime().compile(&tables).err().expect("refused");
    assert_eq!(e.code(), "component_over_limits", "{e}");
}

#[tokio::test]
async fn artefacts_the_compiler_makes_load_into_the_servers_runtime() {
    let bytes = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../guest-sdk/target/wasm32-wasip2/release/examples/system_prompt.wasm"),
    )
    .expect("the examples are built");
    let artefact = compile::precompile(&bytes).expect("compiles");
    // SAFETY: the artefact was just made by `precompile` with this runtime's settings.
    let p = unsafe { runtime().load_artefact(&artefact) }.expect("loads");
    assert_injects_system_prompt(&p).await;
    // Over the pool's limits: refused when loaded, as when compiled here.
    let memories = wat::parse_str(
        "(component (core module $m (memory 1) (memory 1) (memory 1)) (core instance (instantiate $m)))",
    )
    .expect("valid WAT");
    let artefact = compile::precompile(&memories).expect("the compiler knows no pool");
    // SAFETY: as above.
    let e = unsafe { runtime().load_artefact(&artefact) }.err().expect("refused");
    assert_eq!(e.code(), "component_over_limits", "{e}");
}

/// The regex guard (0.2.0) allows, before each token, only the tokens that keep the output a
/// prefix of its pattern, the end of text once the output matches, and stops once nothing more
/// could follow; a pattern that does not compile refuses the configuration.
#[tokio::test]
async fn the_regex_guard_keeps_output_inside_its_pattern() {
    let p = example("regex_guard");
    let tk = crate::testutil::tokenizer();
    let limits = PluginLimits {
        call_timeout: Duration::from_secs(5),
        ..PluginLimits::default()
    };
    let pattern = "(yes|no), because [a-z ]{1,40}\\.";
    let mut i = configured(&p, limits, pattern).await.unwrap();
    let out = i.preprocess(&chat(pattern, &[("user", "x")])).await.unwrap();
    let first = out
        .first_token
        .and_then(|c| c.allowed)
        .expect("the first token is constrained");
    let ids = |text: &str| tk.encode(text, false);
    assert!(first.contains(&ids("yes")[0]) && first.contains(&ids("no")[0]));
    assert!(!first.contains(&ids("maybe")[0]) && !first.contains(&ids(" yes")[0]));
    let eos = tk.eos_id().expect("an end token");
    assert!(!first.contains(&eos), "an empty output does not match");
    let text = ids("yes, because it is.");
    for (n, &id) in text.iter().enumerate() {
        let tok = Token {
            id,
            text: String::new(),
            index: n as u32 + 1,
        };
        match (i.on_token(&tok).await.unwrap(), text.get(n + 1)) {
            (TokenAction::Constrain(c), Some(next)) => {
                let allowed = c.allowed.expect("an allowed set");
                assert!(allowed.contains(next), "token {n}: the text's own next token");
                assert!(!allowed.contains(&ids("!")[0]), "token {n}: `!` is never in it");
            }
            (TokenAction::Stop, None) => {}
            (a, next) => panic!("token {n} ({next:?} next): {a:?}"),
        }
    }
    match configured(&p, limits, "(unclosed").await {
        Err(PluginFailure::Refused { code, .. }) => assert_eq!(code, "plugin_config"),
        Ok(_) => panic!("a bad pattern was accepted"),
        Err(other) => panic!("{other:?}"),
    }
}

fn example_bytes(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../guest-sdk/target/wasm32-wasip2/release/examples")
        .join(format!("{name}.wasm"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Pre-initialises example `name` with `config` in the test runtime.
async fn snapshot_of(name: &str, config: &str) -> Result<snapshot::Snapshot, PluginFailure> {
    let (s, _logs) = snapshot::pre_initialise(
        &example_bytes(name),
        config,
        PluginLimits::default(),
        crate::testutil::tokenizer(),
        8 << 20,
        |b: Vec<u8>| std::future::ready(runtime().compile(&b)),
        std::future::ready(Some(())),
    )
    .await?;
    Ok(s)
}

#[tokio::test]
async fn a_pre_initialised_plugin_starts_from_its_init_and_skips_it() {
    let config = "deny: (?i)\\bpassword\\b\nreplace: \\bACME-\\d{4}\\b => [ticket]";
    let p = match snapshot_of("regex_filter", config).await.unwrap() {
        snapshot::Snapshot::Taken(p) => p,
        snapshot::Snapshot::Kept(why) => panic!("not pre-initialised: {why}"),
    };
    assert!(p.pre_initialised());
    let limits = PluginLimits::default();
    // Its instances behave as ones that ran init, for fewer instructions.
    let mut fresh = configured(&example("regex_filter"), limits, config).await.unwrap();
    let mut i = configured(&p, limits, config).await.unwrap();
    assert!(
        i.take_fuel() * 10 < fresh.take_fuel(),
        "instantiating from the snapshot runs no init"
    );
    let req = chat(config, &[("user", "status of ACME-1234?")]);
    assert_eq!(
        format!("{:?}", i.preprocess(&req).await.unwrap()),
        format!("{:?}", fresh.preprocess(&req).await.unwrap())
    );
    assert_eq!(
        i.postprocess("Ticket ACME-1234 is open.", Some(&end())).await.unwrap(),
        "Ticket [ticket] is open."
    );
    match i.preprocess(&chat(config, &[("user", "my PASSWORD is x")])).await {
        Err(PluginFailure::Refused { code, .. }) => assert_eq!(code, "denied"),
        other => panic!("{other:?}"),
    }
    // It takes only the configuration it was initialised with.
    let e = configured(&p, limits, "deny: x").await.err().expect("another config");
    assert_eq!(e.code(), "plugin_invalid");
    // A configuration init refuses is refused here too.
    match snapshot_of("regex_filter", "replace: ( => x").await {
        Err(PluginFailure::Refused { code, .. }) => assert_eq!(code, "plugin_config"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a bad rule was pre-initialised"),
    }
}

#[tokio::test]
async fn what_a_snapshot_cannot_carry_leaves_init_to_each_request() {
    // 0.1.0 has no init.
    match snapshot_of("legacy_v0_1", "").await.unwrap() {
        snapshot::Snapshot::Kept(why) => assert!(why.contains("no init"), "{why}"),
        snapshot::Snapshot::Taken(_) => panic!("a 0.1.0 component was pre-initialised"),
    }
    // An init that printed: Rust's std keeps the stdout stream it opened, whose handle would
    // name nothing in a new instance, so no snapshot is taken.
    match snapshot_of("adversary", "print-in-init").await.unwrap() {
        snapshot::Snapshot::Kept(why) => assert!(why.contains("kept a host resource"), "{why}"),
        snapshot::Snapshot::Taken(_) => panic!("an init holding a stream was pre-initialised"),
    }
    // The same plugin with an init that prints nothing is.
    assert!(matches!(
        snapshot_of("adversary", "").await.unwrap(),
        snapshot::Snapshot::Taken(_)
    ));
}

#[tokio::test]
async fn init_runs_under_its_own_budget_not_a_calls() {
    // json_guard's init reads the vocabulary and works out the first tokens: tens of millions
    // of instructions, far more than a call may take here, and well within init's budget.
    let p = example("json_guard");
    let limits = PluginLimits {
        fuel_per_call: 1_000_000,
        call_timeout: Duration::from_secs(5),
        init_timeout: Duration::from_secs(5),
        ..PluginLimits::default()
    };
    let mut i = configured(&p, limits, "").await.unwrap();
    let init = i.take_fuel();
    assert!(init > limits.fuel_per_call, "{init}");
    let r = i.preprocess(&chat("", &[("user", "x")])).await.unwrap();
    assert!(r.first_token.is_some_and(|c| c.allowed.is_some_and(|a| !a.is_empty())));
    assert!(i.take_fuel() < limits.fuel_per_call, "calls get their own budget back");
    // Past init's own budget, init fails as a call would.
    let short = PluginLimits {
        init_fuel: init / 2,
        ..limits
    };
    let e = configured(&p, short, "").await.err().expect("init ran out of fuel");
    assert_eq!(e, PluginFailure::FuelExhausted(init / 2));
}
