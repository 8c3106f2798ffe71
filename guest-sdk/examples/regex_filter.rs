//! Rules from the tenant's config, one per line, with the `regex` crate:
//!
//! ```text
//! deny: (?i)\bpassword\b          # refuse requests whose input matches
//! replace: \bACME-\d{4}\b => [ticket]   # rewrite the output
//! ```
//!
//! The rules are compiled once, in `init`: a rule that does not parse refuses the configuration
//! (and says which line), so a bad one never reaches a request. Output is held until the final
//! chunk, so a replacement sees the whole text. Lines that are empty or start with `#` are
//! skipped.

use std::cell::RefCell;

use regex::Regex;
use warden_guest::{Chunk, Finish, Input, Plugin, PluginError, Request};

struct Rules {
    deny: Vec<Regex>,
    replace: Vec<(Regex, String)>,
}

fn error(message: String) -> PluginError {
    PluginError {
        code: "plugin_config".into(),
        message,
    }
}

impl Rules {
    fn parse(config: &str) -> Result<Self, PluginError> {
        let mut rules = Rules {
            deny: vec![],
            replace: vec![],
        };
        for (n, line) in config.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |e: String| error(format!("regex_filter config line {}: {e}", n + 1));
            if let Some(p) = line.strip_prefix("deny:") {
                rules.deny.push(Regex::new(p.trim()).map_err(|e| bad(e.to_string()))?);
            } else if let Some(r) = line.strip_prefix("replace:") {
                let (p, with) = r
                    .split_once("=>")
                    .ok_or_else(|| bad("replace needs `pattern => text`".into()))?;
                let re = Regex::new(p.trim()).map_err(|e| bad(e.to_string()))?;
                rules.replace.push((re, with.trim().to_string()));
            } else {
                return Err(bad(format!("expected `deny:` or `replace:`, got {line:?}")));
            }
        }
        Ok(rules)
    }
}

thread_local! {
    static RULES: RefCell<Option<Rules>> = const { RefCell::new(None) };
    static HELD: RefCell<String> = const { RefCell::new(String::new()) };
}

struct RegexFilter;

impl Plugin for RegexFilter {
    fn init(config: String) -> Result<(), PluginError> {
        let rules = Rules::parse(&config)?;
        // One search each builds the regexes' search caches now, so a request starts with them.
        for re in rules.deny.iter().chain(rules.replace.iter().map(|(re, _)| re)) {
            re.is_match("");
        }
        RULES.with_borrow_mut(|r| *r = Some(rules));
        Ok(())
    }

    fn preprocess(req: Request) -> Result<Request, PluginError> {
        let texts: Vec<&str> = match &req.input {
            Input::Chat(m) => m.iter().map(|m| m.content.as_str()).collect(),
            Input::Prompt(p) => vec![p.as_str()],
        };
        RULES.with_borrow(|r| {
            for re in r.iter().flat_map(|r| &r.deny) {
                if texts.iter().any(|t| re.is_match(t)) {
                    return Err(PluginError {
                        code: "denied".into(),
                        message: format!("the request matches a deny rule ({})", re.as_str()),
                    });
                }
            }
            Ok(())
        })?;
        Ok(req)
    }

    fn postprocess(chunk: Chunk, end: Option<Finish>) -> Result<Chunk, PluginError> {
        HELD.with_borrow_mut(|held| {
            held.push_str(&chunk.text);
            if end.is_none() {
                return Ok(Chunk { text: String::new() });
            }
            let mut text = std::mem::take(held);
            RULES.with_borrow(|r| {
                for (re, with) in r.iter().flat_map(|r| &r.replace) {
                    text = re.replace_all(&text, with.as_str()).into_owned();
                }
            });
            Ok(Chunk { text })
        })
    }
}

warden_guest::plugin!(RegexFilter);
