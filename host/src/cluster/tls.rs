//! The cluster's mutual TLS: every connection between a router and its nodes, and between
//! nodes, authenticates both ends with certificates from the cluster's CA (`[cluster] ca`,
//! `cert`, `key`). A node's acceptor requires a client certificate that chains to the CA, so
//! a peer without one, or with a foreign one, fails the handshake before any message is read.
//! Both sides speak TLS 1.3 only. Both sides' certificates must also be valid for the name
//! [`CLUSTER_NAME`] (a server's as the client checks it, a client's right after the handshake):
//! membership is a certificate the cluster's CA issued for the cluster, whatever address a node
//! has, so a CA that also signs other workloads' certificates does not make them members.
//!
//! [`make_certs`] makes a CA and node certificates for a first setup (`warden cluster certs`).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::pem::{TlsError, io_err, read_certs, read_key, write_private};

/// The name every cluster certificate is valid for, and the name a connecting side checks.
pub const CLUSTER_NAME: &str = "warden-cluster";

/// The cluster CA's distinguished name (the same each time, so a CA read back from its key
/// signs certificates that chain to the one on disk).
const CA_NAME: &str = "Warden cluster CA";

/// A process's side of the cluster's mutual TLS.
pub struct ClusterTls {
    connector: TlsConnector,
    acceptor: TlsAcceptor,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl ClusterTls {
    /// Reads the CA, this process's certificate chain and key; errors name the file.
    pub fn load(ca: &Path, cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let mut roots = RootCertStore::empty();
        for c in read_certs(ca)? {
            roots.add(c)?;
        }
        let roots = Arc::new(roots);
        let chain = read_certs(cert)?;
        let key = read_key(key)?;
        let tls13 = &[&rustls::version::TLS13];
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| TlsError::Rustls(rustls::Error::General(e.to_string())))?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(tls13)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(tls13)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
        Ok(Self {
            connector: TlsConnector::from(Arc::new(client)),
            acceptor: TlsAcceptor::from(Arc::new(server)),
        })
    }

    /// The client side of a handshake on `tcp`, within `limit`.
    pub async fn connect(
        &self,
        tcp: TcpStream,
        limit: Duration,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let name = ServerName::try_from(CLUSTER_NAME).map_err(std::io::Error::other)?;
        tokio::time::timeout(limit, self.connector.connect(name, tcp))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "the TLS handshake timed out"))?
    }

    /// The server side of a handshake on `tcp`, within `limit`: an error for a peer without a
    /// certificate the CA signed.
    pub async fn accept(
        &self,
        tcp: TcpStream,
        limit: Duration,
    ) -> std::io::Result<tokio_rustls::server::TlsStream<TcpStream>> {
        let tls = tokio::time::timeout(limit, self.acceptor.accept(tcp))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "the TLS handshake timed out"))??;
        // The chain was verified in the handshake; the name must be the cluster's.
        let leaf = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .ok_or_else(|| std::io::Error::other("no client certificate"))?;
        let name = ServerName::try_from(CLUSTER_NAME).map_err(std::io::Error::other)?;
        webpki::EndEntityCert::try_from(leaf)
            .and_then(|c| c.verify_is_valid_for_subject_name(&name))
            .map_err(|e| std::io::Error::other(format!("the client certificate is not one for {CLUSTER_NAME}: {e}")))?;
        Ok(tls)
    }
}

/// What [`make_certs`] wrote.
#[derive(Debug)]
pub struct MadeCerts {
    /// Whether the CA was made now (else an existing one in the directory signed).
    pub new_ca: bool,
    /// The certificate files made, one per name.
    pub certs: Vec<std::path::PathBuf>,
}

