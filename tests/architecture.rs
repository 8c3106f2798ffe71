//! The code's shape, checked: the library's layers import one way only, no files import in a
//! cycle (of any length), what exists for tests and benchmarks only stays out of default builds, and
//! failures are typed (no `anyhow`, no `Result<_, String>` in the library).
//!
//! The layer check reads every file under `host/src`, takes the module paths each names in code (`crate::…`,
//! `super::…` and its own submodules; comments, test-only files and `#[cfg(test)]` blocks left
//! out), and checks them against [`LAYERS`]: a file may name a module of its own top-level
//! module or of a lower layer, never one beside or above it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first. A top-level module may import from lower layers only (and within
/// itself); `warden_kernels` is below them all.
const LAYERS: &[&[&str]] = &[
    &["gguf", "tenant", "net", "pem", "heap", "kv", "log", "child", "procstat"],
    &["tokenizer", "chat", "model", "transfer", "fair"],
    &["loaded", "engine"],
    &["config", "plugin", "policy", "grammar"],
    &["metrics"],
    &["runner"],
    &["serve", "cluster"],
    &["boot", "bench"],
];

fn layer(top: &str) -> usize {
    LAYERS
        .iter()
        .position(|l| l.contains(&top))
        .unwrap_or_else(|| panic!("module {top} is in no layer: add it to LAYERS in tests/architecture.rs"))
}

/// One source file: its module path and the code of it that ships.
struct File {
    /// Its path under the crate's `src`.
    rel: String,
    module: Vec<String>,
    /// Whether it is a `mod.rs` (its `super` is its module's parent).
    is_mod: bool,
    code: String,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The test-only and bench-only switches: each feature, and what only a build with it may name.
const SWITCHES: &[(&str, &[&str])] = &[
    (
        "transfer-faults",
        &[
            "faults::",
            "Injector",
            "WARDEN_TRANSFER_FAULTS",
            "Option<Fault>",
            "enum Fault",
            "link::Fault",
        ],
    ),
    ("bench-tags-off", &["SkipForBenchmark"]),
];

/// Drops comment lines and `#[cfg(test)]` items (a `mod x { … }` block, or a `mod x;` line).
fn shipped(text: &str) -> (String, BTreeSet<String>) {
    let mut out = String::new();
    let mut test_mods = BTreeSet::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim();
        if t == "#[cfg(test)]" {
            let next = lines.get(i + 1).map(|l| l.trim()).unwrap_or("");
            let decl = next.strip_prefix("pub ").unwrap_or(next);
            if let Some(name) = decl.strip_prefix("mod ") {
                if let Some(name) = name.strip_suffix(';') {
                    test_mods.insert(name.trim().to_string());
                    i += 2;
                    continue;
                }
                // Skip the block to its closing brace.
                let mut depth = 0i64;
                let mut j = i + 1;
                loop {
                    depth += lines[j].matches('{').count() as i64 - lines[j].matches('}').count() as i64;
                    j += 1;
                    if depth == 0 || j == lines.len() {
                        break;
                    }
                }
                i = j;
                continue;
            }
        }
        if !t.starts_with("//") {
            out.push_str(lines[i]);
            out.push('\n');
        }
        i += 1;
    }
    (out, test_mods)
}

fn files() -> Vec<File> {
    files_in(&src_dir())
}

