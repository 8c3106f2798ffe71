//! Engine tests on the real default model: llama.cpp parity, batching equivalence, isolation and
//! admission.

use crate::kv::SeqId;
use std::collections::HashMap;
use std::sync::Arc;

use warden_kernels::tag::{IsolationViolation, TagCheck};

use super::request::{AbortReason, FinishReason, GenerateRequest, Outcome, RejectReason, Rejected, RequestId, Usage};
use super::{Engine, EngineConfig, Event};
use crate::kv::{KvError, KvPool};
use crate::model::{Forward, Scratch, StepSeq};
use crate::testutil::{IdDetok, Oracle, capture_logs, model, tenant};

/// These tests hold raw requests: each is validated against the engine's own limits on the way
/// in, as the HTTP edge validates a body once, and a refusal there is a rejection like the
/// engine's own.
trait Raw {
    fn submit_raw(&mut self, req: GenerateRequest) -> Result<RequestId, Rejected>;
    fn submit_prefill_raw(&mut self, req: GenerateRequest) -> Result<RequestId, Rejected>;
    fn open_transfer_raw(&mut self, req: GenerateRequest) -> Result<RequestId, Rejected>;
}

impl Raw for Engine {
    fn submit_raw(&mut self, req: GenerateRequest) -> Result<RequestId, Rejected> {
        let req = req.validate(&self.limits())?;
        self.submit(req)
    }

    fn submit_prefill_raw(&mut self, req: GenerateRequest) -> Result<RequestId, Rejected> {
        let req = req.validate(&self.limits())?;
        self.submit_prefill(req)
    }

    fn open_transfer_raw(&mut self, req: GenerateRequest) -> Result<RequestId, Rejected> {
        let req = req.validate(&self.limits())?;
        self.open_transfer(req)
    }
}

fn config(max_context: usize, max_batch_tokens: usize) -> EngineConfig {
    EngineConfig {
        max_context,
        max_batch_tokens,
        step_target: None,
        max_running: 64,
        max_waiting: 64,
        page_size: 16,
        kv_memory_bytes: 96 << 20,
        tag_check: TagCheck::Enforce,
        prefix_cache: true,
        max_pinned_pages: 64,
    }
}

fn engine(max_batch_tokens: usize) -> Engine {
    Engine::new(model(), Arc::new(IdDetok), config(2048, max_batch_tokens)).expect("engine starts")
}

/// Tokens and outcome of every request, running the engine until it is idle.
#[derive(Default)]
struct Runs {
    tokens: HashMap<RequestId, Vec<u32>>,
    prefilled: HashMap<RequestId, usize>,
    opened: std::collections::HashSet<RequestId>,
    outcomes: HashMap<RequestId, Outcome>,
    usage: HashMap<RequestId, Usage>,
}

impl Runs {
    fn absorb(&mut self, events: Vec<Event>) {
        for e in events {
            match e {
                Event::Token { id, token, .. } => {
                    assert!(!self.outcomes.contains_key(&id), "token after Done for {id}");
                    self.tokens.entry(id).or_default().push(token);
                }
                Event::Done { id, outcome, usage, .. } => {
                    assert!(self.outcomes.insert(id, outcome).is_none(), "two Done events for {id}");
                    self.usage.insert(id, usage);
                }
                Event::Opened { id } => {
                    assert!(self.opened.insert(id), "two Opened events for {id}");
                }
                Event::Prefilled { id, tokens } => {
                    assert!(!self.tokens.contains_key(&id), "a prefill-only request sampled");
                    assert!(
                        self.prefilled.insert(id, tokens).is_none(),
                        "two Prefilled events for {id}"
                    );
                }
            }
        }
    }

    fn drain(&mut self, e: &mut Engine) {
        while e.has_work() {
            let ev = e.step();
            self.absorb(ev);
        }
    }
}

/// At quiescence no sequence holds a page and nothing is reserved; once `owners` are forgotten
/// (their prefix caches dropped), every page is free.
fn assert_quiescent(e: &mut Engine, owners: &[u64]) {
    let c = e.kv_counters();
    assert_eq!((c.pages_used, c.pages_reserved), (0, 0), "{c:?}");
    assert_eq!(c.pages_free + c.pages_cached, c.pages_total, "{c:?}");
    for &o in owners {
        e.forget_owner(tenant(o));
    }
    let c = e.kv_counters();
    assert_eq!(
        c.pages_free, c.pages_total,
        "every page is free once the caches are dropped: {c:?}"
    );
}

fn solo(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut e = engine(512);
    let id = e
        .submit_raw(GenerateRequest::greedy(tenant(1), prompt.to_vec(), max_tokens))
        .expect("admitted");
    let mut runs = Runs::default();
    runs.drain(&mut e);
    assert!(
        matches!(runs.outcomes[&id], Outcome::Finished(_)),
        "{:?}",
        runs.outcomes[&id]
    );
    runs.tokens.remove(&id).unwrap_or_default()
}

