//! What every listening process shares: accepting connections until shutdown, bounding what
//! one peer address holds at once, and the shutdown signal itself.

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
