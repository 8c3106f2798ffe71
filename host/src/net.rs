//! What every listening process shares: accepting connections until shutdown, bounding what
//! one peer address holds at once ([`PerPeer`]) and what all of them hold ([`Conns`]), and the
//! shutdown signal itself.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;

/// The next connection, or `None` once `stop` resolves. An accept error (out of descriptors,
/// say) backs off instead of spinning.
pub async fn accept<F: std::future::Future<Output = ()>>(
    listener: &TcpListener,
    mut stop: std::pin::Pin<&mut F>,
) -> Option<(tokio::net::TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => return Some(a),
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = &mut stop => return None,
        }
    }
}

/// Resolves at SIGTERM or SIGINT (never, where the handlers cannot be set).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        // Without signal handlers, run until killed.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Connections (or handshakes) in progress by peer address, at most `max` for each: one peer
/// cannot take every slot of a listener.
#[derive(Debug)]
pub struct PerPeer {
    max: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One of a peer's slots: given back when dropped.
#[derive(Debug)]
pub struct PeerSlot {
    of: Arc<PerPeer>,
    ip: IpAddr,
}

impl PerPeer {
    /// A limiter of `max` slots per peer address.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for `ip`, unless it holds `max` already.
    pub fn try_take(self: &Arc<Self>, ip: IpAddr) -> Option<PeerSlot> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(PeerSlot { of: self.clone(), ip })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.of.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// A listener's open connections: at most `max` in all and `per_peer` from one address. A new
/// connection never waits for a slot: when all are taken, the oldest connection of the address
/// holding the most is closed to make room. Slow peers holding every slot (connections that
/// send nothing) therefore cannot keep out a prober's quick request; they only evict each other.
#[derive(Debug)]
pub struct Conns {
    max: usize,
    per_peer: usize,
    state: Mutex<ConnsState>,
}

#[derive(Debug, Default)]
struct ConnsState {
    next: u64,
    /// By age (ids only grow): each connection's address and what closes it.
    live: std::collections::BTreeMap<u64, (IpAddr, tokio::sync::oneshot::Sender<()>)>,
    per_ip: HashMap<IpAddr, usize>,
}

/// One open connection's slot, given back when dropped. Serve the connection until
/// [`evicted`](ConnSlot::evicted) resolves, then drop it.
#[derive(Debug)]
pub struct ConnSlot {
    of: Arc<Conns>,
    id: u64,
    ip: IpAddr,
    close: tokio::sync::oneshot::Receiver<()>,
}

impl ConnSlot {
    /// Resolves when the connection must close to make room for a newer one.
    pub async fn evicted(&mut self) {
        let _ = (&mut self.close).await;
    }
}

impl Conns {
    /// A table of `max` connections, `per_peer` from one address.
    pub fn new(max: usize, per_peer: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            per_peer: per_peer.max(1),
            state: Mutex::new(ConnsState::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ConnsState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for a connection from `ip`, closing the oldest connection of the address holding
    /// the most when all are taken; `None` when `ip` holds `per_peer` already.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<ConnSlot> {
        let mut s = self.lock();
        if s.per_ip.get(&ip).copied().unwrap_or(0) >= self.per_peer {
            return None;
        }
        if s.live.len() >= self.max {
            let heaviest = s.per_ip.iter().max_by_key(|&(_, &n)| n).map(|(&ip, _)| ip);
            let oldest = s
                .live
                .iter()
                .find(|(_, (i, _))| Some(*i) == heaviest)
                .map(|(&id, _)| id);
            if let Some(id) = oldest
                && let Some((victim, close)) = s.live.remove(&id)
            {
                let _ = close.send(());
                s.forget(victim);
            }
        }
        let id = s.next;
        s.next += 1;
        let (tx, rx) = tokio::sync::oneshot::channel();
        s.live.insert(id, (ip, tx));
        *s.per_ip.entry(ip).or_insert(0) += 1;
        Some(ConnSlot {
            of: self.clone(),
            id,
            ip,
            close: rx,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.lock().live.len()
    }
}

impl ConnsState {
    fn forget(&mut self, ip: IpAddr) {
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        let mut s = self.of.lock();
        // An evicted connection's count went with its eviction.
        if s.live.remove(&self.id).is_some() {
            s.forget(self.ip);
        }
    }
}

/// A block of addresses, as `10.0.0.0/8` or `fd00::/8` (one address alone: itself), for the
/// configuration's trusted proxies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub struct IpBlock {
    net: IpAddr,
    prefix: u8,
}

impl IpBlock {
    /// Whether `ip` is in the block (an IPv4 address mapped into IPv6 counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// Text that is not an address or a block of them.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0:?} is not an address or a block (10.0.0.0/8, fd00::/8)")]
pub struct BadIpBlock(String);

impl TryFrom<String> for IpBlock {
    type Error = BadIpBlock;

    fn try_from(s: String) -> Result<Self, BadIpBlock> {
        let bad = || BadIpBlock(s.clone());
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.as_str(), None),
        };
        let net: IpAddr = addr.parse().map_err(|_| bad())?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p.parse::<u8>().ok().filter(|&p| p <= max).ok_or_else(bad)?,
        };
        Ok(Self { net, prefix })
    }
}

impl std::fmt::Display for IpBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.net, self.prefix)
    }
}

