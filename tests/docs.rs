//! The documentation points only at what is there: every relative link in `README.md` and
//! `docs/*.md` names a file or folder of the checkout (and, with `#anchor`, a heading of the page
//! it names), every repository path a page names in backticks exists, no page sends its reader
//! outside the repository, and the README's test command is the one CI runs.
//!
//! Code blocks are left out: what they hold are examples (`policies/tenants/acme.toml`), and
//! paths under `models/` or a `target/` folder are downloads and build outputs, not checked in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The top-level folders whose paths the pages name. `models/` is not one: its files are
/// downloaded, not committed.
const DIRS: &[&str] = &[
    ".ci/",
    "deploy/",
    "docs/",
    "fuzz/",
    "guest-sdk/",
    "host/",
    "kernels/",
    "policies/",
    "scripts/",
    "tests/",
    "wit/",
];

/// The top-level files the pages name.
const FILES: &[&str] = &[
    "Cargo.lock",
    "Cargo.toml",
    "Dockerfile",
    "README.md",
    "rust-toolchain.toml",
    "rustfmt.toml",
    "warden.example.toml",
];

/// Link targets that leave the repository on purpose.
const EXTERNAL: &[&str] = &["http://", "https://", "mailto:"];

/// What no page may name: a reader has the repository and nothing beside it.
const OUTSIDE: &[&str] = &["../shared", "shared folder", "DESIGN.md", "STYLE.md", "PEER.md"];

/// The checkout's root (this package is `host/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("host/ is in the checkout")
        .to_path_buf()
}

/// A file of the checkout with its text.
fn read(path: PathBuf) -> (PathBuf, String) {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (path, text)
}

/// The pages: the README and every page under `docs/`.
fn pages() -> Vec<(PathBuf, String)> {
    let root = root();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("an entry of docs/").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ holds pages");
    std::iter::once(root.join("README.md")).chain(docs).map(read).collect()
}

/// A page's lines outside fenced code blocks, joined (an inline code span may wrap a line).
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Prose split at its backticks: the text outside inline code spans, and the spans.
fn split_code(body: &str) -> (String, Vec<&str>) {
    let mut text = String::new();
    let mut spans = Vec::new();
    for (i, part) in body.split('`').enumerate() {
        if i % 2 == 0 {
            text.push_str(part);
            text.push(' ');
        } else {
            spans.push(part);
        }
    }
    (text, spans)
}

/// The targets of the markdown links (`[text](target)`) in `text`, as written.
fn links(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let end = after.find(')').unwrap_or(after.len());
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.trim_start_matches('<').trim_end_matches('>'));
        rest = &after[end..];
    }
    out
}

/// The anchors of a page's headings as GitHub makes them: the heading's text in lower case,
/// with only letters, digits, spaces, `-` and `_` kept and each space made a `-`; a repeated
/// heading gets `-1`, `-2`, and so on.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fenced || hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let slug: String = line[hashes..]
            .trim()
            .to_lowercase()
            .chars()
            .filter(|&c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.push(if *n == 0 { slug } else { format!("{slug}-{n}") });
        *n += 1;
    }
    out
}

/// The path a code span names in the checkout, if it names one: a single word under one of
/// [`DIRS`] (not a placeholder with `<`, `*`, `{` or `$`, nor a build output under a `target/`
/// folder), or one of [`FILES`].
fn repo_path(span: &str) -> Option<&str> {
    let span = span.trim();
    if span.is_empty() || span.contains(char::is_whitespace) || span.contains(['<', '*', '{', '$']) {
        return None;
    }
    let under_dir = DIRS.iter().any(|&d| span.starts_with(d)) && !span.split('/').any(|s| s == "target");
    (under_dir || FILES.contains(&span)).then_some(span)
}

#[test]
fn every_relative_link_resolves() {
    let root = std::fs::canonicalize(root()).expect("the checkout");
    let mut bad = Vec::new();
    for (page, text) in pages() {
        let dir = page.parent().expect("a page is in a folder");
        let body = prose(&text);
        let (plain, _) = split_code(&body);
        for target in links(&plain) {
            if target.is_empty() || EXTERNAL.iter().any(|&e| target.starts_with(e)) {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target, None),
            };
            let file = if path.is_empty() { page.clone() } else { dir.join(path) };
            let Ok(found) = std::fs::canonicalize(file) else {
                bad.push(format!("{}: ({target}): no such file", page.display()));
                continue;
            };
            if !found.starts_with(root.as_path()) {
                bad.push(format!("{}: ({target}): outside the repository", page.display()));
                continue;
            }
            if let Some(anchor) = anchor
                && found.extension().is_some_and(|x| x == "md")
                && !anchors(&read(found).1).iter().any(|a| a == anchor)
            {
                bad.push(format!("{}: ({target}): no heading #{anchor} there", page.display()));
            }
        }
    }
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

#[test]
fn every_repository_path_named_exists() {
    let root = root();
    let mut missing = Vec::new();
    for (page, text) in pages() {
        let body = prose(&text);
        let (_, spans) = split_code(&body);
        for path in spans.into_iter().filter_map(repo_path) {
            if !root.join(path).exists() {
                missing.push(format!("{}: `{path}`", page.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "paths the docs name that the checkout does not have:\n{}",
        missing.join("\n")
    );
}

#[test]
fn no_page_points_outside_the_repository() {
    let root = root();
    let readers = pages()
        .into_iter()
        .chain(["guest-sdk/README.md", "models/README.md"].map(|p| read(root.join(p))));
    let mut bad = Vec::new();
    for (page, text) in readers {
        for &name in OUTSIDE {
            if text.contains(name) {
                bad.push(format!("{} names {name}", page.display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "pages that point outside the repository:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_readmes_test_command_is_what_ci_runs() {
    let root = root();
    let (_, ci) = read(root.join(".ci/run"));
    let command = ci
        .lines()
        .find(|l| l.starts_with("rustup "))
        .expect("the test command in .ci/run");
    let (_, readme) = read(root.join("README.md"));
    let block = format!("```sh\n{command}\n```");
    assert!(
        readme.contains(block.as_str()),
        "README.md does not show the command .ci/run runs:\n{command}"
    );
}