/// Makes, in `dir`, a cluster CA (`ca.pem`, `ca.key`; an existing pair there is used instead)
/// and, for each `(name, extra)`, `name.pem` and `name.key`: a certificate the CA signs, for
/// server and client use, valid for [`CLUSTER_NAME`], `name` and each of `extra` (host names or
/// IP addresses). Keys are written readable by their owner only. Certificates are valid from a
/// year ago for five years.
pub fn make_certs(dir: &Path, nodes: &[(String, Vec<String>)]) -> Result<MadeCerts, TlsError> {
    use rcgen::KeyPair;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let (ca_pem, ca_key_pem) = (dir.join("ca.pem"), dir.join("ca.key"));
    let existing = ca_pem.exists() && ca_key_pem.exists();
    // Half a CA is never replaced: the certificates it signed would stop chaining.
    if ca_pem.exists() != ca_key_pem.exists() {
        return Err(TlsError::Pem {
            path: if ca_pem.exists() { ca_key_pem } else { ca_pem },
            what: "missing while the rest of the CA is there: put it back to sign with that CA (a new CA would orphan every certificate it signed)",
        });
    }
    let ca_key = if existing {
        let pem = std::fs::read_to_string(&ca_key_pem).map_err(io_err(&ca_key_pem))?;
        KeyPair::from_pem(&pem)?
    } else {
        KeyPair::generate()?
    };
    let ca = ca_params()?.self_signed(&ca_key)?;
    if !existing {
        write_private(&ca_key_pem, ca_key.serialize_pem().as_bytes()).map_err(io_err(&ca_key_pem))?;
        std::fs::write(&ca_pem, ca.pem()).map_err(io_err(&ca_pem))?;
    }
    let mut certs = Vec::new();
    for (name, extra) in nodes {
        let mut names = vec![CLUSTER_NAME.to_string(), name.clone()];
        names.extend(extra.iter().cloned());
        let key = KeyPair::generate()?;
        let cert = leaf_params(name, names)?.signed_by(&key, &ca, &ca_key)?;
        if existing {
            chains_to(&ca_pem, cert.der())?;
        }
        let (c, k) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        write_private(&k, key.serialize_pem().as_bytes()).map_err(io_err(&k))?;
        std::fs::write(&c, cert.pem()).map_err(io_err(&c))?;
        certs.push(c);
    }
    Ok(MadeCerts {
        new_ca: !existing,
        certs,
    })
}

/// Valid from the start of last year for five years.
fn validity(p: &mut rcgen::CertificateParams) {
    let year = 1970
        + (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            / 31_556_952) as i32;
    p.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    p.not_after = rcgen::date_time_ymd(year + 5, 1, 1);
}

/// The cluster CA's parameters: the same each time, so a CA made again from its key signs
/// certificates that chain to its `ca.pem`.
fn ca_params() -> Result<rcgen::CertificateParams, rcgen::Error> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyUsagePurpose};
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name.push(DnType::CommonName, CA_NAME);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut p);
    Ok(p)
}

/// A node's certificate's parameters: common name `cn`, valid for `names`, for server and
/// client use.
fn leaf_params(cn: &str, names: Vec<String>) -> Result<rcgen::CertificateParams, rcgen::Error> {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyUsagePurpose};
    let mut p = CertificateParams::new(names)?;
    p.distinguished_name.push(DnType::CommonName, cn);
    p.is_ca = IsCa::NoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    validity(&mut p);
    Ok(p)
}

/// Whether `leaf` chains to the CA in `ca_pem`, for [`CLUSTER_NAME`]: a `ca.key` that is not
/// `ca.pem`'s signs certificates that do not.
fn chains_to(ca_pem: &Path, leaf: &rustls::pki_types::CertificateDer<'_>) -> Result<(), TlsError> {
    let general = |e: String| TlsError::Rustls(rustls::Error::General(e));
    let mut roots = RootCertStore::empty();
    for c in read_certs(ca_pem)? {
        roots.add(c)?;
    }
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| general(e.to_string()))?;
    let name = ServerName::try_from(CLUSTER_NAME).map_err(|e| general(e.to_string()))?;
    rustls::client::danger::ServerCertVerifier::verify_server_cert(
        verifier.as_ref(),
        leaf,
        &[],
        &name,
        &[],
        rustls::pki_types::UnixTime::now(),
    )
    .map(|_| ())
    .map_err(|_| TlsError::Pem {
        path: ca_pem.with_file_name("ca.key"),
        what: "not the key of ca.pem: the certificates it signs would not chain to it",
    })
}

/// A name `make_certs` can write files for: letters, digits, `-`, `_` and `.`, not starting
/// with `.`, at most 64.
pub fn valid_cert_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// Sets a link socket up: no Nagle delay; keep-alive probes each second once idle a second, and
/// dropped after `peer_timeout` of unanswered probes or unacknowledged data, so a peer behind a
/// cut link fails its connections instead of stalling them.
pub fn tune(tcp: &TcpStream, peer_timeout: Duration) {
    let _ = tcp.set_nodelay(true);
    let sock = socket2::SockRef::from(tcp);
    let probes = peer_timeout.as_secs().clamp(1, 60) as u32;
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(1))
        .with_interval(Duration::from_secs(1))
        .with_retries(probes);
    let _ = sock.set_tcp_keepalive(&keepalive);
    let _ = sock.set_tcp_user_timeout(Some(peer_timeout));
}

