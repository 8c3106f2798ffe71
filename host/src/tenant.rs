//! Tenants' names and ids: what an operator may call a tenant (the store, the policy files and
//! the metrics' labels all take names, so the rule lives below all three), and the id every
//! layer from the engine up names a tenant by ([`TenantId`], the one the KV tags record).

pub use warden_kernels::tag::TenantId;

/// Whether `name` is a valid tenant name: 1 to 63 bytes of lowercase ASCII letters, digits, `-`
/// and `_`, starting with a letter or digit.
pub fn valid_tenant_name(name: &str) -> bool {
    let b = name.as_bytes();
    (1..=63).contains(&b.len())
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'_')
}
