//! A hostile plugin for Warden's containment tests: its config picks the attack `preprocess`
//! mounts. `loop` spins forever, `bomb` allocates without bound, `recurse` recurses without
//! bound, `trap` panics, `huge` returns a 64 MiB prompt; anything else passes the request on.

use warden_guest::{Input, Plugin, PluginError, Request};

struct Adversary;

#[inline(never)]
#[allow(unconditional_recursion)]
fn recurse(n: u64, sink: &mut [u64; 16]) -> u64 {
    sink[(n % 16) as usize] = n;
    let mut local = [n; 16];
    local[0] = recurse(n + 1, &mut local);
    local[0] ^ sink[0]
}

impl Plugin for Adversary {
    fn preprocess(mut req: Request) -> Result<Request, PluginError> {
        match req.config.trim() {
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
            _ => {}
        }
        Ok(req)
    }
}

warden_guest::plugin!(Adversary);
