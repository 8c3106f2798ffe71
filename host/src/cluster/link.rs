//! The messages nodes and the router exchange, their framing on a connection, and how
//! connections are made ([`Transport`]: plain TCP on loopback, or mutual TLS on any address).
//!
//! A packet is a kind byte, then either a JSON [`Msg`] (a little-endian `u32` length and the
//! text) or a transfer [`Frame`] in its own bounded encoding ([`crate::transfer::wire`]). Every
//! length is checked against a limit before anything is read or allocated: a message against
//! [`MAX_MSG_BYTES`], a frame against the limit the reader was started with (0 where no frame
//! belongs, so a frame there is refused unread).
//!
//! Every connection opens with [`Msg::Hello`] naming [`VERSION`]; then the opener's one request
//! ([`Msg::Describe`], [`Msg::Generate`], [`Msg::Prefill`] or a control message) and whatever
//! that request's exchange needs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::NodeInfo;
use super::tls::{ClusterTls, plain_allowed, tune};
use crate::config::{ClusterConfig, NodeAddr};
use crate::engine::request::{FinishReason, GenerateRequest, RejectReason, RequestId, Usage};
use crate::engine::steer::{SteerInit, TokenConstraint};
use crate::engine::{TenantSettings, TokenLogprobs};
use crate::grammar::Format;
use crate::kv::{PageHandle, PageInfo};
use crate::pem::TlsError;
use crate::plugin::KvAccessError;
use crate::tenant::TenantId;
use crate::transfer::Limits;
use crate::transfer::wire::{Frame, WireError};

/// The protocol's version; a peer that speaks another is refused.
pub const VERSION: u32 = 3;

/// Largest JSON message, in bytes (a prompt of the longest context is far less).
pub const MAX_MSG_BYTES: usize = 16 << 20;

const KIND_MSG: u8 = b'M';
const KIND_FRAME: u8 = b'F';

/// A request as the router dispatches it, and as a decode node passes it to a prefill node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Dispatch {
    /// The request (its owner is the tenant's id).
    pub req: GenerateRequest,
    /// What its output must match (`response_format`, or required tool calls), as the router
    /// checked it: the decode node compiles it against its own vocabulary.
    pub format: Format,
    /// How its plugin steers it, when it does: each token then waits for the verdict the router
    /// relays ([`Msg::Verdict`]).
    pub steer: Option<SteerInit>,
    /// The tenant's policy as the engine enforces it.
    pub settings: TenantSettings,
    /// The policy generation `settings` came from.
    pub generation: u64,
    /// The prefill node to compute the prompt on.
    pub prefill: NodeAddr,
    /// What the router's nodes agreed to serve; a node serving anything else refuses.
    pub agreed: super::Agreement,
    /// The transfer's bounds.
    pub limits: Limits,
    /// A fault for the prefill node to inject into this transfer (`transfer-faults` builds only).
    #[cfg(feature = "transfer-faults")]
    #[serde(default)]
    pub fault: Option<Fault>,
}

/// What a prefill node does wrong to a transfer's first batch.
#[cfg(feature = "transfer-faults")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Never sends it.
    Drop,
    /// Sends half of it and closes the connection.
    Truncate,
    /// Changes a K value of its first page, keeping the checksum.
    Corrupt,
    /// Sends it twice.
    Duplicate,
    /// Sends it after the frame that follows it.
    Reorder,
    /// Sends it 200 ms late (the transfer still succeeds).
    Delay,
    /// Tags it with another tenant.
    Retag,
}

#[cfg(feature = "transfer-faults")]
impl Fault {
    pub(super) fn parse(s: &str) -> Option<Self> {
        serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
    }
}

/// How a request ended, as the decode node tells the router.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ended {
    /// It completed.
    Finished(FinishReason),
    /// The router (its client, or its plugin) cancelled it.
    Cancelled,
    /// The node shut down.
    Shutdown,
    /// Its prompt's KV did not arrive whole.
    Transfer(String),
    /// A tag check failed or the pool refused: the code and message the client sees.
    Failed {
        /// Stable code.
        code: String,
        /// Message.
        message: String,
    },
}