/// How a model's output compares with a llama.cpp oracle's (`scripts/oracle.py`): prompts are
/// tokenized (and chat prompts rendered from their messages by the model's own template) exactly
/// as llama.cpp does; then, fed llama.cpp's greedy tokens one at a time (so that one difference
/// does not change every later context), our logprobs of llama.cpp's top five tokens at each
/// position are compared with its own.
///
/// Every probable token (logprob above −5) must be within 1.2 nats of llama.cpp's, and our most
/// likely token must be llama.cpp's wherever its top two are more than 0.75 nats apart; and
/// free-running greedy generation gives llama.cpp's tokens up to its first position that is
/// closer than that (a near-tie either engine's rounding may flip). A wrong norm, window, RoPE,
/// scale, template or activation moves logprobs by whole nats.
///
/// On average we must be as close to the truth as llama.cpp is. We compute V from
/// 16-bit-grade activations where llama.cpp rounds them to 8 bits, which brings us closer to
/// full-precision logits and so away from llama.cpp's by that rounding (`scripts/numerics.py`).
/// With a `reference` (the same weights run by llama.cpp in F32 with an F32 KV cache, fed the
/// same tokens), our mean distance from it must be at most llama.cpp's, over the tokens both
/// top-fives hold. Without one, the yardstick is llama.cpp itself: with flash attention off its
/// logprobs move from its default's by summation order and rounding alone (the mean over the
/// positions where its two runs still agree on the text), and ours must stay within 1.5 × that.
fn check_against_llama_cpp(
    m: &crate::model::Model,
    tok: &crate::tokenizer::Tokenizer,
    chat: Option<&crate::chat::ChatTemplate>,
    (oracle, fa_off): (Oracle, Oracle),
    reference: Option<Oracle>,
) -> (f32, f32, usize) {
    let (mut to_ref, mut llama_to_ref) = (Vec::new(), Vec::new());
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let mut decided = 0;
    for (name, p) in &oracle {
        if let Some(messages) = &p.messages {
            let rendered = chat.expect("a chat template").render(messages, true).expect("renders");
            assert_eq!(rendered, p.prompt, "{name}: the chat template's rendering");
            assert_eq!(tok.encode_chat(&rendered), p.prompt_tokens, "{name}: prompt tokens");
        } else {
            assert_eq!(tok.encode(&p.prompt, true), p.prompt_tokens, "{name}: prompt tokens");
        }
        let then: Vec<u32> = p.steps.iter().map(|st| st.id).collect();
        let rows = crate::testutil::teacher_forced(m, &p.prompt_tokens, &then);
        if let Some(r) = &reference {
            for ((st, truth), logits) in p.steps.iter().zip(&r[name].steps).zip(&rows) {
                assert_eq!(st.id, truth.id, "{name}: the reference follows the oracle's tokens");
                for &(id, exact) in &truth.top5 {
                    if let Some(&(_, theirs)) = st.top5.iter().find(|t| t.0 == id) {
                        to_ref.push((super::TokenLogprobs::of(logits, id, 0).logprob - exact).abs());
                        llama_to_ref.push((theirs - exact).abs());
                    }
                }
            }
        }
        for (k, (st, logits)) in p.steps.iter().zip(&rows).enumerate() {
            for &(id, want) in &st.top5 {
                let got = super::TokenLogprobs::of(logits, id, 0).logprob;
                assert!(
                    want < -5.0 || (got - want).abs() < 1.2,
                    "{name} position {k}: token {id} logprob {got}, llama.cpp {want}"
                );
                ours.push((got - want).abs());
            }
            // Its most likely token (which may be an end of generation it went past: the oracle
            // ignores them, so `st.id` is then the next).
            if st.top5[0].1 - st.top5[1].1 > 0.75 {
                assert_eq!(super::sampling::argmax(logits), st.top5[0].0, "{name} position {k}");
                decided += 1;
            }
        }
        // llama.cpp's two attention paths, while they still agree on the text.
        for (a, b) in p.steps.iter().zip(&fa_off[name].steps) {
            if a.id != b.id {
                break;
            }
            for &(id, want) in &a.top5 {
                if let Some(&(_, other)) = b.top5.iter().find(|t| t.0 == id) {
                    theirs.push((other - want).abs());
                }
            }
        }
        // Free-running greedy generation, up to llama.cpp's first near-tie (or end of
        // generation).
        let sure = p
            .steps
            .iter()
            .position(|st| st.top5[0].1 - st.top5[1].1 <= 0.75 || st.top5[0].0 != st.id)
            .unwrap_or(p.steps.len());
        assert_eq!(
            crate::testutil::greedy(m, &p.prompt_tokens, sure),
            then[..sure],
            "{name}: greedy generation"
        );
    }
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let (ours_mean, spread) = (mean(&ours), mean(&theirs));
    if reference.is_some() {
        let (us, them) = (mean(&to_ref), mean(&llama_to_ref));
        eprintln!(
            "from the F32 reference: ours {us:.4}, llama.cpp's {them:.4} ({} tokens)",
            to_ref.len()
        );
        assert!(to_ref.len() >= 300, "{} tokens compared", to_ref.len());
        assert!(
            us <= them,
            "mean |Δ logprob| from the F32 reference: ours {us:.4}, llama.cpp's {them:.4}"
        );
    } else {
        assert!(
            ours_mean <= 1.5 * spread,
            "mean |Δ logprob| {ours_mean:.3} against llama.cpp; its own attention paths differ by {spread:.3}"
        );
    }
    (ours_mean, spread, decided)
}

/// SmolLM2 Q4_1, the default model: raw prompts, and chat prompts (the template's own system
/// prompt, a user's, two turns) rendered by its template; and both engines' distance from the
/// F32 reference.
#[test]
fn smollm2_logprobs_and_greedy_tokens_match_llama_cpp() {
    let loaded = crate::loaded::LoadedModel::open(&crate::testutil::model_path()).expect("the default model");
    let (mean, spread, decided) = check_against_llama_cpp(
        &loaded.model,
        &loaded.tokenizer,
        loaded.chat.as_deref(),
        crate::testutil::smollm_oracle(),
        Some(crate::testutil::smollm_reference()),
    );
    eprintln!("smollm2: mean |Δ| {mean:.3}, llama.cpp's own spread {spread:.3}, {decided} decided");
    assert!(decided >= 60, "only {decided} of 120 positions decided");
}

/// Gemma 3 270M Q4_K_M (Q4_K and Q6_K where rows are whole super-blocks, Q5_0 and Q8_0
/// elsewhere; sliding-window layers; GELU; every Gemma norm): raw prompts, Gemma's turn format
/// and a prompt past the 512-position window.
#[test]
fn gemma3_k_quant_logprobs_match_llama_cpp() {
    let (m, tok) = crate::testutil::gemma();
    let (mean, spread, decided) = check_against_llama_cpp(&m, &tok, None, crate::testutil::gemma_oracle(), None);
    eprintln!("gemma3: mean |Δ| {mean:.3}, llama.cpp's own spread {spread:.3}, {decided} decided");
    // Most positions are clear-cut: the token check is not vacuous.
    assert!(decided >= 100, "only {decided} of 144 positions decided");
}

/// Sixteen different prompts, deterministic and of varied lengths.
fn sixteen_prompts() -> Vec<Vec<u32>> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..16)
        .map(|i| {
            let len = 3 + (i * 37) % 90;
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Ordinary tokens, away from the control tokens at the start of the vocabulary.
                    100 + (x % 20_000) as u32
                })
                .collect()
        })
        .collect()
}