/// The shipped source files under `dir` (a crate's `src`), test-only files left out.
fn files_in(dir: &Path) -> Vec<File> {
    let root = dir.to_path_buf();
    let rel = |p: &Path| p.strip_prefix(&root).unwrap().to_string_lossy().replace('\\', "/");
    fn walk(
        dir: &Path,
        module: &[String],
        test_only: &BTreeSet<String>,
        rel: &dyn Fn(&Path) -> String,
        out: &mut Vec<File>,
    ) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        // mod.rs first: it says which children are test-only.
        entries.sort_by_key(|p| p.file_name().unwrap() != "mod.rs");
        let mut tests = test_only.clone();
        for p in entries {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                if tests.contains(&name) {
                    continue;
                }
                let mut m = module.to_vec();
                m.push(name);
                walk(&p, &m, &BTreeSet::new(), rel, out);
                continue;
            }
            if p.extension().is_none_or(|e| e != "rs") || name == "main" {
                continue;
            }
            let (code, test_mods) = shipped(&std::fs::read_to_string(&p).unwrap());
            if name == "mod" || name == "lib" {
                tests.extend(test_mods);
                out.push(File {
                    rel: rel(&p),
                    module: module.to_vec(),
                    is_mod: true,
                    code,
                });
                continue;
            }
            if tests.contains(&name) {
                continue;
            }
            let mut m = module.to_vec();
            m.push(name);
            // A plain file's test-only children live in a folder of its name.
            let _ = test_mods;
            out.push(File {
                rel: rel(&p),
                module: m,
                is_mod: false,
                code,
            });
        }
    }
    let mut out = Vec::new();
    walk(dir, &[], &BTreeSet::new(), &rel, &mut out);
    // lib.rs declares the top-level modules; it is the crate root, not a layer.
    out.retain(|f| !f.module.is_empty());
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Expands the path (or `use` tree) that starts at `s`: `a::b::{c, d::{e}}` gives `a::b::c` and
/// `a::b::d::e`.
fn expand(s: &str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let b = s.as_bytes();
    let mut i = 0;
    let mut path = prefix;
    loop {
        while i < b.len() && b[i] == b' ' {
            i += 1;
        }
        if i < b.len() && b[i] == b'{' {
            i += 1;
            loop {
                while i < b.len() && (b[i] as char).is_whitespace() {
                    i += 1;
                }
                if i >= b.len() {
                    return i;
                }
                if b[i] == b'}' {
                    return i + 1;
                }
                i += expand(&s[i..], path.clone(), out);
                while i < b.len() && (b[i] as char).is_whitespace() {
                    i += 1;
                }
                if i < b.len() && b[i] == b',' {
                    i += 1;
                }
            }
        }
        let start = i;
        while i < b.len() && is_ident(b[i] as char) {
            i += 1;
        }
        if i == start {
            out.push(path);
            return i;
        }
        path.push(s[start..i].to_string());
        if s[i..].starts_with("::") {
            i += 2;
        } else {
            out.push(path);
            return i;
        }
    }
}

/// The module paths (absolute, from the crate root) `f` names.
fn references(f: &File, modules: &BTreeSet<Vec<String>>) -> BTreeSet<Vec<String>> {
    let mut paths = Vec::new();
    let code = &f.code;
    // The module `super` means in this file (a `mod.rs` is its folder's module, so for both
    // kinds it is the parent), and this file's own children.
    let own = f.module.clone();
    let parent = own[..own.len() - 1].to_vec();
    let children: BTreeSet<String> = modules
        .iter()
        .filter(|m| m.len() == own.len() + 1 && m.starts_with(&own) && f.is_mod)
        .map(|m| m[own.len()].clone())
        .collect();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        if !code.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let at_word = i == 0 || !(is_ident(bytes[i - 1] as char) || bytes[i - 1] == b':');
        if at_word {
            let rest = &code[i..];
            let root: Option<(usize, Vec<String>)> = if rest.starts_with("crate::") {
                Some((7, Vec::new()))
            } else if rest.starts_with("super::") {
                Some((7, parent.clone()))
            } else if rest.starts_with("self::") && f.is_mod {
                // In a `mod.rs`, `self::child` is a child module.
                Some((6, own.clone()))
            } else {
                children
                    .iter()
                    .find(|c| rest.starts_with(&format!("{c}::")) || rest.starts_with(&format!("{c}::{{")))
                    .map(|_| (0, own.clone()))
            };
            if let Some((skip, prefix)) = root {
                let used = expand(&rest[skip..], prefix, &mut paths);
                i += skip + used.max(1);
                continue;
            }
        }
        i += 1;
    }
    // Each path names the longest module it starts with.
    paths
        .into_iter()
        .filter_map(|p| {
            (1..=p.len())
                .rev()
                .map(|k| p[..k].to_vec())
                .find(|m| modules.contains(m))
        })
        .filter(|m| *m != f.module)
        .collect()
}

