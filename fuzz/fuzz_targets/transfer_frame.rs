//! KV transfer frames: any bytes decode or are refused within the size limit, and what decodes
//! encodes to bytes that decode to a frame encoding to the same bytes (K and V may hold NaNs, so
//! frames are compared by their bytes).
#![no_main]

use libfuzzer_sys::fuzz_target;
use warden::transfer::wire::Frame;

fuzz_target!(|data: &[u8]| {
    if let Ok((frame, used)) = Frame::decode(data, 1 << 20) {
        assert!(used <= data.len());
        let mut again = Vec::new();
        frame.encode_into(&mut again);
        let (back, n) = Frame::decode(&again, 1 << 20).expect("what was decoded encodes to a frame");
        assert_eq!(n, again.len());
        let mut twice = Vec::new();
        back.encode_into(&mut twice);
        assert_eq!(twice, again);
    }
});