#[test]
fn a_batch_of_sixteen_with_chunked_prefill_yields_what_each_yields_alone() {
    let prompts = sixteen_prompts();
    let max_tokens = 12;
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| solo(p, max_tokens)).collect();

    // A 40-token step budget: prefills are chunked and share steps with other sequences' decodes;
    // half the requests arrive while the first half is already running.
    let mut e = engine(40);
    let mut runs = Runs::default();
    let mut ids = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        if i == 8 {
            for _ in 0..3 {
                let ev = e.step();
                runs.absorb(ev);
            }
        }
        ids.push(
            e.submit_raw(GenerateRequest::greedy(tenant(1 + i as u64 % 3), p.clone(), max_tokens))
                .expect("admitted"),
        );
    }
    runs.drain(&mut e);
    for (i, id) in ids.iter().enumerate() {
        assert!(
            matches!(runs.outcomes[id], Outcome::Finished(_)),
            "request {i}: {:?}",
            runs.outcomes[id]
        );
        assert_eq!(
            runs.tokens.get(id).cloned().unwrap_or_default(),
            alone[i],
            "request {i} (prompt of {} tokens)",
            prompts[i].len()
        );
    }
    assert_quiescent(&mut e, &[1, 2, 3]);
}

/// Steps until request `id` has produced a token (so its prompt is in its pages).
fn step_until_decoding(e: &mut Engine, runs: &mut Runs, ids: &[RequestId]) {
    for _ in 0..64 {
        if ids.iter().all(|id| runs.tokens.contains_key(id)) {
            return;
        }
        let ev = e.step();
        runs.absorb(ev);
    }
    panic!("requests {ids:?} never started decoding");
}

#[test]
fn a_page_table_naming_another_owners_page_fails_that_sequence_only() {
    let prompts = sixteen_prompts();
    let b_alone = solo(&prompts[1], 8);
    let mut e = engine(512);
    let mut req_a = GenerateRequest::greedy(tenant(7), prompts[0].clone(), 8);
    req_a.request_id = "req-of-a".into();
    let a = e.submit_raw(req_a).expect("admitted");
    let b = e
        .submit_raw(GenerateRequest::greedy(tenant(8), prompts[1].clone(), 8))
        .expect("admitted");
    let mut runs = Runs::default();
    step_until_decoding(&mut e, &mut runs, &[a, b]);
    let a_tokens_before = runs.tokens[&a].len();
    let mismatches_before = e.kv_counters().tag_mismatches;

    // A bug hands A's page table tenant B's first page.
    let b_page = e.pool.table(b.seq()).expect("b open").1[0];
    let table = e.pool.forge_table(a.seq());
    let own = table[0];
    table[0] = b_page;
    table.push(own);

    let ((), log) = capture_logs(|| runs.drain(&mut e));
    // One ERROR line names the tenant, the request, the page, and the owners and epochs.
    let line = log
        .lines()
        .find(|l| l.contains("warden::isolation"))
        .unwrap_or_else(|| panic!("no violation line in {log:?}"));
    eprintln!("the violation line: {line}");
    for part in [
        "ERROR",
        "tenant=7",
        "request_id=req-of-a",
        &format!("page={} ", b_page.page),
        "expected_owner=7",
        &format!("expected_epoch={}", b_page.epoch),
        "found_owner=8",
        &format!("found_epoch={}", b_page.epoch),
    ] {
        assert!(line.contains(part), "{part} missing from {line}");
    }
    match &runs.outcomes[&a] {
        Outcome::Aborted(AbortReason::Isolation(IsolationViolation::ForeignOwner { page, expected, found }))
            if (*expected, *found) == (tenant(7).into(), tenant(8).into()) =>
        {
            assert_eq!(*page, b_page.page)
        }
        other => panic!("A should fail with a foreign-owner violation, got {other:?}"),
    }
    assert_eq!(
        runs.tokens[&a].len(),
        a_tokens_before,
        "A got no token after the violation"
    );
    assert!(matches!(runs.outcomes[&b], Outcome::Finished(_)));
    assert_eq!(runs.tokens[&b], b_alone, "B's output is unaffected");
    let c = e.kv_counters();
    assert!(
        c.tag_mismatches > mismatches_before,
        "the counters show the violation: {c:?}"
    );
    // A's close released its own pages and not B's.
    assert_quiescent(&mut e, &[7, 8]);
}

#[test]
fn a_freed_and_reused_page_is_a_stale_epoch() {
    let prompts = sixteen_prompts();
    // Without the prefix cache, so that X's pages are freed, not kept.
    let mut cfg = config(2048, 512);
    cfg.prefix_cache = false;
    let mut e = Engine::new(model(), Arc::new(IdDetok), cfg).expect("engine starts");
    // X runs to completion; a copy of its page table outlives it.
    let x = e
        .submit_raw(GenerateRequest::greedy(tenant(5), prompts[2].clone(), 2))
        .expect("admitted");
    let mut runs = Runs::default();
    let ev = e.step();
    runs.absorb(ev);
    let x_table = e.pool.table(x.seq()).expect("x open").1.to_vec();
    runs.drain(&mut e);
    // Y, the same tenant, gets X's freed pages back with new epochs.
    let y = e
        .submit_raw(GenerateRequest::greedy(tenant(5), prompts[3].clone(), 8))
        .expect("admitted");
    step_until_decoding(&mut e, &mut runs, &[y]);
    let y_pages: Vec<u32> = e
        .pool
        .table(y.seq())
        .expect("y open")
        .1
        .iter()
        .map(|p| p.page)
        .collect();
    let stale = *x_table
        .iter()
        .find(|p| y_pages.contains(&p.page))
        .expect("a page of X was reused by Y");
    let table = e.pool.forge_table(y.seq());
    let own = table[0];
    table[0] = stale;
    table.push(own);

    runs.drain(&mut e);
    match &runs.outcomes[&y] {
        Outcome::Aborted(AbortReason::Isolation(IsolationViolation::StaleEpoch { page, expected, found })) => {
            assert_eq!((*page, *expected), (stale.page, stale.epoch));
            assert!(found > expected);
        }
        other => panic!("Y should fail with a stale-epoch violation, got {other:?}"),
    }
    let c = e.kv_counters();
    assert!(c.tag_mismatches > 0);
    assert_quiescent(&mut e, &[]);
}

