//! `warden plugin new NAME`: a plugin crate that builds and passes `warden plugin test` as
//! written. It depends on the SDK by path (the `guest-sdk` of the repository this binary was
//! built from, or `--sdk`), builds for `wasm32-wasip2` with a plain `cargo build --release`
//! (its `.cargo/config.toml`), reads a typed JSON configuration in `init`, and comes with a
//! configuration and a request to try it on.

use std::path::{Path, PathBuf};

/// What to make.
#[derive(Debug, Clone)]
pub struct NewPlugin {
    /// The plugin's (and the crate's) name: a plugin name that starts with a letter.
    pub name: String,
    /// Where: a directory that does not exist yet, or is empty.
    pub dir: PathBuf,
    /// The SDK's directory (`guest-sdk`).
    pub sdk: PathBuf,
    /// The model `warden plugin test` runs, when the one `warden serve` would use was found.
    pub model: Option<PathBuf>,
    /// The server's data directory (whose store `warden plugin upload` writes), when found.
    pub data_dir: Option<PathBuf>,
}

/// Why no crate was made.
#[derive(Debug, thiserror::Error)]
pub enum ScaffoldError {
    /// A name that is not a plugin's, or cannot be a crate's.
    #[error(
        "{0:?} cannot name a plugin crate: use 1 to 63 characters, lowercase letters, digits, '-' and '_', starting with a letter"
    )]
    BadName(String),
    /// The directory holds something.
    #[error("{0} exists and is not empty: name another with --dir")]
    NotEmpty(PathBuf),
    /// No SDK where it was looked for.
    #[error(
        "no Warden SDK in {0} (its Cargo.toml names warden-guest): pass --sdk with the guest-sdk directory of Warden's repository"
    )]
    NoSdk(PathBuf),
    /// A file could not be written.
    #[error("writing {0}: {1}")]
    Write(PathBuf, std::io::Error),
}

/// The SDK of the repository this binary was built from, if it is still there.
pub fn built_with_sdk() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-sdk")
}