/// A plugin's question about its own request's KV, forwarded by the router. It names no
/// request and no tenant: the decode node answers for the connection's own request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCall {
    /// The page table.
    Pages,
    /// What the tenant may learn of a page.
    Info(PageHandle),
    /// Pin the first `n` tokens.
    Pin(usize),
    /// Unpin.
    Unpin,
}

/// The answer to a [`KvCall`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvReply {
    /// The page table, if the request is open.
    Pages(Option<Vec<PageHandle>>),
    /// A page's info.
    Info(Result<PageInfo, KvAccessError>),
    /// Tokens pinned or pages unpinned.
    Count(Result<usize, KvAccessError>),
}

/// A JSON message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// Opens every connection.
    Hello {
        /// [`VERSION`].
        version: u32,
    },
    /// Asks a node what it serves.
    Describe,
    /// Asks a node for its metrics (Prometheus text: its pool's pages by state, its requests).
    Metrics,
    /// A node's answer to `Metrics`.
    MetricsText {
        /// The exposition.
        text: String,
    },
    /// A node's answer to `Describe`.
    Info(NodeInfo),
    /// Router → decode node: serve this request.
    Generate(Box<Dispatch>),
    /// Decode node → prefill node: compute this prompt and send its KV on this connection.
    Prefill(Box<Dispatch>),
    /// Decode node → router: admitted, with the node's id for it.
    Opened {
        /// The request's id on the decode node.
        id: RequestId,
    },
    /// Decode node → router: admission refused it; nothing ran.
    Rejected {
        /// Why.
        reason: RejectReason,
    },
    /// Decode node → router: a generated token.
    Token {
        /// Its id.
        token: u32,
        /// The text now safe to send.
        text: String,
        /// When asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// Decode node → router: the last message of a request.
    Done {
        /// How it ended.
        ended: Ended,
        /// Held-back text released at the end.
        text: String,
        /// Token counts.
        usage: Usage,
    },
    /// Router → decode node: end the request now, as finished (`stop`) or cancelled.
    End {
        /// Finished rather than cancelled.
        stop: bool,
    },
    /// Router → decode node: the plugin's verdict on the oldest token it has not answered yet,
    /// and the constraint on the next token, if any (for a request dispatched with `steer`).
    Verdict {
        /// The next token's constraint.
        next: Option<TokenConstraint>,
    },
    /// Router → decode node: a plugin's KV question.
    Kv {
        /// The router's number for the call.
        call: u64,
        /// The question.
        query: KvCall,
    },
    /// Decode node → router: its answer.
    KvAnswer {
        /// The call answered.
        call: u64,
        /// The answer.
        answer: KvReply,
    },
    /// Router → node: a tenant's policy.
    Tenant {
        /// The tenant.
        owner: TenantId,
        /// What the engine enforces.
        settings: TenantSettings,
        /// Its policy generation.
        generation: u64,
    },
    /// Router → prefill node: the public prefixes.
    PublicPrefixes {
        /// Their tokens.
        prefixes: Vec<Vec<u32>>,
    },
    /// Router → node: a tenant was deleted.
    Forget {
        /// The tenant.
        owner: TenantId,
    },
    /// A node's answer to a control message.
    Applied {
        /// What went wrong, if anything.
        error: Option<String>,
    },
    /// The peer broke the protocol; the connection ends.
    Error {
        /// What was wrong.
        message: String,
    },
}

/// What arrives on a connection.
#[derive(Debug)]
pub enum Packet {
    /// A JSON message.
    Msg(Msg),
    /// A transfer frame.
    Frame(Frame),
}