/// The 2026 shape at the model's own boundary: reserve 8 pages, fill 1, attend over 8.
#[test]
fn attending_over_unwritten_pages_is_an_isolation_error_not_output() {
    let m = model();
    let mut pool = KvPool::new(m.config().attn_shape(16), m.config().n_layers, 8 << 20).expect("pool");
    pool.open(SeqId(1), tenant(3), 8, &[]).expect("open");
    pool.ensure(SeqId(1), 8 * 16).expect("eight pages");
    let prompt: Vec<u32> = sixteen_prompts()[2][..16].to_vec();
    pool.commit_slots(SeqId(1), 16).expect("commit the first page");
    let step = [StepSeq {
        seq: SeqId(1),
        tokens: &prompt,
        pos0: 0,
        want_logits: true,
        prompt: true,
    }];
    assert!(m.forward(&mut pool, &step, TagCheck::Enforce, &mut Scratch::default())[0].is_ok());

    let before = pool.counters().tag_mismatches;
    // A step that claims position 127 reads all eight pages; seven were never written.
    let step = [StepSeq {
        seq: SeqId(1),
        tokens: &prompt[..1],
        pos0: 127,
        want_logits: true,
        prompt: false,
    }];
    let r = m.forward(&mut pool, &step, TagCheck::Enforce, &mut Scratch::default());
    match &r[0] {
        Err(crate::model::StepError::Isolation(IsolationViolation::UnwrittenSlots { written: 0, .. })) => {}
        other => panic!("expected unwritten slots, got {other:?}"),
    }
    assert!(pool.counters().tag_mismatches > before);
}

#[test]
fn an_over_length_prompt_is_rejected_before_any_page_is_allocated() {
    let mut e = engine(512);
    let before = e.kv_counters();
    let prompt = vec![1000u32; 2000];
    let r = e
        .submit_raw(GenerateRequest::greedy(tenant(1), prompt, 100))
        .expect_err("rejected");
    assert_eq!(
        r.reason,
        RejectReason::ContextLengthExceeded {
            prompt_tokens: 2000,
            max_tokens: 100,
            requested: 2100,
            limit: 2048
        }
    );
    assert_eq!(r.reason.code(), "context_length_exceeded");
    assert!(!e.has_work());
    let ev = e.step();
    assert!(ev.is_empty(), "a rejected request never produces an event");
    let after = e.kv_counters();
    assert_eq!(after.allocations, before.allocations, "no page was allocated");
    assert_eq!(after.allocations, 0);
    assert_eq!((after.pages_reserved, after.pages_used), (0, 0));
}

#[test]
fn malformed_requests_are_rejected_with_their_reason() {
    let mut e = engine(512);
    let cases: Vec<(GenerateRequest, &str)> = vec![
        (GenerateRequest::greedy(tenant(1), vec![], 4), "empty_prompt"),
        (GenerateRequest::greedy(tenant(1), vec![49_152], 4), "invalid_token"),
        (GenerateRequest::greedy(tenant(1), vec![5], 0), "invalid_parameter"),
        (
            GenerateRequest {
                sampling: super::sampling::SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                ..GenerateRequest::greedy(tenant(1), vec![5], 4)
            },
            "invalid_parameter",
        ),
    ];
    for (req, code) in cases {
        let r = e.submit_raw(req.clone()).expect_err("rejected");
        assert_eq!(r.reason.code(), code, "{req:?}: {}", r.reason);
    }
    assert_eq!(e.kv_counters().allocations, 0);
}

#[test]
fn a_request_over_its_owners_kv_budget_is_rejected_and_within_it_waits() {
    let mut e = engine(512);
    e.pool_mut().set_owner_budget(tenant(9), Some(2));
    let r = e
        .submit_raw(GenerateRequest::greedy(tenant(9), vec![500; 40], 8))
        .expect_err("3 pages > budget of 2");
    assert_eq!(r.reason, RejectReason::OverKvBudget { needed: 3, budget: 2 });
    // Two requests of two pages each: the second waits for the first, then runs.
    let a = e
        .submit_raw(GenerateRequest::greedy(tenant(9), vec![500; 20], 4))
        .expect("admitted");
    let b = e
        .submit_raw(GenerateRequest::greedy(tenant(9), vec![501; 20], 4))
        .expect("admitted");
    let mut runs = Runs::default();
    runs.drain(&mut e);
    for id in [a, b] {
        assert!(
            matches!(runs.outcomes[&id], Outcome::Finished(FinishReason::Length)),
            "{:?}",
            runs.outcomes[&id]
        );
    }
}

#[test]
fn cancellation_goes_through_retirement_and_returns_pages() {
    let mut e = engine(512);
    let a = e
        .submit_raw(GenerateRequest::greedy(tenant(1), vec![700; 50], 100))
        .expect("admitted");
    let mut runs = Runs::default();
    step_until_decoding(&mut e, &mut runs, &[a]);
    assert!(e.kv_counters().pages_used > 0);
    assert!(e.cancel(a));
    assert!(!e.cancel(a), "a request is cancelled once");
    runs.absorb(e.step());
    assert!(matches!(runs.outcomes[&a], Outcome::Aborted(AbortReason::Cancelled)));
    assert_eq!(runs.usage[&a].prompt_tokens, 50, "its prompt was computed");
    // Cancelled before it got a slot: it used nothing and books nothing.
    let b = e
        .submit_raw(GenerateRequest::greedy(tenant(1), vec![700; 50], 100))
        .expect("admitted");
    assert!(e.cancel(b));
    runs.absorb(e.step());
    assert!(matches!(runs.outcomes[&b], Outcome::Aborted(AbortReason::Cancelled)));
    assert_eq!(runs.usage[&b].prompt_tokens, 0);
    assert_quiescent(&mut e, &[1]);
}

#[test]
fn a_pool_smaller_than_the_max_context_refuses_to_start() {
    let mut cfg = config(8192, 512);
    cfg.kv_memory_bytes = 16 << 20;
    let err = Engine::new(model(), Arc::new(IdDetok), cfg).err().expect("refused");
    let msg = err.to_string();
    assert!(msg.contains("8192"), "names the max context: {msg}");
    assert!(
        msg.contains(
            &KvPool::new(model().config().attn_shape(16), 30, 16 << 20)
                .expect("pool")
                .capacity_tokens()
                .to_string()
        ),
        "names the capacity: {msg}"
    );
}