/// The client's address of a request that came from `peer` with `x-forwarded-for` values
/// `forwarded`: the peer's, unless it is one of `trusted` proxies; then the rightmost address in
/// the header that is not a trusted proxy (the one the proxies saw), walking from the right.
/// An entry that is not an address stops the walk at the last trusted hop.
pub fn client_addr(peer: IpAddr, forwarded: &[&str], trusted: &[IpBlock]) -> IpAddr {
    let is_trusted = |ip: IpAddr| trusted.iter().any(|b| b.contains(ip));
    let mut client = peer;
    if !is_trusted(client) {
        return client;
    }
    for hop in forwarded.iter().rev().flat_map(|v| v.rsplit(',')) {
        let Ok(ip) = hop.trim().parse::<IpAddr>() else {
            return client;
        };
        client = ip;
        if !is_trusted(ip) {
            return ip;
        }
    }
    client
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_table_makes_room_by_closing_the_heaviest_peers_oldest() {
        let c = Conns::new(4, 3);
        let ip = |n: u8| IpAddr::from([10, 0, 0, n]);
        let mut slow: Vec<ConnSlot> = (0..3).map(|_| c.admit(ip(1)).unwrap()).collect();
        assert!(c.admit(ip(1)).is_none(), "a fourth slot for one peer");
        let other = c.admit(ip(2)).unwrap();
        assert_eq!(c.open(), 4);
        // Full: a prober gets in, and the first of the peer holding three is closed.
        let probe = c.admit(ip(3)).expect("a prober never waits");
        assert_eq!(c.open(), 4);
        tokio::time::timeout(Duration::from_secs(1), slow[0].evicted())
            .await
            .expect("the oldest of the heaviest peer was closed");
        for s in &mut slow[1..] {
            assert!(
                tokio::time::timeout(Duration::from_millis(20), s.evicted())
                    .await
                    .is_err(),
                "only one was closed"
            );
        }
        drop(slow);
        drop((other, probe));
        assert_eq!(c.open(), 0);
        assert!(c.lock().per_ip.is_empty(), "nothing kept for peers gone");
    }

    #[test]
    fn a_peer_holds_at_most_its_slots_and_gets_them_back() {
        let p = PerPeer::new(2);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let (s1, s2) = (p.try_take(a).unwrap(), p.try_take(a).unwrap());
        assert!(p.try_take(a).is_none(), "a third slot for one peer");
        assert!(p.try_take(b).is_some(), "another peer is not held back");
        drop(s1);
        let s3 = p.try_take(a).expect("a slot given back");
        drop((s2, s3));
        assert!(p.open.lock().unwrap().is_empty(), "nothing kept for peers gone");
    }

    fn block(s: &str) -> IpBlock {
        IpBlock::try_from(s.to_string()).unwrap()
    }

    #[test]
    fn blocks_hold_their_addresses_and_refuse_bad_text() {
        let b = block("10.1.0.0/16");
        assert!(b.contains("10.1.200.3".parse().unwrap()));
        assert!(!b.contains("10.2.0.1".parse().unwrap()));
        assert!(b.contains("::ffff:10.1.0.9".parse().unwrap()), "an IPv4-mapped address");
        assert!(block("0.0.0.0/0").contains("8.8.8.8".parse().unwrap()));
        assert!(block("fd00::/8").contains("fd12::1".parse().unwrap()));
        assert!(!block("fd00::/8").contains("10.0.0.1".parse().unwrap()));
        assert!(block("192.168.1.1").contains("192.168.1.1".parse().unwrap()));
        assert!(!block("192.168.1.1").contains("192.168.1.2".parse().unwrap()));
        for bad in ["10.0.0.0/33", "10.0.0/8", "x", "::/129", "10.0.0.0/"] {
            assert!(IpBlock::try_from(bad.to_string()).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_client_is_the_first_untrusted_hop_from_the_right() {
        let trusted = [block("10.0.0.0/8")];
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        // Not from a proxy: the header is the client's to forge, and ignored.
        assert_eq!(
            client_addr(ip("203.0.113.5"), &["1.2.3.4"], &trusted),
            ip("203.0.113.5")
        );
        // Through two proxies; the leftmost entry was the client's own claim.
        assert_eq!(
            client_addr(ip("10.0.0.2"), &["6.6.6.6, 198.51.100.7", "10.0.0.9"], &trusted),
            ip("198.51.100.7")
        );
        assert_eq!(client_addr(ip("10.0.0.2"), &[], &trusted), ip("10.0.0.2"));
        assert_eq!(
            client_addr(ip("10.0.0.2"), &["junk, 10.0.0.7"], &trusted),
            ip("10.0.0.7")
        );
        assert_eq!(client_addr(ip("10.0.0.2"), &["1.1.1.1"], &[]), ip("10.0.0.2"));
    }
}