/// Why a connection's bytes are not packets.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Reading failed, or the peer closed mid-packet.
    #[error("reading from the peer: {0}")]
    Io(#[from] std::io::Error),
    /// An unknown kind byte.
    #[error("unknown packet kind {0:#04x}")]
    Kind(u8),
    /// A message over [`MAX_MSG_BYTES`].
    #[error("a message of {0} bytes, over the limit of {MAX_MSG_BYTES}")]
    TooLarge(usize),
    /// A message that is not one.
    #[error("a malformed message: {0}")]
    Json(#[from] serde_json::Error),
    /// A frame over the limit or malformed.
    #[error("a bad transfer frame: {0}")]
    Frame(#[from] WireError),
}

/// Encodes a message as a packet.
pub fn encode_msg(m: &Msg) -> Vec<u8> {
    let body = serde_json::to_vec(m).expect("messages serialize");
    let mut out = Vec::with_capacity(body.len() + 5);
    out.push(KIND_MSG);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Encodes a transfer frame as a packet.
pub fn encode_frame(f: &Frame) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + f.encoded_len());
    out.push(KIND_FRAME);
    f.encode_into(&mut out);
    out
}

/// Writes a message (and flushes it: over TLS, a record may wait in the session otherwise).
pub async fn send<W: AsyncWrite + Unpin>(w: &mut W, m: &Msg) -> std::io::Result<()> {
    w.write_all(&encode_msg(m)).await?;
    w.flush().await
}

/// Writes a transfer frame (and flushes it).
pub async fn send_frame<W: AsyncWrite + Unpin>(w: &mut W, f: &Frame) -> std::io::Result<()> {
    w.write_all(&encode_frame(f)).await?;
    w.flush().await
}

/// Reads one packet; `None` when the peer closed between packets. Frames over `frame_limit`
/// bytes are refused before they are read.
pub async fn read<R: AsyncRead + Unpin>(r: &mut R, frame_limit: usize) -> Result<Option<Packet>, LinkError> {
    let mut kind = [0u8; 1];
    if r.read(&mut kind).await? == 0 {
        return Ok(None);
    }
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let n = u32::from_le_bytes(len) as usize;
    match kind[0] {
        KIND_MSG => {
            if n > MAX_MSG_BYTES {
                return Err(LinkError::TooLarge(n));
            }
            let mut body = vec![0u8; n];
            r.read_exact(&mut body).await?;
            Ok(Some(Packet::Msg(serde_json::from_slice(&body)?)))
        }
        KIND_FRAME => {
            if n > frame_limit {
                return Err(LinkError::Frame(WireError::TooLarge {
                    len: n,
                    limit: frame_limit,
                }));
            }
            let mut bytes = vec![0u8; 4 + n];
            bytes[..4].copy_from_slice(&len);
            r.read_exact(&mut bytes[4..]).await?;
            let (frame, _) = Frame::decode(&bytes, frame_limit)?;
            Ok(Some(Packet::Frame(frame)))
        }
        k => Err(LinkError::Kind(k)),
    }
}

/// What a reader task hands on: packets, then at most one error; the channel closes at the
/// end of the connection.
pub type Incoming = mpsc::Receiver<Result<Packet, LinkError>>;

/// Reads `r` on a task of its own (so a `select!` never loses half a packet), handing packets
/// on through a small channel: a slow consumer slows the peer through TCP.
pub fn reader(r: ReadHalf, frame_limit: usize) -> Incoming {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        let mut r = BufReader::with_capacity(64 << 10, r);
        loop {
            let p = read(&mut r, frame_limit).await;
            let end = !matches!(p, Ok(Some(_)));
            let item = match p {
                Ok(Some(p)) => Ok(p),
                Ok(None) => break,
                Err(e) => Err(e),
            };
            if tx.send(item).await.is_err() || end {
                break;
            }
        }
    });
    rx
}

/// A connection's reading half: plain TCP or TLS.
pub type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
/// A connection's writing half: plain TCP or TLS.
pub type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// How this process's cluster connections are made and taken: plain TCP, to and from loopback
/// addresses only; or mutual TLS under the cluster's CA, on any address. Either way every link
/// socket is [`tune`]d, so a peer behind a cut link is found dead within the peer timeout.
#[derive(Clone)]
pub struct Transport {
    tls: Option<Arc<ClusterTls>>,
    peer_timeout: Duration,
    /// Names' addresses as last resolved: see [`resolve`](Self::resolve).
    names: Arc<std::sync::Mutex<std::collections::HashMap<NodeAddr, Resolved>>>,
}