#[test]
fn the_2026_replay_an_over_length_request_ends_with_its_error_and_no_output() {
    // The incident's configuration: a max context of 2048 tokens over a pool that holds 720.
    // Engine::new refuses it (invariant 4). With that check skipped, each later layer still
    // stops an 800-token prompt, and none lets it produce output.
    let mut cfg = config(2048, 512);
    cfg.kv_memory_bytes = 16 << 20;
    assert!(Engine::new(model(), Arc::new(IdDetok), cfg.clone()).is_err());
    let mut e = Engine::new_without_capacity_check(model(), Arc::new(IdDetok), cfg).expect("starts unchecked");
    let capacity = e.pool_mut().capacity_tokens();
    assert!(capacity < 800, "a pool of {capacity} tokens");
    let over = || GenerateRequest::greedy(tenant(1), long_prompts(1, 800, 9).remove(0), 8);
    // Admission knows the pool's capacity, not only the configured max context.
    let rej = e.submit_raw(over()).expect_err("admission refuses it");
    assert!(
        matches!(rej.reason, RejectReason::ContextLengthExceeded { limit, .. } if limit == capacity),
        "{rej:?}"
    );
    // Forced past admission too (as if it had missed), the pool refuses to open it: it ends with
    // its error, without a page, a step or a token, and its neighbour runs as if alone.
    let loose = super::request::AdmissionLimits {
        pool_tokens: usize::MAX,
        ..e.limits()
    };
    let over = e
        .enqueue(
            over().validate(&loose).expect("valid without the pool's limit"),
            super::Role::Whole,
        )
        .expect("queued");
    let neighbour_prompt = sixteen_prompts()[3].clone();
    let neighbour_alone = solo(&neighbour_prompt, 8);
    let neighbour = e
        .submit_raw(GenerateRequest::greedy(tenant(2), neighbour_prompt, 8))
        .expect("admitted");
    let mut runs = Runs::default();
    runs.drain(&mut e);
    assert!(
        matches!(
            runs.outcomes[&over],
            Outcome::Aborted(AbortReason::Kv(KvError::PoolExhausted { .. }))
        ),
        "{:?}",
        runs.outcomes[&over]
    );
    assert!(
        !runs.tokens.contains_key(&over),
        "the over-length request produced output"
    );
    assert_eq!(runs.usage[&over].prompt_tokens, 0, "and never got a page");
    assert_eq!(runs.tokens[&neighbour], neighbour_alone, "its neighbour is unaffected");
    assert_eq!(e.kv_counters().tag_mismatches, 0);
    assert_quiescent(&mut e, &[1, 2]);
}

/// Moves prefill-only request `pid`'s pages from `p` into transferred request `did` of `d`,
/// through encoded frames; `corrupt` flips a bit of that batch on the way.
fn transfer_kv(
    p: &Engine,
    d: &mut Engine,
    (pid, did, owner, tokens): (RequestId, RequestId, u64, usize),
    corrupt: Option<u32>,
) -> Result<(), crate::transfer::TransferError> {
    use crate::transfer::wire::Frame;
    use crate::transfer::{Inbound, Limits, Outbound};
    let limits = Limits {
        pages_per_batch: 2,
        ..Limits::default()
    };
    let owner = tenant(owner);
    let mut out = Outbound::new(p.pool(), pid.seq(), owner, tokens, limits);
    let mut inb = Inbound::begin(d.pool_mut(), did.seq(), owner, out.begin())?;
    while !out.done() {
        while let Some(f) = out.next_frame(p.pool())? {
            let mut b = f.encode();
            if matches!(f, Frame::Batch { number, .. } if Some(number) == corrupt) {
                let last = b.len() - 1;
                b[last] ^= 1;
            }
            let f = Frame::decode(&b, 1 << 24).expect("whole frames").0;
            let ack = inb.receive(d.pool_mut(), f)?;
            out.receive(ack)?;
        }
    }
    Ok(())
}

#[test]
fn a_disaggregated_request_decodes_what_a_whole_one_does() {
    let prompt = sixteen_prompts()[2].clone();
    // The reference computes the prompt in the same two parts a disaggregated request does: all
    // but the last token, then the last token alone (attention over one new row and over many
    // round differently, enough to change a greedy choice on this prompt).
    let whole = {
        let mut e = engine(prompt.len() - 1);
        let id = e
            .submit_raw(GenerateRequest::greedy(tenant(7), prompt.clone(), 10))
            .expect("admitted");
        let mut runs = Runs::default();
        runs.drain(&mut e);
        runs.tokens[&id].clone()
    };
    let (mut p, mut d) = (engine(512), engine(512));
    // The prefill node computes the prompt but its last token, and holds the pages.
    let pid = p
        .submit_prefill_raw(GenerateRequest::greedy(tenant(7), prompt.clone(), 10))
        .expect("admitted");
    let mut pruns = Runs::default();
    pruns.drain(&mut p);
    let tokens = pruns.prefilled[&pid];
    assert_eq!(tokens, prompt.len() - 1);
    assert!(p.kv_counters().pages_used > 0, "held for the transfer");
    // The decode node opens the request with its own admission and receives the KV.
    let did = d
        .open_transfer_raw(GenerateRequest::greedy(tenant(7), prompt.clone(), 10))
        .expect("admitted");
    // Its pages open in its turn (at once here): no prefill runs for it.
    let mut druns = Runs::default();
    druns.absorb(d.step());
    assert!(druns.opened.contains(&did) && druns.tokens.is_empty());
    transfer_kv(&p, &mut d, (pid, did, 7, tokens), None).expect("transferred");
    assert!(p.release_prefilled(pid));
    assert!(d.finish_transfer(did, tokens));
    druns.drain(&mut d);
    assert!(matches!(druns.outcomes[&did], Outcome::Finished(_)));
    assert_eq!(
        druns.tokens[&did], whole,
        "decoding from transferred KV changes nothing"
    );
    assert_eq!(druns.usage[&did].prompt_tokens, prompt.len());
    assert_quiescent(&mut p, &[7]);
    assert_quiescent(&mut d, &[7]);
}

#[test]
fn a_corrupted_transfer_fails_its_request_with_no_output_and_frees_both_sides() {
    let prompt = sixteen_prompts()[2].clone();
    let (mut p, mut d) = (engine(512), engine(512));
    let pid = p
        .submit_prefill_raw(GenerateRequest::greedy(tenant(7), prompt.clone(), 10))
        .expect("admitted");
    let mut pruns = Runs::default();
    pruns.drain(&mut p);
    let tokens = pruns.prefilled[&pid];
    let did = d
        .open_transfer_raw(GenerateRequest::greedy(tenant(7), prompt.clone(), 10))
        .expect("admitted");
    // Its pages open in its turn (at once here): no prefill runs for it.
    let mut druns = Runs::default();
    druns.absorb(d.step());
    assert!(druns.opened.contains(&did) && druns.tokens.is_empty());
    let e = transfer_kv(&p, &mut d, (pid, did, 7, tokens), Some(1)).expect_err("corrupted");
    assert!(e.to_string().contains("checksum"), "{e}");
    assert!(d.fail_transfer(did, e.to_string()));
    assert!(p.release_prefilled(pid));
    druns.absorb(d.step());
    assert!(
        matches!(&druns.outcomes[&did], Outcome::Aborted(AbortReason::Transfer(why)) if why.contains("checksum")),
        "{:?}",
        druns.outcomes[&did]
    );
    assert!(!druns.tokens.contains_key(&did), "a failed transfer produced output");
    assert_eq!(d.kv_counters().tag_mismatches, 0);
    assert_quiescent(&mut p, &[7]);
    assert_quiescent(&mut d, &[7]);
}