#[test]
fn layers_import_downward_only_and_no_files_import_in_a_cycle() {
    let files = files();
    assert!(
        files.len() > 40,
        "found only {} source files under {:?}",
        files.len(),
        src_dir()
    );
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| f.module.clone()).collect();
    let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for f in &files {
        let refs = references(f, &modules);
        let top = &f.module[0];
        for r in &refs {
            if r[0] != *top && layer(&r[0]) >= layer(top) {
                wrong.push(format!(
                    "{} (layer {}) imports {} (layer {})",
                    f.module.join("::"),
                    layer(top),
                    r.join("::"),
                    layer(&r[0])
                ));
            }
        }
        graph.insert(f.module.clone(), refs);
    }
    // A module's own parent is named by its children's `super::` paths only as their scope; an
    // import back from the parent makes a cycle, as does any longer loop.
    for cycle in cycles(&graph) {
        let names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
        wrong.push(format!("an import cycle: {} -> {}", names.join(" -> "), names[0]));
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

/// The import cycles of `graph`, of any length: one cycle through each strongly connected
/// component of more than one module (Tarjan's algorithm finds the components), in the order
/// the imports run.
fn cycles<N: Ord + Clone>(graph: &BTreeMap<N, BTreeSet<N>>) -> Vec<Vec<N>> {
    struct Tarjan<'g, N> {
        graph: &'g BTreeMap<N, BTreeSet<N>>,
        index: BTreeMap<&'g N, usize>,
        low: BTreeMap<&'g N, usize>,
        stack: Vec<&'g N>,
        on_stack: BTreeSet<&'g N>,
        components: Vec<Vec<&'g N>>,
    }
    impl<'g, N: Ord> Tarjan<'g, N> {
        fn visit(&mut self, v: &'g N) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let Some((w, _)) = self.graph.get_key_value(w) else {
                    continue;
                };
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                self.components.push(component);
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    // Within a component every module reaches every other: walk from its least module along
    // imports inside the component, breadth first, back to where it started.
    let mut out = Vec::new();
    for c in t.components.into_iter().filter(|c| c.len() > 1) {
        let inside: BTreeSet<&N> = c.iter().copied().collect();
        let start = *inside.iter().next().expect("a component is never empty");
        let mut came_from: BTreeMap<&N, &N> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        let mut last = None;
        'search: while let Some(v) = queue.pop_front() {
            for w in graph.get(v).into_iter().flatten().filter(|w| inside.contains(w)) {
                if w == start {
                    last = Some(v);
                    break 'search;
                }
                let (w, _) = graph.get_key_value(w).expect("inside the graph");
                if !came_from.contains_key(w) {
                    came_from.insert(w, v);
                    queue.push_back(w);
                }
            }
        }
        let mut path = Vec::new();
        let mut at = last.expect("a component's modules reach each other");
        while at != start {
            path.push(at.clone());
            at = came_from[at];
        }
        path.push(start.clone());
        path.reverse();
        out.push(path);
    }
    out
}

/// The layers as `lib.rs`'s table lists them, lowest first: each row's names (the column before
/// the description; an indented row continues the one above).
fn documented_layers(lib: &str) -> Vec<BTreeSet<String>> {
    let block = lib
        .split("//! ```text\n")
        .nth(1)
        .and_then(|b| b.split("//! ```\n").next())
        .expect("lib.rs's layer table");
    let mut rows: Vec<BTreeSet<String>> = Vec::new();
    for line in block.lines() {
        let line = line.strip_prefix("//!").unwrap_or(line);
        let line = line.strip_prefix(' ').unwrap_or(line);
        let continued = line.starts_with("  ");
        let names = line.trim_start().split("  ").next().unwrap_or("");
        let names: BTreeSet<String> = names
            .split([',', '|'])
            .map(str::trim)
            .filter(|n| !n.is_empty() && *n != "warden_kernels")
            .map(String::from)
            .collect();
        match rows.last_mut() {
            Some(last) if continued => last.extend(names),
            _ => rows.push(names),
        }
    }
    rows.retain(|r| !r.is_empty());
    rows.reverse();
    rows
}

