//! TLS files: PEM certificates and private keys read with the error naming the file, and
//! private files written readable by their owner only. The API's TLS ([`crate::serve`]) and
//! the cluster's mutual TLS ([`crate::cluster`]) both read theirs here.

use std::io::Write;
use std::path::{Path, PathBuf};

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// TLS errors.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written. (The cause is in the message, not a `source`: a
    /// chain printed whole would say it twice.)
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// A PEM file could not be read as PEM.
    #[error("{path}: {error}")]
    PemSyntax {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        error: pem::Error,
    },
    /// A PEM file held no certificate or no key.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What was missing.
        what: &'static str,
    },
    /// Generating a certificate failed.
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the certificate or key.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// What turns an I/O error on `path` into a [`TlsError`] naming it.
pub fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |error| TlsError::Io {
        path: path.into(),
        error,
    }
}

/// The certificates of a PEM file, at least one.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = std::fs::read(path).map_err(io_err(path))?;
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<_, _>>()
            .map_err(|error| TlsError::PemSyntax {
                path: path.into(),
                error,
            })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.into(),
            what: "no certificate in the file",
        });
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = std::fs::read(path).map_err(io_err(path))?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|error| match error {
        pem::Error::NoItemsFound => TlsError::Pem {
            path: path.into(),
            what: "no private key in the file",
        },
        error => TlsError::PemSyntax {
            path: path.into(),
            error,
        },
    })
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