/// The type a crate's plugin is: `my-plugin` → `MyPlugin`.
fn type_name(name: &str) -> String {
    name.split(['-', '_'])
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// The commands that build, try and upload the crate made in `dir`, one a line.
pub fn next_steps(p: &NewPlugin) -> String {
    let wasm = format!("target/wasm32-wasip2/release/{}.wasm", p.name.replace('-', "_"));
    let model = p
        .model
        .as_ref()
        .map(|m| format!(" --model {}", m.display()))
        .unwrap_or_else(|| " --model PATH/TO/MODEL.gguf".into());
    let store = p
        .data_dir
        .as_ref()
        .map(|d| format!(" --data-dir {}", d.display()))
        .unwrap_or_default();
    format!(
        "cd {}\ncargo build --release\nwarden plugin test {wasm} --request request.json --plugin-config config.json{model}\nwarden plugin upload {} {wasm}{store}\nwarden plugin config {} config.json{store}",
        p.dir.display(),
        p.name,
        p.name
    )
}

/// Writes the crate; returns what it wrote, relative to its directory.
pub fn create(p: &NewPlugin) -> Result<Vec<&'static str>, ScaffoldError> {
    let b = p.name.as_bytes();
    if !crate::tenant::valid_tenant_name(&p.name) || !b[0].is_ascii_lowercase() {
        return Err(ScaffoldError::BadName(p.name.clone()));
    }
    let sdk_manifest = std::fs::read_to_string(p.sdk.join("Cargo.toml")).unwrap_or_default();
    if !sdk_manifest.contains("name = \"warden-guest\"") {
        return Err(ScaffoldError::NoSdk(p.sdk.clone()));
    }
    // The SDK's `rust-version`, the oldest toolchain a plugin builds with, is the crate's too.
    let rust_version = sdk_manifest
        .lines()
        .find(|l| l.starts_with("rust-version"))
        .map(|l| format!("{l}\n"))
        .unwrap_or_default();
    let sdk = p.sdk.canonicalize().unwrap_or_else(|_| p.sdk.clone());
    if std::fs::read_dir(&p.dir).is_ok_and(|mut d| d.next().is_some()) {
        return Err(ScaffoldError::NotEmpty(p.dir.clone()));
    }
    let name = &p.name;
    let ty = type_name(name);
    let files: [(&'static str, String); 6] = [
        (
            "Cargo.toml",
            format!(
                r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"
{rust_version}
[lib]
crate-type = ["cdylib"]

[dependencies]
warden-guest = {{ path = {sdk:?} }}
serde = {{ version = "1", features = ["derive"] }}

[profile.release]
opt-level = "s"
lto = true
codegen-units = 1
panic = "abort"
strip = true

# A crate of its own, wherever it is.
[workspace]
"#
            ),
        ),
        (
            ".cargo/config.toml",
            "# A plugin is a WebAssembly component: `cargo build` builds one.\n[build]\ntarget = \"wasm32-wasip2\"\n"
                .into(),
        ),
        (".gitignore", "/target\n".into()),
        (
            "src/lib.rs",
            format!(
                r#"//! {name}: a Warden plugin. It puts a system prompt before every conversation that has none and,
//! if its configuration says so, upper-cases the output as it streams.

use std::sync::OnceLock;

use serde::Deserialize;
use warden_guest::{{Chunk, Finish, Input, Message, Plugin, PluginError, Request}};

/// The configuration (`config.json`; on the server, `warden plugin config {name} config.json`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {{
    /// Put before every conversation that has no system message of its own.
    system_prompt: String,
    /// Upper-case the output.
    #[serde(default)]
    uppercase: bool,
}}

/// Read once, in `init`: every request starts from the state `init` left.
static CONFIG: OnceLock<Config> = OnceLock::new();

struct {ty};

impl Plugin for {ty} {{
    fn init(config: String) -> Result<(), PluginError> {{
        let config: Config = warden_guest::parse_config(&config)?;
        if config.system_prompt.trim().is_empty() {{
            return Err(PluginError {{
                code: "plugin_config".into(),
                message: "system_prompt is empty".into(),
            }});
        }}
        let _ = CONFIG.set(config);
        Ok(())
    }}

    fn preprocess(mut req: Request) -> Result<Request, PluginError> {{
        let Some(config) = CONFIG.get() else {{
            return Err(PluginError {{
                code: "plugin_config".into(),
                message: "{name} has no configuration: set one".into(),
            }});
        }};
        if let Input::Chat(messages) = &mut req.input {{
            if !messages.iter().any(|m| m.role == "system") {{
                messages.insert(
                    0,
                    Message {{
                        role: "system".into(),
                        content: config.system_prompt.clone(),
                    }},
                );
            }}
        }}
        Ok(req)
    }}

    fn postprocess(chunk: Chunk, _end: Option<Finish>) -> Result<Chunk, PluginError> {{
        if CONFIG.get().is_some_and(|c| c.uppercase) {{
            return Ok(Chunk {{
                text: chunk.text.to_uppercase(),
            }});
        }}
        Ok(chunk)
    }}
}}

warden_guest::plugin!({ty});
"#
            ),
        ),
        (
            "config.json",
            "{\n  \"system_prompt\": \"Answer in one short sentence.\",\n  \"uppercase\": true\n}\n".into(),
        ),
        (
            "request.json",
            "{\"model\": \"any\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 16, \"temperature\": 0}\n"
                .into(),
        ),
    ];
    let mut made = Vec::new();
    // No toolchain file: the crate builds with whichever toolchain its author has, from the
    // SDK's rust-version up.
    for (rel, text) in files {
        let path = p.dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| ScaffoldError::Write(parent.into(), e))?;
        }
        std::fs::write(&path, text).map_err(|e| ScaffoldError::Write(path.clone(), e))?;
        made.push(rel);
    }
    let readme = format!(
        "# {name}\n\nA Warden plugin, made by `warden plugin new`. Build it, try it on this machine (the real model, every stage printed), upload it and set its configuration:\n\n```sh\n{}\n```\n\n`src/lib.rs` is the plugin; the SDK's README (`{}`) says what a plugin can do.\n",
        next_steps(p).lines().skip(1).collect::<Vec<_>>().join("\n"),
        sdk.join("README.md").display()
    );
    let path = p.dir.join("README.md");
    std::fs::write(&path, readme).map_err(|e| ScaffoldError::Write(path.clone(), e))?;
    made.push("README.md");
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_types_and_bad_names_are_refused() {
        assert_eq!(type_name("my-plugin_2"), "MyPlugin2");
        assert_eq!(type_name("shout"), "Shout");
        let dir = std::env::temp_dir().join(format!("warden-scaffold-{}", std::process::id()));
        for bad in ["1abc", "Shout", "a b", "", "-x"] {
            let p = NewPlugin {
                name: bad.into(),
                dir: dir.join("x"),
                sdk: built_with_sdk(),
                model: None,
                data_dir: None,
            };
            assert!(matches!(create(&p), Err(ScaffoldError::BadName(_))), "{bad}");
        }
        let p = NewPlugin {
            name: "ok".into(),
            dir: dir.join("y"),
            sdk: dir.clone(),
            model: None,
            data_dir: None,
        };
        assert!(matches!(create(&p), Err(ScaffoldError::NoSdk(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