/// A name's addresses as last resolved, and whether a lookup of it is under way.
#[derive(Default)]
struct Resolved {
    at: Option<std::time::Instant>,
    addrs: Vec<SocketAddr>,
    looking: bool,
}

/// How long a name's addresses are used before they are looked up again.
const RESOLVED_FOR: Duration = Duration::from_secs(5);

/// How long a lookup may take before the last addresses are used instead.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest a node lets a peer's TLS handshake take (less where the peer timeout is less):
/// a silent connection does not hold a handshake slot long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

impl Transport {
    /// The transport `[cluster]` configures: mutual TLS when `ca`, `cert` and `key` are set.
    pub fn new(cluster: &ClusterConfig) -> Result<Self, TlsError> {
        let tls = match (&cluster.ca, &cluster.cert, &cluster.key) {
            (Some(ca), Some(cert), Some(key)) => Some(Arc::new(ClusterTls::load(ca, cert, key)?)),
            (None, None, None) => None,
            // Never plain TCP for a configuration that asked for mutual TLS.
            _ => {
                return Err(TlsError::Rustls(rustls::Error::General(
                    "cluster.ca, cluster.cert and cluster.key are set together or not at all".into(),
                )));
            }
        };
        Ok(Self {
            tls,
            peer_timeout: Duration::from_secs(cluster.peer_timeout_s.max(1)),
            names: Default::default(),
        })
    }

    /// Plain TCP on loopback, with the default peer timeout.
    pub fn plain() -> Self {
        Self {
            tls: None,
            peer_timeout: Duration::from_secs(ClusterConfig::default().peer_timeout_s),
            names: Default::default(),
        }
    }

    /// Mutual TLS with `tls`.
    pub fn mutual_tls(tls: ClusterTls, peer_timeout: Duration) -> Self {
        Self {
            tls: Some(Arc::new(tls)),
            peer_timeout,
            names: Default::default(),
        }
    }

    /// Whether connections are mutual TLS.
    pub fn is_mutual_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// How long a peer may stay silent where an answer is due, and connecting may take.
    pub fn peer_timeout(&self) -> Duration {
        self.peer_timeout
    }

