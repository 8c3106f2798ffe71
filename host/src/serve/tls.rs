//! TLS for `warden serve`: the configured certificate and key, or a self-signed certificate for
//! `localhost` generated in the data dir on first start (and reused afterwards). ALPN offers
//! HTTP/2 and HTTP/1.1. The pair is reloaded on SIGHUP and when its files change
//! ([`Certificates::reload`]), for new connections; open ones keep theirs.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use rustls::ServerConfig;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
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
    /// What the acceptor serves; reloaded on SIGHUP and when the files change.
    pub certificates: Arc<Certificates>,
}

pub use crate::pem::{TlsError, write_private};
use crate::pem::{io_err, read_certs, read_key};

/// Loads the configured certificate, or the generated one in `data_dir/tls`, generating it if
/// absent. The acceptor's certificate is [`Certificates`]: it may be reloaded while serving.
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
    let (key, fingerprint) = read_pair(&cert_path, &key_path)?;
    let certificates = Arc::new(Certificates {
        current: RwLock::new(key),
        stamp: Mutex::new(stamp(&cert_path, &key_path)),
        cert_path: cert_path.clone(),
        key_path,
    });
    let mut config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(certificates.clone());
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsSetup {
        config: Arc::new(config),
        cert_path,
        fingerprint,
        generated,
        certificates,
    })
}

/// The certificate and key at these paths, checked to belong together, and the leaf's
/// fingerprint.
fn read_pair(cert_path: &Path, key_path: &Path) -> Result<(Arc<CertifiedKey>, String), TlsError> {
    let certs = read_certs(cert_path)?;
    let fingerprint = Sha256::digest(certs[0].as_ref())
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":");
    let key = read_key(key_path)?;
    let signer = rustls::crypto::ring::default_provider()
        .key_provider
        .load_private_key(key)?;
    let pair = CertifiedKey::new(certs, signer);
    pair.keys_match()?;
    Ok((Arc::new(pair), fingerprint))
}

/// When the two files last changed, and their sizes: what says they were replaced.
type Stamp = Option<(SystemTime, u64, SystemTime, u64)>;

fn stamp(cert_path: &Path, key_path: &Path) -> Stamp {
    let of = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())))
    };
    let ((ct, cl), (kt, kl)) = (of(cert_path)?, of(key_path)?);
    Some((ct, cl, kt, kl))
}

/// The certificate new TLS handshakes get. [`reload`](Self::reload) swaps in the files' current
/// pair; connections already open keep theirs.
#[derive(Debug)]
pub struct Certificates {
    current: RwLock<Arc<CertifiedKey>>,
    stamp: Mutex<Stamp>,
    cert_path: PathBuf,
    key_path: PathBuf,
}

impl Certificates {
    /// Reads the pair again, when `force` or when either file changed since it was last read:
    /// the new leaf's fingerprint when it took effect, `None` when nothing changed. A pair that
    /// does not load (half written, or a key that is not the certificate's) is an error and
    /// the pair in force stays.
    pub fn reload(&self, force: bool) -> Result<Option<String>, TlsError> {
        let now = stamp(&self.cert_path, &self.key_path);
        let mut seen = self.stamp.lock().unwrap_or_else(|p| p.into_inner());
        if !force && now == *seen {
            return Ok(None);
        }
        // Remembered only once it loads: a pair that failed is tried again at the next check.
        let (pair, fingerprint) = read_pair(&self.cert_path, &self.key_path)?;
        *seen = now;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = pair;
        Ok(Some(fingerprint))
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
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
    fn a_replaced_pair_is_reloaded_and_a_mismatched_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("warden-tls-reload-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let t = setup(&TlsConfig::default(), &dir).unwrap();
        let serving = || {
            let leaf = t.certificates.current.read().unwrap().cert[0].clone();
            Sha256::digest(leaf.as_ref())
                .iter()
                .map(|b| format!("{b:02X}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        assert_eq!(serving(), t.fingerprint);
        assert_eq!(t.certificates.reload(false).unwrap(), None, "nothing changed");
        let (cert, key) = (dir.join("tls/cert.pem"), dir.join("tls/key.pem"));
        let next = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        std::fs::write(&cert, next.cert.pem()).unwrap();
        // The certificate is new and the key is not yet: refused, the old pair stays.
        let e = t.certificates.reload(false).unwrap_err();
        assert!(matches!(e, TlsError::Rustls(_)), "{e}");
        assert_eq!(serving(), t.fingerprint);
        write_private(&key, next.key_pair.serialize_pem().as_bytes()).unwrap();
        let fp = t.certificates.reload(false).unwrap().expect("reloaded");
        assert_ne!(fp, t.fingerprint);
        assert_eq!(serving(), fp);
        assert_eq!(t.certificates.reload(true).unwrap(), Some(fp), "SIGHUP reads it again");
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