#[test]
fn lib_rs_lists_the_layers_the_check_enforces() {
    let lib = std::fs::read_to_string(src_dir().join("lib.rs")).expect("lib.rs");
    let documented = documented_layers(&lib);
    let enforced: Vec<BTreeSet<String>> = LAYERS
        .iter()
        .map(|l| l.iter().map(|m| m.to_string()).collect())
        .collect();
    assert_eq!(documented, enforced, "lib.rs's layer table and LAYERS disagree");
    // And every top-level module of the library is in one.
    let all: BTreeSet<&String> = enforced.iter().flatten().collect();
    for f in files() {
        assert!(all.contains(&f.module[0]), "{} is in no layer", f.module[0]);
    }
}

#[test]
fn the_cycle_check_finds_loops_of_any_length() {
    let graph = |edges: &[(u8, u8)]| {
        let mut g: BTreeMap<u8, BTreeSet<u8>> = BTreeMap::new();
        for &(a, b) in edges {
            g.entry(a).or_default().insert(b);
            g.entry(b).or_default();
        }
        g
    };
    assert!(cycles(&graph(&[(1, 2), (2, 3), (1, 3)])).is_empty());
    assert_eq!(cycles(&graph(&[(1, 2), (2, 1)])), [vec![1, 2]]);
    assert_eq!(
        cycles(&graph(&[(1, 2), (2, 3), (3, 4), (4, 1), (5, 1)])),
        [vec![1, 2, 3, 4]]
    );
    let two = cycles(&graph(&[(1, 2), (2, 3), (3, 1), (7, 8), (8, 9), (9, 7), (3, 7)]));
    assert_eq!(two.len(), 2, "{two:?}");
}

#[test]
fn the_checker_sees_crate_super_and_child_paths() {
    let modules: BTreeSet<Vec<String>> = [
        vec!["serve"],
        vec!["serve", "http"],
        vec!["serve", "store"],
        vec!["engine"],
        vec!["cluster"],
    ]
    .into_iter()
    .map(|m| m.into_iter().map(String::from).collect())
    .collect();
    let f = File {
        rel: "serve/http.rs".into(),
        module: vec!["serve".into(), "http".into()],
        is_mod: false,
        code: "use crate::{engine::Engine, cluster::{self}};\nfn f() { super::store::open(); }\n".into(),
    };
    let refs: BTreeSet<String> = references(&f, &modules).into_iter().map(|m| m.join("::")).collect();
    assert_eq!(
        refs,
        ["cluster", "engine", "serve::store"]
            .into_iter()
            .map(String::from)
            .collect()
    );
    let (code, tests) = shipped(
        "// crate::serve\n#[cfg(test)]\nmod tests {\n  use crate::serve;\n}\n#[cfg(test)]\nmod model;\nuse crate::kv;\n",
    );
    assert_eq!(code, "use crate::kv;\n");
    assert!(tests.contains("model"));
    // A `mod.rs` naming a child through `self::` imports it.
    let m = File {
        rel: "serve/mod.rs".into(),
        module: vec!["serve".into()],
        is_mod: true,
        code: "pub use self::store::Tenant;
use self::http::handle;
"
        .into(),
    };
    let refs: BTreeSet<String> = references(&m, &modules).into_iter().map(|m| m.join("::")).collect();
    assert_eq!(
        refs,
        ["serve::http", "serve::store"].into_iter().map(String::from).collect()
    );
}