    /// Connects to a node (its name resolved now; within the peer timeout, handshake included)
    /// and says hello. Without TLS, only to loopback addresses.
    pub async fn connect(&self, addr: &NodeAddr) -> std::io::Result<(ReadHalf, WriteHalf)> {
        let limit = self.peer_timeout;
        let tcp = tokio::time::timeout(limit, async {
            let mut ips = self.resolve(addr).await?;
            if self.tls.is_none() {
                ips.retain(|a| plain_allowed(*a));
                if ips.is_empty() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!("{addr} is not a loopback address and mutual TLS is off (cluster.ca, cert, key)"),
                    ));
                }
            }
            TcpStream::connect(&ips[..]).await
        })
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connecting timed out"))??;
        tune(&tcp, limit);
        let (r, mut w): (ReadHalf, WriteHalf) = match &self.tls {
            Some(tls) => {
                let (r, w) = tokio::io::split(tls.connect(tcp, limit).await?);
                (Box::new(r), Box::new(w))
            }
            None => {
                let (r, w) = tcp.into_split();
                (Box::new(r), Box::new(w))
            }
        };
        send(&mut w, &Msg::Hello { version: VERSION }).await?;
        Ok((r, w))
    }

    /// `addr`'s socket addresses. An IP address is itself; a name is looked up at most once
    /// every [`RESOLVED_FOR`], one lookup at a time, each within [`LOOKUP_TIMEOUT`]: while one is
    /// under way, or when one fails, the last addresses stand (a slow or lost DNS answer neither
    /// stalls connections nor piles up lookups).
    async fn resolve(&self, addr: &NodeAddr) -> std::io::Result<Vec<SocketAddr>> {
        if let Ok(ip) = addr.host().parse::<std::net::IpAddr>() {
            return Ok(vec![SocketAddr::new(ip, addr.port())]);
        }
        let last = {
            let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
            let r = names.entry(addr.clone()).or_default();
            if r.at.is_some_and(|t| t.elapsed() < RESOLVED_FOR) || r.looking {
                if r.addrs.is_empty() {
                    return Err(std::io::Error::other(format!(
                        "resolving {addr}: a lookup is under way"
                    )));
                }
                return Ok(r.addrs.clone());
            }
            r.looking = true;
            r.addrs.clone()
        };
        // Whatever ends this lookup (its answer, its timeout, or the caller giving up on it),
        // the name may be looked up again.
        struct Looking<'a>(
            &'a std::sync::Mutex<std::collections::HashMap<NodeAddr, Resolved>>,
            &'a NodeAddr,
        );
        impl Drop for Looking<'_> {
            fn drop(&mut self) {
                let mut names = self.0.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(r) = names.get_mut(self.1) {
                    r.looking = false;
                }
            }
        }
        let looking = Looking(&self.names, addr);
        let found = tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host((addr.host(), addr.port()))).await;
        drop(looking);
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        let r = names.entry(addr.clone()).or_default();
        match found {
            Ok(Ok(it)) => {
                let addrs: Vec<SocketAddr> = it.collect();
                if !addrs.is_empty() {
                    r.addrs = addrs.clone();
                    r.at = Some(std::time::Instant::now());
                    return Ok(addrs);
                }
                if last.is_empty() {
                    return Err(std::io::Error::other(format!("{addr}: the name has no addresses")));
                }
            }
            Ok(Err(e)) if last.is_empty() => return Err(e),
            Err(_) if last.is_empty() => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("resolving {addr} took over {} s", LOOKUP_TIMEOUT.as_secs()),
                ));
            }
            _ => {}
        }
        Ok(last)
    }

    /// Takes a connection a node accepted from `peer`: over mutual TLS, its handshake (an
    /// error for a peer whose certificate the CA did not sign, or that has none, before
    /// anything of it is read); else only from loopback.
    pub async fn accept(&self, tcp: TcpStream, peer: SocketAddr) -> std::io::Result<(ReadHalf, WriteHalf)> {
        tune(&tcp, self.peer_timeout);
        match &self.tls {
            Some(tls) => {
                let limit = self.peer_timeout.min(HANDSHAKE_TIMEOUT);
                let (r, w) = tokio::io::split(tls.accept(tcp, limit).await?);
                Ok((Box::new(r), Box::new(w)))
            }
            None if plain_allowed(peer) => {
                let (r, w) = tcp.into_split();
                Ok((Box::new(r), Box::new(w)))
            }
            None => Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "not a loopback address, and mutual TLS is off",
            )),
        }
    }

    /// Opens a connection to the node at `addr` and sends `m` on it.
    pub async fn open(&self, addr: &NodeAddr, m: &Msg) -> Result<(ReadHalf, WriteHalf), CallError> {
        let (r, mut w) = self.connect(addr).await.map_err(|cause| CallError::Connect {
            addr: addr.clone(),
            cause,
        })?;
        send(&mut w, m).await.map_err(|cause| CallError::Write {
            addr: addr.clone(),
            cause,
        })?;
        Ok((r, w))
    }

    /// One control exchange with a node: connect, send `m`, read its one answer.
    pub async fn call(&self, addr: &NodeAddr, m: &Msg) -> Result<Msg, CallError> {
        let (r, _w) = self.open(addr, m).await?;
        let mut r = BufReader::new(r);
        let Ok(answer) = tokio::time::timeout(self.peer_timeout, read(&mut r, 0)).await else {
            return Err(CallError::Silent(addr.clone()));
        };
        match answer {
            Ok(Some(Packet::Msg(Msg::Error { message }))) => Err(CallError::Refused {
                addr: addr.clone(),
                message,
            }),
            Ok(Some(Packet::Msg(m))) => Ok(m),
            Ok(Some(Packet::Frame(_))) => Err(CallError::Frame(addr.clone())),
            Ok(None) => Err(CallError::Closed(addr.clone())),
            Err(cause) => Err(CallError::Read {
                addr: addr.clone(),
                cause,
            }),
        }
    }
}

