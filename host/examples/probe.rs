use warden::kv::KvPool;
use warden::model::{Model, Scratch, StepSeq};
use warden_kernels::attention::TagCheck;
fn main() {
    let m = Model::load("models/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let c = m.config().clone();
    println!("{c:?} {}", m.backend_name());
    let mut pool = KvPool::new(c.attn_shape(16), c.n_layers, 64 << 20).unwrap();
    pool.open(1, 1, 10).unwrap();
    let mut toks: Vec<u32> = vec![504, 3575, 282, 4649, 314];
    pool.ensure(1, 40).unwrap();
    let mut s = Scratch::default();
    let mut pos = 0;
    let mut new = toks.clone();
    let t0 = std::time::Instant::now();
    for _ in 0..32 {
        pool.commit_slots(1, pos + new.len()).unwrap();
        let r = m.forward(
            &mut pool,
            &[StepSeq {
                seq: 1,
                tokens: &new,
                pos0: pos,
                want_logits: true,
            }],
            TagCheck::Enforce,
            &mut s,
        );
        let l = r.into_iter().next().unwrap().unwrap().unwrap();
        pos += new.len();
        let mut idx: Vec<usize> = (0..l.len()).collect();
        idx.sort_by(|a, b| l[*b].partial_cmp(&l[*a]).unwrap());
        if pos == 5 {
            println!("top5 {:?}", idx[..5].iter().map(|&i| (i, l[i])).collect::<Vec<_>>());
        }
        let t = idx[0] as u32;
        toks.push(t);
        new = vec![t];
    }
    println!("{:?} {:?}", &toks[5..], t0.elapsed());
}