#[test]
fn test_and_bench_switches_are_features_default_builds_lack() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // No default feature turns a switch on.
    for manifest in ["host/Cargo.toml", "kernels/Cargo.toml"] {
        let text = std::fs::read_to_string(root.join(manifest)).unwrap();
        let doc: toml::Table = toml::from_str(&text).unwrap();
        let features = doc.get("features").and_then(|f| f.as_table());
        let default: Vec<String> = features
            .and_then(|f| f.get("default"))
            .and_then(|d| d.as_array())
            .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
            .unwrap_or_default();
        for (feature, _) in SWITCHES {
            assert!(
                !default.iter().any(|d| d.contains(feature)),
                "{manifest}: the default features turn on {feature}"
            );
        }
    }
    // Every line of shipped code that names a switch's items sits under its feature's cfg (on the
    // line itself or one of the three above), or in a file only such a build compiles.
    let only_with: BTreeMap<&str, &str> = [("cluster/faults.rs", "transfer-faults")].into_iter().collect();
    let mut wrong = Vec::new();
    for dir in [root.join("host/src"), root.join("kernels/src")] {
        for f in files_in(&dir) {
            let lines: Vec<&str> = f.code.lines().collect();
            for (feature, names) in SWITCHES {
                if only_with.get(f.rel.as_str()) == Some(feature) {
                    continue;
                }
                let gate = format!("feature = \"{feature}\"");
                for (i, line) in lines.iter().enumerate() {
                    if !names.iter().any(|n| line.contains(n)) {
                        continue;
                    }
                    // `#[cfg(not(feature …))]` gates the other way.
                    let gated = lines[i.saturating_sub(3)..=i]
                        .iter()
                        .any(|l| l.contains(&gate) && l.contains("cfg(") && !l.contains("not("));
                    if !gated {
                        wrong.push(format!("{}:{}: {}", f.rel, i + 1, line.trim()));
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "switch code outside its feature's cfg:\n{}",
        wrong.join("\n")
    );
}

/// Whether `code` names a `Result` whose error is a bare `String` (`Result<T, String>`, at any
/// nesting of `T`).
fn string_errors(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices("Result<") {
        let rest = &code[at + "Result<".len()..];
        let mut depth = 0i32;
        let mut last_comma = None;
        let mut prev = ' ';
        for (i, c) in rest.char_indices() {
            let arrow = prev == '-';
            prev = c;
            match c {
                // The `>` of a `->` closes nothing.
                '>' if arrow => {}
                '<' | '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                '>' if depth == 0 => {
                    if let Some(k) = last_comma
                        && rest[k + 1..i].trim() == "String"
                    {
                        found.push(format!("Result<{}>", &rest[..i]));
                    }
                    break;
                }
                '>' => depth -= 1,
                ',' if depth == 0 => last_comma = Some(i),
                _ => {}
            }
        }
    }
    found
}

/// The WIT world's host functions return `result<_, string>`: their Rust signatures are the
/// bindings', and convert a typed error at the boundary.
const WIT_HOST_IMPLS: &[&str] = &["plugin/host.rs"];

/// The library says why something failed with a type: no `anyhow` (the binary's alone) and no
/// `Result<_, String>`.
#[test]
fn the_library_says_why_with_types_not_strings() {
    assert_eq!(
        string_errors("fn f() -> Result<Vec<(u8, u8)>, String>; Result<Box<dyn Fn() -> u8>, String>"),
        vec!["Result<Vec<(u8, u8)>, String>", "Result<Box<dyn Fn() -> u8>, String>"]
    );
    assert!(string_errors("fn f() -> Result<String, Error>; Result<Option<String>, E>").is_empty());
    let mut wrong = Vec::new();
    for f in files() {
        if f.code.contains("anyhow") {
            wrong.push(format!("{} uses anyhow", f.rel));
        }
        if !WIT_HOST_IMPLS.contains(&f.rel.as_str()) {
            for r in string_errors(&f.code) {
                wrong.push(format!("{} returns {r}", f.rel));
            }
        }
    }
    assert!(wrong.is_empty(), "untyped errors in the library:\n{}", wrong.join("\n"));
}

/// The guest SDK builds on its own from its copy of the worlds (0.2.0, and 0.1.0 which it
/// imports from): each copy must be the server's, byte for byte, or plugins would be built
/// against a world the server does not link.
#[test]
fn the_guest_sdks_world_is_the_servers() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for file in ["wit/plugin.wit", "wit/deps/plugin-0.1.0/plugin.wit"] {
        let server = std::fs::read(repo.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let sdk = std::fs::read(repo.join("guest-sdk").join(file)).unwrap_or_else(|e| panic!("guest-sdk/{file}: {e}"));
        assert!(
            server == sdk,
            "guest-sdk/{file} differs from {file}: copy the server's world into the SDK"
        );
    }
}
