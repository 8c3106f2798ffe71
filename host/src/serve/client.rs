//! A small HTTPS client over hyper and rustls, trusting one given certificate: the CLI reaches a
//! running server's admin API with it, and the end-to-end tests talk to the server with it. One
//! connection per request.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

/// What went wrong reaching the server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URL is not `https://host:port` or `http://host:port`.
    #[error("unsupported URL {0:?} (expected https://host:port or http://host:port)")]
    Url(String),
    /// An https URL without a certificate to trust.
    #[error("an https URL needs the certificate to trust")]
    NoCertificate,
    /// The certificate file could not be read.
    #[error("the certificate to trust")]
    Certificate(#[from] crate::pem::TlsError),
    /// TLS refused the certificate or the connection.
    #[error("TLS")]
    Tls(#[from] rustls::Error),
    /// The host is not a name TLS can check.
    #[error("{0:?} is not a valid server name")]
    ServerName(String),
    /// The TCP connection or the TLS handshake failed.
    #[error("connecting to {0}")]
    Connect(String, #[source] std::io::Error),
    /// The request could not be built.
    #[error("building the request")]
    Request(#[from] hyper::http::Error),
    /// HTTP failed on the connection.
    #[error("HTTP")]
    Http(#[from] hyper::Error),
    /// The reply is not JSON.
    #[error("reply is not JSON: {0:?}")]
    NotJson(String, #[source] serde_json::Error),
}

/// HTTP version to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    /// HTTP/1.1.
    Http1,
    /// HTTP/2 (ALPN `h2`).
    Http2,
}

/// A client for one server.
#[derive(Clone)]
pub struct Client {
    host: String,
    port: u16,
    tls: Option<Arc<rustls::ClientConfig>>,
    /// Headers every request carries beyond the client's own.
    headers: Vec<(String, String)>,
}

/// A whole reply.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Headers.
    pub headers: hyper::HeaderMap,
    /// Body.
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON.
    pub fn json(&self) -> Result<serde_json::Value, ClientError> {
        serde_json::from_slice(&self.body).map_err(|e| ClientError::NotJson(self.text(), e))
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Client {
    /// A client for `url` (`https://host:port` or `http://host:port`); for https, `ca_cert` is
    /// the PEM certificate to trust.
    pub fn new(url: &str, ca_cert: Option<&Path>) -> Result<Self, ClientError> {
        Self::with_trust(url, ca_cert, |certs| {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs {
                roots.add(c)?;
            }
            Ok(Arc::new(
                rustls::ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()?
                    .with_root_certificates(roots)
                    .with_no_client_auth(),
            ))
        })
    }

    /// A client for `url` that trusts exactly the certificate the server serves from
    /// `cert_file` (its first, the server's own), whatever names it carries and whoever issued
    /// it: how the CLI reaches the server of its own data dir, on a loopback address that an
    /// operator's certificate (issued for the server's public name) does not name, and without
    /// the operator's CA. The server reloads its certificate from the same file, so the CLI
    /// trusts what the server serves now.
    pub fn pinned(url: &str, cert_file: &Path) -> Result<Self, ClientError> {
        Self::with_trust(url, Some(cert_file), |mut certs| {
            let pin = Arc::new(Pinned {
                leaf: certs.swap_remove(0),
                provider: provider(),
            });
            Ok(Arc::new(
                rustls::ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()?
                    .dangerous()
                    .with_custom_certificate_verifier(pin)
                    .with_no_client_auth(),
            ))
        })
    }

    /// A client for `url`; for https, the TLS configuration `trust` makes of the certificates
    /// in `ca_cert` (at least one: [`crate::pem::read_certs`]).
    fn with_trust(
        url: &str,
        ca_cert: Option<&Path>,
        trust: impl FnOnce(Vec<CertificateDer<'static>>) -> Result<Arc<rustls::ClientConfig>, ClientError>,
    ) -> Result<Self, ClientError> {
        let bad_url = || ClientError::Url(url.into());
        let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(bad_url());
        };
        let hostport = rest.trim_end_matches('/');
        let (host, port) = hostport.rsplit_once(':').ok_or_else(bad_url)?;
        let port: u16 = port.parse().map_err(|_| bad_url())?;
        let tls = match tls {
            true => Some(trust(crate::pem::read_certs(
                ca_cert.ok_or(ClientError::NoCertificate)?,
            )?)?),
            false => None,
        };
        Ok(Self {
            host: host.to_string(),
            port,
            tls,
            headers: Vec::new(),
        })
    }

    /// The same client, every request it sends carrying header `name: value` too.
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Sends one request and returns the response with its body unread (for streams).
    pub async fn send(
        &self,
        proto: Proto,
        method: Method,
        path: &str,
        bearer: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Result<Response<Incoming>, ClientError> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| self.unreachable(e))?;
        let mut b = Request::builder()
            .method(method)
            .uri(format!("https://{}:{}{path}", self.host, self.port))
            .header("content-type", "application/json");
        if proto == Proto::Http1 {
            b = b.header("host", format!("{}:{}", self.host, self.port));
        }
        if let Some(t) = bearer {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        for (name, value) in &self.headers {
            b = b.header(name.as_str(), value.as_str());
        }
        let req = b.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        match &self.tls {
            Some(cfg) => {
                let mut cfg = (**cfg).clone();
                cfg.alpn_protocols = vec![match proto {
                    Proto::Http1 => b"http/1.1".to_vec(),
                    Proto::Http2 => b"h2".to_vec(),
                }];
                let stream = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                    .connect(self.server_name()?, tcp)
                    .await
                    .map_err(|e| self.unreachable(e))?;
                send_on(proto, TokioIo::new(stream), req).await
            }
            None => send_on(proto, TokioIo::new(tcp), req).await,
        }
    }

    /// Opens a connection (TLS handshake included) and sends nothing: a slow or idle client.
    pub async fn connect_idle(&self) -> Result<IdleConnection, ClientError> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| self.unreachable(e))?;
        let stream: Box<dyn IdleStream> = match &self.tls {
            Some(cfg) => Box::new(
                tokio_rustls::TlsConnector::from(cfg.clone())
                    .connect(self.server_name()?, tcp)
                    .await
                    .map_err(|e| self.unreachable(e))?,
            ),
            None => Box::new(tcp),
        };
        Ok(IdleConnection { stream })
    }

    /// Sends one request and reads the whole reply.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        bearer: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Result<Reply, ClientError> {
        self.request_proto(Proto::Http1, method, path, bearer, body).await
    }

    /// Sends one request over `proto` and reads the whole reply.
    pub async fn request_proto(
        &self,
        proto: Proto,
        method: Method,
        path: &str,
        bearer: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Result<Reply, ClientError> {
        let r = self.send(proto, method, path, bearer, body).await?;
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.into_body().collect().await?.to_bytes();
        Ok(Reply { status, headers, body })
    }

    fn unreachable(&self, e: std::io::Error) -> ClientError {
        ClientError::Connect(format!("{}:{}", self.host, self.port), e)
    }

    fn server_name(&self) -> Result<ServerName<'static>, ClientError> {
        ServerName::try_from(self.host.clone()).map_err(|_| ClientError::ServerName(self.host.clone()))
    }
}

async fn send_on<IO>(proto: Proto, io: IO, req: Request<Full<Bytes>>) -> Result<Response<Incoming>, ClientError>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    match proto {
        Proto::Http1 => {
            let (mut s, conn) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(conn);
            Ok(s.send_request(req).await?)
        }
        Proto::Http2 => {
            let (mut s, conn) = hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            Ok(s.send_request(req).await?)
        }
    }
}

trait IdleStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> IdleStream for T {}

/// A connection that sends nothing (see [`Client::connect_idle`]).
pub struct IdleConnection {
    stream: Box<dyn IdleStream>,
}

impl IdleConnection {
    /// Whether the server still holds it open (a read would block rather than see the end).
    pub fn is_open(&mut self) -> bool {
        use std::task::{Context, Poll};
        use tokio::io::{AsyncRead, ReadBuf};
        let mut byte = [0u8; 1];
        let mut buf = ReadBuf::new(&mut byte);
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        match std::pin::Pin::new(&mut self.stream).poll_read(&mut cx, &mut buf) {
            Poll::Pending => true,
            Poll::Ready(Ok(())) => !buf.filled().is_empty(),
            Poll::Ready(Err(_)) => false,
        }
    }
}

/// The crypto the clients use.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Trusts one certificate, byte for byte (see [`Client::pinned`]); the handshake's signatures
/// are still checked against it.
#[derive(Debug)]
struct Pinned {
    leaf: CertificateDer<'static>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.leaf.as_ref() {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "the server's certificate is not the one in its certificate file".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}
