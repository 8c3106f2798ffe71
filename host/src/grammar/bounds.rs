//! Schema keywords whose compile cost is not bounded by the schema's size, bounded before
//! anything compiles, with an error that names the keyword.
//!
//! `multipleOf` compiles into an automaton with one state per remainder: its cost grows with the
//! divisor's digits as a number (about 40 ms for 9973 and 8 s with 370 MiB for 999983), not with
//! the 6 bytes it takes to write. Its coefficient (the value with the decimal point removed, as
//! the compiler reads it: 0.25 is 25) is held to [`MAX_MULTIPLE_OF`]. Everything else a schema
//! can make expensive, combinations included (an `allOf` of several `multipleOf`s compiles their
//! least common multiple), is bounded by the compile's own time and memory limits.

use serde_json::Value;

use super::error::GrammarError;

/// The largest `multipleOf` coefficient compiled.
pub const MAX_MULTIPLE_OF: u64 = 10_000;

/// Keywords whose values are data, not schemas: never searched for keywords.
const DATA: &[&str] = &["const", "enum", "default", "examples", "description", "title"];

/// Checks every schema within `schema` for keywords [`bounds`](self) holds to a limit.
pub fn check(schema: &Value) -> Result<(), GrammarError> {
    match schema {
        Value::Object(map) => {
            for (k, v) in map {
                if DATA.contains(&k.as_str()) {
                    continue;
                }
                if k == "multipleOf"
                    && let Value::Number(n) = v
                {
                    let coef = coefficient(n);
                    if coef > MAX_MULTIPLE_OF {
                        return Err(GrammarError::Keyword {
                            keyword: "multipleOf",
                            value: v.to_string(),
                            limit: format!(
                                "at most {MAX_MULTIPLE_OF} as digits without the decimal point (it compiles one state per remainder)"
                            ),
                        });
                    }
                }
                check(v)?;
            }
            Ok(())
        }
        Value::Array(items) => items.iter().try_for_each(check),
        _ => Ok(()),
    }
}

/// The coefficient of `multipleOf` value `n` as the compiler reads it: an integer as itself
/// (1000 is 1000), a fraction as its digits without the point and without trailing zeros (0.25
/// is 25, 1.5e-3 is 15); `u64::MAX` for what does not fit.
fn coefficient(n: &serde_json::Number) -> u64 {
    let text = n.to_string();
    let text = text.trim_start_matches('-');
    let (mantissa, exp) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i64>().unwrap_or(i64::MAX)),
        None => (text, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut digits: String = format!("{int}{frac}").trim_start_matches('0').to_string();
    // The value is digits × 10^shift.
    let mut shift = exp.saturating_sub(frac.len() as i64);
    while shift < 0 && digits.ends_with('0') {
        digits.pop();
        shift += 1;
    }
    if digits.is_empty() {
        return 0;
    }
    let Ok(mut coef) = digits.parse::<u64>() else {
        return u64::MAX;
    };
    for _ in 0..shift.max(0) {
        coef = match coef.checked_mul(10) {
            Some(c) => c,
            None => return u64::MAX,
        };
    }
    coef
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_large_multiple_of_is_refused_by_name_wherever_it_is() {
        for ok in [
            json!({"multipleOf": 5}),
            json!({"multipleOf": 0.01}),
            json!({"multipleOf": 10000}),
        ] {
            check(&ok).unwrap();
        }
        let deep = json!({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "integer", "multipleOf": 999983}]}}});
        let e = check(&deep).unwrap_err();
        assert!(e.to_string().contains("multipleOf"), "{e}");
        assert!(e.to_string().contains("999983"), "{e}");
        // Its digits count, not its size: 0.00012345 is 12345, 1e6 is a million.
        assert!(check(&json!({"multipleOf": 0.00012345})).is_err());
        assert!(check(&json!({"multipleOf": 1e6})).is_err());
        check(&json!({"multipleOf": 0.0025})).unwrap();
        check(&json!({"multipleOf": 2.5e-3})).unwrap();
        assert_eq!(coefficient(&serde_json::Number::from_f64(0.07).unwrap()), 7);
        assert_eq!(coefficient(&serde_json::Number::from(1000)), 1000);
        assert_eq!(coefficient(&serde_json::Number::from_f64(12.50).unwrap()), 125);
        // A property named multipleOf, or data that says it, is no keyword.
        check(&json!({"properties": {"multipleOf": {"type": "integer"}}})).unwrap();
        check(&json!({"const": {"multipleOf": 999983}, "enum": [{"multipleOf": 999983}]})).unwrap();
    }
}
