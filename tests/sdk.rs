//! The plugin SDK as an author meets it: `warden plugin new`'s crate built on the SDK's oldest
//! toolchain and tried with `warden plugin test`, and the SDK's doc examples. Its own test binary:
//! the builds it runs take both cores, and no other test's timing should share them.

mod common;

use common::root;

/// `warden plugin new` writes a crate that builds with the SDK's oldest toolchain (its
/// `rust-version`) and passes `warden plugin test`: each command it prints is run here as
/// printed, outside the repository, up to the upload. The SDK's doc examples compile and run on
/// that toolchain too.
#[test]
fn a_new_plugin_builds_with_the_sdks_rust_version_and_passes_plugin_test_as_printed() {
    let sdk = std::fs::read_to_string(root().join("guest-sdk/Cargo.toml")).unwrap();
    let rust_version = sdk
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("the SDK's rust-version");
    let toolchains = std::process::Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .expect("rustup");
    assert!(
        String::from_utf8_lossy(&toolchains.stdout)
            .lines()
            .any(|l| l.starts_with(&format!("{rust_version}-"))),
        "toolchain {rust_version} (the SDK's rust-version) is not installed: run scripts/sdk-toolchain.sh"
    );
    let dir = std::env::temp_dir().join(format!("warden-plugin-new-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Made from the repository (where `warden serve` finds its default model)...
    let out = std::process::Command::new(common::warden_bin())
        .args(["plugin", "new", "hello-world", "--dir"])
        .arg(dir.join("hello-world"))
        .current_dir(root())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    // ...and used outside it, each printed command as printed, the toolchain the SDK's oldest.
    let bin_dir = common::warden_bin().parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let steps: Vec<&str> = said.lines().filter_map(|l| l.strip_prefix("  ")).collect();
    assert!(steps.len() == 5 && steps[0].starts_with("cd "), "{said}");
    let script = steps[..3].join(" && ");
    let out = std::process::Command::new("sh")
        .args(["-c", &script])
        .current_dir(&dir)
        .env("PATH", path)
        .env("RUSTUP_TOOLCHAIN", rust_version)
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script}\n{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The configuration is read in init, typed; the system prompt goes in; the output is upper
    // case.
    assert!(report.contains("init: pre-initialised"), "{report}");
    assert!(
        report.contains(r#"{"role":"system","content":"Answer in one short sentence."}"#),
        "{report}"
    );
    let output = report
        .lines()
        .find_map(|l| l.strip_prefix("output: "))
        .unwrap_or_default();
    assert!(output.len() > 2 && output == output.to_uppercase(), "{report}");
    // A configuration the plugin's type does not read is refused, saying why.
    std::fs::write(
        dir.join("hello-world/bad.json"),
        r#"{"system_prompt": "x", "upper": true}"#,
    )
    .unwrap();
    let out = std::process::Command::new(common::warden_bin())
        .args(["plugin", "test", "target/wasm32-wasip2/release/hello_world.wasm"])
        .args(["--request", "request.json", "--plugin-config", "bad.json", "--model"])
        .arg(common::model())
        .current_dir(dir.join("hello-world"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("plugin_config") && err.contains("upper"),
        "{err}"
    );
    // A second `new` into the same place is refused.
    let out = std::process::Command::new(common::warden_bin())
        .args(["plugin", "new", "hello-world", "--dir"])
        .arg(dir.join("hello-world"))
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not empty"));
    let _ = std::fs::remove_dir_all(&dir);
    // The SDK's own doc examples compile and run, on that toolchain too.
    let out = std::process::Command::new("cargo")
        .args(["test", "--doc", "--manifest-path"])
        .arg(root().join("guest-sdk/Cargo.toml"))
        .env("RUSTUP_TOOLCHAIN", rust_version)
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.contains("test result: ok"), "{said}");
}
