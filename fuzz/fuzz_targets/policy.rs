//! Policy files: a default and a tenant's file (split at the first NUL) load as a set or are
//! refused with an error naming the file.
#![no_main]

use std::collections::BTreeMap;
use std::path::PathBuf;

use libfuzzer_sys::fuzz_target;
use warden::policy::{Bounds, PolicySet};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (default, tenant) = text.split_once('\0').unwrap_or((&text, ""));
    let mut files = BTreeMap::new();
    for (name, text) in [("default.toml", default), ("tenants/acme.toml", tenant)] {
        files.insert(name.to_string(), (PathBuf::from(name), text.to_string()));
    }
    let bounds = Bounds {
        kv_pages: 1024,
        page_size: 16,
        pin_pages: 512,
    };
    let _ = PolicySet::from_files(&files, bounds, &|s: &str| vec![s.bytes().map(u32::from).collect()]);
});