#[test]
fn token_logprobs_are_log_softmax_with_the_top_alternatives_in_order() {
    let logits = [1.0f32, 3.0, 2.0, -1.0];
    let lse = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
    let lp = super::TokenLogprobs::of(&logits, 2, 3);
    assert!((lp.logprob - (2.0 - lse)).abs() < 1e-5);
    let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
    assert_eq!(ids, [1, 2, 0]);
    assert!((lp.top[0].1 - (3.0 - lse)).abs() < 1e-5);
    assert!(super::TokenLogprobs::of(&logits, 1, 0).top.is_empty());
}

#[test]
fn a_repeated_prompt_reuses_only_its_owners_cached_prefix_with_the_same_output() {
    let prompt = sixteen_prompts()[2].clone();
    assert!(prompt.len() > 33, "a prompt of several pages: {}", prompt.len());
    let whole_pages = (prompt.len() - 1) / 16 * 16;
    let alone = solo(&prompt, 10);
    let mut e = engine(512);
    let mut runs = Runs::default();
    let mut run = |e: &mut Engine, owner: u64| {
        let id = e
            .submit_raw(GenerateRequest::greedy(tenant(owner), prompt.clone(), 10))
            .expect("admitted");
        runs.drain(e);
        (runs.tokens[&id].clone(), runs.usage[&id])
    };
    let (first, u1) = run(&mut e, 1);
    let (again, u2) = run(&mut e, 1);
    let (other, u3) = run(&mut e, 2);
    assert_eq!(u1.cached_tokens, 0);
    assert_eq!(
        u2.cached_tokens, whole_pages,
        "the owner's second request adopts every whole prompt page"
    );
    assert_eq!(u3.cached_tokens, 0, "another owner never hits");
    assert_eq!(first, alone);
    assert_eq!(again, alone, "cached KV gives the same greedy output");
    assert_eq!(other, alone);
    assert_eq!(e.kv_counters().prefix_hit_tokens, whole_pages as u64);
    assert_quiescent(&mut e, &[1, 2]);
}

#[test]
fn public_prefixes_serve_only_tenants_allowed_them_with_the_same_output() {
    let prompt = sixteen_prompts()[2].clone();
    let public = prompt[..32].to_vec();
    let alone = solo(&prompt, 10);
    let mut e = engine(512);
    e.set_public_prefixes(std::slice::from_ref(&public)).expect("computed");
    assert_eq!(e.kv_counters().pages_pinned, 2, "the server pins the public pages");
    let allowed = super::TenantSettings {
        public_prefixes: true,
        ..Default::default()
    };
    e.set_tenant(tenant(1), allowed);
    e.set_tenant(tenant(2), allowed);
    let mut runs = Runs::default();
    let mut run = |e: &mut Engine, owner: u64| {
        let id = e
            .submit_raw(GenerateRequest::greedy(tenant(owner), prompt.clone(), 10))
            .expect("admitted");
        runs.drain(e);
        (runs.tokens[&id].clone(), runs.usage[&id].cached_tokens)
    };
    // Tenants 1 and 2 adopt the public pages on their first request; tenant 3, whose settings
    // do not allow them, computes everything.
    assert_eq!(run(&mut e, 1), (alone.clone(), 32));
    assert_eq!(run(&mut e, 2), (alone.clone(), 32));
    assert_eq!(run(&mut e, 3), (alone.clone(), 0));
    // Nothing of a request that began with a public prefix went to its tenant's private cache.
    e.set_tenant(
        tenant(1),
        super::TenantSettings {
            public_prefixes: false,
            ..Default::default()
        },
    );
    assert_eq!(run(&mut e, 1).1, 0);
    // A prefix shorter than a page is refused; dropping the prefixes frees their pages.
    assert!(matches!(
        e.set_public_prefixes(&[public[..10].to_vec()]),
        Err(KvError::PublicPrefixTooShort { tokens: 10, .. })
    ));
    e.set_public_prefixes(&[]).expect("dropped");
    assert_quiescent(&mut e, &[1, 2, 3]);
}

#[test]
fn pins_are_the_owners_and_hold_against_pressure() {
    let prompt = sixteen_prompts()[2].clone();
    let mut e = engine(512);
    let id = e
        .submit_raw(GenerateRequest::greedy(tenant(4), prompt.clone(), 4))
        .expect("admitted");
    let mut runs = Runs::default();
    step_until_decoding(&mut e, &mut runs, &[id]);
    assert!(
        matches!(e.kv_pin(id, tenant(9), 32), Err(KvError::NoSuchSequence(_))),
        "another owner cannot pin this request's prefix"
    );
    assert_eq!(e.kv_pin(id, tenant(4), 33).expect("pinned"), 32);
    runs.drain(&mut e);
    assert_eq!(e.kv_counters().pages_pinned, 2);
    // Evict everything evictable: the pinned pages stay.
    let total = e.kv_counters().pages_total;
    let pool = e.pool_mut();
    pool.open(SeqId(999), tenant(5), total - 2, &[])
        .expect("all but the pinned pages");
    pool.ensure(SeqId(999), (total - 2) * 16).expect("allocated");
    pool.close(SeqId(999)).expect("closed");
    let again = e
        .submit_raw(GenerateRequest::greedy(tenant(4), prompt.clone(), 4))
        .expect("admitted");
    runs.drain(&mut e);
    assert_eq!(runs.usage[&again].cached_tokens, 32);
    assert_eq!(runs.tokens[&again], runs.tokens[&id]);
    assert_quiescent(&mut e, &[4]);
}

