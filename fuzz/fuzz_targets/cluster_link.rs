//! What a cluster peer sends: any byte stream reads as packets until its end or an error, with
//! the frame limit held before a frame is read.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warden::cluster::link::read;

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    rt.block_on(async {
        let mut r = data;
        for _ in 0..64 {
            match read(&mut r, 1 << 20).await {
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
    });
});