/// Whether `peer` may speak to a node without TLS: loopback only.
pub fn plain_allowed(peer: SocketAddr) -> bool {
    peer.ip().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("warden-ctls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// A server under one CA, and clients under it, under another, under it but not for the
    /// cluster's name, and with no certificate: only the first two get a byte through; the
    /// others are refused before the server reads anything.
    #[test]
    fn only_peers_with_the_clusters_certificates_get_through() {
        let (a, b) = (dir("a"), dir("b"));
        let made = make_certs(
            &a,
            &[("node".into(), vec!["10.1.2.3".into()]), ("router".into(), vec![])],
        )
        .unwrap();
        assert!(made.new_ca && made.certs.len() == 2);
        make_certs(&b, &[("intruder".into(), vec![])]).unwrap();
        // A second run with the CA there reuses it: its new certificate chains to the same CA.
        let again = make_certs(&a, &[("late".into(), vec![])]).unwrap();
        assert!(!again.new_ca);
        let key_mode =
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(a.join("node.key")).unwrap().permissions());
        assert_eq!(key_mode & 0o777, 0o600);
        // The CA's key, signing a certificate not for the cluster's name (another workload's).
        let ca_key = rcgen::KeyPair::from_pem(&std::fs::read_to_string(a.join("ca.key")).unwrap()).unwrap();
        let ca = ca_params().unwrap().self_signed(&ca_key).unwrap();
        let rogue_key = rcgen::KeyPair::generate().unwrap();
        let rogue = leaf_params("web", vec!["web.example".into()])
            .unwrap()
            .signed_by(&rogue_key, &ca, &ca_key)
            .unwrap();
        std::fs::write(a.join("web.pem"), rogue.pem()).unwrap();
        std::fs::write(a.join("web.key"), rogue_key.serialize_pem()).unwrap();
        // Half a CA, or a key that is not the CA's, signs nothing.
        let half = dir("half");
        std::fs::create_dir_all(&half).unwrap();
        std::fs::copy(a.join("ca.pem"), half.join("ca.pem")).unwrap();
        let e = make_certs(&half, &[("x".into(), vec![])]).unwrap_err().to_string();
        assert!(e.contains("ca.key") && e.contains("missing"), "{e}");
        std::fs::copy(b.join("ca.key"), half.join("ca.key")).unwrap();
        let e = make_certs(&half, &[("x".into(), vec![])]).unwrap_err().to_string();
        assert!(e.contains("not the key of ca.pem"), "{e}");
        assert!(!half.join("x.pem").exists());
        let _ = std::fs::remove_dir_all(&half);
        let load = |d: &Path, n: &str, ca: &Path| {
            ClusterTls::load(
                &ca.join("ca.pem"),
                &d.join(format!("{n}.pem")),
                &d.join(format!("{n}.key")),
            )
            .unwrap()
        };
        let server = Arc::new(load(&a, "node", &a));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let s = server.clone();
            let accepted = tokio::spawn(async move {
                let mut outcomes = Vec::new();
                for _ in 0..5 {
                    let (tcp, _) = listener.accept().await.unwrap();
                    outcomes.push(match s.accept(tcp, Duration::from_secs(5)).await {
                        Ok(mut t) => {
                            let mut b = [0u8; 5];
                            t.read_exact(&mut b)
                                .await
                                .map(|_| b.to_vec())
                                .map_err(|e| e.to_string())
                        }
                        Err(e) => Err(e.to_string()),
                    });
                }
                outcomes
            });
            let limit = Duration::from_secs(5);
            for (d, n) in [(&a, "router"), (&a, "late"), (&b, "intruder"), (&a, "web")] {
                let c = load(d, n, &a);
                let tcp = TcpStream::connect(addr).await.unwrap();
                if let Ok(mut t) = c.connect(tcp, limit).await {
                    let _ = t.write_all(b"hello").await;
                    let _ = t.flush().await;
                }
            }
            // No certificate at all: a plain TLS client trusting the CA.
            let mut roots = RootCertStore::empty();
            roots.add(read_certs(&a.join("ca.pem")).unwrap().remove(0)).unwrap();
            let anon = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
            let tcp = TcpStream::connect(addr).await.unwrap();
            let name = ServerName::try_from(CLUSTER_NAME).unwrap();
            if let Ok(mut t) = TlsConnector::from(Arc::new(anon)).connect(name, tcp).await {
                let _ = t.write_all(b"hello").await;
                let _ = t.flush().await;
            }
            let outcomes = accepted.await.unwrap();
            assert_eq!(outcomes[0].as_deref(), Ok(&b"hello"[..]), "{outcomes:?}");
            assert_eq!(outcomes[1].as_deref(), Ok(&b"hello"[..]), "{outcomes:?}");
            assert!(outcomes[2..].iter().all(|o| o.is_err()), "{outcomes:?}");
            assert!(
                outcomes[3].as_ref().is_err_and(|e| e.contains(CLUSTER_NAME)),
                "{outcomes:?}"
            );
        });
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }
}