#[test]
fn the_choices_of_one_prompt_compute_it_once() {
    let prompt = sixteen_prompts()[2].clone();
    let whole_pages = (prompt.len() - 1) / 16 * 16;
    let alone = solo(&prompt, 6);
    // A 32-token step budget: the first choice's prefill takes several steps.
    let mut e = engine(32);
    let ids: Vec<RequestId> = (0..4)
        .map(|_| {
            e.submit_raw(GenerateRequest::greedy(tenant(3), prompt.clone(), 6))
                .expect("admitted")
        })
        .collect();
    let mut runs = Runs::default();
    runs.drain(&mut e);
    let cached: Vec<usize> = ids.iter().map(|id| runs.usage[id].cached_tokens).collect();
    assert_eq!(
        cached,
        [0, whole_pages, whole_pages, whole_pages],
        "the others adopt the first's pages"
    );
    for id in &ids {
        assert_eq!(runs.tokens[id], alone);
    }
    assert_quiescent(&mut e, &[3]);
}

/// `count` distinct prompts of `len` ordinary tokens.
fn long_prompts(count: usize, len: usize, salt: u32) -> Vec<Vec<u32>> {
    (0..count)
        .map(|i| {
            (0..len)
                .map(|j| 100 + ((i * 7919 + j * 104_729) as u32 ^ salt) % 20_000)
                .collect()
        })
        .collect()
}

#[test]
fn a_flooding_tenant_does_not_delay_anothers_first_token() {
    // Unloaded, B's short prompt gives its first token in the first step.
    let b_prompt: Vec<u32> = (0..20).map(|j| 300 + j).collect();
    let steps_to_first_token = |e: &mut Engine, runs: &mut Runs| {
        let b = e
            .submit_raw(GenerateRequest::greedy(tenant(2), b_prompt.clone(), 4))
            .expect("admitted");
        let mut steps = 0;
        while !runs.tokens.contains_key(&b) {
            let ev = e.step();
            runs.absorb(ev);
            steps += 1;
            assert!(steps < 200, "B never started");
        }
        steps
    };
    let mut e = engine(64);
    let unloaded = steps_to_first_token(&mut e, &mut Runs::default());
    assert_eq!(unloaded, 1);
    // A floods: twelve 200-token prompts, 2400 prefill tokens against 64 a step. In arrival
    // order B would wait for all of them; the least served tenant's prefill goes first instead.
    let mut e = engine(64);
    let mut runs = Runs::default();
    for p in long_prompts(12, 200, 0) {
        e.submit_raw(GenerateRequest::greedy(tenant(1), p, 4))
            .expect("admitted");
    }
    for _ in 0..3 {
        let ev = e.step();
        runs.absorb(ev);
    }
    let loaded = steps_to_first_token(&mut e, &mut runs);
    assert!(
        loaded <= 2 * unloaded,
        "B waited {loaded} steps behind A's flood (unloaded: {unloaded})"
    );
    runs.drain(&mut e);
    assert_quiescent(&mut e, &[1, 2]);
}

#[test]
fn a_new_tenants_prefill_leads_the_next_step_beside_anothers_decodes() {
    // A keeps 24 streams decoding; with 48 tokens a step, B's 40-token prompt and all of A's 24
    // decodes do not fit one step. B arrives at A's counter with fewer sequences, so its prefill
    // leads the next step and A's decodes join only as far as the step allows; B's first token
    // comes from that step, and A's decodes all run the step after.
    let mut e = engine(48);
    let mut runs = Runs::default();
    let a: Vec<RequestId> = long_prompts(24, 8, 3)
        .into_iter()
        .map(|p| {
            let mut r = GenerateRequest::greedy(tenant(1), p, 40);
            r.ignore_eos = true;
            e.submit_raw(r).expect("admitted")
        })
        .collect();
    step_until_decoding(&mut e, &mut runs, &a);
    let a_tokens = |runs: &Runs| a.iter().map(|id| runs.tokens[id].len()).sum::<usize>();
    let before = a_tokens(&runs);
    let b_prompt: Vec<u32> = (0..40).map(|j| 300 + j).collect();
    let b = e
        .submit_raw(GenerateRequest::greedy(tenant(2), b_prompt, 4))
        .expect("admitted");
    let ev = e.step();
    runs.absorb(ev);
    assert!(runs.tokens.contains_key(&b), "B's first token took more than one step");
    let shared = a_tokens(&runs) - before;
    assert!(
        shared <= 8,
        "B's prefill led the step, and A's decodes filled what was left: {shared}"
    );
    let ev = e.step();
    runs.absorb(ev);
    assert_eq!(
        a_tokens(&runs),
        before + shared + 24,
        "A's decodes did not all run the step after"
    );
    runs.drain(&mut e);
    assert_quiescent(&mut e, &[1, 2]);
}

#[test]
fn the_step_target_cuts_prefill_chunks_to_what_the_cost_model_predicts() {
    let mut cfg = config(2048, 512);
    cfg.step_target = Some(std::time::Duration::from_millis(20));
    let mut e = Engine::new(model(), Arc::new(IdDetok), cfg).expect("engine starts");
    // Until the model has seen steps, max_batch_tokens alone limits a step.
    e.submit_raw(GenerateRequest::greedy(tenant(1), long_prompts(1, 200, 4).remove(0), 1))
        .expect("admitted");
    e.admit_waiting();
    assert_eq!(e.plan(), vec![(0, 200)]);
    // Steps that took half a millisecond a token: 20 ms holds 40.
    for n in [16, 40, 64, 100, 128, 200, 256, 300] {
        let w = super::cost::Work::chunk(n, n, super::cost::Attention::Prompt, true);
        e.cost.observe(w, std::time::Duration::from_micros(500 * n as u64));
    }
    let plan = e.plan();
    assert_eq!(plan.len(), 1);
    assert!((36..=40).contains(&plan[0].1), "planned {plan:?} for a 20 ms step");
    // However slow steps get, a prefill still gets MIN_PREFILL_TOKENS a step.
    for n in [16, 40, 64, 100, 128, 200, 256, 300] {
        let w = super::cost::Work::chunk(n, n, super::cost::Attention::Prompt, true);
        e.cost.observe(w, std::time::Duration::from_millis(100 * n as u64));
    }
    assert_eq!(e.plan(), vec![(0, super::MIN_PREFILL_TOKENS)]);
    Runs::default().drain(&mut e);
    assert_quiescent(&mut e, &[1]);
}

