//! TLS for `warden serve`: the configured certificate and key, or a self-signed certificate for
//! `localhost` generated in the data dir on first start (and reused afterwards). ALPN offers
//! HTTP/2 and HTTP/1.1.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use crate::config::TlsConfig;

/// The server's TLS settings and where its certificate came from.
pub struct TlsSetup {
    /// For the acceptor.
    pub config: Arc<ServerConfig>,
    /// The certificate file (clients that trust it point here).
    pub cert_path: PathBuf,
    /// SHA-256 of the leaf certificate (DER), colon-separated hex.
    pub fingerprint: String,
    /// Whether this start generated it.
    pub generated: bool,
}

/// TLS errors.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A PEM file held no certificate or no key.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What was missing.
        what: &'static str,
    },
    /// Generating the certificate failed.
    #[error("generating a self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the certificate or key.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.into(),
        source,
    }
}

/// Writes `bytes` to `path` readable by its owner only.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Loads the configured certificate, or the generated one in `data_dir/tls`, generating it if
/// absent.
pub fn setup(cfg: &TlsConfig, data_dir: &Path) -> Result<TlsSetup, TlsError> {
    let (cert_path, key_path, generated) = match (&cfg.cert, &cfg.key) {
        (Some(c), Some(k)) => (c.clone(), k.clone(), false),
        _ => {
            let dir = data_dir.join("tls");
            let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
            let generated = !(c.exists() && k.exists());
            if generated {
                std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
                let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])?;
                write_private(&k, ck.key_pair.serialize_pem().as_bytes()).map_err(io_err(&k))?;
                std::fs::write(&c, ck.cert.pem()).map_err(io_err(&c))?;
            }
            (c, k, generated)
        }
    };
    let cert_pem = std::fs::read(&cert_path).map_err(io_err(&cert_path))?;
    let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut &cert_pem[..])
        .collect::<Result<_, _>>()
        .map_err(io_err(&cert_path))?;
    let leaf = certs.first().ok_or(TlsError::Pem {
        path: cert_path.clone(),
        what: "no certificate in the file",
    })?;
    let fingerprint = Sha256::digest(leaf.as_ref())
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":");
    let key_pem = std::fs::read(&key_path).map_err(io_err(&key_path))?;
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut &key_pem[..])
        .map_err(io_err(&key_path))?
        .ok_or(TlsError::Pem {
            path: key_path.clone(),
            what: "no private key in the file",
        })?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsSetup {
        config: Arc::new(config),
        cert_path,
        fingerprint,
        generated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_once_then_reuses_and_keeps_the_key_private() {
        let dir = std::env::temp_dir().join(format!("warden-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a = setup(&TlsConfig::default(), &dir).unwrap();
        assert!(a.generated && a.cert_path.exists());
        assert_eq!(a.fingerprint.len(), 32 * 3 - 1);
        let b = setup(&TlsConfig::default(), &dir).unwrap();
        assert!(!b.generated);
        assert_eq!(a.fingerprint, b.fingerprint);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("tls/key.pem")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_files_name_the_file() {
        let dir = std::env::temp_dir().join(format!("warden-tls-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not pem").unwrap();
        let cfg = TlsConfig {
            cert: Some(junk.clone()),
            key: Some(junk.clone()),
        };
        let e = setup(&cfg, &dir).err().unwrap().to_string();
        assert!(e.contains("junk.pem") && e.contains("no certificate"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
