//! The server's configuration file: any text parses and passes its checks, or is refused with
//! an error naming the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warden::config::ServeConfig;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = ServeConfig::parse(&text, std::path::Path::new("warden.toml"));
});