#[test]
fn contending_tenants_share_prefill_tokens_by_weight() {
    let mut e = engine(64);
    // Charged in tokens (the stand-in model's steps take too little time to share by).
    e.cost.charge_tokens = true;
    for (owner, weight) in [(1, 1), (2, 2)] {
        e.set_tenant(
            tenant(owner),
            super::TenantSettings {
                weight,
                ..Default::default()
            },
        );
    }
    for (owner, salt) in [(1, 1), (2, 2)] {
        for p in long_prompts(6, 200, salt) {
            e.submit_raw(GenerateRequest::greedy(tenant(owner), p, 2))
                .expect("admitted");
        }
    }
    let mut runs = Runs::default();
    for _ in 0..24 {
        let ev = e.step();
        runs.absorb(ev);
    }
    // Both stayed backlogged (12 x 200 tokens > 24 x 64): tokens served follow the weights.
    let (one, two) = (e.served[&tenant(1)], e.served[&tenant(2)] * 2.0);
    let ratio = two / one;
    assert!(
        (1.6..=2.4).contains(&ratio),
        "tenant 2 got {ratio:.2}x tenant 1's tokens"
    );
    runs.drain(&mut e);
    assert_quiescent(&mut e, &[1, 2]);
}

#[test]
fn a_request_that_a_new_floor_leaves_no_room_for_ends_with_its_error() {
    let mut e = engine(512);
    let total = e.kv_counters().pages_total;
    let b = e
        .submit_raw(GenerateRequest::greedy(tenant(1), vec![700; 40], 200))
        .expect("fits when submitted");
    // A policy reload guarantees another tenant all but two pages before B is admitted.
    e.set_tenant(
        tenant(2),
        super::TenantSettings {
            min_pages: total - 2,
            ..Default::default()
        },
    );
    let mut runs = Runs::default();
    runs.absorb(e.step());
    assert!(
        matches!(
            runs.outcomes.get(&b),
            Some(Outcome::Aborted(AbortReason::Kv(
                crate::kv::KvError::PoolExhausted { .. }
            )))
        ),
        "B can never fit under the new floor, so it ends instead of waiting: {:?}",
        runs.outcomes.get(&b)
    );
    assert!(!e.has_work());
    e.forget_owner(tenant(2));
    assert_quiescent(&mut e, &[1]);
}

/// A steered sequence computes nothing while its last token waits for a verdict (others go on
/// without it), samples its next token under the verdict's constraint, and fails alone with
/// `plugin_constraint_allows_no_token` when a constraint leaves nothing.
#[test]
fn a_steered_sequence_waits_for_each_verdict_and_samples_under_it() {
    use super::steer::{Steer, TokenConstraint};
    let mut e = engine(512);
    let prompt: Vec<u32> = (1..40).collect();
    let free = solo(&prompt, 4);
    let steer = Arc::new(Steer::new(None));
    let limits = e.limits();
    let valid = |owner| {
        GenerateRequest::greedy(tenant(owner), prompt.clone(), 4)
            .validate(&limits)
            .expect("valid")
    };
    let a = e.submit(valid(1).with_steer(steer.clone())).expect("admitted");
    let b = e.submit(valid(2)).expect("admitted");
    let mut runs = Runs::default();
    let tokens = |r: &Runs, id| r.tokens.get(&id).map_or(0, Vec::len);
    while tokens(&runs, a) == 0 {
        runs.absorb(e.step());
    }
    assert_eq!(runs.tokens[&a], free[..1], "the first token needs no verdict");
    assert!(e.awaits_verdicts());
    // Without a verdict A waits; B runs to its end.
    for _ in 0..6 {
        runs.absorb(e.step());
    }
    assert_eq!(tokens(&runs, a), 1, "no verdict, no next token");
    assert_eq!(runs.tokens[&b], free, "the unsteered sequence is not held up");
    // A verdict that allows one token only: the next token is that one.
    let forced = free[1] + 1;
    steer.answer(Some(TokenConstraint {
        allowed: Some(vec![forced]),
        bias: vec![],
    }));
    assert!(!e.awaits_verdicts());
    while tokens(&runs, a) == 1 {
        runs.absorb(e.step());
    }
    assert_eq!(runs.tokens[&a][1], forced);
    // Plain verdicts go on; a constraint that leaves nothing ends A alone, with its code.
    steer.answer(None);
    while tokens(&runs, a) == 2 {
        runs.absorb(e.step());
    }
    steer.answer(Some(TokenConstraint {
        allowed: Some(vec![]),
        bias: vec![],
    }));
    runs.drain(&mut e);
    match &runs.outcomes[&a] {
        Outcome::Aborted(r) => assert_eq!(r.code(), "plugin_constraint_allows_no_token"),
        o => panic!("{o:?}"),
    }
    assert!(matches!(runs.outcomes[&b], Outcome::Finished(_)));
    assert_quiescent(&mut e, &[1, 2]);
}

/// A plugin's constraint and the request's own (its `response_format`) hold together: a token
/// must pass both, and when none does the sequence fails with the plugin's code.
#[test]
fn a_steering_constraint_and_the_requests_format_both_hold() {
    use super::steer::{Steer, TokenConstraint};
    use crate::grammar::{Format, GrammarLimits, Grammars};
    let tk = crate::testutil::tokenizer();
    let one = |text: &str| match tk.encode(text, false)[..] {
        [id] => id,
        ref ids => panic!("{text:?} is {ids:?}"),
    };
    let (brace, word) = (one("{"), one("Hello"));
    let grammars = Grammars::new(
        tk.clone(),
        GrammarLimits {
            max_schema_bytes: 4096,
            compile_ms: 2000,
            memory_bytes: 256 << 20,
        },
    );
    let json = grammars.compile(&Format::JsonObject).unwrap();
    let run = |allowed: Vec<u32>| {
        let mut e = engine(512);
        let prompt: Vec<u32> = (1..20).collect();
        let req = GenerateRequest::greedy(tenant(1), prompt, 2)
            .validate(&e.limits())
            .expect("valid")
            .with_constraint(json.clone())
            .with_steer(Arc::new(Steer::first_only(TokenConstraint {
                allowed: Some(allowed),
                bias: vec![],
            })));
        let id = e.submit(req).expect("admitted");
        let mut runs = Runs::default();
        runs.drain(&mut e);
        (runs.tokens.remove(&id).unwrap_or_default(), runs.outcomes.remove(&id))
    };
    // The plugin allows a word or a brace, the format only the brace: the brace it is.
    let (tokens, _) = run(vec![word, brace]);
    assert_eq!(tokens.first(), Some(&brace));
    // The plugin allows only the word, which the format refuses: nothing is left.
    let (tokens, outcome) = run(vec![word]);
    assert!(tokens.is_empty());
    match outcome {
        Some(Outcome::Aborted(r)) => assert_eq!(r.code(), "plugin_constraint_allows_no_token"),
        o => panic!("{o:?}"),
    }
}