/// Why an exchange with a node failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The node could not be reached.
    #[error("connecting to {addr}: {cause}")]
    Connect {
        /// The node.
        addr: NodeAddr,
        /// Why (in the message, not a separate source: health reports and broadcasts show
        /// the message alone).
        cause: std::io::Error,
    },
    /// The question could not be written.
    #[error("writing to {addr}: {cause}")]
    Write {
        /// The node.
        addr: NodeAddr,
        /// Why.
        cause: std::io::Error,
    },
    /// The node answered with an error message.
    #[error("{addr} refused: {message}")]
    Refused {
        /// The node.
        addr: NodeAddr,
        /// What it said.
        message: String,
    },
    /// The node answered with a transfer frame, not a message.
    #[error("{0} answered with a transfer frame")]
    Frame(NodeAddr),
    /// The node did not answer within the peer timeout.
    #[error("{0} did not answer in time")]
    Silent(NodeAddr),
    /// The node closed the connection before answering.
    #[error("{0} closed the connection without an answer")]
    Closed(NodeAddr),
    /// The answer could not be read.
    #[error("{addr}: {cause}")]
    Read {
        /// The node.
        addr: NodeAddr,
        /// Why.
        cause: LinkError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn packets_round_trip_and_limits_hold_before_reading() {
        let m = Msg::Token {
            token: 7,
            text: "hi".into(),
            logprobs: None,
        };
        let f = Frame::Ack { seq: 3, number: 1 };
        let mut bytes = encode_msg(&m);
        bytes.extend(encode_frame(&f));
        let mut r = &bytes[..];
        assert!(matches!(
            read(&mut r, 1024).await,
            Ok(Some(Packet::Msg(Msg::Token { token: 7, .. })))
        ));
        assert!(matches!(
            read(&mut r, 1024).await,
            Ok(Some(Packet::Frame(Frame::Ack { seq: 3, number: 1 })))
        ));
        assert!(matches!(read(&mut r, 1024).await, Ok(None)));
        // A frame where none belongs is refused by its length alone.
        let bytes = encode_frame(&f);
        let mut r = &bytes[..];
        assert!(matches!(
            read(&mut r, 0).await,
            Err(LinkError::Frame(WireError::TooLarge { .. }))
        ));
        // A message claiming more than the limit is refused before its body is read.
        let mut bytes = vec![KIND_MSG];
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        let mut r = &bytes[..];
        assert!(matches!(read(&mut r, 0).await, Err(LinkError::TooLarge(_))));
        // Unknown kinds and truncated packets are errors, not silence.
        let mut r = &b"Z\0\0\0\0"[..];
        assert!(matches!(read(&mut r, 0).await, Err(LinkError::Kind(b'Z'))));
        let bytes = encode_msg(&m);
        let mut r = &bytes[..bytes.len() - 1];
        assert!(matches!(read(&mut r, 0).await, Err(LinkError::Io(_))));
    }

    /// The KV questions' wire shape is the protocol's ([`VERSION`]): a page handle is an object of
    /// page, epoch and public; an error is its message, and arrives as a remote error.
    #[test]
    fn kv_calls_keep_their_wire_shape() {
        let h = crate::kv::PageHandle::for_test(5, 9);
        let call = serde_json::to_value(KvCall::Info(h)).expect("serializes");
        assert_eq!(
            call,
            serde_json::json!({"info": {"page": 5, "epoch": 9, "public": false}})
        );
        let back: KvCall = serde_json::from_value(call).expect("reads back");
        assert!(matches!(back, KvCall::Info(b) if b == h));
        let refused = KvReply::Count(Err(KvAccessError::Busy));
        let v = serde_json::to_value(&refused).expect("serializes");
        assert_eq!(
            v,
            serde_json::json!({"count": {"Err": "the engine's queue is full; retry"}})
        );
        let back: KvReply = serde_json::from_value(v).expect("reads back");
        assert!(matches!(
            back,
            KvReply::Count(Err(KvAccessError::Remote(m))) if m == "the engine's queue is full; retry"
        ));
    }
}
